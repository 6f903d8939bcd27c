// The row-invariant linear y = x @ W^T (+ bias) over pre-packed weight panels, in three weight kinds.
//
// Invariance by construction: every output element y[m, n] is one fixed chain of float operations
// over k that reads only row m of x, whatever M is and wherever the row sits; vector lanes run over n.
//
// Weight kinds (the packed tensor's dtype says which; PANEL output columns per panel, zero-padded):
//   float32  (P, K, PANEL)        w[p][k][j]      = W[p*PANEL + j][k]
//            y = fma chain over k = 0..K-1 of x[k] * w[k]                         (then + bias)
//   bfloat16 (P, Kp, 2*PANEL)     w[p][i][2j + e] = W[p*PANEL + j][2i + e],  Kp = ceil(K/2)
//            x rounded to bf16; per pair i = 0..Kp-1 in order: acc = fma(x[2i+1], w[2i+1], acc),
//            then acc = fma(x[2i], w[2i], acc)                                     (then + bias)
//            This is VDPBF16PS's documented order (odd element first, each step one rounding: the
//            product of two bf16 values is exact in float32), so the AVX512_BF16 instruction and two
//            FMAs on widened values give the same bits (checked at start-up, see bf16_native_agrees).
//   int8     (P, K, PANEL) + scale (N,) float32: W[n][k] ~ scale[n] * q[n][k] (per output channel)
//            y = (fma chain over k of x[k] * float(q[k])) * scale[n]               (then + bias)
// The chain is cut into K blocks whose partial sums are stored and reloaded as floats (exact), so
// the cache blocking and which register tile computes an element never change its bits.
#pragma once

#include "common.h"

#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
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
// the 6-row VDPBF16PS tile was not measured there, so Zen 5 keeps the 8 rows it was tuned with (see MR_DP).
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

// ---- bfloat16 pair panels through AMX tiles (TDPBF16PS), where the CPU and the OS allow them -----
// A bf16 panel row (2*PANEL words, 128 bytes) is two AMX B-tile rows side by side: columns 0..15 and
// 16..31 of one k pair each, so sixteen panel rows at a stride of 128 bytes are a 16-pair x 16-column
// B tile as the panels lie (no repacking). An A tile is 16 rows of x's bf16 words, 16 pairs each.
// TDPBF16PS's own order inside a 16-pair step is not the FMA form's (measured on Intel Xeon with AMX: it
// agrees with neither sequential order, nor one exact sum per step, on most outputs), so this is a
// form of its own, chosen for every row count when chosen at all (build.bf16_dot_form), never mixed
// with the others. It keeps their invariance: an output element is C[m][n] over k steps 0, 16, 32, ...
// pairs in order, each step the same instruction on row m's words alone (rows of a tile never mix:
// tests/engine/test_kernels.py checks a row alone, in a batch and at every tile position bitwise),
// and a K tail is zero-padded to a whole step whatever M is. DAZ/FTZ as the instruction defines them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
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

// y = x @ W^T over bf16 panels (P, K_rows, 2 PANEL) through AMX; x: (M_pad, ldx) bf16 words, M_pad >= M a
// whole number of tiles, ldx >= 2 * ceil(K_rows / 16) * 16 zero-padded. Work item = (chunk of up to
// AMX_M_CHUNK rows, panel), panels fastest; store(m, n0, ncols, acc) as packed_gemm's.
template <class Store>
void amx_gemm(int64_t M, int64_t K_rows, int64_t P, const bf16* wp, const bf16* xp, int64_t ldx, int64_t out_features,
              const Store& store) {
  const int64_t num_mc = (M + AMX_M_CHUNK - 1) / AMX_M_CHUNK, items = num_mc * P;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t chunk = M <= 32 ? (items + threads - 1) / threads : chunk_for(items, 1);
  const int64_t steps = K_rows / AMX_PAIRS, tail = K_rows % AMX_PAIRS;
  if (M <= AMX_ROWS && tail == 0) {   // one row tile (decode at small batch): panels two at a time
    const int64_t groups = (P + 1) / 2;
    parallel_chunks(groups, (groups + threads - 1) / threads, [&](int64_t begin, int64_t end) {
      amx_configure(M, true);
      alignas(64) float acc[2 * AMX_ROWS * PANEL];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = 2 * g;
        const bf16* w = wp + p * K_rows * 2 * PANEL;
        if (p + 1 < P) {
          amx_block_pair(xp, ldx, w, w + K_rows * 2 * PANEL, steps, true, acc, acc + AMX_ROWS * PANEL);
        } else {
          amx_block<false, false>(xp, ldx, w, steps, 0, true, acc);   // tiles 0, 1, 4, 6, 7 only: the pair's config
        }
        for (int64_t q = p; q < std::min(P, p + 2); ++q) {
          const int64_t n0 = q * PANEL, ncols = std::min(PANEL, out_features - n0);
          for (int64_t i = 0; i < M; ++i) store(i, n0, ncols, acc + (q - p) * AMX_ROWS * PANEL + i * PANEL);
        }
      }
      _tile_release();
    });
    return;
  }
  parallel_chunks(items, chunk, [&](int64_t begin, int64_t end) {
    amx_configure(std::min<int64_t>(M, AMX_ROWS));
    alignas(64) float acc[2 * AMX_ROWS * PANEL];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mc = item / P, p = item % P;
      const int64_t n0 = p * PANEL, ncols = std::min(PANEL, out_features - n0);
      const bf16* w = wp + p * K_rows * 2 * PANEL;
      const int64_t m_end = std::min(M, (mc + 1) * AMX_M_CHUNK);
      for (int64_t m0 = mc * AMX_M_CHUNK; m0 < m_end; m0 += 2 * AMX_ROWS) {
        const bool two = m_end - m0 > AMX_ROWS, first = m0 == mc * AMX_M_CHUNK;
        if (two) {
          amx_block<true>(xp + m0 * ldx, ldx, w, steps, tail, first, acc);
        } else {
          amx_block<false>(xp + m0 * ldx, ldx, w, steps, tail, first, acc);
        }
        for (int64_t i = 0; i < std::min<int64_t>(2 * AMX_ROWS, m_end - m0); ++i) store(m0 + i, n0, ncols, acc + i * PANEL);
      }
    }
    _tile_release();
  });
}
#else
constexpr bool HAS_AMX = false;
inline bool amx_permitted() { return false; }
#endif

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

// The blocked loop shared by every kind. Work item = (M block, NP panels) (paired: see below), panels fastest
// (panels of one M block are contiguous in memory). A few rows (decode
// at small batch) only stream the weight: one contiguous share per thread reads best; float32 panels
// two at a time (NP = 2, AVX-512, the whole K in one pass: each row has four independent FMA chains),
// bf16 and int8 panels one at a time in K blocks with the next block prefetched (`two_panels` false).
// Measured (Zen 5, 2 threads, batch 1, the demo model's 120 layer linears + lm_head, cold, the forms
// interleaved in one process, 30-40 rounds): bf16 0.90-0.92x the two-panel stream's time, int8 0.95-0.97x,
// float32 1.04-1.06x. Many rows: parallel_walk (common.h), each thread walking its own share of the items
// in order, so the next item's first K block it prefetched is its own. Cache blocking: a K block
// of one panel (k_block panel rows, 16 KiB) stays in L1 while the M block's rows stream past it (float32
// past one M block: the whole K, the panel in L2, see K_BLOCK_F32); the M block's accumulators (M_BLOCK x
// PANEL floats, 12 KiB a panel) stay close.
//   tile(np, rows, m, k0, w, kc, buf, first, pf, pf_lines): rows m.. of panel rows k0..k0+kc-1 of the
//     np panels at w[0..np-1], accumulators in buf[0..np-1], prefetching pf_lines lines at each pf[q]
//   store(m, n0, ncols, acc): the finished accumulators of row m, columns n0..n0+ncols-1
// paired (a store taking two accumulator rows, StorePairs; P even): an item is panel p and panel p + P/2 for
// the same rows (gate and up columns of a fused gate_up weight), done one after the other (or together where a
// few rows stream two panels as one), and store(m, n0, ncols, acc_p, acc_p_plus_half) gets both; items are
// (M block, p < P/2). Each panel's accumulators go through the same chain over k as unpaired (the tile forms
// give the same bits whichever panels share a call), so each holds the same bits.
constexpr int64_t SMALL_M = 4;      // at most this many rows: streamed (two panels per work item where `two_panels`)
constexpr int64_t PREFETCH_BYTES = 16384;   // at most this much of the next K block is prefetched (L1: 48 KiB)

// packed_gemm's prefetch_bytes for bf16 and int8 panels at M rows: none for a few rows (M <= SMALL_M, the
// weight streamed once) where the tiles are narrow (narrow_tiles: AMD Zen 4, where this was measured), the
// hardware's prefetchers alone; PREFETCH_BYTES otherwise. Measured on Zen 4 (benchmarks/ab.py engine, the whole
// engine at batch 1 against the next K block prefetched to L1, 10-12 rounds each): bf16 1.062x and 1.063x the
// rate, int8 weights (bf16 activations) 1.103x (medians of the per-round ratios); 4 KiB of the next block instead
// of 16 was 0.957x. A plain read of the same weights in the same call pattern with no software prefetch
// (benchmarks/probes/linears_read.c) read 48-55 GB/s there beside a read probe of 46-57, about its rate, while the
// kernels streamed about a third slower. (Why the prefetches slowed the stream was not measured; a likely reason:
// each L1 prefetch holds one of the core's few L1 miss buffers until its line arrives.) Prefetches change no value.
inline int64_t few_rows_prefetch(int64_t M) { return M <= SMALL_M && narrow_tiles() ? 0 : PREFETCH_BYTES; }

template <class WT, class Tile, class Store>
void packed_gemm(int64_t M, int64_t K_rows, int64_t P, int64_t row_elems, int64_t k_block, int64_t mr, const WT* wp,
                 int64_t out_features, const Tile& tile, const Store& store, bool two_panels,
                 int64_t prefetch_bytes = PREFETCH_BYTES) {
  // paired: a store of two accumulator rows (StorePairs)
  constexpr bool paired = std::is_invocable_v<const Store&, int64_t, int64_t, int64_t, const float*, const float*>;
  const int64_t num_mb = (M + M_BLOCK - 1) / M_BLOCK;
  const int64_t NP = two_panels && M <= SMALL_M && NV == 2 ? 2 : 1;
  const int64_t stride = paired ? P / 2 : 1;   // an item's panels: p0 + j * stride, j < 2 paired, else j < NP
  const int64_t groups = paired ? P / 2 : (P + NP - 1) / NP;
  const int64_t items = num_mb * groups, threads = std::max(1, at::get_num_threads());
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(WT)), total_rows = P * K_rows;
  auto run_item = [&](int64_t item) {
    alignas(64) float acc[2][M_BLOCK * PANEL];
    const int64_t mb = item / groups, p0 = paired ? item % groups : (item % groups) * NP;
    const int64_t in_item = paired ? 2 : std::min(NP, P - p0);
    const int64_t m0 = mb * M_BLOCK, rows = std::min(M_BLOCK, M - m0);
    const int64_t kb = NP == 2 ? K_rows : k_block;       // streaming: the whole K in registers
    for (int64_t j0 = 0; j0 < in_item; j0 += NP) {      // passes of NP panels (paired, one panel a pass: two)
      const int64_t np = std::min(NP, in_item - j0);
      for (int64_t k0 = 0; k0 < K_rows; k0 += kb) {
        const int64_t kc = std::min(kb, K_rows - k0);
        const WT* w[2];
        const char* next[2];
        int64_t lines = 0;
        for (int64_t q = 0; q < np; ++q) {
          // the next k_block rows (PREFETCH_BYTES at most) of panel q's stream: its next block, or the first
          // block of the next panel this thread reads (the item's next pass, else the next item's panel q:
          // panels are contiguous); none past the weight's end
          const int64_t panel = p0 + (j0 + q) * stride, row = panel * K_rows + k0;
          int64_t ahead = row + kc;
          if (k0 + kc >= K_rows) {
            // (paired, the last item of an M block: the next is the next block's gate panel 0, not prefetched,
            // as unpaired prefetches nothing past its last panel)
            const int64_t next_panel = !paired ? panel + np
                                               : j0 + np < in_item ? p0 + (j0 + np) * stride
                                               : p0 + 1 < groups   ? p0 + 1 + q * stride : P;
            ahead = next_panel * K_rows;
          }
          w[q] = wp + row * row_elems;
          next[q] = reinterpret_cast<const char*>(wp + std::min(ahead, total_rows) * row_elems);
          lines = std::max<int64_t>(0, std::min(std::min(k_block, prefetch_bytes / row_bytes), total_rows - ahead)) *
                  row_bytes / 64;
        }
        const int64_t tiles = (rows + mr - 1) / mr, per_tile = (lines + tiles - 1) / tiles;
        for (int64_t i = 0, t = 0; i < rows; i += mr, ++t) {
          const int64_t own = std::max<int64_t>(0, std::min(per_tile, lines - t * per_tile));
          // (no address past the lines: with few of them, the later tiles own none)
          const int64_t skip = own > 0 ? t * per_tile * 64 : 0;
          const char* pf[2] = {next[0] + skip, np > 1 ? next[1] + skip : nullptr};
          float* bufs[2] = {acc[j0] + i * PANEL, acc[j0 + np - 1] + i * PANEL};
          tile(np, std::min(mr, rows - i), m0 + i, k0, w, kc, bufs, k0 == 0, pf, own);
        }
      }
    }
    if constexpr (paired) {
      const int64_t n0 = p0 * PANEL, ncols = std::min(PANEL, out_features / 2 - n0);
      for (int64_t i = 0; i < rows; ++i) store(m0 + i, n0, ncols, acc[0] + i * PANEL, acc[1] + i * PANEL);
    } else {
      for (int64_t q = 0; q < in_item; ++q) {
        const int64_t n0 = (p0 + q) * PANEL, ncols = std::min(PANEL, out_features - n0);
        for (int64_t i = 0; i < rows; ++i) store(m0 + i, n0, ncols, acc[q] + i * PANEL);
      }
    }
  };
  if (M <= 8) {   // one contiguous share per thread
    parallel_chunks(items, (items + threads - 1) / threads, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) run_item(item);
    });
  } else {
    parallel_walk(items, run_item);
  }
}

// y[m, n0 + j] = out(acc[j] * scale[n0 + j] (int8 only) + bias[n0 + j] (when given)), one rounding each
template <class OT>
struct StoreRows {
  OT* y;
  int64_t ld;
  const float* scale;
  const float* bias;
  void operator()(int64_t m, int64_t n0, int64_t ncols, const float* acc) const {
    OT* dst = y + m * ld + n0;
    for (int64_t j = 0; j < ncols; ++j) {
      float v = acc[j];
      if (scale) v = v * scale[n0 + j];
      if (bias) v = v + bias[n0 + j];
      store_scalar<OT>(dst + j, v);
    }
  }
};

// The paired form's store (packed_gemm `paired`): row m's gate values (columns n0.., from acc_g) and up
// values (columns half + n0.., from acc_u) rounded as StoreRows rounds them, then Op::apply(g, u, out, PANEL)
// writes y[m, n0 .. n0 + PANEL) from them (rowwise.h's SiluMul: silu(g) * up). y is (M, half): its row stride
// is half. ncols is always PANEL (pairable() asks for whole panels): loops of a fixed count, so the compiler's
// vector code needs no masks (masked reloads of the just-stored accumulators measured 2.8x slower).
template <class OT, class Op>
struct StorePairs {
  OT* y;
  int64_t half;
  const float* scale;
  const float* bias;
  void operator()(int64_t m, int64_t n0, int64_t /*ncols: PANEL*/, const float* acc_g, const float* acc_u) const {
    alignas(64) float a[PANEL], b[PANEL];
    alignas(64) OT g[PANEL], u[PANEL];
    for (int64_t j = 0; j < PANEL; ++j) a[j] = acc_g[j], b[j] = acc_u[j];
    if (scale)   // StoreRows' operations, in its order
      for (int64_t j = 0; j < PANEL; ++j) a[j] = a[j] * scale[n0 + j], b[j] = b[j] * scale[half + n0 + j];
    if (bias)
      for (int64_t j = 0; j < PANEL; ++j) a[j] = a[j] + bias[n0 + j], b[j] = b[j] + bias[half + n0 + j];
    for (int64_t j = 0; j < PANEL; ++j) store_scalar<OT>(g + j, a[j]), store_scalar<OT>(u + j, b[j]);
    Op::apply(g, u, y + m * half + n0, PANEL);
  }
};

// K blocks in panel rows: 16 KiB of one panel per block for every kind. Float32 over more than one M block
// (prefill) takes the whole K in one pass instead: its panels are re-read from L2 / L3 by every M block, and
// no accumulator goes to memory and back between blocks. Measured (Zen 5, 2 threads, the demo model's
// four linears x 30 layers, interleaved builds): 1882 rows 0.91x the time; 64 rows (one M block, weights
// from DRAM) 1.02x, so one M block keeps the blocks. Same bits either way (see the top of this file).
constexpr int64_t K_BLOCK_F32 = 128, K_BLOCK_BF16 = 128, K_BLOCK_I8 = 512;

// x as float32 rows of `width` >= K columns (zero-padded), at `data`: x itself when it is contiguous float32
// of that width and needs no rounding, else a converted copy (`round`: the values rounded to bf16 first, the
// bf16 kind's activations). A few rows of bf16 (batch-1 decode) are widened into this thread's scratch
// buffer (exact, as .to(float32) is), without a tensor: the dispatcher's conversion cost ~1 us a call, 120
// calls a decode step. Valid until the thread's next float_rows.
struct FloatRows {
  torch::Tensor owned;   // the converted copy, when one was made as a tensor
  const float* data;
};
constexpr int64_t SCRATCH_ROWS_FLOATS = int64_t{1} << 16;   // 256 KiB: rows widened without a tensor
inline FloatRows float_rows(const torch::Tensor& x, int64_t width, bool round) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.is_contiguous() && x.scalar_type() == torch::kFloat32 && width == K && !round) return {x, x.data_ptr<float>()};
  if (x.is_contiguous() && x.scalar_type() == torch::kBFloat16 && M * width <= SCRATCH_ROWS_FLOATS) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < M * width) scratch.resize(M * width);
    const bf16* src = data_of<bf16>(x);
    for (int64_t m = 0; m < M; ++m) {
      float* dst = scratch.data() + m * width;
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_float(src[m * K + k]);
      std::fill(dst + K, dst + width, 0.f);
    }
    return {torch::Tensor(), scratch.data()};
  }
  torch::Tensor xf = round && x.scalar_type() != torch::kBFloat16 ? x.to(torch::kBFloat16) : x;
  xf = xf.to(torch::kFloat32).contiguous();
  if (width != xf.size(1)) xf = torch::constant_pad_nd(xf, {0, width - xf.size(1)});
  return {xf, xf.data_ptr<float>()};
}

// x (M, K) float32 row-major in the float32 tiles' layout: the tile of rows m0 .. m0 + r - 1 (m0 a multiple of
// mr, r = min(mr, M - m0)) at out + m0 * K, its row i's k at [k * r + i], so that a tile's k loop reads x from one
// pointer as one stream. Row-major, a tile's 8 row pointers and the prefetch spread's state outgrow the 16
// general registers: GCC kept some in vector registers and moved one back every k step. The values are copied
// exactly, so no output's bits change (a tile's height or layout never changes an element's chain). Returns the
// calling thread's buffer, valid until its next call; the copy is split over the threads by tiles.
//
// The float32 linear takes this layout, the whole K in one pass (no K blocks: the tile's accumulators stay in
// registers over all of K, x is read as one stream and the panel streams from L2) and the next panel (64 KiB at
// most) prefetched to L2 over the tiles, where the tiles are narrow (narrow_tiles: Zen 4, where this was measured;
// other CPUs keep the forms measured best on them) and there are more than TILED_MIN_ROWS rows and either more than
// one M block (prefill) or at least TILED_MIN_PANELS panels. Measured (AMD Zen 4, 2 threads): a copy of the k loop, one
// thread, weights in cache, 64 rows: row-major in K blocks of 128 98-104 GFLOP/s, this layout in K blocks 106-110,
// this layout over the whole K 112-115 (FMA peak 117); the packed linear with the weight in cache at 64 rows, 2
// threads: gate_up's shape 202 -> 220 GFLOP/s, the lm_head's 195 -> 206. From DRAM (ab.py linears, the demo model's 120 layer linears,
// interleaved): at 64 rows gate_up 0.961x the time and the 576-column linears (o, down: 18 panels, each thread's
// first panel cold, now whole) 1.00-1.03x slower with this form, so fewer panels keep the K blocks; at 1882 rows
// all four 0.969x. The engine's round (profiling.py steps, HEAD and this tree alternating in 4 pairs of
// processes): 0.962x the time, prefill 0.975x, decode 0.96x.
constexpr int64_t TILED_MIN_ROWS = 8;     // a few-row step (team mode included) keeps the row-major streaming forms
constexpr int64_t TILED_MIN_PANELS = 64;  // 2048 output columns: gate_up and the lm_head of the demo model
constexpr int64_t TILED_PREFETCH_BYTES = 65536;   // of the next panel, to L2 (the whole 192 KiB panel of down cost)
inline const float* pack_row_tiles(const float* x, int64_t M, int64_t K, int64_t mr) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < M * K) buf.resize(M * K);
  float* out = buf.data();
  const int64_t tiles = (M + mr - 1) / mr;
  parallel_chunks(tiles, chunk_for(tiles, 1), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * mr, r = std::min(mr, M - m0);
      const float* src = x + m0 * K;
      float* dst = out + m0 * K;
      int64_t k = 0;
#if defined(__AVX2__)
      if (r == 8) {   // 8 x 8 blocks through registers
        for (; k + 8 <= K; k += 8) {
          __m256 v[8], u[8];
          for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + i * K + k);
          for (int i = 0; i < 8; i += 2) u[i] = _mm256_unpacklo_ps(v[i], v[i + 1]), u[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
          for (int i = 0; i < 8; i += 4) {
            v[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
            v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
            v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
            v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
          }
          for (int i = 0; i < 4; ++i) {
            _mm256_storeu_ps(dst + (k + i) * 8, _mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
            _mm256_storeu_ps(dst + (k + i + 4) * 8, _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
          }
        }
      }
#endif
      for (; k < K; ++k)
        for (int64_t i = 0; i < r; ++i) dst[k * r + i] = src[i * K + k];
    }
  });
  return out;
}

// y = x @ W^T (+ bias) for a packed weight of any kind (see the top of this file), in `out` when given
// (contiguous (M, out_features) of y's dtype; (M, out_features / 2) in the paired form), else a new tensor.
// x: (M, K) float32 or bfloat16; packed: float32 (P, K, PANEL), bfloat16 (P, ceil(K/2), 2 PANEL) or
// int8 (P, K, PANEL) with scale (out_features,) float32; bias: (out_features,) float32 or bfloat16.
// out_bf16: y in bfloat16 (each value rounded once), else float32. form (bf16 panels only, Bf16Form):
// BF16_FMA two FMAs per pair; BF16_DP VDPBF16PS at M > SMALL_M rows (the FMA form's bits; fewer rows, or
// a CPU without it, use the FMA form); BF16_AMX AMX tiles at every M (bits of their own, see amx_gemm;
// raises where the build or the OS lacks AMX).
enum Bf16Form : int64_t { BF16_FMA = 0, BF16_DP = 1, BF16_AMX = 2 };
// Whether linear_impl's paired form serves this weight: each half a whole number of panels, and not AMX
// tiles (amx_gemm has no paired store; the bf16 form is ignored by other kinds)
inline bool pairable(c10::ScalarType kind, int64_t out_features, int64_t form) {
  return out_features % (2 * PANEL) == 0 && !(kind == torch::kBFloat16 && form == BF16_AMX);
}
// linear_impl<Op>: the paired form (packed_gemm `paired`, StorePairs): y (M, out_features / 2) =
// Op::apply(gate, up) of the two halves' outputs, each half's values the bits linear gives them; needs
// pairable() (rowwise.h's linear_silu takes the two calls otherwise).
template <class PairOp = void>
torch::Tensor linear_impl(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> scale, bool out_bf16, int64_t form, const torch::Tensor* out = nullptr) {
  constexpr bool paired = !std::is_void_v<PairOp>;
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  is_bf16(x, "x");
  const auto kind = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
              (kind == torch::kFloat32 || kind == torch::kBFloat16 || kind == torch::kInt8),
              "packed weight must be contiguous float32, bfloat16 or int8 (num_panels, rows, elems)");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const int64_t row_elems = kind == torch::kBFloat16 ? 2 * PANEL : PANEL;
  const int64_t K_rows = kind == torch::kBFloat16 ? (K + 1) / 2 : K;
  TORCH_CHECK(packed.size(2) == row_elems, "packed weight's last dimension must be ", row_elems);
  TORCH_CHECK(packed.size(1) == K_rows, "in_features mismatch: x has ", K, ", weight ",
              kind == torch::kBFloat16 ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(out_features <= P * PANEL && out_features > (P - 1) * PANEL, "bad out_features");
  torch::Tensor b_f, s_f;
  if (bias.has_value() && bias->defined()) {
    b_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b_f.numel() == out_features, "bad bias");
  }
  TORCH_CHECK((kind == torch::kInt8) == (scale.has_value() && scale->defined()), "int8 weights need a scale, others none");
  if (kind == torch::kInt8) {
    s_f = scale->contiguous();
    TORCH_CHECK(s_f.scalar_type() == torch::kFloat32 && s_f.numel() == out_features, "scale must be (out_features,) float32");
  }
  TORCH_CHECK(!paired || pairable(kind, out_features, form), "the paired form needs whole panels in each half and no AMX");
  const int64_t y_cols = paired ? out_features / 2 : out_features;
  const auto y_dtype = out_bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor y;
  if (out) {   // the caller's buffer (DecoderStack's workspace): no allocation a call
    TORCH_CHECK(out->dim() == 2 && out->size(0) == M && out->size(1) == y_cols && out->is_contiguous() &&
                out->scalar_type() == y_dtype, "out must be contiguous (M, ", y_cols, ") ", y_dtype);
    y = *out;
  } else {
    y = torch::empty({M, y_cols}, x.options().dtype(y_dtype));
  }
  if (M == 0) return y;
  const float* bp = b_f.defined() ? b_f.data_ptr<float>() : nullptr;
  const float* sp = s_f.defined() ? s_f.data_ptr<float>() : nullptr;
  // one tile through a micro kernel family, np (1 or 2) panels
  auto tiles = [](auto acc, const auto& micro, int64_t np, int64_t rows, const float* x, int64_t ldx,
                  const auto* const* w, int64_t col_elems, int64_t kc, float* const* buf, bool first,
                  const char* const* pf, int64_t n) {
    constexpr int ACC = decltype(acc)::value;
    if (np == 2) return tile_kernel<2, ACC>(micro, rows, x, ldx, w, col_elems, kc, buf, first, pf, n);
    tile_kernel<1, ACC>(micro, rows, x, ldx, w, col_elems, kc, buf, first, pf, n);
  };
  using Wide = std::integral_constant<int, ACC_WIDE>;
  auto run = [&](auto store) {
    if (kind == torch::kFloat32) {
      const FloatRows xf = float_rows(x, K, false);
      const int64_t mr = f32_tile_rows();
      // x in the tiles' own layout where pack_row_tiles says; a tile at row m (a multiple of mr) of r rows finds
      // its k0.. at m * K + k0 * r there
      // (never in team mode: there parallel_chunks would copy only this thread's share of the tiles)
      const bool tiled = narrow_tiles() && M > TILED_MIN_ROWS && (M > M_BLOCK || P >= TILED_MIN_PANELS) &&
                         team_share.threads == 0;
      const float* xp = tiled ? pack_row_tiles(xf.data, M, K, mr) : xf.data;
      packed_gemm(M, K, P, PANEL, M > M_BLOCK || tiled ? K : K_BLOCK_F32, mr, packed.data_ptr<float>(), out_features,
                  [&](int64_t np, int64_t rows, int64_t m, int64_t k0, const float* const* w, int64_t kc,
                      float* const* buf, bool first, const char* const* pf, int64_t n) {
                    if (tiled) {
                      tiles(Wide{}, MicroPlain<true>{}, np, rows, xp + m * K + k0 * rows, rows, w, Vec::W, kc, buf,
                            first, pf, n);
                    } else {
                      tiles(Wide{}, MicroPlain<>{}, np, rows, xp + m * K + k0, K, w, Vec::W, kc, buf, first, pf, n);
                    }
                  }, store, true, tiled ? TILED_PREFETCH_BYTES : PREFETCH_BYTES);
    } else if (kind == torch::kInt8) {
      const FloatRows xf = float_rows(x, K, false);
      const float* xp = xf.data;
      packed_gemm(M, K, P, PANEL, K_BLOCK_I8, MR_WIDE, packed.data_ptr<int8_t>(), out_features,
                  [&](int64_t np, int64_t rows, int64_t m, int64_t k0, const int8_t* const* w, int64_t kc,
                      float* const* buf, bool first, const char* const* pf, int64_t n) {
                    tiles(Wide{}, MicroPlain<>{}, np, rows, xp + m * K + k0, K, w, Vec::W, kc, buf, first, pf, n);
                  }, store, false, few_rows_prefetch(M));
    } else {
      const bf16* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
      const int64_t width = 2 * K_rows;
      TORCH_CHECK(form >= BF16_FMA && form <= BF16_AMX, "bf16 form must be 0 (FMA), 1 (VDPBF16PS) or 2 (AMX)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
      if (form == BF16_AMX) {
        TORCH_CHECK(amx_permitted(), "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
        // x as bf16 words, rows padded to whole tiles and columns to whole 16-pair steps, zeros around
        const int64_t m_pad = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
        const int64_t ldx = (K_rows + AMX_PAIRS - 1) / AMX_PAIRS * AMX_PAIRS * 2;
        torch::Tensor xb = torch::zeros({m_pad, ldx}, x.options().dtype(torch::kBFloat16));
        xb.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
        if constexpr (!paired) amx_gemm(M, K_rows, P, wp, data_of<bf16>(xb), ldx, out_features, store);
        return;
      }
#else
      TORCH_CHECK(form != BF16_AMX, "this build has no AMX (needs AMX-BF16 at build time and Linux)");
#endif
      const bool native = form == BF16_DP;
#if defined(__AVX512BF16__)
      static_assert(MR_DP == 8, "the switch below covers rows 1 .. MR_DP");
      if (native && M > SMALL_M) {   // a few rows keep the FMA form's two-panel streaming (same bits)
        torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
        if (width != K) xb = torch::constant_pad_nd(xb, {0, width - K});
        const bf16* xp = data_of<bf16>(xb);
        packed_gemm(M, K_rows, P, 2 * PANEL, K_BLOCK_BF16, dp_tile_rows(), wp, out_features,
                    [&](int64_t np, int64_t rows, int64_t m, int64_t k0, const bf16* const* w, int64_t kc,
                        float* const* buf, bool first, const char* const* pf, int64_t n) {
                      const bf16* xr = xp + m * width + 2 * k0;
                      for (int64_t q = 0; q < np; ++q) {
                        const int64_t own = q == 0 ? n : 0;
#define LMI_DP(R) \
  case R: micro_dpbf16<R>(xr, width, w[q], kc, buf[q], first, pf[0], own); break;
                        switch (rows) {
                          LMI_DP(1) LMI_DP(2) LMI_DP(3) LMI_DP(4) LMI_DP(5) LMI_DP(6) LMI_DP(7)
                          default: micro_dpbf16<MR_DP>(xr, width, w[q], kc, buf[q], first, pf[0], own);
                        }
#undef LMI_DP
                      }
                    }, store, false);
        return;
      }
#endif
      (void)native;
      const FloatRows xf = float_rows(x, width, true);
      const float* xp = xf.data;
      packed_gemm(M, K_rows, P, 2 * PANEL, K_BLOCK_BF16, MR_WIDE, wp, out_features,
                  [&](int64_t np, int64_t rows, int64_t m, int64_t k0, const bf16* const* w, int64_t kc,
                      float* const* buf, bool first, const char* const* pf, int64_t n) {
                    tiles(Wide{}, MicroBF16{}, np, rows, xp + m * width + 2 * k0, width, w, 2 * Vec::W, kc, buf, first, pf, n);
                  }, store, false, few_rows_prefetch(M));
    }
  };
  if constexpr (paired) {
    const int64_t half = out_features / 2;
    if (out_bf16) {
      run(StorePairs<bf16, PairOp>{data_of<bf16>(y), half, sp, bp});
    } else {
      run(StorePairs<float, PairOp>{y.data_ptr<float>(), half, sp, bp});
    }
  } else if (out_bf16) {
    run(StoreRows<bf16>{data_of<bf16>(y), out_features, sp, bp});
  } else {
    run(StoreRows<float>{y.data_ptr<float>(), out_features, sp, bp});
  }
  return y;
}

// Rows `ids` of a packed float32 or bfloat16 weight (PackedWeight.rows: an embedding lookup on a tied
// lm_head), exact copies in the panels' dtype: ids (n,) int64 in [0, out_features) -> (n, in_features).
// float32 panels (P, K, PANEL): row id = panels[id / PANEL][k][id % PANEL]; bfloat16 (P, Kp, 2 PANEL): element
// 2i + e of row id = panels[id / PANEL][i][2 (id % PANEL) + e].
torch::Tensor packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t out_features, int64_t in_features) {
  const auto kind = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && (kind == torch::kFloat32 || kind == torch::kBFloat16),
              "packed must be contiguous float32 or bfloat16 panels");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be (n,) int64");
  ids = ids.contiguous();
  const int64_t n = ids.size(0), P = packed.size(0), rows = packed.size(1), width = packed.size(2);
  const bool bf = kind == torch::kBFloat16;
  TORCH_CHECK(width == (bf ? 2 * PANEL : PANEL) && out_features <= P * PANEL &&
              in_features <= (bf ? 2 * rows : rows), "panels do not match out / in features");
  auto out = torch::empty({n, in_features}, packed.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < out_features, "id ", ip[r], " out of range");
  for (int64_t r = 0; r < n; ++r) {
    const int64_t p = ip[r] / PANEL, j = ip[r] % PANEL;
    if (bf) {
      const bf16* src = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>()) + p * rows * width + 2 * j;
      bf16* dst = data_of<bf16>(out) + r * in_features;
      for (int64_t k = 0; k < in_features; ++k) dst[k] = src[(k / 2) * width + (k % 2)];
    } else {
      const float* src = packed.data_ptr<float>() + p * rows * width + j;
      float* dst = out.data_ptr<float>() + r * in_features;
      for (int64_t k = 0; k < in_features; ++k) dst[k] = src[k * width];
    }
  }
  return out;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> scale, bool out_bf16, int64_t form) {
  return linear_impl<void>(x, packed, out_features, bias, scale, out_bf16, form);
}

}  // namespace
