"""One device response on NCCL: the per-kind algorithms over a :class:`~horovod.engine.device.DeviceBackend`'s
memory operations and an NCCL communicator, all enqueued on the engine's stream (no host waits).

Reductions fuse into a device buffer, scale and finish on the device (``ncclAvg`` for floats); data movement runs on
bytes, so every dtype moves: ragged allgathers are grouped ``ncclBroadcast``s into place, alltoall is grouped
``ncclSend``/``ncclRecv``, uneven reducescatters are grouped ``ncclReduce``s to each block's owner.
"""
from __future__ import annotations

from math import prod
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend
from horovod.engine.handles import DeviceEntry, own_entries
from horovod.engine.messages import Response
from horovod.transport import nccl


def mark_done(entries: Sequence[Optional[DeviceEntry]], results: Sequence[object], done: Any,
               backend: DeviceBackend, stream: Any) -> None:
    """Attach the completion event to every array the collective touched, and keep their memory alive until the
    engine's stream is past it."""
    for entry in entries:
        if entry is not None and isinstance(entry.tensor, DeviceArray):
            entry.tensor.done = done
            backend.keep_alive(entry.tensor, stream)
    for result in results:
        array = result[0] if isinstance(result, tuple) else result
        if isinstance(array, DeviceArray):
            array.done = done
            backend.keep_alive(array, stream)


class NcclRun:
    """One response on NCCL: the per-kind algorithms, over the backend's memory operations."""

    def __init__(self, owner: Any, backend: DeviceBackend, device: int, stream: Any, index: int,
                 comm: nccl.NcclComm, resp: Response):
        self.owner, self.backend, self.device, self.stream, self.index = owner, backend, device, stream, index
        self.comm, self.resp = comm, resp
        self.handle = backend.stream_handle(stream)
        self.set_size = len(owner.host.set_ranks[resp.process_set])

    def execute(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        kind = self.resp.kind
        if kind == ops.ALLREDUCE:
            return self._allreduce(entries)
        if kind == ops.ALLGATHER:
            return self._allgather(entries)
        if kind == ops.BROADCAST:
            return self._broadcast(entries)
        if kind == ops.ALLTOALL:
            return self._alltoall(entries)
        if kind == ops.REDUCESCATTER:
            return self._reducescatter(entries)
        raise ValueError(f"no device implementation of response kind {kind}")

    def finish(self, entries: Sequence[Optional[DeviceEntry]], results: List[object]) -> None:
        mark_done(entries, results, self.backend.record(self.stream), self.backend, self.stream)

    # -- helpers --------------------------------------------------------------------------------------
    def _empty(self, shape: Sequence[int], dtype: str) -> DeviceArray:
        return self.backend.empty(tuple(shape), dtype, self.device, self.stream)

    def _fusion(self, count: int, dtype: str) -> DeviceArray:
        itemsize = ops.storage_dtype(dtype).itemsize
        raw = self.owner.fusion_buffer(self.backend, self.device, self.index, count * itemsize, self.stream)
        return self.backend.slice(raw, 0, count, dtype)

    def _piece(self, buf: DeviceArray, start: int, count: int) -> DeviceArray:
        return self.backend.slice(buf, start, count, self.resp.dtype)

    def _stage_in(self, entry: Optional[DeviceEntry], dst: DeviceArray) -> None:
        if entry is None or entry.tensor is None:
            self.backend.fill_zero(dst, self.stream)
        else:
            self.backend.copy(dst, entry.tensor, self.stream)

    def _output(self, entry: DeviceEntry, shape: Sequence[int]) -> DeviceArray:
        if entry.output is None:
            entry.output = self._empty(shape, self.resp.dtype)
        return entry.output

    def _finish_reduction(self, buf: DeviceArray, averaged: bool) -> None:
        """Postscale, then Average's division (unless NCCL averaged already)."""
        resp = self.resp
        if resp.postscale != 1.0:
            self.backend.scale(buf, resp.postscale, resp.dtype, self.stream)
        if resp.op == ops.Average and not averaged:
            self.backend.divide(buf, self.set_size, resp.dtype, self.stream)

    def _reduce_args(self) -> Tuple[int, int, bool]:
        """``(NCCL dtype, NCCL op, averaged by NCCL)``; ncclAvg only for floats without a postscale (integers
        keep the host path's truncating division)."""
        resp, lib = self.resp, self.comm.lib
        dtype = nccl.reduction_dtype(resp.dtype, lib.has_avg)
        if dtype is None:   # the device executor stages these through the host instead
            raise ValueError(f"NCCL cannot reduce {resp.dtype} (tensors {resp.names[:3]}); an engine defect, please "
                             f"report")
        floating = resp.dtype in ("float16", "float32", "float64", "bfloat16")
        if resp.op == ops.Average and floating and lib.has_avg and resp.postscale == 1.0:
            return dtype, nccl.AVG, True
        return dtype, nccl.reduction_op(ops.TRANSPORT_OP[resp.op], resp.dtype), False

    # -- reductions -------------------------------------------------------------------------------------
    def _allreduce(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        dtype, op, averaged = self._reduce_args()
        if len(entries) == 1 and entries[0] is not None:
            single = entries[0]
            out = self._output(single, resp.shapes[0])
            src = single.input()
            if resp.prescale != 1.0:
                if out is not src:
                    backend.copy(out, src, stream)
                backend.scale(out, resp.prescale, resp.dtype, stream)
                src = out
            self.comm.allreduce(src.ptr, out.ptr, out.size, dtype, op, self.handle)
            self._finish_reduction(out, averaged)
            return [out]
        counts = [prod(s) for s in resp.shapes]
        buf = self._fusion(sum(counts), resp.dtype)
        offset = 0
        for entry, n in zip(entries, counts):
            self._stage_in(entry, self._piece(buf, offset, n))
            offset += n
        if resp.prescale != 1.0:
            backend.scale(buf, resp.prescale, resp.dtype, stream)
        self.comm.allreduce(buf.ptr, buf.ptr, buf.size, dtype, op, self.handle)
        self._finish_reduction(buf, averaged)
        results: List[object] = []
        offset = 0
        for entry, shape, n in zip(entries, resp.shapes, counts):
            if entry is None:
                results.append(None)
            else:
                out = self._output(entry, shape)
                backend.copy(out, self._piece(buf, offset, n), stream)
                results.append(out)
            offset += n
        return results

    def _reducescatter(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        size, me = self.comm.size, self.comm.rank
        dtype, op, averaged = self._reduce_args()
        splits = [ops.split_rows(shape[0], size) for shape in resp.shapes]
        rows = [ops.row_elems(shape) for shape in resp.shapes]
        counts = [sum(sp[p] * r for sp, r in zip(splits, rows)) for p in range(size)]
        send = self._fusion(sum(counts), resp.dtype)
        offset = 0
        for p in range(size):   # rank p's block: every tensor's p-th slice, in order
            for entry, sp, r in zip(entries, splits, rows):
                n = sp[p] * r
                start = sum(sp[:p]) * r
                piece = self._piece(send, offset, n)
                if entry is None or entry.tensor is None:
                    backend.fill_zero(piece, stream)
                else:
                    backend.copy(piece, backend.slice(entry.tensor, start, n, resp.dtype), stream)
                offset += n
        if resp.prescale != 1.0:
            backend.scale(send, resp.prescale, resp.dtype, stream)
        recv = self._empty((counts[me],), resp.dtype)
        if len(set(counts)) == 1:
            self.comm.reducescatter(send.ptr, recv.ptr, counts[0], dtype, op, self.handle)
        else:   # uneven blocks: one reduce to each block's owner, grouped
            with self.comm.group():
                start = 0
                for p, n in enumerate(counts):
                    target = recv.ptr if p == me else self._piece(send, start, n).ptr
                    self.comm.reduce(self._piece(send, start, n).ptr, target, n, dtype, op, p, self.handle)
                    start += n
        self._finish_reduction(recv, averaged)
        results: List[object] = []
        offset = 0
        for entry, shape, sp, r in zip(entries, resp.shapes, splits, rows):
            n = sp[me] * r
            if entry is None:
                results.append(None)
            else:
                out = self._empty((sp[me],) + tuple(shape[1:]), resp.dtype)
                backend.copy(out, self._piece(recv, offset, n), stream)
                results.append(out)
            offset += n
        return results

    # -- data movement (as bytes: any dtype) -------------------------------------------------------------
    def _allgather(self, slots: Sequence[Optional[DeviceEntry]]) -> List[object]:
        entries = own_entries(slots, "allgather")
        resp, backend, stream = self.resp, self.backend, self.stream
        size, me = self.comm.size, self.comm.rank
        item = ops.storage_dtype(resp.dtype).itemsize
        rows = [ops.row_elems(shape) for shape in resp.shapes]
        outputs = [self._empty((sum(dims),) + tuple(shape[1:]), resp.dtype)
                   for shape, dims in zip(resp.shapes, resp.first_dims)]
        counts = [sum(dims[p] * r for dims, r in zip(resp.first_dims, rows)) for p in range(size)]
        if len(entries) == 1:
            send, recv = entries[0].input(), outputs[0]
        else:
            send = self._fusion(counts[me], resp.dtype)
            offset = 0
            for entry, dims, r in zip(entries, resp.first_dims, rows):
                n = dims[me] * r
                backend.copy(self._piece(send, offset, n), entry.input(), stream)
                offset += n
            recv = self._empty((sum(counts),), resp.dtype)
        if len(set(counts)) == 1:
            self.comm.allgather(send.ptr, recv.ptr, counts[0] * item, nccl.BYTES, self.handle)
        else:   # ragged: every rank broadcasts its block into place, grouped
            with self.comm.group():
                start = 0
                for p, n in enumerate(counts):
                    if n:
                        dst = self._piece(recv, start, n).ptr
                        self.comm.broadcast(send.ptr if p == me else dst, dst, n * item, nccl.BYTES, p, self.handle)
                    start += n
        if len(entries) > 1:
            offset = 0
            cursors = [0] * len(outputs)
            for p in range(size):
                for i, (dims, r) in enumerate(zip(resp.first_dims, rows)):
                    n = dims[p] * r
                    if n:
                        backend.copy(self._piece(outputs[i], cursors[i], n), self._piece(recv, offset, n), stream)
                    cursors[i] += n
                    offset += n
        return list(outputs)

    def _broadcast(self, slots: Sequence[Optional[DeviceEntry]]) -> List[object]:
        entries = own_entries(slots, "broadcast")
        resp, backend, stream = self.resp, self.backend, self.stream
        root = list(self.owner.host.set_ranks[resp.process_set]).index(resp.root)
        item = ops.storage_dtype(resp.dtype).itemsize
        is_root = self.comm.rank == root
        outputs: List[DeviceArray] = []
        for entry in entries:
            tensor = entry.input()
            out = self._output(entry, tensor.shape)
            if out is not tensor and is_root:
                backend.copy(out, tensor, stream)
            outputs.append(out)
        if len(entries) == 1:
            out = outputs[0]
            self.comm.broadcast(out.ptr, out.ptr, out.nbytes, nccl.BYTES, root, self.handle)
            return [out]
        counts = [prod(s) for s in resp.shapes]
        buf = self._fusion(sum(counts), resp.dtype)
        offset = 0
        if is_root:
            for out, n in zip(outputs, counts):
                backend.copy(self._piece(buf, offset, n), out, stream)
                offset += n
        self.comm.broadcast(buf.ptr, buf.ptr, buf.size * item, nccl.BYTES, root, self.handle)
        offset = 0
        for out, n in zip(outputs, counts):
            backend.copy(out, self._piece(buf, offset, n), stream)
            offset += n
        return list(outputs)

    def _alltoall(self, slots: Sequence[Optional[DeviceEntry]]) -> List[object]:
        entries = own_entries(slots, "alltoall")
        resp = self.resp
        size, me = self.comm.size, self.comm.rank
        item = ops.storage_dtype(resp.dtype).itemsize
        results: List[object] = []
        for entry, matrix in zip(entries, resp.splits):
            tensor = entry.input()
            shape = tensor.shape
            r = ops.row_elems(shape)
            send_rows = matrix[me]
            recv_rows = [matrix[p][me] for p in range(size)]
            out = self._empty((sum(recv_rows),) + tuple(shape[1:]), resp.dtype)
            with self.comm.group():
                sent = received = 0
                for p in range(size):
                    n_send, n_recv = send_rows[p] * r, recv_rows[p] * r
                    if n_send:
                        self.comm.send(self._piece(tensor, sent, n_send).ptr, n_send * item, nccl.BYTES, p,
                                       self.handle)
                    if n_recv:
                        self.comm.recv(self._piece(out, received, n_recv).ptr, n_recv * item, nccl.BYTES, p,
                                       self.handle)
                    sent += n_send
                    received += n_recv
            results.append((out, np.asarray(recv_rows, dtype=np.int32)))
        return results
