"""Gradient compression for ``allreduce(compression=...)``, the gradient tapes and the optimizers.

A compressor turns a tensor into the tensor that travels (``compress``) and back (``decompress``); the ``ctx``
returned by ``compress`` carries what ``decompress`` needs (here: the original dtype).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import tensorflow as tf


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Compress ``tensor``; returns the tensor to communicate and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Undo :meth:`compress` using the context it returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; other dtypes are left alone."""

    wire_dtype: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> Tuple[tf.Tensor, Optional[tf.DType]]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range; reduced in float32)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
