"""Which address of this machine the workers on other hosts can reach: interface discovery and a reachability probe.

A job that spans hosts needs the launcher's rendezvous store on an address every host can connect to (never
``0.0.0.0``: the store must not listen on interfaces the job does not use).  :func:`candidate_addresses` lists
this machine's IPv4 addresses, the ones the routing table uses towards the job's hosts first, or only those of
``--network-interfaces``.  :class:`AddressProbe` listens briefly on each candidate; the ssh check
(:mod:`horovod.runner.ssh`) then asks every host which of them it can connect to, and
:func:`choose_address` takes the first one all hosts reached.

Only primary IPv4 addresses are discovered (one per interface, as ``SIOCGIFADDR`` reports them); on systems
without that ioctl the addresses the host name resolves to are used instead.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915   # Linux: the primary IPv4 address of an interface


@dataclass(frozen=True)
class Candidate:
    """An address of this machine the rendezvous store could bind to.

    Attributes:
        iface: the interface it belongs to ("" when unknown).
        addr: the IPv4 address.
    """

    iface: str
    addr: str

    def __str__(self) -> str:
        return f"{self.addr} ({self.iface})" if self.iface else self.addr


def interface_addresses() -> Dict[str, str]:
    """``{interface name: primary IPv4 address}`` of this machine, loopback included; empty when unknown."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return {}
    found: Dict[str, str] = {}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue   # down, or no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    finally:
        probe.close()
    return found


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.")


def resolve_ipv4(host: str) -> List[str]:
    """The IPv4 addresses ``host`` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: List[str] = []
    for info in infos:
        addr = str(info[4][0])   # (an AF_INET sockaddr: (host, port))
        if addr not in out:
            out.append(addr)
    return out


def routed_address(host: str) -> Optional[str]:
    """The address of this machine the routing table uses towards ``host`` (no packet is sent); None if none."""
    for target in resolve_ipv4(host):
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((target, 9))
            return probe.getsockname()[0]
        except OSError:
            continue
        finally:
            probe.close()
    return None


def _iface_of(addr: str, interfaces: Mapping[str, str]) -> str:
    for name, value in interfaces.items():
        if value == addr:
            return name
    return ""


def nic_candidates(nics: Sequence[str], interfaces: Optional[Mapping[str, str]] = None) -> List[Candidate]:
    """The addresses of the ``--network-interfaces`` that exist here (an entry may also be an IPv4 address).

    Raises:
        ValueError: none of them exists on this machine; the message lists the interfaces it has.
    """
    interfaces = interface_addresses() if interfaces is None else interfaces
    out: List[Candidate] = []
    for nic in nics:
        if nic in interfaces:
            cand = Candidate(nic, interfaces[nic])
        elif nic in interfaces.values():
            cand = Candidate(_iface_of(nic, interfaces), nic)
        else:
            continue
        if cand not in out:
            out.append(cand)
    if not out:
        have = ", ".join(f"{n} {a}" for n, a in interfaces.items()) or "none found"
        raise ValueError(f"none of --network-interfaces {','.join(nics)} is an interface (or address) of this "
                         f"machine, so the launcher cannot listen on it; this machine has: {have}")
    return out


def candidate_addresses(hosts: Sequence[str], nics: Sequence[str] = (),
                        interfaces: Optional[Mapping[str, str]] = None) -> List[Candidate]:
    """Addresses of this machine that workers on ``hosts`` might reach, most likely first.

    With ``nics`` only their addresses; otherwise the addresses routed towards the hosts (most hosts first),
    then every other non-loopback address.  Loopback is only offered when a host is reached through it.
    """
    interfaces = interface_addresses() if interfaces is None else interfaces
    if nics:
        return nic_candidates(nics, interfaces)
    votes: Dict[str, int] = {}
    for host in hosts:
        addr = routed_address(host)
        if addr:
            votes[addr] = votes.get(addr, 0) + 1
    ordered = sorted(votes, key=lambda a: -votes[a])
    out = [Candidate(_iface_of(a, interfaces), a) for a in ordered]
    for name, addr in interfaces.items():
        if not _is_loopback(addr) and addr not in votes:
            out.append(Candidate(name, addr))
    return out


class AddressProbe:
    """Listen on an ephemeral port of each candidate address so remote hosts can test they reach it.

    Connections are accepted and closed at once; nothing is read or sent.  Use as a context manager.
    """

    def __init__(self, candidates: Sequence[Candidate]):
        self.targets: Dict[str, Candidate] = {}   # "addr:port" → candidate
        self._socks: List[socket.socket] = []
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        for cand in candidates:
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind((cand.addr, 0))
                sock.listen(64)
                sock.setblocking(False)
            except OSError as exc:
                logger.info("cannot listen on %s for the reachability probe: %s", cand, exc)
                continue
            self._socks.append(sock)
            self._sel.register(sock, selectors.EVENT_READ)
            self.targets[f"{cand.addr}:{sock.getsockname()[1]}"] = cand
        self._thread = threading.Thread(target=self._serve, name="hvd-address-probe", daemon=True)

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj is self._wake_r:
                    return
                sock = key.fileobj
                assert isinstance(sock, socket.socket)   # only listening sockets are registered besides the wake
                try:
                    conn, _ = sock.accept()
                    conn.close()
                except OSError:
                    pass

    def __enter__(self) -> "AddressProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        for sock in self._socks + [self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self._sel.close()


def choose_address(candidates: Sequence[Candidate],
                   reached: Mapping[str, Sequence[str]]) -> Tuple[Optional[Candidate], Dict[str, List[str]]]:
    """The first candidate every host reached.

    Args:
        candidates: in order of preference.
        reached: host → candidate addresses it connected to.

    Returns:
        ``(candidate, {})``, or ``(None, {host: addresses it reached})`` when no address is common to all.
    """
    for cand in candidates:
        if all(cand.addr in addrs for addrs in reached.values()):
            return cand, {}
    return None, {host: list(addrs) for host, addrs in reached.items()}


__all__ = ["Candidate", "interface_addresses", "resolve_ipv4", "routed_address", "nic_candidates",
           "candidate_addresses", "AddressProbe", "choose_address"]
