// The row-invariant linear over 4-bit and 8-bit weight codes with group scales and zero points
// (pre-quantized GPTQ / AWQ / compressed-tensors / FP8 checkpoints, option.quantize=int4: engine/model/quant/).
//
// Layout (engine/model/quant/weight.py packs it; PANEL output columns per panel, zero-padded):
//   4 bits (P, K, PANEL / 2) uint8: byte b of panel row k holds column b in its low nibble and column
//          b + PANEL / 2 in its high nibble (so each vector of columns is one shift and mask of loaded bytes)
//   8 bits (P, K, PANEL) uint8:     byte j of panel row k is column j's code
//   scales, zeros: (G, P * PANEL) float32, G = ceil(K / group_size); row k's group is k / group_size (a
//          checkpoint's act-order permutation is applied to x's columns before the call, quant/weight.py)
//   fmt: CODE_INT, a code's value is the integer itself; CODE_E4M3 (8 bits), a code is a float8 e4m3fn byte
//          and its value the number it holds (FP8 checkpoints; their zeros are 0); CODE_E2M1 (4 bits), a code is
//          an e2m1 nibble and its value E2M1_VALUES[code] (MXFP4 experts, quant/mxfp4.py; zeros 0, scales powers
//          of two: every value exact)
// Arithmetic: w[k][n] = (value(code) - zero[g][n]) * scale[g][n] (two float32 operations: the subtraction is
// exact, one rounding in the product; e4m3 skips the subtraction of its zero 0, which changes no bit: x - 0 is
// x, -0 included), then linear_fma.h's float32 chain
// y = fma(x[k], w[k], y) over k in order, cut into K blocks as every kind (linear.h's top). So y has exactly the
// bits of the float32 packed linear over the dequantized weight (tested), and a row's bits never depend on the
// other rows.
//
// How: each K block of a panel (K_BLOCK_Q rows) is dequantized once into this thread's float buffer (16 KiB,
// L1) by the first tile of an item that reads it, and every tile of the M block runs the float32 micro kernel
// over it (packed_gemm, linear_driver.h: the same work items and threads). A few rows (decode) skip the buffer:
// each panel row is dequantized and multiplied at once (few_rows, the same chain). An e4m3 byte becomes its
// float32 number in registers (e4m3_to_float16x: through float16, F16C), never a float copy of the weight.
#pragma once

#include <cstring>
#include <limits>

#include "linear_fma.h"
#include "linear_driver.h"

namespace {

constexpr int64_t K_BLOCK_Q = 128;   // panel rows per K block: the float buffer is K_BLOCK_Q x PANEL floats
enum CodeFmt : int { CODE_INT = 0, CODE_E4M3 = 1, CODE_E2M1 = 2 };   // what a code is (see the top)
// an e2m1 code's value (OCP MX: bit 3 the sign, bits 0-2 the magnitude)
constexpr float E2M1_VALUES[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                   -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The float8 e4m3fn number byte c holds, exactly: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2;
// exponent 0 is subnormal (m 2^-9), 0x7f / 0xff are NaN, there is no infinity. A normal one is the float32 with
// exponent e + 120 and the mantissa's 3 bits on top of its 23 (no float arithmetic, no denormal anywhere).
inline float e4m3_to_float(unsigned c) {
  const uint32_t em = c & 0x7f;
  float v;
  if (em == 0x7f) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (em < 8) {
    v = static_cast<float>(em) * 0x1p-9f;
  } else {
    const uint32_t bits = (em << 20) + (uint32_t{120} << 23);
    std::memcpy(&v, &bits, sizeof(v));
  }
  return (c & 0x80) ? -v : v;
}

#if defined(__AVX2__) && defined(__F16C__)
// e4m3_to_float on 16 bytes (vector c), into two vectors of eight: each byte moved into a float16 with the same
// sign, exponent and mantissa bits (exponent field e of bias 15 instead of 7, the mantissa's 3 bits on top of its
// 10: the float16 is the e4m3 number times 2^-8 exactly, subnormals included), widened exactly by VCVTPH2PS
// (F16C) and scaled back by 2^8 (exact). Not for NaN bytes (0x7f, 0xff: the reader refuses them, quant/fp8.py).
inline void e4m3_to_float16x(__m128i c, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_cvtepu8_epi16(c);
  const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3f80)),
                                    _mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16(-0x8000)));
  const __m256 up = _mm256_set1_ps(256.0f);
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), up);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), up);
}
#endif

// one panel row's PANEL codes (packed bytes at b) as floats into o: (value(code) - z[j]) * s[j] (see the top)
template <int BITS, int FMT>
inline void dequant_row(const uint8_t* __restrict__ b, const float* __restrict__ s, const float* __restrict__ z,
                        float* __restrict__ o) {
  static_assert(FMT == CODE_INT || (FMT == CODE_E4M3) == (BITS == 8), "e4m3 codes are bytes, e2m1 nibbles");
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (FMT == CODE_E4M3) {   // bytes 0-31 in order, sixteen at a time
    static_assert(PANEL == 32, "the AVX2 form unpacks 32 columns");
    for (int q = 0; q < 2; ++q) {
      __m256 lo, hi;
      e4m3_to_float16x(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * q)), lo, hi);
      _mm256_storeu_ps(o + 16 * q, _mm256_mul_ps(lo, _mm256_loadu_ps(s + 16 * q)));
      _mm256_storeu_ps(o + 16 * q + 8, _mm256_mul_ps(hi, _mm256_loadu_ps(s + 16 * q + 8)));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  // eight columns a vector: the bytes' low nibbles (columns 0-15), then their high nibbles (16-31); 8-bit: bytes
  // 0-31 in order. The same three float operations as the loops below (widening is exact): the same bits.
  static_assert(PANEL == 32, "the AVX2 form unpacks 32 columns");
  __m128i parts[4];
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    parts[0] = lo, parts[1] = _mm_srli_si128(lo, 8), parts[2] = hi, parts[3] = _mm_srli_si128(hi, 8);
  } else {
    for (int q = 0; q < 4; ++q) parts[q] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * q));
  }
  if constexpr (FMT == CODE_INT || FMT == CODE_E2M1) {
    for (int q = 0; q < 4; ++q) {
      __m256 c;
      if constexpr (FMT == CODE_E2M1) {   // the magnitude from bits 0-2 (permutevar8x32 reads those), bit 3 the sign
        const __m256i code = _mm256_cvtepu8_epi32(parts[q]);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
        c = _mm256_xor_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1_VALUES), code), _mm256_castsi256_ps(sign));
      } else {
        c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[q]));
      }
      _mm256_storeu_ps(o + 8 * q, _mm256_mul_ps(_mm256_sub_ps(c, _mm256_loadu_ps(z + 8 * q)), _mm256_loadu_ps(s + 8 * q)));
    }
    return;
  }
#endif
  if constexpr (FMT == CODE_E4M3) {
    for (int64_t j = 0; j < PANEL; ++j) o[j] = e4m3_to_float(b[j]) * s[j];
  } else if constexpr (FMT == CODE_E2M1) {
    constexpr int64_t H = PANEL / 2;
    for (int64_t j = 0; j < H; ++j) o[j] = (E2M1_VALUES[b[j] & 15] - z[j]) * s[j];
    for (int64_t j = 0; j < H; ++j) o[j + H] = (E2M1_VALUES[b[j] >> 4] - z[j + H]) * s[j + H];
  } else if constexpr (BITS == 4) {
    constexpr int64_t H = PANEL / 2;
    for (int64_t j = 0; j < H; ++j) o[j] = (static_cast<float>(b[j] & 15) - z[j]) * s[j];
    for (int64_t j = 0; j < H; ++j) o[j + H] = (static_cast<float>(b[j] >> 4) - z[j + H]) * s[j + H];
  } else {
    for (int64_t j = 0; j < PANEL; ++j) o[j] = (static_cast<float>(b[j]) - z[j]) * s[j];
  }
}

// panel rows k0 .. k0 + kc - 1 of one panel (packed bytes at w, row k0 first) as floats into out (kc, PANEL);
// s, z: the panel's first column of group 0 (row stride ld). Group by group, its scales and zeros copied once.
template <int BITS, int FMT>
inline void dequant_block(const uint8_t* w, const float* s, const float* z, int64_t ld, int64_t k0, int64_t kc,
                          int64_t group_size, float* out) {
  constexpr int64_t RB = BITS == 4 ? PANEL / 2 : PANEL;
  alignas(64) float sg[PANEL], zg[PANEL];
  for (int64_t k = 0; k < kc;) {
    const int64_t g = (k0 + k) / group_size, end = std::min(kc, (g + 1) * group_size - k0);
    std::memcpy(sg, s + g * ld, sizeof(sg));
    std::memcpy(zg, z + g * ld, sizeof(zg));
    for (; k < end; ++k) dequant_row<BITS, FMT>(w + k * RB, sg, zg, out + k * PANEL);
  }
}

// A few rows (R <= SMALL_M, decode): each panel row dequantized into registers and multiplied at once, no
// block buffer: acc[i][j] = fma(x[i][k], w[k][j], acc[i][j]) in k order, micro_plain's chain (the same bits).
template <int BITS, int FMT, int R>
inline void few_rows(const float* x, int64_t ldx, const uint8_t* w, const float* s, const float* z,
                     int64_t ld, int64_t k0, int64_t kc, int64_t group_size, float* const* buf, bool first) {
  constexpr int64_t RB = BITS == 4 ? PANEL / 2 : PANEL;
  Vec acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(buf[0] + i * PANEL + j * Vec::W);
  alignas(64) float sg[PANEL], zg[PANEL], row[PANEL];
  for (int64_t k = 0; k < kc;) {
    const int64_t g = (k0 + k) / group_size, end = std::min(kc, (g + 1) * group_size - k0);
    std::memcpy(sg, s + g * ld, sizeof(sg));
    std::memcpy(zg, z + g * ld, sizeof(zg));
    for (; k < end; ++k) {
      dequant_row<BITS, FMT>(w + k * RB, sg, zg, row);
      for (int i = 0; i < R; ++i) {
        const Vec a = Vec::bcast(x[i * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[i][j] = Vec::fma(a, Vec::load(row + j * Vec::W), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j].store(buf[0] + i * PANEL + j * Vec::W);
}

// which (call, panel block) this thread's buffer holds: a new call never reuses a block of an earlier one
inline std::atomic<uint64_t>& quant_call_counter() {
  static std::atomic<uint64_t> calls{0};
  return calls;
}
struct QuantBlockCache {
  uint64_t call = ~uint64_t{0};
  const uint8_t* block = nullptr;
  alignas(64) float w[K_BLOCK_Q * PANEL];
};

// The product over one code form (BITS, FMT: see the top) into y's store; quant_linear checks and dispatches.
template <int BITS, int FMT, class Store>
inline void quant_gemm(int64_t M, int64_t K, int64_t P, int64_t out_features, const float* xp, const uint8_t* wp,
                       const float* sp, const float* zp, int64_t group_size, Store store) {
  constexpr int64_t row_bytes = BITS == 4 ? PANEL / 2 : PANEL;
  const int64_t ld = P * PANEL, panel_bytes = K * row_bytes;
  const uint64_t call = quant_call_counter().fetch_add(1, std::memory_order_relaxed);
  auto tile = [&](int64_t np, int64_t rows, int64_t m, int64_t k0, const uint8_t* const* w, int64_t kc,
                  float* const* buf, bool first, const char* const* pf, int64_t n) {
    (void)np;   // packed_gemm runs one panel a pass (two_panels false)
    const int64_t p = (w[0] - wp) / panel_bytes;
    if (M <= SMALL_M) {   // a few rows: no block buffer (rows <= M)
      const float* xr = xp + m * K + k0;
      const float* sr = sp + p * PANEL;
      const float* zr = zp + p * PANEL;
#define LMI_FEW(R) few_rows<BITS, FMT, R>(xr, K, w[0], sr, zr, ld, k0, kc, group_size, buf, first)
      switch (rows) {
        case 1: return LMI_FEW(1);
        case 2: return LMI_FEW(2);
        case 3: return LMI_FEW(3);
        default: return LMI_FEW(4);
      }
#undef LMI_FEW
    }
    thread_local QuantBlockCache cache;
    if (cache.call != call || cache.block != w[0]) {
      dequant_block<BITS, FMT>(w[0], sp + p * PANEL, zp + p * PANEL, ld, k0, kc, group_size, cache.w);
      cache.call = call, cache.block = w[0];
    }
    const float* wf[1] = {cache.w};
    tile_kernel<1, ACC_WIDE>(MicroPlain<>{}, rows, xp + m * K + k0, K, wf, Vec::W, kc, buf, first, pf, n);
  };
  packed_gemm(M, K, P, row_bytes, K_BLOCK_Q, MR_WIDE, wp, out_features, tile, store, false, few_rows_prefetch(M));
}

// y = x @ W^T (+ bias) over code panels (see the top). x: (M, K) float32 or bfloat16 (bf16 widened exactly);
// packed: uint8 (P, K, PANEL / 2) for bits 4, (P, K, PANEL) for bits 8; scales, zeros (G, P * PANEL) float32;
// bias (out_features,) float32 or bfloat16 or none; out_bf16: y rounded once to bfloat16, else float32;
// fmt: CODE_INT (integer codes), CODE_E4M3 (float8 e4m3fn bytes, bits 8; zeros are not read) or CODE_E2M1
// (e2m1 nibbles, bits 4).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, torch::Tensor scales,
                           torch::Tensor zeros, int64_t group_size, int64_t bits, c10::optional<torch::Tensor> bias,
                           bool out_bf16, int64_t fmt = CODE_INT) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  is_bf16(x, "x");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  const int64_t row_bytes = bits == 4 ? PANEL / 2 : PANEL;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kUInt8 &&
              packed.size(2) == row_bytes, "packed codes must be contiguous uint8 (P, K, ", row_bytes, ")");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "in_features mismatch: x has ", K, ", weight ", packed.size(1));
  TORCH_CHECK(out_features <= P * PANEL && out_features > (P - 1) * PANEL, "bad out_features");
  TORCH_CHECK(group_size > 0, "group_size must be > 0");
  const int64_t G = (K + group_size - 1) / group_size;
  for (const torch::Tensor* t : {&scales, &zeros})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == G && t->size(1) == P * PANEL && t->is_contiguous() &&
                t->scalar_type() == torch::kFloat32, "scales and zeros must be contiguous (", G, ", ", P * PANEL,
                ") float32");
  TORCH_CHECK(fmt == CODE_INT || (fmt == CODE_E4M3 && bits == 8) || (fmt == CODE_E2M1 && bits == 4),
              "fmt must be 0 (integer codes), 1 (e4m3 bytes, bits 8) or 2 (e2m1 nibbles, bits 4), got ", fmt,
              " with bits ", bits);
  torch::Tensor b_f;
  if (bias.has_value() && bias->defined()) {
    b_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b_f.numel() == out_features, "bad bias");
  }
  torch::Tensor y = torch::empty({M, out_features}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  if (M == 0) return y;
  const float* bp = b_f.defined() ? b_f.data_ptr<float>() : nullptr;
  const FloatRows xf = float_rows(x, K, false);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  auto run = [&](auto store) {
#define LMI_QUANT(B, F) quant_gemm<B, F>(M, K, P, out_features, xf.data, wp, sp, zp, group_size, store)
    if (fmt == CODE_E2M1) return LMI_QUANT(4, CODE_E2M1);
    if (bits == 4) return LMI_QUANT(4, CODE_INT);
    if (fmt == CODE_E4M3) return LMI_QUANT(8, CODE_E4M3);
    return LMI_QUANT(8, CODE_INT);
#undef LMI_QUANT
  };
  if (out_bf16) {
    run(StoreRows<bf16>{data_of<bf16>(y), out_features, nullptr, bp});
  } else {
    run(StoreRows<float>{y.data_ptr<float>(), out_features, nullptr, bp});
  }
  return y;
}

}  // namespace
