// Batch-invariant CPU kernels: a row-invariant linear over pre-packed weights (float32, bfloat16 or
// int8 panels: linear.h), a paged attention that reads K/V straight from the block cache
// (attention.h), the row-wise ops (rowwise.h) and the fused decoder stack (decoder_stack.h), for
// activations in float32 or bfloat16, and huge-page buffers. One translation unit: the headers hold the
// code, this file the Python bindings.
//
// Invariance by construction: every output element is one fixed sequence of float operations that
// reads only its own row's inputs (see each header), whatever M is and wherever the row sits.
#include "decoder_stack.h"

#include <chrono>
#include <cstdlib>
#include <new>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// An uninitialised tensor in memory aligned to 2 MiB and marked for transparent huge pages (madvise;
// a no-op where THP is off). Weights and the KV cache are read once per step in large streams: with
// 4 KiB pages every page is a TLB miss, and under a hypervisor each miss walks two page tables.
// Measured here (2 threads, 425 MiB stream read): 17.6 vs 23.2 GB/s.
torch::Tensor empty_huge(std::vector<int64_t> sizes, c10::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0, "negative size");
    numel *= n;
  }
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));  // the start aligned
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return torch::from_blob(p, sizes, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(dtype));
}

// parallel_walk's check (tests): how many times each of n items ran, and how many ran on a thread other
// than their share's owner (taken from its back). The first share's items each spin `slow_us` microseconds,
// so that with two or more threads the others finish first and take from it. Returns (counts (n,) int64,
// items taken).
std::tuple<torch::Tensor, int64_t> walk_counts(int64_t n, double slow_us) {
  TORCH_CHECK(n >= 0 && n < (int64_t{1} << 24), "n must be in [0, 2^24)");
  std::vector<std::atomic<int64_t>> counts(n);
  std::atomic<int64_t> taken{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool_threads(), n));   // as parallel_walk
  parallel_walk(n, [&](int64_t item) {
    counts[item].fetch_add(1, std::memory_order_relaxed);
    int64_t owner = 0;
    while (owner + 1 < threads && n * (owner + 1) / threads <= item) ++owner;
    if (owner != std::max(0, lmi_pool::slot)) taken.fetch_add(1, std::memory_order_relaxed);
    if (owner == 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(slow_us);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
  });
  torch::Tensor out = torch::empty({n}, torch::kInt64);
  for (int64_t i = 0; i < n; ++i) out.data_ptr<int64_t>()[i] = counts[i].load();
  return {out, taken.load()};
}

}  // namespace

// Every compute binding runs without the GIL (its tensors are converted before, its result after): a
// pybind11 function holds the GIL for its whole call by default, and the engine thread's decoder step
// (tens to hundreds of ms) then stopped the server's event loop, which shares the process, from
// answering anything, /ping and the at-once 503 refusals of a full queue (C27) included. The kernels
// touch no Python object; TORCH_CHECK's exception crosses back once the GIL is held again.
constexpr auto kNoGil = py::call_guard<py::gil_scoped_release>();

// families.cpp (a translation unit of its own): the C++ ops backend's masked attention, norm offset, rope, GeGLU
void register_family_ops(py::module_& m);
// quant.cpp (a translation unit of its own): the linear over 4-bit / 8-bit code panels (linear_quant.h)
void register_quant_ops(py::module_& m);
// moe.cpp (a translation unit of its own): a mixture-of-experts layer's routed experts over packed panels
void register_moe_ops(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_family_ops(m);
  register_quant_ops(m);
  register_moe_ops(m);
  m.attr("PANEL") = PANEL;
  m.attr("VECTOR_WIDTH") = Vec::W;
  m.attr("NATIVE_BF16") = NATIVE_BF16;
  m.attr("HAS_AMX") = HAS_AMX;
  m.def("amx_permitted", &amx_permitted, "whether the OS grants this process AMX tile state (asks once)");
  m.def("empty_huge", &empty_huge, "uninitialised tensor in 2 MiB-aligned memory marked for huge pages");
  m.def("linear", &linear, "row-invariant x @ W^T (+ bias) over packed float32 / bfloat16 / int8 panels", kNoGil);
  m.def("linear_silu", &linear_silu, "silu(gate) * up of a packed gate_up linear in one pass (linear's bits)",
        kNoGil);
  m.def("narrow_tiles", &narrow_tiles, "whether float32 and VDPBF16PS tiles are the narrow ones (AMD Zen 4)");
  m.def("set_narrow_tiles", &set_narrow_tiles, "narrow tiles: -1 the CPU's choice, 0 wide, 1 narrow; returns the previous");
  m.def("paged_attention", &paged_attention, "causal GQA attention over the paged K/V cache (float32 or bfloat16)", kNoGil);
  m.def("add_rmsnorm", &add_rmsnorm, "x += delta (optional, in place); returns weight * rmsnorm(x) per row", kNoGil);
  m.def("rope_kv_write", &rope_kv_write, "RoPE on q, k of fused qkv rows; k, v into the cache by slot; returns q", kNoGil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up over (T, 2I) gate_up rows", py::arg("gate_up"),
        py::arg("vector") = true, kNoGil);
  m.def("mask_logits_", &mask_logits_, "set logits to -inf where the token bitmask does not allow them, in place", kNoGil);
  m.def("row_argmax", &row_argmax, "torch.argmax(x, dim=-1) of (N, V) float32 rows", kNoGil);
  m.def("greedy_pick", &greedy_pick, "(argmax ids, log_softmax, the ids' log-probs) of (N, V) float32 rows", kNoGil);
  m.def("packed_rows", &packed_rows, "rows of a packed float32 / bfloat16 weight (exact copies)", kNoGil);
  m.def("stop_reasons", &stop_reasons, "stopping.token_stop_reasons' codes in one pass", py::arg("token_ids"),
        py::arg("stop_ids"), py::arg("num_output_tokens"), py::arg("max_new_tokens"), py::arg("is_eos") = py::none());
  m.def("walk_counts", &walk_counts, "parallel_walk's check: (runs of each item, items taken from another's share)",
        kNoGil);
  m.def("set_threads", [](int64_t n) { return lmi_pool::threads_setting.exchange(static_cast<int>(n)); },
        "the kernels' thread count (0: torch's, at::get_num_threads()); returns the previous setting");
  m.def("threads", [] { return lmi_pool::threads(); }, "the kernels' thread count now");
  m.def("set_claim_order", [](int64_t mode) { return lmi_pool::claim_order.exchange(static_cast<int>(mode)); },
        "tests: the order pieces are claimed in (0 natural, 1 reversed, 2 shuffled each region); returns the previous");
  m.def("set_worker_delay_us", [](int64_t us) { return lmi_pool::worker_delay_us.exchange(us); },
        "tests: each worker waits this long before joining a region it sees (a late thread); returns the previous");
  m.def("vector_exp_agrees", &vector_exp_agrees, "whether the AVX-512 expf gives std::exp's bits here");
  m.def("lora_add", &lora_add, "y += each row's LoRA term (x A_s^T) B_s^T * scale_s, s = row_slot (-1: none), in place",
        kNoGil);
  py::class_<LoraSet>(m, "LoraSet", "an adapter set's per-layer A and B^T stacks (qkv, o, gate_up, down) and scales")
      .def(py::init<const std::vector<std::vector<c10::optional<torch::Tensor>>>&, torch::Tensor>())
      .def("add", &LoraSet::add_one, "y += layer l's projection p (0 qkv, 1 o, 2 gate_up, 3 down) term, in place",
           kNoGil)
      .def_property_readonly("num_slots", &LoraSet::num_slots);
  using Opt = c10::optional<torch::Tensor>;
  py::class_<lmi_stack::Linear>(m, "StackLinear", "one linear of the fused stack by kind: 'panels' (linear.h's packed "
                                "panels) or 'codes' (linear_quant.h's code panels); stack_linear.h")
      .def(py::init<const std::string&, torch::Tensor, int64_t, Opt, Opt, Opt, Opt, int64_t, int64_t, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("out_features"), py::arg("scale") = py::none(),
           py::arg("bias") = py::none(), py::arg("zeros") = py::none(), py::arg("perm") = py::none(),
           py::arg("group_size") = 0, py::arg("bits") = 0, py::arg("fmt") = 0);
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer's norms and linears by role (forward.LayerWeights' names)")
      .def(py::init<torch::Tensor, lmi_stack::Linear, lmi_stack::Linear, torch::Tensor, lmi_stack::Linear,
                    lmi_stack::Linear>(),
           py::arg("attn_pre"), py::arg("qkv"), py::arg("o"), py::arg("mlp_pre"), py::arg("gate_up"), py::arg("down"));
  py::class_<DecoderStack>(m, "DecoderStack", "the decoder layers and final norm, one call a step")
      .def(py::init<std::vector<StackLayer>, torch::Tensor, int64_t, int64_t, double, double, double>(),
           py::arg("layers"), py::arg("norm"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"),
           py::arg("norm_eps"), py::arg("scale"))
      .def("forward", &DecoderStack::forward, "the decoder stack and final norm on x (not changed)",
           kNoGil)
      .def("forward_lora", &DecoderStack::forward_lora, "forward with a step's LoRA adapters (LoraSet, row_slot)",
           kNoGil);
}
