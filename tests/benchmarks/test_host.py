"""benchmarks/host.py: the host record (cpuinfo, meminfo, sysfs on temp trees), the CPUs vLLM's
threads are bound to, the read-bandwidth probe on a small buffer, and
--busy-cores' spinning processes (running inside the block, gone after it)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import host  # noqa: E402

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 hypervisor

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 hypervisor
"""


def test_cpuinfo_gives_the_model_and_the_flags_that_pick_kernels_in_a_fixed_order():
    info = host.parse_cpuinfo(CPUINFO)
    assert info["model"] == "Intel(R) Xeon(R) Processor" and info["vendor"] == "GenuineIntel"
    assert info["flags_of_interest"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert info["hypervisor"] and info["logical_cpus_listed"] == 2
    assert host.parse_cpuinfo("")["model"] is None


def test_meminfo_is_read_in_bytes():
    info = host.parse_meminfo("MemTotal:       24684120 kB\nMemAvailable:   22000000 kB\nAnonHugePages:   2048 kB\n")
    assert info == {"mem_total_bytes": 24684120 * 1024, "mem_available_bytes": 22000000 * 1024,
                    "anon_huge_pages_bytes": 2048 * 1024}


def _sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    cache = root / "devices/system/cpu/cpu0/cache"
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                                 (3, "Unified", "260M")]):
        d = cache / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    (root / "kernel/mm/transparent_hugepage").mkdir(parents=True)
    (root / "kernel/mm/transparent_hugepage/enabled").write_text("always [madvise] never\n")
    return root


def test_hyper_threads_are_bound_one_per_physical_core(tmp_path):
    # 4 logical CPUs on 2 cores: 0 and 2 share core 0, 1 and 3 share core 1 (lscpu -e's usual numbering)
    root = _sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    core_of = host.physical_core_of([0, 1, 2, 3], root)
    assert host.one_cpu_per_core([3, 2, 1, 0], core_of) == [0, 1]
    assert host.one_cpu_per_core([2, 3], core_of) == [2, 3]
    assert host.physical_core_of([9], root) == {9: (-1, 9)}  # no topology files: its own core


def test_caches_and_huge_pages_are_read_from_sysfs(tmp_path):
    root = _sysfs(tmp_path, {0: (0, 0)})
    assert host.cache_sizes(root) == {"L1d": 48 << 10, "L1i": 32 << 10, "L2": 2 << 20, "L3": 260 << 20}
    assert host.thp_mode(root) == "madvise"
    assert host.thp_mode(tmp_path / "none") is None and host.cache_sizes(tmp_path / "none") == {}


@pytest.mark.parametrize("cpus,text", [([0, 1], "0-1"), ([0], "0"), ([5, 0, 1, 2], "0-2,5"), ([1, 3, 4], "1,3-4"),
                                       ([], "")])
def test_cpu_lists_use_the_taskset_syntax(cpus, text):
    assert host.cpu_list(cpus) == text


def test_omp_binding_takes_cpus_this_process_may_use():
    allowed = sorted(__import__("os").sched_getaffinity(0))
    bound = host.omp_bind_cpus(len(allowed))
    assert sorted(bound) == allowed and host.omp_bind_cpus(1) == bound[:1]


def test_the_bandwidth_buffer_is_past_the_last_level_cache_and_within_memory():
    assert host.default_buffer_bytes(260 << 20, 64 << 30) == 1040 << 20
    assert host.default_buffer_bytes(None, None) == 1 << 30
    assert host.default_buffer_bytes(64 << 20, 2 << 30) == 512 << 20  # a quarter of what is available


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_read_bandwidth_probe_builds_and_reports_every_pass(tmp_path):
    result = host.read_bandwidth(1, 8 << 20, 3, tmp_path)
    assert result["bytes"] == 8 << 20 and result["threads"] == 1 and len(result["seconds"]) == 3
    assert result["best_s"] == min(result["seconds"]) > 0
    assert result["best_bytes_per_s"] == pytest.approx(result["bytes"] / result["best_s"], rel=1e-3)
    assert result["bound_cpus"] and result["huge_pages_requested"] in (0, 1)
    assert 0 < result["cpu_fraction"] <= 1.05  # thread CPU time / wall time of the best pass


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_probe_is_compiled_once_per_source_and_reused_by_later_rounds(tmp_path):
    first = host.build_probe(tmp_path, host.MEMBW_SOURCE)
    built_at = first.stat().st_mtime_ns
    assert host.build_probe(tmp_path, host.MEMBW_SOURCE) == first and first.stat().st_mtime_ns == built_at
    host.read_bandwidth(1, 8 << 20, 1, tmp_path)          # a round's probe: no second binary, no rebuild
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name] and first.stat().st_mtime_ns == built_at
    edited = tmp_path / "src" / host.MEMBW_SOURCE.name       # another source text: a binary of its own
    edited.parent.mkdir()
    edited.write_text(host.MEMBW_SOURCE.read_text() + "\n/* edited */\n")
    other = host.build_probe(tmp_path, edited)
    assert other != first and other.is_file() and first.is_file()


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_step_read_probe_reads_the_bytes_a_decode_step_streams_in_one_region_per_linear(tmp_path):
    from workload import step_linears, weight_bytes_per_token

    config = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
              "vocab_size": 1000, "num_hidden_layers": 3}
    layers, layer, lm_head = step_linears(config)
    for dtype, size in (("bf16", 2), ("fp32", 4)):
        sizes = [rows * cols * size for rows, cols in layer]
        result = host.step_read(2, layers, sizes, lm_head[0] * lm_head[1] * size, 3, tmp_path)
        assert result["bytes"] == weight_bytes_per_token(config, dtype)["bytes"]   # every linear and the lm_head
        assert result["regions"] == 4 * 3 + 1 and result["sweeps"] == 3 and result["threads"] == 2
        assert 0 < result["best_s"] <= result["median_s"]
        assert result["best_bytes_per_s"] == pytest.approx(result["bytes"] / result["best_s"], rel=1e-3)
        assert result["bound_cpus"] and "sink" not in result
    with pytest.raises(RuntimeError, match="step_read exit code 2"):   # the probe refuses a model of no layers
        host.step_read(1, 0, [64], 64, 1, tmp_path)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_fma_peak_probe_counts_two_flops_per_lane_per_fma_and_reports_every_pass(tmp_path):
    result = host.fma_peak(1, tmp_path, iters=2_000_000, repeats=3)
    assert result["threads"] == 1 and result["lanes"] in (8, 16) and len(result["seconds"]) == 3
    flops = 2 * result["lanes"] * result["chains"] * result["iters"] * result["threads"]
    assert result["best_flops_per_s"] == pytest.approx(flops / min(result["seconds"]), rel=1e-3)
    assert result["bound_cpus"] and 0 < result["cpu_fraction"] <= 1.05


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_n_spinning_processes_run_inside_the_block_and_are_stopped_after_it_even_on_an_error():
    with pytest.raises(RuntimeError), host.busy_cores(2, settle_s=0.0) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        raise RuntimeError("a phase failed")
    assert not any(_alive(p) for p in pids)
    with host.busy_cores(0) as none:
        assert none == []
