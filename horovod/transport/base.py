"""The data-plane interface: move and reduce bytes among the ranks of one group.

A transport knows nothing about tensor names, negotiation or frameworks.  Every buffer is a 1-D, C-contiguous
numpy array of a real numpy dtype (the engine converts bfloat16 before calling).  Every call is collective:
all members of the group make the same calls in the same order.  Every blocking wait is bounded by
``timeout`` seconds and raises :class:`TransportError` naming the peer it waited for.

Transports register themselves by name in :data:`REGISTRY`; the engine picks one with an explicit priority list.
"""
from __future__ import annotations

import abc
import copy
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

# Reduction ops a transport must support on its own (Average, pre/post-scaling and Adasum are engine-level).
SUM, MIN, MAX, PRODUCT = "sum", "min", "max", "product"

_UFUNCS = {SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}


def check_op(op: str, who: str) -> None:
    """Refuse a reduce op no transport implements, on every rank alike and before anything is sent."""
    if op not in _UFUNCS:
        raise ValueError(f"{who}: unsupported reduce op {op!r}; expected one of sum, min, max, product "
                         f"(Average and scaling are the engine's)")


def check_gather(send: np.ndarray, recv: np.ndarray, total: int, mine: int, rank: int) -> None:
    """Refuse allgatherv buffers that cannot hold the result, on every rank alike and before anything is sent."""
    if recv.size < total or send.size < mine or recv.dtype != send.dtype:
        raise ValueError(f"allgatherv: recv must hold sum(counts) = {total} elements of {send.dtype} and send at "
                         f"least counts[{rank}] = {mine}; got recv {recv.size} x {recv.dtype}, "
                         f"send {send.size} x {send.dtype}")


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str) -> None:
    """``dst = dst (op) src`` elementwise, in place (bool: sum/max are OR, min/product are AND)."""
    if dst.dtype == np.bool_:
        if op in (SUM, MAX):
            np.logical_or(dst, src, out=dst)
        else:
            np.logical_and(dst, src, out=dst)
        return
    _UFUNCS[op](dst, src, out=dst)


class Finish(Protocol):
    """The last step of a reduction, chosen by the engine (e.g. Average's division): a transport applies it to every
    reduced element exactly once, either in place or while copying a reduced piece to its destination."""

    def __call__(self, piece: np.ndarray) -> None:
        """Finish ``piece`` in place."""

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write the finished values of ``src`` into ``dst`` (``np.copyto``'s argument order)."""


class TransportError(RuntimeError):
    """A collective could not complete: a peer died, closed, timed out or misbehaved.

    Attributes:
        peer: the group rank (or description) of the peer concerned, when known.
    """

    def __init__(self, message: str, peer: object = None):
        super().__init__(message)
        self.peer = peer


class Transport(abc.ABC):
    """Collectives over a fixed group of processes.

    Attributes:
        rank: this process's index in the group.
        size: the number of processes in the group.
        name: the transport's registry name (``tcp``, ``shm``, ``mpi``, ``local``).
    """

    name: str = "abstract"
    rank: int
    size: int

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        """Reduce ``buf`` across the group, in place, with ``op`` in {sum, min, max, product}."""

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: str = SUM,
                       finish: Optional[Finish] = None) -> None:
        """Reduce ``src`` across the group into ``dst`` (same shape and dtype; ``src is dst`` for in place, else no
        overlap); ``src`` is unchanged.  ``finish``, when given, is applied to every element of the result once.

        The default copies, reduces in place and finishes the whole result.  A transport that can read its input
        from one buffer and write its result to another overrides this to save that pass over memory (a fresh
        result's pages are then faulted in by the result's own write), and finishes each piece of the result as
        it writes it, while it is in cache.
        """
        if src is not dst:
            np.copyto(dst, src)
        self.allreduce(dst, op)
        if finish is not None:
            finish(dst)

    @abc.abstractmethod
    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` into ``recv``; ``counts[r]`` elements come from rank r."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``buf`` of group rank ``root`` into ``buf`` on every rank."""

    @abc.abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                  recv_counts: Sequence[int]) -> None:
        """Rank r sends ``send_counts[p]`` consecutive elements to p and receives ``recv_counts[p]`` from p."""

    @abc.abstractmethod
    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: str = SUM) -> None:
        """Reduce ``send`` (``sum(counts)`` elements) across ranks; rank r gets block r (``counts[r]``) in ``recv``.

        ``send`` is only read, never modified (the engine passes user tensors straight in).
        """

    @abc.abstractmethod
    def sendrecv(self, send: Optional[np.ndarray], dest: Optional[int], recv: Optional[np.ndarray],
                 source: Optional[int]) -> None:
        """Point-to-point: send ``send`` to ``dest`` while receiving ``recv`` from ``source`` (either may be None)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""

    @abc.abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> "Transport":
        """A transport over ``ranks`` (group ranks, sorted) of this group; the caller must be one of them."""

    def last_heard(self, rank: int) -> float:
        """When (``time.monotonic()``) a byte from group rank ``rank`` last arrived on this transport; 0.0 when
        unknown. The engine's liveness counts data-plane traffic as life (horovod/engine/liveness.py)."""
        return 0.0

    def close(self) -> None:  # noqa: B027  (a no-op by default: LocalTransport holds nothing to release)
        """Release sockets, segments and threads.  Idempotent."""


class LocalTransport(Transport):
    """The group of one: every collective is a copy (or nothing)."""

    name = "local"

    def __init__(self) -> None:
        self.rank, self.size = 0, 1

    def allreduce(self, buf, op=SUM):
        pass

    def allgatherv(self, send, recv, counts):
        recv[: send.size] = send

    def broadcast(self, buf, root):
        pass

    def alltoallv(self, send, send_counts, recv, recv_counts):
        recv[: recv_counts[0]] = send[: send_counts[0]]

    def reducescatter(self, send, recv, counts, op=SUM):
        recv[: counts[0]] = send[: counts[0]]

    def sendrecv(self, send, dest, recv, source):
        if send is not None and recv is not None:
            recv[...] = send

    def barrier(self):
        pass

    def subgroup(self, ranks):
        return self


# name -> factory(context) -> Transport; filled by each transport module on import.
REGISTRY: Dict[str, Callable[..., Transport]] = {}


def register(name: str) -> Callable[[Callable[..., Transport]], Callable[..., Transport]]:
    """Class/function decorator adding a transport factory to :data:`REGISTRY`."""

    def deco(factory):
        REGISTRY[name] = factory
        return factory

    return deco


class Store(abc.ABC):
    """What a transport needs from the rendezvous: a shared key-value store
    (see :mod:`horovod.transport.rendezvous`)."""

    @abc.abstractmethod
    def put(self, scope: str, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, scope: str, key: str, timeout: Optional[float] = None) -> bytes: ...


MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """Every setting a transport reads, typed and in one place; each transport reads only its own.

    The engine builds one from its config (:mod:`horovod.engine.bootstrap`); tests and benchmarks may pass a
    mapping of the same names to :class:`Bootstrap`, and an unknown name is refused rather than ignored.

    Attributes:
        small_message_bytes: tcp: below this many bytes, latency-optimal algorithms instead of rings
            (``HOROVOD_SMALL_MESSAGE_BYTES``).
        tcp_chunk_bytes: tcp: the largest pipeline segment of a ring step.
        shm_segment_bytes: shm: shared memory per rank and group (two halves used alternately).
        shm_chunk_bytes: shm: allreduce pipeline chunk.
        shm_small_bytes: shm: one-step allreduce while bytes × ranks is at most this.
        shm_spin_us: shm: adaptive spin before blocking (None: the engine's default for this host).
        shm_backing: shm: ``"memfd"`` (anonymous) or ``"file"`` (a file under /dev/shm).
        shm_single_copy_bytes: shm: an allgather block or alltoall piece of at least this many bytes is read
            from the sender's own memory (:mod:`horovod.transport.cma`) where every rank can; 0: never
            (``HOROVOD_SHM_SINGLE_COPY_BYTES``).
        hierarchical_allreduce: hierarchical: split allreduce into host and cross-host steps.
        hierarchical_allgather: hierarchical: gather inside each host first (``HOROVOD_HIERARCHICAL_ALLGATHER``).
        mpi_comm: mpi: the communicator to use (``MPI.COMM_WORLD`` when None).
        mpi_float16: mpi: how float16 is reduced (see :mod:`horovod.transport.mpi`; None: the default).
        mpi_threads_disable: mpi: initialise MPI without thread support (``HOROVOD_MPI_THREADS_DISABLE``).
    """

    small_message_bytes: int = 256 * 1024
    tcp_chunk_bytes: int = MIB
    # Measured on 2 cores: smaller chunks and halves keep the working set in L2/L3 and beat larger ones at 64 MiB.
    shm_segment_bytes: int = 4 * MIB  # two halves of 2 MiB (+ the fast lane's 2 MiB: shm_node.LANE_PAYLOAD_BYTES)
    shm_chunk_bytes: int = MIB
    # An allreduce of n bytes is one step (every rank reduces all n * size bytes) while n * size <= this: measured
    # crossover with the two-step reduce-scatter + allgather at 512 KiB (np = 2) and 256 KiB (np = 4).
    shm_small_bytes: int = MIB
    shm_spin_us: Optional[float] = None
    shm_backing: str = "memfd"
    shm_single_copy_bytes: int = 4 * MIB
    hierarchical_allreduce: bool = True
    hierarchical_allgather: bool = False
    mpi_comm: Any = None
    mpi_float16: Optional[str] = None
    mpi_threads_disable: bool = False

    @classmethod
    def of(cls, value: Union[None, "TransportOptions", Mapping[str, Any]]) -> "TransportOptions":
        """``value`` as options: None gives the defaults; a mapping must use the attribute names above.

        Raises:
            ValueError: a name no transport reads.
        """
        if value is None:
            return cls()
        if isinstance(value, TransportOptions):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown transport option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**value)


class Bootstrap:
    """Everything a transport factory needs to connect the world group.

    Attributes:
        rank, size, local_rank, local_size, cross_rank, cross_size, hostname: this process's place in the job.
        store: the rendezvous key-value store (duck-typed :class:`Store`), or ``None`` under MPI.
        secret: the job secret; every connection is authenticated with it.
        bind_addr: the local address to listen on (never wider than needed).
        timeout: seconds any blocking wait may take before :class:`TransportError`.
        scope: a key prefix unique to this ``init()`` (re-initialisation must not read stale keys).
        options: the transports' settings (:class:`TransportOptions`).
    """

    def __init__(self, rank: int, size: int, *, local_rank: int = 0, local_size: int = 1, cross_rank: int = 0,
                 cross_size: int = 1, hostname: str = "localhost", store=None, secret: bytes = b"",
                 bind_addr: str = "127.0.0.1", timeout: float = 30.0, scope: str = "tcp",
                 options: Union[None, TransportOptions, Mapping[str, Any]] = None):
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.hostname = hostname
        self.store, self.secret, self.bind_addr = store, secret, bind_addr
        self.timeout, self.scope = timeout, scope
        self.options = TransportOptions.of(options)

    def scoped(self, suffix: str) -> "Bootstrap":
        """The same bootstrap under the key prefix ``scope + suffix`` (for a second set of connections)."""
        twin = copy.copy(self)
        twin.scope = self.scope + suffix
        return twin
