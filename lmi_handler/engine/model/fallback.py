"""The transformers fallback: any AutoModelForCausalLM, with this engine's paged attention registered into it.

Owns the attention function registered in transformers' AttentionInterface (as vLLM's Transformers backend and
TGI's transformers fallback do): each attention layer writes the step's keys and values into our paged KV cache
by the slot mapping and attends over the block table, with the kernel backend's store_kv / paged_attention ops,
so the scheduler, prefix caching, chunked prefill and the sampler serve the model as they serve a native one.
Owns FallbackModel (DecoderModel's interface: forward -> final hidden states, compute_logits) and its load with
the start-up probe that refuses a model whose attention does not go through the interface, and the routing of
every linear of the model (nn.Linear, transformers' Conv1D, the lm_head) through the kernel backend's row-invariant
linear (RowInvariantLinear), so a sequence's bits do not depend on the rest of its step. Leaves the choice of
implementation to model_impl.py, the KV cache and batching to model_runner.py.
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.attention import AttentionMetadata

ATTENTION = "lmi_paged"        # our name in transformers' AttentionInterface
# keyword arguments a model's attention layer may pass that change nothing here (or that we read: the window and
# Gemma 2's cap); any other with a value (gpt-oss's sinks `s_aux`, ...) is refused at start-up
QUIET_KWARGS = frozenset({"sliding_window", "softcap", "position_ids", "is_causal", "cache_position",
                          "use_cache", "output_attentions", "dropout", "position_embeddings", "layer_idx"})

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
DEFAULT_CONTEXT = 2048

log = logging.getLogger(__name__)


@dataclass
class PagedStep:
    """What the registered attention reads in every layer of one forward (FallbackModel.forward sets it in
    CURRENT_STEP for the length of the call)."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per layer (K, V): (num_blocks, block_size, kv_heads, D)
    meta: AttentionMetadata
    ops: object                                           # the kernel backend's ops module (store_kv, paged_attention)
    # the probe's record instead of attending: (layer, (kv_heads, head_dim), unknown keyword arguments)
    calls: list[tuple[int, tuple[int, int], tuple[str, ...]]] | None = field(default=None)


# The bridge from FallbackModel.forward into transformers' code, which calls the attention function with its own
# arguments only (some models, StableLM's among them, do not hand their forward's keyword arguments down): set for
# the length of one forward, in this thread or task only. vLLM's Transformers backend reads its forward context so.
CURRENT_STEP: ContextVar[PagedStep | None] = ContextVar("lmi_paged_step", default=None)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract: query (1, H, T, D), key / value (1, KV, T, D), the step's tokens
    only (no transformers cache), RoPE applied -> ((1, T, H, D) output, None). The mask is ignored: causality and
    the sequences' boundaries come from the step's AttentionMetadata (CURRENT_STEP), whose slot mapping places each
    new key and value in the paged cache and whose block tables give each row its context; a window
    (`sliding_window`) and Gemma 2's `softcap` go to the backend's paged_attention. Raises RuntimeError when called
    outside FallbackModel.forward."""
    step = CURRENT_STEP.get()
    if step is None:
        raise RuntimeError(f"{type(module).__name__}: the paged attention was called outside a step")
    layer = module.layer_idx
    if step.calls is not None:                                               # the probe: record, do not attend
        odd = tuple(sorted(k for k, v in kwargs.items() if k not in QUIET_KWARGS and v is not None and v is not False))
        step.calls.append((layer, tuple(key.shape[1::2]), odd))
        return torch.zeros_like(query).transpose(1, 2), None
    k_cache, v_cache = step.kv_caches[layer]
    q = query[0].transpose(0, 1).to(k_cache.dtype).contiguous()             # (T, H, D)
    k = key[0].transpose(0, 1).to(k_cache.dtype).contiguous()               # (T, KV, D)
    v = value[0].transpose(0, 1).to(k_cache.dtype).contiguous()
    step.ops.store_kv(k_cache, v_cache, k, v, step.meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.ops.paged_attention(q, k_cache, v_cache, step.meta, scale, kwargs.get("sliding_window"),
                                   kwargs.get("softcap"))
    return out.to(query.dtype)[None], None                                   # (1, T, H, D)


class RowInvariantLinear(nn.Module):
    """A linear of transformers' model on the kernel backend's row-invariant linear: `ops.linear(x, weight, bias)`
    with `weight` as that backend takes it (the cpp backend's packed panels, made once here; the (out, in) tensor
    for torch's invariant_linear and Triton's matmul). x (..., in) -> (..., out) in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops):
        super().__init__()
        pack = vars(ops).get("pack_linear")
        weight = weight.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.linear = ops.linear
        self.weight = pack(weight, str(weight.dtype).removeprefix("torch."), None) if pack else weight.contiguous()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class RowWiseActivation(nn.Module):
    """A transformers activation module called one row at a time on CPU. torch's CPU elementwise kernels split a
    tensor into one chunk per thread at element offsets that need not fall on a vector boundary, and the few
    elements around an unaligned boundary take the scalar formula (SiLU, GELU-tanh: not bitwise the vector one),
    so a row's bits moved with the step's row count (measured: 5 threads, width 3072; 2 threads, width 1377).
    Called as a (1, width) tensor, a row's split depends on its width alone. x (..., width) -> the same shape."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= 1:
            return self.act(x)
        return torch.cat([self.act(row) for row in rows.split(1)]).view(x.shape)


def route_linears(hf: nn.Module, ops) -> int:
    """Replace every nn.Linear of `hf` (the lm_head too, tied or not) and every transformers Conv1D (GPT-2's:
    weight (in, out), used transposed) by a RowInvariantLinear on `ops`; torch's own F.linear picks its kernel
    by the row count (GEMV for one row), so a row's bits moved with its batch. The other ops of the fallback
    families (embeddings, LayerNorm, RMSNorm, GELU, SiLU, rotary: an outer product of one multiply per value)
    compute a row from that row alone in torch (the activations on CPU once route_activations wraps them).
    Returns how many modules were replaced."""
    from transformers.pytorch_utils import Conv1D

    found = [(name, module) for name, module in hf.named_modules() if isinstance(module, (nn.Linear, Conv1D))]
    for name, module in found:
        weight = module.weight.t() if isinstance(module, Conv1D) else module.weight
        parent, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(parent), attr, RowInvariantLinear(weight, module.bias, ops))
    return len(found)


def route_activations(hf: nn.Module) -> int:
    """On CPU, wrap every transformers activation module of `hf` (transformers.activations' classes: ACT2FN's) in
    RowWiseActivation. Returns how many were wrapped."""
    from transformers.activations import ACT2CLS

    kinds = tuple({cls[0] if isinstance(cls, tuple) else cls for cls in ACT2CLS.values()})
    found = [(name, module) for name, module in hf.named_modules() if isinstance(module, kinds)]
    for name, module in found:
        parent, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(parent), attr, RowWiseActivation(module))
    return len(found)


def register_attention() -> None:
    """Put paged_attention_forward into transformers' AttentionInterface under ATTENTION (idempotent). A name the
    mask interface does not know gets no mask built (masking_utils returns None for it), as vLLM relies on."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)


@dataclass(frozen=True)
class FallbackShape:
    """What the KV cache and the engine need from the model's config (transformers' config object)."""

    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def fallback_shape(model_dir: str | Path, trust_remote_code: bool = False) -> FallbackShape:
    """The KV-cache shape of a fallback model from transformers' config (its attribute maps: GPT-2's n_layer,
    n_positions, ...). The context length is the first of CONTEXT_KEYS the config has, else DEFAULT_CONTEXT
    (vLLM's rule; BLOOM gives none), logged."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code).get_text_config()
    heads, values = c.num_attention_heads, c.to_dict()
    max_len = next((getattr(c, key) for key in CONTEXT_KEYS if getattr(c, key, None)), None)   # (attribute maps)
    if max_len is None:
        log.warning("config.json of model_type=%s names no context length (%s): %d tokens assumed (vLLM's default; "
                    "option.max_model_len sets less)", c.model_type, ", ".join(CONTEXT_KEYS), DEFAULT_CONTEXT)
    return FallbackShape(vocab_size=c.vocab_size, max_position_embeddings=max_len or DEFAULT_CONTEXT, num_layers=c.num_hidden_layers,
                         num_kv_heads=values.get("num_key_value_heads") or heads,
                         head_dim=values.get("head_dim") or c.hidden_size // heads)


class FallbackModel(nn.Module):
    """transformers' causal LM under DecoderModel's interface: forward(input_ids, positions, kv_caches, meta,
    lora) -> (T, hidden) final hidden states of the flat token batch (the sequences side by side as one row of
    transformers' batch, each token at its own position id; our attention keeps them apart), compute_logits(hidden)
    -> (N, vocab) float32 with the head's scales (Cohere's logit_scale, Granite's logits_scaling, a final soft-cap).
    `kernel_backend` is "transformers" (no CUDA graphs, no fused stack); `attention_backend` names the ops whose
    store_kv / paged_attention run inside it; `num_kv_heads` and `head_dim` are the KV cache's, as load_fallback's
    probe saw the layers' keys."""

    def __init__(self, hf: nn.Module, ops, attention_backend: str):
        super().__init__()
        self.hf, self.ops = hf, ops
        self.base = hf.base_model
        self.head = hf.get_output_embeddings()
        self.kernel_backend, self.attention_backend = "transformers", attention_backend
        self.group = None
        self.num_kv_heads = self.head_dim = 0        # load_fallback sets them from its probe
        values = hf.config.get_text_config().to_dict()
        self.logit_scale = values.get("logit_scale")            # Cohere: logits * logit_scale
        self.logits_scaling = values.get("logits_scaling")      # Granite: logits / logits_scaling
        self.final_softcap = values.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, lora=None,
                calls: list | None = None, image_rows=None) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> (T, hidden); writes the step's K/V into kv_caches. `lora` and
        `image_rows` must be None (adapters are refused at start-up; images are the vision families', which the
        layer description serves). `calls`: the probe's record of the attention calls."""
        token = CURRENT_STEP.set(PagedStep(kv_caches, meta, self.ops, calls))
        try:
            out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            CURRENT_STEP.reset(token)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.logit_scale is not None:
            logits = logits * float(self.logit_scale)
        if self.logits_scaling is not None:
            logits = logits / float(self.logits_scaling)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(backend, why) whose store_kv / paged_attention the fallback's attention calls, for option.kernel_backend:
    auto is triton on CUDA (when it imports, else torch), cpp on CPU where the C++ kernels are built (float32 and
    bfloat16), torch otherwise. Raises ConfigError for an explicit backend that cannot run here."""
    from lmi_handler.engine.model.backend import KERNEL_BACKENDS, triton_ops
    from lmi_handler.engine.model.kernels import cpu_kernels

    requested = (requested or "auto").strip().lower()
    if requested not in KERNEL_BACKENDS:
        raise ConfigError(f"option.kernel_backend={requested!r}: must be one of {list(KERNEL_BACKENDS)}")
    cpp_why = ("" if device.type == "cpu" and cpu_kernels() is not None and dtype in (torch.float32, torch.bfloat16)
               else f"the C++ attention runs float32 / bfloat16 on a CPU with the kernels built ({device}, {dtype})")
    triton_why = triton_ops()[1] or ("" if device.type == "cuda" else f"device {device} is not CUDA")
    if requested in ("cpp", "triton") and (why := cpp_why if requested == "cpp" else triton_why):
        raise ConfigError(f"option.kernel_backend={requested} cannot run the transformers fallback here: {why}")
    if requested != "auto":
        return requested, "asked for"
    if device.type == "cuda":
        return ("triton", "auto: CUDA") if not triton_why else ("torch", f"auto: CUDA, but {triton_why}")
    return ("cpp", "auto: CPU, the C++ kernels are built") if not cpp_why else ("torch", f"auto: {cpp_why}")


def load_fallback(model_dir: str | Path, dtype: torch.dtype, device: torch.device, kernel_backend: str = "auto",
                  trust_remote_code: bool = False, why: str = "") -> FallbackModel:
    """The checkpoint as transformers' AutoModelForCausalLM in `dtype` on `device`, eval mode, its attention
    ours (ATTENTION), probed once (probe), logged as the fallback with `why`. Raises ConfigError where the model
    cannot take the paged attention."""
    from lmi_handler.engine.model.backend import backend_ops
    from transformers import AutoModelForCausalLM

    register_attention()
    name, backend_why = attention_backend(kernel_backend, device, dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=ATTENTION,
                                              trust_remote_code=trust_remote_code)
    ops = backend_ops(name)
    linears = route_linears(hf.to(device).eval(), ops)
    if device.type == "cpu":
        route_activations(hf)
    model = FallbackModel(hf, ops, name)
    model.num_kv_heads, model.head_dim = probe(model, fallback_shape(model_dir, trust_remote_code).num_layers)
    log.info("model_impl=transformers for model_type=%s (%s): %s through transformers' AutoModelForCausalLM, its "
             "attention this engine's paged attention and its %d linears the row-invariant linear on kernel_backend=%s (%s)",
             hf.config.model_type, why, type(hf).__name__, linears, name, backend_why)
    return model


@torch.inference_mode()
def probe(model: FallbackModel, num_layers: int) -> tuple[int, int]:
    """Run two tokens through the model with the attention recording instead of attending: every one of
    `num_layers` layers must call it exactly once, with one KV shape and no argument it would ignore. Returns
    (num_kv_heads, head_dim) as the layers' keys have them (the KV cache's shape: GPT-NeoX ignores a
    num_key_value_heads its config may carry). Raises ConfigError naming the model type and why otherwise (its
    attention does not go through transformers' AttentionInterface, as BLOOM's alibi attention, or passes what the
    paged attention cannot honour)."""
    hf, device = model.hf, next(model.hf.parameters()).device
    calls: list = []
    head = (f"config.json model_type={hf.config.model_type!r} ({type(hf).__name__}) cannot run through the "
            "transformers fallback: ")
    try:
        model(torch.tensor([0, 0], device=device), torch.arange(2, device=device), [], None, calls=calls)
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ConfigError(head + f"its forward with this engine's paged attention failed ({exc})") from exc
    layers = sorted(layer for layer, _, _ in calls)
    if layers != list(range(num_layers)):
        raise ConfigError(head + "its attention does not go through transformers' attention interface "
                          f"(AttentionInterface called for layers {layers} of {num_layers}), so its KV cache cannot "
                          "be paged; served: the native families, and decoders whose attention uses the interface")
    if odd := sorted({name for _, _, names in calls for name in names}):
        raise ConfigError(head + f"its attention passes {odd}, which the paged attention does not implement")
    if len(shapes := {shape for _, shape, _ in calls}) != 1:
        raise ConfigError(head + f"its layers' keys differ in shape ({sorted(shapes)}): one paged KV cache holds one")
    return shapes.pop()
