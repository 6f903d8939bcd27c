"""Engine health (engine/health.py): which errors leave the engine unable to step again, and the dead state."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.health import EngineDead, EngineHealth, fatal_reason


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
    torch.AcceleratorError("unspecified launch failure"),
    torch.distributed.DistBackendError("rank 1 is gone"),
    torch.distributed.DistStoreError("timed out waiting for the store"),
], ids=lambda e: type(e).__name__ + ":" + str(e)[:24])
def test_sticky_device_errors_and_dead_ranks_are_fatal(exc):
    reason = fatal_reason(exc)
    assert reason is not None and reason.startswith(type(exc).__name__) and str(exc) in reason


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (CUDA error: out of memory)"),
    RuntimeError("shape mismatch"), ValueError("bad value"), IndexError("list index out of range"),
], ids=lambda e: type(e).__name__)
def test_out_of_memory_and_ordinary_bugs_are_not_fatal(exc):
    assert fatal_reason(exc) is None


def test_an_error_raised_from_or_while_handling_a_fatal_one_is_fatal_and_cycles_end():
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as cuda:
            raise KeyError("lost") from cuda
    except KeyError as outer:
        assert "device-side assert" in fatal_reason(outer)
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert fatal_reason(a) is None


def test_health_is_set_dead_once_the_first_reason_wins_and_each_check_raises_a_fresh_error():
    health = EngineHealth()
    health.check()
    assert health.alive and health.dead is None
    first = health.mark_dead("CUDA error")
    assert isinstance(first, EngineDead) and not health.alive
    health.mark_dead("a later reason")
    errors = []
    for _ in range(2):
        with pytest.raises(EngineDead) as raised:
            health.check()
        errors.append(raised.value)
    assert errors[0] is not errors[1]          # no traceback chained onto one object over hours
    assert all(e.reason == "CUDA error" and e.since == health.dead.since for e in errors)
    assert "cannot generate" in str(errors[0]) and "CUDA error" in str(errors[0])
