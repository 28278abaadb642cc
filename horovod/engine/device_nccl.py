"""One device response on NCCL: the per-kind algorithms over a :class:`~horovod.engine.device.DeviceBackend`'s
memory operations and an NCCL communicator, all enqueued on the engine's stream (no host waits).

Reductions fuse into a device buffer, scale and finish on the device (``ncclAvg`` for floats); data movement runs on
bytes, so every dtype moves: ragged allgathers are grouped ``ncclBroadcast``s into place, alltoall is grouped
``ncclSend``/``ncclRecv``, uneven reducescatters are grouped ``ncclReduce``s to each block's owner.
"""
from __future__ import annotations

from math import prod
from typing import Any, List, Optional, Sequence, Tuple, cast

import numpy as np

from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend
from horovod.engine.handles import DeviceEntry, own_entries
from horovod.engine.messages import Response
from horovod.transport import nccl


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


class NcclRun:
    """One response on NCCL: the per-kind algorithms, over the backend's memory operations."""

    def __init__(self, owner: Any, backend: DeviceBackend, device: int, stream: Any, index: int,
                 comm: nccl.NcclComm, resp: Response):
        self.owner, self.backend, self.device, self.stream, self.index = owner, backend, device, stream, index
        self.comm, self.resp = comm, resp
        self.handle = backend.stream_handle(stream)
        self.set_size = len(owner.host.set_ranks[resp.process_set])

    def execute(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        keep_alive_once(entries, self.backend, self.stream)
        with self.backend.on_stream(self.stream):
            return self._execute(entries)

    def _execute(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
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

    # -- helpers --------------------------------------------------------------------------------------
    def _empty(self, shape: Sequence[int], dtype: str) -> DeviceArray:
        return self.backend.empty(tuple(shape), dtype, self.device, self.stream)

    def _fusion(self, count: int, dtype: str) -> DeviceArray:
        itemsize = ops.storage_dtype(dtype).itemsize
        raw = self.owner.fusion_buffer(self.backend, self.device, self.index, count * itemsize, self.stream)
        return self.backend.slice(raw, 0, count, dtype)

    def _piece(self, buf: DeviceArray, start: int, count: int) -> DeviceArray:
        return self.backend.slice(buf, start, count, self.resp.dtype)

    def _pieces(self, buf: DeviceArray, counts: Sequence[int]) -> List[DeviceArray]:
        out, offset = [], 0
        for n in counts:
            out.append(self._piece(buf, offset, n))
            offset += n
        return out

    def _stage_in(self, entries: Sequence[Optional[DeviceEntry]], pieces: Sequence[DeviceArray]) -> None:
        """Every tensor into its piece of the fusion buffer in one batched copy (zeros for a joined rank)."""
        dsts, srcs = [], []
        for entry, piece in zip(entries, pieces):
            if entry is None or entry.tensor is None:
                self.backend.fill_zero(piece, self.stream)
            else:
                dsts.append(piece)
                srcs.append(entry.tensor)
        if dsts:
            self.backend.copy_many(dsts, srcs, self.stream)

    def _copy_pairs(self, dsts: Sequence[object], srcs: Sequence[DeviceArray]) -> None:
        """``dsts[i] <- srcs[i]`` in one batched copy, skipping ``None`` destinations."""
        pairs = [(d, s) for d, s in zip(dsts, srcs) if isinstance(d, DeviceArray)]
        if pairs:
            self.backend.copy_many([d for d, _ in pairs], [s for _, s in pairs], self.stream)

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
        pieces = self._pieces(buf, counts)
        self._stage_in(entries, pieces)
        if resp.prescale != 1.0:
            backend.scale(buf, resp.prescale, resp.dtype, stream)
        self.comm.allreduce(buf.ptr, buf.ptr, buf.size, dtype, op, self.handle)
        self._finish_reduction(buf, averaged)
        results: List[object] = [None if entry is None else self._output(entry, shape)
                                 for entry, shape in zip(entries, resp.shapes)]
        self._copy_pairs(results, pieces)
        return results

    def _reducescatter(self, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        size, me = self.comm.size, self.comm.rank
        dtype, op, averaged = self._reduce_args()
        splits = [ops.split_rows(shape[0], size) for shape in resp.shapes]
        rows = [ops.row_elems(shape) for shape in resp.shapes]
        counts = [sum(sp[p] * r for sp, r in zip(splits, rows)) for p in range(size)]
        single = entries[0] if len(entries) == 1 else None
        if single is not None and single.tensor is not None and resp.prescale == 1.0:
            send = single.tensor   # one tensor's rows are already its blocks in rank order: no staging
        else:
            send = self._fusion(sum(counts), resp.dtype)
            dsts, srcs, offset = [], [], 0
            for p in range(size):   # rank p's block: every tensor's p-th slice, in order
                for entry, sp, r in zip(entries, splits, rows):
                    n = sp[p] * r
                    piece = self._piece(send, offset, n)
                    if entry is None or entry.tensor is None:
                        backend.fill_zero(piece, stream)
                    elif n:
                        dsts.append(piece)
                        srcs.append(backend.slice(entry.tensor, sum(sp[:p]) * r, n, resp.dtype))
                    offset += n
            if dsts:
                backend.copy_many(dsts, srcs, stream)
            if resp.prescale != 1.0:
                backend.scale(send, resp.prescale, resp.dtype, stream)
        outs: List[object] = [None if entry is None else self._empty((sp[me],) + tuple(shape[1:]), resp.dtype)
                              for entry, shape, sp in zip(entries, resp.shapes, splits)]
        direct = single is not None and isinstance(outs[0], DeviceArray)
        recv = cast(DeviceArray, outs[0]) if direct else self._empty((counts[me],), resp.dtype)
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
        if not direct:
            self._copy_pairs(outs, self._pieces(recv, [sp[me] * r for sp, r in zip(splits, rows)]))
        return outs

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
            mine = self._pieces(send, [dims[me] * r for dims, r in zip(resp.first_dims, rows)])
            backend.copy_many(mine, [entry.input() for entry in entries], stream)
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
            dsts, srcs, offset = [], [], 0
            cursors = [0] * len(outputs)
            for p in range(size):
                for i, (dims, r) in enumerate(zip(resp.first_dims, rows)):
                    n = dims[p] * r
                    if n:
                        dsts.append(self._piece(outputs[i], cursors[i], n))
                        srcs.append(self._piece(recv, offset, n))
                    cursors[i] += n
                    offset += n
            if dsts:
                backend.copy_many(dsts, srcs, stream)
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
        pieces = self._pieces(buf, counts)
        if is_root:
            backend.copy_many(pieces, [entry.input() for entry in entries], stream)
        self.comm.broadcast(buf.ptr, buf.ptr, buf.size * item, nccl.BYTES, root, self.handle)
        if is_root:   # the root's outputs hold its inputs already (copied above where they differ)
            return list(outputs)
        self._copy_pairs(outputs, pieces)
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
