"""Which quantized checkpoint a model directory holds: config.json's `quantization_config` (and LMI's
option.quantize naming the method) read into one QuantConfig, or refused at start-up naming the method and the
supported list.

Owns the detection and its refusals; leaves reading each format's tensors to formats.py (integer codes),
fp8.py (e4m3 weights) and mxfp4.py (gpt-oss's e2m1 experts).
No torch here: families.py calls check_quantization_config while it reads config.json.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lmi_handler.config import ConfigError

SUPPORTED = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")   # quant_method values we read
CHECKPOINT_OPTIONS = SUPPORTED                              # option.quantize values that name the checkpoint's method
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")    # compressed-tensors formats we read
_UNSUPPORTED_HINT = ("serve the unquantized checkpoint (option.quantize=int8 or int4 quantizes its weights at load "
                     "on CPU)")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization. group_size -1: one group per output channel (the whole k).
    zero_offset: added to the stored zero points (GPTQ's v1 format stores zero - 1). ignore: module names (or
    compressed-tensors' "re:" patterns) left in float. fmt: compressed-tensors' format (CT_FORMATS), "" for the
    other methods. fp8: e4m3 weights (quant_method fp8, compressed-tensors float-quantized). block: fp8's
    (rows, columns) of one scale's block (weight_block_size), None for per-tensor or per-channel scales.
    activations: what the checkpoint meant for the activations (e.g. "int8 dynamic per token"), which the engine
    does not do (weight-only: activations stay in the engine's dtype), "" where it meant none."""

    method: str
    bits: int
    group_size: int
    sym: bool = True
    desc_act: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = ()
    fmt: str = ""
    fp8: bool = False
    block: tuple[int, int] | None = None
    activations: str = ""

    @property
    def reader(self) -> str:
        """formats.READERS' key of this config's tensors."""
        return f"{self.method}/{self.fmt}" if self.fmt and self.fmt != "pack-quantized" else self.method

    @property
    def markers(self) -> tuple[str, ...]:
        """Tensor suffixes of which one marks a linear as quantized (besides its <module>.weight, if any)."""
        if self.method == "fp8":
            return "weight_scale_inv", "weight_scale"
        if self.method == "compressed-tensors":
            return ("weight_packed",) if self.fmt == "pack-quantized" else ("weight_scale",)
        return ("qweight",)

    def ignores(self, module: str) -> bool:
        """Whether module `module` (e.g. model.layers.0.mlp.gate) is left in float by the config: named, a name's
        suffix (AWQ's modules_to_not_convert) or matching a "re:" pattern (compressed-tensors' ignore)."""
        for entry in self.ignore:
            if entry.startswith("re:") and re.fullmatch(entry[3:], module):
                return True
            if module == entry or module.endswith("." + entry) or f".{entry}." in f".{module}.":
                return True
        return False

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 experts (e2m1 values, an e8m0 scale per 32 inputs)"
        method = f"{self.method} {self.fmt}" if self.fmt and self.fmt != "pack-quantized" else self.method
        if self.fp8:
            scales = f"{self.block[0]}x{self.block[1]} block" if self.block else "per-tensor or per-channel"
            text = f"{method} e4m3 weights, {scales} scales"
        else:
            group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
            extra = ", act order" if self.desc_act else ""
            text = f"{method} {self.bits}-bit {group}, {'symmetric' if self.sym else 'zero points'}{extra}"
        if self.activations:
            text += f" (its {self.activations} activations not done: weight-only, activations in the engine's dtype)"
        return text


def _refuse(method: str, why: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config (quant_method={method!r}): {why}; supported quantized "
                       f"checkpoints: {list(SUPPORTED)} (4 and 8 bits as each format allows); {_UNSUPPORTED_HINT}")


def read_quant_config(cfg: dict) -> QuantConfig | None:
    """config.json's quantization_config as a QuantConfig, None where there is none. Raises ConfigError naming the
    method (and what of it) for everything we do not read: other methods (bitsandbytes, hqq, exl2, gguf,
    ...), bit widths, layouts and schemes."""
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise _refuse(str(quant), "not a quantization_config we know")
    method = str(quant.get("quant_method", "unknown")).lower()
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors":
        return _compressed(quant)
    if method == "fp8":
        return _fp8(quant)
    if method == "mxfp4":       # gpt-oss: its experts only (quant/mxfp4.py); every other module stays in float
        return QuantConfig("mxfp4", 4, 32, ignore=(r"re:(?!.*\.experts\b).*",))
    raise _refuse(method, "this method is not supported")


def check_quantization_config(cfg: dict) -> None:
    """Raises ConfigError where config.json's quantization_config is not one we serve (read_quant_config)."""
    read_quant_config(cfg)


def _bits(method: str, bits, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise _refuse(method, f"bits={bits!r} is not supported (supported: {list(allowed)})")
    return int(bits)


def _gptq(q: dict) -> QuantConfig:
    fmt = str(q.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format={fmt!r} is not supported (supported: ['gptq', 'gptq_v2'])")
    return QuantConfig("gptq", _bits("gptq", q.get("bits"), (4, 8)), int(q.get("group_size", -1)),
                       sym=bool(q.get("sym", True)), desc_act=bool(q.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0, ignore=tuple(q.get("modules_to_not_convert") or ()))


def _awq(q: dict) -> QuantConfig:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version={version!r} is not supported (supported: ['gemm'])")
    if not q.get("zero_point", True):
        raise _refuse("awq", "zero_point=false is not supported")
    bits = q.get("bits", q.get("w_bit"))
    return QuantConfig("awq", _bits("awq", bits, (4,)), int(q.get("group_size", q.get("q_group_size", 128))),
                       sym=False, ignore=tuple(q.get("modules_to_not_convert") or ()))


def _fp8(q: dict) -> QuantConfig:
    """quant_method fp8 (transformers' FineGrainedFP8Config, vLLM's Fp8Config: Qwen3-FP8, DeepSeek-V3): e4m3
    weights with weight_scale_inv per weight_block_size block, or one per tensor without it."""
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) <= 0):
        raise _refuse("fp8", f"weight_block_size={block!r} is not two positive sizes")
    fmt = str(q.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise _refuse("fp8", f"fmt={fmt!r} is not supported (supported: ['e4m3'])")
    scale_fmt = str(q.get("scale_fmt") or "float").lower()
    if scale_fmt != "float":
        raise _refuse("fp8", f"scale_fmt={scale_fmt!r} is not supported (supported: ['float'])")
    ignore = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    scheme = str(q.get("activation_scheme") or "dynamic").lower()
    return QuantConfig("fp8", 8, int(block[1]) if block else -1, ignore=tuple(ignore), fp8=True,
                       block=(int(block[0]), int(block[1])) if block else None,
                       activations=f"fp8 {scheme}")


def _ct_activations(group: dict) -> str:
    acts = group.get("input_activations")
    if not acts:
        return ""
    how = "dynamic" if acts.get("dynamic") else "static"
    return f"{acts.get('type', 'int')}{acts.get('num_bits', '')} {how} per {acts.get('strategy', 'tensor')}"


def _ct_scheme(group: dict, fmt: str) -> tuple:
    """One config_groups entry as (fmt, fp8, bits, group_size, block, sym, activations), or ConfigError."""
    method = "compressed-tensors"
    weights = group.get("weights") or {}
    if fmt not in CT_FORMATS:
        raise _refuse(method, f"format={fmt!r} is not supported (supported: {list(CT_FORMATS)})")
    kind = str(weights.get("type", "int")).lower()
    if weights.get("dynamic") or kind != ("float" if fmt == "float-quantized" else "int"):
        raise _refuse(method, f"format={fmt!r} with {'dynamic ' if weights.get('dynamic') else ''}{kind} weights "
                              "is not supported (int weights: pack-quantized, int-quantized; e4m3: float-quantized)")
    activations = _ct_activations(group)
    if activations and fmt == "pack-quantized":
        raise _refuse(method, f"pack-quantized with {activations} activations is not supported (W4A16 / W8A16)")
    sym = bool(weights.get("symmetric", True))
    if not sym and fmt == "float-quantized":
        raise _refuse(method, "asymmetric float weights are not supported (supported: symmetric)")
    strategy = str(weights.get("strategy", "group")).lower()
    allowed = ("tensor", "channel", "block") if fmt == "float-quantized" else ("group", "channel", "tensor")
    if strategy not in allowed:
        raise _refuse(method, f"{fmt} strategy={strategy!r} is not supported (supported: {list(allowed)})")
    if weights.get("actorder") not in (None, False, "weight", "group", "static", "dynamic"):
        raise _refuse(method, f"actorder={weights.get('actorder')!r} is not supported")
    bits = _bits(method, weights.get("num_bits"), (8,) if fmt != "pack-quantized" else (4, 8))
    block = None
    if strategy == "block":
        shape = weights.get("block_structure") or []
        if len(shape) != 2:
            raise _refuse(method, f"block_structure={shape!r} is not two sizes")
        block = (int(shape[0]), int(shape[1]))
    size = int(weights.get("group_size") or -1) if strategy == "group" else block[1] if block else -1
    return fmt, fmt == "float-quantized", bits, size, block, sym, activations


def _compressed(q: dict) -> QuantConfig:
    method = "compressed-tensors"
    groups = q.get("config_groups") or {}
    fmt = str(q.get("format", "")).lower()
    schemes = {_ct_scheme(group, str(group.get("format") or fmt).lower()) for group in groups.values()}
    if len(schemes) != 1:
        raise _refuse(method, f"{len(schemes)} weight schemes in config_groups (supported: one)")
    (fmt, fp8, bits, size, block, sym, activations), = schemes
    return QuantConfig(method, bits, size, sym=sym, ignore=tuple(q.get("ignore") or ()), fmt=fmt, fp8=fp8,
                       block=block, activations=activations)


def check_option(option: str | None, found: QuantConfig | None) -> None:
    """option.quantize naming a checkpoint method (LMI: awq, gptq, fp8, ...) must match config.json's (fp8 also
    names a compressed-tensors float-quantized checkpoint, and on a float checkpoint rounds it at load, as vLLM's
    quantization=fp8 does). Raises ConfigError naming both where it does not."""
    if option == "fp8" and found is None:
        return
    if option in CHECKPOINT_OPTIONS and not matches(option, found):
        have = "no quantization_config" if found is None else f"quant_method={found.method!r}"
        raise ConfigError(f"option.quantize={option!r} names a pre-quantized checkpoint, but config.json has {have}")


def matches(option: str, found: QuantConfig | None) -> bool:
    """Whether option.quantize `option` names checkpoint config `found`'s method."""
    return found is not None and (found.method == option or (option == "fp8" and found.fp8))
