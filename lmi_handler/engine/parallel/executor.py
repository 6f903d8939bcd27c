"""Rank 0 of a tensor-parallel engine: start the follower ranks, broadcast each step to them, fail clearly.

Owns the start-up sequence (spawned followers, or LMI's MPI launch), TensorParallelExecutor (the model
runner the engine sees: each step broadcasts the ModelInput, then runs rank 0's shard) and RankFailed;
leaves the collectives to group.py, the followers' loop to worker.py and the shard's forward to the runner.

Start-up, every rank (rank 0 in the handle() process, followers spawned by it or launched by mpirun):

    rank 0: check the degree -> host the store -> spawn ranks 1.. -> wait for "joined/r" of each
    all:    build the groups -> min over ranks of the KV blocks each can hold -> load the shard
    rank 0: wait for "ready/r" of each (ok, or the error text of the rank that failed to load)

A follower that exits is seen at once (its process is polled, its sockets close); one that hangs is
seen after the step timeout. Either way the engine fails with RankFailed and stays failed.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from lmi_handler.engine.health import EngineFatal
from lmi_handler.engine.parallel.group import LOOPBACK, Rendezvous, TPGroup, open_store

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")

START_TIMEOUT_S = 600.0   # joining and loading the shards (a large checkpoint read from disk)
POLL_S = 0.05


class RankFailed(EngineFatal):
    """A tensor-parallel rank died, hung past the step timeout, or failed mid-step: the engine cannot go on.

    Engine-fatal (health.EngineFatal), unlike a step fault: StepGuard raises it without isolating anything,
    the rolling batch fails every running request with its message, and every later step raises it again
    (TensorParallelExecutor.failure() returns it for health checks: /ping and TGI's /health answer 503).
    The ranks are not restarted: restart the server (or let its orchestrator replace it).
    `rank` is the rank at fault when known (None: the group stopped answering and no rank could be named).
    """

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Shutdown:
    """The message that ends the followers' loop (rank 0 closing)."""


@dataclass(frozen=True)
class RankContext:
    """What a rank's runner is built with: its place in the group, its device, the group's collectives."""

    rank: int
    degree: int
    device: torch.device
    group: TPGroup


class RunnerSpec(Protocol):
    """How every rank builds its shard's runner (picklable: it travels to the followers).

    The runner built has ModelRunner's interface (`execute(ModelInput)`, and on rank 0 `config`, `dtype`,
    `device`, `block_size`, `num_blocks`, `prepare_host`); its forward calls the group's collectives, and its
    logits (gathered to rank 0) are only meaningful on rank 0.
    """

    def check(self, degree: int, device: torch.device = CPU) -> None:
        """Refuse a degree the model cannot be split by, or shards `device` (rank 0's) cannot run (raises
        ConfigError); rank 0, before any spawn."""

    def num_blocks_fit(self, rank: int, degree: int) -> int:
        """The KV-cache blocks this rank's share of memory holds (the engine uses the minimum)."""

    def build(self, context: RankContext, num_blocks: int):
        """Load this rank's shard and allocate `num_blocks` KV blocks of its own heads; returns the runner."""


@dataclass(frozen=True)
class WorkerArgs:
    """A spawned or MPI-launched follower's start-up arguments (pickled to its stdin when spawned)."""

    rank: int
    rendezvous: Rendezvous
    spec: RunnerSpec
    device: str
    num_threads: int
    parent_pid: int | None = None   # spawned: exit when this process is gone


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as torch's default thread count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux: every core
        return os.cpu_count() or 1


def threads_per_rank(degree: int, num_threads: int = 0) -> int:
    """option.num_threads when set (per rank), else usable cores / degree, at least 1."""
    return num_threads if num_threads > 0 else max(1, usable_cores() // degree)


def resolve_degree(value: int | str) -> int:
    """option.tensor_parallel_degree as a count: `max` = every visible CUDA device, 1 on a CPU-only host
    (LMI's rule); an int is itself."""
    if value == "max":
        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    return int(value)


def rank_devices(degree: int, device: torch.device) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or cuda:(index + r). Raises ValueError when too few GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return [device] * degree
    first = device.index or 0
    if first + degree > torch.cuda.device_count():
        raise ValueError(f"option.tensor_parallel_degree={degree} needs CUDA devices {first}..{first + degree - 1}, "
                         f"but {torch.cuda.device_count()} are visible")
    return [torch.device("cuda", first + r) for r in range(degree)]


class TensorParallelExecutor:
    """The runner the engine sees under tensor parallelism (rank 0): ModelRunner's interface over rank 0's
    shard; `execute` broadcasts the step to the followers first, so every rank runs the same forward.

    Raises RankFailed from `execute` once any rank failed (and ever after); `failure()` says so without
    running a step. `close()` ends the followers (also at interpreter exit).
    """

    kernel_backend = "cpp"  # shards run only on the cpp backend, either form (backend.choose_backend)
    applies_lora = False    # a shard holds a slice of each projection's input; the LoRA term needs all of it

    def __init__(self, runner, group: TPGroup, store, followers: dict[int, subprocess.Popen]):
        self.runner, self.group, self.store, self.followers = runner, group, store, followers
        self._failure: RankFailed | None = None
        self._closed = False

    # ---- ModelRunner's interface ------------------------------------------------------------------

    @property
    def config(self):
        return self.runner.config

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def degree(self) -> int:
        return self.group.degree

    def prepare(self, sched):
        """The step's ModelInput on the CPU (runner.prepare_host), as the broadcast sends it; `execute` moves
        rank 0's copy to its device, so a CUDA step is never copied back to the host to be broadcast."""
        return self.runner.prepare_host(sched)

    def execute(self, model_input):
        """Broadcast the step (a ModelInput on the CPU, from `prepare`) to the followers, run rank 0's shard
        on its device, return its ModelOutput. Raises RankFailed (the group is gone; the engine cannot go on)."""
        failure = self.failure()
        if failure is not None:
            raise failure
        try:
            self.group.broadcast(model_input)
            device = self.runner.device
            return self.runner.execute(model_input if device.type == "cpu" else model_input.to(device))
        except Exception as exc:
            raise self._fail(exc) from exc

    # ---- health and shutdown -------------------------------------------------------------------------

    def failure(self) -> RankFailed | None:
        """The RankFailed that ended this engine, or None while every rank is alive (spawned followers are
        polled here, so a dead one is seen without running a step). Cheap: one waitpid per follower."""
        if self._failure is None and not self._closed:
            for rank, proc in self.followers.items():
                if proc.poll() is not None:
                    self._failure = RankFailed(self._exit_message(rank, proc), rank)
                    logger.error("tensor parallelism failed: %s", self._failure)
                    self._stop_followers()
                    break
        return self._failure

    def _fail(self, exc: BaseException) -> RankFailed:
        """The RankFailed for a step that raised `exc`: names the follower that died or reported an error
        when there is one (spawned followers are polled; any follower may leave its error in the store)."""
        if self._failure is None:
            deadline = time.monotonic() + 1.0     # a follower failing mid-step: let its exit or report be seen
            while True:
                dead = [(r, p) for r, p in self.followers.items() if p.poll() is not None]
                reported = [(r, e) for r in range(1, self.group.degree) if (e := _reported_error(self.store, r))]
                if dead or reported or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            if dead:
                rank, proc = dead[0]
                self._failure = RankFailed(f"{self._exit_message(rank, proc)}; the step failed with: {exc}", rank)
            elif reported:
                rank, error = reported[0]
                self._failure = RankFailed(f"tensor-parallel rank {rank} failed mid-step: {error}", rank)
            else:
                self._failure = RankFailed(
                    f"the tensor-parallel group failed mid-step (a follower rank died or hung past the step "
                    f"timeout, or rank 0 itself failed; the ranks are out of step): {type(exc).__name__}: {exc}")
            logger.error("tensor parallelism failed: %s", self._failure)
            self._stop_followers()
        return self._failure

    def _exit_message(self, rank: int, proc: subprocess.Popen) -> str:
        code = proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        reported = _reported_error(self.store, rank)
        return (f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
                + (f" after: {reported}" if reported else ""))

    def _stop_followers(self) -> None:
        for proc in self.followers.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.followers.values():
            proc.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the followers: a Shutdown broadcast while the group works, then a kill past `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self.group.broadcast(Shutdown())
            except Exception:  # noqa: BLE001 - a follower already gone: killed below
                logger.warning("tensor parallelism: shutdown broadcast failed; killing the followers")
        deadline = time.monotonic() + timeout_s
        for proc in self.followers.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _reported_error(store, rank: int) -> str | None:
    """The error text a follower left in the store before exiting (worker.py), if any."""
    key = f"error/{rank}"
    try:
        return store.get(key).decode(errors="replace") if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store is a courtesy here
        return None


# ---- start-up ------------------------------------------------------------------------------------------

def start_tensor_parallel(spec: RunnerSpec, degree: int, device: torch.device, timeout_s: float,
                          num_threads: int = 0, mpi=None) -> TensorParallelExecutor:
    """Rank 0's start-up (module docstring): check, spawn (unless `mpi`, an MpiLaunch: the followers were
    started by mpirun and meet at its MASTER_ADDR:MASTER_PORT), join, load; returns the executor.

    Raises: ConfigError (the degree does not fit the model), RankFailed (a follower exited or failed to
    load its shard, or did not join within START_TIMEOUT_S), or whatever building rank 0's shard raised.
    """
    spec.check(degree, device)
    devices = rank_devices(degree, device)
    threads = threads_per_rank(degree, num_threads)
    torch.set_num_threads(threads)
    host, port = (mpi.master_addr, mpi.master_port) if mpi is not None else (LOOPBACK, 0)
    rendezvous = Rendezvous(host, port, degree, timeout_s, START_TIMEOUT_S)
    store = open_store(rendezvous, 0)
    rendezvous = replace(rendezvous, port=store.port)
    followers = {} if mpi is not None else {
        r: spawn_follower(WorkerArgs(r, rendezvous, spec, str(devices[r]), threads, os.getpid())) for r in range(1, degree)}
    try:
        _wait_for(store, "joined", followers, degree)
        group = TPGroup.join(store, 0, degree, devices[0], timeout_s)
        num_blocks = group.min_int(spec.num_blocks_fit(0, degree))
        runner = spec.build(RankContext(0, degree, devices[0], group), num_blocks)
        _wait_for(store, "ready", followers, degree)
    except BaseException:
        for proc in followers.values():
            proc.kill()
        raise
    logger.info("tensor parallelism: %d ranks ready (%d threads each, %d KV blocks)", degree, threads, num_blocks)
    executor = TensorParallelExecutor(runner, group, store, followers)
    import atexit

    atexit.register(executor.close)
    return executor


def spawn_follower(args: WorkerArgs) -> subprocess.Popen:
    """Start rank `args.rank` as `python -c ...` (worker.main) with this process's import path; its
    arguments go pickled to its stdin. Output goes where this process's goes. It runs in a session of its
    own, so a Ctrl-C or SIGTERM to the server's process group leaves it serving while rank 0 drains; it
    ends with rank 0 (Shutdown at close or exit, its sockets closing, or its parent gone)."""
    bootstrap = (f"import sys; sys.path[:0] = {[p or os.getcwd() for p in sys.path]!r}; "
                 "from lmi_handler.engine.parallel.worker import main; main()")
    proc = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.PIPE, start_new_session=True)
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc


def _wait_for(store, stage: str, followers: dict[int, subprocess.Popen], degree: int) -> None:
    """Wait until every follower set `stage/r` in the store ("ok" or its error text). Spawned followers are
    polled meanwhile, so one that exits fails the start at once. Raises RankFailed."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(1, degree))
    while pending:
        for rank in sorted(pending):
            key = f"{stage}/{rank}"
            if store.check([key]):
                value = store.get(key).decode(errors="replace")
                if value != "ok":
                    raise RankFailed(f"tensor-parallel rank {rank} failed to start: {value}", rank)
                pending.discard(rank)
            elif rank in followers and followers[rank].poll() is not None:
                raise RankFailed(f"tensor-parallel rank {rank} (pid {followers[rank].pid}) exited with code "
                                 f"{followers[rank].returncode} before it was {stage}", rank)
        if pending and time.monotonic() > deadline:
            raise RankFailed(f"tensor-parallel ranks {sorted(pending)} were not {stage} within {START_TIMEOUT_S:.0f} s")
        if pending:
            time.sleep(POLL_S)
