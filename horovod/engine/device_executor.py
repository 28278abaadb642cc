"""Executes responses whose tensors live on a GPU: NCCL on the engine's streams, or staged through host memory.

The coordinator ordered these responses like any other; the :class:`~horovod.engine.executor.Executor` hands
those marked with a device here.  Per process set, the members agree once (over the set's CPU transport, in
response order, so every member does it at the same point) on how the set's device collectives run:

- **NCCL** when every member can load NCCL and none asked for ``HOROVOD_GPU_OPERATIONS=HOST``, and no two members
  share one GPU (NCCL refuses that before 2.30; from 2.30 on it is allowed with ``NCCL_MULTI_RANK_GPU_ENABLE=1``).
  Communicators are created lazily, one per engine stream (``HOROVOD_NUM_NCCL_STREAMS``), their unique ids sent
  over the set's CPU transport.  The engine's stream waits for each input's ``ready`` event, the collective runs
  there (fusion buffer, prescale, postscale and Average on the device: :mod:`horovod.engine.device_nccl`), and a
  ``done`` event lets the consumer's stream wait: the host never waits for the GPU on this path.
- **HOST** otherwise (with a one-line notice saying why): each input is copied asynchronously into pinned host
  memory on the engine's stream, the host executor runs the collective on the CPU transport, and the result is
  copied back.  Correct for any number of ranks on one GPU, and for what NCCL cannot reduce (int16, uint16;
  Adasum).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import time
import zlib
from typing import Any, DefaultDict, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from horovod.engine import config as knobs
from horovod.engine import device as devices
from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend
from horovod.engine.device_nccl import mark_done, nccl_run
from horovod.engine.device_watchdog import Pending, Settled, Watchdog
from horovod.engine.handles import DeviceEntry, Entry, HostEntry
from horovod.engine.memory import PinnedStage
from horovod.engine.messages import Response
from horovod.transport import nccl
from horovod.transport.base import Transport, TransportError
from horovod.transport.hierarchical import host_groups, node_key
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
    operation_timeout: float = 600.0   # HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS (the watchdog)
    init_timeout: float = 30.0      # HOROVOD_GLOO_TIMEOUT_SECONDS: creating and connecting communicators
    fusion_cap: int = 128 << 20     # HOROVOD_FUSION_THRESHOLD: the device fusion buffer doubles up to this
    hierarchical: bool = False      # HOROVOD_HIERARCHICAL_ALLREDUCE: NCCL inside hosts, the CPU transport across

    @classmethod
    def from_config(cls, config: Any) -> "DeviceOptions":
        return cls(str(getattr(config, "gpu_operations", "") or "").upper(),
                   str(getattr(config, "nccl_so_path", "") or ""),
                   max(1, int(getattr(config, "num_nccl_streams", 1) or 1)),
                   bool(getattr(config, "nccl_multi_rank_gpu", False)),
                   float(getattr(config, "gpu_operation_timeout_seconds", 600.0)),
                   float(getattr(config, "gloo_timeout_seconds", 30) or 30),
                   int(getattr(config, "fusion_threshold", 128 << 20) or (64 << 20)),
                   bool(getattr(config, "hierarchical_allreduce", False)))


@dataclasses.dataclass
class SetPlane:
    """How one process set runs its device collectives."""

    mode: str
    reason: str = ""
    comms: List[nccl.NcclComm] = dataclasses.field(default_factory=list)
    # Which communicator the set's next collective takes: per set, so that every member of the set picks the same
    # one for the same response (one counter per executor, bumped by other sets' responses, made members differ).
    turn: int = 0
    # Hierarchical allreduce: per stream, a communicator over this host's members, and the CPU transport over the
    # members with this rank's place in its host (empty and None: allreduce runs on the flat communicators).
    local: List[nccl.NcclComm] = dataclasses.field(default_factory=list)
    cross: Optional[Transport] = None


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
        self._retired: List[nccl.NcclComm] = []   # removed sets' communicators, destroyed once their work is done
        self._lib: Optional[NcclLibrary] = None
        self._lib_error = ""
        self._streams: Dict[Tuple[int, int], Any] = {}
        self._fusion: Dict[Tuple[int, int], DeviceArray] = {}
        self._fusion_need: Dict[Tuple[int, int], Tuple[int, int]] = {}   # (largest need, uses) since last check
        # Per stream: the pinned buffer of host staging and of a hierarchical allreduce's step across hosts.
        self._stages: DefaultDict[Tuple[int, int], PinnedStage] = collections.defaultdict(PinnedStage)
        self._implicit_order = False
        self._last: Optional[Tuple[int, Any]] = None   # (stream index, done event) of the last NCCL collective
        self.watchdog = Watchdog(options.operation_timeout, self._abort_all, self._failed,
                                 int(getattr(host, "rank", 0)))

    # -- entry point ------------------------------------------------------------------------------------
    def execute(self, resp: Response, entries: Sequence[Optional[DeviceEntry]]) -> List[object]:
        if self.watchdog.failure is not None:
            raise self.watchdog.failure
        if self._retired:
            self._reap()
        backend, device = self._backend_of(entries)
        backend.set_device(device)
        plane = self._plane(resp.process_set, backend, device)
        if plane.mode == HOST or not self._nccl_can_run(resp):
            return self._staged(resp, entries, backend, device)
        index = plane.turn % len(plane.comms)
        plane.turn += 1
        comm = plane.comms[index]
        stream = self._stream(backend, device, index)
        last = self._last
        if last is not None and last[0] != index and not self._implicit_order:
            # Kernels of several communicators on several streams must launch in one order on every rank (NCCL
            # before 2.26, or without NCCL_LAUNCH_ORDER_IMPLICIT=1): this stream waits for the previous collective.
            backend.wait(stream, last[1])
        for entry in entries:
            if entry is not None and entry.tensor is not None and entry.tensor.ready is not None:
                backend.wait(stream, entry.tensor.ready)
                backend.release(entry.tensor.ready)   # the wait captured it: the event may be recorded anew
                entry.tensor.ready = None
        hierarchy = None if plane.cross is None else (plane.local[index], plane.cross, self._stages[(device, index)])
        try:
            results = nccl_run(backend, device, stream, comm, resp, self.host.set_ranks[resp.process_set],
                               lambda nbytes: self.fusion_buffer(backend, device, index, nbytes, stream), entries,
                               hierarchy)
        except NcclError as exc:
            raise TransportError(f"NCCL {ops.KIND_NAMES.get(resp.kind, resp.kind)} of {resp.names[:3]} failed on "
                                 f"rank {self.host.rank}: {exc}") from exc
        done = backend.record(stream)
        mark_done(entries, results, done)
        if len(plane.comms) > 1:
            self._last = (index, done)
        self._track(resp, entries, done, backend, [comm] + ([plane.local[index]] if hierarchy else []))
        return results

    def _track(self, resp: Response, entries: Sequence[Optional[DeviceEntry]], done: Any, backend: DeviceBackend,
               comms: Sequence[nccl.NcclComm]) -> None:
        """Hand the response's GPU work to the watchdog and let its handles' ``poll`` ask for the event."""
        handles: List[Any] = []
        for entry in entries:
            if entry is not None and all(h is not entry.handle for h in handles):
                handles.append(entry.handle)
        item = Pending(done, backend, lambda: _describe(resp), handles, comms, time.monotonic())
        for handle in handles:
            settled = handle.settled
            if not isinstance(settled, Settled):
                settled = handle.settled = Settled()
            settled.items.append(item)
        self.watchdog.track(item)

    def settle(self, timeout: Optional[float] = None) -> None:
        """Block until the GPU work enqueued so far completed (elastic ``commit()``: never save state computed by a
        collective that failed on the GPU).

        Raises:
            TransportError: the watchdog failed (a collective timed out or NCCL reported an error).
        """
        self.watchdog.settle(timeout)

    def forget_set(self, set_id: int) -> None:
        """A removed process set: its communicators are destroyed once the GPU finished their work."""
        plane = self._planes.pop(set_id, None)
        if plane is not None and plane.comms:
            self._retired.extend(plane.comms + plane.local)
            plane.comms, plane.local = [], []
            self._reap()

    def _reap(self) -> None:
        idle = [c for c in self._retired if not self.watchdog.busy([c])]
        self._retired = [c for c in self._retired if self.watchdog.busy([c])]
        for comm in idle:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001  (freeing must not fail the next collective)
                logger.debug("destroying a removed set's NCCL communicator failed", exc_info=True)

    def _abort_all(self) -> None:
        planes = list(self._planes.values())
        for comm in [c for plane in planes for c in plane.comms + plane.local] + list(self._retired):
            comm.abort()

    def _failed(self, error: BaseException) -> None:
        """The watchdog failed: tell the engine (its hook, when it set one) so it fails at once, not at the next
        GPU collective."""
        notify = getattr(self.host, "on_device_failure", None)
        if notify is not None:
            notify(error)

    def close(self, abort: bool = True, timeout: float = 30.0, reason: str = "") -> Optional[TransportError]:
        """Free the communicators: aborted after a failure (kernels waiting for a dead peer end); after an orderly
        shutdown destroyed once the engine's streams finished (aborted if they have not within ``timeout``).

        Returns:
            The device plane's failure, also when aborting lost GPU work still pending (elastic ``commit()`` must
            not save state computed from it); ``None`` when nothing was lost.
        """
        if not abort and self.watchdog.failure is None:
            try:
                self.watchdog.settle(timeout)
            except (TransportError, TimeoutError):
                abort = True
        elif self.watchdog.failure is not None:
            abort = True
        if abort:
            # Pending work fails with why the engine ended (often a peer's watchdog, relayed), not only that it did.
            self.watchdog.abandon(f"the engine of rank {self.host.rank} ended after a failure"
                                  + (f" ({reason})" if reason else ""))
        self.watchdog.stop()
        for comm in [c for plane in self._planes.values() for c in plane.comms + plane.local] + self._retired:
            try:
                comm.abort() if abort else comm.destroy()
            except Exception:   # teardown must not mask the error that caused it
                logger.debug("freeing an NCCL communicator failed", exc_info=True)
        self._retired = []
        self._planes.clear()
        return self.watchdog.failure

    def mode(self, set_id: int) -> Optional[str]:
        plane = self._planes.get(set_id)
        return plane.mode if plane is not None else None

    # -- set-up ---------------------------------------------------------------------------------------
    @staticmethod
    def _backend_of(entries: Sequence[Optional[DeviceEntry]]) -> Tuple[DeviceBackend, int]:
        for entry in entries:
            if entry is not None and isinstance(entry.tensor, DeviceArray):
                return entry.tensor.backend, entry.tensor.device
        backend = devices.default_backend()   # joined: no tensor of its own, takes part with zeros
        if backend is None:
            raise RuntimeError("a GPU collective reached a rank with no device framework imported; import the "
                               "same binding (e.g. horovod.torch) on every rank")
        device = devices.join_device()   # hvd.join(device=...), or the device current on the joining thread
        return backend, backend.current_device() if device is None else device

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
        version = lib.version_code if lib is not None else 0
        host = node_key(knobs.environ().get("HOROVOD_HOSTNAME") or socket.gethostname())
        mine = np.array([version, int(wants), _identity(socket.gethostname(), backend.device_id(device)),
                         int(self.options.multi_rank_gpu), _identity(host, ""), int(self.options.hierarchical)],
                        dtype=np.int64)
        records = np.empty(6 * transport.size, dtype=np.int64).reshape(transport.size, 6)
        transport.allgatherv(mine, records.reshape(-1), [6] * transport.size)
        mode, reason = choose_mode(records[:, :4], transport.size)
        if mode == HOST and self.options.operations == NCCL:
            raise NcclUnavailable(f"HOROVOD_GPU_OPERATIONS=NCCL, but NCCL cannot serve process set {set_id}: "
                                  f"{reason}" + (f" ({self._lib_error})" if self._lib_error else ""))
        plane = SetPlane(mode, reason)
        if mode == HOST:
            if transport.rank == 0:
                logger.warning("horovod: GPU collectives of process set %d are staged through host memory: %s.",
                               set_id, reason)
        else:
            plane.comms = self._communicators(self._loaded(), transport, set_id)
            if records[:, 5].all():   # every member asked for it (HOROVOD_HIERARCHICAL_ALLREDUCE=1)
                self._hierarchy(plane, transport, [str(h) for h in records[:, 4].tolist()], set_id)
        self._planes[set_id] = plane
        return plane

    def _hierarchy(self, plane: SetPlane, transport: Transport, hosts: List[str], set_id: int) -> None:
        """Communicators inside this host and the CPU transport across hosts, when the set spans hosts with the
        same number (more than one) of members each; otherwise allreduce stays on the flat communicators."""
        groups = host_groups(hosts)
        if len(groups) < 2 or len({len(g) for g in groups}) != 1 or len(groups[0]) < 2:
            return
        mine = next(g for g in groups if transport.rank in g)
        plane.local = self._communicators(self._loaded(), transport.subgroup(mine), set_id)
        plane.cross = transport.subgroup([g[mine.index(transport.rank)] for g in groups])

    def _loaded(self) -> NcclLibrary:
        """The NCCL library of a set in NCCL mode (which every member, this one included, could load)."""
        if self._lib is None:
            raise RuntimeError(f"a process set runs its GPU collectives on NCCL, but this rank has not loaded NCCL "
                               f"({self._lib_error or 'never tried'}); an engine defect, please report")
        return self._lib

    def _launch_order(self, lib: NcclLibrary) -> None:
        """Several streams: let NCCL (2.26+) order the communicators' kernels by issue order, unless the user
        decided; otherwise the executor makes each stream wait for the previous collective (see execute)."""
        if self.options.streams < 2 or not lib.implicit_order:
            return
        chosen = knobs.environ().get("NCCL_LAUNCH_ORDER_IMPLICIT")
        if chosen is None:
            knobs.set_environ("NCCL_LAUNCH_ORDER_IMPLICIT", "1")   # read by NCCL when it creates a communicator
            chosen = "1"
        self._implicit_order = chosen.strip() not in ("", "0")

    def _communicators(self, lib: NcclLibrary, transport, set_id: int) -> List[nccl.NcclComm]:
        """One communicator per engine stream; set rank 0 makes the ids and broadcasts them.  Created non-blocking
        where NCCL can (2.17+), polled against the liveness timeout: a frozen member fails the job, not hangs it."""
        self._mark("INIT_NCCL", True)
        self._launch_order(lib)
        ids = np.zeros(128 * self.options.streams, dtype=np.uint8)
        if transport.rank == 0:
            ids[:] = np.frombuffer(b"".join(nccl.unique_id(lib) for _ in range(self.options.streams)), np.uint8)
        transport.broadcast(ids, 0)
        comms: List[nccl.NcclComm] = []
        try:
            for i in range(self.options.streams):
                comms.append(nccl.NcclComm(lib, ids[128 * i:128 * (i + 1)].tobytes(), transport.size,
                                           transport.rank, self.options.init_timeout))
        except NcclError as exc:
            for comm in comms:
                comm.abort()
            raise TransportError(f"creating the NCCL communicators of process set {set_id} failed on rank "
                                 f"{self.host.rank}: {exc}") from exc
        finally:
            self._mark("INIT_NCCL", False)
        return comms

    def _mark(self, activity: str, begin: bool) -> None:
        timeline = self.host.timeline_of()
        if timeline is not None:
            timeline.activity(activity, begin)

    def _nccl_can_run(self, resp: Response) -> bool:
        """NCCL reduces neither int16/uint16 nor (before 2.10) bfloat16, and Adasum is a host algorithm."""
        if resp.kind in (ops.ALLREDUCE, ops.REDUCESCATTER):
            return resp.op != ops.Adasum and nccl.reduction_dtype(resp.dtype, self._loaded().has_avg) is not None
        return True

    def _stream(self, backend: DeviceBackend, device: int, index: int) -> Any:
        stream = self._streams.get((device, index))
        if stream is None:   # the greatest priority: communication must not wait behind compute
            stream = self._streams[(device, index)] = backend.new_stream(device, high_priority=True)
        return stream

    def fusion_buffer(self, backend: DeviceBackend, device: int, index: int, nbytes: int,
                      stream: Any) -> DeviceArray:
        """The reusable device fusion buffer of one stream, used on that stream only: doubled on demand up to the
        fusion threshold (exactly what is needed beyond), and shrunk when a long run of uses needed far less."""
        key = (device, index)
        buf = self._fusion.get(key)
        need, uses = self._fusion_need.get(key, (0, 0))
        need, uses = max(need, nbytes), uses + 1
        if buf is not None and uses >= _SHRINK_EVERY:
            if buf.nbytes > max(4 * need, _SHRINK_FLOOR):
                buf = None   # allocated on this stream: the allocator reuses it once the stream is past it
                del self._fusion[key]
            need, uses = nbytes, 0
        self._fusion_need[key] = (need, uses)
        if buf is None or buf.nbytes < nbytes:
            doubled = 2 * buf.nbytes if buf is not None else 0
            grown = max(nbytes, min(doubled, self.options.fusion_cap))
            buf = self._fusion[key] = backend.empty((grown,), "uint8", device, stream)
        return buf

    # -- HOST mode ----------------------------------------------------------------------------------------
    def _staged(self, resp: Response, entries: Sequence[Optional[DeviceEntry]], backend: DeviceBackend,
                device: int) -> List[object]:
        """Copy inputs to pinned host memory, run the host executor, copy results back."""
        stream = self._stream(backend, device, 0)
        total = sum(e.tensor.nbytes for e in entries if e is not None and e.tensor is not None)
        pinned = self._stages[(device, 0)].get(backend, stream, total)
        host_entries: List[Optional[HostEntry]] = []
        offset = 0
        for entry in entries:
            if entry is None:
                host_entries.append(None)
                continue
            src = entry.tensor
            if src is None:   # no data to stage (the host executor treats it as zeros)
                host_entries.append(Entry(entry.request, None, None, entry.handle, entry.index))
                continue
            if src.ready is not None:
                backend.wait(stream, src.ready)
            host = pinned[offset:offset + src.nbytes].view(src.dtype).reshape(src.shape)
            offset += src.nbytes
            backend.to_host(host, src, stream)
            inplace = entry.output is entry.tensor
            host_entries.append(Entry(entry.request, host, host if inplace else None, entry.handle, entry.index))
        backend.synchronize(stream)
        results = self.host.execute_on_host(resp, host_entries)
        out: List[object] = []
        for entry, result in zip(entries, results):
            if entry is None or result is None:
                out.append(None)
                continue
            if isinstance(result, tuple):   # alltoall: (rows, received splits)
                out.append((self._upload(result[0], None, resp.dtype, backend, device, stream), result[1]))
            else:   # the host executor's results are host arrays (tuples only for alltoall)
                target = entry.output if isinstance(entry.output, DeviceArray) else None
                out.append(self._upload(cast(np.ndarray, result), target, resp.dtype, backend, device, stream))
        for entry in entries:   # the inputs were read before the host waited; outputs given by the caller are
            if entry is not None and isinstance(entry.output, DeviceArray):   # written by this stream
                backend.keep_alive(entry.output, stream)
        done = backend.record(stream)
        mark_done(entries, out, done)
        self._track(resp, entries, done, backend, ())
        return out

    @staticmethod
    def _upload(array: np.ndarray, target: Optional[DeviceArray], dtype: str, backend: DeviceBackend, device: int,
                stream: Any) -> DeviceArray:
        if target is None or target.shape != tuple(array.shape):
            target = backend.empty(array.shape, dtype, device, stream)
        backend.to_device(target, array, stream)   # the backend copies from contiguous host memory
        return target


def _describe(resp: Response) -> str:
    """A response for messages: ``ALLREDUCE of allreduce.x, ... (process set 0, float32)``."""
    return (f"{ops.KIND_NAMES.get(resp.kind, resp.kind)} of {', '.join(resp.names[:3])}"
            f"{' ...' if len(resp.names) > 3 else ''} (process set {resp.process_set}, {resp.dtype})")


# The fusion buffer is checked for shrinking every this many uses, and never shrunk below this many bytes.
_SHRINK_EVERY = 512
_SHRINK_FLOOR = 4 << 20
