// The packed panels' shape, the register tiles' heights and the weight prefetchers that every form of the
// row-invariant linear shares (linear.h). The forms' micro kernels are in linear_fma.h, linear_dpbf16.h and
// linear_amx.h; how the work is cut and handed to threads, in linear_driver.h.
#pragma once

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace {

constexpr int64_t PANEL = 32;           // output columns per packed weight panel
constexpr int NV = PANEL / Vec::W;      // vectors per panel row
constexpr int64_t MR = 6;               // rows per register tile where vectors are narrow (AVX2: 12 accumulators)
constexpr int64_t M_BLOCK = 96;         // rows per cache block, a multiple of every kind's tile rows
// bf16 and int8 panels widen each weight vector before its FMAs: taller tiles share that work over more
// rows (AVX-512's 32 registers hold 12 rows x 2 vectors of accumulators). Measured (1 thread, thread
// CPU time, the demo model's four linear shapes, interleaved builds): bf16 at 64 rows 82 -> 108 GFLOP/s,
// at 200 rows 85 -> 96; int8 74 -> 81 at 64 rows. float32 gained at 64 rows and lost at 200 on AMD Zen 5;
// on Intel Xeon (Sapphire Rapids class, 2 threads) a 64-sequence fp32 decode step, old and new kernels
// interleaved (benchmarks/ab.py batch1 --batch 64), went 253.6 -> 236.1 ms with 12 rows, and the
// 512-row linears 91-118 -> 119-163 GFLOP/s (not interleaved): float32 takes the tall tile too.
constexpr int64_t MR_WIDE = NV == 2 ? 12 : MR;
constexpr int ACC_WIDE = NV == 2 ? 24 : 12;
static_assert(NV % 2 == 0, "PANEL must hold an even number of vectors");

// Narrow tiles on AMD family 19h with AVX-512, i.e. Zen 4 (Zen 3, the same family, has no AVX-512 and builds take
// the AVX2 tiles there), whose AVX-512 runs each 512-bit operation as two 256-bit halves:
// float32 tiles of 8 rows instead of MR_WIDE's 12 past a few rows, VDPBF16PS tiles of 6 instead of MR_DP's 8
// (f32_tile_rows, dp_tile_rows; every count divides M_BLOCK). A tile's height changes which rows share a k
// loop, never an element's chain, so the bits are the same (tested). Measured on Zen 4 (EPYC, 2 threads,
// benchmarks/ab.py linears: the demo model's 120 layer linears from DRAM, old and new interleaved): float32 8
// rows 0.965x the 12-row time at 64 rows (10 rounds), 0.976x at 1882 (4 rounds); bf16 6 rows 0.959x the 8-row
// time at 64 rows (8 rounds; 4 rows 0.970x, 12 rows 1.028x slower), 0.970x at 1882. Every other CPU keeps the
// wide tiles: float32's 12 rows were measured best on Zen 5 (8 rows 1.00x at 64 rows and 1.04x slower at 1882);
// the 6-row VDPBF16PS tile was not measured there, so Zen 5 keeps the 8 rows it was tuned with (see MR_DP, linear_dpbf16.h).
// set_narrow_tiles overrides the choice (the tests).
inline bool cpu_prefers_narrow_tiles() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  __cpuid(0, a, b, c, d);
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;   // "AuthenticAMD"
  __cpuid(1, a, b, c, d);
  const unsigned base = (a >> 8) & 0xF, family = base + (base == 0xF ? (a >> 20) & 0xFF : 0);
  return NV == 2 && amd && family == 0x19;
#else
  return false;
#endif
}
inline std::atomic<int64_t>& narrow_tiles_slot() {
  static std::atomic<int64_t> narrow{cpu_prefers_narrow_tiles() ? 1 : 0};
  return narrow;
}
inline bool narrow_tiles() { return narrow_tiles_slot().load(std::memory_order_relaxed) != 0; }
// mode -1: this CPU's choice again, 0: the wide tiles, 1: the narrow ones (AVX-512 builds only). Returns the
// previous setting (0 or 1); raises on another mode.
inline int64_t set_narrow_tiles(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "narrow tiles mode must be -1 (the CPU's choice), 0 or 1, got ", mode);
  TORCH_CHECK(mode != 1 || NV == 2, "narrow tiles need an AVX-512 build");
  return narrow_tiles_slot().exchange(mode == -1 ? (cpu_prefers_narrow_tiles() ? 1 : 0) : mode);
}
inline int64_t f32_tile_rows() { return narrow_tiles() ? 8 : MR_WIDE; }

// Prefetch: `pf`, `pf_lines` are cache lines (64 bytes) of weights to pull in while a tile runs,
// spread over its k loop. The linear prefetches the next K block of its stream while the current one
// is computed: without it a decode step waits on DRAM for every layer's weights (measured 161 vs 84 ms
// for the 30 layers' fp32 linears at M=64, weights cold vs in cache). No effect on the arithmetic.
// The lines go evenly over the k loop: one every kc / pf_lines steps, or ceil(pf_lines / kc) a step when there
// are more lines than steps. (Issued a line a step from the loop's start, a 12-row tile's 43 lines were all in
// flight within ~45 steps: more than the core's L1 miss buffers hold.) LEVEL 2: to L2 (the tiled float32 form's
// next panel, see pack_row_tiles).
template <int LEVEL = 1>
struct PrefetchSpread {
  const char* pf;
  int64_t lines, per_step, stride, line = 0, next_k = 0;
  PrefetchSpread(const char* p, int64_t pf_lines, int64_t kc)
      : pf(p), lines(pf_lines), per_step(pf_lines > kc ? (pf_lines + kc - 1) / kc : 1),
        stride(pf_lines > 0 && pf_lines <= kc ? kc / pf_lines : 1) {}
  inline void at(int64_t k) {
    if (k != next_k || line >= lines) return;
    const int64_t end = std::min(lines, line + per_step);
    prefetch_lines<LEVEL>(pf, line, end);
    line = end;
    next_k += stride;
  }
};

// Streaming (NP = 2, a few rows, the whole K in one pass): each panel's stream prefetches the lines
// STREAM_AHEAD bytes past the panel row it reads, one prefetch per 64 bytes consumed. Cheaper than the
// spread scheme above (no per-k range arithmetic: with a row or two, that arithmetic shares the vector
// ports with the FMAs). The address is formed as an integer: past the weight's end it is only a hint.
constexpr int64_t STREAM_AHEAD = 2048;   // measured best of 512, 2048, 8192 (batch 1, 1 thread, weights hot and cold)
template <int ROW_BYTES>
inline void prefetch_ahead(const void* row, int64_t k) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const uintptr_t base = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(STREAM_AHEAD);
  if constexpr (ROW_BYTES >= 64) {
    for (int l = 0; l < ROW_BYTES / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(base + l * 64), _MM_HINT_T0);
  } else {
    if (k % (64 / ROW_BYTES) == 0) _mm_prefetch(reinterpret_cast<const char*>(base), _MM_HINT_T0);
  }
#endif
}

}  // namespace
