"""A batch file over the replicas of a Ray cluster: `lmi-handler batch IN -o OUT --ray` (the optional `ray` extra).

Owns the driver (shards handed to replicas, a lost shard recomputed, finished shards saved and merged, the
progress bar over all replicas), the replica actor (one engine, the runner's line loop) and joining or starting
the cluster. The cut and the shard files are shards.py's; the lines and their records are the single-process
runner's (runner.BatchRunner.run_items, lines.py), so both give the same records.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmi_handler.batch.lines import Record
from lmi_handler.batch.results import ResultFiles
from lmi_handler.batch.runner import BatchSummary, EngineFailed, Progress, check_file, resuming
from lmi_handler.batch.shards import Shard, ShardFiles, cut_shards, merge_records
from lmi_handler.batch.tally import Tally
from lmi_handler.config import REPLICA_LOOPBACK_ENV, Settings, keep_ray_on_loopback
from lmi_handler.protocol.batch_lines import BatchDefaults, check_lines

logger = logging.getLogger(__name__)

LOCAL = "local"                       # Ray's own word: start a new local cluster for this job
LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 128 << 20        # a local cluster's object store: shards and records are small
MAX_ATTEMPTS = 3                      # runs of one shard (a replica lost each time) before it is given up
POLL_S = 0.5                          # how often the driver refreshes the progress bar
REPORT_S = 0.5                        # how often a replica reports its shard's lines done
# A local cluster shares its machine with whatever else runs there: its workers at normal priority (Ray's
# default nice 15 starves the replicas on a busy host), and no Ray memory monitor (it kills workers when the
# whole machine passes 95 %, whoever uses the memory; the kernel's OOM killer stays).
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0, "memory_monitor_refresh_ms": 0}


@dataclass(frozen=True)
class ClusterPlan:
    """Where and how the replicas run: `address` (LOCAL: a cluster of this job on the loopback; else what
    ray.init takes: "auto", "host:port", "ray://..."), how many replicas, input lines per shard, and the Ray
    resources each replica asks for (a tensor-parallel replica needs its degree's worth)."""

    address: str = LOCAL
    replicas: int = 2
    shard_lines: int = 500
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0

    def __post_init__(self):
        for name, low in (("replicas", 1), ("shard_lines", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError(f"replica_cpus and replica_gpus must be >= 0, got {self.replica_cpus}, "
                             f"{self.replica_gpus}")


class Replica:
    """One engine replica in a Ray actor (the engine's Settings as the driver resolved them, tensor parallelism
    included). Each call runs one shard to its records; an engine that cannot go on ends the process."""

    def __init__(self, settings: Settings):
        from lmi_handler.batch.runner import BatchRunner
        from lmi_handler.service import Service

        self.runner = BatchRunner(Service(settings))

    def ready(self) -> int:
        """This replica's process id, once its engine is up."""
        return os.getpid()

    def run_shard(self, shard: Shard, tally) -> list[Record]:
        """The records of every line in `shard.items` (its lines still without a result), through the runner's
        line loop, reporting the lines done to `tally` (a Tally actor) as it goes. On EngineFailed the process exits: Ray starts a fresh replica and the driver gives this shard
        to a replica again (no retry loop here on an engine that is gone)."""
        records: list[Record] = []
        reported = time.monotonic()

        def write(record: Record) -> None:
            nonlocal reported
            records.append(record)
            if time.monotonic() - reported >= REPORT_S:
                tally.report.remote(shard.name, len(records))
                reported = time.monotonic()

        tally.report.remote(shard.name, 0)
        try:
            self.runner.run_items(shard.items, set(), write)
        except EngineFailed:
            logger.exception("replica %d: the engine cannot go on; exiting so Ray starts a fresh one", os.getpid())
            os._exit(1)
        return records


class ClusterError(RuntimeError):
    """The Ray job cannot go on: a replica cannot start its engine, or a local cluster is not on the loopback."""


class ShardsLost(ClusterError):
    """Some shards lost a replica MAX_ATTEMPTS times; their lines have no result (a rerun tries them again)."""


def run_on_ray(settings: Settings, input_path: Path, output_path: Path, errors_path: Path | None = None,
               defaults: BatchDefaults | None = None, plan: ClusterPlan | None = None,
               progress: bool = True) -> BatchSummary:
    """Run every line of `input_path` without a result yet on `plan.replicas` replicas of a Ray cluster.

    The file is checked and cut into shards before Ray starts; each finished shard's records are saved whole
    (shards.ShardFiles) and merged into `output_path` / `errors_path`, each custom_id once whatever was retried.
    A rerun of the same call after any kill (driver or replica) finishes the file.
    Raises BatchRejected (a line without an output length: nothing runs), ShardsLost (after the other shards
    finished and were merged), ClusterError when a replica cannot start its engine or a local cluster is not
    on the loopback, ImportError without the `ray` extra.
    """
    input_path, defaults, plan = Path(input_path), defaults or BatchDefaults(), plan or ClusterPlan()
    checked = check_file(input_path, defaults)
    started = time.monotonic()
    shard_files = ShardFiles(output_path)
    with ResultFiles(output_path, errors_path) as results:
        shard_files.merge_into(results)            # shards a killed driver saved but had not merged
        already = resuming(results, checked.total)
        bar = Progress(checked.total, already, progress)
        try:
            with open(input_path, encoding="utf-8", errors="replace") as lines:
                shards = cut_shards(check_lines(lines, defaults), plan.shard_lines, set(results.done))
                with _connected(plan):
                    lost = _Driver(settings, plan, shard_files, results, bar).run(shards)
        finally:
            bar.close()
        summary = BatchSummary(checked.total, already, results.num_completed, results.num_failed,
                               bar.output_tokens, time.monotonic() - started)
    if lost:
        named = ", ".join(f"lines {s.first_line}-{s.last_line}" for s in lost)
        raise ShardsLost(f"{len(lost)} shard(s) lost a replica {MAX_ATTEMPTS} times and have no result: {named}; "
                         "the rest is merged into the output. Rerun the same command to try them again.")
    shard_files.clear()
    return summary


class _Driver:
    """Hands shards to idle replicas, one shard each at a time; saves and merges each shard that comes back."""

    def __init__(self, settings: Settings, plan: ClusterPlan, shard_files: ShardFiles, results: ResultFiles,
                 bar: Progress):
        import ray

        self.ray, self.shard_files, self.results, self.bar = ray, shard_files, results, bar
        self.tally = ray.remote(num_cpus=0, max_restarts=-1)(Tally).remote()
        actor = ray.remote(num_cpus=plan.replica_cpus, num_gpus=plan.replica_gpus, max_restarts=-1,
                           max_task_retries=0, runtime_env={"env_vars": dict(REPLICA_LOOPBACK_ENV)})(Replica)
        self.replicas = [actor.remote(settings) for _ in range(plan.replicas)]
        self.attempts: dict[str, int] = {}
        self.done_lines = 0        # lines of the shards finished in this run

    def run(self, shards) -> list[Shard]:
        """Run every shard; returns the shards given up (lost a replica MAX_ATTEMPTS times)."""
        ray = self.ray
        try:
            pids = ray.get([replica.ready.remote() for replica in self.replicas])
        except ray.exceptions.RayError as exc:
            raise ClusterError(f"a replica could not start its engine: {exc}") from None
        logger.info("%d replicas ready (pids %s)", len(pids), pids)
        idle, retry, lost = deque(self.replicas), deque(), []
        running: dict[Any, tuple[Any, Shard]] = {}   # call -> (replica, shard)
        waking: dict[Any, Any] = {}                  # ready() call -> a replica Ray is restarting
        shards, exhausted = iter(shards), False
        while True:
            while idle and not (exhausted and not retry):
                shard = retry.popleft() if retry else next(shards, None)
                if shard is None:
                    exhausted = True
                    break
                replica = idle.popleft()
                running[replica.run_shard.remote(shard, self.tally)] = (replica, shard)
            if not running and not waking:
                if exhausted and not retry:
                    return lost
                if not idle:
                    raise ClusterError("every replica is gone for good; rerun the same command to finish the file")
                continue
            finished, _ = ray.wait(list(running) + list(waking), num_returns=1, timeout=POLL_S)
            for call in finished:
                if call in waking:
                    self._wake(call, waking, idle)
                    continue
                replica, shard = running.pop(call)
                if self._finish(call, shard, retry, lost):
                    idle.append(replica)
                else:     # not given more work until Ray has it back
                    waking[replica.ready.remote()] = replica
            self._show([shard for _, shard in running.values()])

    def _wake(self, call, waking: dict, idle: deque) -> None:
        """A restarting replica's ready() came back: idle again, asked again (still restarting), or gone."""
        ray, replica = self.ray, waking.pop(call)
        try:
            ray.get(call)
        except ray.exceptions.ActorUnavailableError:
            time.sleep(POLL_S)
            waking[replica.ready.remote()] = replica
            return
        except ray.exceptions.RayError as exc:
            logger.warning("a replica is gone for good (%s); going on with the others", _first_line(exc))
            return
        idle.append(replica)

    def _finish(self, call, shard: Shard, retry: deque, lost: list) -> bool:
        """Save and merge a shard that came back; requeue (or give up) one whose replica failed. Returns
        whether the replica can take the next shard at once."""
        ray = self.ray
        try:
            records = ray.get(call)
        except ray.exceptions.RayError as exc:   # the replica died (killed, OOM, engine gone) or the shard raised
            attempts = self.attempts[shard.name] = self.attempts.get(shard.name, 0) + 1
            again = attempts < MAX_ATTEMPTS
            logger.warning("lines %d-%d: attempt %d failed (%s); %s", shard.first_line, shard.last_line, attempts,
                           _first_line(exc), "recomputing the shard" if again else "giving the shard up")
            (retry.append if again else lost.append)(shard)
            return isinstance(exc, ray.exceptions.RayTaskError)   # the shard raised: its replica is fine
        self.shard_files.save(shard, records)          # saved whole first: a kill mid-merge loses nothing
        merge_records(self.results, records)
        self.done_lines += len(records)
        for record in records:
            self.bar.update(record, advance=False)
        return True

    def _show(self, running: list[Shard]) -> None:
        """The bar's count: lines with a result before, of finished shards, and of running shards so far."""
        try:
            counts = self.ray.get(self.tally.counts.remote())
        except self.ray.exceptions.RayError:   # the tally's process was lost (Ray restarts it): counts start over
            counts = {}
        self.bar.show(self.done_lines + sum(counts.get(shard.name, 0) for shard in running))


class _connected:
    """ray.init for the job and ray.shutdown after it. LOCAL starts a cluster of this job's own: node address
    127.0.0.1 (RAY_LOOPBACK_SWITCH), no dashboard, a small object store, CPUs (and GPUs) for the replicas."""

    def __init__(self, plan: ClusterPlan):
        self.plan = plan

    def __enter__(self):
        plan = self.plan
        if plan.address != LOCAL:
            if _is_loopback(plan.address):   # else Ray turns 127.0.0.1 into this machine's outward address
                keep_ray_on_loopback()
            import ray

            ray.init(address=plan.address, log_to_driver=True)
            return self
        keep_ray_on_loopback()
        import ray

        ray.init(address=LOCAL, _node_ip_address=LOOPBACK, include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, num_cpus=max(1, round(plan.replicas * plan.replica_cpus)),
                 num_gpus=plan.replicas * plan.replica_gpus, log_to_driver=True,
                 _system_config=LOCAL_SYSTEM_CONFIG)
        node = ray.util.get_node_ip_address()
        if node != LOOPBACK:
            ray.shutdown()
            raise ClusterError(f"the local Ray cluster took {node}, not {LOOPBACK}: `ray` was imported before "
                               "lmi_handler could keep it on the loopback; start a cluster with `ray start --head` "
                               "and pass its address instead")
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
