// The routed experts of a mixture-of-experts layer for the C++ ops backend (backends/cpp.py's moe_experts):
// the (token, rank) pairs grouped by expert, each chosen expert one packed gate_up linear with silu * up in its
// store (gpt-oss: with its bias, then the clamped SwiGLU) and one packed down linear over its own rows (linear.h's entry points: linear_silu and linear, the same
// calls the dense MLP makes), the outputs combined per token in rank order in float32 and rounded once.
//
// Invariance by construction: a row's expert outputs are linear.h's row-invariant values, and its combination
// reads only its own K outputs and weights in the fixed order k = 0, 1, ..., never the order in which experts
// or other tokens arrive; an expert no token chose is never read (a batch-1 decode step reads top_k experts).
// Quantized experts (gpt-oss's MXFP4) take linear_quant.h's code panels in the same frame (moe_experts_quant).
// A translation unit of its own (build.py compiles every .cpp beside cpu_kernels.cpp), so the fused stack's
// unit is compiled as before.
#include "linear_quant.h"
#include "rowwise.h"

namespace {

// gpt-oss's expert activation over (T, 2I) = [gate | up] rows -> (T, I): g = min(gate, limit), u = clamp(up,
// -limit, limit), out = (u + 1) * (g * sigmoid(g * alpha)), each product and sum rounded to T as transformers'
// GptOssExperts rounds its bf16 tensors (float32: no rounding). Scalar code with std::exp, one row at a time:
// a row's bits never depend on the other rows or on where it sits.
template <class T>
void clamped_swiglu_rows(const T* gp, T* op, int64_t rows, int64_t I, float alpha, float limit) {
  parallel_chunks(rows, row_grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      for (int64_t j = 0; j < I; ++j) {
        const float gj = std::min(load_scalar<T>(g + j), limit);
        const float uj = std::min(std::max(load_scalar<T>(u + j), -limit), limit);
        const float sig = keep<T>(1.f / (1.f + std::exp(-keep<T>(gj * alpha))));
        store_scalar<T>(o + j, keep<T>(uj + 1.f) * keep<T>(gj * sig));
      }
    }
  });
}

torch::Tensor clamped_swiglu(torch::Tensor gate_up, double alpha, double limit) {
  const bool bf = is_bf16(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  if (bf) {
    clamped_swiglu_rows<bf16>(data_of<bf16>(gate_up), data_of<bf16>(out), T, I, a, l);
  } else {
    clamped_swiglu_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), T, I, a, l);
  }
  return out;
}

template <class T>
void combine_ranks_rows(const T* outs, const float* weights, T* out, int64_t num_tokens, int64_t top_k,
                        int64_t hidden) {
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const float* w = weights + t * top_k;
      const T* o = outs + t * top_k * hidden;
      for (int64_t j = 0; j < hidden; ++j) acc[j] = load_scalar<T>(o + j) * w[0];
      for (int64_t k = 1; k < top_k; ++k) {
        for (int64_t j = 0; j < hidden; ++j) acc[j] = acc[j] + load_scalar<T>(o + k * hidden + j) * w[k];
      }
      for (int64_t j = 0; j < hidden; ++j) store_scalar<T>(out + t * hidden + j, acc[j]);
    }
  });
}

// The shared frame of both entry points below: x (T, hidden) float32 or bfloat16; ids (T, K) int64 in [0, E);
// weights (T, K) float32; expert(e, rows) -> expert e's outputs (n, hidden) in x's dtype for its rows (n, hidden).
// Groups the (token, rank) pairs by expert (token order within an expert), runs each chosen expert once over its
// rows, and combines each token's K outputs in rank order in float32, rounded once to x's dtype.
template <class F>
torch::Tensor grouped_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, int64_t E, const F& expert) {
  const bool bf = is_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0), "x must be (T, hidden), ids (T, K)");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && weights.scalar_type() == torch::kFloat32 &&
              weights.sizes() == ids.sizes(), "ids must be int64 and weights float32, both (T, K)");
  x = x.contiguous();
  ids = ids.contiguous();
  weights = weights.contiguous();
  const int64_t T = ids.size(0), K = ids.size(1), hidden = x.size(1);
  std::vector<std::vector<int64_t>> pairs(E);          // expert -> its (token, rank) pairs t * K + k, in token order
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < T * K; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id ", id[p], " outside [0, ", E, ")");
    pairs[id[p]].push_back(p);
  }
  auto outs = torch::empty({T * K, hidden}, x.options());
  const auto index = torch::TensorOptions().dtype(torch::kInt64);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(pairs[e].size());
    if (n == 0) continue;
    auto slots = torch::from_blob(pairs[e].data(), {n}, index);
    outs.index_copy_(0, slots, expert(e, x.index_select(0, torch::floor_divide(slots, K))));
  }
  auto out = torch::empty({T, hidden}, x.options());
  if (bf) {
    combine_ranks_rows<bf16>(data_of<bf16>(outs), weights.data_ptr<float>(), data_of<bf16>(out), T, K, hidden);
  } else {
    combine_ranks_rows<float>(outs.data_ptr<float>(), weights.data_ptr<float>(), out.data_ptr<float>(), T, K, hidden);
  }
  return out;
}

// expert e's bias of a per-expert list (gpt-oss), or none where the list is empty
inline c10::optional<torch::Tensor> bias_of(const std::vector<torch::Tensor>& biases, int64_t e) {
  return biases.empty() ? c10::nullopt : c10::optional<torch::Tensor>(biases[e]);
}

// gate_up[e] expert e's packed cat(gate, up) panels (out_features gate_up_features), down[e] its down panels
// (out_features hidden), each with its int8 scale or none; form: the bf16 panels' dot form (linear.h).
// gate_up_bias / down_bias: one bias per expert (gpt-oss) or empty lists; clamped: gpt-oss's clamped SwiGLU with
// alpha and limit (clamped_swiglu) instead of silu * up. Returns grouped_experts' (T, hidden): sum over k of
// weights[t, k] * expert ids[t, k] (x[t]) in float32 in rank order, each expert output first rounded to x's dtype
// (moe.grouped_experts' bits).
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                          const std::vector<torch::Tensor>& gate_up,
                          const std::vector<c10::optional<torch::Tensor>>& gate_up_scale,
                          const std::vector<torch::Tensor>& down,
                          const std::vector<c10::optional<torch::Tensor>>& down_scale, int64_t gate_up_features,
                          int64_t form, const std::vector<torch::Tensor>& gate_up_bias,
                          const std::vector<torch::Tensor>& down_bias, bool clamped, double alpha, double limit) {
  const bool bf = is_bf16(x, "x");
  const int64_t E = static_cast<int64_t>(gate_up.size()), hidden = x.size(1);
  TORCH_CHECK(down.size() == gate_up.size() && gate_up_scale.size() == gate_up.size() &&
              down_scale.size() == gate_up.size(), "one gate_up, down and scale per expert");
  TORCH_CHECK(gate_up_bias.empty() || (gate_up_bias.size() == gate_up.size() && down_bias.size() == gate_up.size()),
              "one gate_up and down bias per expert, or none");
  return grouped_experts(x, ids, weights, E, [&](int64_t e, const torch::Tensor& rows) {
    const auto gu_bias = bias_of(gate_up_bias, e);
    auto act = clamped ? clamped_swiglu(linear(rows, gate_up[e], gate_up_features, gu_bias, gate_up_scale[e], bf, form),
                                        alpha, limit)
                       : linear_silu(rows, gate_up[e], gate_up_features, gu_bias, gate_up_scale[e], bf, form);
    return linear(act, down[e], hidden, bias_of(down_bias, e), down_scale[e], bf, form);
  });
}

// The same over code panels (linear_quant.h: gpt-oss's MXFP4 experts as e2m1 panels, or other codes): per
// expert gate_up / down its (panels, scales, zeros) as quant/weight.QuantWeight holds them, in the kernel's k
// order (no act-order permutation), one group size, bits and code format (fmt: linear_quant.h's CodeFmt) for all;
// biases and the activation as above.
torch::Tensor moe_experts_quant(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                const std::vector<std::vector<torch::Tensor>>& gate_up,
                                const std::vector<std::vector<torch::Tensor>>& down, int64_t gate_up_features,
                                int64_t group_size, int64_t bits, int64_t fmt,
                                const std::vector<torch::Tensor>& gate_up_bias,
                                const std::vector<torch::Tensor>& down_bias, bool clamped, double alpha,
                                double limit) {
  const bool bf = is_bf16(x, "x");
  const int64_t E = static_cast<int64_t>(gate_up.size()), hidden = x.size(1);
  TORCH_CHECK(down.size() == gate_up.size(), "one gate_up and down per expert");
  for (const auto* list : {&gate_up, &down})
    for (const auto& w : *list) TORCH_CHECK(w.size() == 3, "each expert weight is (panels, scales, zeros)");
  TORCH_CHECK(gate_up_bias.empty() || (gate_up_bias.size() == gate_up.size() && down_bias.size() == gate_up.size()),
              "one gate_up and down bias per expert, or none");
  return grouped_experts(x, ids, weights, E, [&](int64_t e, const torch::Tensor& rows) {
    const auto& gu = gate_up[e];
    const auto& d = down[e];
    auto h = quant_linear(rows, gu[0], gate_up_features, gu[1], gu[2], group_size, bits, bias_of(gate_up_bias, e), bf,
                          fmt);
    auto act = clamped ? clamped_swiglu(h, alpha, limit) : silu_mul(h, true);
    return quant_linear(act, d[0], hidden, d[1], d[2], group_size, bits, bias_of(down_bias, e), bf, fmt);
  });
}

}  // namespace

// the binding (cpu_kernels.cpp's module calls this once), without the GIL as the others
void register_moe_ops(py::module_& m) {
  m.def("moe_experts", &moe_experts, "a sparse layer's routed experts over packed panels, combined in rank order",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("gate_up_scale"),
        py::arg("down"), py::arg("down_scale"), py::arg("gate_up_features"), py::arg("form"),
        py::arg("gate_up_bias") = std::vector<torch::Tensor>{}, py::arg("down_bias") = std::vector<torch::Tensor>{},
        py::arg("clamped") = false, py::arg("alpha") = 1.0, py::arg("limit") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts_quant", &moe_experts_quant,
        "a sparse layer's routed experts over code panels (MXFP4 e2m1 or others), combined in rank order",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("down"),
        py::arg("gate_up_features"), py::arg("group_size"), py::arg("bits"), py::arg("fmt"),
        py::arg("gate_up_bias"), py::arg("down_bias"), py::arg("clamped"), py::arg("alpha"), py::arg("limit"),
        py::call_guard<py::gil_scoped_release>());
  m.def("clamped_swiglu", &clamped_swiglu, "gpt-oss's clamped SwiGLU over (T, 2I) gate_up rows", py::arg("gate_up"),
        py::arg("alpha"), py::arg("limit"), py::call_guard<py::gil_scoped_release>());
}
