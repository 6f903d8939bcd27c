// The FMA forms of the linear's micro kernels, on Vec (common.h: AVX-512, AVX2 or scalar, any CPU): float32
// and int8 panels, and bfloat16 pair panels as two FMAs per pair on widened values (the bf16 form every CPU
// has, Bf16Form BF16_FMA), with the row-count dispatch that turns a tile's rows into one of them.
// Called by packed_gemm (linear_driver.h) through linear_impl (linear.h).
#pragma once

#include "linear_tiles.h"

namespace {

// Every micro kernel below computes R rows of x (stride ldx) against NP panels w[0..NP-1] (panel
// rows k = 0..kc-1, C vectors of columns each), accumulators acc[i][q][j] living in buf[q] (R rows of
// stride PANEL) between K blocks. NP = 2 gives a row of decode (batch 1) four independent FMA chains
// instead of two; an element's chain is the same for any NP, R or C.

// ---- float32 and int8 panels: acc = fma(x[i, k], float(w[k, j]), acc) in k order ----------------
// A panel row is PANEL weights of type WT: floats as they are, or int8 widened to floats (exact).
inline Vec load_panel(const float* p) { return Vec::load(p); }
inline Vec load_panel(const int8_t* p) { return Vec::load_i8(p); }

// x is row-major (row i's k at x[i * ldx + k]), or with TILED the tile's own layout (pack_row_tiles: row i's k at
// x[k * R + i], ldx unused).
template <int R, int C, int NP, class WT, bool TILED = false>
void micro_plain(const float* x, int64_t ldx, const WT* const* w, int64_t kc, float* const* buf, bool first,
                 const char* const* pf, int64_t pf_lines) {
  PrefetchSpread<TILED ? 2 : 1> spread(pf[0], NP == 2 ? 0 : pf_lines, kc);
  Vec acc[R][NP][C];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j)
        acc[i][q][j] = first ? Vec::zero() : Vec::load(buf[q] + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (NP == 2) {
      for (int q = 0; q < NP; ++q) prefetch_ahead<PANEL * static_cast<int>(sizeof(WT))>(w[q] + k * PANEL, k);
    } else {
      spread.at(k);
    }
    Vec b[NP][C];
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j) b[q][j] = load_panel(w[q] + k * PANEL + j * Vec::W);
    for (int i = 0; i < R; ++i) {
      const Vec a = Vec::bcast(TILED ? x[k * R + i] : x[i * ldx + k]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < C; ++j) acc[i][q][j] = Vec::fma(a, b[q][j], acc[i][q][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j) acc[i][q][j].store(buf[q] + i * PANEL + j * Vec::W);
}

// ---- bfloat16 pair panels, two FMAs per pair on widened values (any CPU) -------------------------
// x: floats holding bf16 values, pairs at x[2k], x[2k + 1]; a panel row is 2*PANEL bf16 (the words of
// C vectors of columns); per accumulator: odd element, then even, pair by pair.
template <int R, int C, int NP>
void micro_bf16(const float* x, int64_t ldx, const bf16* const* w, int64_t kc, float* const* buf, bool first,
                const char* const* pf, int64_t pf_lines) {
  PrefetchSpread spread(pf[0], NP == 2 ? 0 : pf_lines, kc);
  Vec acc[R][NP][C];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j)
        acc[i][q][j] = first ? Vec::zero() : Vec::load(buf[q] + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (NP == 2) {
      for (int q = 0; q < NP; ++q) prefetch_ahead<PANEL * 4>(w[q] + k * 2 * PANEL, k);
    } else {
      spread.at(k);
    }
    Vec lo[NP][C], hi[NP][C];
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j) {
        const auto words = Vec::load_words(w[q] + k * 2 * PANEL + j * 2 * Vec::W);
        lo[q][j] = Vec::pair_lo(words);
        hi[q][j] = Vec::pair_hi(words);
      }
    for (int i = 0; i < R; ++i) {
      const Vec odd = Vec::bcast(x[i * ldx + 2 * k + 1]), even = Vec::bcast(x[i * ldx + 2 * k]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < C; ++j) acc[i][q][j] = Vec::fma(odd, hi[q][j], acc[i][q][j]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < C; ++j) acc[i][q][j] = Vec::fma(even, lo[q][j], acc[i][q][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NP; ++q)
      for (int j = 0; j < C; ++j) acc[i][q][j].store(buf[q] + i * PANEL + j * Vec::W);
}

template <bool TILED = false>
struct MicroPlain {   // float32 or int8 panels (WT); TILED: x in pack_row_tiles' layout
  template <int R, int C, int NP, class WT>
  void run(const float* x, int64_t ldx, const WT* const* w, int64_t kc, float* const* buf, bool first,
           const char* const* pf, int64_t n) const { micro_plain<R, C, NP, WT, TILED>(x, ldx, w, kc, buf, first, pf, n); }
};
struct MicroBF16 {
  template <int R, int C, int NP>
  void run(const float* x, int64_t ldx, const bf16* const* w, int64_t kc, float* const* buf, bool first,
           const char* const* pf, int64_t n) const { micro_bf16<R, C, NP>(x, ldx, w, kc, buf, first, pf, n); }
};

// R rows over whole panels: one call when R x NP x NV accumulators fit in 12 registers (16 with two
// panels, AVX-512's 32 registers hold them and their weight vectors), else in column pairs of one
// panel at a time (R x 2 accumulators: the classic 6x16 shape on AVX2, which loads each W vector once).
// `col_elems`: weight elements per column vector in a panel row (W, or 2 W for bf16 pairs).
template <int R, int NP, int ACC, class WT, class Micro>
void rows_kernel(const Micro& micro, const float* x, int64_t ldx, const WT* const* w, int64_t col_elems, int64_t kc,
                 float* const* buf, bool first, const char* const* pf, int64_t pf_lines) {
  if constexpr (R * NP * NV <= (NP == 1 ? ACC : 16)) {
    micro.template run<R, NV, NP>(x, ldx, w, kc, buf, first, pf, pf_lines);
  } else {
    for (int q = 0; q < NP; ++q)
      for (int c = 0; c < NV; c += 2) {
        const WT* wc[1] = {w[q] + c * col_elems};
        float* bc[1] = {buf[q] + c * Vec::W};
        const char* pc[1] = {pf[q]};
        micro.template run<R, 2, 1>(x, ldx, wc, kc, bc, first, pc, c == 0 ? pf_lines : 0);
      }
  }
}

// rows (1 .. ACC / 2 on AVX-512) through rows_kernel: ACC is the most accumulators a tile may hold
template <int NP, int ACC, class WT, class Micro>
void tile_kernel(const Micro& micro, int64_t rows, const float* x, int64_t ldx, const WT* const* w, int64_t col_elems,
                 int64_t kc, float* const* buf, bool first, const char* const* pf, int64_t pf_lines) {
#define LMI_ROWS(R) \
  case R: return rows_kernel<R, NP, ACC>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
  switch (rows) {
    LMI_ROWS(1) LMI_ROWS(2) LMI_ROWS(3) LMI_ROWS(4) LMI_ROWS(5)
    default:
      if constexpr (ACC > 12) {
        switch (rows) { LMI_ROWS(6) LMI_ROWS(7) LMI_ROWS(8) LMI_ROWS(9) LMI_ROWS(10) LMI_ROWS(11) default: break; }
        return rows_kernel<12, NP, ACC>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
      } else {
        return rows_kernel<6, NP, ACC>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
      }
  }
#undef LMI_ROWS
}

}  // namespace
