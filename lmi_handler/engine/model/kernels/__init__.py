"""Batch-invariant float32 CPU kernels (C++, built on first use) and their pure-PyTorch references.

Owns the packed-weight layout, the lazy build and the fallback when no C++ compiler works; leaves
deciding which layers use them to llama.py and attention.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 32   # output columns per packed panel; must equal PANEL in cpu_kernels.cpp
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_state: dict = {}


def cpu_kernels():
    """The compiled extension module, or None when it cannot be built (logged once as a warning).

    Built with torch.utils.cpp_extension.load (-O3 -march=native -fopenmp) into torch's extension
    cache on first call; later processes reuse the cached build unless the source changed.
    """
    if "module" not in _state:
        _state["module"] = _build(_SOURCE, "lmi_cpu_kernels")
    return _state["module"]


def _build(source: Path, name: str):
    """Compile `source` as extension `name`; None (and a warning) when that fails."""
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    try:
        module = load(name=name, sources=[str(source)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:     # no compiler, no ninja, a build error: the PyTorch paths still work
        log.warning("C++ CPU kernels unavailable, using the PyTorch fallback: %s", exc)
        return None
    if module.PANEL != PANEL:
        raise RuntimeError(f"cpu_kernels.cpp PANEL={module.PANEL} but the wrapper expects {PANEL}")
    log.info("C++ CPU kernels ready in %.1f s (vector width %d)", time.perf_counter() - start,
             module.VECTOR_WIDTH)
    return module


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (out_features, in_features) repacked for `packed_linear`.

    panels: (ceil(out_features / PANEL), in_features, PANEL) float32, contiguous; panel p holds
    output columns p*PANEL .. p*PANEL+PANEL-1 (zero-padded past out_features), k-major, so the
    kernel streams one panel from start to end per row block.
    """

    panels: torch.Tensor
    out_features: int

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the original weight (an embedding lookup on a tied lm_head): (len(ids), in)."""
        return self.panels[ids // PANEL, :, ids % PANEL]

    def unpack(self) -> torch.Tensor:
        """The original (out_features, in_features) weight (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """(out, in) float32 CPU weight -> PackedWeight. Holds one extra copy only while packing."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, num_panels * PANEL - out_features))
    panels = padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()
    return PackedWeight(panels=panels, out_features=out_features)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias), each output one FMA chain over k = 0..in-1: a row's bits do not depend on
    the other rows. x: (M, in) float32 CPU -> (M, out) float32. Needs cpu_kernels() not None."""
    return cpu_kernels().linear(x, weight.panels, weight.out_features, bias)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-PyTorch reference for packed_linear: x @ weight.T (+ bias) in float64, cast to x's dtype."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)
