"""Result arrays for out-of-place collectives, recycled from memory that is already faulted in.

A fresh 64 MiB result costs more than the collective that fills it: the kernel maps and zeroes every page on first
touch (about as long as the allreduce itself on this kind of machine, measured in benchmarks/collectives.py's
``allreduce-new`` rows), and frees them again when the caller drops the result. Training loops return results
of the same sizes step after step, so a result's memory is worth keeping once the caller is done with it.

How a block comes back: a result array's ``base`` is a :class:`_Lease` (numpy keeps the object that exposes
``__array_interface__`` as the base), and every view, torch tensor (``torch.from_numpy``) or slice of the result
keeps that base alive. When the last of them is gone, CPython drops the lease at once and its ``__del__`` returns
the block to the pool. Only results of at least :data:`MIN_BYTES` are pooled (small ones are cheap to allocate).

What the pool may hold is bounded three ways, because a job with occasional large tensors of ever-changing sizes
would otherwise fill it with blocks nobody asks for again (RSS grew by the whole cap and stayed there until
``shutdown()``):

* a request takes the smallest free block that holds it without wasting more than a third
  (:data:`MAX_SLACK`), so results of similar sizes share blocks instead of each keeping its own;
* at most :data:`MAX_POOLED_BYTES` of free blocks (least recently freed dropped first);
* a block nobody took for :data:`MAX_IDLE_S` seconds is dropped (checked whenever the pool is used).
"""
from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

#: Results below this size come straight from numpy: their pages are few and the pool's bookkeeping is not free.
MIN_BYTES = 1 << 20
#: Free blocks kept for reuse, in bytes, at most (the memory a job may hold beyond its live results).
MAX_POOLED_BYTES = 96 << 20
#: A request may take a free block up to this fraction larger than itself.
MAX_SLACK = 1 / 3
#: Seconds a free block may wait for a taker before it is dropped.
MAX_IDLE_S = 10.0


class _Lease:
    """Holds one pooled block for as long as a result (or any view of it) is alive."""

    __slots__ = ("block", "__array_interface__", "__weakref__")

    def __init__(self, block: np.ndarray, shape: Tuple[int, ...], dtype: np.dtype):
        self.block: Optional[np.ndarray] = block
        # (``block.ctypes`` and ``dtype.descr`` run Python code inside numpy; a plain dtype needs no ``descr``)
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str, "data": block.__array_interface__["data"],
                                    "strides": None, "version": 3, **({"descr": dtype.descr} if dtype.names else {})}

    def __del__(self) -> None:
        block = self.block
        self.block = None
        if block is not None and _POOL is not None:  # None: the interpreter is tearing the module down
            _POOL.release(block)


class ResultPool:
    """Free blocks of raw bytes; see the module docstring for what it keeps and for how long.

    Args:
        max_bytes: free bytes kept at most.
        max_idle_s: seconds a free block is kept without a taker.
        clock: monotonic clock (tests pass their own).
    """

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES, max_idle_s: float = MAX_IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        # Re-entrant: a lease freed by the cyclic GC (which may run on any allocation, even one made while the
        # lock is held) returns its block from inside the same thread.
        self._lock = threading.RLock()
        self._free: Dict[int, List[np.ndarray]] = {}   # nbytes -> free blocks, most recently freed last
        self._sizes: List[int] = []                      # the keys of _free, sorted (for the best fit)
        # id -> (block, when freed), least recently freed first
        self._age: "collections.OrderedDict[int, Tuple[np.ndarray, float]]" = collections.OrderedDict()
        self._bytes = 0
        self.max_bytes = max_bytes
        self.max_idle_s = max_idle_s
        self._clock = clock

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` bytes (at most :data:`MAX_SLACK` more): recycled when the pool has
        one, else new."""
        with self._lock:
            self._drop_idle()
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= nbytes + int(nbytes * MAX_SLACK):
                block = self._free[self._sizes[i]][-1]
                self._forget(block)
                return block
        return np.empty(nbytes, dtype=np.uint8)  # numpy advises huge pages for large arrays

    def release(self, block: np.ndarray) -> None:
        """Give a block back; the oldest free blocks are dropped while the pool is over its cap."""
        if block.nbytes > self.max_bytes:
            return
        with self._lock:
            size = block.nbytes
            same = self._free.get(size)
            if same is None:
                same = self._free[size] = []
                bisect.insort(self._sizes, size)
            same.append(block)
            self._age[id(block)] = (block, self._clock())
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._forget(next(iter(self._age.values()))[0])
            self._drop_idle()

    def _drop_idle(self) -> None:
        limit = self._clock() - self.max_idle_s
        while self._age:
            block, freed = next(iter(self._age.values()))
            if freed > limit:
                return
            self._forget(block)

    def _forget(self, block: np.ndarray) -> None:
        """Take ``block`` out of the free lists (the caller holds the lock)."""
        del self._age[id(block)]
        size = block.nbytes
        same = self._free[size]
        same[:] = [b for b in same if b is not block]
        if not same:
            del self._free[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
        self._bytes -= size

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks right now."""
        return self._bytes

    def clear(self) -> None:
        """Drop every free block (``shutdown()`` calls this so a finished job holds no memory)."""
        with self._lock:
            self._free.clear()
            self._sizes.clear()
            self._age.clear()
            self._bytes = 0


_POOL = ResultPool()


def empty(shape: Union[int, Sequence[int]], dtype) -> np.ndarray:
    """A new, writeable, C-contiguous result array (contents undefined); on every call's path: builtins only."""
    dtype = np.dtype(dtype)
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes < MIN_BYTES or dtype.hasobject:
        return np.empty(dims, dtype=dtype)
    return np.asarray(_Lease(_POOL.take(nbytes), dims, dtype))


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` with ``array``'s shape and dtype."""
    return empty(array.shape, array.dtype)


def pool() -> ResultPool:
    """The process's pool (for shutdown and tests)."""
    return _POOL
