// bfloat16 pair panels through AVX512-BF16's VDPBF16PS (Bf16Form BF16_DP): the FMA form's bits
// (linear.h's top), one instruction per pair. Compiled where the build has AVX512_BF16; NATIVE_BF16 says so.
#pragma once

#include "linear_tiles.h"

namespace {

#if defined(__AVX512BF16__)
constexpr bool NATIVE_BF16 = true;
// The same pairs through VDPBF16PS: x as bf16 words (a pair per 32 bits, broadcast straight from
// memory), one instruction per pair and 16 columns. One panel, whole panel rows (AVX-512: NV == 2),
// R rows (at most 12): R x 2 accumulators, the two weight vectors and one broadcast in 32 registers.
// The accumulators are named registers, not an array indexed in the loop: GCC 12 kept the array form
// on the stack (a store per accumulator per k, measured 150 GFLOP/s, Zen 5, one core).
// Rows per tile, a divisor of M_BLOCK. Measured (Zen 5, 1 thread, thread CPU time, bf16 out): 8 rows
// (16 accumulators) 446 GFLOP/s at gate_up M=64 and 424 at M=200, against 357 / 411 with 12 rows
// (64 rows make 5 tiles of 12 and one of 4) and 150 for the former 6-row array form; oneDNN 407 / 409.
constexpr int64_t MR_DP = 8;
static_assert(M_BLOCK % MR_DP == 0 && M_BLOCK % 6 == 0, "M_BLOCK must be whole tiles");
inline int64_t dp_tile_rows() { return narrow_tiles() ? 6 : MR_DP; }   // see narrow_tiles
template <int R>
void micro_dpbf16(const bf16* x, int64_t ldx, const bf16* w, int64_t kc, float* buf, bool first,
                  const char* pf, int64_t pf_lines) {
  static_assert(R >= 1 && R <= 12, "at most 12 rows (24 accumulators)");
  PrefetchSpread spread(pf, pf_lines, kc);
  __m512 a0[R], a1[R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    a0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + i * PANEL);
    a1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + i * PANEL + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    spread.at(k);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + k * 2 * PANEL);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + k * 2 * PANEL + 32);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + i * ldx + 2 * k));
      a0[i] = _mm512_dpbf16_ps(a0[i], a, b0);
      a1[i] = _mm512_dpbf16_ps(a1[i], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(buf + i * PANEL, a0[i]);
    _mm512_storeu_ps(buf + i * PANEL + 16, a1[i]);
  }
}
#else
constexpr bool NATIVE_BF16 = false;
#endif

}  // namespace
