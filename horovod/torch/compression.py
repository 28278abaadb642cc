"""Gradient compression for :class:`horovod.torch.DistributedOptimizer` and ``allreduce(compression=...)``.

A compressor turns a tensor into the tensor that travels (``compress``) and back (``decompress``).  The
``ctx`` returned by ``compress`` carries whatever ``decompress`` needs (here: the original dtype).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Compress ``tensor``; returns the tensor to communicate and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress` using the context it returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; other dtypes are left alone."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.dtype]]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Optional[torch.dtype]) -> torch.Tensor:
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; ~3 significant digits)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range; reduced in float32)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
