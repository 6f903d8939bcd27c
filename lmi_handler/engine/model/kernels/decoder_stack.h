// The fused decoder stack: every decoder layer of a Llama-shaped model and the final norm, one C++ call a step,
// chaining rowwise.h's row-wise ops, attention.h's paged attention, lora.h's adapter terms and each linear's
// kernel (stack_linear.h: linear.h's packed panels, or linear_quant.h's code panels through quant.cpp). Each layer's
// weights are held by role (StackLayer: named norms and linears, built by backends/cpp.py's DecoderStack from the
// model's LayerWeights), not by position.
#pragma once

#include <optional>

#include "rowwise.h"
#include "stack_linear.h"

namespace {

// One decoder layer's weights by role (forward.py's LayerWeights names): the norms before attention and before
// the MLP (in x's dtype), and the four linears, each of any kind (stack_linear.h).
struct StackLayer {
  torch::Tensor attn_pre;
  lmi_stack::Linear qkv, o;
  torch::Tensor mlp_pre;
  lmi_stack::Linear gate_up, down;

  StackLayer(torch::Tensor attn_pre_, lmi_stack::Linear qkv_, lmi_stack::Linear o_, torch::Tensor mlp_pre_,
             lmi_stack::Linear gate_up_, lmi_stack::Linear down_)
      : attn_pre(std::move(attn_pre_)), qkv(std::move(qkv_)), o(std::move(o_)), mlp_pre(std::move(mlp_pre_)),
        gate_up(std::move(gate_up_)), down(std::move(down_)) {
    TORCH_CHECK(attn_pre.defined() && mlp_pre.defined(), "a stack layer needs both norms");
    TORCH_CHECK(gate_up.out_features % 2 == 0, "gate_up's rows are [gate | up]");
  }
};

// y = x @ W^T (+ bias) by the linear's kind, in x's dtype (bf): panels through linear.h into `out` (its shape),
// codes through linear_quant.h (a tensor of its own, which `out` then holds).
inline void linear_into(const lmi_stack::Linear& w, const torch::Tensor& x, bool bf, int64_t form, torch::Tensor& out) {
  if (w.kind == lmi_stack::Kind::Panels) {
    linear_impl<void>(x, w.weight, w.out_features, w.bias, w.scale, bf, form, &out);
  } else {
    out = lmi_stack::codes_linear(x, w, bf);
  }
}

// the same as a tensor of its own
inline torch::Tensor linear_of(const lmi_stack::Linear& w, const torch::Tensor& x, bool bf, int64_t form) {
  if (w.kind == lmi_stack::Kind::Panels) return linear(x, w.weight, w.out_features, w.bias, w.scale, bf, form);
  return lmi_stack::codes_linear(x, w, bf);
}

// A step's intermediate tensors, made once by DecoderStack::forward and reused by every layer (each op
// used to make its output tensor: 8 a layer, 240 a demo-model step, each a posix_memalign and a free,
// which with the caches cold from the weights' stream cost more than the op itself at batch 1).
// T rows, x's dtype: h (T, hidden) a norm's output; qkv (T, (H + 2 KVH) D); q and attn (T, H, D); delta
// (T, hidden) the o and then the down linear's output (each consumed by the next norm before the next
// linear writes it); act (T, intermediate) silu(gate) * up. Bits: the same operations as the ops' own outputs.
// (A codes linear's output is a tensor of its own, which qkv or delta then holds: linear_into.)
struct Workspace {
  torch::Tensor h, qkv, q, attn, attn_rows, delta, act;   // attn_rows: attn as (T, H D)
  Workspace(const torch::Tensor& x, int64_t H, int64_t KVH, int64_t D, int64_t intermediate) {
    const int64_t T = x.size(0);
    auto opt = x.options();
    h = torch::empty_like(x);
    qkv = torch::empty({T, (H + 2 * KVH) * D}, opt);
    q = torch::empty({T, H, D}, opt);
    attn = torch::empty({T, H, D}, opt);
    attn_rows = attn.view({T, H * D});
    delta = torch::empty_like(x);
    act = torch::empty({T, intermediate}, opt);
  }
};

// x (T, N) += delta (when given, in place); ws.h = weight * rmsnorm(x) (add_rmsnorm's operations)
template <class T>
inline void add_rmsnorm_into(torch::Tensor& x, const torch::Tensor* delta, const torch::Tensor& weight, double eps,
                             torch::Tensor& h) {
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be (N,) contiguous in x's dtype");
  add_rmsnorm_rows<T>(data_of<T>(x), delta ? data_of<T>(*delta) : nullptr, data_of<T>(weight), data_of<T>(h), x.size(0),
                      x.size(1), static_cast<float>(eps));
}

// The per-step inputs every layer shares (DecoderStack::forward's), checked once a step
struct StepInputs {
  torch::Tensor cos, sin, slot_mapping;
  const AttentionPlan& plan;
  int64_t H, KVH, intermediate;
  double eps, scale;
  int64_t bf16_form;   // linear's form for bf16 panels (Bf16Form)
};

// A step's LoRA adapters for the stack (DecoderStack::forward_lora): the set's stacks and the step's rows by slot.
struct LoraStep {
  const LoraSet& set;
  const LoraRows& rows;
  size_t layer;   // the layer being run
};

// One Llama decoder layer on the residual stream x (T, hidden), float32 or bfloat16, in place:
//   x += delta (the previous layer's down output, when `add_delta`); h = rmsnorm(x) -> qkv linear -> rope +
//   KV write -> paged attention -> o linear; x += o; h = rmsnorm(x) -> gate_up linear with silu * up -> down.
// Leaves the down output in ws.delta: the next layer's first norm (or the final norm) adds it to x, as
// forward.py's walk does, so x is read and written once a layer less (the same operations as adding it here).
// Every stage is one of the row-invariant ops (their functions, into the workspace's tensors), so the layer is
// too, and bitwise the ops called one by one. Linears write x's dtype; each linear's kind picks its kernel.
template <class T>
inline void layer_forward(torch::Tensor& x, bool add_delta, const StackLayer& l, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const StepInputs& in, Workspace& ws,
                          const LoraStep* lora = nullptr) {
  constexpr bool bf = std::is_same_v<T, bf16>;
  const int64_t T_rows = x.size(0), D = k_cache.size(3), H = in.H, KVH = in.KVH, form = in.bf16_form;
  add_rmsnorm_into<T>(x, add_delta ? &ws.delta : nullptr, l.attn_pre, in.eps, ws.h);
  linear_into(l.qkv, ws.h, bf, form, ws.qkv);
  if (lora) lora->set.add<T>(ws.h, ws.qkv, lora->rows, lora->layer, 0);
  rope_kv_write_rows<T>(data_of<T>(ws.qkv), data_of<T>(in.cos), data_of<T>(in.sin), data_of<T>(k_cache),
                        data_of<T>(v_cache), in.slot_mapping.data_ptr<int64_t>(), data_of<T>(ws.q), T_rows, H, KVH, D);
  paged_attention_into(ws.q, k_cache, v_cache, in.plan, in.scale, ws.attn);
  linear_into(l.o, ws.attn_rows, bf, form, ws.delta);
  if (lora) lora->set.add<T>(ws.attn_rows, ws.delta, lora->rows, lora->layer, 1);
  add_rmsnorm_into<T>(x, &ws.delta, l.mlp_pre, in.eps, ws.h);
  const bool gate_up_lora = lora && lora->set.has(lora->layer, 2);
  if (!gate_up_lora && l.gate_up.kind == lmi_stack::Kind::Panels &&
      pairable(l.gate_up.weight.scalar_type(), l.gate_up.out_features, form)) {
    linear_impl<SiluMul>(ws.h, l.gate_up.weight, l.gate_up.out_features, l.gate_up.bias, l.gate_up.scale, bf, form,
                         &ws.act);
  } else {
    // the linear's output whole, its LoRA term added before silu * up, then silu_mul's rows (the paired form is
    // bitwise these, so rows without an adapter keep their bits)
    torch::Tensor gate_up = linear_of(l.gate_up, ws.h, bf, form);
    if (gate_up_lora) lora->set.add<T>(ws.h, gate_up, lora->rows, lora->layer, 2);
    silu_mul_rows<T>(data_of<T>(gate_up), data_of<T>(ws.act), T_rows, in.intermediate, true);
  }
  linear_into(l.down, ws.act, bf, form, ws.delta);
  if (lora) lora->set.add<T>(ws.act, ws.delta, lora->rows, lora->layer, 3);
}

// The whole decoder stack and the final norm, held once (the weights' tensors, not copies): one call a
// step in place of one call per layer, so a decode step converts its arguments once, not 28 per layer
// (bitwise the layers' ops called one by one: test_the_walk_is_bitwise_the_fused_stack_through_the_runner). Built
// by backends/cpp.py's DecoderStack at load, from its layers' StackLayers.
struct DecoderStack {
  std::vector<StackLayer> layers;
  torch::Tensor norm;
  int64_t H, KVH, intermediate;
  double eps, norm_eps, scale;

  DecoderStack(std::vector<StackLayer> ls, torch::Tensor norm_w, int64_t H_, int64_t KVH_, double eps_,
               double norm_eps_, double scale_)
      : layers(std::move(ls)), norm(norm_w), H(H_), KVH(KVH_), eps(eps_), norm_eps(norm_eps_), scale(scale_) {
    TORCH_CHECK(!layers.empty() && H > 0 && KVH > 0 && H % KVH == 0, "the stack needs a layer and H a multiple of KVH");
    intermediate = layers[0].gate_up.out_features / 2;
    const int64_t hidden = norm.numel();
    for (const StackLayer& l : layers) {
      TORCH_CHECK(l.gate_up.out_features == 2 * intermediate && l.o.out_features == hidden &&
                  l.down.out_features == hidden && l.attn_pre.numel() == hidden && l.mlp_pre.numel() == hidden,
                  "every layer's o and down write the hidden width, gate_up 2 x the same intermediate, and its "
                  "norms are hidden wide");
    }
  }

  // x: (T, hidden) float32 or bfloat16 (not changed); cos, sin: (T, head_dim); k_caches[l], v_caches[l]:
  // layer l's cache; the attention metadata as paged_attention's. Returns the final-norm hidden states (T, hidden).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor context_lens, torch::Tensor cu_seqlens_q, int64_t bf16_form) const {
    return forward_impl(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, cu_seqlens_q,
                        bf16_form, nullptr, torch::Tensor());
  }

  // forward with a step's LoRA adapters: `lora` the adapter set's stacks (LoraSet, one per set), row_slot (T,)
  // int64 each row's slot in it (-1 = the base). Each layer adds the rows' terms after its qkv, o, gate_up (before
  // silu * up) and down linears (lora.h: row-wise, so the stack stays batch-invariant); rows of the base keep
  // forward's bits.
  torch::Tensor forward_lora(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                             const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                             torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                             torch::Tensor cu_seqlens_q, int64_t bf16_form, const LoraSet& lora,
                             torch::Tensor row_slot) const {
    TORCH_CHECK(lora.layers.size() == layers.size(), "the LoRA set has ", lora.layers.size(), " layers, the stack ",
                layers.size());
    return forward_impl(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, cu_seqlens_q,
                        bf16_form, &lora, row_slot);
  }

  torch::Tensor forward_impl(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                             const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                             torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                             torch::Tensor cu_seqlens_q, int64_t bf16_form, const LoraSet* lora,
                             const torch::Tensor& row_slot) const {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "one K and V cache per layer");
    const bool bf = is_bf16(x, "x");
    TORCH_CHECK(x.dim() == 2 && !layers.empty(), "x must be (T, hidden) and the stack have a layer");
    torch::Tensor h = x.contiguous().clone();        // the residual stream, updated in place by every layer
    const int64_t T = h.size(0), D = k_caches[0].size(3);
    TORCH_CHECK(k_caches[0].dim() == 4 && H % KVH == 0 && D % 2 == 0, "bad cache or head shapes");
    // the step's inputs, checked once for every layer (rope_kv_write's and paged_attention's checks)
    cos = cos.contiguous();
    sin = sin.contiguous();
    TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == h.scalar_type() &&
                sin.scalar_type() == h.scalar_type(), "cos/sin must be (T, head_dim) in x's dtype");
    slot_mapping = slot_mapping.contiguous();
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == T, "slot_mapping must be (T,) int64");
    const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    for (size_t l = 0; l < layers.size(); ++l) {   // every layer's caches, once for both paths
      const torch::Tensor &k = k_caches[l], &v = v_caches[l];
      TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.scalar_type() == h.scalar_type() &&
                  v.scalar_type() == h.scalar_type() && k.size(2) == KVH && k.size(3) == D && v.sizes() == k.sizes() &&
                  k.size(0) * k.size(1) == num_slots,
                  "caches must be contiguous (blocks, BS, KVH, D) in x's dtype, every layer's the same size");
    }
    const AttentionPlan plan(T, k_caches[0].size(1), block_tables, context_lens, cu_seqlens_q);
    const StepInputs in{cos, sin, slot_mapping, plan, H, KVH, intermediate, eps, scale, bf16_form};
    TORCH_CHECK(h.size(1) == norm.numel(), "x has ", h.size(1), " features, the stack ", norm.numel());
    for (const StackLayer& l : layers)
      TORCH_CHECK(l.qkv.out_features == (H + 2 * KVH) * D, "qkv writes (H + 2 KVH) head_dim features");
    Workspace ws(h, H, KVH, D, intermediate);
    const LoraRows lora_rows = lora ? LoraRows(row_slot, T, lora->num_slots()) : LoraRows();
    const LoraSet* lo = lora && !lora_rows.empty() ? lora : nullptr;   // null: no row has an adapter
    for (size_t l = 0; l < layers.size(); ++l) {
      std::optional<LoraStep> step;
      const LoraStep* layer_lora = lo ? &step.emplace(LoraStep{*lo, lora_rows, l}) : nullptr;
      if (bf) {
        layer_forward<bf16>(h, l > 0, layers[l], k_caches[l], v_caches[l], in, ws, layer_lora);
      } else {
        layer_forward<float>(h, l > 0, layers[l], k_caches[l], v_caches[l], in, ws, layer_lora);
      }
    }
    return add_rmsnorm(h, ws.delta, norm, norm_eps);   // the last down output, then the final norm
  }
};

}  // namespace
