"""Tensor-parallel machinery (engine/parallel/executor.py, group.py, worker.py) with real follower processes
over gloo on the loopback: each step broadcast, the fixed-order all-reduce, logits gathered to rank 0, and a
rank that dies, hangs or fails ending the engine with RankFailed within the timeout (tests/engine/parallel/helpers.py
is the sharded model). Ranks run 1 thread each (2 cores here, 3 ranks)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from lmi_handler.config import ConfigError, MpiLaunch
from lmi_handler.engine.parallel.executor import RankFailed, start_tensor_parallel, threads_per_rank
from tests.engine.parallel.helpers import FAULT_TOKEN, ToySpec, build_toy_checkpoint, single_rank, toy_input

CPU = torch.device("cpu")
PROMPTS = [[1, 17, 300, 45, 9], [1, 250], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 499]]
STEP_TIMEOUT_S = 4.0

pytestmark = pytest.mark.slow   # spawns follower processes (each imports torch: seconds on 2 busy cores)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> str:
    return build_toy_checkpoint(tmp_path_factory.mktemp("tiny_tp_toy"))


@pytest.fixture
def threads():
    """start_tensor_parallel sets this process's torch threads (per rank): put them back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def start(spec: ToySpec, degree: int, timeout_s: float = STEP_TIMEOUT_S):
    return start_tensor_parallel(spec, degree, CPU, timeout_s=timeout_s, num_threads=1)


@pytest.fixture(scope="module")
def tp3(toy_dir):
    before = torch.get_num_threads()
    executor = start(ToySpec(toy_dir), 3, timeout_s=60.0)
    yield executor
    executor.close()
    torch.set_num_threads(before)


def test_rank_0_gets_the_logits_of_the_whole_vocabulary_close_to_one_rank(tp3, toy_dir):
    step = toy_input(PROMPTS)
    sharded = tp3.execute(step).logits
    whole = single_rank(ToySpec(toy_dir)).execute(step).logits
    assert sharded.shape == whole.shape == (3, 600)
    # the sharded sum adds the down_proj partial sums in another order than one rank's dot products
    torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(sharded.argmax(-1), whole.argmax(-1))
    assert tp3.num_blocks == 100 and tp3.degree == 3          # the smallest of the ranks' KV capacities


def test_a_rows_logits_are_bitwise_the_same_alone_and_in_any_batch_at_degree_3(tp3):
    alone = [tp3.execute(toy_input([p])).logits[0] for p in PROMPTS]
    batched = tp3.execute(toy_input(PROMPTS)).logits
    reordered = tp3.execute(toy_input(PROMPTS[::-1] + [[7] * 40])).logits
    for i in range(3):
        assert torch.equal(alone[i], batched[i])
        assert torch.equal(alone[i], reordered[2 - i])


def test_the_ordered_all_reduce_gives_every_rank_the_same_bits(tp3):
    runner = tp3.runner
    runner.digests.clear()
    for prompts in (PROMPTS, [[3, 4]], [[9] * 33, [2]]):
        tp3.execute(toy_input(prompts))
    assert len(runner.digests) == 3
    assert all(len(set(d)) == 1 for d in runner.digests), runner.digests


def test_a_degree_the_model_cannot_take_is_refused_before_any_process_starts(toy_dir):
    with pytest.raises(ConfigError, match=r"Total number of attention heads \(6\) must be divisible by tensor "
                                          r"parallel size \(4\)"):
        start(ToySpec(toy_dir), 4)


def test_threads_per_rank_split_the_usable_cores():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores and threads_per_rank(cores * 2) == 1 and threads_per_rank(3, 5) == 5


def test_close_ends_the_followers_cleanly(toy_dir, threads):
    executor = start(ToySpec(toy_dir), 2)
    executor.execute(toy_input(PROMPTS))
    executor.close()
    assert [p.returncode for p in executor.followers.values()] == [0]
    assert executor.failure() is None


def test_a_killed_follower_fails_the_engine_at_once_naming_it(toy_dir, threads):
    executor = start(ToySpec(toy_dir), 3)
    executor.execute(toy_input(PROMPTS))
    os.kill(executor.followers[2].pid, signal.SIGKILL)
    executor.followers[2].wait()
    failure = executor.failure()            # no step needed: health sees it
    assert isinstance(failure, RankFailed) and failure.rank == 2
    assert "rank 2" in str(failure) and "SIGKILL" in str(failure)
    for _ in range(2):                      # and the engine stays failed
        with pytest.raises(RankFailed, match="rank 2"):
            executor.execute(toy_input(PROMPTS))
    assert all(p.poll() is not None for p in executor.followers.values())   # the rest were ended too
    executor.close()


def test_a_follower_that_dies_mid_step_fails_the_step_at_once(toy_dir, threads):
    executor = start(ToySpec(toy_dir, fault=(1, "exit")), 2)
    began = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        executor.execute(toy_input([[1, 2, FAULT_TOKEN]]))
    assert failed.value.rank == 1 and "exited with code 3" in str(failed.value)
    assert time.monotonic() - began < STEP_TIMEOUT_S          # seen from its closed sockets, not a timeout
    executor.close()


def test_a_follower_that_hangs_fails_the_step_after_the_timeout(toy_dir, threads):
    executor = start(ToySpec(toy_dir, fault=(1, "hang")), 2)
    began = time.monotonic()
    with pytest.raises(RankFailed, match="died or hung past the step timeout") as failed:
        executor.execute(toy_input([[1, 2, FAULT_TOKEN]]))
    waited = time.monotonic() - began
    assert failed.value.rank is None and STEP_TIMEOUT_S * 0.9 < waited < STEP_TIMEOUT_S + 5
    assert executor.followers[1].poll() is not None            # the hung rank was ended
    executor.close()


def test_a_follower_whose_step_raises_reports_its_error_to_rank_0(toy_dir, threads):
    executor = start(ToySpec(toy_dir, fault=(1, "raise")), 2)
    with pytest.raises(RankFailed, match=r"rank 1 .*RuntimeError: toy fault on rank 1") as failed:
        executor.execute(toy_input([[1, FAULT_TOKEN]]))     # seen as its exit (code 1), or its report before it
    assert failed.value.rank == 1
    executor.close()


def test_a_follower_that_cannot_load_its_shard_fails_the_start_with_its_error(toy_dir, threads):
    with pytest.raises(RankFailed, match=r"rank 2 failed to start: MemoryError: toy shard of rank 2 does not fit"):
        start(ToySpec(toy_dir, fail_build_rank=2), 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_an_mpi_launch_a_follower_meets_rank_0_at_master_port(toy_dir, threads):
    """Followers started by mpirun (not spawned here) meet rank 0 at MASTER_ADDR:MASTER_PORT."""
    port = _free_port()
    mpi = MpiLaunch(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port)
    started: dict = {}
    rank0 = threading.Thread(target=lambda: started.update(executor=start_tensor_parallel(
        ToySpec(toy_dir), 2, CPU, STEP_TIMEOUT_S, num_threads=1, mpi=mpi)))
    rank0.start()
    while True:     # as under mpirun the follower may come first, but its store client then backs off for long
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    follower = subprocess.Popen([sys.executable, "-c", (
        "from lmi_handler.engine.parallel.executor import WorkerArgs\n"
        "from lmi_handler.engine.parallel.group import Rendezvous\n"
        "from lmi_handler.engine.parallel.worker import run_follower\n"
        "from tests.engine.parallel.helpers import ToySpec\n"
        f"run_follower(WorkerArgs(1, Rendezvous('127.0.0.1', {port}, 2, {STEP_TIMEOUT_S}, 120.0), "
        f"ToySpec({toy_dir!r}), 'cpu', 1))\n")])
    try:
        rank0.join(timeout=120)
        executor = started["executor"]
        assert executor.followers == {}
        step = toy_input(PROMPTS)
        torch.testing.assert_close(executor.execute(step).logits, single_rank(ToySpec(toy_dir)).execute(step).logits,
                                   rtol=1e-5, atol=1e-5)
        executor.close()
        assert follower.wait(timeout=60) == 0       # run_follower returned on Shutdown
    finally:
        follower.kill()
