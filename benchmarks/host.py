"""The host a benchmark runs on: facts read from /proc and /sys (CPU model and flags, cores, memory, caches)
and its ceilings, measured inside the run they are held against (read bandwidth, peak FLOP/s).

Owns "what machine was this" (recorded in every result JSON, since ratios move with the host), which CPUs
vLLM's OpenMP threads are bound to, the probes (C sources in probes/) and other work on it (busy_cores, for
--busy-cores). Plain Python; torch only inside
peak_matmul: the orchestrator and every venv can import it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# the instruction-set flags that decide which kernels an engine can use (vLLM's CPU docs list avx512f,
# avx512_bf16 and avx512_vnni; AMX tiles on Sapphire Rapids and later)
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                     "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo's text -> model name, vendor, family/model/stepping, the flags of interest (present
    ones, in FLAGS_OF_INTEREST order), all flags, and the logical CPUs listed. Missing fields are None."""
    first: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            processors += 1
        first.setdefault(key, value)
    flags = first.get("flags", "").split()
    return {"model": first.get("model name"), "vendor": first.get("vendor_id"),
            "family_model_stepping": [first.get("cpu family"), first.get("model"), first.get("stepping")],
            "flags_of_interest": [f for f in FLAGS_OF_INTEREST if f in flags], "num_flags": len(flags),
            "hypervisor": "hypervisor" in flags, "logical_cpus_listed": processors}


def parse_meminfo(text: str) -> dict:
    """/proc/meminfo's text -> MemTotal, MemAvailable and AnonHugePages in bytes (None when absent)."""
    values = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+) kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * 1024
    return {"mem_total_bytes": values.get("MemTotal"), "mem_available_bytes": values.get("MemAvailable"),
            "anon_huge_pages_bytes": values.get("AnonHugePages")}


def thp_mode(sys_root: Path = Path("/sys")) -> str | None:
    """Transparent huge pages: the bracketed word of .../transparent_hugepage/enabled (always | madvise |
    never), None where the file does not exist."""
    try:
        text = (sys_root / "kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def cache_sizes(sys_root: Path = Path("/sys")) -> dict[str, int]:
    """CPU 0's caches, {"L1d": bytes, "L1i": ..., "L2": ..., "L3": ...}, from .../cpu0/cache/index*;
    {} where sysfs has none. (lscpu's totals add up instances; these are one instance each.)"""
    out = {}
    for index in sorted((sys_root / "devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if not m:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[f"L{level}{suffix}"] = int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]
    return out


def physical_core_of(cpus: list[int], sys_root: Path = Path("/sys")) -> dict[int, tuple[int, int]]:
    """Logical CPU -> (package id, core id) from sysfs topology; a CPU without topology files is its own core."""
    out = {}
    for cpu in cpus:
        topo = sys_root / f"devices/system/cpu/cpu{cpu}/topology"
        try:
            out[cpu] = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            out[cpu] = (-1, cpu)
    return out


def one_cpu_per_core(cpus: list[int], core_of: dict[int, tuple[int, int]]) -> list[int]:
    """The lowest-numbered logical CPU of each physical core among `cpus`, in CPU order (vLLM's CPU docs:
    on a hyper-threaded host bind one OpenMP thread per physical core)."""
    seen, out = set(), []
    for cpu in sorted(cpus):
        if core_of[cpu] not in seen:
            seen.add(core_of[cpu])
            out.append(cpu)
    return out


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the list syntax of VLLM_CPU_OMP_THREADS_BIND and taskset)."""
    parts, cpus = [], sorted(cpus)
    start = prev = None
    for cpu in [*cpus, None]:
        if start is not None and (cpu is None or cpu != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if cpu is not None and start is None:
            start = cpu
        prev = cpu
    return ",".join(parts)


def omp_bind_cpus(threads: int, sys_root: Path = Path("/sys")) -> list[int]:
    """The CPUs to bind `threads` OpenMP threads to: one per physical core among those this process may
    use, lowest first; when there are fewer cores than threads, the remaining logical CPUs after them."""
    allowed = sorted(os.sched_getaffinity(0))
    first = one_cpu_per_core(allowed, physical_core_of(allowed, sys_root))
    rest = [cpu for cpu in allowed if cpu not in first]
    return (first + rest)[:threads]


def host_info() -> dict:
    """Everything above for this machine, for the result JSON's "machine" record."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    allowed = sorted(os.sched_getaffinity(0))
    cores = one_cpu_per_core(allowed, physical_core_of(allowed))
    return {"cpu": parse_cpuinfo(read("/proc/cpuinfo")), "cpu_count": os.cpu_count(),
            "affinity_cpus": len(allowed), "physical_cores_in_affinity": len(cores),
            **parse_meminfo(read("/proc/meminfo")), "caches_bytes": cache_sizes(), "thp": thp_mode(),
            "hostname": platform.node(), "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version()}


# ---- the machine's ceilings, measured inside the run they are held against ----------------------------------
# Memory read bandwidth (probes/membw.c, built with the C compiler at run time, best of N passes over a buffer
# several times the last-level cache, huge pages where the kernel gives them), the peak matmul rate per dtype
# (torch.matmul), the cores' peak float32 FMA rate (probes/fmapeak.c) and a plain read of a batch-1 step's
# weights in the step's call pattern (probes/step_read.c). The ceilings' arithmetic (bytes per token / GB/s) is
# report.py's. Run by `workers.py peak` in the project's venv, so torch is imported lazily.

MEMBW_SOURCE = Path(__file__).resolve().parent / "probes" / "membw.c"
FMAPEAK_SOURCE = Path(__file__).resolve().parent / "probes" / "fmapeak.c"
STEP_READ_SOURCE = Path(__file__).resolve().parent / "probes" / "step_read.c"
MIN_BUFFER_BYTES = 1 << 30


def default_buffer_bytes(l3_bytes: int | None, mem_available_bytes: int | None) -> int:
    """At least 1 GiB and 4x the last-level cache (so the passes stream from DRAM), at most a quarter of
    the memory available now."""
    size = max(MIN_BUFFER_BYTES, 4 * (l3_bytes or 0))
    if mem_available_bytes:
        size = min(size, mem_available_bytes // 4)
    return size


def build_probe(out_dir: Path, source: Path) -> Path:
    """Compile a C probe (probes/membw.c, probes/fmapeak.c) with `cc -O3 -march=native -fopenmp` into `out_dir`;
    returns the binary. The binary's name carries a digest of the source and the compiler, so a later call
    with the same `out_dir` (a batch-1 round's probe, run before every round) reuses it instead of compiling
    again. Raises RuntimeError (with the compiler's message) when there is no compiler or the build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError(f"no C compiler (cc, gcc or $CC) to build probes/{source.name}")
    digest = hashlib.sha256(source.read_bytes() + cc.encode()).hexdigest()[:12]
    binary = out_dir / f"{source.stem}-{digest}"
    if binary.is_file():
        return binary
    partial = binary.with_name(f"{binary.name}.partial")     # renamed once whole: never run half-written
    proc = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", str(source), "-o", str(partial)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr[-500:]}")
    partial.replace(binary)
    return binary


def _omp_env(threads: int) -> tuple[dict, list[int]]:
    cpus = omp_bind_cpus(threads)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "true",
            "OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus)}, cpus


def fma_peak(threads: int, out_dir: Path, iters: int = 100_000_000, repeats: int = 5) -> dict:
    """Peak float32 FMA rate of `threads` OpenMP threads bound as read_bandwidth's (probes/fmapeak.c:
    independent register-resident vector FMA chains, 64-byte vectors with AVX-512, else 32). The ceiling a
    float32 GEMM can approach; "best_flops_per_s" in FLOP/s (2 per lane per FMA). Raises RuntimeError when
    it cannot run."""
    env, cpus = _omp_env(threads)
    binary = build_probe(out_dir, FMAPEAK_SOURCE)
    proc = subprocess.run([str(binary), str(iters), str(repeats)], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"fmapeak exit code {proc.returncode}: {proc.stderr[-500:]}")
    result = json.loads(proc.stdout)
    result.pop("sink", None)
    return {**result, "bound_cpus": cpu_list(cpus),
            "method": "probes/fmapeak.c: register-resident vector FMA chains per thread, best of the passes"}


def read_bandwidth(threads: int, buffer_bytes: int | None, repeats: int, out_dir: Path) -> dict:
    """Best-of-`repeats` read bandwidth with `threads` OpenMP threads, bound one per physical core (the
    CPUs vLLM's threads are bound to), on a `buffer_bytes` buffer (None: default_buffer_bytes) with
    MADV_HUGEPAGE unless transparent huge pages are off. Returns membw's JSON plus how it ran;
    "best_bytes_per_s" is the figure the batch-1 ceilings use. Raises RuntimeError when it cannot run."""
    meminfo = parse_meminfo(Path("/proc/meminfo").read_text()) if Path("/proc/meminfo").exists() else {}
    caches = cache_sizes()
    size = buffer_bytes or default_buffer_bytes(caches.get("L3"), meminfo.get("mem_available_bytes"))
    thp = thp_mode()
    huge = thp in ("always", "madvise")
    env, cpus = _omp_env(threads)
    binary = build_probe(out_dir, MEMBW_SOURCE)
    proc = subprocess.run([str(binary), str(size), str(repeats), str(int(huge))], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"membw exit code {proc.returncode}: {proc.stderr[-500:]}")
    result = json.loads(proc.stdout)
    result.pop("sink", None)
    return {**result, "bound_cpus": cpu_list(cpus), "thp": thp, "l3_bytes": caches.get("L3"),
            "method": "probes/membw.c: uint64 sum over the buffer, each thread its own slice, best of the passes"}


def step_read(threads: int, layers: int, layer_bytes: list[int], tail_bytes: int, sweeps: int, out_dir: Path) -> dict:
    """A plain read of one batch-1 decode step's weights in the step's call pattern (probes/step_read.c, built
    into `out_dir` once), `threads` OpenMP threads bound as read_bandwidth's: `layers` x one region per weight of
    `layer_bytes` (bytes each, in layer order), then one of `tail_bytes` (the lm_head), each thread its contiguous
    share, from DRAM, no arithmetic; each size rounded down to whole 64-byte lines. Returns its JSON: bytes,
    threads, sweeps, regions, best_s / median_s (seconds a sweep, best and median of `sweeps`), best_bytes_per_s /
    median_bytes_per_s. Raises RuntimeError when the probe cannot be built or exits non-zero (its message in the
    error)."""
    binary = build_probe(out_dir, STEP_READ_SOURCE)
    env, cpus = _omp_env(threads)
    proc = subprocess.run([str(binary), str(sweeps), str(layers), str(tail_bytes), *map(str, layer_bytes)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"step_read exit code {proc.returncode}: {proc.stderr[-500:]}")
    result = json.loads(proc.stdout)
    result.pop("sink", None)
    return {**result, "bound_cpus": cpu_list(cpus)}


def peak_matmul(dtype_name: str, size: int, threads: int, decode_shape: tuple[int, int, int] | None = None) -> dict:
    """FLOP/s of a square `size`^3 torch.matmul (0: 2048 on CPU, 8192 on CUDA) in `dtype_name` (fp32 | bf16),
    best of 5 timed runs after a warm-up, and of the model's decode-shaped GEMM (M x K -> N) when given.
    CUDA when torch sees it."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.set_num_threads(threads)
    size = size or (8192 if device == "cuda" else 2048)

    def rate(m: int, k: int, n: int, repeat: int) -> float:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        # each timed pass about 0.1 s at most: a bf16 matmul without native bf16 dot products (AVX2 hosts)
        # runs at about 1 GFLOP/s, and 50 decode-shaped ones a pass took the smoke run 30 s
        repeat = max(1, min(repeat, round(0.1 / max(time.perf_counter() - start, 1e-9))))
        best = float("inf")
        for _ in range(6):  # the first is a warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeat):
                torch.matmul(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / repeat)
        return 2 * m * k * n / best

    out = {"device": device, "dtype": str(dtype), "torch_num_threads": torch.get_num_threads(), "square_size": size,
           "peak_flops_per_s": rate(size, size, size, 3 if device == "cpu" else 20)}
    if decode_shape:
        out.update(decode_shape=list(decode_shape), decode_shape_flops_per_s=rate(*decode_shape, 50))
    return out


SPIN = "while True: pass"


@contextmanager
def busy_cores(num: int, settle_s: float = 0.5):
    """Other work on the host, for --busy-cores: N processes that only spin (one core each) for the block's duration
    (none when num is 0), as a neighbour, a log shipper or the container's own front end would take cores from the
    engine; each stopped (killed and reaped) at its end, also on an error or Ctrl-C. Yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(max(0, num))]
    try:
        if procs:
            time.sleep(settle_s)
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
