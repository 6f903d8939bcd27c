"""Encoder models for the pooling tasks: BERT, RoBERTa and XLM-RoBERTa (bidirectional attention over one
sequence, absolute positions, LayerNorm with bias, GELU), their sequence-classification heads included.

Owns EncoderSpec (read from config.json), loading an encoder checkpoint onto a kernel backend and
EncoderModel's forward over a flat batch of whole sequences. Leaves the linears to the backend (torch_ref's
tiled invariant linear, or the cpp backend's packed panels in float32, bfloat16 or int8), pooling and the
scores' activation to engine/pooling.py. Every op computes a row (attention: a sequence) from that row
alone, so a text's vector never depends on the rest of its batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.loader import read_config, read_safetensors

# model_type -> the first position id of a sequence (RoBERTa counts from padding_idx + 1)
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class EncoderSpec:
    """What an encoder's forward needs from config.json. position_offset: the first token's position id (0
    for BERT, padding_idx + 1 for RoBERTa); head: the classification head the architectures name ("bert":
    pooler dense + tanh, then classifier; "roberta": classifier.dense + tanh + out_proj on the first token;
    None: a bare encoder)."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_layers: int
    layer_norm_eps: float
    activation: str
    max_positions: int
    position_offset: int
    type_vocab_size: int
    head: str | None = None
    id2label: dict[int, str] = field(default_factory=dict)
    problem_type: str | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_positions - self.position_offset


def is_encoder(cfg: dict) -> bool:
    return cfg.get("model_type") in ENCODER_TYPES


def encoder_spec(cfg: dict) -> EncoderSpec:
    """EncoderSpec of config.json's dict. Raises ConfigError for what the encoder does not run (relative
    position embeddings, an unknown activation)."""
    model_type = cfg["model_type"]
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"model_type={model_type}: position_embedding_type="
                          f"{cfg['position_embedding_type']!r} is not served (absolute positions only)")
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"model_type={model_type}: hidden_act={act!r} is not served ({sorted(ACTIVATIONS)})")
    classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
    head = ("bert" if model_type == "bert" else "roberta") if classifier else None
    offset = cfg.get("pad_token_id", 1) + 1 if model_type != "bert" else 0
    labels = {int(k): v for k, v in (cfg.get("id2label") or {}).items()}
    return EncoderSpec(model_type, cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
                       cfg.get("layer_norm_eps", 1e-12), act, cfg.get("max_position_embeddings", 512), offset,
                       cfg.get("type_vocab_size", 2), head, labels, cfg.get("problem_type"))


class EncoderModel:
    """The encoder stack on backend `ops` (backends/torch_ref or backends/cpp): `w` holds the checkpoint's
    tensors by their names without the model prefix (linears as the backend's form, the rest in `dtype`)."""

    def __init__(self, spec: EncoderSpec, ops, w: dict, dtype: torch.dtype, backend_name: str):
        self.spec, self.ops, self.w, self.dtype, self.kernel_backend = spec, ops, w, dtype, backend_name
        self.act = ACTIVATIONS[spec.activation]

    @property
    def num_labels(self) -> int:
        return len(self.spec.id2label) if self.spec.head else 0

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """input_ids, token_type_ids: (T,) int64, the sequences one after the other (seq_lens, host ints)
        -> (T, hidden) last hidden states in the model's dtype."""
        spec, w = self.spec, self.w
        positions = torch.cat([torch.arange(n) for n in seq_lens]) + spec.position_offset
        x = (F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
             + F.embedding(token_type_ids, w["embeddings.token_type_embeddings.weight"])
             + F.embedding(positions.to(input_ids.device), w["embeddings.position_embeddings.weight"]))
        x = self._layer_norm(x, "embeddings.LayerNorm")
        for i in range(spec.num_layers):
            p = f"encoder.layer.{i}."
            a = self._attention(self._linear(x, p + "attention.self.qkv"), seq_lens)
            x = self._layer_norm(self._linear(a, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = self.act(self._linear(x, p + "intermediate.dense"))
            x = self._layer_norm(self._linear(h, p + "output.dense") + x, p + "output.LayerNorm")
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The classification head on each sequence's first-token hidden state: (S, hidden) -> (S, labels)
        float32 logits."""
        if self.spec.head == "bert":
            pooled = torch.tanh(self._linear(first, "pooler.dense"))
            return self._linear(pooled, "classifier").float()
        dense = torch.tanh(self._linear(first, "classifier.dense"))
        return self._linear(dense, "classifier.out_proj").float()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.ops.linear(x.contiguous(), self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """LayerNorm with bias over each row, in float32, rounded once to the model's dtype."""
        w, b = self.w[name + ".weight"], self.w[name + ".bias"]
        return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), self.spec.layer_norm_eps).to(x.dtype)

    def _attention(self, qkv: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Bidirectional attention within each sequence, in float32, one sequence at a time (its rows see
        exactly its own keys): (T, 3 * hidden) -> (T, hidden) in qkv's dtype."""
        heads, dim = self.spec.num_heads, self.spec.head_dim
        out, start = [], 0
        for n in seq_lens:
            q, k, v = qkv[start:start + n].float().view(1, n, 3, heads, dim).permute(2, 0, 3, 1, 4)  # (1, H, n, D)
            # 4-D, so that torch takes its CPU flash kernel (a fixed order over key blocks for each query row):
            # 3-D inputs fall back to the math path, measured 4.4x slower (12 heads x 200 tokens, 2 threads)
            o = F.scaled_dot_product_attention(q, k, v)[0]         # the same call for a sequence in any batch
            out.append(o.transpose(0, 1).reshape(n, heads * dim).to(qkv.dtype))
            start += n
        return torch.cat(out)


def load_encoder(model_dir: str | Path, dtype: torch.dtype, device: torch.device, backend: str = "auto",
                 quantize: str | None = None) -> EncoderModel:
    """EncoderModel of an HF directory (a bare encoder as sentence-transformers saves it, or a
    *ForSequenceClassification with its `bert.` / `roberta.` prefix). backend: "torch", "cpp" or "auto" (the C++
    kernels on CPU where they build); quantize "int8" packs the linears as int8 panels (cpp only).
    Raises ConfigError for an encoder or a backend not served here, KeyError naming a missing tensor."""
    spec = encoder_spec(read_config(model_dir))
    name = _backend(backend, device, quantize)
    ops = _ops(name)
    hf = read_safetensors(model_dir)
    prefix = next((k.removesuffix("embeddings.word_embeddings.weight") for k in hf
                   if k.endswith("embeddings.word_embeddings.weight")), None)
    if prefix is None:
        raise KeyError("weights missing from the checkpoint: embeddings.word_embeddings.weight")
    w = {(k[len(prefix):] if k.startswith(prefix) else k): t for k, t in hf.items()}
    for i in range(spec.num_layers):        # q, k, v fused by rows: one linear
        p = f"encoder.layer.{i}.attention.self."
        for part in ("weight", "bias"):
            w[p + "qkv." + part] = torch.cat([w.pop(p + role + "." + part) for role in ("query", "key", "value")])
    kind = quantize or str(dtype).removeprefix("torch.")
    pack = vars(ops).get("pack_linear")
    out = {}
    for key, t in w.items():
        is_linear = key.endswith(".weight") and t.dim() == 2 and "embeddings" not in key
        if is_linear and pack is not None:
            out[key] = pack(t.contiguous(), kind)
        else:
            out[key] = t.to(device=device, dtype=dtype, copy=True)
    return EncoderModel(spec, ops, out, dtype, name)


def _backend(requested: str, device: torch.device, quantize: str | None) -> str:
    from lmi_handler.engine.model.kernels import cpu_kernels

    requested = (requested or "auto").lower()
    cpp_ok = device.type == "cpu" and cpu_kernels() is not None
    if quantize is not None or requested == "cpp":
        if not cpp_ok:
            raise ConfigError(f"option.kernel_backend={requested} (quantize={quantize}): the encoder's C++ linears "
                              f"need a CPU with the kernels built")
        return "cpp"
    if requested in ("torch", "triton"):      # the Triton backend's linear for encoders is torch's here
        return "torch"
    return "cpp" if cpp_ok else "torch"


def _ops(name: str):
    from lmi_handler.engine.model.backends import cpp, torch_ref

    return cpp if name == "cpp" else torch_ref
