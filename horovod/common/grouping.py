"""Framework-neutral gradient grouping: which gradients are reduced together as one atomic group.

Bindings pass the ``groups`` / ``num_groups`` arguments of their optimizers and gradient tapes here together
with one identity key per gradient (e.g. ``id`` of its variable); the result is a list of groups of indices,
the same on every rank because it depends only on the argument and the order of the gradients.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Union

from horovod.common.util import split_list

GroupsArg = Union[None, int, Sequence[Sequence[Any]]]


def check_groups(groups: GroupsArg, num_groups: int = 0) -> GroupsArg:
    """Validate ``groups`` / the deprecated ``num_groups`` and return the one to use.

    Raises:
        ValueError: a negative number of groups, or ``groups`` that is neither an int nor a list of lists.
    """
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool):
        raise ValueError(f"groups must be a non-negative int or a list of lists of variables, got {groups!r}.")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative number of groups, got {groups}.")
        return groups
    if isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups):
        return groups
    raise ValueError(f"groups must be a non-negative int or a list of lists of variables, got {groups!r}.")


def partition(count: int, groups: GroupsArg = None, keys: Optional[Sequence[Hashable]] = None,
              key_of: Optional[Callable[[Any], Hashable]] = None) -> List[List[int]]:
    """Split the indices ``0 .. count-1`` into groups.

    Args:
        count: number of gradients.
        groups: ``None``/``0`` — one group of everything (one fused, atomic reduction); an int ``n`` — ``n``
            contiguous groups of nearly equal length; a list of lists of variables — each inner list is one
            group (matched through ``key_of``), and the gradients of variables in no list form one more group.
        keys: one identity key per gradient (needed for a list of lists).
        key_of: maps a variable of ``groups`` to its key (default ``id``).

    Returns:
        Non-empty groups of indices, in order of first index.
    """
    if count == 0:
        return []
    if not groups:
        return [list(range(count))]
    if isinstance(groups, int):
        return [g for g in split_list(list(range(count)), min(groups, count)) if g]
    if keys is None:
        raise ValueError("partition with explicit variable groups needs one key per gradient.")
    key_of = key_of or id
    where: Dict[Any, int] = {}   # variable key -> its group
    for gi, members in enumerate(groups):
        for var in members:
            where.setdefault(key_of(var), gi)
    buckets: List[List[int]] = [[] for _ in groups]
    rest: List[int] = []
    for i, key in enumerate(keys):
        g = where.get(key)
        (buckets[g] if g is not None else rest).append(i)
    out = [b for b in buckets if b]
    if rest:
        out.append(rest)
    out.sort(key=lambda g: g[0])
    return out
