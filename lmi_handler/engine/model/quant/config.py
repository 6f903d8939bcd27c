"""Which quantized checkpoint a model directory holds: config.json's `quantization_config` (and LMI's
option.quantize naming the method) read into one QuantConfig, or refused at start-up naming the method and the
supported list.

Owns the detection and its refusals; leaves reading each format's tensors to gptq.py, awq.py and compressed.py.
No torch here: families.py calls check_quantization_config while it reads config.json.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lmi_handler.config import ConfigError

SUPPORTED = ("gptq", "awq", "compressed-tensors")          # quant_method values we read
CHECKPOINT_OPTIONS = SUPPORTED                              # option.quantize values that name the checkpoint's method
_UNSUPPORTED_HINT = ("serve the unquantized checkpoint (option.quantize=int8 or int4 quantizes its weights at load "
                     "on CPU)")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization. group_size -1: one group per output channel (the whole k).
    zero_offset: added to the stored zero points (GPTQ's v1 format stores zero - 1). packed: the tensor suffix
    that marks a quantized linear (qweight, or compressed-tensors' weight_packed). ignore: module names (or
    compressed-tensors' "re:" patterns) left in float."""

    method: str
    bits: int
    group_size: int
    sym: bool = True
    desc_act: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = ()

    @property
    def packed(self) -> str:
        return "weight_packed" if self.method == "compressed-tensors" else "qweight"

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
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = ", act order" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit {group}, {'symmetric' if self.sym else 'zero points'}{extra}"


def _refuse(method: str, why: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config (quant_method={method!r}): {why}; supported quantized "
                       f"checkpoints: {list(SUPPORTED)} (4 and 8 bits as each format allows); {_UNSUPPORTED_HINT}")


def read_quant_config(cfg: dict) -> QuantConfig | None:
    """config.json's quantization_config as a QuantConfig, None where there is none. Raises ConfigError naming the
    method (and what of it) for everything we do not read: other methods (bitsandbytes, hqq, exl2, gguf, fp8,
    mxfp4, ...), bit widths, layouts and schemes."""
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


def _compressed(q: dict) -> QuantConfig:
    method = "compressed-tensors"
    groups = q.get("config_groups") or {}
    fmt = str(q.get("format", "")).lower()
    schemes = []
    for group in groups.values():
        weights = group.get("weights") or {}
        group_fmt = str(group.get("format") or fmt).lower()
        if group_fmt != "pack-quantized":
            raise _refuse(method, f"format={group_fmt!r} is not supported (supported: ['pack-quantized'], "
                                  f"W4A16 / W8A16)")
        if group.get("input_activations") or weights.get("type", "int") != "int" or weights.get("dynamic"):
            raise _refuse(method, "only integer weights with float activations (W4A16 / W8A16) are supported")
        if not weights.get("symmetric", True):
            raise _refuse(method, "asymmetric weights are not supported (supported: symmetric)")
        strategy = str(weights.get("strategy", "group")).lower()
        if strategy not in ("group", "channel"):
            raise _refuse(method, f"strategy={strategy!r} is not supported (supported: ['group', 'channel'])")
        size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        schemes.append((_bits(method, weights.get("num_bits"), (4, 8)), size))
    if len(set(schemes)) != 1:
        raise _refuse(method, f"{len(set(schemes))} weight schemes in config_groups (supported: one)")
    (bits, size), = set(schemes)
    return QuantConfig(method, bits, size, sym=True, ignore=tuple(q.get("ignore") or ()))


def check_option(option: str | None, found: QuantConfig | None) -> None:
    """option.quantize naming a checkpoint method (LMI: awq, gptq, ...) must match config.json's. Raises
    ConfigError naming both where it does not."""
    if option in CHECKPOINT_OPTIONS and (found is None or found.method != option):
        have = "no quantization_config" if found is None else f"quant_method={found.method!r}"
        raise ConfigError(f"option.quantize={option!r} names a pre-quantized checkpoint, but config.json has {have}")
