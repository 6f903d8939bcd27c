// bfloat16 pair panels through AMX tiles (TDPBF16PS, Bf16Form BF16_AMX): the tile kernels, the tile
// configuration and the OS's permission. Their work division over rows, panels and threads (amx_gemm) is
// linear_driver.h's. LMI_AMX: whether this build has them (AMX-BF16 at build time, Linux); HAS_AMX says so.
#pragma once

#include "linear_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LMI_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LMI_AMX 0
#endif

namespace {

// ---- bfloat16 pair panels through AMX tiles (TDPBF16PS), where the CPU and the OS allow them -----
// A bf16 panel row (2*PANEL words, 128 bytes) is two AMX B-tile rows side by side: columns 0..15 and
// 16..31 of one k pair each, so sixteen panel rows at a stride of 128 bytes are a 16-pair x 16-column
// B tile as the panels lie (no repacking). An A tile is 16 rows of x's bf16 words, 16 pairs each.
// TDPBF16PS's own order inside a 16-pair step is not the FMA form's (measured on Intel Xeon with AMX: it
// agrees with neither sequential order, nor one exact sum per step, on most outputs), so this is a
// form of its own, chosen for every row count when chosen at all (bf16_form.bf16_dot_form), never mixed
// with the others. It keeps their invariance: an output element is C[m][n] over k steps 0, 16, 32, ...
// pairs in order, each step the same instruction on row m's words alone (rows of a tile never mix:
// tests/engine/test_kernels.py checks a row alone, in a batch and at every tile position bitwise),
// and a K tail is zero-padded to a whole step whatever M is. DAZ/FTZ as the instruction defines them.
#if LMI_AMX
constexpr bool HAS_AMX = true;
// Linux hands a process AMX's tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernel 5.16+); false where the kernel refuses (then the other forms run)
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// GCC 12's tile intrinsics are asm statements that name no memory beyond their address registers
// (ldtilecfg names the config's first 8 bytes only): without a compiler barrier the stores that fill a
// buffer before a tile load, or the reads after a tile store, may be moved or dropped (seen here: a
// zero-padded tail buffer read as garbage). Every tile load of memory written here and every tile
// store read back goes through one.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }
// eight 64-byte-wide tiles: amx_block's tmm0..3 accumulators (2 row tiles x 2 column tiles), tmm4, 5 x,
// tmm6, 7 weights (with one row tile, tmm2, 3 and 5 take a second step's weights and x); amx_block_pair's
// (`pair`) tmm0..3 accumulators of two panels, tmm4 x, tmm5..7 weights. Row tiles (accumulators, x) get
// `rows` rows (fewer than 16 when M is: a tile's rows never change another row's bits), weights 16.
inline void amx_configure(int64_t rows, bool pair = false) {
  AmxConfig c;
  for (int t = 0; t < 8; ++t) {
    const bool row_tile = pair ? t <= 4 : (t == 0 || t == 1 || t == 4 || t == 5);
    c.rows[t] = static_cast<uint8_t>(row_tile ? rows : 16);
    c.colsb[t] = 64;
  }
  memory_barrier();
  _tile_loadconfig(&c);
}
constexpr int64_t AMX_PAIRS = 16;    // k pairs per tile step (64 bytes of an x row)
constexpr int64_t AMX_AHEAD = 2;     // weight steps prefetched ahead (measured: 1-4 alike at batch 1)
constexpr int64_t AMX_ROWS = 16;     // rows per tile
constexpr int64_t AMX_M_CHUNK = 256; // rows per work item: their x (<= 0.8 MiB at K = 1536) stays in L2 across panels

// One panel's 32 columns for rows m0 .. m0 + 16 * TWO + 15 of x (bf16 words, ldx words a row, rows padded
// to whole tiles, width a whole number of steps): C over every k step, then the finished rows to
// `out` (32 floats a row, 128 bytes). `w`: the panel's first row; `steps` whole steps, and `tail`
// the panel's remaining rows (< 16, copied into a zero-padded step); `prefetch`: pull the weight
// stream AMX_AHEAD steps ahead (the first row block of an item, which reads the panel from memory).
// UNROLL (one row tile only): two steps at a time in tiles 2, 3, 5 too. Bits: the same either way.
template <bool TWO, bool UNROLL = !TWO>
inline void amx_block(const bf16* x, int64_t ldx, const bf16* w, int64_t steps, int64_t tail, bool prefetch,
                      float* out) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t xs = ldx * static_cast<int64_t>(sizeof(bf16));
  int64_t s = 0;
  if constexpr (UNROLL) {
    // one row tile leaves tmm2, 3 and 5 free: two steps at a time in two sets of x and weight tiles, so
    // one step's loads overlap the other's products (a tile register is not renamed: reusing one waits)
    for (; s + 2 <= steps; s += 2) {
      const bf16* ws = w + s * AMX_PAIRS * 2 * PANEL;
      if (prefetch) prefetch_lines(reinterpret_cast<const char*>(ws + AMX_AHEAD * AMX_PAIRS * 2 * PANEL), 0, 64);
      _tile_loadd(6, ws, 128);
      _tile_loadd(7, ws + PANEL, 128);
      _tile_loadd(4, x + s * 2 * AMX_PAIRS, xs);
      _tile_loadd(2, ws + AMX_PAIRS * 2 * PANEL, 128);
      _tile_loadd(3, ws + AMX_PAIRS * 2 * PANEL + PANEL, 128);
      _tile_loadd(5, x + (s + 1) * 2 * AMX_PAIRS, xs);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(0, 5, 2);
      _tile_dpbf16ps(1, 5, 3);
    }
  }
  for (; s < steps; ++s) {
    const bf16* ws = w + s * AMX_PAIRS * 2 * PANEL;
    if (prefetch) prefetch_lines(reinterpret_cast<const char*>(ws + AMX_AHEAD * AMX_PAIRS * 2 * PANEL), 0, 32);
    _tile_loadd(6, ws, 128);
    _tile_loadd(7, ws + PANEL, 128);
    _tile_loadd(4, x + s * 2 * AMX_PAIRS, xs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + AMX_ROWS * ldx + s * 2 * AMX_PAIRS, xs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (tail > 0) {
    alignas(64) bf16 wt[AMX_PAIRS * 2 * PANEL] = {};
    std::memcpy(wt, w + steps * AMX_PAIRS * 2 * PANEL, tail * 2 * PANEL * sizeof(bf16));
    memory_barrier();
    _tile_loadd(6, wt, 128);
    _tile_loadd(7, wt + PANEL, 128);
    _tile_loadd(4, x + steps * 2 * AMX_PAIRS, xs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + AMX_ROWS * ldx + steps * 2 * AMX_PAIRS, xs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t cs = PANEL * sizeof(float);
  _tile_stored(0, out, cs);
  _tile_stored(1, out + 16, cs);
  if constexpr (TWO) {
    _tile_stored(2, out + AMX_ROWS * PANEL, cs);
    _tile_stored(3, out + AMX_ROWS * PANEL + 16, cs);
  }
  memory_barrier();
}

// amx_block<false> for two panels at once (w, then w2 = the next panel), whole steps only: four
// accumulator chains instead of two, so that one chain's products overlap the others' (each tile's
// chain over the steps is a dependency: TDPBF16PS on one accumulator waits for the previous). The
// same instructions on the same tiles per accumulator as amx_block: the same bits.
inline void amx_block_pair(const bf16* x, int64_t ldx, const bf16* w, const bf16* w2, int64_t steps, bool prefetch,
                           float* out, float* out2) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t xs = ldx * static_cast<int64_t>(sizeof(bf16));
  for (int64_t s = 0; s < steps; ++s) {
    const bf16* ws = w + s * AMX_PAIRS * 2 * PANEL;
    const bf16* ws2 = w2 + s * AMX_PAIRS * 2 * PANEL;
    if (prefetch) {
      prefetch_lines(reinterpret_cast<const char*>(ws + AMX_AHEAD * AMX_PAIRS * 2 * PANEL), 0, 32);
      prefetch_lines(reinterpret_cast<const char*>(ws2 + AMX_AHEAD * AMX_PAIRS * 2 * PANEL), 0, 32);
    }
    _tile_loadd(4, x + s * 2 * AMX_PAIRS, xs);
    _tile_loadd(5, ws, 128);
    _tile_loadd(6, ws + PANEL, 128);
    _tile_loadd(7, ws2, 128);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, ws2 + PANEL, 128);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t cs = PANEL * sizeof(float);
  _tile_stored(0, out, cs);
  _tile_stored(1, out + 16, cs);
  _tile_stored(2, out2, cs);
  _tile_stored(3, out2 + 16, cs);
  memory_barrier();
}

#else
constexpr bool HAS_AMX = false;
inline bool amx_permitted() { return false; }
#endif

}  // namespace
