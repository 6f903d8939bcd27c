"""The host a benchmark runs on, as facts read from /proc and /sys: CPU model and flags, cores, memory, caches.

Owns "what machine was this" (recorded in every result JSON, since ratios move with the host) and which
CPUs vLLM's OpenMP threads are bound to; measuring the machine (bandwidth, FLOP/s) is probes.py's.
Plain Python, no torch: the orchestrator and every venv can import it.
"""
from __future__ import annotations

import os
import platform
import re
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
