"""The C++ CPU kernels' lazy build, the fallback when no C++ compiler works, and what the CPU offers.

Owns building (and finding a stale build lock), huge-page buffers and the CPU's bfloat16 support;
leaves the packed layouts to packing.py and deciding which layers use the kernels to llama.py.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 32   # output columns per packed panel; must equal PANEL in linear.h
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_state: dict = {}


def cpu_kernels():
    """The compiled extension module, or None when it cannot be built (logged once as a warning).

    Built with torch.utils.cpp_extension.load (-O3 -march=native -ffp-contract=off -fopenmp) into
    torch's extension cache on first call (the name carries a hash of the sources and of the CPU's
    flags) (-ffp-contract=off: a * b + c stays two roundings, as in PyTorch's elementwise ops); later
    processes reuse the cached build unless the sources or the CPU changed.
    """
    if "module" not in _state:
        _state["module"] = build_extension(_SOURCE, _module_name(_SOURCE))
    return _state["module"]


def built_kernels():
    """The extension module when cpu_kernels() has built it already, else None: never builds (for the
    fast paths outside the model, e.g. the sampler's argmax, which must not compile the kernels on the
    plain path)."""
    return _state.get("module")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (e.g. avx512f, avx512_bf16, amx_bf16); empty
    where that file does not exist (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _module_name(source: Path) -> str:
    """The extension's name carries a hash of its sources (the .cpp and the headers beside it) and of the
    CPU's flags: checkouts of different versions on one machine (a CI clone beside a working tree) never
    load each other's build from torch's shared cache, and a home directory shared by machines with
    different CPUs never loads a -march=native build made for another one. It also carries torch's
    version and install path: torch writes that path (its include directories) into the build file, so
    two virtual environments sharing one build directory would each see the other's build as stale and
    rebuild it in turn (seen here: five checkouts, each start waiting minutes on the others' builds). The
    sources' own directory is hashed for the same reason: the build file names the source path, so two
    checkouts of one version (git worktrees) would otherwise rebuild each other's build at every start."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(source.parent.glob("*.[ch]*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(f"{torch.__version__}\0{Path(torch.__file__).resolve().parent}".encode())
    digest.update(str(source.resolve().parent).encode())
    return "lmi_cpu_kernels_" + digest.hexdigest()[:12]


STALE_LOCK_S = 600.0   # a build takes about a minute here; a lock this old was left by a killed build


def clear_stale_build_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> bool:
    """Wait while `build_dir`/lock is held by a build younger than `max_age_s` seconds (as torch itself
    would), then remove it if it is still there; True when a stale lock was removed.

    torch.utils.cpp_extension serialises builds with that file and waits for it to go away, forever: a
    build killed part-way (SIGKILL, a CI timeout) would otherwise hang every later start of the engine.
    The file's mtime is when its build began.
    """
    lock = Path(build_dir) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= max_age_s:
            break
        time.sleep(min(poll_s, max_age_s - age))
    log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def kernel_sources(source: Path) -> list[str]:
    """The translation units of the extension whose module source is `source` (cpu_kernels.cpp): it first, then
    every other .cpp beside it (families.cpp: the C++ ops backend's kernels, a unit of their own so that the
    compiler's inlining in the Llama path's unit is not changed by them). A revision with one .cpp builds as
    before (benchmarks/ab.py builds old revisions through build_extension)."""
    return [str(source)] + sorted(str(p) for p in source.parent.glob("*.cpp") if p.name != source.name)


def build_extension(source: Path, name: str):
    """Compile `source` (and the other units beside it, kernel_sources) as extension `name`; None (and a
    warning) when that fails."""
    from torch.utils.cpp_extension import _get_build_directory, load

    start = time.perf_counter()
    try:
        clear_stale_build_lock(Path(_get_build_directory(name, verbose=False)))
        module = load(name=name, sources=kernel_sources(source),
                      extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:     # no compiler, no ninja, a build error: the PyTorch paths still work
        log.warning("C++ CPU kernels unavailable, using the PyTorch fallback: %s", exc)
        return None
    if module.PANEL != PANEL:
        raise RuntimeError(f"cpu_kernels.cpp PANEL={module.PANEL} but the wrapper expects {PANEL}")
    log.info("C++ CPU kernels ready in %.1f s (vector width %d, AVX512_BF16 %s)", time.perf_counter() - start,
             module.VECTOR_WIDTH, "yes" if module.NATIVE_BF16 else "no")
    return module


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor in 2 MiB-aligned memory marked for transparent huge pages.

    For the large, streamed buffers (packed weights, the KV cache): with 4 KiB pages each page is a
    TLB miss, and under a hypervisor each miss walks two page tables (measured on this project's
    2-core VM: a 425 MiB stream read at 17.6 GB/s with 4 KiB pages, 23.2 GB/s with huge pages).
    Falls back to torch.empty for other dtypes or devices, when `huge_pages` is False (option.huge_pages,
    LMI_HUGE_PAGES=0: config.py), or when the C++ kernels
    are not built: it never builds them itself, so the plain (option.batch_invariant=false) path compiles
    nothing; the batch-invariant path builds them before packing its weights. Where THP is off the
    kernel ignores the advice. Contents are what torch.empty gives: zero_() or copy_() before use.
    """
    if (dtype not in _HUGE_DTYPES or torch.device(device).type != "cpu" or not huge_pages
            or (module := _state.get("module")) is None):
        return torch.empty(shape, dtype=dtype, device=device)
    return module.empty_huge(list(shape), dtype)


_HUGE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)   # what the weights and the KV cache use


def native_bf16_cpu() -> bool:
    """Whether the CPU has native bfloat16 dot products (AVX512_BF16 or AMX-BF16): the test dtype=auto
    applies to a bf16 checkpoint (vLLM's CPU backend runs bf16 where this holds). From the built kernels
    when they exist (compiled with -march=native, so they say what this CPU has), else /proc/cpuinfo."""
    module = _state.get("module")
    if module is not None:
        return bool(module.NATIVE_BF16) or "amx_bf16" in cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


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
    from lmi_handler.engine.model.kernels.packing import pack_weight

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
    from lmi_handler.engine.model.kernels.packing import pack_weight

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
    from lmi_handler.engine.model.kernels.packing import pack_weight

    packed = pack_weight(w, "bfloat16")
    fma = module.linear(x, packed.panels, 70, None, None, False, BF16_FMA)
    return torch.equal(module.linear(x, packed.panels, 70, None, None, False, BF16_DP), fma)
