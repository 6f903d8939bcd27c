"""One rank's view of the tensor-parallel group: joining it, and the collectives a sharded forward needs.

Owns the store the ranks meet at, the process groups (torch.distributed backends: gloo on CPU, NCCL for
tensors on CUDA) and the collectives with their determinism rules; leaves starting processes and failure
handling to executor.py / worker.py.

Two groups over the same ranks, built as standalone backend objects (no torch.distributed global default
group, so one process can hold a group, lose it to a failure, and build another):
- `data` (gloo on CPU, NCCL on CUDA) carries the forward's tensors, with the step timeout: a rank that
  stops answering mid-step makes the others' collective fail after `timeout_s`, never hang; a rank that
  dies makes it fail at once (its sockets close).
- `control` (gloo, CPU) carries the step broadcast and start-up values. Followers wait on it for the next
  step while the server is idle, so its timeout is unbounded; a dead rank 0 still ends their wait at once.
Both bind to 127.0.0.1 (one machine: the same as GLOO_SOCKET_IFNAME=lo with MASTER_ADDR=127.0.0.1).
"""
from __future__ import annotations

import datetime
import io
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=3650)   # the control group: followers wait for steps while idle
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0 hosts a TCPStore at host:port (port 0: rank 0 picks a free one)."""

    host: str
    port: int
    degree: int
    timeout_s: float          # one collective of a step, at most (data group)
    start_timeout_s: float    # store operations: joining, waiting for the shards to load


def open_store(rendezvous: Rendezvous, rank: int) -> dist.TCPStore:
    """Rank 0 hosts the store (on a free port when rendezvous.port is 0: read it from `.port`); the others
    connect to it. Store waits last at most start_timeout_s. Raises DistNetworkError / DistStoreError."""
    timeout = datetime.timedelta(seconds=rendezvous.start_timeout_s)
    if rank == 0:
        return dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.degree, is_master=True,
                             timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.degree, is_master=False, timeout=timeout)


def _gloo(store: dist.Store, prefix: str, rank: int, degree: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, degree, options)


class TPGroup:
    """Rank `rank` of a tensor-parallel group of `degree` ranks: the collectives of a sharded forward.

    Every collective must be called by every rank in the same order (the followers replay rank 0's
    steps, so their forwards make the same calls). Errors: RuntimeError (DistBackendError) when a peer
    died (at once) or did not answer within the step timeout; the group is unusable after one.
    """

    def __init__(self, rank: int, degree: int, device: torch.device, data=None, control=None):
        self.rank, self.degree, self.device = rank, degree, torch.device(device)
        self.data, self.control = data, control

    @classmethod
    def join(cls, store: dist.Store, rank: int, degree: int, device: torch.device, timeout_s: float) -> "TPGroup":
        """Build both groups over `store` (every rank calls it; it returns once all have joined)."""
        device = torch.device(device)
        control = _gloo(store, "control/", rank, degree, IDLE_TIMEOUT)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            data = dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, degree, options)
        else:
            data = _gloo(store, "data/", rank, degree, timeout)
        return cls(rank, degree, device, data=data, control=control)

    # ---- the forward's collectives (data group) --------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, added in rank order: ((x_0 + x_1) + x_2) + ...

        Each rank gathers all the parts and adds them itself in that fixed order, so the result is
        bitwise the same on every rank and, the adds being elementwise, a row's sum never depends on the
        other rows (batch invariance holds under TP; a ring or tree all-reduce promises neither).
        x: any shape; returns a new tensor of x's shape and dtype (x itself at degree 1).
        """
        if self.degree == 1:
            return x
        parts = self.all_gather(x)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def gather_rows(self, x: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """Row t of the result is row t of rank owner[t]'s `x` (vocabulary-parallel embedding: each rank
        looked up the ids it holds). An exact copy, no arithmetic. x: (T, H); owner: (T,) int64 on x's
        device; returns (T, H) on every rank."""
        if self.degree == 1:
            return x
        parts = torch.stack(self.all_gather(x))                            # (degree, T, H)
        return parts[owner, torch.arange(x.shape[0], device=x.device)]

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dim, in rank order (vocabulary-parallel
        logits: (R, V / degree) on each rank -> (R, V)); the other ranks get None."""
        if self.degree == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.degree)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.data.gather([parts] if parts else [], [x], options).wait()
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape and dtype on each), in rank order, on every rank."""
        if self.degree == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        self.data.allgather([parts], [x]).wait()
        return parts

    # ---- start-up values and the step broadcast (control group) -----------------------------------

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], options).wait()
        return int(t.item())   # sync: a start-up value, CPU anyway

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` (picklable; tensors on CPU) to every rank; every rank returns it.

        Followers block here until rank 0 sends (no timeout: see the module docstring). Two gloo
        broadcasts: the pickle's length, then its bytes (see `dumps`).
        """
        options = dist.BroadcastOptions()
        options.rootRank = 0
        payload = dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.control.broadcast([size], options).wait()
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                  else torch.empty(int(size.item()), dtype=torch.uint8))
        self.control.broadcast([buffer], options).wait()
        return obj if self.rank == 0 else pickle.loads(buffer.numpy().tobytes())


_NUMPY_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                 torch.float32, torch.float16}


def _tensor_from_numpy(array) -> torch.Tensor:
    return torch.from_numpy(array)


class _StepPickler(pickle.Pickler):
    """Pickles CPU tensors of numpy's dtypes as numpy arrays: a 64-sequence decode ModelInput (8.7 KB) takes
    0.08 ms to dump and 0.05 to load this way, against 0.63 and 0.9-1.5 ms through torch's own tensor
    reduction (measured here, thread CPU time, 1 thread); other tensors keep torch's."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES \
                and not obj.requires_grad:
            return _tensor_from_numpy, (obj.numpy(),)
        return NotImplemented


def dumps(obj) -> bytes:
    """`obj` pickled for the step broadcast (plain pickle.loads reads it back)."""
    buffer = io.BytesIO()
    _StepPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
