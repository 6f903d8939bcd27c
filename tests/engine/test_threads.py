"""engine/threads.py: option.num_threads=auto's starting count from the affinity mask and a fake cgroup's CPU quota,
and its run-time adaptation fed fake windows; an explicit count stays fixed."""
from __future__ import annotations

import logging

import pytest
import torch

from lmi_handler.engine import threads as threads_mod
from lmi_handler.engine.threads import ThreadControl, ThreadTuner, auto_threads, cgroup_cpu_quota


def fake_cgroup_v2(tmp_path, limits: dict[str, str]):
    """A cgroup v2 tree under tmp_path/fs and a /proc/self/cgroup naming /kubepods/pod1/ctr; `limits` maps a
    directory under the root ("" the root) to its cpu.max."""
    root = tmp_path / "fs"
    (root / "kubepods/pod1/ctr").mkdir(parents=True)
    for directory, value in limits.items():
        (root / directory / "cpu.max").write_text(value + "\n")
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text("0::/kubepods/pod1/ctr\n")
    return root, self_cgroup


def test_the_cgroup_v2_quota_is_the_smallest_on_the_path_up_to_the_root(tmp_path):
    root, self_cgroup = fake_cgroup_v2(tmp_path, {"": "max 100000", "kubepods/pod1": "150000 100000",
                                                  "kubepods/pod1/ctr": "max 100000"})
    assert cgroup_cpu_quota(root, self_cgroup) == 1.5
    root, self_cgroup = fake_cgroup_v2(tmp_path / "none", {"kubepods/pod1/ctr": "max 100000"})
    assert cgroup_cpu_quota(root, self_cgroup) is None


def test_the_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    ctr = tmp_path / "fs/cpu,cpuacct/docker/abc"
    ctr.mkdir(parents=True)
    (ctr / "cpu.cfs_quota_us").write_text("300000\n")
    (ctr / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cgroup").write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "cgroup") == 3.0
    (ctr / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "cgroup") is None


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "missing") is None


@pytest.mark.parametrize(("cores", "quota", "expected"), [(8, None, 8), (8, 2.0, 2), (8, 1.5, 1), (8, 0.5, 1),
                                                           (2, 4.0, 2), (1, None, 1)])
def test_auto_threads_are_the_affinity_mask_capped_by_the_quota_s_whole_cores(cores, quota, expected):
    assert auto_threads(cores, quota) == expected


def test_auto_threads_read_a_narrowed_affinity_mask_and_a_quota(monkeypatch, tmp_path):
    root, self_cgroup = fake_cgroup_v2(tmp_path, {"kubepods/pod1/ctr": "200000 100000"})
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(threads_mod, "CGROUP_ROOT", root)
    monkeypatch.setattr(threads_mod, "PROC_SELF_CGROUP", self_cgroup)
    assert auto_threads(quota=cgroup_cpu_quota(root, self_cgroup)) == 2
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert auto_threads(quota=cgroup_cpu_quota(root, self_cgroup)) == 1


def test_the_tuner_drops_a_thread_per_window_while_they_wait_for_cores_down_to_one():
    tuner = ThreadTuner(max_threads=4, threads=4, probe_s=1000.0)
    assert [tuner.observe(2.0, 100.0, 0.4) for _ in range(4)] == [3, 2, 1, None]
    assert tuner.threads == 1


def test_the_tuner_keeps_a_probe_of_one_thread_more_only_when_it_is_faster():
    tuner = ThreadTuner(max_threads=2, threads=1, probe_s=10.0)
    assert tuner.observe(4.0, 100.0, 0.0) is None          # not yet time to probe
    assert tuner.observe(6.0, 100.0, 0.0) == 2             # 10 s at 1 thread: try 2
    assert tuner.observe(2.0, 103.0, 0.0) == 1             # not faster enough: back to 1, next probe 20 s off
    assert tuner.observe(10.0, 100.0, 0.0) is None
    assert tuner.observe(10.0, 100.0, 0.0) == 2
    assert tuner.observe(2.0, 150.0, 0.05) is None         # faster: kept
    assert tuner.threads == 2 and tuner.observe(100.0, 150.0, 0.0) is None   # at its maximum: no probe


def test_a_probe_that_makes_the_threads_wait_is_given_back():
    tuner = ThreadTuner(max_threads=2, threads=1, probe_s=1.0)
    assert tuner.observe(1.0, 100.0, 0.0) == 2
    assert tuner.observe(1.0, 200.0, 0.5) == 1


def test_thread_control_under_auto_logs_its_count_and_each_change(monkeypatch, caplog):
    monkeypatch.setattr(threads_mod, "affinity_cores", lambda: 2)
    monkeypatch.setattr(threads_mod, "cgroup_cpu_quota", lambda: None)
    waits = iter([(0, 0), (1000, 1000), (2000, 2000)])   # half the runnable time waiting
    monkeypatch.setattr(threads_mod, "run_queue_wait", lambda: next(waits))
    applied = []
    monkeypatch.setattr(threads_mod, "apply_threads", applied.append)
    monkeypatch.setattr(ThreadControl, "WINDOW_S", 0.0)
    with caplog.at_level(logging.INFO, logger="lmi_handler.engine.threads"):
        control = ThreadControl(0)
        with control.measure(64):
            pass
    assert applied == [2, 1]
    assert "num_threads=auto: 2 threads" in caplog.text and "2 -> 1 threads" in caplog.text


def test_an_explicit_thread_count_stays_fixed(monkeypatch):
    applied = []
    monkeypatch.setattr(threads_mod, "apply_threads", applied.append)
    control = ThreadControl(3)
    for _ in range(3):
        with control.measure(64):
            pass
    assert applied == [3] and control.tuner is None


def test_apply_threads_sets_torch_s_threads_and_the_kernels_pool():
    from lmi_handler.engine.model.kernels import cpu_kernels

    module = cpu_kernels()
    before, setting = torch.get_num_threads(), module.set_threads(0)
    try:
        threads_mod.apply_threads(3)
        assert torch.get_num_threads() == 3 and module.threads() == 3
    finally:
        torch.set_num_threads(before)
        module.set_threads(setting)
