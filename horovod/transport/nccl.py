"""NCCL communicators: collectives on device memory, given as raw pointers and a CUDA stream handle.

This module knows nothing about frameworks or tensor names: a buffer is an integer device pointer, a stream an
integer ``cudaStream_t``.  Every call only *enqueues* work on the stream and returns; ordering against the
producer and the consumer of the data is the caller's business (CUDA events, :mod:`horovod.engine.device`).

Failures: a call that returns an error raises :class:`~horovod.transport.nccl_lib.NcclError`; an error that
happens later on the GPU (a peer died, a network failure) is seen by :meth:`NcclComm.async_error`, and
:meth:`NcclComm.abort` frees every kernel of the communicator that waits for a peer, so a dead peer never holds
a GPU for ever.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from typing import Iterator, Optional

from horovod.transport.nccl_lib import IN_PROGRESS, SUCCESS, NcclError, NcclLibrary, NcclUniqueId, nonblocking_config

logger = logging.getLogger(__name__)
INVALID_ARGUMENT = 4

# ncclDataType_t by engine dtype name.  int16/uint16 have no NCCL type: reductions on them are host-staged,
# and data movement (allgather, broadcast, alltoall) moves any dtype as bytes.
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
          "float32": 7, "float64": 8, "bfloat16": 9, "bool": 1}
BYTES = 1   # ncclUint8: what data movement counts in

# ncclRedOp_t by the transport's op name.  A bool is carried as uint8 0/1, where sum/max are OR and
# min/product are AND, as the CPU transports do.
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
OPS = {"sum": SUM, "product": PROD, "max": MAX, "min": MIN}
BOOL_OPS = {"sum": MAX, "max": MAX, "product": MIN, "min": MIN}


def reduction_dtype(dtype: str, has_bfloat16: bool) -> Optional[int]:
    """The NCCL type reductions of ``dtype`` run in, or ``None`` when NCCL cannot reduce it (host-staged)."""
    if dtype == "bfloat16" and not has_bfloat16:
        return None
    return DTYPES.get(dtype)


def reduction_op(op: str, dtype: str) -> int:
    return (BOOL_OPS if dtype == "bool" else OPS)[op]


def unique_id(lib: NcclLibrary) -> bytes:
    """A fresh ``ncclUniqueId`` (made by one rank, sent to the others over the control plane)."""
    uid = NcclUniqueId()
    lib.check("ncclGetUniqueId", lib.ncclGetUniqueId(ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))   # all 128 bytes: .internal stops at a NUL


def _id_struct(raw: bytes) -> NcclUniqueId:
    if len(raw) != ctypes.sizeof(NcclUniqueId):
        raise ValueError(f"an ncclUniqueId has {ctypes.sizeof(NcclUniqueId)} bytes, got {len(raw)}")
    uid = NcclUniqueId()
    ctypes.memmove(ctypes.byref(uid), raw, len(raw))
    return uid


class NcclTimeout(NcclError):
    """A non-blocking communicator did not finish creating (or connecting) in time: a peer is frozen or gone."""


class NcclComm:
    """One communicator: ``size`` ranks, this one ``rank``, on the current CUDA device of the creating thread.

    Creation is collective: every rank calls it with the same ``uid``.  With ``timeout`` (seconds) and a library
    that has ``ncclCommInitRankConfig`` (2.17+), the communicator is non-blocking: creation, and every call that
    answers ``ncclInProgress`` (NCCL's lazy connects), are polled until done and fail with :class:`NcclTimeout`
    after ``timeout`` instead of blocking the calling thread for ever on a frozen peer.
    """

    def __init__(self, lib: NcclLibrary, uid: bytes, size: int, rank: int, timeout: Optional[float] = None):
        self.lib, self.size, self.rank, self.timeout = lib, size, rank, timeout
        handle = ctypes.c_void_p()
        self.nonblocking = timeout is not None and lib.has_config
        self.handle: Optional[int] = None
        if self.nonblocking:
            config = nonblocking_config()
            code = lib.ncclCommInitRankConfig(ctypes.byref(handle), size, _id_struct(uid), rank, ctypes.byref(config))
            self.handle = handle.value
            if code == INVALID_ARGUMENT and not self.handle:
                # A library that refuses this config layout: create the communicator the blocking way instead.
                logger.warning("horovod: %s refused a non-blocking NCCL communicator (%s); creating it blocking",
                               lib.path, lib.last_error() or lib.error_string(code))
                self.nonblocking = False
            elif code not in (SUCCESS, IN_PROGRESS):
                self.abort()
                lib.check("ncclCommInitRankConfig", code)
            else:
                self._settle("ncclCommInitRankConfig", "creating the communicator")
        if not self.nonblocking:
            lib.check("ncclCommInitRank", lib.ncclCommInitRank(ctypes.byref(handle), size, _id_struct(uid), rank))
            self.handle = handle.value

    def _settle(self, call: str, doing: str) -> None:
        """Poll a non-blocking communicator until its last call completed (or failed, or the timeout passed)."""
        deadline = time.monotonic() + (self.timeout or 0.0)
        code = ctypes.c_int(IN_PROGRESS)
        pause = 1e-5
        while True:
            self.lib.check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(code)))
            if code.value != IN_PROGRESS:
                break
            if time.monotonic() > deadline:
                self.abort()
                raise NcclTimeout(call, IN_PROGRESS, f"{doing} did not complete within {self.timeout:.0f} s on rank "
                                  f"{self.rank} of {self.size}: a rank of the communicator is frozen, gone, or never "
                                  f"created it (HOROVOD_GLOO_TIMEOUT_SECONDS bounds this wait)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        if code.value != SUCCESS:
            self.lib.check(call, code.value, self.handle)

    def _check(self, call: str, code: int) -> None:
        if code == IN_PROGRESS and self.nonblocking:
            self._settle(call, call)
        elif code != SUCCESS and code != IN_PROGRESS:
            self.lib.check(call, code, self.handle)

    # -- collectives (enqueue on ``stream`` and return) ----------------------------------------------------
    def allreduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._check("ncclAllReduce", self.lib.ncclAllReduce(send, recv, count, dtype, op, self.handle, stream))

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._check("ncclBroadcast", self.lib.ncclBroadcast(send, recv, count, dtype, root, self.handle, stream))

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, stream: int) -> None:
        self._check("ncclReduce", self.lib.ncclReduce(send, recv, count, dtype, op, root, self.handle, stream))

    def allgather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        """``count`` elements from every rank, concatenated in rank order into ``recv``."""
        self._check("ncclAllGather", self.lib.ncclAllGather(send, recv, count, dtype, self.handle, stream))

    def reducescatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        """``count`` elements of the reduction to every rank (``send`` holds ``size * count``)."""
        self._check("ncclReduceScatter",
                    self.lib.ncclReduceScatter(send, recv, count, dtype, op, self.handle, stream))

    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._check("ncclSend", self.lib.ncclSend(buf, count, dtype, peer, self.handle, stream))

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._check("ncclRecv", self.lib.ncclRecv(buf, count, dtype, peer, self.handle, stream))

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Calls inside run as one NCCL group (sends and receives that must not wait for each other)."""
        self._check("ncclGroupStart", self.lib.ncclGroupStart())
        try:
            yield
        finally:
            self._check("ncclGroupEnd", self.lib.ncclGroupEnd())

    # -- health and teardown ---------------------------------------------------------------------------
    def async_error(self) -> Optional[NcclError]:
        """An error NCCL met after a call returned (a peer vanished, a network failure), else ``None``."""
        if self.handle is None:
            return None
        code = ctypes.c_int()
        self.lib.check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(code)))
        if code.value in (SUCCESS, IN_PROGRESS):
            return None
        return NcclError("an NCCL operation", code.value, self.lib.last_error(self.handle)
                         or self.lib.error_string(code.value))

    def abort(self) -> None:
        """Free the communicator at once, ending its kernels that wait for peers (after a failure)."""
        handle, self.handle = self.handle, None
        if handle is not None:
            self.lib.ncclCommAbort(handle)

    def destroy(self) -> None:
        """Free the communicator after its work completed (orderly shutdown).  A non-blocking one is finalized
        first and polled (its flush may take a moment; a peer gone meanwhile makes it an abort)."""
        if self.handle is None:
            return
        if self.nonblocking and hasattr(self.lib, "ncclCommFinalize"):
            try:
                self._check("ncclCommFinalize", self.lib.ncclCommFinalize(self.handle))
            except NcclError:
                self.abort()
                return
        handle, self.handle = self.handle, None
        self.lib.ncclCommDestroy(handle)
