"""Hierarchical data plane: shared memory inside each host, TCP across hosts.

A large allreduce is split in three: a shared-memory reduce-scatter among the ranks of each host, a TCP allreduce
of each rank's share among the ranks that hold the same share on the other hosts, and a shared-memory allgather.
Only ``1 / local_size`` of the data crosses the network from each rank, and every host link carries traffic at
once.  When hosts run different numbers of ranks, the local leaders do the cross-host step for the whole host.

With ``HOROVOD_HIERARCHICAL_ALLGATHER=1`` an allgather is split the same way: a shared-memory allgather inside each
host, one TCP allgather of whole host blocks among the hosts' leaders, and a shared-memory broadcast of the result,
so each host's data crosses the network once instead of once per rank.  Other collectives, and process-set
subgroups, use the flat TCP mesh.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from horovod.transport.base import SUM, Bootstrap, Finish, Transport, check_gather, register
from horovod.transport.shm import create_shm
from horovod.transport.tcp import create_tcp

logger = logging.getLogger(__name__)


def host_groups(hostnames: Sequence[str]) -> List[List[int]]:
    """Global ranks grouped by host, hosts in order of their lowest rank (pure)."""
    groups: Dict[str, List[int]] = {}
    for rank, host in enumerate(hostnames):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def node_key(hostname: str) -> str:
    """Which ranks can share memory: the launcher's host name for this rank, and this kernel's boot id and network
    namespace (the shared-memory transport meets its local ranks on abstract Unix sockets, which are per network
    namespace).  The host name alone is not enough: under mpirun no launcher sets ``HOROVOD_HOSTNAME``, so every rank
    said ``localhost`` and ranks on different hosts formed one shared-memory group that could never connect."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{hostname}|{boot}|{net}"


def even_counts(n: int, parts: int) -> List[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class HierarchicalTransport(Transport):
    """Allreduce through shared memory + TCP; everything else through the TCP mesh.

    Args:
        flat: the TCP transport over every rank.
        local: the shared-memory transport over this host's ranks.
        groups: global ranks per host.
        hierarchical_allreduce: False to use the flat TCP allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE=0``).
        hierarchical_allgather: True to gather inside each host first (``HOROVOD_HIERARCHICAL_ALLGATHER=1``).
    """

    name = "hierarchical"

    def __init__(self, flat: Transport, local: Transport, groups: List[List[int]], hierarchical_allreduce: bool,
                 hierarchical_allgather: bool = False):
        self.flat, self.local = flat, local
        self.rank, self.size = flat.rank, flat.size
        self.groups = groups
        self.enabled = hierarchical_allreduce
        self.allgather_enabled = hierarchical_allgather
        self.host_major = [r for g in groups for r in g] == list(range(self.size))  # hosts hold rank ranges
        self.homogeneous = len({len(g) for g in groups}) == 1
        self.group_index = next(i for i, g in enumerate(groups) if self.rank in g)
        self.local_index = groups[self.group_index].index(self.rank)
        # Ranks holding the same share on every host (homogeneous), and one leader per host (otherwise).
        self.cross = flat.subgroup([g[self.local_index] for g in groups]) if self.homogeneous else None
        self.leaders = flat.subgroup([g[0] for g in groups]) if self.local_index == 0 else None
        self._scratch = np.empty(0, dtype=np.uint8)

    def _share(self, count: int, dtype: np.dtype) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        self.allreduce_into(buf, buf, op)

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: str = SUM,
                       finish: Optional[Finish] = None) -> None:
        # Every decision below depends only on values all ranks share, so all ranks take the same path.
        if len(self.groups) == 1:
            self.local.allreduce_into(src, dst, op, finish)
        elif not self.enabled or all(len(g) == 1 for g in self.groups):
            self.flat.allreduce_into(src, dst, op, finish)
        elif self.cross is not None and src.size >= self.local.size:   # cross: only on a homogeneous job
            counts = even_counts(src.size, self.local.size)
            share = self._share(counts[self.local_index], src.dtype)
            self.local.reducescatter(src, share, counts, op)
            # Each rank finishes its share (a fraction of the result, in cache) before the hosts share them out.
            self.cross.allreduce_into(share, share, op, finish)
            self.local.allgatherv(share, dst, counts)
        else:
            if src is not dst:
                np.copyto(dst, src)
            self.local.allreduce(dst, op)
            if self.leaders is not None:   # the host's leader (local index 0)
                self.leaders.allreduce(dst, op)
            self.local.broadcast(dst, 0)
            if finish is not None:
                finish(dst)

    def allgatherv(self, send, recv, counts):
        if not self.allgather_enabled or len(self.groups) == 1 or all(len(g) == 1 for g in self.groups):
            self.flat.allgatherv(send, recv, counts)
            return
        counts = list(counts)
        total = sum(counts)
        check_gather(send, recv, total, counts[self.rank], self.rank)
        # Gathered host by host; when hosts do not hold contiguous rank ranges, reordered by rank at the end.
        gathered = recv[:total] if self.host_major else self._share(total, recv.dtype)
        host_totals = [sum(counts[r] for r in g) for g in self.groups]
        start = sum(host_totals[:self.group_index])
        host_block = gathered[start:start + host_totals[self.group_index]]
        self.local.allgatherv(send, host_block, [counts[r] for r in self.groups[self.group_index]])
        if self.local_index == 0:
            self.leaders.allgatherv(host_block.copy(), gathered, host_totals)
        self.local.broadcast(gathered, 0)
        if not self.host_major:
            rank_offsets = np.concatenate([[0], np.cumsum(counts)])
            position = 0
            for r in (r for g in self.groups for r in g):
                recv[rank_offsets[r]:rank_offsets[r] + counts[r]] = gathered[position:position + counts[r]]
                position += counts[r]

    def broadcast(self, buf, root):
        self.flat.broadcast(buf, root)

    def alltoallv(self, send, send_counts, recv, recv_counts):
        self.flat.alltoallv(send, send_counts, recv, recv_counts)

    def reducescatter(self, send, recv, counts, op=SUM):
        self.flat.reducescatter(send, recv, counts, op)

    def sendrecv(self, send, dest, recv, source):
        self.flat.sendrecv(send, dest, recv, source)

    def barrier(self):
        self.flat.barrier()

    def last_heard(self, rank: int) -> float:
        group = self.groups[self.group_index]
        local = self.local.last_heard(group.index(rank)) if rank in group else 0.0
        return max(self.flat.last_heard(rank), local)

    def subgroup(self, ranks):
        if list(ranks) == list(range(self.size)):
            return self
        return self.flat.subgroup(ranks)

    def close(self):
        try:
            self.local.close()
        finally:
            self.flat.close()


@register("hierarchical")
def create_hierarchical(boot: Bootstrap) -> Transport:
    """Connect the TCP mesh, find which ranks share this host, and connect them through shared memory."""
    flat = create_tcp(Bootstrap(boot.rank, boot.size, local_rank=boot.local_rank, local_size=boot.local_size,
                                cross_rank=boot.cross_rank, cross_size=boot.cross_size, hostname=boot.hostname,
                                store=boot.store, secret=boot.secret, bind_addr=boot.bind_addr, timeout=boot.timeout,
                                scope=boot.scope + "-tcp", options=boot.options))
    try:
        boot.store.put(boot.scope + "-hosts", str(boot.rank), node_key(boot.hostname).encode())
        hostnames = [boot.store.get(boot.scope + "-hosts", str(r), timeout=boot.timeout).decode()
                     for r in range(boot.size)]
        groups = host_groups(hostnames)
        mine = next(g for g in groups if boot.rank in g)
        index = mine.index(boot.rank)
        local = create_shm(Bootstrap(index, len(mine), local_rank=index, local_size=len(mine),
                                     hostname=boot.hostname, store=boot.store, secret=boot.secret,
                                     bind_addr=boot.bind_addr, timeout=boot.timeout,
                                     scope=f"{boot.scope}-shm-{mine[0]}", options=boot.options))
    except BaseException:
        flat.close()
        raise
    return HierarchicalTransport(flat, local, groups, boot.options.hierarchical_allreduce,
                                 boot.options.hierarchical_allgather)
