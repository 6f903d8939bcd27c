// Batch-invariant CPU kernels (float32): a row-invariant linear over pre-packed weights and a
// paged attention that reads K/V straight from the block cache.
//
// Invariance by construction: every output element is one fixed sequence of float operations
// that reads only its own row's inputs. In the linear, y[m, n] is one FMA chain over k = 0..K-1
// (vector lanes run over n), whatever M is and wherever the row sits. In attention, a query row's
// scores, softmax and weighted sum loop over its own keys 0..pos in order, whatever else is in
// the batch and however its sequence was cut into chunks.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <vector>

#include <cstdlib>
#include <new>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Work items handed out on demand, `chunk` at a time, over torch's OpenMP threads (the same pool where
// torch's wheel ships `libgomp.so.1`, as its CPU wheel does: the loader reuses it; a wheel with a renamed
// libgomp would give this extension a pool of its own). A static split leaves one thread waiting at the barrier whenever the
// other's share is dearer (longer contexts, a busier core): perf showed the main thread spinning in
// libgomp for 16 % of a 64-sequence decode step. Items write disjoint outputs, so which thread runs
// one never changes its bits.
// An exception inside a chunk (e.g. a failed allocation) is caught, the remaining chunks are skipped,
// and the first one is re-thrown on the calling thread, as at::parallel_for does.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_chunks));
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::exception_ptr error;
  std::atomic<bool> failed{false};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      f(c * chunk, std::min(n, (c + 1) * chunk));
    } catch (...) {
#pragma omp critical(lmi_parallel_chunks_error)
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (error) std::rethrow_exception(error);
}

// chunk size for n items: about 8 chunks per thread (balance) but never below `min_chunk`
inline int64_t chunk_for(int64_t n, int64_t min_chunk) {
  return std::max<int64_t>(min_chunk, n / (8 * std::max(1, at::get_num_threads())));
}

constexpr int64_t PANEL = 32;  // output columns per packed weight panel

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
};
#endif

constexpr int NV = PANEL / Vec::W;  // vectors per panel row

// ---------------------------------------------------------------- linear ----------------------
// R rows of x (stride ldx), k = k0..k0+kc-1, C vectors of columns of one panel w (kc x PANEL,
// row stride PANEL): acc[i][j] = fma(x[i, k], w[k, j], acc[i][j]) in k order. acc lives in `buf`
// (R rows of stride PANEL) between K blocks: storing and reloading a float is exact, so the chain
// is the same as one long loop, and which kernel shape computes an element never changes its bits.
// `pf`, `pf_lines`: cache lines (16 floats each) of weights to pull in meanwhile, spread over the k
// loop. The linear prefetches the next K block of its stream while the current one is computed:
// without it a decode step waits on DRAM for every layer's weights (measured 161 vs 84 ms for the
// 30 layers' linears at M=64, weights cold vs in cache). No effect on the arithmetic.
template <int R, int C>
void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* buf, bool first,
                  const float* pf, int64_t pf_lines) {
  const int64_t per_k = pf_lines > 0 ? (pf_lines + kc - 1) / kc : 0;
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(buf + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
#if defined(__AVX512F__) || defined(__AVX2__)
    for (int64_t l = k * per_k; l < std::min(pf_lines, (k + 1) * per_k); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(pf + l * 16), _MM_HINT_T0);
#endif
    Vec b[C];
    for (int j = 0; j < C; ++j) b[j] = Vec::load(w + k * PANEL + j * Vec::W);
    for (int i = 0; i < R; ++i) {
      const Vec a = Vec::bcast(x[i * ldx + k]);
      for (int j = 0; j < C; ++j) acc[i][j] = Vec::fma(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j].store(buf + i * PANEL + j * Vec::W);
}

// R rows over the whole panel: one call when R x NV accumulators fit in 12 registers, else in
// column pairs (R x 2 accumulators: the classic 6x16 shape on AVX2, which loads each W vector once).
template <int R>
void rows_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* buf, bool first,
                 const float* pf, int64_t pf_lines) {
  if constexpr (R * NV <= 12) {
    micro_kernel<R, NV>(x, ldx, w, kc, buf, first, pf, pf_lines);
  } else {
    for (int c = 0; c < NV; c += 2)
      micro_kernel<R, 2>(x, ldx, w + c * Vec::W, kc, buf + c * Vec::W, first, pf, c == 0 ? pf_lines : 0);
  }
}

constexpr int64_t MR = 6;  // rows per register tile
static_assert(NV % 2 == 0, "PANEL must hold an even number of vectors");

void tile_kernel(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t kc, float* buf,
                 bool first, const float* pf, int64_t pf_lines) {
  switch (rows) {
    case 1: return rows_kernel<1>(x, ldx, w, kc, buf, first, pf, pf_lines);
    case 2: return rows_kernel<2>(x, ldx, w, kc, buf, first, pf, pf_lines);
    case 3: return rows_kernel<3>(x, ldx, w, kc, buf, first, pf, pf_lines);
    case 4: return rows_kernel<4>(x, ldx, w, kc, buf, first, pf, pf_lines);
    case 5: return rows_kernel<5>(x, ldx, w, kc, buf, first, pf, pf_lines);
    default: return rows_kernel<6>(x, ldx, w, kc, buf, first, pf, pf_lines);
  }
}

// Cache blocking: a K block of one panel (K_BLOCK x PANEL floats, 16 KiB) stays in L1 while the
// M block's rows stream past it; the M block's accumulators (M_BLOCK x PANEL, 12 KiB) stay close.
constexpr int64_t K_BLOCK = 128;
constexpr int64_t M_BLOCK = 96;  // a multiple of MR

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be (M, K) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous() &&
              packed.scalar_type() == torch::kFloat32,
              "packed weight must be contiguous float32 (num_panels, K, ", PANEL, ")");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "in_features mismatch: x has ", K, ", weight ", packed.size(1));
  TORCH_CHECK(out_features <= P * PANEL && out_features > (P - 1) * PANEL, "bad out_features");
  const bool has_bias = bias.has_value() && bias->defined();
  torch::Tensor b_cont;
  if (has_bias) {
    b_cont = bias->contiguous();
    TORCH_CHECK(b_cont.scalar_type() == torch::kFloat32 && b_cont.numel() == out_features, "bad bias");
  }
  auto y = torch::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? b_cont.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t num_mb = (M + M_BLOCK - 1) / M_BLOCK;
  // work item = (M block, panel), panels fastest: threads split the panels of each M block
  // Panels of one M block are contiguous in memory. A few rows (decode at small batch) only stream the
  // weight: one contiguous share per thread reads best. Many rows: small chunks balance the threads.
  const int64_t items = num_mb * P, threads = std::max(1, at::get_num_threads());
  const int64_t chunk = M <= 8 ? (items + threads - 1) / threads : chunk_for(items, 1);
  parallel_chunks(items, chunk, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[M_BLOCK * PANEL];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mb = item / P, p = item % P;
      const int64_t m0 = mb * M_BLOCK, rows = std::min(M_BLOCK, M - m0);
      const int64_t n0 = p * PANEL, ncols = std::min(PANEL, out_features - n0);
      for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t kc = std::min(K_BLOCK, K - k0);
        const float* w = wp + (p * K + k0) * PANEL;
        // the next K_BLOCK rows of the stream (this panel's next block, or the next panel's first:
        // panels are contiguous), spread over the row tiles; none past the weight's end
        const float* next = w + kc * PANEL;
        const int64_t lines = std::min(K_BLOCK, P * K - (p * K + k0 + kc)) * PANEL / 16;
        const int64_t tiles = (rows + MR - 1) / MR, per_tile = (lines + tiles - 1) / tiles;
        for (int64_t i = 0, tile = 0; i < rows; i += MR, ++tile) {
          const int64_t own = std::max<int64_t>(0, std::min(per_tile, lines - tile * per_tile));
          tile_kernel(std::min(MR, rows - i), xp + (m0 + i) * K + k0, K, w, kc, buf + i * PANEL, k0 == 0,
                      own > 0 ? next + tile * per_tile * 16 : nullptr, own);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {  // copy out, + bias (one add after the chain)
        float* dst = yp + (m0 + i) * out_features + n0;
        const float* src = buf + i * PANEL;
        if (bp) {
          for (int64_t j = 0; j < ncols; ++j) dst[j] = src[j] + bp[n0 + j];
        } else {
          std::copy(src, src + ncols, dst);
        }
      }
    }
  });
  return y;
}

// -------------------------------------------------------------- attention ---------------------
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp for 8 floats: Cephes range reduction x = n ln2 + r and a degree-5 polynomial (~1 ulp)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// s[t] = exp(s[t] - max) in place for t < n; returns the sum (fixed order)
float exp_and_sum(float* s, int64_t n, float max) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(max);
  for (; t + 8 <= n; t += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = Vec{acc}.sum();
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - max);
    total += s[t];
  }
  return total;
}

// ---- one query row, all H heads, walking its sequence's cache block by block -----------------
// A block holds BS tokens x KVH heads x D floats contiguously (12 KiB for the demo model), so a row
// that takes every head at once reads each block as one sequential stream, and the next block is
// prefetched while this one is used (measured on the demo model's 64-sequence decode, 30 layers,
// 2 threads: 53.2 -> 46.7 ms against one (row, KV head) per item reading K/V rows one by one; the
// bits are unchanged). A score s[h * ld + t] is one dot chain over d (vector lanes, lanes summed in a
// fixed order, scalar tail), an output lane one FMA chain over t in order from zero, stored and
// reloaded between blocks (exact): the same operations whatever else is in the batch.

// scores of NH heads (pointers q[h], key offset koff[h] within a token's row) for one key row
template <int NH>
inline void score_heads(const float* const* q, const int64_t* koff, const float* krow, int64_t D, float scale,
                        float* s, int64_t ld, int64_t t, float* mx) {
  Vec acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = Vec::zero();
  int64_t d = 0;
  for (; d + Vec::W <= D; d += Vec::W)
    for (int h = 0; h < NH; ++h) acc[h] = Vec::fma(Vec::load(q[h] + d), Vec::load(krow + koff[h] + d), acc[h]);
  for (int h = 0; h < NH; ++h) {
    float r = acc[h].sum();
    for (int64_t e = d; e < D; ++e) r = std::fma(q[h][e], krow[koff[h] + e], r);
    r *= scale;
    s[h * ld + t] = r;
    mx[h] = std::max(mx[h], r);
  }
}

// out[h][d0 .. d0 + C*W) (+)= sum over the block's keys t0..t1 of p[h][t] * v_t[g][...] for the
// NG heads of one KV head; `first`: start from zero (the first block), else from the stored value
template <int NG, int C>
inline void values_heads(const float* p, int64_t ld, const float* vblock, int64_t row_stride, int64_t t0, int64_t t1,
                         int64_t d0, float* out, int64_t D, bool first) {
  Vec acc[NG][C];
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = first ? Vec::zero() : Vec::load(out + h * D + d0 + c * Vec::W);
  for (int64_t t = t0; t < t1; ++t) {
    const float* v = vblock + (t - t0) * row_stride + d0;
    for (int h = 0; h < NG; ++h) {
      const Vec w = Vec::bcast(p[h * ld + t]);
      for (int c = 0; c < C; ++c) acc[h][c] = Vec::fma(w, Vec::load(v + c * Vec::W), acc[h][c]);
    }
  }
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < C; ++c) acc[h][c].store(out + h * D + d0 + c * Vec::W);
}

template <int NG>
void values_group(const float* p, int64_t ld, const float* vblock, int64_t row_stride, int64_t t0, int64_t t1,
                  float* out, int64_t D, bool first) {
  constexpr int C = NG == 1 ? 8 : (NG == 2 ? 4 : (NG <= 3 ? 4 : 2));  // NG x C accumulators <= 12
  int64_t d = 0;
  for (; d + C * Vec::W <= D; d += C * Vec::W) values_heads<NG, C>(p, ld, vblock, row_stride, t0, t1, d, out, D, first);
  for (; d + Vec::W <= D; d += Vec::W) values_heads<NG, 1>(p, ld, vblock, row_stride, t0, t1, d, out, D, first);
  for (; d < D; ++d)
    for (int h = 0; h < NG; ++h) {
      float a = first ? 0.f : out[h * D + d];
      for (int64_t t = t0; t < t1; ++t) a = std::fma(p[h * ld + t], vblock[(t - t0) * row_stride + d], a);
      out[h * D + d] = a;
    }
}

inline void prefetch_span(const float* p, int64_t first_line, int64_t last_line) {
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int64_t l = first_line; l < last_line; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + l * 16), _MM_HINT_T0);
#endif
}

// One query row, the query heads of KV heads g0..g1-1: q (H, D) the row's queries, keys 0..n-1 of
// the sequence with block table `table`; writes those heads of out (H, D). Scratch (indexed by head):
// scores H x ld floats (ld >= n), stats 2 H floats. A head's bits do not depend on g0, g1.
void attend_row(const float* q, const float* kp, const float* vp, const int32_t* table, int64_t n, int64_t BS,
                int64_t H, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float* scores, int64_t ld,
                float* stats, float* out) {
  const int64_t G = H / KVH, row_stride = KVH * D, block_floats = BS * row_stride;
  const int64_t num_blocks = (n + BS - 1) / BS, h0 = g0 * G, h1 = g1 * G;
  // cache lines of one token's slice (KV heads g0..g1-1) from its start
  const int64_t slice_begin = g0 * D, slice_lines = ((g1 - g0) * D + 15) / 16;
  float* mx = stats;
  float* denom = stats + H;
  std::fill(mx + h0, mx + h1, -INFINITY);
  // scores, four heads at a time, block by block; each key prefetches the same token of the next block
  for (int64_t j = 0; j < num_blocks; ++j) {
    const float* kb = kp + static_cast<int64_t>(table[j]) * block_floats;
    const float* next = j + 1 < num_blocks ? kp + static_cast<int64_t>(table[j + 1]) * block_floats : nullptr;
    const int64_t t0 = j * BS, t1 = std::min(n, t0 + BS);
    for (int64_t t = t0; t < t1; ++t) {
      if (next) prefetch_span(next + (t - t0) * row_stride + slice_begin, 0, slice_lines);
      const float* krow = kb + (t - t0) * row_stride;
      int64_t h = h0;
      for (; h + 4 <= h1; h += 4) {
        const float* qs[4] = {q + h * D, q + (h + 1) * D, q + (h + 2) * D, q + (h + 3) * D};
        const int64_t ko[4] = {(h / G) * D, ((h + 1) / G) * D, ((h + 2) / G) * D, ((h + 3) / G) * D};
        score_heads<4>(qs, ko, krow, D, scale, scores + h * ld, ld, t, mx + h);
      }
      for (; h < h1; ++h) {
        const float* qs[1] = {q + h * D};
        const int64_t ko[1] = {(h / G) * D};
        score_heads<1>(qs, ko, krow, D, scale, scores + h * ld, ld, t, mx + h);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) denom[h] = exp_and_sum(scores + h * ld, n, mx[h]);
  // weighted values, block by block, the G heads of each KV head together
  for (int64_t j = 0; j < num_blocks; ++j) {
    const float* vb = vp + static_cast<int64_t>(table[j]) * block_floats;
    const int64_t t0 = j * BS, t1 = std::min(n, t0 + BS);
    if (j + 1 < num_blocks) {
      const float* vn = vp + static_cast<int64_t>(table[j + 1]) * block_floats + slice_begin;
      for (int64_t t = 0; t < std::min(BS, n - t1); ++t) prefetch_span(vn + t * row_stride, 0, slice_lines);
    }
    for (int64_t g = g0; g < g1; ++g) {
      const float* p = scores + g * G * ld;
      float* o = out + g * G * D;
      const float* vg = vb + g * D;
      switch (G) {
        case 1: values_group<1>(p, ld, vg, row_stride, t0, t1, o, D, j == 0); break;
        case 2: values_group<2>(p, ld, vg, row_stride, t0, t1, o, D, j == 0); break;
        case 3: values_group<3>(p, ld, vg, row_stride, t0, t1, o, D, j == 0); break;
        case 4: values_group<4>(p, ld, vg, row_stride, t0, t1, o, D, j == 0); break;
        default:
          for (int64_t h = 0; h < G; ++h)
            values_group<1>(p + h * ld, ld, vg, row_stride, t0, t1, o + h * D, D, j == 0);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] /= denom[h];
}


// q: (T, H, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); block_tables: (S, max_blocks)
// int32; context_lens: (S,) int32; cu_seqlens_q: (S+1,) int32. Row r of sequence s sits at
// position context_lens[s] - query_len[s] + (r - cu_seqlens_q[s]) and attends to keys 0..pos.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor context_lens,
                              torch::Tensor cu_seqlens_q, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "paged_attention is float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
              cu_seqlens_q.scalar_type() == torch::kInt32, "metadata must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t S = context_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head shapes mismatch");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  TORCH_CHECK(cu[S] == T, "cu_seqlens_q[-1] must equal the number of query rows");
  std::vector<int32_t> seq_of_row(T);
  int64_t max_ctx = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ctx[s] >= cu[s + 1] - cu[s] && (ctx[s] + BS - 1) / BS <= MB, "bad context length");
    for (int64_t r = cu[s]; r < cu[s + 1]; ++r) seq_of_row[r] = static_cast<int32_t>(s);
    max_ctx = std::max<int64_t>(max_ctx, ctx[s]);
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // work item = one query row with all its heads, so each cache block is read as one stream; a step
  // of a few rows (batch-1 decode) splits each row by KV head instead, so that every thread has work
  const int64_t parts = T < 4 * std::max(1, at::get_num_threads()) ? KVH : 1;
  parallel_chunks(T * parts, chunk_for(T * parts, 1), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * max_ctx), stats(2 * H);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / parts, part = item % parts, s = seq_of_row[r];
      const int64_t n = ctx[s] - (cu[s + 1] - cu[s]) + (r - cu[s]) + 1;  // keys 0..pos
      attend_row(qp + r * H * D, kp, vp, tables + s * MB, n, BS, H, KVH, D, part * KVH / parts,
                 (part + 1) * KVH / parts, fscale, scores.data(), max_ctx, stats.data(), op + r * H * D);
    }
  });
  return out;
}

// ------------------------------------------------------------ row-wise ops -------------------
// Each op below treats rows independently with a fixed per-row operation order, so a row's bits
// depend only on that row. Small ops run on the calling thread: `ROW_GRAIN` floats of work per
// task keeps one decode row (a few hundred floats) off the thread pool.
constexpr int64_t ROW_GRAIN = 1 << 15;

inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, ROW_GRAIN / std::max<int64_t>(1, row_len)); }

// h[r] = weight * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))), x optionally updated first by
// x[r] += delta[r] (in place). Float32 as transformers' LlamaRMSNorm; the sum of squares is one
// vector-lane accumulation then lanes summed in a fixed order (its bits differ from PyTorch's
// reduction by rounding only).
void add_rmsnorm_rows(float* x, const float* delta, const float* w, float* h, int64_t T, int64_t N,
                      float eps) {
  at::parallel_for(0, T, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * N;
      if (delta) {
        const float* dr = delta + r * N;
        for (int64_t j = 0; j < N; ++j) xr[j] = xr[j] + dr[j];
      }
      Vec acc = Vec::zero();
      int64_t j = 0;
      for (; j + Vec::W <= N; j += Vec::W) {
        const Vec v = Vec::load(xr + j);
        acc = Vec::add(acc, Vec::mul(v, v));
      }
      float ss = acc.sum();
      for (; j < N; ++j) ss += xr[j] * xr[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
      float* hr = h + r * N;
      for (j = 0; j < N; ++j) hr[j] = w[j] * (xr[j] * inv);
    }
  });
}

torch::Tensor add_rmsnorm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be contiguous (T, N) float32");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N && weight.is_contiguous() && weight.scalar_type() == torch::kFloat32, "bad weight");
  const float* dp = nullptr;
  torch::Tensor d;
  if (delta.has_value() && delta->defined()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == torch::kFloat32, "delta must match x");
    dp = d.data_ptr<float>();
  }
  auto h = torch::empty_like(x);
  add_rmsnorm_rows(x.data_ptr<float>(), dp, weight.data_ptr<float>(), h.data_ptr<float>(), T, N,
                   static_cast<float>(eps));
  return h;
}

// RoPE (rotate-half) on q and k straight out of the fused qkv rows, then the KV-cache write:
// qkv: (T, (H + 2 KVH) D); cos, sin: (T, D); k/v rows go to cache slot slot_mapping[t].
// out = x * cos + rotate_half(x) * sin elementwise: two products then one add, no FMA contraction
// (the file is built with -ffp-contract=off), the same float operations as llama.apply_rope.
inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
}

torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t H, int64_t KVH) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "bad qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "caches must be contiguous float32");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && k_cache.size(2) == KVH && D % 2 == 0, "qkv/cache shapes mismatch");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32, "cos/sin must be (T, head_dim) float32");
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == T, "slot_mapping must be (T,) int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  auto q = torch::empty({T, H, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t width = (H + 2 * KVH) * D;
  at::parallel_for(0, T, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, s, D, qp + (t * H + h) * D);
      float* kdst = kc + slots[t] * KVH * D;
      float* vdst = vc + slots[t] * KVH * D;
      for (int64_t g = 0; g < KVH; ++g) rope_row(row + (H + g) * D, c, s, D, kdst + g * D);
      std::copy(row + (H + KVH) * D, row + width, vdst);
    }
  });
  return q;
}

// silu(gate) * up on gate_up rows (T, 2I) -> (T, I); silu(g) = g / (1 + exp(-g)). Lane j's result
// depends only on g[j], u[j] (vector lanes and the scalar tail are the same per-row split for any T).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat32 &&
              gate_up.size(1) % 2 == 0, "gate_up must be contiguous (T, 2I) float32");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = gp + t * 2 * I, *u = g + I;
      float* o = op + t * I;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; j + 8 <= I; j += 8) {  // exp256 (~1 ulp) in place of std::exp: same formula, 8 lanes
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp256(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

// One Llama decoder layer, in place on the residual stream x (T, hidden):
//   h = rmsnorm(x) -> qkv linear -> rope + KV write -> paged attention -> o linear;
//   x += o; h = rmsnorm(x) -> gate_up linear -> silu * up -> down linear; x += down.
// Every stage is one of the row-invariant ops above, so the layer is too.
void decoder_layer(torch::Tensor x, torch::Tensor in_norm, torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b,
                   torch::Tensor o_w, c10::optional<torch::Tensor> o_b, torch::Tensor post_norm,
                   torch::Tensor gu_w, c10::optional<torch::Tensor> gu_b, torch::Tensor down_w,
                   c10::optional<torch::Tensor> down_b, torch::Tensor cos, torch::Tensor sin,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                   torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor cu_seqlens_q,
                   int64_t H, int64_t KVH, int64_t intermediate, double eps, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "bad x");
  const int64_t T = x.size(0), N = x.size(1), D = k_cache.size(3);
  auto h = add_rmsnorm(x, c10::nullopt, in_norm, eps);
  auto qkv = linear(h, qkv_w, (H + 2 * KVH) * D, qkv_b);
  auto q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping, H, KVH);
  auto o = paged_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale);
  auto delta = linear(o.view({T, H * D}), o_w, N, o_b);
  h = add_rmsnorm(x, delta, post_norm, eps);
  auto act = silu_mul(linear(h, gu_w, 2 * intermediate, gu_b));
  delta = linear(act, down_w, N, down_b);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  at::parallel_for(0, T, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * N; i < end * N; ++i) xp[i] = xp[i] + dp[i];
  });
}

// An uninitialised float32 tensor in memory aligned to 2 MiB and marked for transparent huge pages
// (madvise; a no-op where THP is off). Weights and the KV cache are read once per step in large
// streams: with 4 KiB pages every page is a TLB miss, and under a hypervisor each miss walks two
// page tables. Measured here (2 threads, 425 MiB stream read): 17.6 vs 23.2 GB/s.
torch::Tensor empty_huge(std::vector<int64_t> sizes) {
  int64_t numel = 1;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0, "negative size");
    numel *= n;
  }
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * sizeof(float));  // the start aligned, not the size
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return torch::from_blob(p, sizes, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(torch::kFloat32));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("PANEL") = PANEL;
  m.attr("VECTOR_WIDTH") = Vec::W;
  m.def("empty_huge", &empty_huge, "uninitialised float32 tensor in 2 MiB-aligned memory marked for huge pages");
  m.def("linear", &linear, "row-invariant x @ W^T (+ bias) over a packed (panels, K, PANEL) weight");
  m.def("paged_attention", &paged_attention, "causal GQA attention over the paged K/V cache");
  m.def("add_rmsnorm", &add_rmsnorm, "x += delta (optional, in place); returns weight * rmsnorm(x) per row");
  m.def("rope_kv_write", &rope_kv_write, "RoPE on q, k of fused qkv rows; k, v into the cache by slot; returns q");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over (T, 2I) gate_up rows");
  m.def("decoder_layer", &decoder_layer, "one Llama decoder layer in place on x (row-invariant C++ chain)");
}
