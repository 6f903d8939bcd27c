"""Which form multiplies bfloat16 panels (linear.h's Bf16Form: the FMA form, VDPBF16PS or AMX tiles), chosen once
per process from what the build and the CPU offer, with the probes that check and time the forms.

Leaves building the kernels to build.py, the panels' layout to packing.py and calling the linear to ops.py.
"""
from __future__ import annotations

import logging
import time

import torch

from lmi_handler.engine.model.kernels.build import cpu_kernels
from lmi_handler.engine.model.kernels.packing import pack_weight

log = logging.getLogger(__name__)
_state: dict = {}   # the chosen form, choose_bf16_dot's mode and the start-up timing, once a process

# linear.h's Bf16Form: how bf16 panels are multiplied
BF16_FMA, BF16_DP, BF16_AMX = 0, 1, 2
_FORM_NAMES = {BF16_FMA: "FMA form", BF16_DP: "VDPBF16PS", BF16_AMX: "AMX tiles"}


def bf16_dot_form() -> int:
    """How bf16 panels are multiplied (linear.h's Bf16Form), chosen once per process and logged:

    - BF16_AMX (2): AMX tiles (TDPBF16PS), at every row count. Where the build has AMX-BF16, Linux grants
      the tile state (arch_prctl) and a self-check finds each row's bits the same alone and in a batch
      (_amx_is_row_invariant). Its bits are its own (the instruction's order inside a 16-pair step is
      not the FMA form's), so it is never mixed with the other forms; every process on one machine picks
      it alike (no timing decides it), so tensor-parallel ranks agree.
    - BF16_DP (1): VDPBF16PS above 4 rows, the FMA form below; where the build has AVX512_BF16 and the
      instruction gives, on a probe, the bits of the documented order the FMA form follows (linear.h),
      and then (mode "auto") only when a start-up timing probe finds it faster than the FMA form on one
      small shape. Both give the same bits, so this choice never changes an output.
    - BF16_FMA (0): two FMAs per pair on widened values (any CPU).

    choose_bf16_dot overrides the choice ("fma", "native", "amx"). Measured, one core or two, wall
    clock (benchmarks/README.md, benchmarks/profiling.py kernels):
      Intel Xeon with AMX (2 cores): AMX tiles 670-1100 GFLOP/s at 64 and 512 rows on the demo model's
        linears against about 195 for VDPBF16PS (oneDNN's bf16 matmul, also AMX: 690-1345).
      Intel Xeon (AVX512_BF16, no AMX): VDPBF16PS zmm retires 0.5 per cycle (16 multiply-adds a cycle)
        against 2 FMAs (32): the FMA form was faster there.
      AMD EPYC Zen 5: the 8-row VDPBF16PS tile reaches 424-453 GFLOP/s on the demo model's linears at
        64 and 200 rows against 205-229 for the FMA form (oneDNN's bf16 matmul: 394-438).
    """
    if "bf16_form" not in _state:
        _state["bf16_form"] = _pick_bf16_dot()
    return _state["bf16_form"]


def bf16_form_name(form: int) -> str:
    """bf16_dot_form's value as words ("FMA form", "VDPBF16PS", "AMX tiles")."""
    return _FORM_NAMES[form]


def choose_bf16_dot(mode: str) -> None:
    """"auto" (the default: AMX tiles where bf16_dot_form's conditions hold, else VDPBF16PS where its
    conditions hold and it times faster, else the FMA form), "fma" (always the FMA form), "native"
    (VDPBF16PS where the CPU has it and it gives the documented bits, without timing) or "amx" (AMX tiles
    where the build and the OS allow them, else as "auto" without AMX), for the linears run after this
    call (benchmarks/profiling.py kernels compares them). Raises: ValueError for another mode."""
    if mode not in BF16_DOT_MODES:
        raise ValueError(f"bf16 dot mode must be one of {BF16_DOT_MODES}, got {mode!r}")
    _state["bf16_dot_mode"] = mode
    _state.pop("bf16_form", None)


BF16_DOT_MODES = ("auto", "fma", "native", "amx")


def _pick_bf16_dot() -> int:
    module = cpu_kernels()
    mode = _state.get("bf16_dot_mode", "auto")
    if module is None or mode == "fma":
        if module is not None:
            log.info("bf16 linears: FMA form (chosen: %s)", mode)
        return BF16_FMA
    if mode in ("auto", "amx") and module.HAS_AMX:
        if not module.amx_permitted():
            log.warning("the OS refused AMX tile state (arch_prctl); bf16 linears do without AMX")
        elif not _amx_is_row_invariant(module):
            log.warning("AMX tiles gave a row different bits alone and in a batch; bf16 linears do without AMX")
        else:
            log.info("bf16 linears: AMX tiles (AMX-BF16, every row count)")
            return BF16_AMX
    if mode == "amx" and not module.HAS_AMX:
        log.warning("AMX tiles were asked for, but this build of the kernels has no AMX-BF16; bf16 linears do "
                    "without AMX")
    if not module.NATIVE_BF16:
        (log.warning if mode != "auto" else log.info)(
            "bf16 linears: FMA form (this CPU or build has no AVX512_BF16%s; chosen: %s)",
            "" if mode == "native" else " nor AMX-BF16", mode)
        return BF16_FMA
    if not _native_matches_fma(module):
        log.warning("VDPBF16PS does not give the documented bits on this CPU; bf16 linears use the FMA form")
        return BF16_FMA
    if mode in ("native", "amx"):
        log.info("bf16 linears: VDPBF16PS above 4 rows, the FMA form below (chosen: %s)", mode)
        return BF16_DP
    if "bf16_timing" not in _state:    # timed once a process: choosing "auto" again gives the same form
        _state["bf16_timing"] = _time_bf16_dots(module)
    native_s, fma_s = _state["bf16_timing"]
    log.info("bf16 linears: %s (start-up probe, 64 x 576 x 1024: VDPBF16PS %.3f ms, FMA form %.3f ms)",
             "VDPBF16PS" if native_s < fma_s else "FMA form", native_s * 1e3, fma_s * 1e3)
    return BF16_DP if native_s < fma_s else BF16_FMA


def _amx_is_row_invariant(module) -> bool:
    """AMX tiles give 40 rows of mixed magnitudes (an odd K with a tail step, a partial last panel) the same
    bits computed together as each alone."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 301, generator=g) * torch.logspace(-4, 4, 301)).to(torch.bfloat16)
    w = torch.randn(70, 301, generator=g) * torch.logspace(3, -3, 301)
    panels = pack_weight(w, "bfloat16", huge_pages=False).panels
    batch = module.linear(x, panels, 70, None, None, False, BF16_AMX)
    return all(torch.equal(module.linear(x[i:i + 1], panels, 70, None, None, False, BF16_AMX), batch[i:i + 1])
               for i in (0, 15, 16, 39))


def _time_bf16_dots(module, rounds: int = 7) -> tuple[float, float]:
    """The best of `rounds` interleaved wall-clock timings (seconds) of one (64, 576) x (576, 1024) bf16
    linear through VDPBF16PS and through the FMA form (about 10 ms in all here). The minimum of
    interleaved runs stands a shared machine's load; a wrong pick costs speed, never bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    panels = pack_weight(torch.randn(1024, 576, generator=g) * 0.05, "bfloat16", huge_pages=False).panels
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, form in enumerate((BF16_DP, BF16_FMA)):
            start = time.perf_counter()
            module.linear(x, panels, 1024, None, None, True, form)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _native_matches_fma(module) -> bool:
    """VDPBF16PS and the FMA form agree bitwise on random bf16 rows and weights of mixed magnitudes."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 301, generator=g) * torch.logspace(-4, 4, 301)).to(torch.bfloat16)
    w = torch.randn(70, 301, generator=g) * torch.logspace(3, -3, 301)
    packed = pack_weight(w, "bfloat16")
    fma = module.linear(x, packed.panels, 70, None, None, False, BF16_FMA)
    return torch.equal(module.linear(x, packed.panels, 70, None, None, False, BF16_DP), fma)
