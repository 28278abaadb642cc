"""Executes responses whose tensors live on a GPU: NCCL on the engine's streams, or staged through host memory.

The coordinator ordered these responses like any other; the :class:`~horovod.engine.executor.Executor` hands
those marked with a device here.  Per process set, the members agree once (over the set's CPU transport, in
response order, so every member does it at the same point) on how the set's device collectives run:

- **NCCL** when every member can load NCCL and none asked for ``HOROVOD_GPU_OPERATIONS=HOST``, and no two members
  share one GPU (NCCL refuses that before 2.30; from 2.30 on it is allowed with ``NCCL_MULTI_RANK_GPU_ENABLE=1``).
  Communicators are created lazily, one per engine stream (``HOROVOD_NUM_NCCL_STREAMS``), their unique ids sent
  over the set's CPU transport.  The engine's stream waits for each input's ``ready`` event, the collective runs
  there (fusion buffer, prescale, postscale and Average on the device), and a ``done`` event lets the consumer's
  stream wait: the host never waits for the GPU on this path.
- **HOST** otherwise (with a one-line notice saying why): each input is copied asynchronously into pinned host
  memory on the engine's stream, the host executor runs the collective on the CPU transport, and the result is
  copied back.  Correct for any number of ranks on one GPU, and for what NCCL cannot reduce (int16, uint16;
  Adasum).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import time
import zlib
from math import prod
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import device as devices
from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend
from horovod.engine.handles import Entry
from horovod.engine.messages import Response
from horovod.transport import nccl
from horovod.transport.base import TransportError
from horovod.transport.nccl_lib import MULTI_RANK_GPU_VERSION, NcclError, NcclLibrary, NcclUnavailable, load

logger = logging.getLogger(__name__)

NCCL, HOST = "NCCL", "HOST"
_VERSION_2_30 = MULTI_RANK_GPU_VERSION[0] * 10000 + MULTI_RANK_GPU_VERSION[1] * 100


@dataclasses.dataclass(frozen=True)
class DeviceOptions:
    """The knobs of the device data plane (from :class:`horovod.engine.config.Config`)."""

    operations: str = ""            # HOROVOD_GPU_OPERATIONS: "", "NCCL" or "HOST"
    nccl_path: str = ""             # HOROVOD_NCCL_SO_PATH
    streams: int = 1                # HOROVOD_NUM_NCCL_STREAMS
    multi_rank_gpu: bool = False    # NCCL_MULTI_RANK_GPU_ENABLE

    @classmethod
    def from_config(cls, config: Any) -> "DeviceOptions":
        return cls(str(getattr(config, "gpu_operations", "") or "").upper(),
                   str(getattr(config, "nccl_so_path", "") or ""),
                   max(1, int(getattr(config, "num_nccl_streams", 1) or 1)),
                   bool(getattr(config, "nccl_multi_rank_gpu", False)))


@dataclasses.dataclass
class SetPlane:
    """How one process set runs its device collectives."""

    mode: str
    reason: str = ""
    comms: List[nccl.NcclComm] = dataclasses.field(default_factory=list)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _identity(host: str, device_id: str) -> int:
    """A 62-bit number naming one physical GPU of one host (equal on two ranks sharing a GPU)."""
    digest = zlib.crc32(host.encode()) << 31 ^ zlib.crc32(device_id.encode())
    return digest & ((1 << 62) - 1)


def choose_mode(records: np.ndarray, size: int) -> Tuple[str, str]:
    """The mode every member derives from the members' records ``[nccl version, wants nccl, gpu identity,
    multi-rank enabled]`` (one row per member, in set order), and why when it is HOST.  Pure; unit-tested."""
    versions, wants, gpus, multi = records[:, 0], records[:, 1], records[:, 2], records[:, 3]
    if not wants.all():
        return HOST, "HOROVOD_GPU_OPERATIONS=HOST (or device memory NCCL cannot use)"
    if not versions.all():
        missing = [int(r) for r in np.flatnonzero(versions == 0)]
        return HOST, f"NCCL could not be loaded on set rank{'s' if len(missing) > 1 else ''} " \
                     f"{', '.join(map(str, missing))}"
    if len(set(gpus.tolist())) < size:
        shared = sorted({int(g) for g in gpus.tolist() if (gpus == g).sum() > 1})
        ranks = [int(r) for r in np.flatnonzero(np.isin(gpus, shared))]
        if not ((versions >= _VERSION_2_30).all() and multi.all()):
            return HOST, (f"set ranks {', '.join(map(str, ranks))} share one GPU, which NCCL refuses before 2.30 "
                          f"(from 2.30 on, set NCCL_MULTI_RANK_GPU_ENABLE=1; or give each rank its own GPU with "
                          f"torch.cuda.set_device(hvd.local_rank()))")
    return NCCL, ""


class DeviceExecutor:
    """Runs device responses for one rank (see the module docstring).

    Args:
        host: the rank's host executor (its transports, set ranks, and the collectives HOST mode delegates to).
        options: the device knobs.
    """

    def __init__(self, host: Any, options: DeviceOptions):
        self.host = host
        self.options = options
        self._planes: Dict[int, SetPlane] = {}
        self._lib: Optional[NcclLibrary] = None
        self._lib_error = ""
        self._streams: Dict[Tuple[int, int], Any] = {}
        self._fusion: Dict[Tuple[int, int], DeviceArray] = {}
        self._pinned = np.empty(0, np.uint8)
        self._turn = 0

    # -- entry point ------------------------------------------------------------------------------------
    def execute(self, resp: Response, entries: List[Optional[Entry]]) -> List[object]:
        backend, device = self._backend_of(entries)
        backend.set_device(device)
        plane = self._plane(resp.process_set, backend, device)
        if plane.mode == HOST or not self._nccl_can_run(resp):
            return self._staged(resp, entries, backend, device)
        index = self._turn % len(plane.comms)
        self._turn += 1
        comm = plane.comms[index]
        stream = self._stream(backend, device, index)
        for entry in entries:
            if entry is not None and entry.tensor is not None and entry.tensor.ready is not None:
                backend.wait(stream, entry.tensor.ready)
        run = _NcclRun(self, backend, device, stream, index, comm, resp)
        try:
            results = run.execute(entries)
        except NcclError as exc:
            raise TransportError(f"NCCL {ops.KIND_NAMES.get(resp.kind, resp.kind)} of {resp.names[:3]} failed: "
                                 f"{exc}") from exc
        error = comm.async_error()
        if error is not None:
            raise TransportError(f"NCCL reported an asynchronous failure: {error}; a peer may have died")
        run.finish(entries, results)
        return results

    def close(self, abort: bool = True, timeout: float = 30.0) -> None:
        """Free the communicators: aborted after a failure (kernels waiting for a dead peer end); after an orderly
        shutdown destroyed once the engine's streams finished (aborted if they have not within ``timeout``)."""
        if not abort and self._streams:
            backend = devices.default_backend()
            deadline = time.monotonic() + timeout
            pending = [backend.record(s) for s in self._streams.values()] if backend is not None else []
            while pending and time.monotonic() < deadline:
                pending = [e for e in pending if not backend.query(e)]
                if pending:
                    time.sleep(0.001)
            abort = bool(pending)
        for plane in self._planes.values():
            for comm in plane.comms:
                try:
                    comm.abort() if abort else comm.destroy()
                except Exception:   # teardown must not mask the error that caused it
                    logger.debug("freeing an NCCL communicator failed", exc_info=True)
            plane.comms.clear()
        self._planes.clear()

    def mode(self, set_id: int) -> Optional[str]:
        plane = self._planes.get(set_id)
        return plane.mode if plane is not None else None

    # -- set-up ---------------------------------------------------------------------------------------
    @staticmethod
    def _backend_of(entries: Sequence[Optional[Entry]]) -> Tuple[DeviceBackend, int]:
        for entry in entries:
            if entry is not None and isinstance(entry.tensor, DeviceArray):
                return entry.tensor.backend, entry.tensor.device
        backend = devices.default_backend()   # joined: no tensor of its own, takes part with zeros
        if backend is None:
            raise RuntimeError("a GPU collective reached a rank with no device framework imported; import the "
                               "same binding (e.g. horovod.torch) on every rank")
        return backend, backend.current_device()

    def _library(self) -> Optional[NcclLibrary]:
        if self._lib is None and not self._lib_error:
            try:
                self._lib = load(self.options.nccl_path)
            except NcclUnavailable as exc:
                self._lib_error = str(exc)
        return self._lib

    def _plane(self, set_id: int, backend: DeviceBackend, device: int) -> SetPlane:
        plane = self._planes.get(set_id)
        if plane is not None:
            return plane
        transport = self.host.transport_for(set_id)
        wants = self.options.operations != HOST and backend.nccl_capable
        lib = self._library() if wants else None
        version = 0
        if lib is not None:
            major, minor, patch = lib.version
            version = major * 10000 + minor * 100 + patch
        mine = np.array([version, int(wants), _identity(socket.gethostname(), backend.device_id(device)),
                         int(self.options.multi_rank_gpu)], dtype=np.int64)
        records = np.empty(4 * transport.size, dtype=np.int64)
        transport.allgatherv(mine, records, [4] * transport.size)
        mode, reason = choose_mode(records.reshape(transport.size, 4), transport.size)
        if mode == HOST and self.options.operations == NCCL:
            raise NcclUnavailable(f"HOROVOD_GPU_OPERATIONS=NCCL, but NCCL cannot serve process set {set_id}: "
                                  f"{reason}" + (f" ({self._lib_error})" if self._lib_error else ""))
        plane = SetPlane(mode, reason)
        if mode == HOST:
            if transport.rank == 0:
                logger.warning("horovod: GPU collectives of process set %d are staged through host memory: %s.",
                               set_id, reason)
        else:
            plane.comms = self._communicators(lib, transport)
        self._planes[set_id] = plane
        return plane

    def _communicators(self, lib: NcclLibrary, transport) -> List[nccl.NcclComm]:
        """One communicator per engine stream; set rank 0 makes the ids and broadcasts them."""
        self._mark("INIT_NCCL", True)
        ids = np.zeros(128 * self.options.streams, dtype=np.uint8)
        if transport.rank == 0:
            ids[:] = np.frombuffer(b"".join(nccl.unique_id(lib) for _ in range(self.options.streams)), np.uint8)
        transport.broadcast(ids, 0)
        comms = [nccl.NcclComm(lib, ids[128 * i:128 * (i + 1)].tobytes(), transport.size, transport.rank)
                 for i in range(self.options.streams)]
        self._mark("INIT_NCCL", False)
        return comms

    def _mark(self, activity: str, begin: bool) -> None:
        timeline = self.host.timeline_of()
        if timeline is not None:
            timeline.activity(activity, begin)

    def _nccl_can_run(self, resp: Response) -> bool:
        """NCCL reduces neither int16/uint16 nor (before 2.10) bfloat16, and Adasum is a host algorithm."""
        if resp.kind in (ops.ALLREDUCE, ops.REDUCESCATTER):
            return resp.op != ops.Adasum and nccl.reduction_dtype(resp.dtype, self._lib.has_avg) is not None
        return True

    def _stream(self, backend: DeviceBackend, device: int, index: int) -> Any:
        stream = self._streams.get((device, index))
        if stream is None:
            stream = self._streams[(device, index)] = backend.new_stream(device)
        return stream

    def fusion_buffer(self, backend: DeviceBackend, device: int, index: int, nbytes: int,
                      stream: Any) -> DeviceArray:
        """The reusable device fusion buffer of one stream (grown on demand; used on that stream only)."""
        buf = self._fusion.get((device, index))
        if buf is None or buf.nbytes < nbytes:
            grown = max(nbytes, 2 * buf.nbytes if buf is not None else 0)
            buf = self._fusion[(device, index)] = backend.empty((grown,), "uint8", device, stream)
        return buf

    # -- HOST mode ----------------------------------------------------------------------------------------
    def _staged(self, resp: Response, entries: List[Optional[Entry]], backend: DeviceBackend,
                device: int) -> List[object]:
        """Copy inputs to pinned host memory, run the host executor, copy results back."""
        stream = self._stream(backend, device, 0)
        total = sum(e.tensor.nbytes for e in entries if e is not None and e.tensor is not None)
        if self._pinned.nbytes < total:
            self._pinned = backend.pinned(max(total, 2 * self._pinned.nbytes))
        host_entries: List[Optional[Entry]] = []
        offset = 0
        for entry in entries:
            if entry is None or entry.tensor is None:
                host_entries.append(entry)
                continue
            src = entry.tensor
            if src.ready is not None:
                backend.wait(stream, src.ready)
            host = self._pinned[offset:offset + src.nbytes].view(src.dtype).reshape(src.shape)
            offset += src.nbytes
            backend.to_host(host, src, stream)
            inplace = entry.output is entry.tensor
            host_entries.append(dataclasses.replace(entry, tensor=host, output=host if inplace else None))
        backend.synchronize(stream)
        results = self.host.execute_on_host(resp, host_entries)
        out: List[object] = []
        for entry, result in zip(entries, results):
            if entry is None or result is None:
                out.append(None)
                continue
            if isinstance(result, tuple):   # alltoall: (rows, received splits)
                out.append((self._upload(result[0], None, resp.dtype, backend, device, stream), result[1]))
            else:
                target = entry.output if isinstance(entry.output, DeviceArray) else None
                out.append(self._upload(result, target, resp.dtype, backend, device, stream))
        done = backend.record(stream)
        _mark_done(entries, out, done, backend, stream)
        return out

    @staticmethod
    def _upload(array: np.ndarray, target: Optional[DeviceArray], dtype: str, backend: DeviceBackend, device: int,
                stream: Any) -> DeviceArray:
        if target is None or target.shape != tuple(array.shape):
            target = backend.empty(array.shape, dtype, device, stream)
        backend.to_device(target, np.ascontiguousarray(array), stream)
        return target


def _mark_done(entries: Sequence[Optional[Entry]], results: Sequence[object], done: Any,
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


class _NcclRun:
    """One response on NCCL: the per-kind algorithms, over the backend's memory operations."""

    def __init__(self, owner: DeviceExecutor, backend: DeviceBackend, device: int, stream: Any, index: int,
                 comm: nccl.NcclComm, resp: Response):
        self.owner, self.backend, self.device, self.stream, self.index = owner, backend, device, stream, index
        self.comm, self.resp = comm, resp
        self.handle = backend.stream_handle(stream)
        self.set_size = len(owner.host.set_ranks[resp.process_set])

    def execute(self, entries: List[Optional[Entry]]) -> List[object]:
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

    def finish(self, entries: List[Optional[Entry]], results: List[object]) -> None:
        _mark_done(entries, results, self.backend.record(self.stream), self.backend, self.stream)

    # -- helpers --------------------------------------------------------------------------------------
    def _empty(self, shape: Sequence[int], dtype: str) -> DeviceArray:
        return self.backend.empty(tuple(shape), dtype, self.device, self.stream)

    def _fusion(self, count: int, dtype: str) -> DeviceArray:
        itemsize = ops.storage_dtype(dtype).itemsize
        raw = self.owner.fusion_buffer(self.backend, self.device, self.index, count * itemsize, self.stream)
        return self.backend.slice(raw, 0, count, dtype)

    def _piece(self, buf: DeviceArray, start: int, count: int) -> DeviceArray:
        return self.backend.slice(buf, start, count, self.resp.dtype)

    def _stage_in(self, entry: Optional[Entry], dst: DeviceArray) -> None:
        if entry is None or entry.tensor is None:
            self.backend.fill_zero(dst, self.stream)
        else:
            self.backend.copy(dst, entry.tensor, self.stream)

    def _output(self, entry: Entry, shape: Sequence[int]) -> DeviceArray:
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
        floating = resp.dtype in ("float16", "float32", "float64", "bfloat16")
        if resp.op == ops.Average and floating and lib.has_avg and resp.postscale == 1.0:
            return dtype, nccl.AVG, True
        return dtype, nccl.reduction_op(ops.TRANSPORT_OP[resp.op], resp.dtype), False

    # -- reductions -------------------------------------------------------------------------------------
    def _allreduce(self, entries: List[Optional[Entry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        dtype, op, averaged = self._reduce_args()
        if len(entries) == 1 and entries[0] is not None:
            entry = entries[0]
            out = self._output(entry, resp.shapes[0])
            src = entry.tensor
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

    def _reducescatter(self, entries: List[Optional[Entry]]) -> List[object]:
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
    def _allgather(self, entries: List[Optional[Entry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        size, me = self.comm.size, self.comm.rank
        item = ops.storage_dtype(resp.dtype).itemsize
        rows = [ops.row_elems(shape) for shape in resp.shapes]
        outputs = [self._empty((sum(dims),) + tuple(shape[1:]), resp.dtype)
                   for shape, dims in zip(resp.shapes, resp.first_dims)]
        counts = [sum(dims[p] * r for dims, r in zip(resp.first_dims, rows)) for p in range(size)]
        if len(entries) == 1:
            send, recv = entries[0].tensor, outputs[0]
        else:
            send = self._fusion(counts[me], resp.dtype)
            offset = 0
            for entry, dims, r in zip(entries, resp.first_dims, rows):
                n = dims[me] * r
                backend.copy(self._piece(send, offset, n), entry.tensor, stream)
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
        return outputs

    def _broadcast(self, entries: List[Optional[Entry]]) -> List[object]:
        resp, backend, stream = self.resp, self.backend, self.stream
        root = list(self.owner.host.set_ranks[resp.process_set]).index(resp.root)
        item = ops.storage_dtype(resp.dtype).itemsize
        is_root = self.comm.rank == root
        for entry in entries:
            out = self._output(entry, entry.tensor.shape)
            if out is not entry.tensor and is_root:
                backend.copy(out, entry.tensor, stream)
        if len(entries) == 1:
            out = entries[0].output
            self.comm.broadcast(out.ptr, out.ptr, out.nbytes, nccl.BYTES, root, self.handle)
            return [out]
        counts = [prod(s) for s in resp.shapes]
        buf = self._fusion(sum(counts), resp.dtype)
        offset = 0
        if is_root:
            for entry, n in zip(entries, counts):
                backend.copy(self._piece(buf, offset, n), entry.output, stream)
                offset += n
        self.comm.broadcast(buf.ptr, buf.ptr, buf.size * item, nccl.BYTES, root, self.handle)
        offset = 0
        for entry, n in zip(entries, counts):
            backend.copy(entry.output, self._piece(buf, offset, n), stream)
            offset += n
        return [e.output for e in entries]

    def _alltoall(self, entries: List[Optional[Entry]]) -> List[object]:
        resp = self.resp
        size, me = self.comm.size, self.comm.rank
        item = ops.storage_dtype(resp.dtype).itemsize
        results: List[object] = []
        for entry, matrix in zip(entries, resp.splits):
            shape = entry.tensor.shape
            r = ops.row_elems(shape)
            send_rows = matrix[me]
            recv_rows = [matrix[p][me] for p in range(size)]
            out = self._empty((sum(recv_rows),) + tuple(shape[1:]), resp.dtype)
            with self.comm.group():
                sent = received = 0
                for p in range(size):
                    n_send, n_recv = send_rows[p] * r, recv_rows[p] * r
                    if n_send:
                        self.comm.send(self._piece(entry.tensor, sent, n_send).ptr, n_send * item, nccl.BYTES, p,
                                       self.handle)
                    if n_recv:
                        self.comm.recv(self._piece(out, received, n_recv).ptr, n_recv * item, nccl.BYTES, p,
                                       self.handle)
                    sent += n_send
                    received += n_recv
            results.append((out, np.asarray(recv_rows, dtype=np.int32)))
        return results
