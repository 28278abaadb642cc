"""Torch tensors ↔ the numpy arrays the engine works on: torch's :class:`~horovod.common.adapter.TensorAdapter`.

A contiguous CPU tensor is handed to the engine as a zero-copy numpy view, so in-place collectives really write
into the tensor's memory.  Tensors the engine cannot view directly — non-contiguous ones, lazily negated views,
tensors on an accelerator — are *staged*: copied into a contiguous host tensor, and for in-place collectives the
result is copied back when the operation is synchronized.  bfloat16 travels as its 16-bit pattern, as the
protocol says; torch reaches those bits through an int16 view (numpy has no bfloat16).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from horovod.common.adapter import BFLOAT16, TensorAdapter, View

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


class TorchAdapter(TensorAdapter):
    """torch tensors of any device: CPU memory is viewed, everything else staged through host memory."""

    def view(self, tensor: torch.Tensor) -> View:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_sparse:
            raise ValueError("sparse tensors cannot be reduced densely; use hvd.sparse_allreduce_async or "
                             "DistributedOptimizer(sparse_as_dense=True)")
        dtype = engine_dtype(tensor)
        host = tensor.detach()
        # Lazily negated views (is_neg) cannot be exported to numpy: they are staged like non-contiguous ones.
        staged = host.device.type != "cpu" or not host.is_contiguous() or host.is_neg()
        if staged:
            host = host.resolve_neg().to("cpu", memory_format=torch.contiguous_format, copy=True)
        return View(tensor, numpy_view(host), BFLOAT16 if dtype == BFLOAT16 else None, staged)

    def result(self, array: np.ndarray, view: View) -> torch.Tensor:
        tensor = view.tensor
        out = to_torch(array, tensor.dtype)
        return out if out.device == tensor.device else out.to(tensor.device)

    def write_back(self, tensor: torch.Tensor, array: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(to_torch(array, tensor.dtype))
        return tensor

    def splits(self, splits) -> Optional[List[int]]:
        if isinstance(splits, torch.Tensor):
            return [int(v) for v in splits.reshape(-1).tolist()]
        return None if splits is None else [int(v) for v in splits]

    def received_splits(self, received: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(received)
