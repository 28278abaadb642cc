"""One device response on NCCL: the shared algorithms (:mod:`horovod.engine.algorithms`) over device memory
(:class:`~horovod.engine.memory.DeviceMemory`) and NCCL as their data plane, all enqueued on the engine's stream (no
host waits, but for a hierarchical allreduce's step across hosts).

:class:`NcclPlane` gives NCCL the CPU transports' operations on device arrays.  Reductions scale and finish on the
device (``ncclAvg`` for floats); data movement runs on bytes, so every dtype moves: ragged allgathers are grouped
``ncclBroadcast``s into place, alltoall is grouped ``ncclSend``/``ncclRecv``, uneven reducescatters are grouped
``ncclReduce``s to each block's owner.  :class:`HierarchicalPlane` composes NCCL inside a host with the CPU
transport across hosts for allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import algorithms, ops
from horovod.engine.device import DeviceArray, DeviceBackend
from horovod.engine.handles import DeviceEntry
from horovod.engine.memory import DeviceFinish, DeviceMemory, PinnedStage
from horovod.engine.messages import Response
from horovod.transport import nccl
from horovod.transport.base import Transport
from horovod.transport.hierarchical import even_counts


def mark_done(entries: Sequence[Optional[DeviceEntry]], results: Sequence[object], done: Any) -> None:
    """Attach the completion event to every array the collective touched (the consumer's stream waits for it)."""
    for entry in entries:
        if entry is not None and isinstance(entry.tensor, DeviceArray):
            entry.tensor.done = done
    for result in results:
        array = result[0] if isinstance(result, tuple) else result
        if isinstance(array, DeviceArray):
            array.done = done


def keep_alive_once(entries: Sequence[Optional[DeviceEntry]], backend: DeviceBackend, stream: Any) -> None:
    """Tell the allocator, before anything is enqueued, that the engine's stream uses the caller's memory: a failure
    half-way through a group must not let the memory be handed out while kernels may still use it.  Once per
    tensor; what the engine allocates on its own stream needs nothing."""
    for entry in entries:
        if entry is None:
            continue
        if entry.tensor is not None:
            backend.keep_alive(entry.tensor, stream)
        if entry.output is not None and entry.output is not entry.tensor:
            backend.keep_alive(entry.output, stream)


class NcclPlane:
    """NCCL as a data plane: the CPU transports' operations on one response's device arrays (counts in elements of
    ``dtype``), enqueued on the stream ``handle``.  Its ops are the transports' plus :data:`AVERAGE` (ncclAvg)."""

    AVERAGE = "average"

    def __init__(self, comm: nccl.NcclComm, handle: int, dtype: str):
        self.comm, self.handle, self.dtype = comm, handle, dtype
        self.rank, self.size = comm.rank, comm.size
        self.item = ops.storage_dtype(dtype).itemsize

    def averages(self, resp: Response) -> bool:
        """Whether ncclAvg can do Average: for floats without a postscale only (integers keep the host path's
        truncating division)."""
        return (resp.op == ops.Average and resp.postscale == 1.0 and self.comm.lib.has_avg
                and resp.dtype in ("float16", "float32", "float64", "bfloat16"))

    def _reduction(self, op: str) -> Tuple[int, int]:
        dtype = nccl.reduction_dtype(self.dtype, self.comm.lib.has_avg)
        if dtype is None:   # the device executor stages these through the host instead
            raise ValueError(f"NCCL cannot reduce {self.dtype}; an engine defect, please report")
        return dtype, nccl.AVG if op == self.AVERAGE else nccl.reduction_op(op, self.dtype)

    def _at(self, a: DeviceArray, start: int) -> int:
        return a.ptr + start * self.item

    def allreduce_into(self, src: DeviceArray, dst: DeviceArray, op: str,
                       finish: Optional[DeviceFinish] = None) -> None:
        dtype, nop = self._reduction(op)
        self.comm.allreduce(src.ptr, dst.ptr, dst.size, dtype, nop, self.handle)
        if finish is not None:
            finish(dst)

    def reducescatter(self, send: DeviceArray, recv: DeviceArray, counts: Sequence[int], op: str) -> None:
        dtype, nop = self._reduction(op)
        if len(set(counts)) == 1:
            self.comm.reducescatter(send.ptr, recv.ptr, counts[0], dtype, nop, self.handle)
            return
        with self.comm.group():   # uneven blocks: one reduce to each block's owner, grouped
            start = 0
            for p, n in enumerate(counts):
                target = recv.ptr if p == self.rank else self._at(send, start)
                self.comm.reduce(self._at(send, start), target, n, dtype, nop, p, self.handle)
                start += n

    def allgatherv(self, send: DeviceArray, recv: DeviceArray, counts: Sequence[int]) -> None:
        if len(set(counts)) == 1:
            self.comm.allgather(send.ptr, recv.ptr, counts[0] * self.item, nccl.BYTES, self.handle)
            return
        with self.comm.group():   # ragged: every rank broadcasts its block into place, grouped
            start = 0
            for p, n in enumerate(counts):
                if n:
                    dst = self._at(recv, start)
                    self.comm.broadcast(send.ptr if p == self.rank else dst, dst, n * self.item, nccl.BYTES, p,
                                        self.handle)
                start += n

    def broadcast(self, buf: DeviceArray, root: int) -> None:
        self.comm.broadcast(buf.ptr, buf.ptr, buf.size * self.item, nccl.BYTES, root, self.handle)

    def alltoallv(self, send: DeviceArray, send_counts: Sequence[int], recv: DeviceArray,
                  recv_counts: Sequence[int]) -> None:
        with self.comm.group():
            sent = received = 0
            for p, (n_send, n_recv) in enumerate(zip(send_counts, recv_counts)):
                if n_send:
                    self.comm.send(self._at(send, sent), n_send * self.item, nccl.BYTES, p, self.handle)
                if n_recv:
                    self.comm.recv(self._at(recv, received), n_recv * self.item, nccl.BYTES, p, self.handle)
                sent += n_send
                received += n_recv


class HierarchicalPlane(NcclPlane):
    """Allreduce as the original's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` on GPUs: the host's ranks reduce-scatter on
    NCCL, each allreduces its shard across hosts on the CPU transport (over the ranks with its place in their host)
    through pinned host memory, and the host's ranks allgather the shards on NCCL; only ``1 / local_size`` of the
    data crosses hosts from each rank.  Every other operation runs on the flat communicator (``comm``).
    """

    def __init__(self, comm: nccl.NcclComm, handle: int, dtype: str, local: NcclPlane, cross: Transport,
                 memory: DeviceMemory, stage: PinnedStage):
        super().__init__(comm, handle, dtype)
        self.local, self.cross, self.memory, self.stage = local, cross, memory, stage

    def averages(self, resp: Response) -> bool:
        return False   # ncclAvg inside the host would divide by the host's ranks only: Average finishes after

    def allreduce_into(self, src: DeviceArray, dst: DeviceArray, op: str,
                       finish: Optional[DeviceFinish] = None) -> None:
        local, memory = self.local, self.memory
        counts = even_counts(dst.size, local.size)
        shard = memory.piece(dst, sum(counts[:local.rank]), counts[local.rank])   # in place, where the allgather
        local.reducescatter(src, shard, counts, op)                                # sends it from
        if shard.size:
            backend, stream = memory.backend, memory.stream
            host = self.stage.get(backend, stream, shard.nbytes)[:shard.nbytes].view(shard.dtype)
            backend.to_host(host, shard, stream)
            backend.synchronize(stream)   # the CPU transport reads it now
            if self.dtype == ops.BFLOAT16:   # the CPU transports reduce bfloat16 in float32, as the host path does
                wide = np.empty(host.size, np.float32)
                ops.bf16_to_f32(host, wide)
                self.cross.allreduce_into(wide, wide, op)
                ops.f32_to_bf16(wide, host)
            else:
                self.cross.allreduce_into(host, host, op)
            backend.to_device(shard, host, stream)
        local.allgatherv(shard, dst, counts)
        if finish is not None:
            finish(dst)


def nccl_run(backend: DeviceBackend, device: int, stream: Any, comm: nccl.NcclComm, resp: Response,
             set_ranks: Sequence[int], fusion_bytes: Callable[[int], DeviceArray],
             entries: Sequence[Optional[DeviceEntry]],
             hierarchy: Optional[Tuple[nccl.NcclComm, Transport, PinnedStage]] = None) -> List[object]:
    """Run ``resp`` on NCCL: device memory on the engine's ``stream``, NCCL as the data plane, the shared algorithms
    (``set_ranks``: the set's global ranks, which name a broadcast's root; ``fusion_bytes(n)``: the stream's
    reusable fusion buffer of at least ``n`` bytes; ``hierarchy``: a communicator inside this host, the CPU transport
    across hosts and the pinned buffer between them, for a hierarchical allreduce)."""
    keep_alive_once(entries, backend, stream)
    memory = DeviceMemory(backend, device, stream, resp.dtype, fusion_bytes)
    handle = backend.stream_handle(stream)
    plane = NcclPlane(comm, handle, resp.dtype)
    if hierarchy is not None and resp.kind == ops.ALLREDUCE:
        local, cross, stage = hierarchy
        plane = HierarchicalPlane(comm, handle, resp.dtype, NcclPlane(local, handle, resp.dtype), cross, memory,
                                  stage)
    op, finish = "", None
    if resp.kind in (ops.ALLREDUCE, ops.REDUCESCATTER):
        averaged = plane.averages(resp)
        op = plane.AVERAGE if averaged else ops.TRANSPORT_OP[resp.op]
        finish = memory.finisher(ops.Sum if averaged else resp.op, resp.postscale, plane.size)
    with backend.on_stream(stream):
        return algorithms.run(memory, plane, resp, entries, op, finish, set_ranks)
