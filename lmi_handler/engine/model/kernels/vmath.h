// Vector forms of scalar math that must keep the scalar code's bits: expf as glibc computes it (the
// scalar std::exp the row-wise ops were written with), bf16 rounding as float_to_bf16, and a row argmax
// as torch.argmax picks it. AVX-512 only; every caller keeps its scalar loop for other CPUs and for lanes
// the vector form does not cover.
#pragma once

#include "common.h"

namespace {

#if defined(__AVX512F__)
// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the algorithm of Szabolcs Nagy's optimized-routines,
// built with FMA on x86-64 CPUs that have it): in double, x * 32 / ln2 = k + r, exp(x) = 2^(k/32) * p(r)
// with a 32-entry table of 2^(i/32) and a cubic, one rounding to float at the end. Written from the
// published algorithm, not copied. The table below is tab[i] = bits(2^(i/32) rounded to double) - i << 47.
// Checked against this machine's std::exp on every float with |x| < 88 (2^31.06 inputs, all bitwise
// equal; the same code without the two FMAs glibc's FMA build forms for k and r differs on 2 of them);
// vector_exp_agrees() repeats a sampled check at run time, so a libm that computes otherwise keeps the
// scalar path. Lanes with |x| >= 88 (overflow, underflow, inf, NaN) are glibc's special cases:
// exp16_exact sends those through std::exp (exp16_special says which).
alignas(64) constexpr uint64_t EXP2_TABLE[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

inline __m256 exp8_glibc(__m256 xf) {
  const __m512d xd = _mm512_cvtps_pd(xf);
  const __m512d inv = _mm512_set1_pd(0x1.71547652b82fep+0 * 32), shift = _mm512_set1_pd(0x1.8p+52);
  __m512d kd = _mm512_fmadd_pd(inv, xd, shift);             // k + shift: the integer k in the low bits
  const __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  const __m512d r = _mm512_fmsub_pd(inv, xd, kd);            // x * 32 / ln2 - k
  const double* tab = reinterpret_cast<const double*>(EXP2_TABLE);
  const __m512d lo = _mm512_permutex2var_pd(_mm512_load_pd(tab), ki, _mm512_load_pd(tab + 8));
  const __m512d hi = _mm512_permutex2var_pd(_mm512_load_pd(tab + 16), ki, _mm512_load_pd(tab + 24));
  const __m512i t = _mm512_castpd_si512(_mm512_mask_blend_pd(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), lo, hi));
  const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));   // 2^(k/32)
  const __m512d c0 = _mm512_set1_pd(0x1.c6af84b912394p-5 / 32 / 32 / 32);
  const __m512d c1 = _mm512_set1_pd(0x1.ebfce50fac4f3p-3 / 32 / 32), c2 = _mm512_set1_pd(0x1.62e42ff0c52d6p-1 / 32);
  const __m512d z = _mm512_fmadd_pd(c0, r, c1);
  __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
  return _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
}

inline __m512 exp16_glibc(__m512 x) {
  const __m256 a = exp8_glibc(_mm512_castps512_ps256(x)), b = exp8_glibc(_mm512_extractf32x8_ps(x, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

// lanes glibc's expf sends to its special cases: |x| >= 88 by the top 12 bits, inf, NaN
inline __mmask16 exp16_special(__m512 x) {
  const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
  return _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(0x42b));
}

// std::exp's bits in every lane (where vector_exp_agrees): exp16_glibc, and its special lanes (exp16_special)
// through std::exp one by one. Always inlined, as the code it replaced was written in its callers (silu_mul_span,
// gelu_tanh_mul_span): a plain `inline` changed GCC's inlining around them (packed_gemm's silu * up store).
__attribute__((always_inline)) inline __m512 exp16_exact(__m512 x) {
  __m512 e = exp16_glibc(x);
  if (const __mmask16 special = exp16_special(x)) {
    alignas(64) float xv[16], ev[16];
    _mm512_store_ps(xv, x);
    _mm512_store_ps(ev, e);
    for (int l = 0; l < 16; ++l)
      if (special >> l & 1) ev[l] = std::exp(xv[l]);
    e = _mm512_load_ps(ev);
  }
  return e;
}

// float_to_bf16 on 16 lanes (round to nearest even, NaN -> 0x7FC0), as 16-bit values in 32-bit lanes
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// round_bf16 on 16 lanes: the value a bf16 holds, as floats
inline __m512 round_bf16_16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

// 16 values of T as floats (exact), and stored with store_scalar's rounding
template <class T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<bf16>(const bf16* p) { return Vec::load_bf16(p).v; }
template <class T> inline void store16(T* p, __m512 v);
template <> inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <> inline void store16<bf16>(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
template <class T> inline __m512 keep16(__m512 v) { return v; }
template <> inline __m512 keep16<bf16>(__m512 v) { return round_bf16_16(v); }

// Whether exp16_glibc gives std::exp's bits on this machine: every 4093rd float bit pattern with
// |x| < 88 (about a million inputs, a few ms), checked once.
inline bool vector_exp_agrees() {
  static const bool agrees = [] {
    alignas(64) float in[16], out[16];
    int n = 0;
    for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4093) {
      const uint32_t bits = static_cast<uint32_t>(b);
      if (((bits >> 20) & 0x7ff) >= 0x42b) continue;
      std::memcpy(&in[n++], &bits, 4);
      if (n < 16) continue;
      _mm512_store_ps(out, exp16_glibc(_mm512_load_ps(in)));
      for (int i = 0; i < 16; ++i) {
        const float ref = std::exp(in[i]);
        if (std::memcmp(&ref, &out[i], 4) != 0) return false;
      }
      n = 0;
    }
    return true;
  }();
  return agrees;
}
#else
inline bool vector_exp_agrees() { return false; }
#endif

// torch.argmax's pick over one row of n >= 1 floats: the first index of the largest value, any NaN
// counting as the largest (the first NaN wins); -0 and +0 tie (the first wins)
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t j = 0;
  float best = -INFINITY;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  best = _mm512_reduce_max_ps(mx);
  for (int64_t i = j; i < n; ++i) {
    if (std::isnan(x[i])) nan = 1;
    best = std::max(best, x[i]);
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  const __m512 b = _mm512_set1_ps(best);
  for (j = 0; j + 16 <= n; j += 16)
    if (const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), b, _CMP_EQ_OQ)) return j + __builtin_ctz(k);
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return n - 1;   // not reached: some element equals the max
#else
  int64_t arg = 0;
  best = x[0];
  if (std::isnan(best)) return 0;
  for (j = 1; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > best) best = x[j], arg = j;
  }
  return arg;
#endif
}

// (N, V) float32 -> (N,) int64: argmax_row of each row (rows shared over the threads: integer outputs,
// so how they are split changes nothing)
torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0, "x must be (N, V > 0) float32");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_chunks(N, chunk_for(N, 1), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// sampler.greedy_sample's tensors in one call: (ids (N,) int64 = row_argmax(x), logprobs (N, V) float32 =
// at::log_softmax(x, -1) (torch.log_softmax's kernel, so its bits), chosen (N,) float32 = logprobs[r, ids[r]]).
// x: (N, V > 0) float32. The Python form was four dispatcher calls a step, each costing more than its work at
// batch 1 with the caches cold from the weights' stream.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> greedy_pick(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0, "x must be (N, V > 0) float32");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto ids = torch::empty({N}, x.options().dtype(torch::kInt64));
  auto logprobs = torch::empty_like(x);
  auto chosen = torch::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* lp = logprobs.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* cp = chosen.data_ptr<float>();
  // each thread its own rows, whole: the argmax, then torch's log_softmax kernel on those rows (run serially
  // inside the region; a row's log-probs do not depend on the rows beside it, tested), then the chosen ones.
  // (torch's own log_softmax over the 64 x 49152 logits of a decode step took longer on 2 threads than on 1
  // here: 3.5 against 2.5 ms, AMD Zen 4.)
  parallel_chunks(N, chunk_for(N, 1), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ip[r] = argmax_row(xp + r * V, V);
    auto rows = logprobs.narrow(0, begin, end - begin);
    at::_log_softmax_out(rows, x.narrow(0, begin, end - begin), 1, false);
    for (int64_t r = begin; r < end; ++r) cp[r] = lp[r * V + ip[r]];
  });
  return {ids, logprobs, chosen};
}

// stopping.token_stop_reasons in one pass over a few rows (its tensor ops are ~8 dispatcher calls a step,
// each costing more than the arithmetic when the caches are cold from the weights' stream). Same codes:
// token_ids (B,) int64; stop_ids (B, S) int64 padded with -1; num_output_tokens, max_new_tokens (B,) int64;
// is_eos (B, S) bool or absent (every stop id counts as eos). Returns (B,) int8: 0 go on, 1 eos, 2 length,
// 3 a user stop id; an eos hit wins over a stop id, a stop id over length.
torch::Tensor stop_reasons(torch::Tensor token_ids, torch::Tensor stop_ids, torch::Tensor num_output_tokens,
                           torch::Tensor max_new_tokens, c10::optional<torch::Tensor> is_eos) {
  token_ids = token_ids.contiguous();
  stop_ids = stop_ids.contiguous();
  num_output_tokens = num_output_tokens.contiguous();
  max_new_tokens = max_new_tokens.contiguous();
  const int64_t B = token_ids.numel();
  TORCH_CHECK(token_ids.scalar_type() == torch::kInt64 && stop_ids.scalar_type() == torch::kInt64 &&
              num_output_tokens.scalar_type() == torch::kInt64 && max_new_tokens.scalar_type() == torch::kInt64,
              "token ids, stop ids and counts must be int64");
  TORCH_CHECK(stop_ids.dim() == 2 && stop_ids.size(0) == B && num_output_tokens.numel() == B &&
              max_new_tokens.numel() == B, "stop_ids must be (B, S), the counts (B,)");
  const int64_t S = stop_ids.size(1);
  torch::Tensor eos;
  if (is_eos.has_value() && is_eos->defined()) {
    eos = is_eos->contiguous();
    TORCH_CHECK(eos.scalar_type() == torch::kBool && eos.sizes() == stop_ids.sizes(), "is_eos must be (B, S) bool");
  }
  auto out = torch::empty({B}, token_ids.options().dtype(torch::kInt8));
  const int64_t *tok = token_ids.data_ptr<int64_t>(), *ids = stop_ids.data_ptr<int64_t>();
  const int64_t *n = num_output_tokens.data_ptr<int64_t>(), *mx = max_new_tokens.data_ptr<int64_t>();
  const bool* ep = eos.defined() ? eos.data_ptr<bool>() : nullptr;
  int8_t* op = out.data_ptr<int8_t>();
  for (int64_t b = 0; b < B; ++b) {
    bool eos_hit = false, stop_hit = false;
    for (int64_t j = 0; j < S; ++j) {
      if (ids[b * S + j] != tok[b]) continue;
      if (!ep || ep[b * S + j]) eos_hit = true; else stop_hit = true;
    }
    op[b] = eos_hit ? 1 : stop_hit ? 3 : n[b] >= mx[b] ? 2 : 0;
  }
  return out;
}

}  // namespace
