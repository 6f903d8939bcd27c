// Row-wise ops (RMSNorm with the residual add, RoPE + KV-cache write, SiLU * up) and one whole Llama
// decoder layer, for activations stored as float32 or bfloat16 (type T, one per call).
//
// Each op treats rows independently with a fixed per-row operation order, so a row's bits depend only
// on that row. The arithmetic is float32; with T = bf16 a value is rounded to bf16 wherever PyTorch's
// bf16 ops round one (after each elementwise op: that is what transformers' bf16 Llama computes), and
// with T = float those roundings are the identity, so the float32 path is the same float operations.
#pragma once

#include <optional>

#include "attention.h"
#include "bitmask.h"
#include "linear.h"
#include "lora.h"
#include "vmath.h"

namespace {

// h[r] = weight * keep(x[r] * (1 / sqrt(mean(x[r]^2) + eps))), x optionally updated first by
// x[r] = keep(x[r] + delta[r]) (in place). transformers' LlamaRMSNorm: normalize in float32, cast to
// the model dtype, then scale in it; the scale is common.h's rms_inv: one vector-lane accumulation of the
// squares, then lanes summed in a fixed order (its bits differ from PyTorch's reduction by rounding only).
template <class T>
void add_rmsnorm_rows(T* x, const T* delta, const T* w, T* h, int64_t rows, int64_t N, float eps) {
  parallel_chunks(rows, row_grain(N), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> xf;   // kept between calls: no malloc and free per call
    if (static_cast<int64_t>(xf.size()) < N) xf.resize(N);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * N;
      if (delta) {
        const T* dr = delta + r * N;
        for (int64_t j = 0; j < N; ++j) store_scalar<T>(xr + j, load_scalar<T>(xr + j) + load_scalar<T>(dr + j));
      }
      for (int64_t j = 0; j < N; ++j) xf[j] = load_scalar<T>(xr + j);
      const float inv = rms_inv(xf.data(), N, eps);
      T* hr = h + r * N;
      for (int64_t j = 0; j < N; ++j) store_scalar<T>(hr + j, load_scalar<T>(w + j) * keep<T>(xf[j] * inv));
    }
  });
}

torch::Tensor add_rmsnorm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  const bool bf = is_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous (T, N)");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be (N,) contiguous in x's dtype");
  torch::Tensor d;
  if (delta.has_value() && delta->defined()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto h = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  if (bf) {
    add_rmsnorm_rows<bf16>(data_of<bf16>(x), d.defined() ? data_of<bf16>(d) : nullptr, data_of<bf16>(weight),
                           data_of<bf16>(h), T, N, e);
  } else {
    add_rmsnorm_rows<float>(x.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr,
                            weight.data_ptr<float>(), h.data_ptr<float>(), T, N, e);
  }
  return h;
}

// RoPE + K/V write for the paged attention's work items [i0, i1) of the rows (attention_parts: item = (row,
// part), `parts` a row; parts 1: whole rows): each item's query heads into q, its KV heads' k (rotated) and v
// into the cache; rope_kv_write_rows is whole rows over the pool's threads.
template <class T>
void rope_kv_write_items(const T* xp, const T* cp, const T* sp, T* kc, T* vc, const int64_t* slots, T* qp, int64_t H,
                         int64_t KVH, int64_t D, int64_t parts, int64_t i0, int64_t i1) {
  const int64_t width = (H + 2 * KVH) * D, G = H / KVH;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t t = item / parts, part = item % parts;
    const int64_t g0 = part * KVH / parts, g1 = (part + 1) * KVH / parts;
    const T* row = xp + t * width;
    const T *c = cp + t * D, *s = sp + t * D;
    for (int64_t h = g0 * G; h < g1 * G; ++h) rope_row(row + h * D, c, s, D, qp + (t * H + h) * D);
    T* kdst = kc + slots[t] * KVH * D;
    T* vdst = vc + slots[t] * KVH * D;
    for (int64_t g = g0; g < g1; ++g) {
      rope_row(row + (H + g) * D, c, s, D, kdst + g * D);
      std::copy(row + (H + KVH + g) * D, row + (H + KVH + g + 1) * D, vdst + g * D);
    }
  }
}

template <class T>
void rope_kv_write_rows(const T* xp, const T* cp, const T* sp, T* kc, T* vc, const int64_t* slots, T* qp,
                        int64_t rows, int64_t H, int64_t KVH, int64_t D) {
  parallel_chunks(rows, row_grain((H + 2 * KVH) * D), [&](int64_t begin, int64_t end) {
    rope_kv_write_items<T>(xp, cp, sp, kc, vc, slots, qp, H, KVH, D, 1, begin, end);
  });
}

// qkv: (T, (H + 2 KVH) D); cos, sin: (T, D); k/v rows go to cache slot slot_mapping[t]; all one dtype
torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t H, int64_t KVH) {
  const bool bf = is_bf16(qkv, "qkv");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "bad qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == dt &&
              v_cache.scalar_type() == dt, "caches must be contiguous, in qkv's dtype");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && k_cache.size(2) == KVH && D % 2 == 0, "qkv/cache shapes mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == dt && sin.scalar_type() == dt,
              "cos/sin must be (T, head_dim) in qkv's dtype");
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == T, "slot_mapping must be (T,) int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  auto q = torch::empty({T, H, D}, qkv.options());
  if (bf) {
    rope_kv_write_rows<bf16>(data_of<bf16>(qkv), data_of<bf16>(cos), data_of<bf16>(sin), data_of<bf16>(k_cache),
                             data_of<bf16>(v_cache), slots, data_of<bf16>(q), T, H, KVH, D);
  } else {
    rope_kv_write_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                              k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots, q.data_ptr<float>(), T, H,
                              KVH, D);
  }
  return q;
}

// silu(gate) * up on gate_up rows (T, 2I) -> (T, I): keep(keep(g / (1 + exp(-g))) * u). Lane j's result
// depends only on g[j], u[j] (vector lanes and the scalar tail are the same per-row split for any T).
// `vector` (AVX-512, where vector_exp_agrees): sixteen lanes at a time with exp16_exact, the same float
// operations and roundings as the scalar loop, so the same bits.
// Measured (1 thread, thread CPU time, one 64 x 1536 call, vector and scalar interleaved in one process):
// float32 0.33 -> 0.08 ms, bfloat16 0.67 -> 0.11 ms (30 layers: 10 and 20 ms of a 64-sequence decode step).
template <class T>
inline void silu_mul_span(const T* g, const T* u, T* o, int64_t n, bool vector) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (vector) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (; j + 16 <= n; j += 16) {
      const __m512 gv = load16<T>(g + j);
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));   // -g, exact
      const __m512 e = exp16_exact(neg);
      const __m512 s = keep16<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
      store16<T>(o + j, _mm512_mul_ps(s, load16<T>(u + j)));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {  // exp256 (~1 ulp) in place of std::exp: same formula, 8 lanes
      const __m256 gv = _mm256_loadu_ps(g + j);
      const __m256 e = exp256(_mm256_sub_ps(zero, gv));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
  }
#endif
  for (; j < n; ++j) {
    const float gj = load_scalar<T>(g + j);
    store_scalar<T>(o + j, keep<T>(gj / (1.f + std::exp(-gj))) * load_scalar<T>(u + j));
  }
}

template <class T>
void silu_mul_rows(const T* gp, T* op, int64_t rows, int64_t I, bool vector) {
  vector = vector && vector_exp_agrees();
  parallel_chunks(rows, row_grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_span<T>(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I, vector);
  });
}

// linear's paired form (linear.h) with silu * up as its store: silu_mul(linear(x, gate_up)) in one pass,
// bitwise (each gate / up value rounded as linear stores it, then silu_mul_span on those values; a panel's
// 32 columns start at a multiple of 32, so its lanes take the same vector / scalar path as in a whole row).
// Saves writing the (T, 2I) gate_up output and reading it back: measured (Zen 5, 2 threads, the demo
// model's prefill of 1882 tokens) silu * up was 37 of 1012 ms. Falls back to the two calls where the form
// cannot pair (I not a whole number of panels, or the AMX form).
struct SiluMul {
  template <class T>
  static void apply(const T* g, const T* u, T* o, int64_t n) { silu_mul_span<T>(g, u, o, n, vector_exp_agrees()); }
};

torch::Tensor silu_mul(torch::Tensor gate_up, bool vector);

inline torch::Tensor linear_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                 c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scale, bool out_bf16,
                                 int64_t form) {
  if (!pairable(packed.scalar_type(), out_features, form)) {
    return silu_mul(linear(x, packed, out_features, bias, scale, out_bf16, form), true);
  }
  return linear_impl<SiluMul>(x, packed, out_features, bias, scale, out_bf16, form);
}

// `vector`: the AVX-512 lanes where they agree with std::exp (the default); false: the scalar loop
// alone, the definition the vector form is tested against (tests/engine/test_kernels.py)
torch::Tensor silu_mul(torch::Tensor gate_up, bool vector) {
  const bool bf = is_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous (T, 2I)");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  if (bf) {
    silu_mul_rows<bf16>(data_of<bf16>(gate_up), data_of<bf16>(out), T, I, vector);
  } else {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), T, I, vector);
  }
  return out;
}

// One decoder layer's weights: norms in x's dtype; linears packed panels of any kind (linear.h), `*_s`
// the int8 kinds' scales and `*_b` the biases (each empty where there is none).
struct LayerWeights {
  using Opt = c10::optional<torch::Tensor>;
  torch::Tensor in_norm, qkv_w;
  Opt qkv_s, qkv_b;
  torch::Tensor o_w;
  Opt o_s, o_b;
  torch::Tensor post_norm, gu_w;
  Opt gu_s, gu_b;
  torch::Tensor down_w;
  Opt down_s, down_b;
};

// A step's intermediate tensors, made once by DecoderStack::forward and reused by every layer (each op
// used to make its output tensor: 8 a layer, 240 a demo-model step, each a posix_memalign and a free,
// which with the caches cold from the weights' stream cost more than the op itself at batch 1).
// T rows, x's dtype: h (T, hidden) a norm's output; qkv (T, (H + 2 KVH) D); q and attn (T, H, D); delta
// (T, hidden) the o and then the down linear's output (each consumed by the next norm before the next
// linear writes it); act (T, intermediate) silu(gate) * up. Bits: the same operations as the ops' own outputs.
struct Workspace {
  torch::Tensor h, qkv, q, attn, attn_rows, delta, act;   // attn_rows: attn as (T, H D)
  Workspace(const torch::Tensor& x, int64_t H, int64_t KVH, int64_t D, int64_t intermediate) {
    const int64_t T = x.size(0);
    auto opt = x.options();
    h = torch::empty_like(x);
    qkv = torch::empty({T, (H + 2 * KVH) * D}, opt);
    q = torch::empty({T, H, D}, opt);
    attn = torch::empty({T, H, D}, opt);
    attn_rows = attn.view({T, H * D});
    delta = torch::empty_like(x);
    act = torch::empty({T, intermediate}, opt);
  }
};

// x (T, N) += delta (when given, in place); ws.h = weight * rmsnorm(x) (add_rmsnorm's operations)
template <class T>
inline void add_rmsnorm_into(torch::Tensor& x, const torch::Tensor* delta, const torch::Tensor& weight, double eps,
                             torch::Tensor& h) {
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be (N,) contiguous in x's dtype");
  add_rmsnorm_rows<T>(data_of<T>(x), delta ? data_of<T>(*delta) : nullptr, data_of<T>(weight), data_of<T>(h), x.size(0),
                      x.size(1), static_cast<float>(eps));
}

// The per-step inputs every layer shares (DecoderStack::forward's), checked once a step
struct StepInputs {
  torch::Tensor cos, sin, slot_mapping;
  const AttentionPlan& plan;
  int64_t H, KVH, intermediate;
  double eps, scale;
  int64_t bf16_form;   // linear's form for bf16 panels (Bf16Form)
};

// One Llama decoder layer on the residual stream x (T, hidden), float32 or bfloat16, in place:
//   x += delta (the previous layer's down output, when `add_delta`); h = rmsnorm(x) -> qkv linear -> rope +
//   KV write -> paged attention -> o linear; x += o; h = rmsnorm(x) -> gate_up linear with silu * up -> down.
// Leaves the down output in ws.delta: the next layer's first norm (or the final norm) adds it to x, as
// forward.py's walk does, so x is read and written once a layer less (the same operations as adding it here).
// Every stage is one of the row-invariant ops above (their functions, into the workspace's tensors), so the
// layer is too, and bitwise the ops called one by one. Linears write x's dtype.
// A step's LoRA adapters for the stack (DecoderStack::forward_lora): the set's stacks and the step's rows by slot.
struct LoraStep {
  const LoraSet& set;
  const LoraRows& rows;
  size_t layer;   // the layer being run
};

template <class T>
inline void layer_forward(torch::Tensor& x, bool add_delta, const LayerWeights& l, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const StepInputs& in, Workspace& ws,
                          const LoraStep* lora = nullptr) {
  constexpr bool bf = std::is_same_v<T, bf16>;
  const int64_t T_rows = x.size(0), N = x.size(1), D = k_cache.size(3), H = in.H, KVH = in.KVH;
  add_rmsnorm_into<T>(x, add_delta ? &ws.delta : nullptr, l.in_norm, in.eps, ws.h);
  linear_impl<void>(ws.h, l.qkv_w, (H + 2 * KVH) * D, l.qkv_b, l.qkv_s, bf, in.bf16_form, &ws.qkv);
  if (lora) lora->set.add<T>(ws.h, ws.qkv, lora->rows, lora->layer, 0);
  rope_kv_write_rows<T>(data_of<T>(ws.qkv), data_of<T>(in.cos), data_of<T>(in.sin), data_of<T>(k_cache),
                        data_of<T>(v_cache), in.slot_mapping.data_ptr<int64_t>(), data_of<T>(ws.q), T_rows, H, KVH, D);
  paged_attention_into(ws.q, k_cache, v_cache, in.plan, in.scale, ws.attn);
  linear_impl<void>(ws.attn_rows, l.o_w, N, l.o_b, l.o_s, bf, in.bf16_form, &ws.delta);
  if (lora) lora->set.add<T>(ws.attn_rows, ws.delta, lora->rows, lora->layer, 1);
  add_rmsnorm_into<T>(x, &ws.delta, l.post_norm, in.eps, ws.h);
  if (lora && lora->set.has(lora->layer, 2)) {
    // the gate_up term goes in before silu * up: the linear's output whole, then silu_mul (the paired form is
    // bitwise these two, so rows without an adapter keep their bits)
    torch::Tensor gate_up = linear(ws.h, l.gu_w, 2 * in.intermediate, l.gu_b, l.gu_s, bf, in.bf16_form);
    lora->set.add<T>(ws.h, gate_up, lora->rows, lora->layer, 2);
    silu_mul_rows<T>(data_of<T>(gate_up), data_of<T>(ws.act), T_rows, in.intermediate, true);
  } else if (pairable(l.gu_w.scalar_type(), 2 * in.intermediate, in.bf16_form)) {
    linear_impl<SiluMul>(ws.h, l.gu_w, 2 * in.intermediate, l.gu_b, l.gu_s, bf, in.bf16_form, &ws.act);
  } else {
    ws.act.copy_(silu_mul(linear(ws.h, l.gu_w, 2 * in.intermediate, l.gu_b, l.gu_s, bf, in.bf16_form), true));
  }
  linear_impl<void>(ws.act, l.down_w, N, l.down_b, l.down_s, bf, in.bf16_form, &ws.delta);
  if (lora) lora->set.add<T>(ws.act, ws.delta, lora->rows, lora->layer, 3);
}

// The whole decoder stack and the final norm, held once (the weights' tensors, not copies): one call a
// step in place of one call per layer, so a decode step converts its arguments once, not 28 per layer
// (bitwise the layers' ops called one by one: test_the_walk_is_bitwise_the_fused_stack_through_the_runner). Built
// by backends/cpp.py's DecoderStack at load.
struct DecoderStack {
  std::vector<LayerWeights> layers;
  torch::Tensor norm;
  int64_t H, KVH, intermediate;
  double eps, norm_eps, scale;

  // layers[l]: 14 tensors or None, in LayerWeights' order (in_norm, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b,
  // post_norm, gu_w, gu_s, gu_b, down_w, down_s, down_b)
  DecoderStack(const std::vector<std::vector<c10::optional<torch::Tensor>>>& ls, torch::Tensor norm_w, int64_t H_,
               int64_t KVH_, int64_t intermediate_, double eps_, double norm_eps_, double scale_)
      : norm(norm_w), H(H_), KVH(KVH_), intermediate(intermediate_), eps(eps_), norm_eps(norm_eps_), scale(scale_) {
    for (const auto& t : ls) {
      TORCH_CHECK(t.size() == 14, "a layer is 14 tensors (or None)");
      TORCH_CHECK(t[0] && t[1] && t[4] && t[7] && t[8] && t[11], "norms and linear panels are required");
      // biases held as float32 (exact), the form linear converts them to at every call otherwise
      auto f32 = [](const c10::optional<torch::Tensor>& b) -> c10::optional<torch::Tensor> {
        if (!b.has_value() || !b->defined()) return b;
        return b->to(torch::kFloat32).contiguous();
      };
      layers.push_back({*t[0], *t[1], t[2], f32(t[3]), *t[4], t[5], f32(t[6]), *t[7], *t[8], t[9], f32(t[10]), *t[11],
                        t[12], f32(t[13])});
    }
  }

  // x: (T, hidden) float32 or bfloat16 (not changed); cos, sin: (T, head_dim); k_caches[l], v_caches[l]:
  // layer l's cache; the attention metadata as paged_attention's. Returns the final-norm hidden states (T, hidden).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor context_lens, torch::Tensor cu_seqlens_q, int64_t bf16_form) const {
    return forward_impl(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, cu_seqlens_q,
                        bf16_form, nullptr, torch::Tensor());
  }

  // forward with a step's LoRA adapters: `lora` the adapter set's stacks (LoraSet, one per set), row_slot (T,)
  // int64 each row's slot in it (-1 = the base). Each layer adds the rows' terms after its qkv, o, gate_up (before
  // silu * up) and down linears (lora.h: row-wise, so the stack stays batch-invariant); rows of the base keep
  // forward's bits.
  torch::Tensor forward_lora(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                             const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                             torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                             torch::Tensor cu_seqlens_q, int64_t bf16_form, const LoraSet& lora,
                             torch::Tensor row_slot) const {
    TORCH_CHECK(lora.layers.size() == layers.size(), "the LoRA set has ", lora.layers.size(), " layers, the stack ",
                layers.size());
    return forward_impl(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, cu_seqlens_q,
                        bf16_form, &lora, row_slot);
  }

  torch::Tensor forward_impl(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                             const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                             torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                             torch::Tensor cu_seqlens_q, int64_t bf16_form, const LoraSet* lora,
                             const torch::Tensor& row_slot) const {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "one K and V cache per layer");
    const bool bf = is_bf16(x, "x");
    TORCH_CHECK(x.dim() == 2 && !layers.empty(), "x must be (T, hidden) and the stack have a layer");
    torch::Tensor h = x.contiguous().clone();        // the residual stream, updated in place by every layer
    const int64_t T = h.size(0), D = k_caches[0].size(3);
    TORCH_CHECK(k_caches[0].dim() == 4 && H % KVH == 0 && D % 2 == 0, "bad cache or head shapes");
    // the step's inputs, checked once for every layer (rope_kv_write's and paged_attention's checks)
    cos = cos.contiguous();
    sin = sin.contiguous();
    TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == h.scalar_type() &&
                sin.scalar_type() == h.scalar_type(), "cos/sin must be (T, head_dim) in x's dtype");
    slot_mapping = slot_mapping.contiguous();
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == T, "slot_mapping must be (T,) int64");
    const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    for (size_t l = 0; l < layers.size(); ++l) {   // every layer's caches, once for both paths
      const torch::Tensor &k = k_caches[l], &v = v_caches[l];
      TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.scalar_type() == h.scalar_type() &&
                  v.scalar_type() == h.scalar_type() && k.size(2) == KVH && k.size(3) == D && v.sizes() == k.sizes() &&
                  k.size(0) * k.size(1) == num_slots,
                  "caches must be contiguous (blocks, BS, KVH, D) in x's dtype, every layer's the same size");
    }
    const AttentionPlan plan(T, k_caches[0].size(1), block_tables, context_lens, cu_seqlens_q);
    const StepInputs in{cos, sin, slot_mapping, plan, H, KVH, intermediate, eps, scale, bf16_form};
    TORCH_CHECK(layers[0].qkv_w.dim() == 3, "bad packed qkv");
    Workspace ws(h, H, KVH, D, intermediate);
    const LoraRows lora_rows = lora ? LoraRows(row_slot, T, lora->num_slots()) : LoraRows();
    const LoraSet* lo = lora && !lora_rows.empty() ? lora : nullptr;   // null: no row has an adapter
    for (size_t l = 0; l < layers.size(); ++l) {
      std::optional<LoraStep> step;
      const LoraStep* layer_lora = lo ? &step.emplace(LoraStep{*lo, lora_rows, l}) : nullptr;
      if (bf) {
        layer_forward<bf16>(h, l > 0, layers[l], k_caches[l], v_caches[l], in, ws, layer_lora);
      } else {
        layer_forward<float>(h, l > 0, layers[l], k_caches[l], v_caches[l], in, ws, layer_lora);
      }
    }
    return add_rmsnorm(h, ws.delta, norm, norm_eps);   // the last down output, then the final norm
  }
};

}  // namespace
