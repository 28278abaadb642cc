"""A device whose memory is host memory: the engine's device path (device arrays, the device executor's
agreement and host staging) run by CI, where there is no GPU.

:class:`HostMemoryBackend` implements :class:`horovod.engine.device.DeviceBackend` over numpy arrays (streams and
events are synchronous, so there is nothing to order); it declares itself unable to serve NCCL, so every process
set stages through host memory exactly as a GPU job without NCCL does.  :func:`install` makes ``horovod.numpy``
hand its arrays to the engine as device arrays of this backend (inside a test rank only).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from horovod.common.adapter import ArrayAdapter, View, c_order, from_storage, storage_view
from horovod.engine import device as devices
from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend


def _flat(array: DeviceArray) -> np.ndarray:
    return array.owner.reshape(-1)


class HostMemoryBackend(DeviceBackend):
    name = "host-memory"
    nccl_capable = False

    def current_device(self) -> int:
        return 0

    def set_device(self, device: int) -> None:
        pass

    def device_id(self, device: int) -> str:
        return "host-memory"

    def new_stream(self, device: int, high_priority: bool = False) -> Any:
        return None

    def stream_handle(self, stream: Any) -> int:
        return 0

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, stream: Any) -> None:
        pass

    def empty(self, shape: Sequence[int], dtype: str, device: int, stream: Any) -> DeviceArray:
        storage = ops.storage_dtype(dtype)
        array = DeviceArray(np.empty(tuple(shape), storage), shape, storage, device, self)
        array.allocated = True
        return array

    def pointer(self, array: DeviceArray) -> int:
        return array.owner.ctypes.data

    def slice(self, array: DeviceArray, start: int, count: int, dtype: str) -> DeviceArray:
        storage = ops.storage_dtype(dtype)
        flat = _flat(array)
        if flat.dtype != storage:
            flat = flat.view(np.uint8)[start * storage.itemsize:(start + count) * storage.itemsize].view(storage)
        else:
            flat = flat[start:start + count]
        return DeviceArray(flat, (count,), storage, array.device, self)

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Any) -> None:
        np.copyto(_flat(dst), _flat(src))

    def fill_zero(self, array: DeviceArray, stream: Any) -> None:
        array.owner[...] = 0

    def scale(self, array: DeviceArray, factor: float, dtype: str, stream: Any) -> None:
        ops.scale_inplace(_flat(array), factor)

    def divide(self, array: DeviceArray, divisor: int, dtype: str, stream: Any) -> None:
        ops.divide_inplace(_flat(array), divisor)

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def to_host(self, dst: np.ndarray, src: DeviceArray, stream: Any) -> None:
        np.copyto(dst.reshape(-1).view(np.uint8), _flat(src).view(np.uint8))

    def to_device(self, dst: DeviceArray, src: np.ndarray, stream: Any) -> None:
        np.copyto(_flat(dst).view(np.uint8), np.ascontiguousarray(src).reshape(-1).view(np.uint8))


class DeviceArrayAdapter(ArrayAdapter):
    """numpy arrays handed to the engine as device arrays of :class:`HostMemoryBackend`."""

    def __init__(self, backend: HostMemoryBackend):
        self.backend = backend

    def _wrap(self, view: View) -> View:
        a = view.array
        view.array = DeviceArray(a, a.shape, a.dtype, 0, self.backend)
        return view

    def view(self, tensor: Any) -> View:
        array, copied = c_order(tensor)
        storage, dtype = storage_view(array)
        return self._wrap(View(tensor, storage, dtype, copied))

    def inplace_view(self, tensor: Any) -> View:
        return self._wrap(super().inplace_view(tensor))

    def fresh_output(self, view: View):
        if view.staged:
            return view.array
        a = view.array
        return self.backend.empty(a.shape, view.dtype or ops.dtype_name(a.owner), 0, None)

    def result(self, array, view: View) -> np.ndarray:
        return super().result(array.owner, view)

    def write_back(self, tensor: np.ndarray, array) -> np.ndarray:
        np.copyto(tensor, from_storage(array.owner, tensor.dtype), casting="no")
        return tensor


def install(binding) -> None:
    """Make ``binding`` (``horovod.numpy``) pass device arrays of a host-memory backend to the engine."""
    backend = HostMemoryBackend()
    devices.register_backend(backend)
    binding._collectives.adapter = DeviceArrayAdapter(backend)


class _Event:
    """An emulated CUDA event: complete unless it was recorded behind work of the stand-in NCCL that never completes
    (the stand-in's streams are synchronous, so what was recorded before that work is done, as on a GPU stream:
    reading the stuck state at query time instead failed a collective finished before the stuck one, whenever the
    watchdog first looked at it after the stuck call was enqueued)."""

    __slots__ = ("backend", "behind_stuck_work")

    def __init__(self, backend: "NcclHostBackend"):
        self.backend = backend
        self.behind_stuck_work = backend.busy()


class NcclHostBackend(HostMemoryBackend):
    """A host-memory "GPU" that NCCL may use: with the stand-in NCCL (tests/gpu/standin_nccl) loaded through
    ``HOROVOD_NCCL_SO_PATH``, the device executor's NCCL path runs on the CPU.

    Each process is its own GPU (its id names the process), the current device is per thread, and what the engine
    asks of the device is recorded in :attr:`calls` (``(what, detail)``) for the tests to read.  Events complete
    at once unless recorded while the stand-in says its emulated GPU is stuck (``standinBusy()``: a collective that
    never completes, until its communicator is aborted).
    """

    name = "host-memory-nccl"
    nccl_capable = True

    def __init__(self, standin_path: str = ""):
        import ctypes
        import os
        import threading

        self._local = threading.local()
        self.calls: list = []
        self.violations: list = []
        self._pending_reads: set = set()
        self._lib = ctypes.CDLL(standin_path) if standin_path else None
        self._uid = f"emulated-gpu-{os.getpid()}"

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: int) -> None:
        self._local.device = device
        self.calls.append(("set_device", device))

    def device_id(self, device: int) -> str:
        return f"{self._uid}:{device}"

    def new_stream(self, device: int, high_priority: bool = False) -> Any:
        self.calls.append(("new_stream", (device, high_priority)))
        return None

    def busy(self) -> bool:
        return bool(self._lib is not None and self._lib.standinBusy())

    def record(self, stream: Any) -> Any:
        return _Event(self)

    def wait(self, stream: Any, event: Any) -> None:
        self.calls.append(("wait", id(event)))

    def query(self, event: Any) -> bool:
        return event is None or not (event.behind_stuck_work and self.busy())

    def synchronize(self, stream: Any) -> None:
        self._pending_reads.clear()

    def empty(self, shape: Sequence[int], dtype: str, device: int, stream: Any) -> DeviceArray:
        self.calls.append(("empty", device))
        return super().empty(shape, dtype, device, stream)

    def keep_alive(self, array: DeviceArray, stream: Any) -> None:
        self.calls.append(("keep_alive", self.pointer(array)))

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Any) -> None:
        self.calls.append(("copy", src.nbytes))
        super().copy(dst, src, stream)

    def copy_many(self, dsts: Sequence[DeviceArray], srcs: Sequence[DeviceArray], stream: Any) -> None:
        self.calls.append(("copy_many", len(dsts)))
        for dst, src in zip(dsts, srcs):
            HostMemoryBackend.copy(self, dst, src, stream)

    def pinned(self, nbytes: int) -> np.ndarray:
        if self._pending_reads:   # a GPU would still be copying out of the buffer being replaced
            self.violations.append("a pinned buffer was replaced while a copy could still read the old one")
        return super().pinned(nbytes)

    def to_device(self, dst: DeviceArray, src: np.ndarray, stream: Any) -> None:
        self._pending_reads.add(id(src))   # asynchronous on a GPU: reads src until the stream gets there
        super().to_device(dst, src, stream)


def install_nccl(binding, standin_path: str) -> NcclHostBackend:
    """Make ``binding`` (``horovod.numpy``) pass device arrays of an NCCL-capable host-memory backend."""
    backend = NcclHostBackend(standin_path)
    devices.register_backend(backend)
    binding._collectives.adapter = DeviceArrayAdapter(backend)
    return backend
