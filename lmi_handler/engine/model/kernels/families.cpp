// The ops the families beyond Llama need, for the C++ ops backend (engine/model/backends/cpp.py, which
// forward.DecoderModel calls op by op): paged attention with a sliding window and Gemma 2's score cap
// (attention.h's kernel, its masked form), RMSNorm with the weight offset and every product in float32 (Gemma's
// 1 + weight; the interface's rms_norm), RoPE on its own (rotary rows of any head layout) and GELU-tanh * up
// (Gemma's GeGLU). Llama's fused path (rowwise.h's DecoderStack) calls none of them.
//
// A translation unit of its own (build.py compiles it beside cpu_kernels.cpp; cpu_kernels.cpp's module calls
// register_family_ops): the compiler decides what to inline per unit, and with the masked attention in
// cpu_kernels.cpp's unit its helpers (exp_sum_keep, values_group) had two callers and were no longer inlined
// into the unmasked kernel; the Llama path's unit holds only the unmasked form, built as before.
//
// Invariance by construction, as the other kernels: every output element is one fixed sequence of float
// operations on its own row's inputs (vector lanes and scalar tails give the same bits: the vector forms use
// the same operations, and exp16_exact has glibc's bits), whatever the number of rows.
#include "attention.h"
#include "vmath.h"

namespace {

// attention.h's paged_attention with `window` (0: none; else a row at position p reads keys max(0, p - window
// + 1)..p), `softcap` (0: none; else scores softcap * tanh(score / softcap) before the softmax) and `sinks`
// (none, or (H,): each head's logit in the softmax denominator, gpt-oss): its
// paged_attention_typed in the masked form (with neither, the same operations as the unmasked form)
torch::Tensor paged_attention_masked(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor cu_seqlens_q,
                                     double scale, int64_t window, double softcap,
                                     c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  torch::Tensor sinks_f;   // (H,) float32: gpt-oss's per-head logit in the denominator
  if (sinks.has_value() && sinks->defined()) {
    sinks_f = sinks->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sinks_f.dim() == 1 && sinks_f.size(0) == q.size(1), "sinks must be (num_heads,)");
  }
  is_bf16(q, "q");
  q = q.contiguous();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be (T, H, D) and the caches (blocks, BS, KVH, D)");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention needs q and the caches in one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes mismatch");
  const AttentionPlan plan(q.size(0), k_cache.size(1), block_tables, context_lens, cu_seqlens_q);
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  const AttentionMask mask{window, static_cast<float>(softcap), sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr};
  if (q.scalar_type() == torch::kBFloat16) {
    paged_attention_typed<bf16>(q, k_cache, v_cache, plan.tables, plan.ctx, plan.cu, plan.seq_of_row, plan.MB,
                                plan.max_ctx, fscale, out, mask);
  } else {
    paged_attention_typed<float>(q, k_cache, v_cache, plan.tables, plan.ctx, plan.cu, plan.seq_of_row, plan.MB,
                                 plan.max_ctx, fscale, out, mask);
  }
  return out;
}

// h[r] = x[r] (+ residual[r], rounded to T); out[r] = h[r] * (1 / sqrt(mean(h[r]^2) + eps)) * wf, in float32,
// rounded once to T. wf: (N,) float32 = offset + weight (computed once a call). The scale is
// common.h's rms_inv, as in add_rmsnorm_rows.
template <class T>
void rms_norm_offset_rows(const T* x, const T* residual, const float* wf, T* out, T* hsum, int64_t rows, int64_t N,
                          float eps) {
  at::parallel_for(0, rows, row_grain(N), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> hf;
    if (static_cast<int64_t>(hf.size()) < N) hf.resize(N);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * N;
      if (residual) {
        const T* rr = residual + r * N;
        T* hr = hsum + r * N;
        for (int64_t j = 0; j < N; ++j) {
          store_scalar<T>(hr + j, load_scalar<T>(xr + j) + load_scalar<T>(rr + j));
          hf[j] = load_scalar<T>(hr + j);
        }
      } else {
        for (int64_t j = 0; j < N; ++j) hf[j] = load_scalar<T>(xr + j);
      }
      const float inv = rms_inv(hf.data(), N, eps);
      T* orow = out + r * N;
      for (int64_t j = 0; j < N; ++j) store_scalar<T>(orow + j, hf[j] * inv * wf[j]);
    }
  });
}

// x (T, N), residual (T, N) or None, weight (N,) any float dtype -> (out, h): the interface's rms_norm
std::tuple<torch::Tensor, torch::Tensor> rms_norm_offset(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                         torch::Tensor weight, double eps, double offset) {
  const bool bf = is_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (T, N)");
  x = x.contiguous();
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N, "weight must be (N,)");
  // offset + weight in float32 (transformers' Gemma: 1.0 + self.weight.float())
  const torch::Tensor wf = weight.to(torch::kFloat32).contiguous().reshape({N}).add(offset);
  torch::Tensor r;
  if (residual.has_value() && residual->defined()) {
    r = residual->contiguous();
    TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(), "residual must match x");
  }
  auto out = torch::empty_like(x);
  auto h = r.defined() ? torch::empty_like(x) : x;
  const float e = static_cast<float>(eps);
  if (bf) {
    rms_norm_offset_rows<bf16>(data_of<bf16>(x), r.defined() ? data_of<bf16>(r) : nullptr, wf.data_ptr<float>(),
                               data_of<bf16>(out), data_of<bf16>(h), T, N, e);
  } else {
    rms_norm_offset_rows<float>(x.data_ptr<float>(), r.defined() ? r.data_ptr<float>() : nullptr, wf.data_ptr<float>(),
                                out.data_ptr<float>(), h.data_ptr<float>(), T, N, e);
  }
  return {out, h};
}

// x (T, H, D) rotated by cos, sin (T, D) (rotate-half, HF's convention): common.h's rope_row on each head
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const bool bf = is_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be (T, H, D) with D even");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos/sin must be (T, D) in x's dtype");
  auto out = torch::empty_like(x);
  auto run = [&](auto* xp, auto* cp, auto* sp, auto* op) {
    at::parallel_for(0, T, row_grain(H * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < H; ++h) rope_row(xp + (t * H + h) * D, cp + t * D, sp + t * D, D, op + (t * H + h) * D);
    });
  };
  if (bf) {
    run(data_of<bf16>(x), data_of<bf16>(cos), data_of<bf16>(sin), data_of<bf16>(out));
  } else {
    run(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// gelu_tanh(g) * u over one row's n lanes: keep(keep(gelu(g)) * u), as PyTorch's bf16 F.gelu then * round.
// gelu(g) = 0.5 g (1 + tanh(k)), k = sqrt(2 / pi) (g + 0.044715 g^3), computed as the identical
// g / (1 + exp(-2 k)), so that exp is the only transcendental (glibc's expf: exp16_exact where
// vector_exp_agrees, std::exp on the scalar tail): lane j depends on g[j], u[j] alone.
template <class T>
inline void gelu_tanh_mul_span(const T* g, const T* u, T* o, int64_t n, bool vector) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (vector) {
    const __m512 one = _mm512_set1_ps(1.f), beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa),
                 minus_two = _mm512_set1_ps(-2.f);
    for (; j + 16 <= n; j += 16) {
      const __m512 x = load16<T>(g + j);
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
      const __m512 neg = _mm512_mul_ps(minus_two, inner);
      const __m512 e = exp16_exact(neg);
      const __m512 a = keep16<T>(_mm512_div_ps(x, _mm512_add_ps(one, e)));
      store16<T>(o + j, _mm512_mul_ps(a, load16<T>(u + j)));
    }
  }
#endif
  for (; j < n; ++j) {
    const float x = load_scalar<T>(g + j);
    const float inner = kBeta * (x + kKappa * (x * x * x));
    const float a = keep<T>(x / (1.f + std::exp(-2.f * inner)));
    store_scalar<T>(o + j, a * load_scalar<T>(u + j));
  }
}

// gelu_tanh(gate) * up on gate_up rows (T, 2I) = [gate | up] -> (T, I). `vector`: the AVX-512 lanes where
// vector_exp_agrees (the default); false: the scalar loop alone (the definition the vector form is tested against)
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up, bool vector) {
  const bool bf = is_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  vector = vector && vector_exp_agrees();
  auto run = [&](auto* gp, auto* op) {
    at::parallel_for(0, T, row_grain(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) gelu_tanh_mul_span(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I, vector);
    });
  };
  if (bf) {
    run(data_of<bf16>(gate_up), data_of<bf16>(out));
  } else {
    run(gate_up.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

}  // namespace

// the bindings (cpu_kernels.cpp's module calls this once), each without the GIL as the others
void register_family_ops(py::module_& m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention_masked", &paged_attention_masked,
        "paged_attention with a sliding window and a score cap (0: none)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("cu_seqlens_q"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), no_gil);
  m.def("rms_norm_offset", &rms_norm_offset, "(x + residual) * rsqrt(mean(.^2) + eps) * (offset + weight) in float32",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0, no_gil);
  m.def("rope", &rope, "x (T, H, D) rotated by cos, sin (T, D), rotate-half", no_gil);
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up over (T, 2I) gate_up rows", py::arg("gate_up"),
        py::arg("vector") = true, no_gil);
}
