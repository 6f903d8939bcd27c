"""What a step would make a GPU wait for, found on CPU: DeviceSyncs follows which tensors would live on the
accelerator and records each operation that would block the host on one (shared by tests/engine/test_engine.py,
tests/engine/test_cuda_graphs.py, tests/engine/test_lora.py and tests/engine/triton/; on a GPU,
torch.cuda.set_sync_debug_mode counts the real ones).

Which tensors are on the device: on CUDA, the ones whose .device is CUDA. On CPU every tensor is a host tensor, so
the mode keeps the difference itself: a tensor is a device tensor when it was marked (on_device), made by
.to(device) / a factory given device=, or computed from a device tensor (outputs of a host read excepted). What it
cannot see on CPU: a C++ extension's call (its outputs are unmarked; tests turn the CPU-only shortcuts off), and a
device-to-host .to("cpu"), which on CPU is the same call as a no-op .to(device).

It records, with the first source line of lmi_handler on the call stack:
- a host read of a device tensor (.tolist(), .item(), .cpu(), .numpy(), np.asarray, bool(), int(), float(),
  index(), format, `in`, torch.equal / allclose): the host waits for the queued work;
- an operation whose output size depends on a device tensor's values (nonzero, one-argument where,
  masked_select, unique, bincount, a boolean index read or written, repeat_interleave without output_size):
  torch reads the size back;
- a blocking host-to-device copy (.to(device) or copy_ from a host tensor without non_blocking=True, a
  tensor's .new_tensor, torch.tensor(data, device=device)): torch synchronizes the stream after it;
- a device-to-host copy_ into a host tensor (blocking: a wait; non_blocking: the host may read it too early).
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import lmi_handler

HOST_READS = {"tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
              "__format__", "__contains__", "__repr__", "equal", "allclose"}
SIZE_FROM_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "nonzero_static"}
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "eye", "linspace"}
COPIES_FROM_DATA = {"tensor", "as_tensor"}
PACKAGE = str(Path(lmi_handler.__file__).parent) + "/"        # as imported: the form frames carry
TORCH = str(Path(torch.__file__).parent) + "/"


@dataclass(frozen=True)
class Sync:
    """One operation that would block the host: why, and the first source line of lmi_handler that called it
    (`file` relative to the package, e.g. engine/output_processor.py)."""

    why: str
    file: str
    line: int
    function: str


class DeviceSyncs(TorchFunctionMode):
    """A TorchFunctionMode recording Sync events (self.syncs) for operations called from lmi_handler's files,
    those under `skip` (paths relative to the package, e.g. "engine/model/") left out; `device` is the device the
    code under test takes for the accelerator (cpu here, cuda on a GPU)."""

    def __init__(self, device: torch.device, skip: tuple[str, ...] = ()):
        super().__init__()
        self.device, self.skip = torch.device(device), skip
        self.syncs: list[Sync] = []
        self._device_tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def on_device(self, *tensors) -> None:
        """Mark tensors (or nested lists / tuples / dicts of them) as living on the device."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._device_tensors[id(t)] = t

    def is_on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device.type != "cpu":
            return t.device.type == self.device.type
        return self._device_tensors.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        from_device = any(self.is_on_device(t) for t in tree_leaves((args, kwargs)))
        why = self._blocks(name, args, kwargs, from_device)
        if why:
            self._record(why)
        out = func(*args, **kwargs)
        if name not in HOST_READS and (from_device or self._makes_device_tensor(name, args, kwargs)):
            self.on_device(out)
        return out

    def _is_device(self, target) -> bool:
        """Whether `target` (a torch.device or a device string) names the accelerator: the same type, and the
        same index where both give one (cuda is cuda:0 when that is the current device)."""
        target = torch.device(target)
        if target.type != self.device.type:
            return False
        return target.index is None or self.device.index is None or target.index == self.device.index

    def _targets_device(self, args, kwargs) -> bool:
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (torch.device, str))]
        return any(self._is_device(t) for t in targets) or any(self.is_on_device(a) for a in args)

    def _makes_device_tensor(self, name: str, args, kwargs) -> bool:
        if name == "to":
            return self._targets_device(args[1:], kwargs)
        return (name in FACTORIES or name in COPIES_FROM_DATA or name.endswith("_like")) and \
            kwargs.get("device") is not None and self._is_device(kwargs["device"])

    def _blocks(self, name: str, args, kwargs, from_device: bool) -> str:
        first = args[0] if args else None
        if name in HOST_READS and any(self.is_on_device(t) for t in tree_leaves(args)):
            return f"{name} of a device tensor"
        if not from_device:
            return self._blocking_copy(name, args, kwargs)
        if name in SIZE_FROM_VALUES or (name == "where" and len(args) == 1 and not kwargs):
            return f"{name}: its output size comes from a device tensor's values"
        if name == "bincount":             # max(input) + 1 bins, minlength or not
            return "bincount: its output size comes from a device tensor's values"
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1 and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1])):
            return f"a boolean index of a device tensor ({name})"
        if name == "repeat_interleave" and "output_size" not in kwargs:
            return "repeat_interleave without output_size on a device tensor"
        if name == "copy_" and not self.is_on_device(first):
            return "a device-to-host copy_ (the host waits, or with non_blocking may read it early)"
        if name == "new_tensor" and self.is_on_device(first):
            return "a blocking host-to-device copy (new_tensor)"
        return self._blocking_copy(name, args, kwargs)

    def _blocking_copy(self, name: str, args, kwargs) -> str:
        first = args[0] if args else None
        blocking = not kwargs.get("non_blocking", False)
        if name == "to" and blocking and not self.is_on_device(first) and self._targets_device(args[1:], kwargs):
            return "a blocking host-to-device copy (.to without non_blocking=True)"
        if name == "copy_" and blocking and self.is_on_device(first) and not self.is_on_device(args[1]):
            return "a blocking host-to-device copy (copy_ without non_blocking=True)"
        if name in COPIES_FROM_DATA and self._makes_device_tensor(name, args, kwargs):
            return f"a blocking host-to-device copy (torch.{name}(data, device=...))"
        return ""

    def _record(self, why: str) -> None:
        """Record `why` against the operation's caller: the first frame outside torch and this file. Calls made
        by other libraries (Triton's interpreter reading its arguments, a test's own checks) are not ours."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith((TORCH, __file__)):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        path = frame.f_code.co_filename[len(PACKAGE):]
        if not path.startswith(self.skip):
            self.syncs.append(Sync(why, path, frame.f_lineno, frame.f_code.co_name))
