"""Executes planned responses on a transport: fusion buffer in, collective, scaling, fusion buffer out.

Runs only on the background thread.  A response names tensors; this rank's entries for them (or zeros, for a
rank that has joined) are staged into one reusable fusion buffer, reduced or gathered by the transport, and
copied out.  A single tensor that can be worked on in place skips the staging copies.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from horovod.engine import ops, result_pool
from horovod.engine.handles import Entry, HostEntry, own_entries
from horovod.engine.messages import Response
from horovod.transport.base import Transport


class FusionBuffer:
    """One reusable byte buffer per process (grown on demand, never shrunk below the last need)."""

    def __init__(self) -> None:
        self._raw = np.empty(0, dtype=np.uint8)

    def get(self, count: int, dtype: np.dtype) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self._raw.nbytes < nbytes:
            self._raw = np.empty(max(nbytes, 2 * self._raw.nbytes if self._raw.nbytes < (64 << 20) else nbytes),
                                 dtype=np.uint8)
        return self._raw[:nbytes].view(dtype)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def deliver_inline(entry: HostEntry, payload: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Write an already reduced tiny result into the entry's output (allocated when the call returns a new one)."""
    result = np.frombuffer(payload, dtype=ops.storage_dtype(dtype))
    if entry.output is None:
        entry.output = result_pool.empty(shape, dtype=ops.storage_dtype(dtype))
    np.copyto(_flat(entry.output), result, casting="no")
    return entry.output


_row_elems = ops.row_elems
split_rows = ops.split_rows


class Executor:
    """Carries out responses for this rank.

    Args:
        rank: global rank of this process.
        set_ranks: process set id -> sorted global ranks.
        transport_for: process set id -> the transport of that set (members only).
    """

    def __init__(self, rank: int, set_ranks: Dict[int, Sequence[int]], transport_for: Callable[[int], Transport],
                 config: Any = None):
        self.rank = rank
        self.set_ranks = set_ranks
        self.transport_for = transport_for
        self.fusion = FusionBuffer()
        self.config = config
        self.timeline_of: Callable[[], Any] = lambda: None   # the runtime's current timeline (it may be replaced)
        self._devices: Any = None   # the DeviceExecutor, made at the first GPU response
        # Set by the engine: called (from the GPU watchdog's thread) when the device plane failed.
        self.on_device_failure: Optional[Callable[[BaseException], None]] = None
        self._device_error: Optional[BaseException] = None   # the closed device plane's failure (lost GPU work)

    @property
    def devices(self):
        """The device data plane (NCCL or host-staged), created on first use: CPU-only jobs never load it."""
        if self._devices is None:
            from horovod.engine.device_executor import DeviceExecutor, DeviceOptions

            self._devices = DeviceExecutor(self, DeviceOptions.from_config(self.config))
        return self._devices

    def close(self, abort: bool = True, reason: str = "") -> None:
        """Free device resources (NCCL communicators: aborted after a failure so no GPU waits for a dead peer;
        ``reason``: why the engine ended, for the pending GPU work's error)."""
        if self._devices is not None:
            self._device_error = self._devices.close(abort, reason=reason)
            self._devices = None

    def forget_set(self, set_id: int) -> None:
        """A process set was removed: free its device resources (NCCL communicators, once their work is done)."""
        if self._devices is not None:
            self._devices.forget_set(set_id)

    def settle_devices(self, timeout: Optional[float] = None) -> None:
        """Wait until the GPU work enqueued so far completed; raise if the device plane failed."""
        if self._devices is not None:
            self._devices.settle(timeout)
        elif self._device_error is not None:
            raise self._device_error

    def device_failure(self) -> Optional[BaseException]:
        """The device plane's failure (a GPU collective timed out, an asynchronous NCCL error), else ``None``."""
        return self._devices.watchdog.failure if self._devices is not None else self._device_error

    def activity_prefix(self, resp: Response) -> Optional[str]:
        """The timeline's name for the data plane of ``resp`` when it is not the host transport's."""
        if resp.device < 0:
            return None
        mode = self._devices.mode(resp.process_set) if self._devices is not None else None
        return None if mode == "HOST" else "NCCL"   # host-staged GPU work runs on the host transport

    # -- helpers --------------------------------------------------------------------------------------
    def _stage_in(self, entry: Optional[HostEntry], shape, dst: np.ndarray, dtype: str) -> None:
        if entry is None or entry.tensor is None:
            dst[...] = 0
        elif dtype == ops.BFLOAT16:
            ops.bf16_to_f32(_flat(entry.tensor), dst)
        else:
            np.copyto(dst, _flat(entry.tensor), casting="no")

    def _stage_out(self, src: np.ndarray, entry: HostEntry, shape, dtype: str) -> np.ndarray:
        out = entry.output
        if out is None:
            out = result_pool.empty(shape, dtype=ops.storage_dtype(dtype))
        if dtype == ops.BFLOAT16:
            ops.f32_to_bf16(src, _flat(out))
        else:
            np.copyto(_flat(out), src, casting="no")
        return out

    # -- dispatch -------------------------------------------------------------------------------------
    def execute(self, resp: Response, entries: Sequence[Optional[Entry[Any]]]) -> List[object]:
        """Run ``resp``; returns one result per entry (the output array, or a tuple for alltoall).

        The response's device says what the entries hold: negotiation refuses a tensor that is on the GPU on one
        rank and on the host on another, so this rank's entries of a device response are device arrays.
        """
        if resp.device >= 0 and resp.kind != ops.BARRIER:
            return self.devices.execute(resp, entries)
        return self.execute_on_host(resp, entries)

    def execute_on_host(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        """Run ``resp`` on host arrays with the CPU transports."""
        kind = resp.kind
        if kind == ops.ALLREDUCE:
            if resp.payload is not None:
                return self._inline_result(resp, entries)
            if resp.op == ops.Adasum:
                return self._adasum(resp, entries)
            return self._allreduce(resp, entries)
        if kind == ops.ALLGATHER:
            return self._allgather(resp, entries)
        if kind == ops.BROADCAST:
            return self._broadcast(resp, entries)
        if kind == ops.ALLTOALL:
            return self._alltoall(resp, entries)
        if kind == ops.REDUCESCATTER:
            return self._reducescatter(resp, entries)
        if kind == ops.BARRIER:
            self.transport_for(resp.process_set).barrier()
            return [None for _ in entries]
        raise ValueError(f"executor cannot run response kind {kind}")

    def _finish(self, buf: np.ndarray, resp: Response) -> None:
        """Postscale, then Average's division by the set size."""
        ops.finish_reduction(buf, resp.op, resp.postscale, len(self.set_ranks[resp.process_set]))

    def _finisher(self, resp: Response) -> Optional[ops.Finish]:
        """The same finish, for a transport to apply to each piece of an allreduce's result as it writes it."""
        return ops.finisher(resp.op, resp.postscale, len(self.set_ranks[resp.process_set]))

    # -- reductions -----------------------------------------------------------------------------------
    def _allreduce(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        transport = self.transport_for(resp.process_set)
        pre = resp.prescale
        op = ops.TRANSPORT_OP[resp.op]
        if len(entries) == 1 and entries[0] is not None and resp.dtype != ops.BFLOAT16:
            single = entries[0]
            tensor = single.input()
            if single.output is None:
                single.output = result_pool.empty_like(tensor)
            output = single.output
            buf = _flat(output)
            separate = output is not tensor and not np.shares_memory(output, tensor)
            if separate and pre == 1:
                # Reduced straight from the input into the result: one pass over memory less than copy + in place.
                transport.allreduce_into(_flat(tensor), buf, op, self._finisher(resp))
            else:
                if separate:
                    np.copyto(buf, _flat(tensor), casting="no")
                ops.scale_inplace(buf, pre)
                transport.allreduce_into(buf, buf, op, self._finisher(resp))
            return [output]
        counts = [prod(s) for s in resp.shapes]
        buf = self.fusion.get(sum(counts), ops.compute_dtype(resp.dtype))
        offset = 0
        for entry, shape, n in zip(entries, resp.shapes, counts):
            self._stage_in(entry, shape, buf[offset:offset + n], resp.dtype)
            offset += n
        ops.scale_inplace(buf, pre)
        transport.allreduce_into(buf, buf, op, self._finisher(resp))
        results: List[object] = []
        offset = 0
        for entry, shape, n in zip(entries, resp.shapes, counts):
            results.append(None if entry is None else self._stage_out(buf[offset:offset + n], entry, shape,
                                                                     resp.dtype))
            offset += n
        return results

    def _inline_result(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        """The coordinator already reduced this tiny tensor: copy its result out."""
        entry = entries[0]
        if entry is None:
            return [None]
        payload = resp.payload
        if not isinstance(payload, bytes):
            raise TypeError(f"an inline allreduce response for {resp.names[:3]} carries {type(payload).__name__}, "
                            f"expected the reduced bytes (an engine defect; please report)")
        return [deliver_inline(entry, payload, resp.dtype, resp.shapes[0])]

    def _adasum(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        """Adasum by recursive doubling: partners exchange vectors and combine them scale-invariantly."""
        transport = self.transport_for(resp.process_set)
        results: List[object] = []
        for entry, shape in zip(entries, resp.shapes):
            n = prod(shape)
            a = np.empty(n, dtype=np.float64)
            if entry is None or entry.tensor is None:
                a[...] = 0
            elif resp.dtype == ops.BFLOAT16:
                tmp = np.empty(n, dtype=np.float32)
                ops.bf16_to_f32(_flat(entry.tensor), tmp)
                a[...] = tmp
            else:
                a[...] = _flat(entry.tensor)
            a *= resp.prescale
            b = np.empty_like(a)
            distance = 1
            while distance < transport.size:
                partner = transport.rank ^ distance
                transport.sendrecv(a, partner, b, partner)
                # Both partners must combine in the same order to get bit-identical results.
                lo, hi = (a, b) if transport.rank < partner else (b, a)
                dot = float(np.dot(lo, hi))
                n_lo, n_hi = float(np.dot(lo, lo)), float(np.dot(hi, hi))
                c_lo = 1.0 - dot / (2 * n_lo) if n_lo > 1e-300 else 1.0
                c_hi = 1.0 - dot / (2 * n_hi) if n_hi > 1e-300 else 1.0
                a = c_lo * lo + c_hi * hi
                distance <<= 1
            a *= resp.postscale
            if entry is None:
                results.append(None)
                continue
            out = entry.output if entry.output is not None else result_pool.empty(shape,
                                                                                  ops.storage_dtype(resp.dtype))
            if resp.dtype == ops.BFLOAT16:
                ops.f32_to_bf16(a.astype(np.float32), _flat(out))
            else:
                _flat(out)[...] = a.astype(out.dtype, copy=False)
            entry.output = out
            results.append(out)
        return results

    def _reducescatter(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        transport = self.transport_for(resp.process_set)
        size, me = transport.size, transport.rank
        pre = resp.prescale
        cdt = ops.compute_dtype(resp.dtype)
        splits = [split_rows(shape[0], size) for shape in resp.shapes]
        rows = [_row_elems(shape) for shape in resp.shapes]
        counts = [sum(sp[p] * r for sp, r in zip(splits, rows)) for p in range(size)]
        if len(entries) == 1 and entries[0] is not None and resp.dtype != ops.BFLOAT16 and pre == 1.0:
            # One tensor is already laid out block by block: reduce straight from it into the result.
            single, shape = entries[0], resp.shapes[0]
            out = result_pool.empty((splits[0][me],) + tuple(shape[1:]), dtype=cdt)
            transport.reducescatter(_flat(single.input()), _flat(out), counts, ops.TRANSPORT_OP[resp.op])
            self._finish(out, resp)
            single.output = out
            return [out]
        send = self.fusion.get(sum(counts), cdt)
        # Lay out rank p's block as the concatenation of every tensor's p-th slice.
        offset = 0
        for p in range(size):
            for entry, sp, r in zip(entries, splits, rows):
                n = sp[p] * r
                start = sum(sp[:p]) * r
                src = None if entry is None else _flat(entry.input())[start:start + n]
                if src is None:
                    send[offset:offset + n] = 0
                elif resp.dtype == ops.BFLOAT16:
                    ops.bf16_to_f32(src, send[offset:offset + n])
                else:
                    np.copyto(send[offset:offset + n], src, casting="no")
                offset += n
        ops.scale_inplace(send, pre)
        recv = result_pool.empty(counts[me], dtype=cdt)
        transport.reducescatter(send, recv, counts, ops.TRANSPORT_OP[resp.op])
        self._finish(recv, resp)
        results: List[object] = []
        offset = 0
        for entry, shape, sp, r in zip(entries, resp.shapes, splits, rows):
            n = sp[me] * r
            out_shape = (sp[me],) + tuple(shape[1:])
            if entry is None:
                results.append(None)
            else:
                entry.output = None
                results.append(self._stage_out(recv[offset:offset + n], entry, out_shape, resp.dtype))
            offset += n
        return results

    # -- data movement --------------------------------------------------------------------------------
    def _allgather(self, resp: Response, slots: Sequence[Optional[HostEntry]]) -> List[object]:
        entries = own_entries(slots, "allgather")
        transport = self.transport_for(resp.process_set)
        size, me = transport.size, transport.rank
        sdt = ops.storage_dtype(resp.dtype)
        rows = [_row_elems(shape) for shape in resp.shapes]
        outputs = [result_pool.empty((sum(dims),) + tuple(shape[1:]), dtype=sdt)
                   for shape, dims in zip(resp.shapes, resp.first_dims)]
        if len(entries) == 1:
            counts = [d * rows[0] for d in resp.first_dims[0]]
            transport.allgatherv(_flat(entries[0].input()), _flat(outputs[0]), counts)
            return list(outputs)
        counts = [sum(dims[p] * r for dims, r in zip(resp.first_dims, rows)) for p in range(size)]
        send = self.fusion.get(counts[me], sdt)
        offset = 0
        for entry, dims, r in zip(entries, resp.first_dims, rows):
            n = dims[me] * r
            np.copyto(send[offset:offset + n], _flat(entry.input()), casting="no")
            offset += n
        recv = result_pool.empty(sum(counts), dtype=sdt)
        transport.allgatherv(send, recv, counts)
        offset = 0
        cursors = [0] * len(outputs)
        for p in range(size):
            for i, (dims, r) in enumerate(zip(resp.first_dims, rows)):
                n = dims[p] * r
                _flat(outputs[i])[cursors[i]:cursors[i] + n] = recv[offset:offset + n]
                cursors[i] += n
                offset += n
        return list(outputs)

    def _broadcast(self, resp: Response, slots: Sequence[Optional[HostEntry]]) -> List[object]:
        entries = own_entries(slots, "broadcast")
        transport = self.transport_for(resp.process_set)
        root = list(self.set_ranks[resp.process_set]).index(resp.root)
        sdt = ops.storage_dtype(resp.dtype)
        outputs: List[np.ndarray] = []
        for entry in entries:
            tensor = entry.input()
            if entry.output is None:
                entry.output = result_pool.empty_like(tensor)
            if entry.output is not tensor and transport.rank == root:
                np.copyto(entry.output, tensor, casting="no")
            outputs.append(entry.output)
        if len(entries) == 1:
            transport.broadcast(_flat(outputs[0]), root)
            return [outputs[0]]
        counts = [prod(s) for s in resp.shapes]
        buf = self.fusion.get(sum(counts), sdt)
        offset = 0
        if transport.rank == root:
            for out, n in zip(outputs, counts):
                np.copyto(buf[offset:offset + n], _flat(out), casting="no")
                offset += n
        transport.broadcast(buf, root)
        offset = 0
        for out, n in zip(outputs, counts):
            np.copyto(_flat(out), buf[offset:offset + n], casting="no")
            offset += n
        return list(outputs)

    def _alltoall(self, resp: Response, slots: Sequence[Optional[HostEntry]]) -> List[object]:
        entries = own_entries(slots, "alltoall")
        transport = self.transport_for(resp.process_set)
        me = transport.rank
        sdt = ops.storage_dtype(resp.dtype)
        results: List[object] = []
        for entry, matrix in zip(entries, resp.splits):
            tensor = entry.input()
            shape = tensor.shape
            r = _row_elems(shape)
            send_rows = matrix[me]
            recv_rows = [matrix[p][me] for p in range(transport.size)]
            out = result_pool.empty((sum(recv_rows),) + tuple(shape[1:]), dtype=sdt)
            transport.alltoallv(_flat(tensor), [s * r for s in send_rows], _flat(out),
                                [s * r for s in recv_rows])
            results.append((out, np.asarray(recv_rows, dtype=np.int32)))
        return results
