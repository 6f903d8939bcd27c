"""The decoder stack of any ModelSpec: for each layer, the spec's ops in order, calling one backend's ops.

Owns DecoderModel (the weights by role, the per-step RoPE rows, the layer walk and the logits' caps and
scales); leaves what a family is to spec.py / families.py, reading the checkpoint to loader.py and the ops
themselves to the backend (backends/torch_ref.py, backends/triton/). The spec and the backend are fixed at
load: nothing here checks a device or a dtype per call. A tensor-parallel rank (on the C++ ops backend) holds
its shard (engine/parallel/layout.ShardLayout) and meets the other ranks where llama.LlamaModel does: the
vocabulary-parallel embedding and logits, and row_parallel_linear after o_proj and down_proj.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.llama import Collectives, row_parallel_linear
from lmi_handler.engine.model.lora import LoraBatch
from lmi_handler.engine.model.spec import ModelSpec, RopeSpec, rope_cos_sin_rows

NORM_ROLES = ("attn_pre", "attn_post", "mlp_pre", "mlp_post", "q_norm", "k_norm")


@dataclass
class LayerWeights:
    """One layer's tensors by role (families.layer_tensor_names): fused qkv and gate_up rows, the norms the
    spec's placement has (None otherwise)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    attn_pre: torch.Tensor | None = None
    attn_post: torch.Tensor | None = None
    mlp_pre: torch.Tensor | None = None
    mlp_post: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class DecoderModel(nn.Module):
    """Embedding, the decoder layers as `spec` describes them and lm_head, over a flat token batch, with
    `ops` (a backend module) doing the arithmetic. The same call contract as llama.LlamaModel: forward(
    input_ids, positions, kv_caches, meta, invariant, lora) -> final-norm hidden states, compute_logits(hidden).
    A step with LoRA adapters (`lora`, a LoraBatch) adds each row's adapter term after every projection
    (qkv_proj, o_proj, gate_up_proj, down_proj: the fused rows this model holds).

    Tensor parallelism: built with `layout` (a ShardLayout), the weights are rank layout.rank's shard (its
    query and KV heads' rows of qkv and columns of o, its intermediate rows of gate_up and columns of down,
    its vocabulary rows of the embedding and lm_head; norms and the row-parallel biases whole) and `group`
    (set by the runner) its collectives, exactly as llama.LlamaModel uses them: the embedding row of each
    id comes from the rank holding it, o_proj and down_proj sum their float32 partials in rank order (the
    bias added once), compute_logits gathers the vocabulary slices to rank 0 (the others get None). Per-head
    q/k norms, windows, caps, multipliers and norm offsets act per row or per head, so a shard applies them
    to what it holds; OLMo-2's full-width q/k norm sums its squares over the ranks (_full_norm)."""

    def __init__(self, spec: ModelSpec, ops, embed: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, layers: list[LayerWeights], backend_name: str, layout=None):
        super().__init__()
        self.spec, self.ops, self.kernel_backend = spec, ops, backend_name
        self.layout = layout
        self.group: Collectives | None = None     # the runner sets it on a tensor-parallel rank
        self.num_heads = spec.num_heads if layout is None else layout.num_heads
        self.num_kv_heads = spec.num_kv_heads if layout is None else layout.num_kv_heads
        self._lora_add = ops.lora_add      # a backend's own LoRA kernel (triton), None: LoraBatch.add's
        self._lora_stack = ops.lora_stack  # and how it takes a projection's stacks (made once per adapter set)
        self.embed_tokens, self.final_norm, self.lm_head, self.layer_weights = embed, final_norm, lm_head, layers
        # id(RopeSpec) -> the rope with its frequencies on the weights' device, moved once here: a copy from the
        # host per step would cost a transfer, and a CUDA graph cannot record one
        self.ropes = {id(layer.rope): _on_device(layer.rope, embed.device) for layer in spec.layers if layer.rope}
        self._ropes_need_lengths = any(rope.depends_on_length for rope in self.ropes.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                invariant: bool = True, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> (T, hidden) after the final norm; writes this step's K/V.
        `lora`: the step's adapters, None when no row has one."""
        spec = self.spec
        x = self._embed(input_ids)
        if spec.embedding_scale is not None:
            x = x * torch.tensor(spec.embedding_scale, dtype=x.dtype)
        ropes = self._rope_rows(positions, meta, x.dtype)
        for i, (layer, w, (k_cache, v_cache)) in enumerate(zip(spec.layers, self.layer_weights, kv_caches)):
            h = self._norm(x, w.attn_pre)
            a = self._attention(h, w, k_cache, v_cache, meta, layer.window, ropes.get(id(layer.rope)), lora, i)
            x = self._add(x, self._norm(a, w.attn_post))
            m = self._mlp(self._norm(x, w.mlp_pre), w, lora, i)
            x = self._add(x, self._norm(m, w.mlp_post))
        return self._norm(x, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = True) -> torch.Tensor:
        """hidden (N, hidden_size) -> (N, vocab) float32, Granite's logits_scaling and Gemma 2's final cap
        applied. A tensor-parallel shard computes its vocabulary slice's (both act per logit), gathered to
        rank 0 in rank order; the other ranks get None."""
        spec = self.spec
        logits = self.ops.linear(hidden, self.lm_head, None)
        if spec.logit_scale is not None:
            logits = logits / spec.logit_scale
        if spec.final_logit_softcap is not None:
            logits = torch.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
        return logits.float() if self.group is None else self.group.gather_last_dim(logits.float())

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, hidden) embedding rows; a shard looks up the ids of its vocabulary slice and each
        row comes from the rank holding its id (group.gather_rows, a copy), as llama.LlamaModel.embed."""
        if self.group is None:
            return F.embedding(input_ids, self.embed_tokens)
        start, stop = self.layout.vocab
        rows = F.embedding((input_ids - start).clamp_(0, stop - start - 1), self.embed_tokens)
        return self.group.gather_rows(rows, input_ids // (stop - start))

    def _row_parallel(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """o_proj / down_proj: the backend's linear in one process, else the ranks' partials summed in rank
        order with the bias added once (llama.row_parallel_linear; the C++ ops' weights are packed)."""
        if self.group is None:
            return self.ops.linear(x, weight, bias)
        return row_parallel_linear(x, weight, bias, True, self.group)

    def _full_norm(self, x: torch.Tensor, weight: torch.Tensor, width: int, counted: bool) -> torch.Tensor:
        """OLMo-2's q / k norm over the whole projection when this rank holds only its heads' features: the
        float32 sums of squares of every rank added in rank order (group.all_reduce), then transformers'
        Olmo2RMSNorm arithmetic. counted False: this rank's KV head is a replica another rank already counts
        (its sum is left out, so each head counts once). x: (T, this rank's features); width: the whole
        projection's features (the mean's divisor)."""
        spec, x32 = self.spec, x.float()
        squares = (x32 * x32).sum(-1, keepdim=True)
        total = self.group.all_reduce(squares if counted else torch.zeros_like(squares))
        out = x32 * torch.rsqrt(total / width + spec.norm_eps)
        return ((weight.float() + spec.norm_offset) * out).to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        rows = x.reshape(-1, x.shape[-1])           # q / k per head: (T * heads, head_dim) rows
        return self.ops.rms_norm(rows, weight, self.spec.norm_eps, None, self.spec.norm_offset)[0].view(x.shape)

    def _add(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        scale = self.spec.residual_scale
        return x + (delta if scale is None else delta * scale)

    def _attention(self, h, w: LayerWeights, k_cache, v_cache, meta, window, cos_sin, lora: LoraBatch | None,
                   index: int):
        spec, ops = self.spec, self.ops
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, spec.head_dim
        qkv = ops.linear(h, w.qkv, w.qkv_bias)
        qkv = self._lora(qkv, h, lora, index, "qkv_proj")
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        if spec.qk_norm == "full" and self.group is not None:        # OLMo-2 sharded: squares summed over ranks
            q = self._full_norm(q, w.q_norm, spec.num_heads * dim, True)
            k = self._full_norm(k, w.k_norm, spec.num_kv_heads * dim, self.layout.rank % self.layout.kv_replicas == 0)
        elif spec.qk_norm == "full":                                 # OLMo-2: over the whole projection
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        q, k, v = q.reshape(-1, heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)
        if spec.qk_norm == "head":                                   # Qwen3, Gemma 3: over each head
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        if cos_sin is not None:
            q, k = self._rotate(q, *cos_sin), self._rotate(k, *cos_sin)
        ops.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, meta, spec.scale, window, spec.attn_softcap)
        o = o.reshape(-1, heads * dim)
        out = self._row_parallel(o, w.o, w.o_bias)
        return self._lora(out, o, lora, index, "o_proj")

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary = cos.shape[-1]
        if rotary == x.shape[-1]:
            return self.ops.rope(x, cos, sin)
        return torch.cat((self.ops.rope(x[..., :rotary].contiguous(), cos, sin), x[..., rotary:]), dim=-1)

    def _mlp(self, h: torch.Tensor, w: LayerWeights, lora: LoraBatch | None, index: int) -> torch.Tensor:
        gate_up = self.ops.linear(h, w.gate_up, w.gate_up_bias)
        gate_up = self._lora(gate_up, h, lora, index, "gate_up_proj")
        act = self.ops.act_mul(gate_up, self.spec.activation)
        out = self._row_parallel(act, w.down, w.down_bias)
        return self._lora(out, act, lora, index, "down_proj")

    def _lora(self, y: torch.Tensor, x: torch.Tensor, lora: LoraBatch | None, index: int,
              module: str) -> torch.Tensor:
        """y + the step's LoRA term of projection `module` of layer `index`: the backend's kernel (added onto y,
        a fresh projection output, in place) where it has one, LoraBatch.add's tiled product otherwise."""
        if lora is None:
            return y
        if self._lora_add is None:
            return lora.add(y, x, index, module)
        stack = lora.backend_stacks(self._lora_stack).get((index, module))
        return y if stack is None else self._lora_add(y, x, lora.row_slot, stack, lora.scale)

    def _rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype) -> dict:
        """id(RopeSpec) -> this step's (cos, sin) rows, one pair per distinct rope of the spec."""
        ropes: dict[int, RopeSpec] = self.ropes
        seq_lens = None
        if self._ropes_need_lengths:
            seq_lens = torch.repeat_interleave(torch.tensor(meta.context_lens_host),
                                               torch.tensor(meta.query_lens))
        return {key: rope_cos_sin_rows(rope, positions, seq_lens, dtype) for key, rope in ropes.items()}


def _on_device(rope: RopeSpec, device: torch.device) -> RopeSpec:
    """`rope` with its frequency tensors on `device`."""
    long_inv_freq = rope.long_inv_freq.to(device) if rope.long_inv_freq is not None else None
    return replace(rope, inv_freq=rope.inv_freq.to(device), long_inv_freq=long_inv_freq)
