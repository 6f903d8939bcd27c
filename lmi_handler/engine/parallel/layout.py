"""Which slice of each weight a tensor-parallel rank holds, and the start-up checks of the degree.

Owns the shard layout as pure functions of (model shape, rank, degree) and of weight tensors; leaves
reading the checkpoint to model/loader.py and running the shards (collectives) to group.py.

    column-parallel (split the outputs)       row-parallel (split the inputs, all-reduce after)
    q/k/v_proj: rows of the rank's heads      o_proj:    columns of the rank's query heads
    gate/up_proj: rows [i0, i1)               down_proj: columns [i0, i1)
    vocabulary-parallel: embed_tokens and lm_head rows [v0, v1); norms and row-parallel biases: whole
    fused qkv_proj / gate_up_proj (Phi-3): each part's rows as above, concatenated (q | k | v, gate | up)
    q/k norms: per head (Qwen3, Gemma 3, (head_dim,)) whole; OLMo-2's full-width ones the rank's heads

Rules from vLLM (ModelConfig.verify_with_parallel_config, QKVParallelLinear): query heads,
intermediate size and vocabulary divisible by the degree; KV heads divisible by it, or the degree a
multiple of the KV heads, which are then replicated (rank r holds KV head r // (degree / num_kv_heads)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.config import ConfigError


def degree_problems(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                    degree: int) -> list[str]:
    """The rules `degree` breaks for this model shape, each one sentence in vLLM's wording; [] = it fits."""
    problems = []
    if num_heads % degree:
        problems.append(f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel "
                        f"size ({degree}).")
    if num_kv_heads % degree and degree % num_kv_heads:
        problems.append(f"Total number of KV heads ({num_kv_heads}) must be divisible by tensor parallel size "
                        f"({degree}), or tensor parallel size a multiple of it (KV heads replicated).")
    if intermediate_size % degree:
        problems.append(f"Intermediate size ({intermediate_size}) must be divisible by tensor parallel size "
                        f"({degree}).")
    if vocab_size % degree:
        problems.append(f"Vocabulary size ({vocab_size}) must be divisible by tensor parallel size ({degree}).")
    return problems


def check_degree(args, degree: int) -> None:
    """Refuse a degree the model cannot be split by (start-up; the model's ModelSpec or any object with
    num_heads, num_kv_heads, intermediate_size and vocab_size).

    Raises: ConfigError naming option.tensor_parallel_degree, every rule it breaks (vLLM's wording) and
    the degrees up to the number of query heads that would fit.
    """
    shape = (args.num_heads, args.num_kv_heads, args.intermediate_size, args.vocab_size)
    problems = degree_problems(*shape, degree)
    if problems:
        fits = [d for d in range(1, args.num_heads + 1) if not degree_problems(*shape, d)]
        raise ConfigError(f"option.tensor_parallel_degree={degree}: {' '.join(problems)} "
                          f"Degrees this model takes: {', '.join(map(str, fits))}.")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `degree`: its query heads, KV heads, intermediate columns and vocabulary rows.

    Ranges are [start, stop) in units of heads, intermediate features and vocabulary ids.
    """

    rank: int
    degree: int
    head_dim: int
    heads: tuple[int, int]            # query heads
    kv_heads: tuple[int, int]         # KV heads (one, shared with kv_replicas - 1 other ranks, when replicated)
    kv_replicas: int                  # ranks holding each KV head: 1 when KV heads are split
    intermediate: tuple[int, int]     # gate/up rows, down_proj columns
    vocab: tuple[int, int]            # embedding and lm_head rows

    @classmethod
    def of(cls, args, rank: int, degree: int) -> "ShardLayout":
        """The layout of `rank` for a model (its ModelSpec or alike). Raises ConfigError (check_degree)."""
        check_degree(args, degree)
        if not 0 <= rank < degree:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {degree}")
        h, i, v = args.num_heads // degree, args.intermediate_size // degree, args.vocab_size // degree
        if args.num_kv_heads >= degree:
            kv, replicas = args.num_kv_heads // degree, 1
            kv_heads = (rank * kv, (rank + 1) * kv)
        else:
            replicas = degree // args.num_kv_heads
            kv_heads = (rank // replicas, rank // replicas + 1)
        return cls(rank=rank, degree=degree, head_dim=args.head_dim, heads=(rank * h, (rank + 1) * h),
                   kv_heads=kv_heads, kv_replicas=replicas, intermediate=(rank * i, (rank + 1) * i),
                   vocab=(rank * v, (rank + 1) * v))

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


@dataclass(frozen=True)
class Shard:
    """Take [start, stop) along `dim` of a weight (0: rows, i.e. output features; 1: input features)."""

    dim: int
    start: int
    stop: int


# HF weight name suffix -> what part of it a rank takes: "heads" / "kv_heads" in units of head_dim rows
# (or columns), "intermediate" and "vocab" in rows (or columns); None = every rank holds all of it
_SHARDED = {
    "self_attn.q_proj.weight": (0, "heads"), "self_attn.q_proj.bias": (0, "heads"),
    "self_attn.k_proj.weight": (0, "kv_heads"), "self_attn.k_proj.bias": (0, "kv_heads"),
    "self_attn.v_proj.weight": (0, "kv_heads"), "self_attn.v_proj.bias": (0, "kv_heads"),
    "self_attn.o_proj.weight": (1, "heads"), "self_attn.o_proj.bias": None,
    "mlp.gate_proj.weight": (0, "intermediate"), "mlp.gate_proj.bias": (0, "intermediate"),
    "mlp.up_proj.weight": (0, "intermediate"), "mlp.up_proj.bias": (0, "intermediate"),
    "mlp.down_proj.weight": (1, "intermediate"), "mlp.down_proj.bias": None,
    "input_layernorm.weight": None, "post_attention_layernorm.weight": None,
    "pre_feedforward_layernorm.weight": None, "post_feedforward_layernorm.weight": None,
    "self_attn.q_norm.weight": None, "self_attn.k_norm.weight": None,
    "model.embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"), "model.norm.weight": None,
}
# fused checkpoint tensors (Phi-3) -> their parts in row order, each taken as its own rule says
_FUSED = {"self_attn.qkv_proj.weight": ("heads", "kv_heads", "kv_heads"),
          "mlp.gate_up_proj.weight": ("intermediate", "intermediate")}
# OLMo-2's q/k norms span the whole projection: the rank's heads of it (shard_of(full_qk_norm=True))
_FULL_QK_NORM = {"self_attn.q_norm.weight": (0, "heads"), "self_attn.k_norm.weight": (0, "kv_heads")}


def _total(layout: ShardLayout, part: str) -> int:
    """The whole model's count of `part` (heads, kv_heads, intermediate) from one rank's layout."""
    if part == "heads":
        return layout.num_heads * layout.degree
    if part == "kv_heads":
        return layout.num_kv_heads * layout.degree // layout.kv_replicas
    return layout.intermediate_size * layout.degree


def shard_of(name: str, layout: ShardLayout, full_qk_norm: bool = False) -> Shard | tuple[Shard, ...] | None:
    """The part of HF weight `name` (e.g. model.layers.3.self_attn.q_proj.weight) rank `layout.rank` holds;
    None when every rank holds the whole tensor (norms, row-parallel biases: added once, after the reduce);
    a tuple of row Shards for a fused tensor (Phi-3's qkv_proj, gate_up_proj: the rank's rows of each part,
    concatenated by `take`). full_qk_norm: q_norm / k_norm span the whole projection (OLMo-2), so a rank
    holds its heads' features of them; otherwise they are per head and whole.

    Raises: KeyError for a name outside the checkpoint layouts of the families we serve.
    """
    suffix = name.split(".", 3)[3] if name.startswith("model.layers.") else name
    if suffix in _FUSED:
        shards, offset = [], 0
        for part in _FUSED[suffix]:
            unit = layout.head_dim if part in ("heads", "kv_heads") else 1
            start, stop = getattr(layout, part)
            shards.append(Shard(0, offset + start * unit, offset + stop * unit))
            offset += _total(layout, part) * unit
        return tuple(shards)
    rules = {**_SHARDED, **_FULL_QK_NORM} if full_qk_norm else _SHARDED
    if suffix not in rules:
        raise KeyError(f"no tensor-parallel rule for weight {name!r}")
    rule = rules[suffix]
    if rule is None:
        return None
    dim, part = rule
    start, stop = getattr(layout, part)
    unit = layout.head_dim if part in ("heads", "kv_heads") else 1
    return Shard(dim, start * unit, stop * unit)


def take(source, shard: Shard | tuple[Shard, ...] | None) -> torch.Tensor:
    """The shard of a tensor, or of a safetensors slice (`safe_open(...).get_slice(name)`, so only the
    shard is read from disk). A tensor's shard is a contiguous copy (it never keeps the whole alive);
    a tuple of shards (a fused tensor's parts) is their concatenation along their dim; None returns the
    whole (a slice is read in full)."""
    if isinstance(shard, tuple):
        return torch.cat([take(source, part) for part in shard], dim=shard[0].dim)
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    if isinstance(source, torch.Tensor):
        return source.narrow(shard.dim, shard.start, shard.stop - shard.start).clone()
    index = (slice(shard.start, shard.stop),) if shard.dim == 0 else (slice(None), slice(shard.start, shard.stop))
    return source[index]
