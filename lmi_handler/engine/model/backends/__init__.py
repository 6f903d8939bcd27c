"""Kernel backends: each offers the ops of the backend interface (/work/wt/INTERFACE.md: store_kv,
paged_attention, linear, rms_norm, rope, act_mul, log_softmax, greedy) with the same signatures.
torch_ref.py is the pure-PyTorch reference every other backend is tested against; triton/ holds the Triton
kernels; the C++ CPU kernels run as today's Llama path (llama.py). engine/model/backend.py picks one at load."""
