"""Kernel backends: each offers the same ops, with the same signatures and semantics, and
engine/model/backend.py picks one at load (option.kernel_backend). torch_ref.py is the pure-PyTorch
reference every other backend is tested against; triton/ holds the Triton kernels (CUDA, and CPU tensors
under TRITON_INTERPRET=1 for tests); cpp.py the C++ CPU kernels, op by op, for the families the fused C++
Llama path (llama.py) does not run.

The ops (row-wise ops compute each row independently of the others, for batch invariance; reductions
accumulate in float32):

- store_kv(k_cache, v_cache, k, v, slot_mapping) -> None. Caches (num_blocks, block_size, num_kv_heads,
  head_dim); k, v (T, num_kv_heads, head_dim); slot_mapping (T,) int64 = block_id * block_size + offset; a slot
  of -1 (a padding row) writes nothing.
- paged_attention(q, k_cache, v_cache, meta, scale, window=None, softcap=None) -> (T, num_heads, head_dim).
  Row j of sequence i sits at p = context_lens[i] - query_lens[i] + j and attends causally to cache positions
  [max(0, p - window + 1), p] (transformers' sliding-window mask); GQA: query head h reads KV head
  h // (num_heads // num_kv_heads); softcap (Gemma 2): scores = softcap * tanh(scores / softcap). The KV is
  walked in fixed tiles aligned to absolute positions, never a split that depends on the batch.
- linear(x (T, K), weight (N, K), bias (N,) | None) -> (T, N): one reduction order over K whatever T is.
- rms_norm(x, weight, eps, residual=None, weight_offset=0.0) -> (out, residual_out): h = x + residual (or x),
  out = h * rsqrt(mean(h^2) + eps) * (weight_offset + weight) in float32, cast to x's dtype; residual_out = h
  (Gemma: weight_offset 1.0).
- rope(x (T, H, D), cos (T, D), sin (T, D)) -> x * cos + rotate_half(x) * sin (HF's convention).
- act_mul(gate_up (T, 2I), act "silu" | "gelu_tanh") -> act(gate) * up, (T, I).
- log_softmax(logits) -> (S, V) float32; greedy(logits) -> (S,) int64, the lowest index on ties.
- Triton also: seeded_sample(logprobs, seeds, positions) -> (S,) int64, engine/sampler.py's exponential race
  with the same hash of (seed, position, token).
"""
