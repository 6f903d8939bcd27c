// The quantized-weight linear (linear_quant.h: 4-bit and 8-bit codes with group scales and zero points), for
// the C++ ops backend (engine/model/backends/cpp.py over engine/model/quant/) and the fused decoder stack's "codes"
// linears (stack_linear.h's codes_linear). A translation unit of its own (build.py compiles every .cpp beside
// cpu_kernels.cpp; cpu_kernels.cpp's module calls register_quant_ops), so the compiler's inlining in the fused
// stack's unit is not changed by it.
#include "linear_quant.h"
#include "stack_linear.h"

torch::Tensor lmi_stack::codes_linear(const torch::Tensor& x, const Linear& w, bool out_bf16) {
  const torch::Tensor xk = w.perm ? x.index_select(1, *w.perm) : x;   // the act-order k order (exact copies)
  return quant_linear(xk.contiguous(), w.weight, w.out_features, *w.scale, *w.zeros, w.group_size, w.bits, w.bias,
                      out_bf16, w.fmt);
}

void register_quant_ops(py::module_& m) {
  m.def("quant_linear", &quant_linear,
        "row-invariant x @ W^T (+ bias) over 4-bit / 8-bit code panels with group scales and zeros (fmt 1: "
        "float8 e4m3 bytes, 2: e2m1 nibbles)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("scales"), py::arg("zeros"),
        py::arg("group_size"), py::arg("bits"), py::arg("bias"), py::arg("out_bf16"), py::arg("fmt") = 0,
        py::call_guard<py::gil_scoped_release>());
}
