"""Quantized linears at load: a pre-quantized checkpoint's (GPTQ, AWQ, compressed-tensors, FP8, gpt-oss's MXFP4
experts: config.py detects, formats.py, fp8.py and mxfp4.py read) or a float checkpoint's rounded at load
(option.quantize=int4, or fp8 without a quantization_config: rtn.py), each linear unpacked
once into the C++ kernel's code panels (weight.py, kernels/linear_quant.h), never the whole model dequantized.

The loader's one hook (loader.load_model): `quantized_linears(cfg, quantize, ...)` gives a QuantizedLinears (or
None for a float model) whose `covers(hf, names)` says which of the spec's linears it takes and `take(hf, names)`
reads one (q/k/v and gate/up fused by rows). The backends compute with weight.QuantWeight: cpp through the
kernel, torch through its dequantized float weight (the reference).
"""
from __future__ import annotations

import logging

import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.quant.config import (  # noqa: F401
    CHECKPOINT_OPTIONS,
    SUPPORTED,
    QuantConfig,
    check_option,
    check_quantization_config,
    matches,
    read_quant_config,
)
from lmi_handler.engine.model.quant.formats import READERS as INT_READERS
from lmi_handler.engine.model.quant.fp8 import READERS as FP8_READERS
from lmi_handler.engine.model.quant.mxfp4 import read_mxfp4
from lmi_handler.engine.model.quant.rtn import INT4_GROUP, quantize_fp8, quantize_int4  # noqa: F401
from lmi_handler.engine.model.quant.weight import Codes, QuantWeight, concat, pack_codes, quant_linear  # noqa: F401

log = logging.getLogger(__name__)

READERS = {**INT_READERS, **FP8_READERS, "mxfp4": read_mxfp4}   # QuantConfig.reader -> its reader of one linear's

QUANTIZED_BACKENDS = ("cpp", "torch")


class QuantizedLinears:
    """Which linears of a checkpoint are quantized and how to read them (see the module)."""

    def __init__(self, config: QuantConfig | None, rounding: str = "int4"):
        self.config = config          # None: the float layer linears rounded at load to `rounding` (int4 or fp8)
        self.rounding = rounding

    @property
    def experts_only(self) -> bool:
        """Only a mixture-of-experts model's experts are quantized (MXFP4: gpt-oss's experts)."""
        return self.config is not None and self.config.method == "mxfp4"

    def describe(self) -> str:
        if self.config is None and self.rounding == "fp8":
            return "option.quantize=fp8 (e4m3 weights, a scale per output channel, rounded at load; weight-only)"
        if self.config is None:
            return f"option.quantize=int4 (4-bit codes, a scale and zero point per {INT4_GROUP} inputs)"
        return self.config.describe()

    def covers(self, hf: dict[str, torch.Tensor], names: str | list[str]) -> bool:
        """Whether the linear of checkpoint tensor(s) `names` (each "<module>.weight") is quantized. Raises
        ValueError where a fused linear's parts disagree."""
        if isinstance(names, tuple):        # one expert of a stacked tensor (gpt-oss): MXFP4 blocks, or float
            return self.config is not None and f"{names[0]}_blocks" in hf
        parts = [names] if isinstance(names, str) else names
        found = [self._quantized(hf, n) for n in parts]
        if any(found) and not all(found):
            raise ValueError(f"fused weights {parts}: some quantized, some not")
        return found[0]

    def _quantized(self, hf: dict[str, torch.Tensor], name: str) -> bool:
        prefix = name.removesuffix(".weight")
        if self.config is None:
            return name in hf and ".layers." in name
        if any(f"{prefix}.{marker}" in hf for marker in self.config.markers):
            return True
        if name in hf and ".layers." in name and not self.config.ignores(prefix):
            raise ConfigError(f"config.json quantization_config ({self.config.describe()}): layer weight {name!r} "
                              f"is stored in float and not in the config's ignore list (a checkpoint the quantizer "
                              f"did not finish?)")
        return False

    def take(self, hf: dict[str, torch.Tensor], names: str | list[str]) -> QuantWeight:
        """The linear of `names` as a QuantWeight (their codes concatenated by rows), its tensors dropped from hf."""
        if isinstance(names, tuple):
            return pack_codes(READERS[self.config.reader](hf, names, self.config))
        parts = [names] if isinstance(names, str) else names
        if self.config is None:
            rounding = quantize_fp8 if self.rounding == "fp8" else quantize_int4
            codes = [rounding(hf.pop(n)) for n in parts]
        else:
            read = READERS[self.config.reader]
            codes = [read(hf, n.removesuffix(".weight"), self.config) for n in parts]
        return pack_codes(concat(codes))


def quantized_linears(cfg: dict, quantize: str | None, tensor_parallel: bool = False,
                      ) -> tuple[QuantizedLinears | None, str | None]:
    """(the model's QuantizedLinears or None, the option.quantize left for the loader's own packing: "int8" or
    None; with int4 "int8": lm_head, the one linear int4 leaves, becomes int8 panels as option.quantize=int8 makes
    it, and so runs on the cpp backend only). option.quantize=fp8 over a float checkpoint rounds its layer
    linears to e4m3 at load (rtn.quantize_fp8; lm_head stays in the activations' dtype, as FP8 checkpoints
    keep it). Raises ConfigError for a quantization_config we do not read (config.read_quant_config), an
    option.quantize naming another method than the checkpoint's, int4 over a quantized checkpoint, and tensor
    parallelism of quantized linears (not yet)."""
    found = read_quant_config(cfg)
    check_option(quantize, found)
    if found is not None and quantize is not None and not matches(quantize, found):
        raise ConfigError(f"option.quantize={quantize!r} on a checkpoint already quantized ({found.describe()}): "
                          "unset option.quantize")
    rounding = quantize if found is None and quantize in ("int4", "fp8") else None
    if found is None and rounding is None:
        return None, quantize
    left = "int8" if quantize == "int4" else None    # int4: lm_head as int8 panels (the loader's own packing)
    if tensor_parallel:
        what = found.describe() if found else f"option.quantize={rounding}"
        raise ConfigError(f"{what}: tensor parallelism of quantized weights is not supported yet "
                          "(set option.tensor_parallel_degree=1)")
    return QuantizedLinears(found, rounding or "int4"), left


def check_backend(linears: QuantizedLinears, backend: str) -> None:
    """Raises ConfigError where kernel backend `backend` cannot run quantized linears (Triton: not yet)."""
    if backend not in QUANTIZED_BACKENDS:
        raise ConfigError(f"{linears.describe()}: kernel_backend={backend} cannot run quantized weights yet "
                          f"(supported: {list(QUANTIZED_BACKENDS)}; set option.kernel_backend=cpp on CPU)")
    log.info("quantized linears: %s, on kernel_backend=%s%s", linears.describe(), backend,
             " (inside the fused C++ stack where the family fits it)" if backend == "cpp" else "")
