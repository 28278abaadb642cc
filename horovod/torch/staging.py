"""Torch tensors ↔ the numpy arrays the engine works on.

A contiguous CPU tensor is handed to the engine as a zero-copy numpy view, so in-place collectives really write
into the tensor's memory.  Tensors the engine cannot view directly — non-contiguous ones, tensors on an
accelerator — are *staged*: copied into a contiguous host tensor, and for in-place collectives the result is
copied back when the operation is synchronized.  bfloat16 has no numpy dtype; it travels as its 16-bit pattern
(``uint16``) with the engine dtype ``"bfloat16"``, and the engine reduces it in float32.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from horovod.engine import ops, result_pool

# torch dtype -> engine dtype name (the engine's numpy dtype for it is ops.storage_dtype(name)).
_ENGINE_DTYPE = {
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64", torch.bool: "bool",
    torch.bfloat16: ops.BFLOAT16,
}
if hasattr(torch, "uint16"):
    _ENGINE_DTYPE[torch.uint16] = "uint16"

_TORCH_DTYPE = {name: dtype for dtype, name in _ENGINE_DTYPE.items()}


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


def _check_tensor(tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError("sparse tensors cannot be reduced densely; use hvd.sparse_allreduce_async or "
                         "DistributedOptimizer(sparse_as_dense=True)")
    return tensor


def numpy_view(host: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()


def to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor over an engine result (a fresh, writeable array)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class Staged:
    """One tensor prepared for the engine.

    Attributes:
        tensor: the caller's tensor.
        host: a contiguous CPU tensor whose memory the engine reads (and, in place, writes).  It *is* ``tensor``
            (detached) when no staging was needed.
        array: numpy view of ``host``.
        dtype: engine dtype name.
        staged: True when ``host`` is a copy, so in-place results must be copied back to ``tensor``.
    """

    __slots__ = ("tensor", "host", "array", "dtype", "staged")

    def __init__(self, tensor: torch.Tensor):
        tensor = _check_tensor(tensor)
        self.tensor = tensor
        self.dtype = engine_dtype(tensor)
        host = tensor.detach()
        # Lazily negated views (is_neg) cannot be exported to numpy: they are staged like non-contiguous ones.
        self.staged = host.device.type != "cpu" or not host.is_contiguous() or host.is_neg()
        if self.staged:
            host = host.resolve_neg().to("cpu", memory_format=torch.contiguous_format, copy=True)
        self.host = host
        self.array = numpy_view(host)

    @property
    def override(self) -> Optional[str]:
        """The ``dtypes`` entry for the engine (only bfloat16 needs one)."""
        return ops.BFLOAT16 if self.dtype == ops.BFLOAT16 else None

    def fresh_output(self) -> Tuple[torch.Tensor, np.ndarray]:
        """A result buffer for an out-of-place reduction/broadcast: the staged copy, or a new host tensor."""
        if self.staged:
            return self.host, self.array
        # From the engine's result pool, not torch's allocator: large results reuse memory that is already
        # faulted in (a fresh 64 MiB torch.empty is mapped and zeroed page by page, ~15x the copy itself).
        array = result_pool.empty(self.array.shape, self.array.dtype)
        return to_torch(array, self.host.dtype), array

    def finish_inplace(self) -> torch.Tensor:
        """After an in-place collective: copy a staged result back into the caller's tensor; return it."""
        if self.staged:
            with torch.no_grad():
                self.tensor.copy_(self.host)
        return self.tensor

    def to_device(self, result: torch.Tensor) -> torch.Tensor:
        """Move a host result to the caller's device (no-op on CPU)."""
        if result.device != self.tensor.device:
            return result.to(self.tensor.device)
        return result


def overrides(staged) -> Optional[list]:
    """``dtypes=`` for a list of :class:`Staged` (``None`` when no entry needs an override)."""
    values = [s.override for s in staged]
    return values if any(v is not None for v in values) else None
