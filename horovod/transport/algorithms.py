"""Pure schedules for the collective algorithms: who talks to whom, in which order, over which slice.

Nothing here touches a socket or a buffer, so every function can be checked on its own for any group size.
Ranks are group ranks ``0 .. size-1``; slices are ``(offset, length)`` pairs in elements.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Slice = Tuple[int, int]


def partition(count: int, parts: int) -> List[int]:
    """Split ``count`` elements into ``parts`` blocks whose sizes differ by at most one (larger blocks first)."""
    base, extra = divmod(count, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets(counts: Sequence[int]) -> List[int]:
    """Exclusive prefix sums: where each block starts."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out


def segments(offset: int, length: int, seg: int) -> List[Slice]:
    """Cut ``[offset, offset + length)`` into pieces of at most ``seg`` elements (none for an empty block).

    The cut depends only on the block, so a block received in one ring step and forwarded in the next is
    segmented identically on both sides; the pipeline's dependencies rely on that.
    """
    return [(offset + start, min(seg, length - start)) for start in range(0, length, seg)]


def segment_elements(block_bytes: int, itemsize: int, chunk_bytes: int, min_bytes: int = 64 * 1024,
                     depth: int = 4) -> int:
    """Pipeline segment size in elements: about ``block / depth``, clamped to ``[min_bytes, chunk_bytes]``.

    Small enough that receiving one segment overlaps reducing the previous one, large enough that the
    per-segment Python overhead stays negligible.
    """
    target = min(chunk_bytes, max(min_bytes, block_bytes // depth))
    return max(1, target // max(1, itemsize))


def ring_neighbours(rank: int, size: int) -> Tuple[int, int]:
    """``(left, right)``: data flows from left to this rank to right."""
    return (rank - 1) % size, (rank + 1) % size


class Fold:
    """Recursive doubling on a non-power-of-two group: fold the extra ranks into partners first.

    With ``p`` the largest power of two not above ``size`` and ``extra = size - p``, ranks ``0 .. 2*extra-1``
    pair up: each even rank hands its data to the odd rank above it and waits for the result, and the odd
    rank takes part in the power-of-two exchange as ``rank // 2``.  Ranks above ``2 * extra`` take part as
    ``rank - extra``.

    Attributes:
        pow2: the power of two that exchanges.
        role: ``"extra"`` (sits out), ``"proxy"`` (stands in for an extra rank) or ``"core"``.
        partner: the extra's proxy or the proxy's extra, else ``None``.
        vrank: this rank's index among the ``pow2`` exchanging ranks (``None`` for an extra rank).
    """

    def __init__(self, rank: int, size: int):
        pow2 = 1
        while pow2 * 2 <= size:
            pow2 *= 2
        self.pow2, self._extra = pow2, size - pow2
        self.partner: Optional[int] = None
        self.vrank: Optional[int]
        if rank < 2 * self._extra:
            if rank % 2 == 0:
                self.role, self.partner, self.vrank = "extra", rank + 1, None
            else:
                self.role, self.partner, self.vrank = "proxy", rank - 1, rank // 2
        else:
            self.role, self.vrank = "core", rank - self._extra

    def real(self, vrank: int) -> int:
        """The group rank standing as ``vrank`` in the power-of-two exchange."""
        return 2 * vrank + 1 if vrank < self._extra else vrank + self._extra

    def partners(self) -> List[int]:
        """Group ranks this rank exchanges with, round by round (empty for an extra rank)."""
        if self.vrank is None:
            return []
        out, mask = [], 1
        while mask < self.pow2:
            out.append(self.real(self.vrank ^ mask))
            mask <<= 1
        return out


def binomial_tree(rank: int, size: int, root: int) -> Tuple[Optional[int], List[int]]:
    """``(parent, children)`` of ``rank`` in a binomial tree rooted at ``root``.

    Children are listed largest subtree first, the order in which they should be sent to.
    """
    v = (rank - root) % size
    parent = None
    mask = 1
    while mask < size:
        if v & mask:
            parent = ((v - mask) + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask >>= 1
    return parent, children


def chain(rank: int, size: int, root: int) -> Tuple[Optional[int], Optional[int]]:
    """``(previous, next)`` in the pipelined broadcast chain ``root, root+1, ...`` (``None`` at the ends)."""
    v = (rank - root) % size
    prev = None if v == 0 else (rank - 1) % size
    nxt = None if v == size - 1 else (rank + 1) % size
    return prev, nxt


def dissemination(rank: int, size: int) -> List[Tuple[int, int]]:
    """``(send_to, receive_from)`` per round of a dissemination barrier (``ceil(log2 size)`` rounds)."""
    rounds, dist = [], 1
    while dist < size:
        rounds.append(((rank + dist) % size, (rank - dist) % size))
        dist *= 2
    return rounds


def pairwise(rank: int, size: int) -> List[Tuple[int, int]]:
    """``(send_to, receive_from)`` per step of a pairwise exchange (alltoall), ``size - 1`` steps."""
    return [((rank + k) % size, (rank - k) % size) for k in range(1, size)]
