"""Torch tensors ↔ the numpy arrays the engine works on: torch's :class:`~horovod.common.adapter.TensorAdapter`.

A contiguous CPU tensor is handed to the engine as a zero-copy numpy view, so in-place collectives really write
into the tensor's memory.  A CUDA tensor is handed over as a device array over its own memory
(:mod:`horovod.torch.cuda`): the engine runs its collective on the GPU (NCCL) or stages it through pinned host
memory itself, ordered by CUDA events.  Tensors the engine cannot view directly — non-contiguous ones, lazily
negated views, tensors on other accelerators — are *staged*: copied into a contiguous tensor (on the same device
for CUDA, else on the host), and for in-place collectives the result is copied back when the operation is
synchronized.  bfloat16 travels as its 16-bit pattern, as the
protocol says; torch reaches those bits through an int16 view (numpy has no bfloat16).
"""
from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np
import torch

from horovod.common.adapter import BFLOAT16, TensorAdapter, View
from horovod.engine.device import DeviceArray, HostOrDevice
from horovod.torch import cuda

logger = logging.getLogger(__name__)

# torch dtype -> engine dtype name (the engine's numpy dtype for it is ops.storage_dtype(name)).
_ENGINE_DTYPE = {
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64", torch.bool: "bool",
    torch.bfloat16: BFLOAT16,
}
if hasattr(torch, "uint16"):
    _ENGINE_DTYPE[torch.uint16] = "uint16"


def engine_dtype(tensor: torch.Tensor) -> str:
    """The engine's name for ``tensor``'s dtype.

    Raises:
        ValueError: the dtype cannot travel through the engine (complex, float8, uint32/64, quantized ...).
    """
    try:
        return _ENGINE_DTYPE[tensor.dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _ENGINE_DTYPE)
        raise ValueError(f"Tensor type {tensor.dtype} is not supported. Supported types: {supported}.") from None


def numpy_view(host: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()


def to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor over an engine result (a fresh, writeable array in storage form)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _current_graph_task() -> int:
    """The id of the autograd graph task this thread runs (-1 outside ``backward``)."""
    try:
        return int(torch._C._current_graph_task_id())
    except (AttributeError, RuntimeError):
        return -1


class ModifiedWhileInFlight(ValueError):
    """A tensor was modified in place while an asynchronous collective on it ran (see :class:`TorchView`); a misuse,
    like a duplicate name, so a ValueError (never a HorovodInternalError, which an elastic job would take for a
    failed peer)."""


class TorchView(View[HostOrDevice]):
    """A :class:`View` that remembers the tensor's version counter when the collective started.

    The rule for asynchronous collectives (docs/reliability.md): a tensor handed to one must not be modified until
    ``synchronize`` returns; the engine reads (and, in place, writes) its memory meanwhile, so a change gives a
    result that depends on timing. torch counts every in-place change of a tensor (``_version``): ``synchronize``
    compares, and raises :class:`ModifiedWhileInFlight` instead of returning such a result. Checked for tensors
    in CPU memory that the engine reads directly, and for staged copies written back in place (the change would be
    silently overwritten); a staged input of an out-of-place collective is a private copy and cannot be affected.
    A collective started inside ``backward`` (DistributedOptimizer's gradient hooks) only logs a warning: its
    caller synchronizes many handles in a row, and an error in the middle would leave the rest in flight.
    """

    __slots__ = ("version", "in_backward")

    def __init__(self, tensor: torch.Tensor, array: HostOrDevice, dtype: Optional[str], staged: bool):
        super().__init__(tensor, array, dtype, staged)
        try:
            self.version: Optional[int] = tensor._version
        except RuntimeError:   # inference tensors have no version counter
            self.version = None
        # Started from a backward hook (DistributedOptimizer's gradients): the caller is an optimizer that
        # synchronizes many handles in a row, and must not be left half done; it gets a warning instead.
        self.in_backward = _current_graph_task() >= 0

    def check_unchanged(self, inplace: bool) -> None:
        tensor = self.tensor
        if self.version is None or (self.staged and not inplace) or isinstance(self.array, DeviceArray):
            return
        now = tensor._version
        if now != self.version:
            if self.in_backward:
                logger.warning(
                    "a %s gradient of shape %s was modified in place (version %d -> %d) while its allreduce, "
                    "started by a backward hook, was running: its reduced value depends on timing (a second "
                    "backward before optimizer.step(), or a hook writing into .grad?)", tensor.dtype,
                    tuple(tensor.shape), self.version, now)
                return
            raise ModifiedWhileInFlight(
                f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)} was modified in place (its version went "
                f"from {self.version} to {now}) while a Horovod {'in-place ' if inplace else ''}collective on it "
                f"was running: the result would depend on timing (old and new values mixed). Do not write to a "
                f"tensor between an *_async call and synchronize(); copy it first (tensor.clone()) if you need to "
                f"keep working on it.")


class TorchAdapter(TensorAdapter[HostOrDevice]):
    """torch tensors of any device: CPU memory is viewed, everything else staged through host memory."""

    def view(self, tensor: torch.Tensor) -> View[HostOrDevice]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_sparse:
            raise ValueError("sparse tensors cannot be reduced densely; use hvd.sparse_allreduce_async or "
                             "DistributedOptimizer(sparse_as_dense=True)")
        dtype = engine_dtype(tensor)
        if tensor.is_cuda:
            return self._cuda_view(tensor, dtype)
        host = tensor.detach()
        # Lazily negated views (is_neg) cannot be exported to numpy: they are staged like non-contiguous ones.
        staged = host.device.type != "cpu" or not host.is_contiguous() or host.is_neg()
        if staged:
            host = host.resolve_neg().to("cpu", memory_format=torch.contiguous_format, copy=True)
        return TorchView(tensor, numpy_view(host), BFLOAT16 if dtype == BFLOAT16 else None, staged)

    @staticmethod
    def _cuda_view(tensor: torch.Tensor, dtype: str) -> View[HostOrDevice]:
        device_tensor = tensor.detach()
        staged = not device_tensor.is_contiguous() or device_tensor.is_neg()
        if staged:
            device_tensor = device_tensor.resolve_neg().contiguous()
        return View(tensor, cuda.backend().wrap(device_tensor), BFLOAT16 if dtype == BFLOAT16 else None, staged)

    def fresh_output(self, view: View[HostOrDevice]) -> HostOrDevice:
        array = view.array
        if isinstance(array, DeviceArray):
            if view.staged:
                return array
            return array.backend.empty(array.shape, view.dtype or engine_dtype(view.tensor), array.device,
                                       torch.cuda.current_stream(array.device))
        return super().fresh_output(view)

    def result(self, array: HostOrDevice, view: View[HostOrDevice]) -> torch.Tensor:
        if isinstance(view, TorchView):
            view.check_unchanged(inplace=False)
        tensor = view.tensor
        if isinstance(array, DeviceArray):
            return cuda.wait_done(array)
        out = to_torch(array, tensor.dtype)
        return out if out.device == tensor.device else out.to(tensor.device)

    def write_back(self, tensor: torch.Tensor, array: HostOrDevice) -> torch.Tensor:
        source = cuda.wait_done(array).view(tensor.shape) if isinstance(array, DeviceArray) \
            else to_torch(array, tensor.dtype)
        with torch.no_grad():
            tensor.copy_(source)
        return tensor

    def finish_inplace(self, view: View[HostOrDevice]) -> torch.Tensor:
        if isinstance(view, TorchView):
            view.check_unchanged(inplace=True)
        if isinstance(view.array, DeviceArray) and not view.staged:
            cuda.wait_done(view.array)
            return view.tensor
        return super().finish_inplace(view)

    def splits(self, splits) -> Optional[List[int]]:
        if isinstance(splits, torch.Tensor):
            return [int(v) for v in splits.reshape(-1).tolist()]
        return None if splits is None else [int(v) for v in splits]

    def received_splits(self, received: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(received)


# Joined ranks take part in GPU collectives with zeros on their current device: the engine needs the backend
# even on a rank that has not handed over a CUDA tensor yet.
if torch.cuda.is_available():
    cuda.backend()
