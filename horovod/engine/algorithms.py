"""The per-kind collective algorithms, written once over a memory and a data plane.

A response names tensors; this rank's entries for them (or zeros, for a rank that has joined) are staged into one
reusable fusion buffer, prescaled, reduced or gathered by the data plane, finished (postscale, Average) and copied
out.  A single tensor that can be worked on where it lies skips the staging copies.

The memory is host memory (numpy) or one stream's device memory (:mod:`horovod.engine.memory`); the data plane is a
CPU :class:`~horovod.transport.base.Transport` or NCCL (:class:`horovod.engine.device_nccl.NcclPlane`).  Neither
side knows which the other is.  Adasum, barrier and the coordinator's inline results stay the host executor's.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, FrozenSet, List, Optional, Protocol, Sequence, TypeVar

import numpy as np

from horovod.engine import ops
from horovod.engine.handles import Entry, own_entries
from horovod.engine.messages import Response

A = TypeVar("A")
F = TypeVar("F", bound=Callable[[Any], None])
A_in = TypeVar("A_in", contravariant=True)
F_in = TypeVar("F_in", contravariant=True)


class Memory(Protocol[A]):
    """Flat element pieces of C-contiguous arrays in one memory (see :mod:`horovod.engine.memory`)."""

    widens: FrozenSet[str]   # the dtypes it reduces in a wider one (host: bfloat16 in float32)

    def reduce_dtype(self, dtype: str) -> str: ...
    def flat(self, a: A) -> A: ...
    def overlaps(self, a: A, b: A) -> bool: ...
    def empty(self, shape: Sequence[int], dtype: str) -> A: ...
    def empty_like(self, a: A) -> A: ...
    def fusion(self, count: int, dtype: str) -> A: ...
    def piece(self, a: A, start: int, count: int) -> A: ...
    def copy(self, dst: A, src: A) -> None: ...
    def copy_many(self, dsts: Sequence[Optional[A]], srcs: Sequence[A]) -> None: ...
    def fill_zero(self, a: A) -> None: ...
    def scale(self, a: A, factor: float) -> None: ...


class DataPlane(Protocol[A_in, F_in]):
    """What the algorithms ask of a data plane: the CPU transports' operations (counts in elements)."""

    rank: int
    size: int

    def allreduce_into(self, src: A_in, dst: A_in, op: str, finish: Optional[F_in]) -> None: ...
    def reducescatter(self, send: A_in, recv: A_in, counts: Sequence[int], op: str) -> None: ...
    def allgatherv(self, send: A_in, recv: A_in, counts: Sequence[int]) -> None: ...
    def broadcast(self, buf: A_in, root: int) -> None: ...
    def alltoallv(self, send: A_in, send_counts: Sequence[int], recv: A_in, recv_counts: Sequence[int]) -> None: ...


def run(mem: Memory[A], plane: DataPlane[A, F], resp: Response, entries: Sequence[Optional[Entry[Any]]],
        op: str, finish: Optional[F], set_ranks: Sequence[int]) -> List[object]:
    """Run ``resp``: one result per entry (the output array, or ``(array, received splits)`` for alltoall).

    ``op`` and ``finish`` are the reduction (the op the plane applies, and the postscale and Average after it, which
    a plane may fold in: ncclAvg, or a CPU transport finishing each piece while it is in cache); ``set_ranks``: the
    set's global ranks (a broadcast's root is one)."""
    kind = resp.kind
    if kind == ops.ALLREDUCE:
        return allreduce(mem, plane, resp, entries, op, finish)
    if kind == ops.REDUCESCATTER:
        return reducescatter(mem, plane, resp, entries, op, finish)
    if kind == ops.ALLGATHER:
        return allgather(mem, plane, resp, entries)
    if kind == ops.BROADCAST:
        return broadcast(mem, plane, resp, entries, list(set_ranks).index(resp.root))
    if kind == ops.ALLTOALL:
        return alltoall(mem, plane, resp, entries)
    raise ValueError(f"no data-plane algorithm for response kind {kind}")


def _output(mem: Memory[A], entry: Entry[Any], shape: Sequence[int], dtype: str) -> A:
    if entry.output is None:
        entry.output = mem.empty(shape, dtype)
    return entry.output


def _pieces(mem: Memory[A], buf: A, counts: Sequence[int]) -> List[A]:
    out, offset = [], 0
    for n in counts:
        out.append(mem.piece(buf, offset, n))
        offset += n
    return out


# -- reductions -----------------------------------------------------------------------------------------
def allreduce(mem: Memory[A], plane: DataPlane[A, F], resp: Response, entries: Sequence[Optional[Entry[Any]]],
              op: str, finish: Optional[F]) -> List[object]:
    single = entries[0] if len(entries) == 1 else None
    if single is not None and resp.dtype not in mem.widens:
        tensor = single.input()
        out = single.output
        if out is None:
            out = single.output = mem.empty_like(tensor)
        dst = mem.flat(out)
        separate = out is not tensor and not mem.overlaps(out, tensor)
        if separate and resp.prescale == 1.0:
            # Reduced straight from the input into the result: one pass over memory less than copy + in place.
            plane.allreduce_into(mem.flat(tensor), dst, op, finish)
            return [out]
        if separate:
            mem.copy(dst, mem.flat(tensor))
        mem.scale(dst, resp.prescale)
        plane.allreduce_into(dst, dst, op, finish)
        return [out]
    counts = [prod(s) for s in resp.shapes]
    buf = mem.fusion(sum(counts), mem.reduce_dtype(resp.dtype))
    pieces = _pieces(mem, buf, counts)
    mine = [(p, e.tensor) for e, p in zip(entries, pieces) if e is not None and e.tensor is not None]
    for entry, piece in zip(entries, pieces):
        if entry is None or entry.tensor is None:
            mem.fill_zero(piece)   # a joined rank takes part with zeros
    mem.copy_many([p for p, _ in mine], [t for _, t in mine])
    mem.scale(buf, resp.prescale)
    plane.allreduce_into(buf, buf, op, finish)
    results: List[Optional[A]] = [None if entry is None else _output(mem, entry, shape, resp.dtype)
                                  for entry, shape in zip(entries, resp.shapes)]
    mem.copy_many(results, pieces)
    return list(results)


def reducescatter(mem: Memory[A], plane: DataPlane[A, F], resp: Response,
                  entries: Sequence[Optional[Entry[Any]]], op: str, finish: Optional[F]) -> List[object]:
    size, me = plane.size, plane.rank
    splits = [ops.split_rows(shape[0], size) for shape in resp.shapes]
    rows = [ops.row_elems(shape) for shape in resp.shapes]
    counts = [sum(sp[p] * r for sp, r in zip(splits, rows)) for p in range(size)]
    single = entries[0] if len(entries) == 1 else None
    direct = single is not None and resp.dtype not in mem.widens   # received into the output
    if direct and single is not None and single.tensor is not None and resp.prescale == 1.0:
        send = mem.flat(single.tensor)   # one tensor's rows are already its blocks in rank order: no staging
    else:
        send = mem.fusion(sum(counts), mem.reduce_dtype(resp.dtype))
        dsts, srcs, offset = [], [], 0
        for p in range(size):   # rank p's block: every tensor's p-th slice, in order
            for entry, sp, r in zip(entries, splits, rows):
                n = sp[p] * r
                piece = mem.piece(send, offset, n)
                if entry is None or entry.tensor is None:
                    mem.fill_zero(piece)
                elif n:
                    dsts.append(piece)
                    srcs.append(mem.piece(entry.tensor, sum(sp[:p]) * r, n))
                offset += n
        mem.copy_many(dsts, srcs)
        mem.scale(send, resp.prescale)
    outs: List[Optional[A]] = [None if entry is None else mem.empty((sp[me],) + tuple(shape[1:]), resp.dtype)
                               for entry, shape, sp in zip(entries, resp.shapes, splits)]
    first = outs[0]
    recv = mem.empty((counts[me],), mem.reduce_dtype(resp.dtype)) if first is None or not direct else first
    plane.reducescatter(send, mem.flat(recv), counts, op)
    if finish is not None:
        finish(recv)
    if recv is not first:
        mem.copy_many(outs, _pieces(mem, recv, [sp[me] * r for sp, r in zip(splits, rows)]))
    return list(outs)


# -- data movement (storage dtype: every dtype moves) ---------------------------------------------------------
def allgather(mem: Memory[A], plane: DataPlane[A, F], resp: Response,
              slots: Sequence[Optional[Entry[Any]]]) -> List[object]:
    entries = own_entries(slots, "allgather")
    size, me = plane.size, plane.rank
    rows = [ops.row_elems(shape) for shape in resp.shapes]
    outputs = [mem.empty((sum(dims),) + tuple(shape[1:]), resp.dtype)
               for shape, dims in zip(resp.shapes, resp.first_dims)]
    counts = [sum(dims[p] * r for dims, r in zip(resp.first_dims, rows)) for p in range(size)]
    if len(entries) == 1:
        plane.allgatherv(mem.flat(entries[0].input()), mem.flat(outputs[0]), counts)
        return list(outputs)
    send = mem.fusion(counts[me], resp.dtype)
    mine = _pieces(mem, send, [dims[me] * r for dims, r in zip(resp.first_dims, rows)])
    mem.copy_many(mine, [entry.input() for entry in entries])
    recv = mem.empty((sum(counts),), resp.dtype)
    plane.allgatherv(send, recv, counts)
    dsts, srcs, offset = [], [], 0
    cursors = [0] * len(outputs)
    for p in range(size):   # rank p's block holds every tensor's rows from p, in order
        for i, (dims, r) in enumerate(zip(resp.first_dims, rows)):
            n = dims[p] * r
            if n:
                dsts.append(mem.piece(outputs[i], cursors[i], n))
                srcs.append(mem.piece(recv, offset, n))
            cursors[i] += n
            offset += n
    mem.copy_many(dsts, srcs)
    return list(outputs)


def broadcast(mem: Memory[A], plane: DataPlane[A, F], resp: Response, slots: Sequence[Optional[Entry[Any]]],
              root: int) -> List[object]:
    entries = own_entries(slots, "broadcast")
    is_root = plane.rank == root
    outputs: List[A] = []
    for entry in entries:
        tensor = entry.input()
        out = _output(mem, entry, tensor.shape, resp.dtype)
        if out is not tensor and is_root:
            mem.copy(mem.flat(out), mem.flat(tensor))
        outputs.append(out)
    if len(entries) == 1:
        plane.broadcast(mem.flat(outputs[0]), root)
        return list(outputs)
    buf = mem.fusion(sum(prod(s) for s in resp.shapes), resp.dtype)
    pieces = _pieces(mem, buf, [prod(s) for s in resp.shapes])
    if is_root:
        mem.copy_many(pieces, [entry.input() for entry in entries])
    plane.broadcast(buf, root)
    if not is_root:   # the root's outputs hold its inputs already
        mem.copy_many(outputs, pieces)
    return list(outputs)


def alltoall(mem: Memory[A], plane: DataPlane[A, F], resp: Response,
             slots: Sequence[Optional[Entry[Any]]]) -> List[object]:
    entries = own_entries(slots, "alltoall")
    size, me = plane.size, plane.rank
    results: List[object] = []
    for entry, matrix in zip(entries, resp.splits):
        tensor = entry.input()
        shape = tensor.shape
        r = ops.row_elems(shape)
        recv_rows = [matrix[p][me] for p in range(size)]
        out = mem.empty((sum(recv_rows),) + tuple(shape[1:]), resp.dtype)
        plane.alltoallv(mem.flat(tensor), [s * r for s in matrix[me]], mem.flat(out), [s * r for s in recv_rows])
        results.append((out, np.asarray(recv_rows, dtype=np.int32)))
    return results

