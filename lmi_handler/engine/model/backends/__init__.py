"""Kernel backends: each offers the same ops, with the same signatures and semantics, and
engine/model/backend.py picks one at load (option.kernel_backend). torch_ref.py is the pure-PyTorch
reference every other backend is tested against; triton/ holds the Triton kernels (CUDA, and CPU tensors
under TRITON_INTERPRET=1 for tests); cpp.py the C++ CPU kernels, op by op, and the fused C++ decoder stack as
its whole-stack operation. forward.DecoderModel is the one walk that calls them.

The ops (row-wise ops compute each row independently of the others, for batch invariance; reductions
accumulate in float32):

- store_kv(k_cache, v_cache, k, v, slot_mapping) -> None. Caches (num_blocks, block_size, num_kv_heads,
  head_dim); k, v (T, num_kv_heads, head_dim); slot_mapping (T,) int64 = block_id * block_size + offset; a slot
  of -1 (a padding row) writes nothing.
- paged_attention(q, k_cache, v_cache, meta, scale, window=None, softcap=None, sinks=None) -> (T, num_heads,
  head_dim). sinks (num_heads,) (gpt-oss): head h's learned logit joins each row's softmax denominator and
  attends to nothing.
  Row j of sequence i sits at p = context_lens[i] - query_lens[i] + j and attends causally to cache positions
  [max(0, p - window + 1), p] (transformers' sliding-window mask); GQA: query head h reads KV head
  h // (num_heads // num_kv_heads); softcap (Gemma 2): scores = softcap * tanh(scores / softcap). The KV is
  walked in fixed tiles aligned to absolute positions, never a split that depends on the batch.
- linear(x (T, K), weight (N, K), bias (N,) | None, out_dtype=None) -> (T, N) in out_dtype (default x's): one
  reduction order over K whatever T is (float32 out_dtype: the tensor-parallel partials and the logits).
- rms_norm(x, weight, eps, residual=None, weight_offset=0.0, weight_in_float=True) -> (out, residual_out):
  h = x + residual (or x), n = h * rsqrt(mean(h^2) + eps) in float32; out = n * (weight_offset + weight) in
  float32 cast once to x's dtype (Gemma: weight_offset 1.0; OLMo-2), or with weight_in_float False n cast to
  x's dtype first and then times the weight (transformers' LlamaRMSNorm); residual_out = h (a backend may
  write it into x: the walk owns x). torch_ref.rms_norm is the one description.
- rope(x (T, H, D), cos (T, D), sin (T, D)) -> x * cos + rotate_half(x) * sin (HF's convention).
- act_mul(gate_up (T, 2I), act "silu" | "gelu_tanh") -> act(gate) * up, (T, I).
- lora_add(y, x, lora, layer, module, num_layers) -> y + each row's LoRA term of that projection (a LoraBatch;
  may add in place into y, a fresh projection output): the one place a backend applies adapters.
- moe_experts(x (T, hidden), ids (T, K) int64, weights (T, K) float32, w: moe.MoeWeights, spec: MoeSpec | None)
  -> (T, hidden) in x's dtype: token t's sum over its ranks k, in rank order and in float32, of weights[t, k]
  times SwiGLU expert ids[t, k] applied to x[t] (that expert's output rounded to x's dtype first), rounded once;
  each expert's rows grouped, never an expert no token chose read; the experts' biases where w has them and
  spec.activation's activation (gpt-oss's clamped SwiGLU: clamped_swiglu(gate_up, alpha, limit), an op of the
  torch and cpp backends). torch_ref.moe_experts is the definition.
- decoder_stack(spec, layers, final_norm, num_heads, num_kv_heads) -> a whole-stack operation for that spec
  (called as stack(x, cos, sin, kv_caches, meta, lora) -> final-norm hidden states), or None: the walk.
- log_softmax(logits) -> (S, V) float32; greedy(logits) -> (S,) int64, the lowest index on ties.
- Triton also: seeded_sample(logprobs, seeds, positions) -> (S,) int64, engine/sampler.py's exponential race
  with the same hash of (seed, position, token).
"""
