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

    def new_stream(self, device: int) -> Any:
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
        return DeviceArray(np.empty(tuple(shape), storage), shape, storage, device, self)

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
