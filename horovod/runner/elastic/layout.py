"""Who is in the next epoch of an elastic job, and with which ranks: pure functions, no I/O.

A worker is named by its slot, ``"<host>:<slot>"``.  The next epoch keeps the survivors of the current one first,
in their old rank order — so rank 0 is the oldest survivor and already holds the newest state — then adds
newcomers in host order (oldest host first) and slot order, up to ``max_np`` workers.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Optional, Sequence, Tuple

from horovod.runner.hosts import HostInfo

#: ``[rank, size, local_rank, local_size, cross_rank, cross_size, hostname]`` as published to the workers.
SlotLayout = Tuple[int, int, int, int, int, int, str]


def worker_id(host: str, slot: int) -> str:
    """The stable name of the worker on ``slot`` of ``host`` (also its ``HOROVOD_ELASTIC_WORKER_ID``)."""
    return f"{host}:{slot}"


def host_of(wid: str) -> str:
    """The host part of a worker id."""
    return wid.rsplit(":", 1)[0]


def slot_ids(hosts: Sequence[HostInfo]) -> List[str]:
    """Every slot of ``hosts`` as a worker id, host by host."""
    return [worker_id(h.hostname, s) for h in hosts for s in range(h.slots)]


def plan_members(current: Sequence[str], hosts: Sequence[HostInfo], alive: Collection[str],
                 max_np: Optional[int] = None) -> List[str]:
    """The workers of the next epoch, in rank order.

    Args:
        current: members of the current epoch in rank order (empty before the first epoch).
        hosts: usable hosts (discovered and not blacklisted), oldest first.
        alive: worker ids whose process is running and may stay.
        max_np: at most this many workers (``None``: every slot).
    """
    slots = slot_ids(hosts)
    usable = set(slots)
    survivors = [w for w in current if w in usable and w in alive]
    kept = set(survivors)
    order = survivors + [w for w in slots if w not in kept]
    return order if max_np is None else order[:max_np]


def assign_ranks(order: Sequence[str]) -> Dict[str, SlotLayout]:
    """Rank, local and cross layout of every worker of ``order`` (rank = position).

    ``local_rank`` counts the workers of the same host in rank order; ``cross_rank`` is the position of the
    host among the hosts that have a worker with that local rank (in order of their first rank).
    """
    size = len(order)
    hosts = [host_of(w) for w in order]
    local_rank: List[int] = []
    counts: Dict[str, int] = {}
    for host in hosts:
        local_rank.append(counts.get(host, 0))
        counts[host] = counts.get(host, 0) + 1
    cross: Dict[int, List[str]] = {}
    for host, lr in zip(hosts, local_rank):
        cross.setdefault(lr, []).append(host)
    out: Dict[str, SlotLayout] = {}
    for rank, (wid, host, lr) in enumerate(zip(order, hosts, local_rank)):
        peers = cross[lr]
        out[wid] = (rank, size, lr, counts[host], peers.index(host), len(peers), host)
    return out
