"""CUDA tensors for the engine: torch's :class:`~horovod.engine.device.DeviceBackend`.

A contiguous CUDA tensor reaches the engine as a :class:`~horovod.engine.device.DeviceArray` over its own memory
(no copy), with an event recorded on the caller's current stream; the engine's collective runs on a stream of
its own and the caller's stream waits for its completion event when the result is used (:func:`wait_done`).
Memory the engine's stream touches is announced to torch's caching allocator (``record_stream``), so a tensor
freed by the caller is not handed out again before that stream is past it.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from horovod.engine import device as devices
from horovod.engine import ops
from horovod.engine.device import DeviceArray, DeviceBackend

_TORCH_DTYPE = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
    "bfloat16": torch.bfloat16,
}
if hasattr(torch, "uint16"):
    _TORCH_DTYPE["uint16"] = torch.uint16
_HALVES = (torch.float16, torch.bfloat16)


def _flat(array: DeviceArray) -> torch.Tensor:
    return array.owner.reshape(-1)


class TorchCudaBackend(DeviceBackend):
    """CUDA memory, streams and events through torch."""

    name = "torch.cuda"

    # -- devices and streams -----------------------------------------------------------------------------
    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: int) -> None:
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def device_id(self, device: int) -> str:
        props = torch.cuda.get_device_properties(device)
        return str(getattr(props, "uuid", "")) or f"{props.name}:{getattr(props, 'pci_bus_id', device)}"

    def new_stream(self, device: int) -> Any:
        return torch.cuda.Stream(device=device)

    def stream_handle(self, stream: Any) -> int:
        return stream.cuda_stream

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return event.query()

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    # -- memory -------------------------------------------------------------------------------------------
    def wrap(self, tensor: torch.Tensor) -> DeviceArray:
        """A contiguous CUDA tensor as a device array, ready once the caller's current stream gets here."""
        ready = self.record(torch.cuda.current_stream(tensor.device))
        storage = np.uint16 if tensor.dtype == torch.bfloat16 else ops.storage_dtype(_engine_name(tensor.dtype))
        return DeviceArray(tensor, tensor.shape, storage, tensor.device.index, self, ready)

    def empty(self, shape: Sequence[int], dtype: str, device: int, stream: Any) -> DeviceArray:
        with torch.cuda.stream(stream):
            tensor = torch.empty(tuple(shape), dtype=_TORCH_DTYPE[dtype], device=torch.device("cuda", device))
        return DeviceArray(tensor, shape, ops.storage_dtype(dtype), device, self)

    def pointer(self, array: DeviceArray) -> int:
        return array.owner.data_ptr()

    def slice(self, array: DeviceArray, start: int, count: int, dtype: str) -> DeviceArray:
        target = _TORCH_DTYPE[dtype]
        flat = _flat(array)
        if flat.dtype != target:
            item = flat.element_size()
            raw = flat.view(torch.uint8) if item != 1 else flat
            size = torch.empty((), dtype=target).element_size()
            piece = raw[start * size:(start + count) * size].view(target)
        else:
            piece = flat[start:start + count]
        return DeviceArray(piece, (count,), ops.storage_dtype(dtype), array.device, self)

    def keep_alive(self, array: DeviceArray, stream: Any) -> None:
        array.owner.record_stream(stream)

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Any) -> None:
        if not src.nbytes:
            return
        with torch.cuda.stream(stream):
            _flat(dst).copy_(_flat(src))

    def fill_zero(self, array: DeviceArray, stream: Any) -> None:
        with torch.cuda.stream(stream):
            array.owner.zero_()

    def scale(self, array: DeviceArray, factor: float, dtype: str, stream: Any) -> None:
        if factor == 1.0:
            return
        t = _flat(array)
        with torch.cuda.stream(stream):
            if t.dtype == torch.bool:
                if factor == 0:
                    t.zero_()
            elif not t.is_floating_point():
                t.copy_((t.to(torch.float64) * factor).trunc())    # in float64, truncated: the host rule
            elif t.dtype in _HALVES:
                t.copy_(t.float() * factor)                         # in float32, rounded once
            else:
                t.mul_(factor)

    def divide(self, array: DeviceArray, divisor: int, dtype: str, stream: Any) -> None:
        if divisor == 1:
            return
        t = _flat(array)
        with torch.cuda.stream(stream):
            if t.dtype == torch.bool:
                return
            if not t.is_floating_point():
                t.copy_(torch.div(t.to(torch.float64), divisor).trunc())
            elif t.dtype in _HALVES:
                t.copy_(t.float() / divisor)
            else:
                t.div_(divisor)

    def pinned(self, nbytes: int) -> np.ndarray:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def to_host(self, dst: np.ndarray, src: DeviceArray, stream: Any) -> None:
        if not src.nbytes:   # empty tensors may have zero strides, which byte views refuse
            return
        host = torch.from_numpy(dst.reshape(-1).view(np.uint8))
        with torch.cuda.stream(stream):
            host.copy_(_flat(src).view(torch.uint8), non_blocking=True)

    def to_device(self, dst: DeviceArray, src: np.ndarray, stream: Any) -> None:
        if not dst.nbytes:
            return
        host = torch.from_numpy(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
        with torch.cuda.stream(stream):
            _flat(dst).view(torch.uint8).copy_(host, non_blocking=True)


def _engine_name(dtype: torch.dtype) -> str:
    for name, value in _TORCH_DTYPE.items():
        if value == dtype:
            return name
    raise ValueError(f"Tensor type {dtype} is not supported on the GPU data plane.")


def wait_done(array: DeviceArray) -> torch.Tensor:
    """Make the caller's current stream wait for the collective that produced ``array``; its tensor."""
    tensor = array.owner
    stream = torch.cuda.current_stream(tensor.device)
    if array.done is not None:
        stream.wait_event(array.done)
    tensor.record_stream(stream)
    return tensor


_backend = None


def backend() -> TorchCudaBackend:
    """The process's backend, registered with the engine on first use."""
    global _backend
    if _backend is None:
        _backend = TorchCudaBackend()
        devices.register_backend(_backend)
    return _backend
