"""The offline phases' driver: long-lived engine workers take turns running the workload, in rounds.

Owns starting the offline workers (ours, vLLM), the order of the rounds, what the machine was doing
in each, and each worker's time limit. The workers' side of the protocol is round_protocol.py;
turning rounds into ratios is report.py's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from monitor import PhaseMonitor, RoundWatch, machine_snapshot
from round_protocol import READY, headline, round_file
from workload import REPO


class WorkerFailed(Exception):
    """A worker exited, ran out of time or left no result; the message says which and where its log is."""


def log_tail(path: Path, chars: int = 2500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class OfflineWorker:
    """One long-lived offline worker process (workers.py ours-offline or vllm_worker.py).

    `cmd` is the worker's command line without `--control-dir` and `--out`, which are added here
    (under `tmp`, named after `name`; its stdout and stderr go to `tmp/<name>.log`). `time_limit_s`
    bounds the time this worker keeps the driver waiting (start-up and warm-up, its own rounds, the
    batch-1 run at "finish"), not the rounds it sits idle through; past it, its process group is killed.
    Peak RSS of its process tree is sampled over its whole life.
    """

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], tmp: Path, time_limit_s: float):
        self.name, self.env, self.time_limit_s = name, env, time_limit_s
        self.control_dir = tmp / f"{name}-rounds"
        self.out, self.log = tmp / f"{name}.json", tmp / f"{name}.log"
        self.cmd = [*cmd, "--control-dir", str(self.control_dir), "--out", str(self.out)]
        self.busy_s = 0.0
        self.proc: subprocess.Popen | None = None
        self._killed = False
        self.monitor: PhaseMonitor | None = None

    def start(self) -> dict:
        """Start the worker and wait until it is warmed up; returns its ready.json. Raises WorkerFailed."""
        self.control_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log_file:
            try:  # own process group: a timeout kills vLLM's engine-core children with it
                self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=log_file,
                                             stderr=subprocess.STDOUT, env=self.env, cwd=REPO, text=True,
                                             start_new_session=True)
            except OSError as exc:
                raise WorkerFailed(f"cannot start {self.cmd[0]}: {exc}") from None
        self.monitor = PhaseMonitor(self.proc.pid).start()
        return self._wait_for(READY, "it was ready")

    def run_round(self, k: int) -> dict:
        """Have the worker run the workload once (round `k`); returns its round-k.json. Raises WorkerFailed."""
        self._send(f"run {k}")
        return self._wait_for(round_file(k), f"round {k} ended")

    def finish(self) -> dict:
        """Batch-1 decode, the final JSON, the exit; returns that JSON with "monitor". Raises WorkerFailed."""
        self._send("finish")
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited meanwhile: its exit code says how
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout=max(self.time_limit_s - self.busy_s, 0.0))
        except subprocess.TimeoutExpired:
            self.kill()
            raise WorkerFailed(f"timed out after {self.time_limit_s} s busy, at batch-1; log {self.log}") from None
        finally:
            self.busy_s += time.monotonic() - start
        self.kill()  # anything its exit left behind in its group
        if rc != 0 or not self.out.exists():
            raise WorkerFailed(f"exit code {rc}; log {self.log}:\n{log_tail(self.log)}")
        result = json.loads(self.out.read_text())
        result["monitor"] = self.monitor.result()
        return result

    def kill(self) -> None:
        """SIGKILL the worker's process group (what is left of it) and stop its memory sampling.

        Only the first call signals: once the group is gone its id may be reused by someone else's.
        """
        if self.proc is not None and not self._killed:
            self._killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.monitor is not None:
            self.monitor.stop()

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise WorkerFailed(f"exited ({self.proc.poll()}) before {line!r}; log {self.log}:\n"
                               f"{log_tail(self.log)}") from None

    def _wait_for(self, name: str, what: str) -> dict:
        path, start = self.control_dir / name, time.monotonic()
        try:
            while not path.exists():
                if self.proc.poll() is not None:
                    raise WorkerFailed(f"exit code {self.proc.returncode} before {what}; log {self.log}:\n"
                                       f"{log_tail(self.log)}")
                if self.busy_s + time.monotonic() - start > self.time_limit_s:
                    self.kill()
                    raise WorkerFailed(f"timed out after {self.time_limit_s} s busy, before {what}; log {self.log}")
                time.sleep(0.05)
        finally:
            self.busy_s += time.monotonic() - start
        return json.loads(path.read_text())


def run_rounds(workers: list[OfflineWorker], num_rounds: int, snapshot_s: float = 1.0,
               log=print) -> dict[str, dict]:
    """Start the workers one after the other (start-ups never overlap), then `num_rounds` rounds in which
    each live worker runs the workload once while the others wait on their stdin, the order rotating
    every round (two workers: A, B; B, A; ...), so a slow drift of the machine cancels; then each one's
    batch-1 and exit.

    Before each turn the machine snapshot (`snapshot_s` s: load, other processes' cores, steal), and
    over it a RoundWatch (steal, the running engine's, the idle peers' and other processes' cores), go
    into that round's record as "machine". A worker that fails is killed and recorded as skipped; the
    others go on. Returns {worker name: its final JSON, or {"skipped": why}}.
    """
    rounds = _Rounds(snapshot_s, log)
    try:
        for worker in workers:
            rounds.start(worker)
        for k in range(1, num_rounds + 1):
            shift = (k - 1) % max(len(rounds.live), 1)
            order = rounds.live[shift:] + rounds.live[:shift]
            for position, worker in enumerate(order, 1):
                rounds.turn(worker, k, num_rounds, position, [w.name for w in order])
        for worker in list(rounds.live):
            rounds.finish(worker)
    finally:
        for worker in workers:
            worker.kill()
    return rounds.results


class _Rounds:
    """run_rounds' state: the live workers, each one's machine record per round, the results so far."""

    def __init__(self, snapshot_s: float, log):
        self.snapshot_s, self.log = snapshot_s, log
        self.live: list[OfflineWorker] = []
        self.machine: dict[str, dict[int, dict]] = {}
        self.results: dict[str, dict] = {}

    def start(self, worker: OfflineWorker) -> None:
        self.log(f"[{time.strftime('%H:%M:%S')}] {worker.name}: starting (rounds worker) ...")
        try:
            ready = worker.start()
        except Exception as exc:  # noqa: BLE001 - one worker's failure must not lose the others' results
            self._fail(worker, exc, "at start-up")
            return
        if "refused" in ready:  # the engine would not start with these options: not a failure of the run
            worker.kill()
            self.results[worker.name] = {"skipped": ready["refused"]}
            self.log(f"    {worker.name}: refused at start-up: {ready['refused'][:400]}")
            return
        self.live.append(worker)
        self.machine[worker.name] = {}
        self.log(f"    {worker.name}: ready ({', '.join(f'{k} {v:.1f}' for k, v in ready.items())})")

    def turn(self, worker: OfflineWorker, k: int, num_rounds: int, position: int, order: list[str]) -> None:
        """`worker` runs round `k` while the other live workers wait; its machine record is kept."""
        if worker not in self.live:  # failed earlier in this round
            return
        record = {"position": position, "order": order, "before": machine_snapshot(self.snapshot_s)}
        try:
            with RoundWatch(worker.proc.pid, [w.proc.pid for w in self.live if w is not worker]) as watch:
                result = worker.run_round(k)
        except Exception as exc:  # noqa: BLE001 - as in start
            self._fail(worker, exc, f"in round {k}")
            return
        record["during"] = watch.result()
        self.machine[worker.name][k] = record
        self.log(f"    round {k}/{num_rounds} {worker.name}: {headline(result)}; {describe(record)}")

    def finish(self, worker: OfflineWorker) -> None:
        try:
            result = worker.finish()
        except Exception as exc:  # noqa: BLE001 - as in start
            self._fail(worker, exc, "at finish (batch-1)")
            return
        for rnd in result.get("rounds", []):
            rnd["machine"] = self.machine[worker.name].get(rnd["round"])
        result["phase_s"] = result["monitor"]["wall_s"]
        self.results[worker.name] = result

    def _fail(self, worker: OfflineWorker, exc: Exception, when: str) -> None:
        worker.kill()
        if worker in self.live:
            self.live.remove(worker)
        why = str(exc) if isinstance(exc, WorkerFailed) else f"{type(exc).__name__}: {exc}"
        self.results[worker.name] = {"skipped": f"failed {when}: {why}"}
        self.log(f"    {worker.name}: failed {when}: {why[:400]}")


def describe(record: dict) -> str:
    """One round's machine record in a few words, for progress output."""
    during = record["during"]
    steal, peer = during["steal_fraction"], during["idle_peer_cpu_cores_busy"]
    return (f"steal {'–' if steal is None else f'{100 * steal:.1f} %'}, "
            f"load {record['before']['loadavg_1_5_15'][0]:.2f}, other processes {during['other_cpu_cores_busy']:.2f} "
            f"cores, idle peer {'–' if peer is None else f'{peer:.2f}'}")
