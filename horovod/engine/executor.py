"""Executes planned responses: host arrays on the set's CPU transport, device arrays by the device executor.

Runs only on the background thread.  The per-kind algorithms (fusion buffer in, prescale, collective, finish,
fusion buffer out) are :mod:`horovod.engine.algorithms`, shared with the NCCL path; here they run over host memory
(:class:`~horovod.engine.memory.HostMemory`) with the transport as the data plane.  Adasum (recursive doubling on
the transport) and the coordinator's inline results of tiny allreduces are the host's own.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from horovod.engine import algorithms, ops, result_pool
from horovod.engine.handles import Entry, HostEntry
from horovod.engine.memory import HostMemory
from horovod.engine.messages import Response
from horovod.transport.base import Transport


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


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
        self.memory = HostMemory()   # and its fusion buffer
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
        if kind == ops.ALLREDUCE and resp.payload is not None:
            return self._inline_result(resp, entries)
        if kind == ops.ALLREDUCE and resp.op == ops.Adasum:
            return self._adasum(resp, entries)
        transport = self.transport_for(resp.process_set)
        if kind == ops.BARRIER:
            transport.barrier()
            return [None for _ in entries]
        reduces = kind == ops.ALLREDUCE or kind == ops.REDUCESCATTER
        finish = ops.finisher(resp.op, resp.postscale, transport.size) if reduces else None
        if kind == ops.ALLREDUCE:   # the hot path: straight to its algorithm
            return algorithms.allreduce(self.memory, transport, resp, entries, ops.TRANSPORT_OP[resp.op], finish)
        return algorithms.run(self.memory, transport, resp, entries, ops.TRANSPORT_OP.get(resp.op, ""), finish,
                              self.set_ranks[resp.process_set])

    def _inline_result(self, resp: Response, entries: Sequence[Optional[HostEntry]]) -> List[object]:
        """The coordinator already reduced this tiny tensor: copy its result into the entry's output (allocated
        when the call returns a new one)."""
        entry, payload, dtype = entries[0], resp.payload, ops.storage_dtype(resp.dtype)
        if entry is None:
            return [None]
        if not isinstance(payload, bytes):
            raise TypeError(f"an inline allreduce response for {resp.names[:3]} carries {type(payload).__name__}, "
                            f"expected the reduced bytes (an engine defect; please report)")
        if entry.output is None:
            entry.output = result_pool.empty(resp.shapes[0], dtype=dtype)
        np.copyto(_flat(entry.output), np.frombuffer(payload, dtype=dtype), casting="no")
        return [entry.output]

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
