// One linear of the fused decoder stack (decoder_stack.h), by kind: its kind picks the kernel that runs it.
//   "panels": linear.h's packed panels (float32, bfloat16 or int8; the panels' dtype says which), `scale` the int8
//             kind's per-channel scales;
//   "codes":  linear_quant.h's 4-bit / 8-bit code panels with group `scale`s and `zeros` (engine/model/quant's
//             QuantWeight), `perm` its act-order k order (x's columns taken as x[:, perm]), `group_size`, `bits`,
//             `fmt` what a code is (linear_quant.h's CodeFmt: 0 the integer itself, 1 a float8 e4m3 byte).
// `bias` (out_features,) is held as float32 (exact: the form both kernels convert it to at every call otherwise).
// A named namespace, not an anonymous one: quant.cpp (its own translation unit, so that linear_quant.h does not
// change the inlining in the stack's unit) defines codes_linear for the stack's unit to call.
#pragma once

#include <torch/extension.h>

#include <string>

namespace lmi_stack {

enum class Kind : int { Panels = 0, Codes = 1 };

struct Linear {
  using Opt = c10::optional<torch::Tensor>;
  Kind kind;
  torch::Tensor weight;   // the panels, of either kind
  int64_t out_features;
  Opt scale, bias, zeros, perm;
  int64_t group_size, bits, fmt;

  Linear(const std::string& kind_, torch::Tensor weight_, int64_t out_features_, Opt scale_, Opt bias_, Opt zeros_,
         Opt perm_, int64_t group_size_, int64_t bits_, int64_t fmt_)
      : weight(std::move(weight_)), out_features(out_features_), scale(present(scale_)), bias(present(bias_)),
        zeros(present(zeros_)), perm(present(perm_)), group_size(group_size_), bits(bits_), fmt(fmt_) {
    TORCH_CHECK(kind_ == "panels" || kind_ == "codes", "a stack linear's kind is 'panels' or 'codes', got '", kind_,
                "'");
    kind = kind_ == "panels" ? Kind::Panels : Kind::Codes;
    TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous(), "a stack linear's panels must be contiguous (P, K, .)");
    if (kind == Kind::Codes) {
      TORCH_CHECK(scale && zeros && group_size > 0 && (bits == 4 || bits == 8),
                  "a 'codes' linear needs scale, zeros, group_size > 0 and bits 4 or 8");
    } else {
      TORCH_CHECK(!zeros && !perm && fmt == 0, "a 'panels' linear has no zeros, perm or code format");
    }
    if (bias) bias = bias->to(torch::kFloat32).contiguous();
    if (perm) perm = perm->to(torch::kInt64).contiguous();
  }

 private:
  static Opt present(const Opt& t) { return t.has_value() && t->defined() ? t : Opt(); }
};

// x (M, K) @ W^T (+ bias) for a "codes" linear through linear_quant.h's quant_linear (x permuted first where the
// weight has an act-order perm: exact copies; its codes read as `fmt` says), y in bfloat16 (out_bf16) or float32:
// the bits of the ops backend's quant_linear call (engine/model/quant/weight.py). Defined in quant.cpp.
torch::Tensor codes_linear(const torch::Tensor& x, const Linear& w, bool out_bf16);

}  // namespace lmi_stack
