"""The implementations a sweep races, each binding a :class:`Case` to one call, and the rank-side helpers that
sit outside every timed region (a barrier and max across ranks, the JSON-lines emitter)."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from benchmarks._collectives.cases import F32, Case


class RawImpl:
    """A transport of this project, called directly."""

    def __init__(self, key: str, transport):
        self.key, self.t = key, transport

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        t = self.t
        if c.op in ("allreduce-avg", "allreduce-async"):
            return None  # Average is the engine's (a transport sums), and so are asynchronous calls
        if c.op == "allreduce":
            return lambda: (t.allreduce(c.buf, "sum"), c.buf)[1]
        if c.op == "allreduce-new":
            def fresh() -> np.ndarray:
                out = np.empty_like(c.buf)
                t.allreduce_into(c.buf, out, "sum")
                return out
            return fresh
        if c.op == "broadcast":
            return lambda: (t.broadcast(c.buf, 0), c.buf)[1]
        if c.op == "allgather":
            return lambda: (t.allgatherv(c.send, c.recv, c.splits), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (t.reducescatter(c.send, c.recv, c.splits, "sum"), c.recv)[1]
        return lambda: (t.alltoallv(c.send, c.splits, c.recv, c.splits), c.recv)[1]


class EngineImpl:
    """``horovod.numpy`` collectives: the full engine, negotiation included."""

    def __init__(self, key: str, hvd):
        self.key, self.hvd = key, hvd

    def bind(self, c: Case) -> Callable[[], np.ndarray]:
        hvd, name = self.hvd, f"bench.{c.op}.{c.nbytes}"
        if c.op == "allreduce":
            return lambda: hvd.allreduce_(c.buf, op=hvd.Sum, name=name)
        if c.op == "allreduce-avg":
            return lambda: hvd.allreduce_(c.buf, op=hvd.Average, name=name)
        if c.op == "allreduce-new":
            return lambda: hvd.allreduce(c.buf, op=hvd.Sum, name=name)
        if c.op == "allreduce-async":
            return lambda: hvd.synchronize(hvd.allreduce_async_(c.buf, op=hvd.Sum, name=name))
        if c.op == "broadcast":
            return lambda: hvd.broadcast_(c.buf, 0, name=name)
        if c.op == "allgather":
            return lambda: hvd.allgather(c.send, name=name)
        if c.op == "reducescatter":
            return lambda: hvd.reducescatter(c.send, name=name, op=hvd.Sum)
        return lambda: hvd.alltoall(c.send, name=name)


class GlooImpl:
    """``torch.distributed`` on the Gloo backend, on zero-copy tensor views of the same buffers."""

    key = "gloo"

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        # torch 2.13 renamed the *_into_tensor / *_tensor variants; use whichever this torch has.
        self.allgather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reducescatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        if c.op == "allreduce-new":
            return None  # torch.distributed reduces in place only
        t, dist = self.torch.from_numpy, self.dist
        if c.op in ("allreduce", "allreduce-avg", "allreduce-async", "broadcast"):
            tb = t(c.buf)
            if c.op == "allreduce":
                return lambda: (dist.all_reduce(tb), c.buf)[1]
            if c.op == "allreduce-async":
                return lambda: (dist.all_reduce(tb, async_op=True).wait(), c.buf)[1]
            if c.op == "allreduce-avg":
                n = dist.get_world_size()
                return lambda: (dist.all_reduce(tb), tb.div_(n), c.buf)[2]
            return lambda: (dist.broadcast(tb, 0), c.buf)[1]
        ts, tr = t(c.send), t(c.recv)
        if c.op == "allgather":
            return lambda: (self.allgather(tr, ts), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (self.reducescatter(tr, ts), c.recv)[1]
        return lambda: (dist.all_to_all_single(tr, ts), c.recv)[1]


class TorchEngineImpl:
    """``horovod.torch.allreduce`` on a CPU tensor: the binding's own result allocation (new results only)."""

    def __init__(self, key: str, torch, hvd_torch):
        self.key, self.torch, self.hvd = key, torch, hvd_torch

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        if c.op != "allreduce-new":
            return None
        hvd, tensor, name = self.hvd, self.torch.from_numpy(c.buf), f"bench.torch.{c.op}.{c.nbytes}"
        return lambda: hvd.allreduce(tensor, op=hvd.Sum, name=name).numpy()


class MpiImpl:
    """mpi4py buffer-interface collectives on a duplicate of ``COMM_WORLD``."""

    key = "openmpi"

    def __init__(self, MPI, comm):
        self.MPI, self.comm = MPI, comm

    def bind(self, c: Case) -> Callable[[], np.ndarray]:
        MPI, comm = self.MPI, self.comm
        if c.op == "allreduce":
            return lambda: (comm.Allreduce(MPI.IN_PLACE, c.buf, op=MPI.SUM), c.buf)[1]
        if c.op == "allreduce-async":
            return lambda: (comm.Iallreduce(MPI.IN_PLACE, c.buf, op=MPI.SUM).Wait(), c.buf)[1]
        if c.op == "allreduce-avg":
            n = F32(comm.Get_size())
            return lambda: (comm.Allreduce(MPI.IN_PLACE, c.buf, op=MPI.SUM), np.divide(c.buf, n, out=c.buf))[1]
        if c.op == "allreduce-new":
            def fresh() -> np.ndarray:
                out = np.empty_like(c.buf)
                comm.Allreduce(c.buf, out, op=MPI.SUM)
                return out
            return fresh
        if c.op == "broadcast":
            return lambda: (comm.Bcast(c.buf, root=0), c.buf)[1]
        if c.op == "allgather":
            return lambda: (comm.Allgather(c.send, c.recv), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (comm.Reduce_scatter_block(c.send, c.recv, op=MPI.SUM), c.recv)[1]
        return lambda: (comm.Alltoall(c.send, c.recv), c.recv)[1]


class Sync:
    """Barrier and elementwise max across ranks, outside every timed region (a raw transport underneath)."""

    def __init__(self, transport):
        self.t = transport

    def barrier(self) -> None:
        self.t.barrier()

    def max(self, values: Sequence[float]) -> np.ndarray:
        arr = np.array(values, dtype=np.float64).reshape(-1)
        if arr.size:
            self.t.allreduce(arr, "max")
        return arr


class TorchSync:
    """Barrier and max across the ranks of a torch.distributed job (the Gloo peer's own group), outside every
    timed region: that job imports nothing of this project."""

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist

    def barrier(self) -> None:
        self.dist.barrier()

    def max(self, values: Sequence[float]) -> np.ndarray:
        arr = np.array(values, dtype=np.float64).reshape(-1)
        if arr.size:
            self.dist.all_reduce(self.torch.from_numpy(arr), op=self.dist.ReduceOp.MAX)
        return arr


class MpiSync:
    """Barrier and max across the ranks of an mpi4py job (the Open MPI peer's), on ``COMM_WORLD``."""

    def __init__(self, MPI, comm):
        self.MPI, self.comm = MPI, comm

    def barrier(self) -> None:
        self.comm.Barrier()

    def max(self, values: Sequence[float]) -> np.ndarray:
        arr = np.array(values, dtype=np.float64).reshape(-1)
        if arr.size:
            self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.MAX)
        return arr


class Emitter:
    """Appends JSON lines to this job's result file (rank 0 only, unless ``every_rank``)."""

    def __init__(self, path: str, rank: int, base: Dict[str, Any]):
        self.path, self.rank, self.base = path, rank, base

    def __call__(self, record: Dict[str, Any], every_rank: bool = False) -> None:
        if self.rank != 0 and not every_rank:
            return
        path = self.path if not every_rank else f"{self.path}.rank{self.rank}"
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**self.base, **record, "rank": self.rank}) + "\n")


