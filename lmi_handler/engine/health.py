"""Engine health: whether the engine can still generate at all, and which errors mean it cannot.

Owns EngineHealth (the dead-or-alive state, set once), EngineDead (what a dead engine raises) and
fatal_reason (errors no later step recovers from). Deciding from a failed step is StepGuard's
(engine/faults.py rules 4 and 5); what a dead engine means to clients is the front end's.
"""
from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


# Error texts of CUDA's sticky errors (the context is unusable until the process exits) and of collective
# communication gone wrong. Recoverable CUDA errors (out of memory) do not match; torch raises those as
# torch.OutOfMemoryError, which is never fatal here.
FATAL_MESSAGES = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS_EXECUTION_FAILED",
                  "uncorrectable ECC", "NCCL error")


class EngineDead(RuntimeError):
    """The engine can no longer generate (engine/faults.py rules 4 and 5). Raised by every StepGuard.step from
    then on.

    `reason` says why, for logs and clients; `since` is when it died (time.monotonic() seconds).
    """

    def __init__(self, reason: str, since: float | None = None):
        super().__init__(f"the engine is dead and cannot generate any more: {reason}")
        self.reason = reason
        self.since = time.monotonic() if since is None else since


class EngineFatal(RuntimeError):
    """An error after which the engine can run no step at all (every later step raises it again): not a
    fault of some sequences, so StepGuard never isolates it but raises it, and the server reports itself
    unhealthy (Engine.failure()). Subclasses: parallel/executor.RankFailed.
    fatal_reason counts it as fatal by its type."""


def fatal_reason(exc: BaseException) -> str | None:
    """Why `exc` (or an exception it was raised from) leaves the engine unable to step again; None if it does not.

    Fatal: EngineFatal (a tensor-parallel rank failed: parallel/executor.RankFailed), torch.AcceleratorError
    (CUDA errors, torch >= 2.8), torch.distributed's DistError family (a
    tensor-parallel rank or its store gone), and any error whose text names a sticky CUDA error
    (FATAL_MESSAGES; older torch raises those as plain RuntimeError). torch.OutOfMemoryError is not fatal.
    """
    fatal_types = tuple(t for t in (EngineFatal, getattr(torch, "AcceleratorError", None), _dist_error())
                        if t is not None)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, torch.OutOfMemoryError):
            text = str(exc)
            if isinstance(exc, fatal_types) or any(marker in text for marker in FATAL_MESSAGES):
                return f"{type(exc).__name__}: {text}"
        exc = exc.__cause__ or exc.__context__
    return None


def _dist_error() -> type | None:
    try:
        from torch.distributed import DistError
    except ImportError:     # torch built without distributed support
        return None
    return DistError


class EngineHealth:
    """Whether the engine can still generate. Set dead once and never cleared: a dead engine is restarted
    (by the container's supervisor, or DJL's worker recovery), not healed.

    Written by the engine's thread (StepGuard), read by any: `dead` is one attribute, assigned once.
    """

    def __init__(self) -> None:
        self.dead: EngineDead | None = None

    @property
    def alive(self) -> bool:
        return self.dead is None

    def mark_dead(self, reason: str) -> EngineDead:
        """Record the death (the first reason wins); returns an EngineDead to raise."""
        if self.dead is None:
            self.dead = EngineDead(reason)
            logger.critical("%s", self.dead)
        return self.error()

    def error(self) -> EngineDead:
        """A fresh EngineDead for the recorded death, to raise (raising one object again and again would
        chain every traceback onto it). Only once dead."""
        return EngineDead(self.dead.reason, self.dead.since)

    def check(self) -> None:
        """Raise EngineDead if the engine is dead."""
        if self.dead is not None:
            raise self.error()
