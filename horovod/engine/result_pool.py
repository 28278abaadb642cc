"""Result arrays for out-of-place collectives, recycled from memory that is already faulted in.

A fresh 64 MiB result costs more than the collective that fills it: the kernel maps and zeroes every page on first
touch (about as long as the allreduce itself on this kind of machine, measured in benchmarks/collectives.py's
``allreduce-new`` rows), and frees them again when the caller drops the result. Training loops return results
of the same sizes step after step, so a result's memory is worth keeping once the caller is done with it.

How a block comes back: a result array's ``base`` is a :class:`_Lease` (numpy keeps the object that exposes
``__array_interface__`` as the base), and every view, torch tensor (``torch.from_numpy``) or slice of the result
keeps that base alive. When the last of them is gone, CPython drops the lease at once and its ``__del__`` returns
the block to the pool. Only results of at least :data:`MIN_BYTES` are pooled (small ones are cheap to allocate),
and the pool keeps at most :data:`MAX_POOLED_BYTES` of free blocks (least recently freed dropped first), so idle
memory stays bounded.
"""
from __future__ import annotations

import collections
import threading
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

#: Results below this size come straight from numpy: their pages are few and the pool's bookkeeping is not free.
MIN_BYTES = 1 << 20
#: Free blocks kept for reuse, in bytes, at most (the memory a job may hold beyond its live results).
MAX_POOLED_BYTES = 256 << 20


class _Lease:
    """Holds one pooled block for as long as a result (or any view of it) is alive."""

    __slots__ = ("block", "__array_interface__", "__weakref__")

    def __init__(self, block: np.ndarray, shape: Tuple[int, ...], dtype: np.dtype):
        self.block = block
        self.__array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "descr": dtype.descr,
                                    "data": (block.ctypes.data, False), "strides": None, "version": 3}

    def __del__(self) -> None:
        block = self.block
        self.block = None
        if block is not None and _POOL is not None:  # None: the interpreter is tearing the module down
            _POOL.release(block)


class ResultPool:
    """Free blocks of raw bytes, keyed by exact size; the least recently freed go first when over the cap."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES):
        # Re-entrant: a lease freed by the cyclic GC (which may run on any allocation, even one made while the
        # lock is held) returns its block from inside the same thread.
        self._lock = threading.RLock()
        self._free: Dict[int, List[np.ndarray]] = {}  # nbytes -> free blocks, most recently freed last
        self._age: "collections.OrderedDict[int, np.ndarray]" = collections.OrderedDict()  # id -> block, oldest first
        self._bytes = 0
        self.max_bytes = max_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A block of ``nbytes`` bytes: a recycled one when the pool has it, else a new one."""
        with self._lock:
            blocks = self._free.get(nbytes)
            if blocks:
                block = blocks.pop()
                del self._age[id(block)]
                self._bytes -= nbytes
                return block
        return np.empty(nbytes, dtype=np.uint8)  # numpy advises huge pages for large arrays

    def release(self, block: np.ndarray) -> None:
        """Give a block back; the oldest free blocks are dropped while the pool is over its cap."""
        if block.nbytes > self.max_bytes:
            return
        with self._lock:
            self._free.setdefault(block.nbytes, []).append(block)
            self._age[id(block)] = block
            self._bytes += block.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._age.popitem(last=False)
                same = self._free[old.nbytes]
                same[:] = [b for b in same if b is not old]
                self._bytes -= old.nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks right now."""
        return self._bytes

    def clear(self) -> None:
        """Drop every free block (``shutdown()`` calls this so a finished job holds no memory)."""
        with self._lock:
            self._free.clear()
            self._age.clear()
            self._bytes = 0


_POOL = ResultPool()


def empty(shape: Union[int, Sequence[int]], dtype) -> np.ndarray:
    """A new, writeable, C-contiguous array for a collective's result (contents undefined)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MIN_BYTES or dtype.hasobject:
        return np.empty(shape, dtype=dtype)
    return np.asarray(_Lease(_POOL.take(nbytes), shape, dtype))


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` with ``array``'s shape and dtype."""
    return empty(array.shape, array.dtype)


def pool() -> ResultPool:
    """The process's pool (for shutdown and tests)."""
    return _POOL
