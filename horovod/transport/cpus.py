"""The cores of this host a process may use, and each worker on its own share of them (HOROVOD_BIND_CORES).

Two ranks of a job wake each other for every collective. Left to itself, the Linux scheduler tends to put a woken
process on the waker's core when that looks cheaper, and two mostly-sleeping ranks can then share one core for
good while the other idles: on 2 cores, an 8-byte allreduce after 1 ms of compute went from ~45 µs to ~170 µs
once the ranks fell into that state, and stayed there. Binding each of a host's ``local_size`` ranks to a disjoint,
contiguous share of the cores the process may use (``cores // local_size`` each, as OMP_NUM_THREADS gets) keeps
them apart, as Open MPI's default binding does for small jobs. A host with more ranks than cores is left unbound:
there is no share to give.
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

logger = logging.getLogger(__name__)

_process_cpus: Optional[List[int]] = None   # the cores this process could use before its first binding


def process_cpus() -> List[int]:
    """The cores this process could run on before any binding of its own (what its host gives the job)."""
    global _process_cpus
    if _process_cpus is None:
        try:
            _process_cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            _process_cpus = list(range(os.cpu_count() or 1))
    return _process_cpus


def usable_cpus() -> int:
    """How many cores the job's processes on this host share (not this process's bound share)."""
    return len(process_cpus())


def share_of(cpus: Sequence[int], local_rank: int, local_size: int) -> Optional[List[int]]:
    """The cores of ``cpus`` for ``local_rank`` of ``local_size`` ranks, or None when there is nothing to bind
    (one rank, more ranks than cores, or a local rank outside the host)."""
    cpus = sorted(cpus)
    if local_size < 2 or local_size > len(cpus) or not 0 <= local_rank < local_size:
        return None
    per_rank = len(cpus) // local_size
    return cpus[local_rank * per_rank:(local_rank + 1) * per_rank]


def bind_process(local_rank: int, local_size: int) -> Optional[List[int]]:
    """Bind every thread of this process to its share of the cores; returns the share (None: left unbound).

    The share is taken from the cores the process could use before its first binding, so an elastic re-init
    with another local size binds afresh instead of splitting an earlier share.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    share = share_of(process_cpus(), local_rank, local_size)
    if share is None:
        return None
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, share)
        except OSError as exc:   # a thread that just exited, or a container that forbids it
            if tid in (0, os.getpid()):
                logger.warning("could not bind local rank %d to cores %s: %s", local_rank, share, exc)
                return None
    logger.debug("local rank %d of %d bound to cores %s", local_rank, local_size, share)
    return share
