"""The coordinator's check that every rank passed a grouped collective the same number of tensors.

A grouped call names its members ``<base>_<i>of<n>`` (:func:`horovod.engine.naming.group_names`), so ranks that
passed different counts submit names that never meet, and without this check every rank waits for the others
until the stall inspector speaks. Two first members ``<base>_1of<n>`` with different ``n`` pending in one process
set at once can only mean that: a rank submits a group name again only after its previous call of that name
completed, which took the name off the pending table. Every rank that passed a group of that name is then failed
with the same mismatch error on each of its members, including members and ranks that arrive later.
"""
from __future__ import annotations

from typing import Any, Dict, List, MutableMapping, Set, Tuple

from horovod.engine.messages import ERROR, Request, Response


def _group_of(req: Request) -> Tuple[str, int]:
    """``(base name, count)`` of a grouped request."""
    first, count = req.group or ("", 0)
    return first[: len(first) - len(f"_1of{count}")], count


def _ranks(ranks: Set[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def _message(base: str, counts: Dict[int, Set[int]], unheard: Set[int]) -> str:
    parts = [f"{_ranks(ranks)} passed {n} tensor{'s' if n != 1 else ''}"
             for n, ranks in sorted(counts.items(), key=lambda c: min(c[1]))]
    what = ", but ".join(parts) if len(parts) == 2 else "; ".join(parts)
    later = f" ({_ranks(unheard)} had not called it yet)" if unheard else ""
    return (f"Mismatched {base.partition('.')[0]} group sizes (group '{base}'): {what}{later}. Every rank must "
            f"pass the same number of tensors to a grouped call; check how each rank builds its list.")


class GroupSizes:
    """Finds grouped calls whose ranks disagree on the count, and fails them (see the module docstring)."""

    def __init__(self) -> None:
        self._failed: Dict[Tuple[int, str], Tuple[str, Set[int]]] = {}   # (set, base) -> (error, ranks still owing)

    def reject(self, pset: Any, req: Request) -> List[Response]:
        """The ERROR responses that fail ``req`` (a grouped request, not yet recorded) and the rest of its group on
        every rank, when the ranks' counts differ; empty when they do not.

        Args:
            pset: the coordinator's process set (``id``, ``active`` ranks and ``pending`` collectives by name, each
                with the ``requests`` of the ranks that sent it); the failed group's members leave ``pending``.
        """
        base, count = _group_of(req)
        pending: MutableMapping[str, Any] = pset.pending
        key = (pset.id, base)
        out: List[Response] = []
        failed = self._failed.get(key)
        if failed is None or req.rank not in failed[1]:   # not a member of a group already failed: a new call
            prefix = f"{base}_1of"
            if req.name != f"{prefix}{count}" or len(pending) == 0:
                return out   # only a first member can reveal the mismatch, and only beside another
            counts: Dict[int, Set[int]] = {}
            for name, entry in pending.items():
                if name.startswith(prefix) and name[len(prefix):].isdigit():
                    counts.setdefault(int(name[len(prefix):]), set()).update(entry.requests)
            if not counts.keys() - {count}:
                return out
            counts.setdefault(count, set()).add(req.rank)
            error = _message(base, counts, pset.active.difference(*counts.values()))
            finished: Set[int] = set()   # ranks whose every member already arrived
            for n in counts:
                for i in range(1, n + 1):
                    entry = pending.pop(f"{base}_{i}of{n}", None)
                    if entry is not None:
                        out.append(Response(ERROR, [f"{base}_{i}of{n}"], pset.id, error=error))
                        if i == n:
                            finished.update(entry.requests)
            failed = self._failed[key] = (error, (pset.active - finished) | (failed[1] if failed else set()))
        error, owing = failed
        out.append(Response(ERROR, [req.name], pset.id, error=error))
        if req.name == f"{base}_{count}of{count}":   # a rank sends its members in order: this was its last
            owing.discard(req.rank)
            if not owing:
                del self._failed[key]
        return out
