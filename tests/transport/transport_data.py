"""The transport suite's one data generator, numpy reference and option variants (a helper module, not a test).

Every rank builds every rank's input from ``(key, rank, n, dtype)``, so each can compute the whole job's expected
result with numpy.  Values are chosen so that every reduction is exact in any order (the transports reduce in
different orders: rings, trees, MPI's own): floats are quarter steps in [-8, 8] (products: powers of two), ints of
one or two bytes take their full range (sums and products wrap, which is order-free modular arithmetic), wider ints
stay small.  Non-integer floats (``kind="normal"``) are for the one case that checks rounding.

A :class:`Variant` is one set of transport options with the sizes that cross its algorithm switch points; each job
of the suite runs every case on every variant of its transport.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # subprocess and mpirun ranks get it by value

# What every transport moves and reduces (bfloat16 is not among them: the engine converts it before calling).
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool")
OPS = ("sum", "min", "max", "product")
# Collectives that only move data see a dtype as its item size: one of each size, and bool.
MOVE_DTYPES = ("uint8", "float16", "float32", "int64", "bool")
_BLOCK = 4099   # a random block of prime length, tiled: cheap for large n, never aligned with a chunk boundary


_cache: Dict[Tuple, np.ndarray] = {}   # a plain dict, not functools.lru_cache: cloudpickle ships a dict by value
_CACHE_BYTES = 128 << 20


def _make(key: Tuple, rank: int, n: int, dtype: str, kind: str) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(repr(key).encode()), rank, n])
    k = min(n, _BLOCK)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        base = rng.random(k) < 0.5
    elif kind == "normal":
        base = rng.standard_normal(k).astype(dt)
    elif dt.kind == "f":
        values = (rng.choice(np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]), k) if kind == "product"
                  else rng.integers(-32, 33, k) * 0.25)
        base = values.astype(dt)
    elif dt.itemsize <= 2:
        info = np.iinfo(dt)
        base = rng.integers(info.min, info.max, k, endpoint=True).astype(dt)
    else:
        base = (rng.integers(-3, 4, k) if kind == "product" else rng.integers(-1000, 1001, k)).astype(dt)
    out = np.resize(base, n)
    out.setflags(write=False)
    return out


def data(key: Tuple, rank: int, n: int, dtype: str, op: str = "sum", kind: Optional[str] = None) -> np.ndarray:
    """Rank ``rank``'s read-only input for case ``key`` (``.copy()`` it for in-place collectives)."""
    args = (tuple(key), int(rank), int(n), str(dtype), kind or ("product" if op == "product" else "plain"))
    out = _cache.get(args)
    if out is None:
        if sum(a.nbytes for a in _cache.values()) > _CACHE_BYTES:
            _cache.clear()
        out = _cache[args] = _make(*args)
    return out


def fold(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """numpy reference: ``a0 op a1 op ...`` in rank order (bool: sum/max are OR, min/product are AND)."""
    if arrays[0].dtype == np.bool_:
        f = np.logical_or if op in ("sum", "max") else np.logical_and
    else:
        f = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    out = np.array(arrays[0], copy=True)
    with np.errstate(over="ignore"):   # wrap-around is the defined result
        for a in arrays[1:]:
            f(out, a, out=out)
    return out


def digest(a: np.ndarray) -> str:
    """A short fingerprint of ``a``'s bytes (results that must agree bit for bit across ranks)."""
    return f"{a.dtype}:{a.size}:" + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:20]


def even_split(n: int, parts: int) -> List[int]:
    return [n // parts + (q < n % parts) for q in range(parts)]


def ragged_counts(n: int, size: int) -> List[List[int]]:
    """Per-rank counts of a gather or reduce-scatter: growing, all on the last rank, uneven with the first empty."""
    patterns = [[(n * (q + 1)) // size for q in range(size)], [n if q == size - 1 else 0 for q in range(size)],
                [(n * (q % 3)) // 2 for q in range(size)]]
    unique: List[List[int]] = []
    for p in patterns:
        if p not in unique:
            unique.append(p)
    return unique


def a2a_counts(n: int, size: int) -> List[List[int]]:
    """``c[r][p]``: elements rank r sends to rank p (zeros, uneven and full blocks)."""
    return [[(n * ((r + 2 * p + 1) % (size + 1))) // max(1, size) for p in range(size)] for r in range(size)]


# -- option variants ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of opening a transport, with the sizes that matter for it.

    Attributes:
        label: written in front of every check of this variant.
        options: :class:`~horovod.transport.base.TransportOptions` names and values.
        sizes: element counts every dtype runs (zero, odd, around the switch points).
        big_bytes: one more size per dtype, ``big_bytes // itemsize + 13`` elements (0: none).
        dtypes, ops: what the per-dtype and per-op cases run on this variant.
        hosts: hierarchical only: the host name of each rank, from the world size (fake hosts on one machine);
            None where the layout would repeat another variant's at this size.
        may_refuse: the transport may refuse these options with TransportError (mpi's native float16).
        cases: the cases these options change (None: all); the others already ran on the first variant.
    """

    label: str
    options: Dict
    sizes: Tuple[int, ...]
    big_bytes: int = 0
    dtypes: Tuple[str, ...] = DTYPES
    ops: Tuple[str, ...] = OPS
    hosts: Optional[Callable[[int], Optional[List[str]]]] = None
    may_refuse: bool = False
    cases: Optional[Tuple[str, ...]] = None

    def sizes_of(self, dtype: str) -> List[int]:
        big = [self.big_bytes // np.dtype(dtype).itemsize + 13] if self.big_bytes else []
        return list(self.sizes) + big

    def ops_at(self, n: int) -> Tuple[str, ...]:
        """Every op at the largest of ``sizes`` (past the switch points of the tiny variants), sum elsewhere: an
        op changes the reduction's ufunc (and mpi's plan), not the path the bytes take."""
        return self.ops if self.sizes and n == max(self.sizes) else ("sum",)


def _halves(size: int) -> List[str]:
    first = (size + 1) // 2   # 2 + 2, 2 + 1 (uneven: the hosts' leaders reduce), 1 + 1 (flat)
    return ["host-a"] * first + ["host-b"] * (size - first)


def _interleaved(size: int) -> List[str]:
    return ["host-a" if r % 2 == 0 else "host-b" for r in range(size)]   # hosts do not hold rank ranges


def _first_alone(size: int) -> Optional[List[str]]:
    # 1 + 2, 1 + 3: host b's leader is rank 1 (below three ranks, the same layout as _halves: skipped)
    return ["host-a"] + ["host-b"] * (size - 1) if size > 2 else None


def _one_host(size: int) -> List[str]:
    return ["host-a"] * size


# Tiny thresholds make small buffers take every path: tcp's rings with many uneven pipeline segments, shm's 4 KiB
# halves crossed by every size, the two-step shm allreduce from 256 bytes.
TCP_TINY = {"small_message_bytes": 4096, "tcp_chunk_bytes": 16384}
SHM_TINY = {"shm_segment_bytes": 8192, "shm_chunk_bytes": 4096, "shm_small_bytes": 256}
SMALL_SIZES = (0, 1, 3001)   # one element is fewer than the ranks (tcp's small path even with rings)
REDUCTIONS = ("allreduce", "allreduce_finish", "allreduce_rounding", "float16_overflow", "reducescatter")
# Large buffers at the default options: every collective, but not the random program (its sizes stay below the
# default thresholds) nor the thread (its calls are the same ones again).
DEFAULTS = REDUCTIONS + ("allgatherv", "broadcast", "alltoallv", "sendrecv")
HIERARCHICAL = ("allreduce", "allreduce_finish", "allreduce_rounding", "float16_overflow", "allgatherv",
                "random_program")   # what it does not hand to its flat tcp mesh

VARIANTS: Dict[str, List[Variant]] = {
    "tcp": [
        Variant("tcp-tiny", TCP_TINY, SMALL_SIZES, big_bytes=160_000),
        # defaults: 256 KiB switches to rings, 1 MiB segments; 4 MB crosses both
        Variant("tcp-default", {}, (65_539,), big_bytes=(4 << 20) + 12, dtypes=("float32", "int64"),
                ops=("sum", "max"), cases=DEFAULTS),
    ],
    "shm": [
        # a /dev/shm file (unlinked once open) behind the segments, instead of the default memfd
        Variant("shm-tiny", {**SHM_TINY, "shm_backing": "file"}, SMALL_SIZES, big_bytes=20_000),
        # defaults: one step up to 1 MiB x ranks, 1 MiB chunks, 2 MiB halves; 2.5 MB crosses them
        Variant("shm-default", {}, (65_539,), big_bytes=5 << 19, dtypes=("float32", "float16", "bool"),
                ops=("sum", "max"), cases=DEFAULTS),
        # single-copy reads from 2 KiB: allgathers past it, alltoalls whose pieces are read or staged (or both in
        # one call: the ragged counts), through tiny halves
        Variant("shm-single-copy", {**SHM_TINY, "shm_single_copy_bytes": 2048}, SMALL_SIZES, big_bytes=40_000,
                dtypes=("float32", "uint8"), cases=("allgatherv", "alltoallv", "random_program")),
    ],
    "mpi": [
        # Open MPI's own algorithms, then 8 MiB of float32 for its large-message protocol
        Variant("mpi", {}, SMALL_SIZES + (65_539,)),
        Variant("mpi-8MiB", {}, (), big_bytes=(8 << 20) - 52, dtypes=("float32",), ops=("sum",),
                cases=("allreduce", "broadcast")),
        Variant("mpi-f16-upcast", {"mpi_float16": "upcast"}, SMALL_SIZES + (65_539,), dtypes=("float16",),
                cases=REDUCTIONS),
        Variant("mpi-f16-native", {"mpi_float16": "native"}, SMALL_SIZES + (65_539,), dtypes=("float16",),
                may_refuse=True, cases=REDUCTIONS),
    ],
    "hierarchical": [
        Variant("hier-halves-tiny", {**TCP_TINY, **SHM_TINY, "hierarchical_allgather": True}, SMALL_SIZES,
                big_bytes=300_000, hosts=_halves),
        Variant("hier-interleaved", {"hierarchical_allgather": True}, (0, 1, 3, 1000), big_bytes=1_200_000,
                dtypes=("float32", "int64", "uint8", "bool"), hosts=_interleaved, cases=HIERARCHICAL),
        Variant("hier-first-alone", {**TCP_TINY, **SHM_TINY, "hierarchical_allgather": True}, (0, 1, 3, 1000),
                big_bytes=40_000, dtypes=("float32", "int16", "bool"), hosts=_first_alone, cases=HIERARCHICAL),
        Variant("hier-switched-off", {**TCP_TINY, "hierarchical_allreduce": False}, (0, 7, 3001),
                dtypes=("float64", "int32"), hosts=_halves, cases=HIERARCHICAL),
        Variant("hier-one-host", SHM_TINY, (0, 7, 3001), dtypes=("float32", "uint16"), hosts=_one_host,
                cases=HIERARCHICAL),
    ],
}
