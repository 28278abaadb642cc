"""The MPI data plane: every collective of :class:`~horovod.transport.base.Transport` on an mpi4py communicator.

Used when a job is started by ``mpirun`` (or ``horovodrun --mpi``).  Buffers go to MPI without copies: numpy arrays
are passed straight to mpi4py's upper-case (buffer) methods, reductions run in place with ``MPI.IN_PLACE``.

Threading: the engine calls the collectives from its one background thread, not from the main thread, so MPI must
be initialised with at least ``MPI_THREAD_SERIALIZED`` (mpi4py's default is ``MULTIPLE``).  :func:`configure_mpi4py`
sets the level before mpi4py initialises MPI.  The transport works on a *duplicate* of the communicator it is given,
so the engine's collectives never interleave with collectives the user runs on the same communicator.

Timeouts: MPI has no bounded blocking collective, so ``Bootstrap.timeout`` is not enforced here.  A rank that dies
makes ``mpirun`` abort the whole job (MPI's own failure model); MPI errors that are *returned* become
:class:`~horovod.transport.base.TransportError`.

mpi4py is imported lazily: importing this module never fails; creating a transport without mpi4py raises an
``ImportError`` saying what to install.
"""
from __future__ import annotations

import logging
import sys
import threading
import zlib
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from horovod.transport.base import MAX, MIN, PRODUCT, SUM, Bootstrap, Transport, TransportError, register

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install mpi4py (or pip install horovod-next[mpi]) on top of an MPI library such as Open MPI"

# float16 reduction strategies (``TransportOptions.mpi_float16``), see :class:`MpiTransport`.
F16_NUMPY, F16_NATIVE, F16_UPCAST = "numpy", "native", "upcast"
F16_MODES = (F16_NUMPY, F16_NATIVE, F16_UPCAST)

_REDUCE_OPS = (SUM, MIN, MAX, PRODUCT)


def _mpi() -> Any:
    """Import ``mpi4py.MPI`` (which initialises MPI on first import) or explain what is missing.

    Typed ``Any``: mpi4py is optional, and a module is not a type mypy can check attribute access against.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"the MPI transport needs mpi4py, which could not be imported ({exc}); "
                          f"{_INSTALL_HINT}") from exc
    return MPI


def configure_mpi4py(threads_disable: bool = False) -> bool:
    """Choose the MPI thread level before mpi4py initialises MPI.

    The engine calls MPI from one background thread, never concurrently, so ``MPI_THREAD_SERIALIZED`` is the least
    it may legally run with (``SINGLE`` and ``FUNNELED`` only allow the main thread).  With ``threads_disable`` we
    therefore request ``SERIALIZED`` rather than the original's ``SINGLE``; otherwise ``MULTIPLE`` (mpi4py's default).

    Args:
        threads_disable: the ``mpi_threads_disable`` knob (``HOROVOD_MPI_THREADS_DISABLE``), passed by the caller.

    Returns:
        True if the level was applied; False if MPI was already initialised (the user imported ``mpi4py.MPI``
        first), in which case the level the user chose stays.

    Raises:
        ImportError: mpi4py is not installed (the message says what to install).
    """
    try:
        import mpi4py
    except ImportError as exc:
        raise ImportError(f"the MPI transport needs mpi4py ({exc}); {_INSTALL_HINT}") from exc

    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None:
        # mpi4py reads its rc settings once, when mpi4py.MPI is first imported; too late to change them now.
        if MPI.Is_initialized() and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            logger.warning("MPI was initialised with thread level %d before horovod; the engine calls MPI from a "
                           "background thread and needs MPI_THREAD_SERIALIZED or better", MPI.Query_thread())
        return False
    mpi4py.rc.threads = True
    mpi4py.rc.thread_level = "serialized" if threads_disable else "multiple"
    return True


def _group_tag(ranks: Tuple[int, ...]) -> int:
    # Create_group matches its internal messages by tag; a tag derived from the member list keeps two different
    # groups being formed at the same time from ever pairing up (32767 is the smallest MPI_TAG_UB allowed).
    return zlib.crc32(np.asarray(ranks, dtype=np.int64).tobytes()) % 32768


class _Plan:
    """How one (dtype, op) pair is reduced: MPI datatype and op, and an optional wider scratch dtype."""

    __slots__ = ("datatype", "op", "wide", "wide_datatype")

    def __init__(self, datatype: Any, op: Any, wide: Optional[np.dtype] = None, wide_datatype: Any = None):
        self.datatype, self.op, self.wide, self.wide_datatype = datatype, op, wide, wide_datatype


_NUMPY_UFUNCS = {SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}
_numpy_ops: Dict[Tuple[str, str], Any] = {}
_numpy_ops_lock = threading.Lock()


def _numpy_op(MPI: Any, dtype: np.dtype, op: str) -> Any:
    """A user-defined MPI op that reduces with the numpy ufunc (created once per process, never freed)."""
    key = (dtype.str, op)
    with _numpy_ops_lock:
        mpi_op = _numpy_ops.get(key)
        if mpi_op is None:
            ufunc = _NUMPY_UFUNCS[op]

            def reduce(inbuf, inoutbuf, datatype, _dtype=dtype, _ufunc=ufunc):
                acc = np.frombuffer(inoutbuf, dtype=_dtype)
                with np.errstate(all="ignore"):   # wrap-around and inf are the defined results, not errors
                    _ufunc(acc, np.frombuffer(inbuf, dtype=_dtype), out=acc)

            mpi_op = _numpy_ops[key] = MPI.Op.Create(reduce, commute=True)
        return mpi_op


class MpiTransport(Transport):
    """Collectives over an mpi4py communicator.

    Every call is collective over the communicator: all members make the same calls in the same order.

    Reductions MPI cannot be trusted with use a user-defined op that runs the numpy ufunc (so results are exactly
    numpy's, like every other transport's): 8- and 16-bit integer sums, which Open MPI's AVX component *saturates*
    instead of wrapping (open-mpi/ompi#8045, closed "wontfix"; reproduced on 5.0.11 from 16 elements up), and
    float16, which MPI does not standardise (Open MPI's ``MPI_SHORT_FLOAT`` works but reduced at ~0.3 GB/s here,
    the numpy op at ~0.7-0.9 GB/s).

    Args:
        comm: the communicator (an ``mpi4py.MPI.Comm``); the transport works on its own duplicate unless
            ``dup`` is False.
        float16: ``numpy`` (default: the numpy op, half-precision rounding after every pairwise step),
            ``native`` (the library's ``MPI_SHORT_FLOAT``; :class:`TransportError` if it has none) or ``upcast``
            (reduce in a float32 scratch buffer: one rounding at the end, slower because numpy's half<->single
            casts run at ~1.2 GB/s here).
        dup: duplicate ``comm`` (collective over it) so user traffic on ``comm`` cannot interleave with ours.
    """

    name = "mpi"

    def __init__(self, comm: Any, *, float16: str = F16_NUMPY, dup: bool = True):
        MPI = _mpi()
        self._MPI = MPI
        if float16 not in F16_MODES:
            raise ValueError(f"mpi_float16={float16!r}: expected one of {F16_MODES}")
        self.float16 = float16
        self._types = self._datatypes()
        if float16 == F16_NATIVE and not self._native_float16_works():
            raise TransportError("mpi_float16='native' but this MPI library cannot reduce MPI_SHORT_FLOAT; "
                                 "use 'numpy' or 'upcast'")
        self._comm = comm.Dup() if dup else comm
        self._owns_comm = dup
        # Errors must come back as exceptions (mpi4py's default on COMM_WORLD), not abort the process.
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._ops = {SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD}
        self._bool_ops = {SUM: MPI.LOR, MAX: MPI.LOR, MIN: MPI.LAND, PRODUCT: MPI.LAND}
        self._plans: Dict[Tuple[np.dtype, str], _Plan] = {}
        self._children: Dict[Tuple[int, ...], MpiTransport] = {}
        self._scratch: Dict[np.dtype, np.ndarray] = {}
        self._closed = False

    # ------------------------------------------------------------------ setup

    def _datatypes(self) -> Dict[np.dtype, Any]:
        MPI = self._MPI
        table = {np.dtype(np.bool_): MPI.C_BOOL, np.dtype(np.float16): MPI._typedict.get("e", MPI.DATATYPE_NULL)}
        for code in ("f", "d", "b", "h", "i", "l", "q", "B", "H", "I", "L", "Q"):
            table[np.dtype(code)] = MPI._typedict[code]
        return {dt: t for dt, t in table.items() if t != MPI.DATATYPE_NULL}

    def _native_float16_works(self) -> bool:
        """Probe locally (no communication) that the library reduces half floats correctly for every op."""
        MPI = self._MPI
        half = self._types.get(np.dtype(np.float16))
        if half is None:
            return False
        a = np.array([1.5, -2.0, 0.25] * 11, dtype=np.float16)   # 33 elements: past any vector-path threshold
        try:
            for name, mpi_op in ((SUM, MPI.SUM), (MIN, MPI.MIN), (MAX, MPI.MAX), (PRODUCT, MPI.PROD)):
                b = np.array([0.5, 3.0, -1.0] * 11, dtype=np.float16)
                expected = _NUMPY_UFUNCS[name](b, a)
                mpi_op.Reduce_local([a, half], [b, half])
                if not np.array_equal(b, expected):
                    return False
        except MPI.Exception:
            return False
        return True

    def _plan(self, dtype: np.dtype, op: str) -> _Plan:
        """Decide once per (dtype, op) how to reduce it; see the class docstring for why."""
        plan = self._plans.get((dtype, op))
        if plan is not None:
            return plan
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduction op {op!r} is not supported by the MPI transport; expected one of "
                             f"{_REDUCE_OPS} (average, scaling and adasum are done by the engine)")
        MPI = self._MPI
        if dtype == np.bool_:
            plan = _Plan(MPI.C_BOOL, self._bool_ops[op])
        elif dtype == np.float16:
            if self.float16 == F16_NATIVE:
                plan = _Plan(self._types[dtype], self._ops[op])
            elif self.float16 == F16_UPCAST:
                plan = _Plan(None, self._ops[op], np.dtype(np.float32), MPI.FLOAT)
            else:   # any 2-byte datatype carries the bits; the op reads them as float16
                plan = _Plan(MPI.UINT16_T, _numpy_op(MPI, dtype, op))
        elif op == SUM and dtype.kind in "iu" and dtype.itemsize <= 2:
            plan = _Plan(self._types[dtype], _numpy_op(MPI, dtype, op))
        elif dtype in self._types:
            plan = _Plan(self._types[dtype], self._ops[op])
        else:
            raise TypeError(f"the MPI transport cannot reduce dtype {dtype}; expected one of "
                            f"{sorted(str(t) for t in self._types)}")
        self._plans[(dtype, op)] = plan
        return plan

    def _spec(self, buf: np.ndarray) -> Tuple[np.ndarray, Any, int]:
        """(array, MPI datatype, elements per array element) to move ``buf``; unknown dtypes travel as bytes."""
        dt = self._types.get(buf.dtype)
        if dt is not None:
            return buf, dt, 1
        return buf.view(np.uint8), self._MPI.BYTE, buf.dtype.itemsize

    def _fail(self, what: str, exc: Exception) -> TransportError:
        text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
        return TransportError(f"MPI {what} failed on rank {self.rank} of {self.size}: {text}")

    def _scratch_of(self, dtype: np.dtype, n: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < n:
            buf = self._scratch[dtype] = np.empty(n, dtype=dtype)
        return buf[:n]

    def _live(self) -> None:
        if self._closed:
            raise TransportError(f"MPI transport (rank {self.rank} of {self.size}) used after close()")

    # ------------------------------------------------------------- collectives

    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        """Reduce ``buf`` in place over the group; all ranks call it with equal sizes, dtypes and op."""
        plan = self._plan(buf.dtype, op)
        if self._closed:
            self._live()
        if self.size == 1 or buf.size == 0:
            return
        MPI = self._MPI
        try:
            if plan.wide is None:
                self._comm.Allreduce(MPI.IN_PLACE, [buf, plan.datatype], op=plan.op)
            else:
                wide = self._scratch_of(plan.wide, buf.size)
                np.copyto(wide, buf)
                self._comm.Allreduce(MPI.IN_PLACE, [wide, plan.wide_datatype], op=plan.op)
                with np.errstate(over="ignore"):   # overflow to inf is float16's defined result
                    np.copyto(buf, wide, casting="unsafe")
        except MPI.Exception as exc:
            raise self._fail(f"allreduce({op}, {buf.dtype}, {buf.size} elements)", exc) from exc

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[r]`` elements from rank r) into ``recv`` on every rank."""
        self._live()
        counts = [int(c) for c in counts]
        total = sum(counts)
        if counts[self.rank] != send.size:
            raise ValueError(f"allgatherv: counts[{self.rank}]={counts[self.rank]} but send has {send.size} elements")
        if recv.size < total:
            raise ValueError(f"allgatherv: recv has {recv.size} elements, counts need {total}")
        if self.size == 1:
            recv[:total] = send
            return
        if total == 0:
            return
        MPI = self._MPI
        send_v, dt, k = self._spec(send)
        recv_v = self._spec(recv)[0]
        counts_k = [c * k for c in counts]
        try:
            self._comm.Allgatherv([send_v, dt], [recv_v, (counts_k, _displs(counts_k)), dt])
        except MPI.Exception as exc:
            raise self._fail(f"allgatherv({send.dtype}, counts={counts})", exc) from exc

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``buf`` of group rank ``root`` into ``buf`` on every rank."""
        self._live()
        if self.size == 1 or buf.size == 0:
            return
        MPI = self._MPI
        view, dt, _ = self._spec(buf)
        try:
            self._comm.Bcast([view, dt], root=root)
        except MPI.Exception as exc:
            raise self._fail(f"broadcast(root={root}, {buf.dtype}, {buf.size} elements)", exc) from exc

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                  recv_counts: Sequence[int]) -> None:
        """Send ``send_counts[p]`` consecutive elements to each rank p; receive ``recv_counts[p]`` from each p."""
        self._live()
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        if self.size == 1:
            recv[: recv_counts[0]] = send[: send_counts[0]]
            return
        MPI = self._MPI
        # Never skip on local emptiness: other ranks may still have something to exchange with us.
        send_v, dt, k = self._spec(send)
        recv_v = self._spec(recv)[0]
        sc = [c * k for c in send_counts]
        rc = [c * k for c in recv_counts]
        try:
            self._comm.Alltoallv([send_v, (sc, _displs(sc)), dt], [recv_v, (rc, _displs(rc)), dt])
        except MPI.Exception as exc:
            raise self._fail(f"alltoallv({send.dtype}, send_counts={send_counts}, recv_counts={recv_counts})",
                             exc) from exc

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: str = SUM) -> None:
        """Reduce ``send`` (``sum(counts)`` elements) over the group; rank r receives block r in ``recv``."""
        plan = self._plan(send.dtype, op)
        self._live()
        counts = [int(c) for c in counts]
        total, mine = sum(counts), counts[self.rank]
        if send.size < total or recv.size < mine:
            raise ValueError(f"reducescatter: send has {send.size} elements (need {total}), recv has {recv.size} "
                             f"(need {mine})")
        if self.size == 1:
            recv[:mine] = send[:mine]
            return
        if total == 0:
            return
        MPI = self._MPI
        try:
            if plan.wide is None:
                self._comm.Reduce_scatter([send[:total], plan.datatype], [recv[:mine], plan.datatype], counts,
                                          op=plan.op)
            else:
                wide = self._scratch_of(plan.wide, total + mine)
                np.copyto(wide[:total], send[:total])
                out = wide[total:]
                self._comm.Reduce_scatter([wide[:total], plan.wide_datatype], [out, plan.wide_datatype], counts,
                                          op=plan.op)
                with np.errstate(over="ignore"):
                    np.copyto(recv[:mine], out, casting="unsafe")
        except MPI.Exception as exc:
            raise self._fail(f"reducescatter({op}, {send.dtype}, counts={counts})", exc) from exc

    def sendrecv(self, send: Optional[np.ndarray], dest: Optional[int], recv: Optional[np.ndarray],
                 source: Optional[int]) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``; either side may be None."""
        self._live()
        MPI = self._MPI
        # (array, datatype) per side that takes part; None for a side that does not.
        out = self._spec(send)[:2] if send is not None and dest is not None else None
        into = self._spec(recv)[:2] if recv is not None and source is not None else None
        try:
            if out is not None and into is not None:
                self._comm.Sendrecv(list(out), dest=dest, sendtag=0, recvbuf=list(into), source=source, recvtag=0)
            elif out is not None:
                self._comm.Send(list(out), dest=dest, tag=0)
            elif into is not None:
                self._comm.Recv(list(into), source=source, tag=0)
        except MPI.Exception as exc:
            raise self._fail(f"sendrecv(dest={dest}, source={source})", exc) from exc

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        self._live()
        if self.size == 1:
            return
        try:
            self._comm.Barrier()
        except self._MPI.Exception as exc:
            raise self._fail("barrier", exc) from exc

    def subgroup(self, ranks: Sequence[int]) -> "MpiTransport":
        """A transport over ``ranks`` (group ranks of this transport), cached per rank tuple.

        Creation (``MPI_Comm_create_group``) is collective over the *members* of ``ranks`` only: every member
        must call ``subgroup(ranks)``, and members must create their groups in the same order.  The engine
        registers process sets on every rank in one order, which satisfies both.  Later calls with the same
        ranks return the cached transport without communicating.
        """
        self._live()
        key = tuple(sorted(int(r) for r in ranks))
        if not key or key[0] < 0 or key[-1] >= self.size or len(set(key)) != len(key):
            raise ValueError(f"subgroup ranks {list(ranks)} must be distinct group ranks in [0, {self.size})")
        if self.rank not in key:
            raise ValueError(f"subgroup({list(key)}) called on rank {self.rank}, which is not a member")
        child = self._children.get(key)
        if child is not None and not child._closed:
            return child
        MPI = self._MPI
        group = self._comm.Get_group()
        try:
            members = group.Incl(list(key))
            try:
                comm = self._comm.Create_group(members, tag=_group_tag(key))
            finally:
                members.Free()
        except MPI.Exception as exc:
            raise self._fail(f"subgroup({list(key)})", exc) from exc
        finally:
            group.Free()
        child = MpiTransport(comm, float16=self.float16, dup=False)
        child._owns_comm = True
        self._children[key] = child
        return child

    def close(self) -> None:
        """Free the duplicated communicator and every subgroup's.  Idempotent; a no-op after MPI_Finalize."""
        if self._closed:
            return
        self._closed = True
        for child in self._children.values():
            child.close()
        self._children.clear()
        MPI = self._MPI
        if self._owns_comm and not MPI.Is_finalized():
            try:
                self._comm.Free()
            except MPI.Exception as exc:   # closing must not raise; the communicator is unusable either way
                logger.debug("MPI_Comm_free failed on rank %d: %s", self.rank, exc)

    @property
    def comm(self) -> Any:
        """The communicator this transport runs on (its private duplicate)."""
        return self._comm


def _displs(counts: Sequence[int]) -> list:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


@register("mpi")
def create_mpi(boot: Bootstrap) -> MpiTransport:
    """Build the world transport from ``boot.options.mpi_comm`` (``MPI.COMM_WORLD`` when absent).

    Collective over the communicator (it is duplicated).  Options: ``mpi_comm``, ``mpi_float16``
    (``numpy``/``native``/``upcast``, see :class:`MpiTransport`), ``mpi_threads_disable`` (applied through
    :func:`configure_mpi4py` if MPI is not initialised yet; callers that import ``mpi4py.MPI`` themselves should
    call :func:`configure_mpi4py` first).

    Raises:
        ImportError: mpi4py is not installed (the message says what to install).
        ValueError: the communicator's rank or size differs from ``boot.rank`` / ``boot.size``.
    """
    configure_mpi4py(boot.options.mpi_threads_disable)
    MPI = _mpi()
    comm = boot.options.mpi_comm
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if (rank, size) != (boot.rank, boot.size):
        raise ValueError(f"MPI communicator has rank {rank} of {size} but the bootstrap says rank {boot.rank} of "
                         f"{boot.size}; start the job with mpirun (or pass the communicator hvd.init(comm=...) "
                         f"uses) so both agree")
    transport = MpiTransport(comm, float16=boot.options.mpi_float16 or F16_NUMPY)
    logger.debug("MPI transport up: rank %d of %d, thread level %d, float16 reduced by %s", rank, size,
                 MPI.Query_thread(), transport.float16)
    return transport
