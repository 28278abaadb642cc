"""Gradient compression for :class:`horovod.mxnet.DistributedTrainer`.

A compressor turns an NDArray into the NDArray that travels (``compress``) and back (``decompress``); the ``ctx``
returned by ``compress`` carries what ``decompress`` needs (here: the original dtype).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import mxnet as mx
import numpy as np


class Compressor:
    """Interface for compressing and decompressing an NDArray."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Any]:
        """Compress ``tensor``; returns the NDArray to communicate and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        """Undo :meth:`compress` using the context it returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        return tensor


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes; ~3 significant digits); others are left alone."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Optional[np.dtype]]:
        dtype = np.dtype(tensor.dtype)
        if _is_float(dtype) and dtype != np.float16:
            return tensor.astype(np.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Optional[np.dtype]) -> mx.nd.NDArray:
        if ctx is not None and _is_float(ctx) and np.dtype(tensor.dtype) != ctx:
            return tensor.astype(ctx)
        return tensor


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
