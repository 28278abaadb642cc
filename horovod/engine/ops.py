"""Reduce ops, request kinds and dtype rules shared by the engine and every binding."""
from __future__ import annotations

from math import prod
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

# Reduce ops: the integer values of the original's C enum, which scripts pass around as ``hvd.Sum`` etc.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "AVERAGE", Sum: "SUM", Adasum: "ADASUM", Min: "MIN", Max: "MAX", Product: "PRODUCT"}
# What the transport is asked to do for each op (Average = sum then scale; Adasum is engine-level).
TRANSPORT_OP = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product"}

# Request kinds (the original's numbering, for timeline names and messages). Number 4 was the original's ADASUM
# kind; here Adasum is an allreduce whose op is Adasum, so that number is never used.
ALLREDUCE, ALLGATHER, BROADCAST, JOIN, _, ALLTOALL, BARRIER, REDUCESCATTER = range(8)
ADD_PROCESS_SET, REMOVE_PROCESS_SET = 100, 101
KIND_NAMES = {ALLREDUCE: "ALLREDUCE", ALLGATHER: "ALLGATHER", BROADCAST: "BROADCAST", JOIN: "JOIN",
              ALLTOALL: "ALLTOALL", BARRIER: "BARRIER", REDUCESCATTER: "REDUCESCATTER",
              ADD_PROCESS_SET: "ADD_PROCESS_SET", REMOVE_PROCESS_SET: "REMOVE_PROCESS_SET"}

# dtypes the engine moves.  bfloat16 travels as its uint16 bit pattern and is reduced in float32.
BFLOAT16 = "bfloat16"
SUPPORTED_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64",
                    "bool", BFLOAT16)

_NUMPY_OF: Dict[str, np.dtype] = {name: np.dtype(name) for name in SUPPORTED_DTYPES if name != BFLOAT16}
_NUMPY_OF[BFLOAT16] = np.dtype(np.uint16)
# ``dtype.name`` is computed on every access; the hot path looks the name up instead.
_NAME_OF: Dict[np.dtype, str] = {dt: name for name, dt in _NUMPY_OF.items() if name != BFLOAT16}


def row_elems(shape: Sequence[int]) -> int:
    """Elements per row (along the first dimension) of a tensor of ``shape``."""
    return prod(shape[1:]) if len(shape) > 1 else 1


def split_rows(rows: int, parts: int) -> List[int]:
    """Reducescatter split: ``rows // parts`` each, the first ``rows % parts`` get one more."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def block_bounds(counts: Sequence[int], index: int, row_bytes: int) -> Tuple[int, int]:
    """Bytes ``[start, stop)`` of block ``index`` among blocks of ``counts[i]`` rows of ``row_bytes`` each."""
    start = sum(counts[:index]) * row_bytes
    return start, start + counts[index] * row_bytes


class Typed(Protocol):
    """Anything with a numpy ``dtype``: a host array, or a :class:`~horovod.engine.device.DeviceArray`."""

    @property
    def dtype(self) -> np.dtype: ...


def dtype_name(array: Typed, override: Optional[str] = None) -> str:
    """The engine's name for an array's element type (``override`` marks uint16 storage as bfloat16).

    Raises:
        ValueError: the dtype is not one the engine can move.
    """
    name = override or _NAME_OF.get(array.dtype) or array.dtype.name
    if name not in _NUMPY_OF:
        raise ValueError(f"Tensor type {name} is not supported. Supported types: {', '.join(SUPPORTED_DTYPES)}.")
    return name


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype holding an engine dtype's bytes."""
    return _NUMPY_OF[name]


def compute_dtype(name: str) -> np.dtype:
    """The numpy dtype reductions run in (bfloat16 is widened to float32)."""
    return np.dtype(np.float32) if name == BFLOAT16 else _NUMPY_OF[name]


def bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> None:
    """Widen bfloat16 bit patterns (uint16) into float32 ``out``."""
    out.view(np.uint32)[...] = bits.astype(np.uint32) << 16


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to the nearest bfloat16 (ties to even) into uint16 ``out``; NaNs stay NaN."""
    bits = values.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x40)
    out[...] = rounded


def divide_inplace(buf: np.ndarray, divisor: int) -> None:
    """Divide by ``divisor`` in place, as Average does: a true division (float16 in float32), integers truncated
    toward zero. A division, not a multiplication by ``1 / divisor``: ``x * (1/3)`` and ``x / 3`` differ in the last
    bit, and scripts compare averages with ``tensor / size``."""
    if divisor == 1 or buf.dtype == np.bool_:
        return
    if buf.dtype.kind in "iu":
        quotient = np.divide(buf, divisor, dtype=np.float64)
        np.trunc(quotient, out=quotient)
        np.copyto(buf, quotient, casting="unsafe")
    elif buf.dtype == np.float16:
        # dtype= makes the float32 loop explicit: NumPy 1.x's value-based casting would pick the half loop.
        np.divide(buf, divisor, out=buf, dtype=np.float32, casting="unsafe")
    else:
        np.divide(buf, buf.dtype.type(divisor), out=buf)


class Finish:
    """The end of a reduction (the postscale factor, then Average's division) for a transport to apply to each
    piece of a result while that piece is still in cache: on a large result, a whole pass over memory fewer than
    finishing the reduced buffer afterwards (Average cost ~70 % on top of Sum at 64 MiB before, measured)."""

    __slots__ = ("postscale", "divisor")

    def __init__(self, postscale: float, divisor: int):
        self.postscale, self.divisor = postscale, divisor

    def __call__(self, piece: np.ndarray) -> None:
        """Finish ``piece`` in place."""
        scale_inplace(piece, self.postscale)
        divide_inplace(piece, self.divisor)

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write the finished values of ``src`` into ``dst`` (same shape and dtype; ``np.copyto``'s argument order,
        so a transport can use either): in one pass for a plain Average of float32/float64 (the same division as
        :func:`divide_inplace`, so the same bits)."""
        if self.postscale == 1.0 and dst.dtype.kind == "f" and dst.dtype != np.float16:
            np.divide(src, dst.dtype.type(self.divisor), out=dst)
            return
        np.copyto(dst, src)
        self(dst)


def finisher(op: int, postscale: float, set_size: int) -> Optional[Finish]:
    """The :class:`Finish` of a reduction, or None when it has nothing to do (Sum, Min, ... without a postscale)."""
    divisor = set_size if op == Average else 1
    if postscale == 1.0 and divisor == 1:
        return None
    return Finish(postscale, divisor)


def finish_reduction(buf: np.ndarray, op: int, postscale: float, set_size: int) -> None:
    """After the reduction: the postscale factor, then Average's division by the set size (what :class:`Finish`
    does, without building one: small reductions call this on every collective)."""
    if postscale != 1.0:
        scale_inplace(buf, postscale)
    if op == Average:
        divide_inplace(buf, set_size)


def scale_inplace(buf: np.ndarray, factor: float) -> None:
    """Multiply by ``factor`` in place; integer buffers truncate, as the original does."""
    if factor == 1.0:
        return
    if buf.dtype.kind in "iu":
        np.multiply(buf, factor, out=buf, casting="unsafe")   # in float64, then truncated
    elif buf.dtype == np.bool_:
        if factor == 0:
            buf[...] = False
    elif buf.dtype == np.float16:
        # In float32, rounded once to half (a half factor would lose 3 digits first). dtype= makes the float32
        # loop explicit: NumPy 1.x's value-based casting picks the half loop for a float32 scalar operand.
        np.multiply(buf, factor, out=buf, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(buf, buf.dtype.type(factor), out=buf)
