// LoRA's batched low-rank term, row by row: each row with an adapter slot s adds
//   y[t] += keep(scale[s] * ((x[t] A_s^T) B_s^T))
// to a projection's output y (its input x), rows of the base (slot -1) untouched. The stacks are a step's
// adapter set (lora.py LoraBatch, the runner's, built once per set): A (S, R, in) and B^T (S, R, out) float32,
// ranks below R zero-padded (a fused projection's parts side by side along R, block diagonal in B).
//
// Batch-invariant by construction: a row's term is one fixed chain of float operations that reads only that
// row, its slot's weights and scale, whatever the other rows are and wherever the row sits:
//   shrink u[k] = dot(x[t], A_s[k]): vector lanes accumulated by FMA over the in features in order, the lanes
//     then summed in Vec::sum's fixed order, the tail (in % W) added after by FMA in order;
//   expand e[j] = fma(u[R-1], Bt[R-1][j], ... fma(u[0], Bt[0][j], 0)): k ascending, the same FMAs in a vector
//     lane and in the scalar tail (std::fma), so a column's bits do not depend on its lane;
//   y[j] = keep(y[j] + keep(e[j] * scale[s])): lora_delta's roundings (its term rounded to y's dtype, then the
//     add), float32 throughout (bf16 activations loaded as float; the stacks are float32).
// The order differs from lora_delta's bmm (MKL's), so the two agree within float32 rounding, not bitwise.
#pragma once

#include "common.h"

#include <array>
#include <type_traits>

namespace {

// NR rows of one slot (xf[r]: row r's input as float, yr[r]: its output row): each row's chain is the one
// described above whatever NR is (the rows only share the weights' loads: Zen 4 measured the expand bound by
// reading B^T from L2, once per row). u: NR * R floats of scratch.
template <class T, int NR>
inline void lora_block(const float* const* xf, int64_t in, T* const* yr, int64_t out, const float* as, const float* bs,
                       int64_t R, float sc, float* u) {
  constexpr int W = Vec::W;
  for (int64_t k = 0; k < R; ++k) {   // shrink
    const float* ak = as + k * in;
    Vec c[NR];
    for (int r = 0; r < NR; ++r) c[r] = Vec::zero();
    int64_t j = 0;
    for (; j + W <= in; j += W) {
      const Vec av = Vec::load(ak + j);
      for (int r = 0; r < NR; ++r) c[r] = Vec::fma(Vec::load(xf[r] + j), av, c[r]);
    }
    for (int r = 0; r < NR; ++r) {
      float sk = c[r].sum();
      for (int64_t jj = j; jj < in; ++jj) sk = std::fma(xf[r][jj], ak[jj], sk);
      u[r * R + k] = sk;
    }
  }
  int64_t j = 0;   // expand, times the scale, added to y
  alignas(64) float e[W];
  for (; j + W <= out; j += W) {
    Vec c[NR];
    for (int r = 0; r < NR; ++r) c[r] = Vec::zero();
    for (int64_t k = 0; k < R; ++k) {
      const Vec bv = Vec::load(bs + k * out + j);
      for (int r = 0; r < NR; ++r) c[r] = Vec::fma(Vec::bcast(u[r * R + k]), bv, c[r]);
    }
    for (int r = 0; r < NR; ++r) {
      c[r].store(e);
      for (int l = 0; l < W; ++l) store_scalar<T>(yr[r] + j + l, load_scalar<T>(yr[r] + j + l) + keep<T>(e[l] * sc));
    }
  }
  for (; j < out; ++j) {
    for (int r = 0; r < NR; ++r) {
      float c = 0.f;
      for (int64_t k = 0; k < R; ++k) c = std::fma(u[r * R + k], bs[k * out + j], c);
      store_scalar<T>(yr[r] + j, load_scalar<T>(yr[r] + j) + keep<T>(c * sc));
    }
  }
}

constexpr int LORA_BLOCK = 4;   // rows of one slot sharing the weights' loads

// rows [r0, r1) of `rows` (indices into x / y; each rows[i]'s slot is slots[i] >= 0), in blocks of up to
// LORA_BLOCK consecutive rows of one slot
template <class T>
void lora_add_span(const T* x, int64_t ldx, int64_t in, T* y, int64_t ldy, int64_t out, const int64_t* rows,
                   const int64_t* slots, int64_t r0, int64_t r1, const float* a, const float* bt, int64_t R,
                   const float* scale) {
  thread_local std::vector<float> xbuf, ubuf;
  if (static_cast<int64_t>(xbuf.size()) < LORA_BLOCK * in) xbuf.resize(LORA_BLOCK * in);
  if (static_cast<int64_t>(ubuf.size()) < LORA_BLOCK * R) ubuf.resize(LORA_BLOCK * R);
  for (int64_t i = r0; i < r1;) {
    const int64_t s = slots[i];
    int nr = 1;
    while (nr < LORA_BLOCK && i + nr < r1 && slots[i + nr] == s) ++nr;
    const float* xf[LORA_BLOCK];
    T* yr[LORA_BLOCK];
    for (int r = 0; r < nr; ++r) {
      const int64_t t = rows[i + r];
      yr[r] = y + t * ldy;
      if constexpr (std::is_same_v<T, float>) {
        xf[r] = x + t * ldx;
      } else {
        float* dst = xbuf.data() + r * in;
        for (int64_t j = 0; j < in; ++j) dst[j] = load_scalar<T>(x + t * ldx + j);
        xf[r] = dst;
      }
    }
    const float *as = a + s * R * in, *bs = bt + s * R * out;
    const float sc = scale[s];
    switch (nr) {
      case 4: lora_block<T, 4>(xf, in, yr, out, as, bs, R, sc, ubuf.data()); break;
      case 3: lora_block<T, 3>(xf, in, yr, out, as, bs, R, sc, ubuf.data()); break;
      case 2: lora_block<T, 2>(xf, in, yr, out, as, bs, R, sc, ubuf.data()); break;
      default: lora_block<T, 1>(xf, in, yr, out, as, bs, R, sc, ubuf.data()); break;
    }
    i += nr;
  }
}

// A step's rows that have an adapter, grouped by slot (a thread's consecutive rows share their slot's
// weights in its caches; the grouping changes no row's bits). Made once a step, shared by every projection.
struct LoraRows {
  std::vector<int64_t> rows, slots;
  LoraRows() = default;
  LoraRows(const torch::Tensor& row_slot, int64_t T, int64_t num_slots) {
    TORCH_CHECK(row_slot.scalar_type() == torch::kInt64 && row_slot.dim() == 1 && row_slot.numel() == T &&
                row_slot.device().is_cpu(), "row_slot must be (T,) int64 on the CPU, one per row of x");
    const torch::Tensor rs = row_slot.contiguous();
    const int64_t* p = rs.data_ptr<int64_t>();
    for (int64_t s = 0; s < num_slots; ++s)
      for (int64_t t = 0; t < T; ++t)
        if (p[t] == s) rows.push_back(t), slots.push_back(s);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(p[t] >= -1 && p[t] < num_slots, "row_slot[", t, "] = ", p[t], " is outside [-1, ", num_slots, ")");
  }
  bool empty() const { return rows.empty(); }
};

// y (T, out) += each row's LoRA term of x (T, in), in place; a (S, R, in), bt (S, R, out), scale (S,) float32
// contiguous (checked by the caller: lora_check). Rows shared over the pool's threads.
template <class T>
void lora_add_into(const torch::Tensor& x, torch::Tensor& y, const LoraRows& lr, const torch::Tensor& a,
                   const torch::Tensor& bt, const torch::Tensor& scale) {
  if (lr.empty()) return;
  const int64_t in = x.size(1), out = y.size(1), R = a.size(1), n = static_cast<int64_t>(lr.rows.size());
  const int64_t work = R * (in + out);   // a chunk: whole blocks of rows
  const int64_t chunk = std::max<int64_t>(1, ROW_GRAIN / std::max<int64_t>(1, work) / LORA_BLOCK) * LORA_BLOCK;
  parallel_chunks(n, chunk, [&](int64_t r0, int64_t r1) {
    lora_add_span<T>(data_of<T>(x), x.stride(0), in, data_of<T>(y), y.stride(0), out, lr.rows.data(),
                     lr.slots.data(), r0, r1, a.data_ptr<float>(), bt.data_ptr<float>(), R, scale.data_ptr<float>());
  });
}

inline void lora_check(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& a, const torch::Tensor& bt,
                       const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "x (T, in) and y (T, out) must have rows of unit stride, the same T");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must have one dtype");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && bt.scalar_type() == torch::kFloat32 &&
              scale.scalar_type() == torch::kFloat32 && a.is_contiguous() && bt.is_contiguous() &&
              scale.is_contiguous(), "A, B^T and scale must be contiguous float32");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
              a.size(2) == x.size(1) && bt.size(2) == y.size(1) && scale.numel() == a.size(0),
              "A must be (S, R, in), B^T (S, R, out), scale (S,), in and out those of x and y");
}

// The binding: y += the LoRA term of x for each row's slot (row_slot (T,) int64, -1 = none), in place; returns y.
torch::Tensor lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor row_slot, torch::Tensor a, torch::Tensor bt,
                       torch::Tensor scale) {
  const bool bf = is_bf16(x, "x");
  lora_check(x, y, a, bt, scale);
  const LoraRows lr(row_slot, x.size(0), a.size(0));
  if (bf) {
    lora_add_into<bf16>(x, y, lr, a, bt, scale);
  } else {
    lora_add_into<float>(x, y, lr, a, bt, scale);
  }
  return y;
}

// One adapter set's stacks for the decoder stack: per layer, A and B^T of qkv, o, gate_up and down (each pair
// absent where no adapter of the set has that projection), and the slots' scales. Built once per set
// (LoraBatch.kernel_set, from the runner's LoraBatch) and passed to DecoderStack.forward_lora with a step's row_slot.
struct LoraSet {
  static constexpr int PROJ = 4;   // qkv, o, gate_up, down
  struct Pair {
    torch::Tensor a, bt;
    bool defined() const { return a.defined(); }
  };
  std::vector<std::array<Pair, PROJ>> layers;
  torch::Tensor scale;

  // ls[l]: 8 tensors or None (A, B^T of qkv, o, gate_up, down)
  LoraSet(const std::vector<std::vector<c10::optional<torch::Tensor>>>& ls, torch::Tensor scale_)
      : scale(scale_.to(torch::kFloat32).contiguous()) {
    for (const auto& t : ls) {
      TORCH_CHECK(t.size() == 2 * PROJ, "a layer is 8 tensors or None (A, B^T of qkv, o, gate_up, down)");
      std::array<Pair, PROJ> layer;
      for (int p = 0; p < PROJ; ++p) {
        const auto &a = t[2 * p], &bt = t[2 * p + 1];
        const bool has = a.has_value() && a->defined();
        TORCH_CHECK(has == (bt.has_value() && bt->defined()), "A without B^T or the reverse");
        if (!has) continue;
        layer[p] = {a->contiguous(), bt->contiguous()};
        TORCH_CHECK(layer[p].a.scalar_type() == torch::kFloat32 && layer[p].bt.scalar_type() == torch::kFloat32 &&
                    layer[p].a.dim() == 3 && layer[p].bt.dim() == 3 && layer[p].a.size(0) == scale.numel() &&
                    layer[p].bt.size(0) == scale.numel() && layer[p].a.size(1) == layer[p].bt.size(1),
                    "A (S, R, in) and B^T (S, R, out) float32, S the scales' number");
      }
      layers.push_back(layer);
    }
  }
  int64_t num_slots() const { return scale.numel(); }

  // y += layer `l`'s projection `p` term (nothing where the set has none); shapes checked
  template <class T>
  void add(const torch::Tensor& x, torch::Tensor& y, const LoraRows& lr, size_t l, int p) const {
    if (l >= layers.size() || !layers[l][p].defined()) return;
    const Pair& pr = layers[l][p];
    lora_check(x, y, pr.a, pr.bt, scale);
    lora_add_into<T>(x, y, lr, pr.a, pr.bt, scale);
  }

  bool has(size_t l, int p) const { return l < layers.size() && layers[l][p].defined(); }

  // the binding for the walk (backends/cpp.py lora_add): y += projection p of layer l's term, in place
  torch::Tensor add_one(torch::Tensor y, torch::Tensor x, torch::Tensor row_slot, int64_t l, int64_t p) const {
    TORCH_CHECK(p >= 0 && p < PROJ && l >= 0, "projection 0..3 (qkv, o, gate_up, down), layer >= 0");
    const bool bf = is_bf16(x, "x");
    const LoraRows lr(row_slot, x.size(0), num_slots());
    if (bf) {
      add<bf16>(x, y, lr, static_cast<size_t>(l), static_cast<int>(p));
    } else {
      add<float>(x, y, lr, static_cast<size_t>(l), static_cast<int>(p));
    }
    return y;
  }
};

}  // namespace
