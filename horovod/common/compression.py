"""Gradient compression, shared by every binding.

A compressor turns a tensor into the tensor that travels (``compress``) and back (``decompress``); the ``ctx``
returned by ``compress`` carries what ``decompress`` needs (here: the original dtype).  A binding only says how
its tensors report their dtype, whether a dtype is floating point, and how to cast (:class:`CastCompressor`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """Compress ``tensor``; returns the tensor to communicate and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Undo :meth:`compress` using the context it returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; other dtypes are left alone.

    Subclasses per framework provide :meth:`dtype_of`, :meth:`is_floating` and :meth:`cast`; subclasses per
    precision set ``wire_dtype``.
    """

    wire_dtype: Any = None

    @staticmethod
    def dtype_of(tensor: Any) -> Any:
        return tensor.dtype

    @staticmethod
    def is_floating(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> Tuple[Any, Optional[Any]]:
        dtype = cls.dtype_of(tensor)
        if cls.is_floating(dtype) and dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Optional[Any]) -> Any:
        if ctx is not None and cls.is_floating(ctx) and cls.dtype_of(tensor) != ctx:
            return cls.cast(tensor, ctx)
        return tensor
