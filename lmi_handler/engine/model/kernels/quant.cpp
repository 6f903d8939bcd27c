// The quantized-weight linear (linear_quant.h: 4-bit and 8-bit codes with group scales and zero points), for
// the C++ ops backend (engine/model/backends/cpp.py over engine/model/quant/). A translation unit of its own
// (build.py compiles every .cpp beside cpu_kernels.cpp; cpu_kernels.cpp's module calls register_quant_ops), so
// the compiler's inlining in the fused stack's unit is not changed by it.
#include "linear_quant.h"

void register_quant_ops(py::module_& m) {
  m.def("quant_linear", &quant_linear,
        "row-invariant x @ W^T (+ bias) over 4-bit / 8-bit code panels with group scales and zeros (fmt 1: "
        "float8 e4m3 bytes, 2: e2m1 nibbles)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("scales"), py::arg("zeros"),
        py::arg("group_size"), py::arg("bits"), py::arg("bias"), py::arg("out_bf16"), py::arg("fmt") = 0,
        py::call_guard<py::gil_scoped_release>());
}
