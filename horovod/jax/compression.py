"""Gradient compression for :func:`horovod.jax.DistributedOptimizer` and ``allreduce(compression=...)``.

The casts are ``jnp`` operations, so they work on concrete arrays and inside ``jax.jit`` alike (there they are
compiled into the step, before and after the host callback that reduces).
"""
from __future__ import annotations

import jax.numpy as jnp

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _JaxCast(CastCompressor):
    is_floating = staticmethod(lambda dtype: jnp.issubdtype(dtype, jnp.floating))
    cast = staticmethod(lambda tensor, dtype: tensor.astype(dtype))


class FP16Compressor(_JaxCast):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire_dtype = jnp.dtype(jnp.float16)


class BF16Compressor(_JaxCast):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range)."""

    wire_dtype = jnp.dtype(jnp.bfloat16)


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
