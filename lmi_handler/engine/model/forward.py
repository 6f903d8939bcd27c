"""The decoder stack of any ModelSpec: for each layer, the spec's ops in order, calling one backend's ops.

Owns DecoderModel, the one forward of every family on every backend: the weights by role, the per-step RoPE
rows, the layer walk, the logits' caps and scales, and where a tensor-parallel shard meets the other ranks.
Leaves what a family is to spec.py / families.py, reading the checkpoint to loader.py, the ops themselves to
the backend (backends/torch_ref.py, backends/cpp.py, backends/triton/) and the row-parallel reduce to
linear.py. The spec, the backend and the form of the forward are fixed at load: nothing here checks a device,
a dtype or a family per call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.kernels import PackedWeight
from lmi_handler.engine.model.linear import Collectives, row_parallel_linear
from lmi_handler.engine.model.lora import LoraBatch
from lmi_handler.engine.model.moe import MoeWeights, moe_mlp
from lmi_handler.engine.model.spec import ModelSpec, RopeSpec, mrope_cos_sin_rows, rope_cos_sin_rows

NORM_ROLES = ("attn_pre", "attn_post", "mlp_pre", "mlp_post", "q_norm", "k_norm")
ROPE_SLAB = 256   # positions per slab of the CPU RoPE table (256 * head_dim floats: whole 32-float vectors)


@dataclass
class LayerWeights:
    """One layer's tensors by role (families.layer_tensor_names): fused qkv and gate_up rows (a backend's
    packed form where it packs them: kernels.PackedWeight on the cpp backend), the norms the spec's placement
    has (None otherwise). A sparse layer has `moe` (its router and experts) instead of gate_up and down."""

    qkv: torch.Tensor | PackedWeight
    o: torch.Tensor | PackedWeight
    gate_up: torch.Tensor | PackedWeight | None = None
    down: torch.Tensor | PackedWeight | None = None
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
    sinks: torch.Tensor | None = None       # (num_heads,) gpt-oss's attention sinks
    moe: MoeWeights | None = None


class DecoderModel(nn.Module):
    """Embedding, the decoder layers as `spec` describes them and lm_head, over a flat token batch, with
    `ops` (a backend module) doing the arithmetic: forward(input_ids, positions, kv_caches, meta, lora) ->
    final-norm hidden states, compute_logits(hidden) -> float32 logits. Every op computes a row from that row
    alone, so a sequence's bits never depend on the rest of its step.

    Two forms, chosen once here: where the backend offers a whole-stack operation for this spec
    (ops.decoder_stack: the cpp backend's fused C++ DecoderStack for a spec cpp_misfits() passes, one C++ call
    a step, not on a shard) `stack` holds it and forward hands it the step; otherwise (stack None) forward
    walks the layers op by op. On the cpp backend the two give the same bits (the stack chains the same
    kernels), so a test may set `stack = None` to compare them.

    LoRA: a step with adapters (`lora`, a LoraBatch) adds each row's adapter term after every projection
    (qkv_proj, o_proj, gate_up_proj, down_proj: the fused rows this model holds), through the backend's
    lora_add (the stack adds them itself with the same C++ kernel).

    Tensor parallelism: built with `layout` (a ShardLayout), the weights are rank layout.rank's shard (its
    query and KV heads' rows of qkv and columns of o, its intermediate rows of gate_up and columns of down,
    its vocabulary rows of the embedding and lm_head; norms and the row-parallel biases whole) and `group`
    (set by the runner) its collectives: the embedding row of each id comes from the rank holding it, o_proj
    and down_proj sum their float32 partials in rank order (linear.row_parallel_linear, the bias added once),
    compute_logits gathers the vocabulary slices to rank 0 (the others get None). Per-head q/k norms, windows,
    caps, multipliers and norm offsets act per row or per head, so a shard applies them to what it holds;
    OLMo-2's full-width q/k norm sums its squares over the ranks (_full_norm)."""

    def __init__(self, spec: ModelSpec, ops, embed: torch.Tensor | PackedWeight, final_norm: torch.Tensor,
                 lm_head: torch.Tensor | PackedWeight, layers: list[LayerWeights], backend_name: str, layout=None):
        super().__init__()
        self.spec, self.ops, self.kernel_backend = spec, ops, backend_name
        self.layout = layout
        self.group: Collectives | None = None     # the runner sets it on a tensor-parallel rank
        self.num_heads = spec.num_heads if layout is None else layout.num_heads
        self.num_kv_heads = spec.num_kv_heads if layout is None else layout.num_kv_heads
        self.embed_tokens, self.final_norm, self.lm_head, self.layer_weights = embed, final_norm, lm_head, layers
        # id(RopeSpec) -> the rope with its frequencies on the weights' device, moved once here: a copy from the
        # host per step would cost a transfer, and a CUDA graph cannot record one
        device = final_norm.device
        self.ropes = {id(layer.rope): _on_device(layer.rope, device) for layer in spec.layers if layer.rope}
        self._ropes_need_lengths = any(rope.depends_on_length for rope in self.ropes.values())
        # CPU: a step's cos / sin rows come from a table of every position (RopeTable); on a GPU each step
        # computes its own (a CUDA graph replays them, and a table could not grow inside one)
        self.rope_tables = {key: RopeTable(rope) for key, rope in self.ropes.items()
                            if device.type == "cpu" and not rope.depends_on_length}
        self.stack = ops.decoder_stack(spec, layers, final_norm, self.num_heads, self.num_kv_heads) \
            if layout is None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None, image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> (T, hidden) after the final norm; writes this step's K/V.
        positions may be (3, T) (M-RoPE's streams, a step with Qwen2-VL image tokens: _rope_rows).
        kv_caches[l]: (K, V), each (num_blocks, block_size, num_kv_heads, head_dim) in the activations' dtype.
        `lora`: the step's adapters, None when no row has one (never on a shard). `image_rows`: (rows (K,)
        int64, embeddings (K, hidden)): those rows' input embeddings are the images' (engine/model/vision/),
        put in after the embedding scale (Gemma 3 scales its token embeddings only)."""
        spec = self.spec
        x = self._embed(input_ids)
        if spec.embedding_scale is not None:
            x = x * torch.tensor(spec.embedding_scale, dtype=x.dtype)
        if image_rows is not None:
            x = x.index_copy(0, image_rows[0], image_rows[1].to(x.dtype))
        ropes = self._rope_rows(positions, meta, x.dtype)
        if self.stack is not None:                      # one rope on every layer (cpp_misfits)
            cos, sin = ropes[id(spec.layers[0].rope)]
            return self.stack(x, cos, sin, kv_caches, meta, lora)
        delta = None      # the last block's output, added to the residual stream x by the next norm
        for i, (layer, w, (k_cache, v_cache)) in enumerate(zip(spec.layers, self.layer_weights, kv_caches)):
            h, x = self._add_norm(x, delta, w.attn_pre)
            a = self._attention(h, w, k_cache, v_cache, meta, layer.window, ropes.get(id(layer.rope)), lora, i)
            delta = self._block_output(a, w.attn_post)
            h, x = self._add_norm(x, delta, w.mlp_pre)
            delta = self._block_output(self._mlp(h, w, lora, i), w.mlp_post)
        return self._add_norm(x, delta, self.final_norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (N, hidden_size) -> (N, vocab) float32 (written from the linear's float32 accumulators,
        never rounded to a bf16 model's dtype), Granite's logits_scaling and Gemma 2's final cap applied. A
        tensor-parallel shard computes its vocabulary slice's (both act per logit), gathered to rank 0 in rank
        order; the other ranks get None."""
        spec = self.spec
        logits = self.ops.linear(hidden, self.lm_head, None, torch.float32)
        if spec.logit_scale is not None:
            logits = logits / spec.logit_scale
        if spec.final_logit_softcap is not None:
            logits = torch.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
        return logits if self.group is None else self.group.gather_last_dim(logits)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, hidden) embedding rows (exact copies, from the packed lm_head's panels where a tied
        embedding shares them); a shard looks up the ids of its vocabulary slice (others clamped into it, then
        discarded) and each row comes from the rank holding its id (group.gather_rows, a copy)."""
        if self.group is None:
            return self._lookup(input_ids)
        start, stop = self.layout.vocab
        rows = self._lookup((input_ids - start).clamp_(0, stop - start - 1))
        return self.group.gather_rows(rows, input_ids // (stop - start))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, PackedWeight):
            return self.embed_tokens.rows(ids)
        return F.embedding(ids, self.embed_tokens)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm's output, the residual stream x + delta): the residual add folded into the norm (the
        backend's rms_norm, which may update x in place: the walk owns it). No norm here (OLMo-2's blocks
        have none before them): both are x + delta."""
        if weight is None:
            x = x if delta is None else x + delta
            return x, x
        spec = self.spec
        return self.ops.rms_norm(x, weight, spec.norm_eps, delta, spec.norm_offset, spec.norm_weight_in_float)

    def _block_output(self, out: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        """What a block adds to the residual stream: its output, post-normed where the placement says
        (OLMo-2, Gemma 2 / 3), times Granite's residual_multiplier."""
        out = self._norm(out, post_norm)
        scale = self.spec.residual_scale
        return out if scale is None else out * scale

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        spec = self.spec
        rows = x.reshape(-1, x.shape[-1])           # q / k per head: (T * heads, head_dim) rows
        out = self.ops.rms_norm(rows, weight, spec.norm_eps, None, spec.norm_offset, spec.norm_weight_in_float)[0]
        return out.view(x.shape)

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

    def _row_parallel(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """o_proj / down_proj: the backend's linear in one process, else the ranks' float32 partials summed in
        rank order with the bias added once (linear.row_parallel_linear)."""
        return row_parallel_linear(x, weight, bias, self.group, self.ops.linear)

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
        o = ops.paged_attention(q, k_cache, v_cache, meta, spec.scale, window, spec.attn_softcap, w.sinks)
        o = o.reshape(-1, heads * dim)
        out = self._row_parallel(o, w.o, w.o_bias)
        return self._lora(out, o, lora, index, "o_proj")

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary = cos.shape[-1]
        if rotary == x.shape[-1]:
            return self.ops.rope(x, cos, sin)
        return torch.cat((self.ops.rope(x[..., :rotary].contiguous(), cos, sin), x[..., rotary:]), dim=-1)

    def _mlp(self, h: torch.Tensor, w: LayerWeights, lora: LoraBatch | None, index: int) -> torch.Tensor:
        if w.moe is not None:                  # a sparse layer (moe.py); LoRA adapts the dense MLPs only
            return moe_mlp(h, w.moe, self.spec.layers[index].moe, self.ops)
        gate_up = self.ops.linear(h, w.gate_up, w.gate_up_bias)
        gate_up = self._lora(gate_up, h, lora, index, "gate_up_proj")
        act = self.ops.act_mul(gate_up, self.spec.activation)
        out = self._row_parallel(act, w.down, w.down_bias)
        return self._lora(out, act, lora, index, "down_proj")

    def _lora(self, y: torch.Tensor, x: torch.Tensor, lora: LoraBatch | None, index: int,
              module: str) -> torch.Tensor:
        """y + the step's LoRA term of projection `module` of layer `index` (the backend's lora_add)."""
        if lora is None:
            return y
        return self.ops.lora_add(y, x, lora, index, module, self.spec.num_layers)

    def _rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype) -> dict:
        """id(RopeSpec) -> this step's (cos, sin) rows, each (T, rotary_dim) in `dtype`, one pair per distinct
        rope of the spec (spec.rope_cos_sin_rows' values; on CPU read from its RopeTable). positions (3, T):
        M-RoPE's temporal, height and width streams (a step holding image tokens of Qwen2-VL); each stream's
        rows are looked up as (T,) positions are, and spec.mrope_cos_sin_rows picks each section's (a rope
        without sections takes the first stream)."""
        seq_lens = None
        if self._ropes_need_lengths:
            seq_lens = torch.repeat_interleave(torch.tensor(meta.context_lens_host),
                                               torch.tensor(meta.query_lens))
        bound = max(meta.context_lens_host, default=0)
        rows = {}
        for key, rope in self.ropes.items():
            table = self.rope_tables.get(key)
            if positions.dim() == 1:
                rows[key] = self._stream_rows(rope, table, positions, bound, seq_lens, dtype)
            elif rope.mrope_section is None:
                rows[key] = self._stream_rows(rope, table, positions[0], bound, seq_lens, dtype)
            else:
                rows[key] = mrope_cos_sin_rows(rope, [self._stream_rows(rope, table, p, bound, seq_lens, dtype)
                                                      for p in positions])
        return rows

    @staticmethod
    def _stream_rows(rope: RopeSpec, table: RopeTable | None, positions: torch.Tensor, bound: int,
                     seq_lens: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, rotary_dim) of one stream of (T,) positions: from `table` where there is one (CPU)."""
        if table is None:
            return rope_cos_sin_rows(rope, positions, seq_lens, dtype)
        return table.rows(positions, bound, dtype)


class RopeTable:
    """One rope's cos / sin rows of every position below a bound, per dtype, grown in slabs of ROPE_SLAB
    positions when a step needs more: two index_selects a step instead of the ~10 ops of computing them (on
    CPU a step's few rows cost more in dispatch than in arithmetic). A slab's elements are computed as a
    step's are (spec.rope_cos_sin_rows, ROPE_SLAB * rotary_dim elements: whole vectors, no scalar tail, one
    thread), so a position's row is the one the step would compute wherever its (T, rotary_dim) has no tail
    (rotary_dim a multiple of 32), and the same for every batch always. Not for the length-dependent kinds."""

    def __init__(self, rope: RopeSpec):
        self.rope = rope
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype):
        """positions: (T,) int64 CPU, each below `num_positions` -> cos, sin (T, rotary_dim) in `dtype`."""
        table = self.tables.get(dtype)
        if table is None or table[0].shape[0] < num_positions:
            have = 0 if table is None else table[0].shape[0]
            want = -(-max(num_positions, 2 * have, ROPE_SLAB) // ROPE_SLAB) * ROPE_SLAB
            slabs = [rope_cos_sin_rows(self.rope, torch.arange(start, start + ROPE_SLAB), None, dtype)
                     for start in range(have, want, ROPE_SLAB)]
            cos = torch.cat(([table[0]] if have else []) + [c for c, _ in slabs])
            sin = torch.cat(([table[1]] if have else []) + [s for _, s in slabs])
            table = self.tables[dtype] = (cos, sin)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


def _on_device(rope: RopeSpec, device: torch.device) -> RopeSpec:
    """`rope` with its frequency tensors on `device`."""
    long_inv_freq = rope.long_inv_freq.to(device) if rope.long_inv_freq is not None else None
    return replace(rope, inv_freq=rope.inv_freq.to(device), long_inv_freq=long_inv_freq)
