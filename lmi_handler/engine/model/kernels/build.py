"""The C++ CPU kernels' lazy build, the fallback when no C++ compiler works, and what the CPU offers.

Owns building (and finding a stale build lock), huge-page buffers, the CPU's flags and whether it has native
bfloat16 dot products; leaves the packed layouts to packing.py, the bf16 linears' form to bf16_form.py and
which layers run on the kernels to the model's backends (backends/cpp.py).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 32   # output columns per packed panel; must equal PANEL in linear_tiles.h
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
    compiler's inlining in the fused stack's unit is not changed by them). A revision with one .cpp builds as
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
