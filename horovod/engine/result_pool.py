"""Result arrays for out-of-place collectives, recycled from memory that is already faulted in.

A fresh 64 MiB result costs more than the collective that fills it: the kernel maps and zeroes every page on first
touch (about as long as the allreduce itself on this kind of machine, measured in benchmarks/collectives.py's
``allreduce-new`` rows), and frees them again when the caller drops the result. Training loops return results
of the same sizes step after step, so a result's memory is worth keeping once the caller is done with it.

How a block comes back: a result array's ``base`` is a :class:`_Lease` (numpy keeps the object that exposes
``__array_interface__`` as the base), and every view, torch tensor (``torch.from_numpy``) or slice of the result
keeps that base alive. When the last of them is gone, CPython drops the lease at once and its ``__del__`` returns
the block to the pool. Only results of at least :data:`MIN_BYTES` are pooled (smaller ones are cheap to allocate).

What the pool may hold is bounded three ways, because a job with occasional large tensors of ever-changing sizes
would otherwise fill it with blocks nobody asks for again (RSS grew by the whole cap and stayed there until
``shutdown()``):

* a request takes the smallest free block that holds it without wasting more than a third
  (:data:`MAX_SLACK`), so results of similar sizes share blocks instead of each keeping its own;
* at most :data:`MAX_POOLED_BYTES` of free blocks (least recently freed dropped first);
* a block nobody took for :data:`MAX_IDLE_S` seconds is dropped (looked for at most every :data:`SWEEP_S` as the
  pool is used).
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

#: Results below this size come straight from numpy. 128 KiB is glibc's default mmap threshold: from there a fresh
#: allocation may be a new mapping, or heap that glibc returned to the kernel when a step dropped its results, and
#: every page faults in again (in a VM, a few µs each). Measured in-job at np = 2 (docs/decisions/0010-result-pool.md):
#: a step of 8 asynchronous allreduces whose results it holds took 0.50–0.72× the time at 128 KiB and 0.43–0.53×
#: at 256–512 KiB with the pool; results dropped at once, back to back, cost up to ~10 % more (the pool's ~4 µs).
MIN_BYTES = 128 << 10
#: Free blocks kept for reuse, in bytes, at most (the memory a job may hold beyond its live results).
MAX_POOLED_BYTES = 96 << 20
#: A request may take a free block up to this fraction larger than itself.
MAX_SLACK = 1 / 3
#: Seconds a free block may wait for a taker before it is dropped.
MAX_IDLE_S = 10.0
#: Seconds between two looks for idle blocks (so a block may stay up to MAX_IDLE_S + SWEEP_S).
SWEEP_S = 1.0


class _Lease:
    """Holds one pooled block for as long as a result (or any view of it) is alive."""

    __slots__ = ("block", "__array_interface__", "__weakref__")
    block: Optional[np.ndarray]
    __array_interface__: dict

    def __del__(self) -> None:
        block = self.block
        self.block = None
        if block is not None and _POOL is not None:  # None: the interpreter is tearing the module down
            _POOL.release(block)


def _lease(block: np.ndarray, shape: Tuple[int, ...], dtype: np.dtype) -> _Lease:
    """A lease of ``block`` whose array interface is ``shape`` of ``dtype`` (the interface dict is cached: a training
    loop asks for the same shapes of the same blocks step after step, and building it is most of a lease's cost)."""
    faces = _FACES.get(id(block))
    if faces is None:
        if len(_FACES) >= _FACES_MAX:
            _FACES.clear()
        faces = _FACES[id(block)] = {}
    face = faces.get((shape, dtype))
    if face is None:   # (``block.ctypes`` and ``dtype.descr`` run Python code inside numpy: neither is on this path)
        if len(faces) >= _FACES_MAX:   # a block serves results of many shapes (sizes within MAX_SLACK of it)
            faces.clear()
        face = faces[(shape, dtype)] = {"shape": shape, "typestr": dtype.str, "strides": None, "version": 3,
                                        "data": block.__array_interface__["data"],
                                        **({"descr": dtype.descr} if dtype.names else {})}
    lease = _Lease()
    lease.block = block
    lease.__array_interface__ = face
    return lease


#: id of a block -> (shape, dtype) -> the array interface of that view of it. Keyed by id, so an entry must go when
#: its block does (a new block may get the id): the pool drops a block's entry whenever it lets go of the block.
_FACES: Dict[int, Dict[Tuple[Tuple[int, ...], np.dtype], dict]] = {}
_FACES_MAX = 64   # blocks with cached interfaces, and interfaces cached per block


class ResultPool:
    """Free blocks of raw bytes; see the module docstring for what it keeps and for how long.

    Args:
        max_bytes: free bytes kept at most.
        max_idle_s: seconds a free block is kept without a taker.
        clock: monotonic clock (tests pass their own).

    Every result of the job passes through :meth:`take` and :meth:`release`, so both do as little as they can: a
    block of the exact size asked for (a training loop's case) is a dict lookup and a list pop.
    """

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES, max_idle_s: float = MAX_IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        # Re-entrant: a lease freed by the cyclic GC (which may run on any allocation, even one made while the
        # lock is held) returns its block from inside the same thread.
        self._lock = threading.RLock()
        self._free: Dict[int, List[np.ndarray]] = {}   # nbytes -> free blocks, most recently freed last
        self._sizes: List[int] = []                      # the keys of _free, sorted (for the best fit)
        # id -> (block, when freed), least recently freed first (a dict keeps insertion order)
        self._age: Dict[int, Tuple[np.ndarray, float]] = {}
        self._bytes = 0
        self.max_bytes = max_bytes
        self.max_idle_s = max_idle_s
        self._clock = clock
        self._next_sweep = 0.0   # when to look for idle blocks next (at most every SWEEP_S: a look costs a clock)

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` bytes (at most :data:`MAX_SLACK` more): recycled when the pool has
        one, else new."""
        with self._lock:
            now = self._clock()
            if now >= self._next_sweep:
                self._drop_idle(now)
            same = self._free.get(nbytes)
            if same:
                block = same.pop()
                del self._age[id(block)]
                self._bytes -= nbytes
                if not same:
                    del self._free[nbytes]
                    del self._sizes[bisect.bisect_left(self._sizes, nbytes)]
                return block
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= nbytes + int(nbytes * MAX_SLACK):
                block = self._free[self._sizes[i]][-1]
                self._forget(block)
                return block
        return np.empty(nbytes, dtype=np.uint8)  # numpy advises huge pages for large arrays

    def release(self, block: np.ndarray) -> None:
        """Give a block back; the oldest free blocks are dropped while the pool is over its cap."""
        size = block.nbytes
        if size > self.max_bytes:
            _FACES.pop(id(block), None)
            return
        with self._lock:
            same = self._free.get(size)
            if same is None:
                same = self._free[size] = []
                bisect.insort(self._sizes, size)
            same.append(block)
            now = self._clock()
            self._age[id(block)] = (block, now)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._age.values()))[0])
            if now >= self._next_sweep:
                self._drop_idle(now)

    def _drop_idle(self, now: float) -> None:
        """Drop the blocks nobody took for :attr:`max_idle_s` seconds (the caller holds the lock)."""
        self._next_sweep = now + SWEEP_S
        limit = now - self.max_idle_s
        while self._age:
            block, freed = next(iter(self._age.values()))
            if freed > limit:
                return
            self._drop(block)

    def _drop(self, block: np.ndarray) -> None:
        """Let go of a free block for good (the caller holds the lock)."""
        self._forget(block)
        _FACES.pop(id(block), None)

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
            _FACES.clear()


_POOL = ResultPool()


def empty(shape: Union[int, Sequence[int]], dtype) -> np.ndarray:
    """A new, writeable, C-contiguous result array (contents undefined); on every call's path: builtins only."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes < MIN_BYTES or dt.hasobject:
        return np.empty(dims, dtype=dt)
    return np.asarray(_lease(_POOL.take(nbytes), dims, dt))


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` with ``array``'s shape and dtype."""
    return empty(array.shape, array.dtype)


def pool() -> ResultPool:
    """The process's pool (for shutdown and tests)."""
    return _POOL
