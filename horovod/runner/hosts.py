"""Host lists and rank layout: pure functions, no I/O except reading a hostfile.

``-H host1:2,host2:4`` and hostfile lines ``host1 slots=2`` both become a list of :class:`HostInfo`;
:func:`get_host_assignments` turns that list into one :class:`SlotInfo` per process, filling hosts in the
order given.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union


@dataclass(frozen=True)
class HostInfo:
    """One host and how many processes it may run."""

    hostname: str
    slots: int

    @classmethod
    def from_string(cls, text: str) -> "HostInfo":
        """Parse ``host`` or ``host:slots`` (a bare host has one slot).

        Raises:
            ValueError: the slot count is not a positive integer or the host name is empty.
        """
        text = text.strip()
        hostname, slots = text, "1"
        bare_ipv6 = text.count(":") > 1 and not text.startswith("[")
        if ":" in text and not bare_ipv6:
            # rsplit so a bracketed IPv6 literal ("[::1]:2") keeps its colons.
            hostname, slots = text.rsplit(":", 1)
        hostname = hostname.strip()
        if hostname.startswith("[") and hostname.endswith("]"):
            hostname = hostname[1:-1]
        if not hostname:
            raise ValueError(f"host entry {text!r} has no host name; expected 'host:slots', e.g. 'localhost:2'")
        try:
            count = int(slots)
        except ValueError:
            raise ValueError(f"host entry {text!r}: slots {slots!r} is not an integer; expected 'host:slots', "
                             f"e.g. 'localhost:2'") from None
        if count < 1:
            raise ValueError(f"host entry {text!r}: slots must be >= 1, got {count}")
        return cls(hostname, count)

    def __str__(self) -> str:
        return f"{self.hostname}:{self.slots}"


@dataclass(frozen=True)
class SlotInfo:
    """Where one process of the job sits.

    ``cross_rank`` is the index of this host among the hosts that run a process with the same
    ``local_rank``; ``cross_size`` is how many such hosts there are.
    """

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_response_string(self) -> str:
        """``"rank,size,local_rank,local_size,cross_rank,cross_size"`` (the original's wire form)."""
        return ",".join(str(v) for v in (self.rank, self.size, self.local_rank, self.local_size,
                                          self.cross_rank, self.cross_size))

    def env(self) -> dict:
        """The per-slot ``HOROVOD_*`` variables a worker reads."""
        return {
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def _unique(hosts: List[HostInfo]) -> List[HostInfo]:
    seen = set()
    for host in hosts:
        if host.hostname in seen:
            raise ValueError(f"host {host.hostname!r} is listed more than once; list each host once with its "
                             f"total slot count (e.g. '{host.hostname}:4')")
        seen.add(host.hostname)
    return hosts


def parse_hosts(text: str) -> List[HostInfo]:
    """Parse the ``-H`` value ``host1:2,host2:4``.

    Raises:
        ValueError: an entry is malformed, a host repeats, or the list is empty.
    """
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"-H/--hosts {text!r} lists no host; expected e.g. 'localhost:2,otherhost:4'")
    return _unique([HostInfo.from_string(e) for e in entries])


def parse_hostfile_lines(lines: Iterable[str], source: str = "hostfile") -> List[HostInfo]:
    """Parse hostfile lines ``host slots=N`` (``#`` starts a comment; a bare host has one slot).

    Raises:
        ValueError: a line is malformed (the message names ``source`` and the line number).
    """
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        slots = 1
        for extra in fields[1:]:
            key, sep, value = extra.partition("=")
            if sep and key == "slots":
                try:
                    slots = int(value)
                except ValueError:
                    raise ValueError(f"{source}:{number}: slots={value!r} is not an integer") from None
            elif sep and key in ("max_slots", "max-slots"):
                continue  # mpirun's hostfile syntax; the slot count is what matters here
            else:
                raise ValueError(f"{source}:{number}: cannot parse {raw.strip()!r}; expected '<host> slots=<n>'")
        if slots < 1:
            raise ValueError(f"{source}:{number}: slots must be >= 1, got {slots}")
        hosts.append(HostInfo(fields[0], slots))
    if not hosts:
        raise ValueError(f"{source} lists no host; expected lines like 'localhost slots=2'")
    return _unique(hosts)


def parse_hostfile(path: str) -> List[HostInfo]:
    """Read and parse a hostfile (see :func:`parse_hostfile_lines`)."""
    with open(path, encoding="utf-8") as handle:
        return parse_hostfile_lines(handle, source=path)


def total_slots(hosts: Sequence[HostInfo]) -> int:
    return sum(h.slots for h in hosts)


def get_host_assignments(hosts: Sequence[HostInfo], min_num_proc: int,
                         max_num_proc: Optional[int] = None) -> List[SlotInfo]:
    """Lay out ranks over ``hosts``, filling each host's slots before moving to the next.

    Unlike the original's static Gloo path (which passed no maximum and so started one process per slot:
    ``-np 2 -H localhost:4`` gave 4 workers), a missing ``max_num_proc`` means exactly ``min_num_proc``.

    Args:
        hosts: hosts in the order ranks are assigned.
        min_num_proc: processes the job needs.
        max_num_proc: use up to this many when slots allow (elastic); defaults to ``min_num_proc``.

    Returns:
        One :class:`SlotInfo` per process, ordered by rank.

    Raises:
        ValueError: fewer than ``min_num_proc`` slots, or a non-positive count.
    """
    if min_num_proc < 1:
        raise ValueError(f"the number of processes must be >= 1, got {min_num_proc}")
    wanted = min_num_proc if max_num_proc is None else max(min_num_proc, max_num_proc)
    available = total_slots(hosts)
    if available < min_num_proc:
        listing = ",".join(str(h) for h in hosts)
        raise ValueError(f"requested {min_num_proc} processes but the hosts provide only {available} slots "
                         f"({listing}); add slots (e.g. -H localhost:{min_num_proc}) or lower -np")
    per_host: List[tuple] = []   # (hostname, processes on it)
    remaining = min(wanted, available)
    for host in hosts:
        if remaining == 0:
            break
        take = min(host.slots, remaining)
        per_host.append((host.hostname, take))
        remaining -= take

    size = sum(n for _, n in per_host)
    # Hosts holding a given local rank, in host order: that index is the cross rank.
    max_local = max(n for _, n in per_host)
    cross_hosts = [[h for h, n in per_host if n > local] for local in range(max_local)]
    slots: List[SlotInfo] = []
    rank = 0
    for hostname, count in per_host:
        for local_rank in range(count):
            peers = cross_hosts[local_rank]
            slots.append(SlotInfo(hostname=hostname, rank=rank, local_rank=local_rank,
                                  cross_rank=peers.index(hostname), size=size, local_size=count,
                                  cross_size=len(peers)))
            rank += 1
    return slots


def local_hostnames() -> frozenset:
    """Names that mean "this machine" for the single-host launcher."""
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        name = socket.gethostname()
        names.update({name, name.split(".")[0]})
    except OSError:
        pass
    return frozenset(names)


def is_local_host(hostname: str) -> bool:
    """True for ``localhost``, ``127.0.0.1``, ``::1`` and this machine's host name."""
    return hostname in local_hostnames()


def resolve_hosts(args: Any) -> List[HostInfo]:
    """Hosts from ``-H`` or ``--hostfile``; ``localhost:<np>`` when neither is given."""
    if getattr(args, "hosts", None):
        return parse_hosts(args.hosts)
    if getattr(args, "hostfile", None):
        try:
            return parse_hostfile(args.hostfile)
        except OSError as exc:
            raise ValueError(f"cannot read --hostfile {args.hostfile!r}: {exc.strerror or exc}") from None
    return [HostInfo("localhost", args.num_proc)]


def parse_nics(value: Union[None, str, Sequence[str]]) -> List[str]:
    """Network interfaces from a list or a comma-separated string, in order, without blanks or repeats."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out: List[str] = []
    for item in items:
        item = str(item).strip()
        if item and item not in out:
            out.append(item)
    return out


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    parts: List[str] = []
    start = prev = None
    for r in sorted(ranks):
        if start is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def placement_text(slots: Sequence[SlotInfo]) -> str:
    """Where a job's processes run, for the launcher's first line: ``2 processes on localhost``, or per host
    ``4 processes on 2 hosts: hostA (ranks 0-1), hostB (ranks 2-3)``."""
    by_host: Dict[str, List[int]] = {}
    for slot in slots:
        by_host.setdefault(slot.hostname, []).append(slot.rank)
    count = f"{len(slots)} process{'es' if len(slots) != 1 else ''}"
    if len(by_host) == 1:
        return f"{count} on {next(iter(by_host))}"
    hosts = ", ".join(f"{host} (rank{'s' if len(r) > 1 else ''} {rank_ranges(r)})" for host, r in by_host.items())
    return f"{count} on {len(by_host)} hosts: {hosts}"
