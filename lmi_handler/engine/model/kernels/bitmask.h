// Token bitmasks applied to logits in place, without a float mask: logits_controls.apply_token_bitmask's CPU path.
//
// mask_logits_(logits, rows, bitmask): for each bitmask row i (N, W int32; bit j of word w = token 32 w + j,
// 1 = allowed), the logits row rows[i] (or i when rows is empty) gets -inf at every token whose bit is 0 and
// at every token past 32 W; allowed tokens are not touched. One pass over the bitmask, a masked store of -inf
// per 16 tokens (AVX-512) or per token; each row is written from its own bitmask row only, in one thread.
// The reference is logits_controls.apply_token_bitmask_reference (tests/engine/test_logits_controls.py).
#pragma once

#include "common.h"

#include <limits>
inline void mask_bitmask_row(float* out, const int32_t* words, int64_t num_words, int64_t vocab) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = std::min(num_words, vocab / 32);   // words whose 32 tokens all lie in the row
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(neg_inf);
#endif
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    float* dst = out + 32 * w;
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(dst, static_cast<__mmask16>(~word & 0xFFFFu), ninf);
    _mm512_mask_storeu_ps(dst + 16, static_cast<__mmask16>((~word >> 16) & 0xFFFFu), ninf);
#else
    for (int j = 0; j < 32; ++j) {
      if (!((word >> j) & 1u)) dst[j] = neg_inf;
    }
#endif
  }
  // the last, partial word of the row (a vocabulary that is not a multiple of 32)
  for (int64_t t = 32 * full_words; t < std::min(vocab, 32 * num_words); ++t) {
    if (!((static_cast<uint32_t>(words[t / 32]) >> (t % 32)) & 1u)) out[t] = neg_inf;
  }
  // tokens past the bitmask (a padded vocabulary): never allowed
  for (int64_t t = 32 * num_words; t < vocab; ++t) out[t] = neg_inf;
}

inline torch::Tensor mask_logits_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu(), "mask_logits_: CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "mask_logits_: logits must be (B, V) float32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "mask_logits_: bitmask must be a contiguous (N, W) int32 tensor");
  const int64_t n = bitmask.size(0), num_words = bitmask.size(1), vocab = logits.size(1);
  const bool all_rows = rows.numel() == 0;
  TORCH_CHECK(all_rows ? n == logits.size(0) : (rows.dim() == 1 && rows.numel() == n &&
                                                rows.scalar_type() == torch::kInt64),
              "mask_logits_: rows must be empty (N == B) or (N,) int64");
  auto rows_c = rows.contiguous();
  const int64_t* row_ids = all_rows ? nullptr : rows_c.data_ptr<int64_t>();
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = all_rows ? i : row_ids[i];
    TORCH_CHECK(r >= 0 && r < logits.size(0), "mask_logits_: row index ", r, " out of range");
    mask_bitmask_row(base + r * logits.stride(0), words + i * num_words, num_words, vocab);
  }
  return logits;
}
