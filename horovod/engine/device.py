"""Device memory as the engine sees it: a framework-blind descriptor and the protocol a framework implements.

The engine negotiates a CUDA tensor exactly like a host array (name, dtype, shape, process set); only the
executor treats it differently.  A binding hands the engine a :class:`DeviceArray` instead of a numpy array: its
shape and storage dtype (numpy's, for negotiation), the device, and the framework tensor that owns the memory.
What the engine must do *on* the device — allocate, copy, scale, order streams, stage through pinned host
memory — goes through a :class:`DeviceBackend` that the binding registers (``horovod.torch`` registers one for
CUDA tensors), so no framework is imported here.

Ordering is by events, never by host synchronisation on the hot path: the binding records ``ready`` on the
producer's stream; the engine's stream waits for it, runs the collective and records ``done``; the binding makes
the consumer's stream wait for ``done`` when the caller synchronizes.
"""
from __future__ import annotations

import contextlib
from math import prod
from typing import Any, ContextManager, Dict, Optional, Sequence, TypeVar, Union

import numpy as np
from numpy.typing import DTypeLike


class DeviceArray:
    """A C-contiguous array in device memory.

    Attributes:
        owner: the framework tensor owning the memory (flat or shaped; the backend knows).
        shape: the logical shape.
        dtype: the numpy storage dtype (bfloat16 as ``uint16``, as on the host path).
        device: the device index on this process.
        backend: the :class:`DeviceBackend` that made it.
        ready: an event the producer's stream recorded after writing it (``None``: nothing to wait for).
        done: the event recorded after the last collective that wrote or read it (set by the engine).
    """

    __slots__ = ("owner", "shape", "dtype", "device", "backend", "ready", "done", "allocated")

    def __init__(self, owner: Any, shape: Sequence[int], dtype: DTypeLike, device: int, backend: "DeviceBackend",
                 ready: Any = None):
        self.owner = owner
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.backend = backend
        self.ready = ready
        self.done: Any = None
        self.allocated = False   # made by the engine on its own stream (not the caller's memory)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        return self.backend.pointer(self)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"


class DeviceBackend:
    """What the engine needs from a framework to work on its device memory.

    Streams and events are the framework's objects; :meth:`stream_handle` gives NCCL the raw ``cudaStream_t``.
    Every method that takes a ``stream`` enqueues work on it and returns without waiting.
    """

    name = "abstract"
    #: whether its memory can be handed to NCCL (a backend over host memory cannot: it is always staged)
    nccl_capable = True

    # -- devices and streams -----------------------------------------------------------------------------
    def current_device(self) -> int:
        raise NotImplementedError

    def set_device(self, device: int) -> None:
        """Make ``device`` current for the calling thread (NCCL creates communicators on the current device)."""
        raise NotImplementedError

    def device_id(self, device: int) -> str:
        """A string naming the physical device (its UUID): two ranks on one GPU have the same id."""
        raise NotImplementedError

    def new_stream(self, device: int, high_priority: bool = False) -> Any:
        """A new stream; ``high_priority``: the device's greatest priority (the engine's streams: communication
        must not wait behind compute)."""
        raise NotImplementedError

    def stream_handle(self, stream: Any) -> int:
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        """A new event recorded on ``stream``."""
        raise NotImplementedError

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (no host wait)."""
        raise NotImplementedError

    def release(self, event: Any) -> None:
        """``event`` will not be waited on or queried by the engine again: a backend may record it anew (an event
        pool).  A stream that waited on it keeps waiting for the point it was recorded at."""

    def query(self, event: Any) -> bool:
        """Whether the work before ``event`` has completed (no wait)."""
        raise NotImplementedError

    def synchronize(self, stream: Any) -> None:
        """Wait on the host until ``stream``'s work is done (host-staged path only)."""
        raise NotImplementedError

    def on_stream(self, stream: Any) -> ContextManager[Any]:
        """A scope in which work goes to ``stream`` (entered once per response, so that the methods below need not
        switch streams each)."""
        return contextlib.nullcontext()

    # -- memory -------------------------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: str, device: int, stream: Any) -> DeviceArray:
        """New device memory of engine dtype ``dtype``, safe to use on ``stream``."""
        raise NotImplementedError

    def pointer(self, array: DeviceArray) -> int:
        raise NotImplementedError

    def slice(self, array: DeviceArray, start: int, count: int, dtype: str) -> DeviceArray:
        """Elements ``start .. start+count`` of a flat ``array`` reinterpreted as engine dtype ``dtype`` (the fusion
        buffer is bytes; ``start`` and ``count`` are in elements of ``dtype``)."""
        raise NotImplementedError

    def keep_alive(self, array: DeviceArray, stream: Any) -> None:
        """Tell the framework's allocator that ``stream`` uses ``array`` (it must not be reused before)."""

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Any) -> None:
        """Device-to-device copy of ``src``'s elements into ``dst`` (same element count and dtype)."""
        raise NotImplementedError

    def copy_many(self, dsts: Sequence[DeviceArray], srcs: Sequence[DeviceArray], stream: Any) -> None:
        """:meth:`copy` of each pair, batched where the framework can (fusion staging: one launch, not one per
        tensor)."""
        for dst, src in zip(dsts, srcs):
            self.copy(dst, src, stream)

    def fill_zero(self, array: DeviceArray, stream: Any) -> None:
        raise NotImplementedError

    def scale(self, array: DeviceArray, factor: float, dtype: str, stream: Any) -> None:
        """Multiply in place as the host path does (integers truncated; halves computed in float32)."""
        raise NotImplementedError

    def divide(self, array: DeviceArray, divisor: int, dtype: str, stream: Any) -> None:
        """Average's division, as the host path does (a true division; integers truncated toward zero)."""
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of ``nbytes`` bytes (``uint8``), for asynchronous copies."""
        raise NotImplementedError

    def to_host(self, dst: np.ndarray, src: DeviceArray, stream: Any) -> None:
        """Asynchronous device-to-host copy into the pinned ``dst`` (``src.nbytes`` bytes)."""
        raise NotImplementedError

    def to_device(self, dst: DeviceArray, src: np.ndarray, stream: Any) -> None:
        """Host-to-device copy from ``src`` (any host array: the backend reads it as contiguous bytes; asynchronous
        when ``src`` is pinned)."""
        raise NotImplementedError


#: What the engine moves: a host array, or a binding's device array.
HostOrDevice = Union[np.ndarray, DeviceArray]
#: One of them, where a class holds one kind (``Entry[np.ndarray]``, ``View[DeviceArray]``...).
ArrayT = TypeVar("ArrayT", bound=HostOrDevice)

_backends: Dict[str, DeviceBackend] = {}


def register_backend(backend: DeviceBackend) -> None:
    """Make ``backend`` the one for its name (a binding calls this when imported)."""
    _backends[backend.name] = backend


def default_backend() -> Optional[DeviceBackend]:
    """The backend a rank without device tensors of its own uses (a joined rank taking part with zeros)."""
    return next(iter(_backends.values()), None)


_join_device: Optional[int] = None


def note_join(device: int = -1) -> None:
    """Remember the device a joined rank's zeros live on (``hvd.join(device=...)``; -1: the caller's current
    device, read on the caller's thread, not the engine's)."""
    global _join_device
    if device < 0:
        backend = default_backend()
        device = backend.current_device() if backend is not None else -1
    _join_device = device if device >= 0 else None


def join_device() -> Optional[int]:
    """The device :func:`note_join` remembered, else ``None``."""
    return _join_device


def nccl_version(path: str = "") -> int:
    """``major*10000 + minor*100 + patch`` of the NCCL this process can load (``path``: HOROVOD_NCCL_SO_PATH),
    0 when none loads."""
    from horovod.transport.nccl_lib import version_code

    return version_code(path)


def cuda_devices() -> int:
    """CUDA devices this machine's driver reports (0 without a driver)."""
    from horovod.transport.cuda_driver import device_count

    return device_count()
