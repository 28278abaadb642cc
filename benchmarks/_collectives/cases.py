"""What the collective sweep measures: the collectives, the implementations' names, and one case (buffers, the
validation pattern and numpy's answer) of one collective at one size on one rank."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

OPS = ("allreduce", "allreduce-avg", "allreduce-new", "allreduce-async", "allgather", "broadcast", "alltoall",
       "reducescatter")
# allreduce-new: the same reduction, but the result is a new array each call (``hvd.allreduce``, not ``allreduce_``);
# implementations without such a call (Gloo) sit it out.  allreduce-avg: the in-place reduction averaged, the op
# training uses (hvd: ``op=Average``; Gloo and Open MPI have no average on CPU: their users sum, then divide).
# allreduce-async: in place, started asynchronously and waited for at once (hvd: ``allreduce_async_`` then
# ``synchronize``; Gloo: ``async_op=True`` then ``wait()``; Open MPI: ``Iallreduce`` then ``Wait``).
REDUCTIONS = ("allreduce", "allreduce-avg", "allreduce-new", "allreduce-async")
# Latency patterns: what runs before each timed 8-byte call.
LATENCY_PATTERNS = ("back to back", "barrier before each", "1 ms compute before each")
F32 = np.float32
PERIOD = 113  # pattern period of the validation data: small integers, so every float32 sum is exact

# Display names, in table column order.
LABELS = {
    "engine-shm": "hvd engine shm", "engine-tcp": "hvd engine tcp", "engine-mpi": "hvd engine mpi",
    "torch-shm": "hvd.torch shm", "torch-tcp": "hvd.torch tcp",
    "raw-shm": "shm transport", "raw-tcp": "tcp transport", "raw-mpi": "mpi transport",
    "gloo": "torch Gloo", "openmpi": "Open MPI (mpi4py)",
}
ORDER = list(LABELS)


def register_impl(key: str, label: str) -> None:
    """Name one more implementation (``transports.py``: a transport with an option set), after the others."""
    if key not in LABELS:
        LABELS[key] = label
        ORDER.append(key)


class Case:
    """One collective at one size on this rank: its buffers, the validation pattern and numpy's answer."""

    def __init__(self, op: str, nbytes: int, rank: int, size: int):
        self.op, self.rank, self.size = op, rank, size
        if op in REDUCTIONS or op == "broadcast":
            count = max(1, nbytes // 4)
        else:  # every rank's block must be whole
            count = max(size, nbytes // 4 // size * size)
        self.count, self.per = count, count // size
        self.nbytes = count * 4
        self.splits = [self.per] * size
        self._expected: Optional[np.ndarray] = None
        if op in REDUCTIONS or op == "broadcast":
            self.buf = np.zeros(count, F32)
        elif op == "allgather":
            self.send, self.recv = np.zeros(self.per, F32), np.zeros(count, F32)
        elif op == "reducescatter":
            self.send, self.recv = np.zeros(count, F32), np.zeros(self.per, F32)
        elif op == "alltoall":
            self.send, self.recv = np.zeros(count, F32), np.zeros(count, F32)
        else:
            raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")

    def _base(self, n: int) -> np.ndarray:
        return np.resize(np.arange(PERIOD, dtype=F32), n)

    def load_pattern(self) -> None:
        """Inputs: the pattern plus this rank's number; outputs: a value no correct result contains."""
        r = F32(self.rank)
        if self.op in REDUCTIONS or self.op == "broadcast":
            np.add(self._base(self.count), r, out=self.buf)
        elif self.op == "allgather":
            np.add(self._base(self.per), r, out=self.send)
            self.recv.fill(-1)
        else:
            np.add(self._base(self.count), r, out=self.send)
            self.recv.fill(-1)

    def expected(self) -> np.ndarray:
        """numpy's answer for this rank (computed once: at 256 MiB it is not free)."""
        if self._expected is None:
            self._expected = self._compute_expected()
        return self._expected

    def _compute_expected(self) -> np.ndarray:
        n, per, r = self.size, self.per, self.rank
        offset = F32(n * (n - 1) // 2)
        if self.op == "allreduce-avg":
            return (self._base(self.count) * F32(n) + offset) / F32(n)
        if self.op in REDUCTIONS:
            return self._base(self.count) * F32(n) + offset
        if self.op == "broadcast":
            return self._base(self.count)  # root 0 adds 0
        if self.op == "allgather":
            return np.concatenate([self._base(per) + F32(p) for p in range(n)])
        if self.op == "reducescatter":
            return self._base(self.count)[r * per:(r + 1) * per] * F32(n) + offset
        block = self._base(self.count)[r * per:(r + 1) * per]
        return np.concatenate([block + F32(p) for p in range(n)])

    def check(self, out: Any) -> Optional[str]:
        """None when ``out`` equals numpy's answer, else what differs."""
        got = np.asarray(out).reshape(-1)
        want = self.expected()
        if got.shape != want.shape:
            return f"result has {got.size} elements, expected {want.size}"
        if np.array_equal(got, want):
            return None
        bad = int(np.flatnonzero(got != want)[0])
        return (f"rank {self.rank}: element {bad} is {float(got[bad])!r}, numpy says {float(want[bad])!r} "
                f"({int(np.count_nonzero(got != want))} of {want.size} differ)")

    def reset_for_timing(self) -> None:
        self._expected = None
        # Repeated in-place sums of zeros stay zeros: no overflow, no inf/NaN slow paths.
        if self.op in REDUCTIONS:
            self.buf.fill(0)


