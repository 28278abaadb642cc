"""Gradient compression for :class:`horovod.torch.DistributedOptimizer` and ``allreduce(compression=...)``."""
from __future__ import annotations

import torch

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _TorchCast(CastCompressor):
    is_floating = staticmethod(lambda dtype: dtype.is_floating_point)
    cast = staticmethod(lambda tensor, dtype: tensor.to(dtype))


class FP16Compressor(_TorchCast):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range; reduced in float32)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
