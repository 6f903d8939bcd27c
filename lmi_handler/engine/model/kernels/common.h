// Shared pieces of the batch-invariant CPU kernels: the work-sharing loop, one vector of floats
// (AVX-512, AVX2+FMA or scalar), and bfloat16 <-> float32 conversions that round as PyTorch does.
// Included by cpu_kernels.cpp and families.cpp (two translation units); everything lives in an anonymous namespace.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Work items over the kernels' pool (pool.h): a thread the OS has descheduled holds back only the piece it holds,
// and a region ends when its pieces are done. Items write disjoint outputs, so which thread runs one never changes
// its bits. An exception inside an item skips the items not yet started and is re-thrown on the calling thread, as
// at::parallel_for does.
inline int64_t pool_threads() { return lmi_pool::threads(); }

// Items 0..n-1 in pieces of `chunk` items (the last one shorter), f(begin, end) per piece, the pieces handed out
// one at a time in order to whichever thread asks next. Callers size `chunk` for several pieces a thread
// (chunk_for): a static share per thread left one thread waiting whenever the other's share was dearer (longer
// contexts, a busier core; perf showed the main thread spinning in libgomp for 16 % of a 64-sequence decode step).
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  lmi_pool::pool().run(num_chunks, false, [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); });
}

// Items 0..n-1 over the pool's threads, each thread walking a contiguous share of its own in order and, when its
// share is done, taking items one at a time from the back of another thread's share (a share whose thread never
// came, descheduled, is taken whole). For loops that prefetch the item after the one they run (packed_gemm: the
// next panel's first K block): handed out one at a time from one counter, a thread's next item is seldom the next
// one, and the line it prefetched is the other thread's work (measured: a 64-row fp32 decode step's linears scaled
// 1.36-1.70x from 1 to 2 threads, o_proj's 18 panels the worst). f(item) for each item, exactly once.
template <class F>
void parallel_walk(int64_t n, const F& f) {
  lmi_pool::pool().run(n, true, f);
}

// chunk size for n items: about 8 chunks per thread (balance) but never below `min_chunk`
inline int64_t chunk_for(int64_t n, int64_t min_chunk) {
  return std::max<int64_t>(min_chunk, n / (8 * pool_threads()));
}

// ---- bfloat16: the upper 16 bits of a float32 --------------------------------------------------
using bf16 = uint16_t;

inline float bf16_to_float(bf16 h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, so a value rounded here has the
// bits PyTorch's `.to(torch.bfloat16)` gives it (denormals kept, as there)
inline bf16 float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// a float rounded to the nearest bfloat16 and back (the value a bf16 tensor would hold)
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// Activation storage: float (the fp32 model) or bf16 (the bf16 model). `store` rounds once.
template <class T> inline float load_scalar(const T* p);
template <> inline float load_scalar<float>(const float* p) { return *p; }
template <> inline float load_scalar<bf16>(const bf16* p) { return bf16_to_float(*p); }
template <class T> inline void store_scalar(T* p, float v);
template <> inline void store_scalar<float>(float* p, float v) { *p = v; }
template <> inline void store_scalar<bf16>(bf16* p, float v) { *p = float_to_bf16(v); }
// the value a T can hold: identity for float, a bf16 rounding for bf16 (PyTorch's bf16 ops round
// every result to bf16; the fused kernels round at the same points, see rowwise.h)
template <class T> inline float keep(float v) { return v; }
template <> inline float keep<bf16>(float v) { return round_bf16(v); }

// ---- one vector of floats: AVX-512, AVX2+FMA, or a scalar fallback (std::fma keeps the chain) ----
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
  static constexpr int W = 16;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec bcast(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  // W bf16 values widened (exact)
  static Vec load_bf16(const bf16* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16))};
  }
  // W 32-bit words of bf16 pairs (lo, hi): their lo halves / hi halves widened (exact, one op each)
  static Vec pair_lo(__m512i words) { return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16))}; }
  static Vec pair_hi(__m512i words) {
    return {_mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static __m512i load_words(const bf16* p) { return _mm512_loadu_si512(p); }
  // W int8 values as floats (exact)
  static Vec load_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  __m256 v;
  static constexpr int W = 8;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec bcast(float x) { return {_mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  static Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  float sum() const {  // fixed pairwise order
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static Vec load_bf16(const bf16* p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p))), 16))};
  }
  static Vec pair_lo(__m256i words) { return {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16))}; }
  static Vec pair_hi(__m256i words) {
    return {_mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static __m256i load_words(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec load_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
};
#else
struct Vec {
  float v;
  static constexpr int W = 1;
  static Vec zero() { return {0.f}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec bcast(float x) { return {x}; }
  void store(float* p) const { *p = v; }
  static Vec fma(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {a.v + b.v}; }
  static Vec mul(Vec a, Vec b) { return {a.v * b.v}; }
  float sum() const { return v; }
  static Vec load_bf16(const bf16* p) { return {bf16_to_float(*p)}; }
  static Vec pair_lo(uint32_t word) { return {bf16_to_float(static_cast<bf16>(word & 0xFFFFu))}; }
  static Vec pair_hi(uint32_t word) { return {bf16_to_float(static_cast<bf16>(word >> 16))}; }
  static uint32_t load_words(const bf16* p) { return p[0] | (static_cast<uint32_t>(p[1]) << 16); }
  static Vec load_i8(const int8_t* p) { return {static_cast<float>(*p)}; }
};
#endif

template <int LEVEL = 1>   // the cache level the lines go to: 1 (_MM_HINT_T0) or 2 (_MM_HINT_T1)
inline void prefetch_lines(const void* p, int64_t first_line, int64_t last_line) {
  static_assert(LEVEL == 1 || LEVEL == 2, "prefetch to L1 or L2");
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr _mm_hint hint = LEVEL == 1 ? _MM_HINT_T0 : _MM_HINT_T1;
  const char* c = static_cast<const char*>(p);
  for (int64_t l = first_line; l < last_line; ++l) _mm_prefetch(c + l * 64, hint);
#endif
}

// Row-wise ops run on the calling thread when small: `ROW_GRAIN` floats of work per task keeps one
// decode row (a few hundred floats) off the thread pool.
constexpr int64_t ROW_GRAIN = 1 << 15;

inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, ROW_GRAIN / std::max<int64_t>(1, row_len)); }

// RMSNorm's scale 1 / sqrt(mean(x^2) + eps) over n floats: the squares summed in vector lanes, the lanes summed
// in Vec::sum's fixed order, then the scalar tail's squares in order (rowwise.h's add_rmsnorm_rows and
// families.cpp's rms_norm_offset_rows: one sequence of float operations for a row, whatever the rows beside it).
// Always inlined, as the code it replaced was written in those loops (a plain inline moved GCC's code for other
// functions of the unit, e.g. paged_attention_typed's set-up).
__attribute__((always_inline)) inline float rms_inv(const float* x, int64_t n, float eps) {
  Vec acc = Vec::zero();
  int64_t j = 0;
  for (; j + Vec::W <= n; j += Vec::W) {
    const Vec v = Vec::load(x + j);
    acc = Vec::add(acc, Vec::mul(v, v));
  }
  float ss = acc.sum();
  for (; j < n; ++j) ss += x[j] * x[j];
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// Typed data pointers for the activation storage types (bf16 tensors hold c10::BFloat16).
template <class T> inline T* data_of(const torch::Tensor& t);
template <> inline float* data_of<float>(const torch::Tensor& t) { return t.data_ptr<float>(); }
template <> inline bf16* data_of<bf16>(const torch::Tensor& t) {
  return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>());
}

// the activation storage type of a tensor: float32 or bfloat16, else an error naming `what`
inline bool is_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == torch::kBFloat16;
}

// RoPE (rotate-half): out = keep(keep(x * cos) + keep(rotate_half(x) * sin)) elementwise: two products
// then one add, no FMA contraction (each translation unit is built with -ffp-contract=off), the same float
// operations (and, in bf16, roundings) as torch_ref.rope (the fused stack and families.cpp's rope op).
template <class T>
inline void rope_row(const T* x, const T* c, const T* s, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -load_scalar<T>(x + d + half) : load_scalar<T>(x + d - half);
    const float a = keep<T>(load_scalar<T>(x + d) * load_scalar<T>(c + d));
    store_scalar<T>(out + d, a + keep<T>(rot * load_scalar<T>(s + d)));
  }
}

}  // namespace
