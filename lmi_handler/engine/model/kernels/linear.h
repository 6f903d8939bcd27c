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

namespace {

constexpr int64_t PANEL = 32;           // output columns per packed weight panel
constexpr int NV = PANEL / Vec::W;      // vectors per panel row
constexpr int64_t MR = 6;               // rows per register tile
constexpr int64_t M_BLOCK = 96;         // rows per cache block, a multiple of MR
static_assert(NV % 2 == 0, "PANEL must hold an even number of vectors");

// Prefetch: `pf`, `pf_lines` are cache lines (64 bytes) of weights to pull in while a tile runs,
// spread over its k loop. The linear prefetches the next K block of its stream while the current one
// is computed: without it a decode step waits on DRAM for every layer's weights (measured 161 vs 84 ms
// for the 30 layers' fp32 linears at M=64, weights cold vs in cache). No effect on the arithmetic.
inline void prefetch_share(const char* pf, int64_t pf_lines, int64_t per_k, int64_t k) {
  prefetch_lines(pf, k * per_k, std::min(pf_lines, (k + 1) * per_k));
}

// ---- float32 panels: R rows of x (stride ldx), panel rows k = 0..kc-1, C vectors of columns ------
// acc[i][j] = fma(x[i, k], w[k, j], acc[i][j]) in k order; acc lives in `buf` (R rows of stride
// PANEL) between K blocks.
template <int R, int C>
void micro_f32(const float* x, int64_t ldx, const float* w, int64_t kc, float* buf, bool first,
               const char* pf, int64_t pf_lines) {
  const int64_t per_k = pf_lines > 0 ? (pf_lines + kc - 1) / kc : 0;
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(buf + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
    prefetch_share(pf, pf_lines, per_k, k);
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

// ---- bfloat16 pair panels, two FMAs per pair on widened values (any CPU) -------------------------
// x: floats holding bf16 values, pairs at x[2i], x[2i + 1]; w: kc panel rows of 2*PANEL bf16 (the
// words of C vectors of columns); per accumulator: odd element, then even, pair by pair.
template <int R, int C>
void micro_bf16(const float* x, int64_t ldx, const bf16* w, int64_t kc, float* buf, bool first,
                const char* pf, int64_t pf_lines) {
  const int64_t per_k = pf_lines > 0 ? (pf_lines + kc - 1) / kc : 0;
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(buf + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
    prefetch_share(pf, pf_lines, per_k, k);
    Vec lo[C], hi[C];
    for (int j = 0; j < C; ++j) {
      const auto words = Vec::load_words(w + k * 2 * PANEL + j * 2 * Vec::W);
      lo[j] = Vec::pair_lo(words);
      hi[j] = Vec::pair_hi(words);
    }
    for (int i = 0; i < R; ++i) {
      const Vec odd = Vec::bcast(x[i * ldx + 2 * k + 1]), even = Vec::bcast(x[i * ldx + 2 * k]);
      for (int j = 0; j < C; ++j) acc[i][j] = Vec::fma(odd, hi[j], acc[i][j]);
      for (int j = 0; j < C; ++j) acc[i][j] = Vec::fma(even, lo[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j].store(buf + i * PANEL + j * Vec::W);
}

#if defined(__AVX512BF16__)
constexpr bool NATIVE_BF16 = true;
// The same pairs through VDPBF16PS: x as bf16 words (a pair per 32 bits), one instruction per pair
// and 16 columns. Whole panel rows only (AVX-512: NV == 2).
template <int R>
void micro_dpbf16(const bf16* x, int64_t ldx, const bf16* w, int64_t kc, float* buf, bool first,
                  const char* pf, int64_t pf_lines) {
  const int64_t per_k = pf_lines > 0 ? (pf_lines + kc - 1) / kc : 0;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + i * PANEL + j * 16);
  for (int64_t k = 0; k < kc; ++k) {
    prefetch_share(pf, pf_lines, per_k, k);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + k * 2 * PANEL);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + k * 2 * PANEL + 32);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(buf + i * PANEL + j * 16, acc[i][j]);
}
#else
constexpr bool NATIVE_BF16 = false;
#endif

// ---- int8 panels: k rows of PANEL int8, widened to floats (exact) -------------------------------
template <int R, int C>
void micro_i8(const float* x, int64_t ldx, const int8_t* w, int64_t kc, float* buf, bool first,
              const char* pf, int64_t pf_lines) {
  const int64_t per_k = pf_lines > 0 ? (pf_lines + kc - 1) / kc : 0;
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(buf + i * PANEL + j * Vec::W);
  for (int64_t k = 0; k < kc; ++k) {
    prefetch_share(pf, pf_lines, per_k, k);
    Vec b[C];
    for (int j = 0; j < C; ++j) b[j] = Vec::load_i8(w + k * PANEL + j * Vec::W);
    for (int i = 0; i < R; ++i) {
      const Vec a = Vec::bcast(x[i * ldx + k]);
      for (int j = 0; j < C; ++j) acc[i][j] = Vec::fma(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j].store(buf + i * PANEL + j * Vec::W);
}

// R rows over the whole panel: one call when R x NV accumulators fit in 12 registers, else in column
// pairs (R x 2 accumulators: the classic 6x16 shape on AVX2, which loads each W vector once). `Micro`
// is one of the micro kernels above; `col_elems` the weight elements per column vector in a panel row
// (W, or 2 W for bf16 pairs).
template <int R, class WT, class Micro>
void rows_kernel(const Micro& micro, const float* x, int64_t ldx, const WT* w, int64_t col_elems, int64_t kc,
                 float* buf, bool first, const char* pf, int64_t pf_lines) {
  if constexpr (R * NV <= 12) {
    micro.template run<R, NV>(x, ldx, w, kc, buf, first, pf, pf_lines);
  } else {
    for (int c = 0; c < NV; c += 2)
      micro.template run<R, 2>(x, ldx, w + c * col_elems, kc, buf + c * Vec::W, first, pf, c == 0 ? pf_lines : 0);
  }
}

struct MicroF32 {
  template <int R, int C>
  void run(const float* x, int64_t ldx, const float* w, int64_t kc, float* buf, bool first, const char* pf,
           int64_t n) const { micro_f32<R, C>(x, ldx, w, kc, buf, first, pf, n); }
};
struct MicroBF16 {
  template <int R, int C>
  void run(const float* x, int64_t ldx, const bf16* w, int64_t kc, float* buf, bool first, const char* pf,
           int64_t n) const { micro_bf16<R, C>(x, ldx, w, kc, buf, first, pf, n); }
};
struct MicroI8 {
  template <int R, int C>
  void run(const float* x, int64_t ldx, const int8_t* w, int64_t kc, float* buf, bool first, const char* pf,
           int64_t n) const { micro_i8<R, C>(x, ldx, w, kc, buf, first, pf, n); }
};

template <class WT, class Micro>
void tile_kernel(const Micro& micro, int64_t rows, const float* x, int64_t ldx, const WT* w, int64_t col_elems,
                 int64_t kc, float* buf, bool first, const char* pf, int64_t pf_lines) {
  switch (rows) {
    case 1: return rows_kernel<1>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
    case 2: return rows_kernel<2>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
    case 3: return rows_kernel<3>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
    case 4: return rows_kernel<4>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
    case 5: return rows_kernel<5>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
    default: return rows_kernel<6>(micro, x, ldx, w, col_elems, kc, buf, first, pf, pf_lines);
  }
}

// The blocked loop shared by every kind. Work item = (M block, panel), panels fastest: threads split
// the panels of each M block (panels of one M block are contiguous in memory). A few rows (decode at
// small batch) only stream the weight: one contiguous share per thread reads best. Many rows: small
// chunks balance the threads. Cache blocking: a K block of one panel (k_block panel rows, 16 KiB) stays
// in L1 while the M block's rows stream past it; the M block's accumulators (M_BLOCK x PANEL floats,
// 12 KiB) stay close.
//   tile(rows, m, k0, w, kc, buf, first, pf, pf_lines): rows m.. of panel rows k0..k0+kc-1 at w
//   store(m, n0, ncols, acc): the finished accumulators of row m, columns n0..n0+ncols-1
template <class WT, class Tile, class Store>
void packed_gemm(int64_t M, int64_t K_rows, int64_t P, int64_t row_elems, int64_t k_block, const WT* wp,
                 int64_t out_features, const Tile& tile, const Store& store) {
  const int64_t num_mb = (M + M_BLOCK - 1) / M_BLOCK;
  const int64_t items = num_mb * P, threads = std::max(1, at::get_num_threads());
  const int64_t chunk = M <= 8 ? (items + threads - 1) / threads : chunk_for(items, 1);
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(WT));
  parallel_chunks(items, chunk, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[M_BLOCK * PANEL];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mb = item / P, p = item % P;
      const int64_t m0 = mb * M_BLOCK, rows = std::min(M_BLOCK, M - m0);
      const int64_t n0 = p * PANEL, ncols = std::min(PANEL, out_features - n0);
      for (int64_t k0 = 0; k0 < K_rows; k0 += k_block) {
        const int64_t kc = std::min(k_block, K_rows - k0);
        const WT* w = wp + (p * K_rows + k0) * row_elems;
        // the next k_block rows of the stream (this panel's next block, or the next panel's first:
        // panels are contiguous), spread over the row tiles; none past the weight's end
        const char* next = reinterpret_cast<const char*>(w + kc * row_elems);
        const int64_t lines = std::min(k_block, P * K_rows - (p * K_rows + k0 + kc)) * row_bytes / 64;
        const int64_t tiles = (rows + MR - 1) / MR, per_tile = (lines + tiles - 1) / tiles;
        for (int64_t i = 0, t = 0; i < rows; i += MR, ++t) {
          const int64_t own = std::max<int64_t>(0, std::min(per_tile, lines - t * per_tile));
          tile(std::min(MR, rows - i), m0 + i, k0, w, kc, buf + i * PANEL, k0 == 0,
               own > 0 ? next + t * per_tile * 64 : nullptr, own);
        }
      }
      for (int64_t i = 0; i < rows; ++i) store(m0 + i, n0, ncols, buf + i * PANEL);
    }
  });
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

// K blocks in panel rows: 16 KiB of one panel per block for every kind
constexpr int64_t K_BLOCK_F32 = 128, K_BLOCK_BF16 = 128, K_BLOCK_I8 = 512;

// x as float32 rows, `width` >= K columns (zero-padded): x itself when it is float32 of that width,
// else a converted copy; `round`: the values rounded to bf16 first (the bf16 kind's activations)
inline torch::Tensor float_rows(const torch::Tensor& x, int64_t width, bool round) {
  torch::Tensor xf = round && x.scalar_type() != torch::kBFloat16 ? x.to(torch::kBFloat16) : x;
  xf = xf.to(torch::kFloat32).contiguous();
  if (width != xf.size(1)) xf = torch::constant_pad_nd(xf, {0, width - xf.size(1)});
  return xf;
}

// y = x @ W^T (+ bias) for a packed weight of any kind (see the top of this file).
// x: (M, K) float32 or bfloat16; packed: float32 (P, K, PANEL), bfloat16 (P, ceil(K/2), 2 PANEL) or
// int8 (P, K, PANEL) with scale (out_features,) float32; bias: (out_features,) float32 or bfloat16.
// out_bf16: y in bfloat16 (each value rounded once), else float32. native: VDPBF16PS for bf16 panels
// (same bits as the FMA form; ignored where the CPU lacks it).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> scale, bool out_bf16, bool native) {
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
  auto y = torch::empty({M, out_features}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  if (M == 0) return y;
  const float* bp = b_f.defined() ? b_f.data_ptr<float>() : nullptr;
  const float* sp = s_f.defined() ? s_f.data_ptr<float>() : nullptr;
  auto run = [&](auto store) {
    if (kind == torch::kFloat32) {
      const torch::Tensor xf = float_rows(x, K, false);
      const float* xp = xf.data_ptr<float>();
      const float* wp = packed.data_ptr<float>();
      packed_gemm(M, K, P, PANEL, K_BLOCK_F32, wp, out_features,
                  [&](int64_t rows, int64_t m, int64_t k0, const float* w, int64_t kc, float* buf, bool first,
                      const char* pf, int64_t n) {
                    tile_kernel(MicroF32{}, rows, xp + m * K + k0, K, w, Vec::W, kc, buf, first, pf, n);
                  }, store);
    } else if (kind == torch::kInt8) {
      const torch::Tensor xf = float_rows(x, K, false);
      const float* xp = xf.data_ptr<float>();
      const int8_t* wp = packed.data_ptr<int8_t>();
      packed_gemm(M, K, P, PANEL, K_BLOCK_I8, wp, out_features,
                  [&](int64_t rows, int64_t m, int64_t k0, const int8_t* w, int64_t kc, float* buf, bool first,
                      const char* pf, int64_t n) {
                    tile_kernel(MicroI8{}, rows, xp + m * K + k0, K, w, Vec::W, kc, buf, first, pf, n);
                  }, store);
    } else {
      const bf16* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
      const int64_t width = 2 * K_rows;
#if defined(__AVX512BF16__)
      if (native) {
        torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
        if (width != K) xb = torch::constant_pad_nd(xb, {0, width - K});
        const bf16* xp = data_of<bf16>(xb);
        packed_gemm(M, K_rows, P, 2 * PANEL, K_BLOCK_BF16, wp, out_features,
                    [&](int64_t rows, int64_t m, int64_t k0, const bf16* w, int64_t kc, float* buf, bool first,
                        const char* pf, int64_t n) {
                      const bf16* xr = xp + m * width + 2 * k0;
                      switch (rows) {
                        case 1: return micro_dpbf16<1>(xr, width, w, kc, buf, first, pf, n);
                        case 2: return micro_dpbf16<2>(xr, width, w, kc, buf, first, pf, n);
                        case 3: return micro_dpbf16<3>(xr, width, w, kc, buf, first, pf, n);
                        case 4: return micro_dpbf16<4>(xr, width, w, kc, buf, first, pf, n);
                        case 5: return micro_dpbf16<5>(xr, width, w, kc, buf, first, pf, n);
                        default: return micro_dpbf16<6>(xr, width, w, kc, buf, first, pf, n);
                      }
                    }, store);
        return;
      }
#endif
      (void)native;
      const torch::Tensor xf = float_rows(x, width, true);
      const float* xp = xf.data_ptr<float>();
      packed_gemm(M, K_rows, P, 2 * PANEL, K_BLOCK_BF16, wp, out_features,
                  [&](int64_t rows, int64_t m, int64_t k0, const bf16* w, int64_t kc, float* buf, bool first,
                      const char* pf, int64_t n) {
                    tile_kernel(MicroBF16{}, rows, xp + m * width + 2 * k0, width, w, 2 * Vec::W, kc, buf, first,
                                pf, n);
                  }, store);
    }
  };
  if (out_bf16) {
    run(StoreRows<bf16>{data_of<bf16>(y), out_features, sp, bp});
  } else {
    run(StoreRows<float>{y.data_ptr<float>(), out_features, sp, bp});
  }
  return y;
}

}  // namespace
