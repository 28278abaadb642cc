"""Tensor names: how the coordinator matches one collective across ranks.

A named op is ``<prefix>.<name>``. An unnamed one is ``<prefix>.noname.<n>``, numbered in issue order within its
process set (ranks outside a set never see its ops, so one shared counter would drift). Outside the global set the
set's id is part of the name (``<prefix>.noname.<n>.set<id>``): two sets' counters run independently, so their
numbers meet, and the coordinator must not take two different sets' n-th unnamed ops for one collective
submitted on the wrong set. Grouped ops name their members ``<base>_<i>of<count>``.

A rank that has joined does not issue the ops the others still run, but takes part in them (it contributes zeros,
or receives their error); :func:`skip_unnamed` moves its counters past them, so that after the join its next
unnamed op gets the same number as everyone else's.
"""
from __future__ import annotations

import re
import threading
from typing import Dict, Iterable, List, Optional, Tuple

_lock = threading.Lock()
_next: Dict[int, int] = {}  # process set id -> number of its next unnamed op
#: The one name of ``join()`` (every rank joins the global set at most once at a time).
JOIN_NAME = "join.noname"
_UNNAMED = re.compile(r"\.noname\.(\d+)(?:\.set\d+)?(?:_\d+of\d+)?$")


def reset_names() -> None:
    """Restart automatic naming (every rank does it at ``init()``, so names keep matching)."""
    with _lock:
        _next.clear()


def tensor_name(prefix: str, name: Optional[str], process_set: int = 0) -> str:
    """``<prefix>.<name>``, or the next unnamed name of ``process_set`` (see the module docstring)."""
    if name is not None:
        return f"{prefix}.{name}"
    with _lock:
        n = _next.get(process_set, 0)
        _next[process_set] = n + 1
    return f"{prefix}.noname.{n}" if process_set == 0 else f"{prefix}.noname.{n}.set{process_set}"


def group_names(prefix: str, name: Optional[str], count: int, process_set: int = 0) -> Tuple[List[str], str]:
    """Member names ``<base>_<i>of<n>`` (1-based) and the group's key (its base name)."""
    base = tensor_name(prefix, name, process_set)
    return [f"{base}_{i}of{count}" for i in range(1, count + 1)], base


def skip_unnamed(names: Iterable[str], process_set: int) -> None:
    """Advance ``process_set``'s counter past the unnamed ops among ``names`` (ops the others ran while this
    rank had joined)."""
    numbers = [int(m.group(1)) for m in map(_UNNAMED.search, names) if m]
    if numbers:
        with _lock:
            _next[process_set] = max(_next.get(process_set, 0), max(numbers) + 1)
