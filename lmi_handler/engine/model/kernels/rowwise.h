// Row-wise ops (RMSNorm with the residual add, RoPE + KV-cache write, SiLU * up), which the fused decoder
// stack (decoder_stack.h) chains, for activations stored as float32 or bfloat16 (type T, one per call).
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

}  // namespace
