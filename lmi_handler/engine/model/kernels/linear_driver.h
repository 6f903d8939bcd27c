// How the linear's work is cut into items and handed to the threads, for every form: packed_gemm (the FMA
// and VDPBF16PS forms: M blocks x panels, K blocks, the weight prefetch), amx_gemm (AMX tiles: row chunks x
// panels), pack_row_tiles (the float32 tiles' copy of x); the stores of finished rows and x's conversion to
// float rows. Every parallel region of the linear is here (the primitives, parallel_chunks and parallel_walk,
// in common.h, over pool.h's threads: items claimed dynamically, so a descheduled thread holds back only the item
// it runs); the forms' micro kernels are called through the `tile` callbacks linear_impl (linear.h) passes, and
// never see a thread.
#pragma once

#include "linear_amx.h"
#include "linear_tiles.h"

#include <type_traits>

namespace {

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
  const int64_t items = num_mb * groups;
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
  // a contiguous share per thread (a few rows stream the weight: one stream a thread reads best), the shares of a
  // thread that is late taken from their back by the others
  parallel_walk(items, run_item);
}

#if LMI_AMX
// y = x @ W^T over bf16 panels (P, K_rows, 2 PANEL) through AMX; x: (M_pad, ldx) bf16 words, M_pad >= M a
// whole number of tiles, ldx >= 2 * ceil(K_rows / 16) * 16 zero-padded. Work item = (chunk of up to
// AMX_M_CHUNK rows, panel), panels fastest; store(m, n0, ncols, acc) as packed_gemm's.
template <class Store>
void amx_gemm(int64_t M, int64_t K_rows, int64_t P, const bf16* wp, const bf16* xp, int64_t ldx, int64_t out_features,
              const Store& store) {
  const int64_t num_mc = (M + AMX_M_CHUNK - 1) / AMX_M_CHUNK, items = num_mc * P;
  const int64_t chunk = chunk_for(items, 1);
  const int64_t steps = K_rows / AMX_PAIRS, tail = K_rows % AMX_PAIRS;
  if (M <= AMX_ROWS && tail == 0) {   // one row tile (decode at small batch): panels two at a time
    const int64_t groups = (P + 1) / 2;
    parallel_chunks(groups, chunk_for(groups, 1), [&](int64_t begin, int64_t end) {
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
#endif

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
// from DRAM) 1.02x, so one M block keeps the blocks. Same bits either way (see linear.h's top).
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
constexpr int64_t TILED_MIN_ROWS = 8;     // a few-row step keeps the row-major streaming forms
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

}  // namespace
