"""What a step would make a GPU wait for, found on CPU: DeviceSyncs follows which tensors would live on the
accelerator and records each operation that would block the host on one (shared by tests/engine/test_engine.py
and tests/engine/triton/test_cuda_graphs.py; on a GPU, torch.cuda.set_sync_debug_mode counts the real ones).

On CPU every tensor is a host tensor, so the mode keeps the difference itself: a tensor is a device tensor when
it was marked (on_device), made by .to(device) / a factory given device=, or computed from a device tensor.
It records, with the first of our source lines on the call stack:
- a host read of a device tensor (.tolist(), .item(), .cpu(), .numpy(), bool(), int(), float(), index()): the
  host waits for the queued work;
- an operation whose output size depends on a device tensor's values (nonzero, masked_select, unique, a boolean
  index, repeat_interleave without output_size): torch reads the size back;
- a blocking host-to-device copy (.to(device) or copy_ from a host tensor without non_blocking=True,
  torch.tensor(data, device=device)): torch synchronizes the stream after it.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"}
SIZE_FROM_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "eye", "linspace"}
COPIES_FROM_DATA = {"tensor", "as_tensor"}


@dataclass(frozen=True)
class Sync:
    """One operation that would block the host: why, and the first source line of `where` that called it."""

    why: str
    file: str
    line: int
    function: str


class DeviceSyncs(TorchFunctionMode):
    """A TorchFunctionMode recording Sync events (self.syncs) for operations called from files whose path contains
    one of `where` and none of `skip`; `device` is the device the code under test takes for the accelerator."""

    def __init__(self, device: torch.device, where: tuple[str, ...] = ("/lmi_handler/",), skip: tuple[str, ...] = ()):
        super().__init__()
        self.device, self.where, self.skip = torch.device(device), where, skip
        self.syncs: list[Sync] = []
        self._device_tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def on_device(self, *tensors) -> None:
        """Mark tensors (or nested lists / tuples / dicts of them) as living on the device."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._device_tensors[id(t)] = t

    def is_on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._device_tensors.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        from_device = any(self.is_on_device(t) for t in tree_leaves((args, kwargs)))
        why = self._blocks(name, args, kwargs, from_device)
        if why:
            self._record(why)
        out = func(*args, **kwargs)
        if from_device or self._makes_device_tensor(name, args, kwargs):
            self.on_device(out)
        return out

    def _targets_device(self, args, kwargs) -> bool:
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (torch.device, str))]
        return any(torch.device(t) == self.device for t in targets)

    def _makes_device_tensor(self, name: str, args, kwargs) -> bool:
        if name == "to":
            return self._targets_device(args[1:], kwargs)
        return (name in FACTORIES or name in COPIES_FROM_DATA or name.endswith("_like")) and \
            kwargs.get("device") is not None and torch.device(kwargs["device"]) == self.device

    def _blocks(self, name: str, args, kwargs, from_device: bool) -> str:
        first = args[0] if args else None
        if name in HOST_READS and self.is_on_device(first):
            return f"{name} of a device tensor"
        if from_device and name in SIZE_FROM_VALUES:
            return f"{name}: its output size comes from a device tensor's values"
        if from_device and name == "__getitem__" and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1])):
            return "a boolean index of a device tensor"
        if from_device and name == "repeat_interleave" and "output_size" not in kwargs:
            return "repeat_interleave without output_size on a device tensor"
        blocking = not kwargs.get("non_blocking", False)
        if name == "to" and blocking and not self.is_on_device(first) and self._targets_device(args[1:], kwargs):
            return "a blocking host-to-device copy (.to without non_blocking=True)"
        if name == "copy_" and blocking and self.is_on_device(first) and not self.is_on_device(args[1]):
            return "a blocking host-to-device copy (copy_ without non_blocking=True)"
        if name in COPIES_FROM_DATA and self._makes_device_tensor(name, args, kwargs):
            return f"a blocking host-to-device copy (torch.{name}(data, device=...))"
        return ""

    def _record(self, why: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is None:
            return
        path = frame.f_code.co_filename
        if any(w in path for w in self.where) and not any(s in path for s in self.skip):
            self.syncs.append(Sync(why, path.split("/lmi_handler/")[-1], frame.f_lineno, frame.f_code.co_name))
