"""A follower rank (1 .. degree-1) of a tensor-parallel engine: join, load its shard, replay rank 0's steps.

Owns the follower's main loop: receive a ModelInput, run its shard's forward (joining the collectives
inside it), repeat until Shutdown; leaves start-up on rank 0 and failure reporting to executor.py.
Followers never sample: only rank 0 gets the logits.

Started two ways: spawned by rank 0 (`main`, arguments pickled on stdin), or under LMI's MPI launch from
the init call of handle() on ranks above 0 (`run_follower`, which returns when rank 0 shuts down).
A follower whose step fails writes the error to the store (`error/<rank>`, for rank 0's message) and
exits with code 1, so rank 0 sees it at once instead of waiting out a timeout.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback

import torch

from lmi_handler.engine.parallel.executor import RankContext, Shutdown, WorkerArgs
from lmi_handler.engine.parallel.group import TPGroup, open_store

logger = logging.getLogger(__name__)


def run_follower(args: WorkerArgs) -> None:
    """Join the group as rank args.rank, load the shard, run steps until rank 0 sends Shutdown.

    Raises SystemExit(1) when loading or a step fails (the error is in the store and the log), and
    whatever the store raises when rank 0 is gone before the group is built.
    """
    torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = open_store(args.rendezvous, args.rank)
    store.set(f"joined/{args.rank}", "ok")
    group = TPGroup.join(store, args.rank, args.rendezvous.degree, device, args.rendezvous.timeout_s)
    num_blocks = group.min_int(args.spec.num_blocks_fit(args.rank, args.rendezvous.degree))
    try:
        runner = args.spec.build(RankContext(args.rank, args.rendezvous.degree, device, group), num_blocks)
    except Exception as exc:
        _report(store, "ready", args.rank, exc)
        raise SystemExit(1) from exc
    store.set(f"ready/{args.rank}", "ok")
    logger.info("tensor-parallel rank %d ready on %s", args.rank, device)
    _loop(runner, group, store, args.rank, device)


def _loop(runner, group: TPGroup, store, rank: int, device: torch.device) -> None:
    while True:
        try:
            step = group.broadcast()
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone (its sockets closed): nothing left to serve
            logger.warning("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
            raise SystemExit(1) from None
        if isinstance(step, Shutdown):
            logger.info("tensor-parallel rank %d: shutdown", rank)
            return
        try:
            runner.execute(step if device.type == "cpu" else step.to(device))
        except Exception as exc:
            _report(store, "error", rank, exc)
            raise SystemExit(1) from exc


def _report(store, stage: str, rank: int, exc: BaseException) -> None:
    """Leave `stage/<rank>` = the error text in the store for rank 0, and log the traceback."""
    logger.error("tensor-parallel rank %d failed:\n%s", rank, "".join(traceback.format_exception(exc)))
    try:
        store.set(f"{stage}/{rank}", f"{type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001 - rank 0 may already be gone
        pass


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the spawning process is gone (it was killed: nothing will shut this rank down)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    """A spawned follower: WorkerArgs pickled on stdin (executor.spawn_follower)."""
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    run_follower(args)          # SystemExit(1) on a failure
    os._exit(0)                 # a clean shutdown: skip the teardown of the process groups' threads
