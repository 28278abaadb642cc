"""Gradient compression for ``allreduce(compression=...)``, the gradient tapes and the optimizers."""
from __future__ import annotations

import tensorflow as tf

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _TFCast(CastCompressor):
    is_floating = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)


class FP16Compressor(_TFCast):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire_dtype = tf.float16


class BF16Compressor(_TFCast):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range; reduced in float32)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
