"""CUDA tensors for the engine: torch's :class:`~horovod.engine.device.DeviceBackend`.

A contiguous CUDA tensor reaches the engine as a :class:`~horovod.engine.device.DeviceArray` over its own memory
(no copy), with an event recorded on the caller's current stream; the engine's collective runs on a stream of
its own and the caller's stream waits for its completion event when the result is used (:func:`wait_done`).
Memory the engine's stream touches is announced to torch's caching allocator (``record_stream``), so a tensor
freed by the caller is not handed out again before that stream is past it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence

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
_ITEMSIZE = {name: ops.storage_dtype(name).itemsize for name in _TORCH_DTYPE}
_POOL_LIMIT = 1024   # events kept for reuse


def _flat(array: DeviceArray) -> torch.Tensor:
    return array.owner.reshape(-1)


class TorchCudaBackend(DeviceBackend):
    """CUDA memory, streams and events through torch.

    Host cost per collective matters (one allreduce is a few tens of microseconds of Python): events come from a
    pool (an event the engine released is recorded anew), the engine's stream is entered once per response
    (:meth:`on_stream`) instead of once per copy, and fusion staging is one ``torch._foreach_copy_``.
    """

    name = "torch.cuda"

    def __init__(self) -> None:
        self._events: List[Any] = []
        self._active: Any = None   # the stream entered by on_stream (the engine's thread only)

    # -- devices and streams -----------------------------------------------------------------------------
    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: int) -> None:
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def device_id(self, device: int) -> str:
        props = torch.cuda.get_device_properties(device)
        return str(getattr(props, "uuid", "")) or f"{props.name}:{getattr(props, 'pci_bus_id', device)}"

    def new_stream(self, device: int, high_priority: bool = False) -> Any:
        if not high_priority:
            return torch.cuda.Stream(device=device)
        try:   # a value beyond the device's range maps to its greatest priority
            return torch.cuda.Stream(device=device, priority=-100)
        except (RuntimeError, ValueError):
            return torch.cuda.Stream(device=device, priority=-1)

    def stream_handle(self, stream: Any) -> int:
        return stream.cuda_stream

    def record(self, stream: Any) -> Any:
        try:
            event = self._events.pop()
        except IndexError:
            event = torch.cuda.Event()
        event.record(stream)
        return event

    def release(self, event: Any) -> None:
        if len(self._events) < _POOL_LIMIT:
            self._events.append(event)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return event.query()

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        with self._on(stream):
            previous, self._active = self._active, stream
            try:
                yield
            finally:
                self._active = previous

    def _on(self, stream: Any):
        """``torch.cuda.stream(stream)``, or nothing when :meth:`on_stream` entered it already."""
        return contextlib.nullcontext() if stream is self._active else torch.cuda.stream(stream)

    # -- memory -------------------------------------------------------------------------------------------
    def wrap(self, tensor: torch.Tensor) -> DeviceArray:
        """A contiguous CUDA tensor as a device array, ready once the caller's current stream gets here."""
        ready = self.record(torch.cuda.current_stream(tensor.device))
        storage = np.uint16 if tensor.dtype == torch.bfloat16 else ops.storage_dtype(_engine_name(tensor.dtype))
        return DeviceArray(tensor, tensor.shape, storage, tensor.device.index, self, ready)

    def empty(self, shape: Sequence[int], dtype: str, device: int, stream: Any) -> DeviceArray:
        with self._on(stream):
            tensor = torch.empty(tuple(shape), dtype=_TORCH_DTYPE[dtype], device=torch.device("cuda", device))
        array = DeviceArray(tensor, shape, ops.storage_dtype(dtype), device, self)
        array.allocated = True
        return array

    def pointer(self, array: DeviceArray) -> int:
        return array.owner.data_ptr()

    def slice(self, array: DeviceArray, start: int, count: int, dtype: str) -> DeviceArray:
        target = _TORCH_DTYPE[dtype]
        flat = _flat(array)
        if flat.dtype != target:
            item = flat.element_size()
            raw = flat.view(torch.uint8) if item != 1 else flat
            size = _ITEMSIZE[dtype]
            piece = raw[start * size:(start + count) * size].view(target)
        else:
            piece = flat[start:start + count]
        return DeviceArray(piece, (count,), ops.storage_dtype(dtype), array.device, self)

    def keep_alive(self, array: DeviceArray, stream: Any) -> None:
        array.owner.record_stream(stream)

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Any) -> None:
        if not src.nbytes:
            return
        with self._on(stream):
            _flat(dst).copy_(_flat(src))

    def copy_many(self, dsts: Sequence[DeviceArray], srcs: Sequence[DeviceArray], stream: Any) -> None:
        pairs = [(_flat(d), _flat(s)) for d, s in zip(dsts, srcs) if s.nbytes]
        if not pairs:
            return
        with self._on(stream):
            if hasattr(torch, "_foreach_copy_"):   # one launch for every pair
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            else:
                for d, s in pairs:
                    d.copy_(s)

    def fill_zero(self, array: DeviceArray, stream: Any) -> None:
        with self._on(stream):
            array.owner.zero_()

    def scale(self, array: DeviceArray, factor: float, dtype: str, stream: Any) -> None:
        if factor == 1.0:
            return
        t = _flat(array)
        with self._on(stream):
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
        with self._on(stream):
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
        with self._on(stream):
            host.copy_(_flat(src).view(torch.uint8), non_blocking=True)

    def to_device(self, dst: DeviceArray, src: np.ndarray, stream: Any) -> None:
        if not dst.nbytes:
            return
        host = torch.from_numpy(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
        with self._on(stream):
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
    if array.allocated:   # made on the engine's stream, used on the caller's from now on
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
