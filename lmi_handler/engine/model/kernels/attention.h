// Paged causal GQA attention reading K/V straight from the block cache, in float32 or bfloat16
// storage (q, caches and output share one type T); the arithmetic is float32 either way, and bf16 storage
// rounds the softmax weights to bf16 where torch's CPU flash attention does (attend_row).
//
// Invariance by construction: a query row's scores, softmax and weighted sum loop over its own keys
// 0..pos in order, whatever else is in the batch and however its sequence was cut into chunks.
#pragma once

#include "common.h"

namespace {

// exp for W/32 floats (exp256: AVX2, exp512: AVX-512): Cephes range reduction x = n ln2 + r and a
// degree-5 polynomial (~1 ulp); ROUND rounds to the nearest integer
#define LMI_EXP(W, ROUND)                                                                                   \
  inline __m##W exp##W(__m##W x) {                                                                          \
    x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-87.3f)), _mm##W##_set1_ps(88.3f));             \
    __m##W fx = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)),                           \
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                        \
    x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                          \
    x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                                       \
    __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                          \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                        \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                        \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                        \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                        \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                        \
    y = _mm##W##_fmadd_ps(y, _mm##W##_mul_ps(x, x), _mm##W##_add_ps(x, _mm##W##_set1_ps(1.f)));             \
    __m##W##i n = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(fx), _mm##W##_set1_epi32(127)), 23); \
    return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(n));                                                  \
  }
#if defined(__AVX512F__)
LMI_EXP(512, _mm512_roundscale_ps)
#elif defined(__AVX2__) && defined(__FMA__)
LMI_EXP(256, _mm256_round_ps)
#endif
#undef LMI_EXP

// s[t] = exp(s[t] - max) in place for t < n; returns the sum (fixed order)
float exp_and_sum(float* s, int64_t n, float max) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  // every element through exp512 (the tail masked: lanes past n add 0 to the sum), lanes summed at the end
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(max);
  for (; t < n; t += 16) {
    const __mmask16 k = t + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
    _mm512_mask_storeu_ps(s + t, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
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

// exp_and_sum, then each s[t] as a T holds it (keep<T>): the softmax weights bf16 storage rounds. On
// AVX-512 the rounding is done in the same pass, to the bits of float_to_bf16 (round to nearest even;
// exp512 never returns NaN: its input is clamped), the sum being of the unrounded values as before.
template <class T>
float exp_sum_keep(float* s, int64_t n, float max) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, bf16>) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(max);
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1),
                  high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 k = t + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
      const __m512i u = _mm512_castps_si512(e);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, half), lsb), high);
      _mm512_mask_storeu_ps(s + t, k, _mm512_castsi512_ps(r));
      acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
  }
#endif
  const float total = exp_and_sum(s, n, max);
  for (int64_t t = 0; t < n; ++t) s[t] = keep<T>(s[t]);
  return total;
}

// W cache values of type T as floats (exact)
template <class T> inline Vec load_vec(const T* p);
template <> inline Vec load_vec<float>(const float* p) { return Vec::load(p); }
template <> inline Vec load_vec<bf16>(const bf16* p) { return Vec::load_bf16(p); }

// ---- one query row, all H heads, walking its sequence's cache block by block -----------------
// A block holds BS tokens x KVH heads x D values contiguously (12 KiB for the demo model in float32),
// so a row that takes every head at once reads each block as one sequential stream, and the next
// block is prefetched while this one is used (measured on the demo model's 64-sequence decode, 30
// layers, 2 threads: 53.2 -> 46.7 ms against one (row, KV head) per item reading K/V rows one by one;
// the bits are unchanged). On AVX-512 the scores go sixteen keys at a time per head, their lane sums in
// one transpose (transpose_sum16) instead of a horizontal sum per key, and exp is vectorized (exp512):
// 64 rows x 200 keys, 1 thread, thread CPU time, old and new builds interleaved in one process:
// float32 2.75 -> 2.39 ms a layer, bfloat16 2.32 -> 1.91 (the rest is mostly reading K/V). Then the
// key loop of score_group16 unrolled to sixteen register accumulators, the sums placed by one permute,
// the softmax weights rounded to bf16 in exp's pass and the first value block prefetched during the
// last key block (benchmarks/ab.py attention, 64 rows x 112-240 keys, old and new interleaved, bitwise
// equal): old/new 1.10-1.24 in bfloat16 and 1.07-1.32 in float32 over two runs at 1 and 2 threads. A score s[h * ld + t] is one dot chain over d (vector lanes, lanes summed
// in a fixed order, scalar tail), an output lane one FMA chain over t in order from zero, stored and
// reloaded between blocks (exact): the same operations whatever else is in the batch.

// scores of NH heads (float queries q[h], key offset koff[h] within a token's row) for one key row
template <int NH, class T>
inline void score_heads(const float* const* q, const int64_t* koff, const T* krow, int64_t D, float scale,
                        float* s, int64_t ld, int64_t t, float* mx) {
  Vec acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = Vec::zero();
  int64_t d = 0;
  for (; d + Vec::W <= D; d += Vec::W)
    for (int h = 0; h < NH; ++h) acc[h] = Vec::fma(Vec::load(q[h] + d), load_vec<T>(krow + koff[h] + d), acc[h]);
  for (int h = 0; h < NH; ++h) {
    float r = acc[h].sum();
    for (int64_t e = d; e < D; ++e) r = std::fma(q[h][e], load_scalar<T>(krow + koff[h] + e), r);
    r *= scale;
    s[h * ld + t] = r;
    mx[h] = std::max(mx[h], r);
  }
}

// out[h][d0 .. d0 + C*W) (+)= sum over the block's keys t0..t1 of p[h][t] * v_t[g][...] for the
// NG heads of one KV head; `first`: start from zero (the first block), else from the stored value
template <int NG, int C, class T>
inline void values_heads(const float* p, int64_t ld, const T* vblock, int64_t row_stride, int64_t t0, int64_t t1,
                         int64_t d0, float* out, int64_t D, bool first) {
  Vec acc[NG][C];
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = first ? Vec::zero() : Vec::load(out + h * D + d0 + c * Vec::W);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v = vblock + (t - t0) * row_stride + d0;
    for (int h = 0; h < NG; ++h) {
      const Vec w = Vec::bcast(p[h * ld + t]);
      for (int c = 0; c < C; ++c) acc[h][c] = Vec::fma(w, load_vec<T>(v + c * Vec::W), acc[h][c]);
    }
  }
  for (int h = 0; h < NG; ++h)
    for (int c = 0; c < C; ++c) acc[h][c].store(out + h * D + d0 + c * Vec::W);
}

template <int NG, class T>
void values_group(const float* p, int64_t ld, const T* vblock, int64_t row_stride, int64_t t0, int64_t t1,
                  float* out, int64_t D, bool first) {
  constexpr int C = NG == 1 ? 8 : (NG == 2 ? 4 : (NG <= 3 ? 4 : 2));  // NG x C accumulators <= 12
  int64_t d = 0;
  for (; d + C * Vec::W <= D; d += C * Vec::W) values_heads<NG, C>(p, ld, vblock, row_stride, t0, t1, d, out, D, first);
  for (; d + Vec::W <= D; d += Vec::W) values_heads<NG, 1>(p, ld, vblock, row_stride, t0, t1, d, out, D, first);
  for (; d < D; ++d)
    for (int h = 0; h < NG; ++h) {
      float a = first ? 0.f : out[h * D + d];
      for (int64_t t = t0; t < t1; ++t)
        a = std::fma(p[h * ld + t], load_scalar<T>(vblock + (t - t0) * row_stride + d), a);
      out[h * D + d] = a;
    }
}

#if defined(__AVX512F__)
// Sixteen vectors' lane sums as one vector: out lane i = a fixed tree over the 16 lanes of v[PERM[i]]
// (pairs of lanes, then pairs of pairs, ...); a lane never mixes two vectors, so a key's score does not
// depend on which keys share its group (absent ones are zero vectors).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// where transpose_sum16 puts vector i's sum: computed once by running it on one-hot vectors
struct Sum16Order {
  int lane_of[16];
  __m512i index;   // lane_of as a permute index
  Sum16Order() {
    for (int i = 0; i < 16; ++i) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) v[j] = _mm512_set1_ps(j == i ? 1.f : 0.f);
      alignas(64) float out[16];
      _mm512_store_ps(out, transpose_sum16(v));
      for (int l = 0; l < 16; ++l)
        if (out[l] != 0.f) lane_of[i] = l;
    }
    alignas(64) int32_t lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = lane_of[i];
    index = _mm512_load_si512(lanes);
  }
};

// scores of head h (float query q, D a multiple of 16) for keys t0..t0+cnt-1 (cnt <= 16) at krows (row
// stride row_stride, the head's KV slice at koff): s[t] = scale * tree sum over lanes of the FMA chain
// over d; returns the group's max
template <class T>
inline float score_group16(const float* q, const T* krows, int64_t row_stride, int64_t koff, int64_t D, int64_t cnt,
                           float scale, float* s) {
  static const Sum16Order order;
  // sixteen chains whatever cnt is, so that the loop over keys unrolls and the accumulators stay in
  // registers (a loop to a run-time cnt kept them in memory: a load and a store around every FMA); keys
  // past cnt repeat the last one, their sums are never read, and a lane never mixes two vectors
  const T* rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = krows + std::min<int64_t>(i, cnt - 1) * row_stride + koff;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qv, load_vec<T>(rows[i] + d).v, acc[i]);
  }
  // key i's sum to lane i (one permute), the first cnt stored; max is exact, so the vector max is the
  // scalar loop's
  const __m512 sums = _mm512_permutexvar_ps(order.index, _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale)));
  const __mmask16 k = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1);
  _mm512_mask_storeu_ps(s, k, sums);
  return _mm512_mask_reduce_max_ps(k, sums);
}
#endif

// Share `step` of `steps` of a prefetch of one block's first `tokens` token slices (slice_lines cache
// lines each, from `block`): tokens step * BS / steps .. (step + 1) * BS / steps - 1. attend_row asks for
// the next block in shares spread over its work on the current one: issued at once at a block's start,
// a float32 block's 192 prefetches found the core's outstanding misses full and were as good as none
// (measured: removing them changed nothing); spread, the 30 layers' K/V of a 64-sequence decode step
// (112-240 keys, caches bigger than the L3) streamed at 26-29 GB/s instead of 20-22 in float32 and
// 18-20 instead of 13-15 in bfloat16, 2 threads, AMD EPYC Zen 5. (A row split by KV head, batch 1, has one
// weighted sum a block, so its value prefetch is one share: 64 lines in float32, within the misses it can hold.)
// The block after the next goes to L2 in the same shares (LEVEL 2: its misses wait in L2's buffers, not
// L1's): measured (ab.py attention, 12 interleaved rounds, 2 threads) 1.17-1.18x the K/V rate in bfloat16,
// 1.04-1.05x in float32; three blocks ahead gave the same (AMD Zen 5). float32 sends the block three ahead to L2
// as well (FAR_BLOCKS in attend_row): on AMD Zen 4 (ab.py attention, 10 rounds) 1.13x the K/V rate, where four
// ahead gave 1.10-1.12x and six 1.05x (too many prefetches in flight stall the loop); bfloat16 gained nothing
// from three or four (0.97-1.00x) and keeps two.
template <int LEVEL = 1, class T>
inline void spread_prefetch(const T* block, int64_t tokens, int64_t row_stride, int64_t slice_lines, int64_t BS,
                            int64_t step, int64_t steps) {
  const int64_t end = std::min(tokens, (step + 1) * BS / steps);
  for (int64_t t = step * BS / steps; t < end; ++t) prefetch_lines<LEVEL>(block + t * row_stride, 0, slice_lines);
}

// A kernel's optional mask, passed as a pack of none or one (so that the unmasked form keeps its parameters
// and code): the one, or for none M{} (value-initialized: every field 0, which is no mask)
template <class M> inline M mask_or_none() { return M{}; }
template <class M> inline M mask_or_none(const M& mask) { return mask; }

// attend_row's masked form: a row's keys first_key..n-1 (after the skipped blocks), its scores capped when
// softcap > 0; sinks (H floats, or nullptr): each head's learned logit in the softmax's denominator (gpt-oss)
struct RowMask {
  int64_t first_key;
  float softcap;
  const float* sinks;
};

// One query row, the query heads of KV heads g0..g1-1: q (H, D) the row's queries as floats, keys
// 0..n-1 of the sequence with block table `table`; writes those heads of out (H, D) floats. Scratch
// (indexed by head): scores H x ld floats (ld >= n), stats 2 H floats. A head's bits do not depend
// on g0, g1. `next_table` / `next_n`: the block table and key count of the row the caller runs next
// over the same KV heads (nullptr: none), whose first key blocks the stream prefetches during this
// row's last value blocks (prefetches only: no value changes).
// `mask`: none (the Llama path: keys 0..n-1, no cap), or one RowMask (the masked form, paged_attention_typed
// with a window or a score cap): keys first_key..n-1 only (first_key < BS: the caller drops the window's whole
// blocks before it by starting `table` past them), and softcap > 0 caps each score as softcap * tanh(score /
// softcap) before the softmax (Gemma 2). A pack, so that the unmasked form keeps its parameters and code as
// they were (with two more parameters passed as constants, the compiler cloned and re-allocated it).
template <class T, class... Mask>
void attend_row(const float* q, const T* kp, const T* vp, const int32_t* table, int64_t n, int64_t BS,
                int64_t H, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float* scores, int64_t ld,
                float* stats, float* out, const int32_t* next_table = nullptr, int64_t next_n = 0,
                const Mask&... mask) {
  constexpr bool MASKED = sizeof...(Mask) > 0;
  const RowMask row_mask = mask_or_none<RowMask>(mask...);
  const int64_t lo = MASKED ? row_mask.first_key : 0;   // the row's first key (its first block's from `lo`)
  const int64_t G = H / KVH, row_stride = KVH * D, block_elems = BS * row_stride;
  constexpr int64_t FAR_BLOCKS = sizeof(T) == 4 ? 3 : 2;   // the last block the stream sends to L2 (spread_prefetch)
  const int64_t num_blocks = (n + BS - 1) / BS, h0 = g0 * G, h1 = g1 * G;
  // cache lines of one token's slice (KV heads g0..g1-1) from its start
  const int64_t slice_begin = g0 * D, slice_lines = ((g1 - g0) * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  float* mx = stats;
  float* denom = stats + H;
  std::fill(mx + h0, mx + h1, -INFINITY);
  // block i of the row's stream (keys 0..num_blocks-1, then values, then the next row's keys) at this slice,
  // and its tokens; the stream's blocks two (float32: two and three) ahead of the one being read go to L2
  // (spread as the next one's to L1)
  const int64_t next_blocks = next_table ? (next_n + BS - 1) / BS : 0;
  auto stream_block = [&](int64_t i) -> const T* {
    if (i >= 2 * num_blocks) {
      const int64_t b = i - 2 * num_blocks;
      return b < next_blocks ? kp + static_cast<int64_t>(next_table[b]) * block_elems + slice_begin : nullptr;
    }
    const T* base = i < num_blocks ? kp : vp;
    return base + static_cast<int64_t>(table[i % num_blocks]) * block_elems + slice_begin;
  };
  auto stream_tokens = [&](int64_t i) {
    if (i >= 2 * num_blocks) {
      const int64_t b = i - 2 * num_blocks;
      return b < next_blocks ? std::min(BS, next_n - b * BS) : int64_t{0};
    }
    return std::min(BS, n - (i % num_blocks) * BS);
  };
  // the stream's blocks 2 .. FAR_BLOCKS past block i and their tokens, looked up once a block (look_far)
  constexpr int FAR = FAR_BLOCKS - 1;
  const T* far[FAR];
  int64_t far_tokens[FAR];
  auto look_far = [&](int64_t i) {
    for (int x = 0; x < FAR; ++x) far[x] = stream_block(i + 2 + x), far_tokens[x] = stream_tokens(i + 2 + x);
  };
  // scores block by block: sixteen keys x one head a step (AVX-512), else four heads a key, each key prefetching
  // the same token of the next block
  for (int64_t j = 0; j < num_blocks; ++j) {
    const T* kb = kp + static_cast<int64_t>(table[j]) * block_elems;
    const T* next = j + 1 < num_blocks ? kp + static_cast<int64_t>(table[j + 1]) * block_elems : nullptr;
    const int64_t t0 = j * BS, t1 = std::min(n, t0 + BS), ts = MASKED && j == 0 ? lo : t0;
#if defined(__AVX512F__)
    if (D % 16 == 0) {   // sixteen keys at a time per head, their lane sums in one transpose
      // the next block's keys, or after the last the first block's values, on their way meanwhile: its
      // tokens in shares, one before each (key group, head) step (see spread_prefetch)
      const T* ahead = (next ? next : vp + static_cast<int64_t>(table[0]) * block_elems) + slice_begin;
      const int64_t ahead_tokens = next ? std::min(BS, n - t1) : std::min(BS, n);
      const int64_t steps = (h1 - h0) * ((t1 - ts + 15) / 16);   // the key-group/head steps of this block
      // (bf16 keys widened once per block into a float buffer, instead of once per query head of their KV
      // head, measured 0.90x: the buffer's stores cost more than the conversions saved)
      look_far(j);
      for (int64_t u = ts; u < t1; u += 16) {
        const int64_t cnt = std::min<int64_t>(16, t1 - u);
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t step = ((u - ts) / 16) * (h1 - h0) + h - h0;
          spread_prefetch(ahead, ahead_tokens, row_stride, slice_lines, BS, step, steps);
          for (int x = 0; x < FAR; ++x) spread_prefetch<2>(far[x], far_tokens[x], row_stride, slice_lines, BS, step, steps);
          mx[h] = std::max(mx[h], score_group16<T>(q + h * D, kb + (u - t0) * row_stride, row_stride, (h / G) * D, D,
                                                   cnt, scale, scores + h * ld + u));
        }
      }
      continue;
    }
#endif
    for (int64_t t = ts; t < t1; ++t) {
      if (next) prefetch_lines(next + (t - t0) * row_stride + slice_begin, 0, slice_lines);
      const T* krow = kb + (t - t0) * row_stride;
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
  // bf16 storage rounds the softmax weights to bf16 before the weighted sum (the sum stays the float32
  // weights') and scales the output by the sum's reciprocal: the roundings of torch's CPU flash attention,
  // which transformers' bf16 Llama runs (sdpa). float32: keep is the identity and the output is divided.
  if constexpr (MASKED) {
    if (const float softcap = row_mask.softcap; softcap > 0.f) {   // Gemma 2's cap (transformers: tanh(s / cap) * cap)
      for (int64_t h = h0; h < h1; ++h) {
        float m = -INFINITY;
        for (int64_t t = lo; t < n; ++t) {
          float& s = scores[h * ld + t];
          s = std::tanh(s / softcap) * softcap;
          m = std::max(m, s);
        }
        mx[h] = m;
      }
    }
  }
  if constexpr (MASKED) {   // a sink: one more logit in the max and the denominator, whose weight is dropped
    if (const float* sinks = row_mask.sinks) {
      for (int64_t h = h0; h < h1; ++h) mx[h] = std::max(mx[h], sinks[h]);
    }
  }
  for (int64_t h = h0; h < h1; ++h) denom[h] = exp_sum_keep<T>(scores + h * ld + lo, n - lo, mx[h]);
  if constexpr (MASKED) {
    if (const float* sinks = row_mask.sinks) {
      for (int64_t h = h0; h < h1; ++h) denom[h] += std::exp(sinks[h] - mx[h]);
    }
  }
  // weighted values, block by block, the G heads of each KV head together
  for (int64_t j = 0; j < num_blocks; ++j) {
    const T* vb = vp + static_cast<int64_t>(table[j]) * block_elems;
    const int64_t t0 = j * BS, t1 = std::min(n, t0 + BS), ts = MASKED && j == 0 ? lo : t0;
    if constexpr (MASKED) vb += (ts - t0) * row_stride;   // key ts's row
    // the next block's values (after the last, the next row's first keys) in shares, one before each KV
    // head's weighted sum
    const T* vn = stream_block(num_blocks + j + 1);
    const int64_t vn_tokens = stream_tokens(num_blocks + j + 1);
    look_far(num_blocks + j);
    for (int64_t g = g0; g < g1; ++g) {
      spread_prefetch(vn, vn_tokens, row_stride, slice_lines, BS, g - g0, g1 - g0);
      for (int x = 0; x < FAR; ++x)
        spread_prefetch<2>(far[x], far_tokens[x], row_stride, slice_lines, BS, g - g0, g1 - g0);
      const float* p = scores + g * G * ld;
      float* o = out + g * G * D;
      const T* vg = vb + g * D;
      switch (G) {
        case 1: values_group<1>(p, ld, vg, row_stride, ts, t1, o, D, j == 0); break;
        case 2: values_group<2>(p, ld, vg, row_stride, ts, t1, o, D, j == 0); break;
        case 3: values_group<3>(p, ld, vg, row_stride, ts, t1, o, D, j == 0); break;
        case 4: values_group<4>(p, ld, vg, row_stride, ts, t1, o, D, j == 0); break;
        default:
          for (int64_t h = 0; h < G; ++h)
            values_group<1>(p + h * ld, ld, vg, row_stride, ts, t1, o + h * D, D, j == 0);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    if constexpr (std::is_same_v<T, bf16>) {
      const float reciprocal = 1.f / denom[h];
      for (int64_t d = 0; d < D; ++d) out[h * D + d] *= reciprocal;
    } else {
      for (int64_t d = 0; d < D; ++d) out[h * D + d] /= denom[h];
    }
  }
}

// paged_attention_typed's work items: T_rows * parts, item = (row, part), part p of a row its KV heads
// [p * KVH / parts, (p + 1) * KVH / parts). One query row with all its heads, so each cache block is read as
// one stream; a step of a few rows (batch-1 decode) splits each row by KV head instead, so that every thread
// has work.
inline int64_t attention_parts(int64_t T_rows, int64_t KVH) { return T_rows < 4 * pool_threads() ? KVH : 1; }

// paged_attention_typed's masked form: a row at position p reads keys max(0, p - window + 1)..p when window
// > 0, its scores are capped when softcap > 0, and sinks (H floats, or nullptr) join its softmax (RowMask)
struct AttentionMask {
  int64_t window;
  float softcap;
  const float* sinks;
};

// `mask`: none (the Llama path's unmasked code, as it was), or one AttentionMask (the masked form: the C++ ops
// backend, families.cpp): a window skips each row's whole blocks before its first key (attend_row walks the same
// absolute blocks, from the window's first) and masks the rest of them; the cap goes to attend_row.
template <class T, class... Mask>
void paged_attention_typed(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const int32_t* tables, const int32_t* ctx, const int32_t* cu,
                           const std::vector<int32_t>& seq_of_row, int64_t MB, int64_t max_ctx, float scale,
                           torch::Tensor& out, const Mask&... mask) {
  constexpr bool MASKED = sizeof...(Mask) > 0;
  const int64_t T_rows = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const T* qp = data_of<T>(q);
  const T* kp = data_of<T>(k_cache);
  const T* vp = data_of<T>(v_cache);
  T* op = data_of<T>(out);
  const int64_t parts = attention_parts(T_rows, KVH);
  parallel_chunks(T_rows * parts, chunk_for(T_rows * parts, 1), [&](int64_t begin, int64_t end) {
    // each thread's own buffers, kept between calls (zeroed as fresh vectors are): a decode step's 30 layers
    // each ran a malloc and free of four vectors per chunk on both threads
    thread_local std::vector<float> scores, stats, qf, of;
    scores.assign(H * max_ctx, 0.f);
    stats.assign(2 * H, 0.f);
    qf.assign(H * D, 0.f);
    of.assign(H * D, 0.f);
    // keys 0..pos of row r
    auto keys_of = [&](int64_t r, int64_t s) { return ctx[s] - (cu[s + 1] - cu[s]) + (r - cu[s]) + 1; };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / parts, part = item % parts, s = seq_of_row[r];
      const int64_t g0 = part * KVH / parts, g1 = (part + 1) * KVH / parts, G = H / KVH;
      const int64_t n = keys_of(r, s);
      // this thread's next row, whose first key blocks this row's stream runs into (whole rows only: a
      // row split by KV head has its next item over other heads)
      const bool next = parts == 1 && item + 1 < end;
      const int64_t next_s = next ? seq_of_row[r + 1] : 0;
      const T* qr = qp + r * H * D;
      for (int64_t e = g0 * G * D; e < g1 * G * D; ++e) qf[e] = load_scalar<T>(qr + e);
      if constexpr (MASKED) {
        // whole blocks before the window's first key are skipped, the rest of them masked in attend_row (the mask
        // read here, from the pack: a name in this branch is captured by the lambda even where it is discarded)
        const AttentionMask attention_mask = mask_or_none<AttentionMask>(mask...);
        const int64_t window = attention_mask.window;
        auto skipped = [&](int64_t keys) { return window > 0 && keys > window ? (keys - window) / BS : int64_t{0}; };
        const int64_t skip = skipped(n), next_n = next ? keys_of(r + 1, next_s) : 0, next_skip = skipped(next_n);
        const RowMask row_mask{window > 0 && n > window ? n - window - skip * BS : 0, attention_mask.softcap,
                               attention_mask.sinks};
        attend_row<T>(qf.data(), kp, vp, tables + s * MB + skip, n - skip * BS, BS, H, KVH, D, g0, g1, scale,
                      scores.data(), max_ctx, stats.data(), of.data(), next ? tables + next_s * MB + next_skip : nullptr,
                      next_n - next_skip * BS, row_mask);
      } else {
        attend_row<T>(qf.data(), kp, vp, tables + s * MB, n, BS, H, KVH, D, g0, g1, scale, scores.data(), max_ctx,
                      stats.data(), of.data(), next ? tables + next_s * MB : nullptr, next ? keys_of(r + 1, next_s) : 0);
      }
      T* orow = op + r * H * D;
      for (int64_t e = g0 * G * D; e < g1 * G * D; ++e) store_scalar<T>(orow + e, of[e]);
    }
  });
}

// A step's attention metadata, checked once, shared by every layer (DecoderStack) and each paged_attention
// call: block_tables (S, MB) int32 (made contiguous, held here), context_lens (S,) int32, cu_seqlens_q
// (S+1,) int32 for T query rows in cache blocks of BS tokens. Raises (TORCH_CHECK) on a bad dtype, a
// context longer than its table or cu_seqlens_q[-1] != T.
struct AttentionPlan {
  torch::Tensor block_tables, context_lens, cu_seqlens_q;   // held: the pointers below are theirs
  const int32_t *tables, *ctx, *cu;
  std::vector<int32_t> seq_of_row;   // (T,) each query row's sequence
  int64_t MB, max_ctx;

  AttentionPlan(int64_t T, int64_t BS, torch::Tensor block_tables_, torch::Tensor context_lens_,
                torch::Tensor cu_seqlens_q_)
      : block_tables(block_tables_.contiguous()), context_lens(context_lens_.contiguous()),
        cu_seqlens_q(cu_seqlens_q_.contiguous()) {
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
                cu_seqlens_q.scalar_type() == torch::kInt32, "metadata must be int32");
    const int64_t S = context_lens.size(0);
    MB = block_tables.size(1);
    TORCH_CHECK(cu_seqlens_q.numel() == S + 1, "cu_seqlens_q must be (S + 1,)");
    tables = block_tables.data_ptr<int32_t>();
    ctx = context_lens.data_ptr<int32_t>();
    cu = cu_seqlens_q.data_ptr<int32_t>();
    TORCH_CHECK(cu[S] == T, "cu_seqlens_q[-1] must equal the number of query rows");
    seq_of_row.assign(T, 0);
    max_ctx = 1;
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(ctx[s] >= cu[s + 1] - cu[s] && (ctx[s] + BS - 1) / BS <= MB, "bad context length");
      for (int64_t r = cu[s]; r < cu[s + 1]; ++r) seq_of_row[r] = static_cast<int32_t>(s);
      max_ctx = std::max<int64_t>(max_ctx, ctx[s]);
    }
  }
};

// paged attention of q (T, H, D) contiguous into out (T, H, D), q's dtype, over one layer's caches
inline void paged_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const AttentionPlan& plan, double scale, torch::Tensor& out) {
  const bool bf = is_bf16(q, "q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention needs q and the caches in one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q and out must be contiguous (T, H, D) of one dtype");
  TORCH_CHECK(q.size(0) == static_cast<int64_t>(plan.seq_of_row.size()), "q's rows must be the plan's");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes mismatch");
  const float fscale = static_cast<float>(scale);
  if (bf) {
    paged_attention_typed<bf16>(q, k_cache, v_cache, plan.tables, plan.ctx, plan.cu, plan.seq_of_row, plan.MB,
                                plan.max_ctx, fscale, out);
  } else {
    paged_attention_typed<float>(q, k_cache, v_cache, plan.tables, plan.ctx, plan.cu, plan.seq_of_row, plan.MB,
                                 plan.max_ctx, fscale, out);
  }
}

// q: (T, H, D); k_cache, v_cache: (num_blocks, block_size, KVH, D), all float32 or all bfloat16;
// block_tables: (S, max_blocks) int32; context_lens: (S,) int32; cu_seqlens_q: (S+1,) int32. Row r of
// sequence s sits at position context_lens[s] - query_len[s] + (r - cu_seqlens_q[s]) and attends to
// keys 0..pos. Returns (T, H, D) in q's dtype (bf16: each output rounded once from its float32 value).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor context_lens,
                              torch::Tensor cu_seqlens_q, double scale) {
  is_bf16(q, "q");
  q = q.contiguous();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be (T, H, D) and the caches (blocks, BS, KVH, D)");
  const AttentionPlan plan(q.size(0), k_cache.size(1), block_tables, context_lens, cu_seqlens_q);
  auto out = torch::empty_like(q);
  paged_attention_into(q, k_cache, v_cache, plan, scale, out);
  return out;
}

}  // namespace
