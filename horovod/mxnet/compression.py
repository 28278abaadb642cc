"""Gradient compression for :class:`horovod.mxnet.DistributedTrainer`."""
from __future__ import annotations

import numpy as np

from horovod.common.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class FP16Compressor(CastCompressor):
    """Floating-point NDArrays travel as float16 (half the bytes; about 3 significant digits)."""

    wire_dtype = np.dtype(np.float16)
    dtype_of = staticmethod(lambda tensor: np.dtype(tensor.dtype))
    is_floating = staticmethod(lambda dtype: np.issubdtype(np.dtype(dtype), np.floating))
    cast = staticmethod(lambda tensor, dtype: tensor.astype(dtype))


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
