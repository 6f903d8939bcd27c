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
//            FMAs on widened values give the same bits (checked at start-up: bf16_form.py).
//   int8     (P, K, PANEL) + scale (N,) float32: W[n][k] ~ scale[n] * q[n][k] (per output channel)
//            y = (fma chain over k of x[k] * float(q[k])) * scale[n]               (then + bias)
// The chain is cut into K blocks whose partial sums are stored and reloaded as floats (exact), so
// the cache blocking and which register tile computes an element never change its bits.
//
// Files, one per instruction family and one driver:
//   linear_tiles.h   panel and tile shapes, the CPU's tile heights, weight prefetch (shared by all)
//   linear_fma.h     FMA micro kernels on Vec: float32, int8, bfloat16 as two FMAs per pair (any CPU)
//   linear_dpbf16.h  bfloat16 through VDPBF16PS (AVX512-BF16)
//   linear_amx.h     bfloat16 through AMX tiles (AMX-BF16)
//   linear_driver.h  work items, threads and cache blocking for every form; stores; x's float rows
//   linear.h         this file: the entry point (checks, the form for each kind, the Python-facing calls)
#pragma once

// (in the order the code stood in one file: the compiler's inlining across the unit follows it)
#include "linear_fma.h"
#include "linear_dpbf16.h"
#include "linear_amx.h"
#include "linear_driver.h"

#include <type_traits>

namespace {

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
      const bool tiled = narrow_tiles() && M > TILED_MIN_ROWS && (M > M_BLOCK || P >= TILED_MIN_PANELS);
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
#if LMI_AMX
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
