"""Elastic jobs across machines: where the rendezvous store listens, and which discovered hosts can take workers.

A static job checks its hosts once, before anything starts (:func:`horovod.runner.ssh.prepare_remote_hosts`).
An elastic job learns of hosts while it runs, so:

* the store's address is chosen before the first worker starts, for the hosts known then *and* those to come:
  the address every initially discovered remote host reached (the same probe as a static job), else the one of
  ``--network-interfaces``, else, when discovery may add hosts later, this machine's primary non-loopback
  address.  Only a fixed list of this machine's names keeps it on loopback;
* every remote host is checked over ssh once when first discovered, and it must connect to the store's own
  ``address:port`` from there (:class:`RemoteHosts`, in a thread per host: discovery never waits on ssh).  A host
  that fails is left out with one warning and checked again after :data:`RECHECK_S` seconds (a spot instance may
  still be booting); one that passes is started over ssh like a static job's workers (the secret on ssh's standard
  input, never on a command line).

A host lost later (its workers killed, the machine gone: ssh exits 255) is a worker failure like any other: the
driver blacklists it and the survivors reset from their last commit.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from horovod.runner import ssh
from horovod.runner.elastic.discovery import FixedHosts, HostDiscovery
from horovod.runner.hosts import HostInfo
from horovod.transport import network

logger = logging.getLogger(__name__)

#: Seconds before a host that failed its check is checked again.
RECHECK_S = 10.0


def rendezvous_address(first: Sequence[HostInfo], discovery: HostDiscovery, ssh_settings: ssh.SshSettings,
                       timeout: float, nics: Sequence[str], fallback: str) -> Tuple[str, Dict[str, bool]]:
    """The address the store binds to, and the initial remote hosts that reached it (see the module docstring).

    Args:
        first: the hosts of the first discovery.
        discovery: where later hosts come from (a fixed list never changes).
        ssh_settings, timeout: how to check the remote hosts, and how long each check may take.
        nics: ``--network-interfaces``.
        fallback: the address when every host is this machine and always will be (loopback).

    Returns:
        ``(address, {remote host: passed})``.

    Raises:
        ValueError: ``nics`` names no interface of this machine.
    """
    remote = [h.hostname for h in first if ssh.is_remote(h.hostname)]
    if not remote:
        if nics:
            return network.nic_candidates(nics)[0].addr, {}
        if isinstance(discovery, FixedHosts):
            return fallback, {}
        primary = network.candidate_addresses([])
        if not primary:
            logger.warning("elastic: this machine has no address but loopback; hosts discovered later on other "
                           "machines will not be able to join")
            return fallback, {}
        return primary[0].addr, {}
    candidates = network.candidate_addresses(remote, nics)
    if not candidates:
        logger.warning("elastic: this machine has no address but loopback, so %s cannot reach it; they are left out",
                       ", ".join(remote))
        return fallback, {h: False for h in remote}
    with network.AddressProbe(candidates) as probe:
        results = ssh.check_hosts(remote, ssh_settings, timeout, list(probe.targets))
    reached = {h: results[h].reached for h in remote if results[h].ok}
    chosen, _ = network.choose_address(candidates, reached)
    if chosen is None:
        # No address suits every host: take the one most of them reached; the others are left out.
        best = max(candidates, key=lambda c: sum(c.addr in addrs for addrs in reached.values()))
        chosen = best
    passed = {h: h in reached and chosen.addr in reached[h] for h in remote}
    for host in remote:
        if not passed[host]:
            why = results[host].problem if not results[host].ok else f"it cannot connect to {chosen.addr}"
            logger.warning("elastic: leaving out host %s for now: %s", host, why)
    logger.info("elastic: rendezvous store on %s (reached by %s)", chosen,
                ", ".join(h for h in remote if passed[h]) or "no remote host yet")
    return chosen.addr, passed


class RemoteHosts:
    """Which discovered hosts this launcher can start workers on: this machine's, and remote ones that passed.

    Args:
        ssh_settings: how to reach remote hosts.
        timeout: seconds one host's check may take.
        passed: hosts already checked (by :func:`rendezvous_address`).
        clock: monotonic clock.
    """

    def __init__(self, ssh_settings: ssh.SshSettings, timeout: float, passed: Optional[Dict[str, bool]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ssh = ssh_settings
        self.timeout = timeout
        self.store_target = ""   # "addr:port" of the store, once it listens
        self._clock = clock
        self._lock = threading.Lock()
        self._ok: Dict[str, bool] = {}
        self._checked_at: Dict[str, float] = {}
        self._in_flight: set = set()
        for host, ok in (passed or {}).items():
            self._record(host, ok)

    def _record(self, host: str, ok: bool) -> None:
        with self._lock:
            self._ok[host] = ok
            self._checked_at[host] = self._clock()

    def check(self, hosts: Sequence[str]) -> None:
        """Start checking the remote hosts among ``hosts`` that were never checked, or failed :data:`RECHECK_S`
        ago; returns at once (each check runs in a thread of its own and may take up to the timeout: an
        unreachable host must not hold up discovery of the others)."""
        now = self._clock()
        with self._lock:
            due = [h for h in dict.fromkeys(hosts) if ssh.is_remote(h) and h not in self._in_flight and
                   (h not in self._ok or (not self._ok[h] and now - self._checked_at[h] >= RECHECK_S))]
            self._in_flight.update(due)
        for host in due:
            threading.Thread(target=self._check_one, args=(host,), name=f"hvd-elastic-check-{host}",
                             daemon=True).start()

    def _check_one(self, host: str) -> None:
        targets = [self.store_target] if self.store_target else []
        try:
            result = ssh.check_hosts([host], self.ssh, self.timeout, targets)[host]
        except Exception as exc:   # a check must never kill the thread silently: the host just stays out
            result = ssh.HostCheck(host, False, problem=f"the check failed: {exc!r}")
        store_addr = self.store_target.rsplit(":", 1)[0]
        ok = result.ok and (not targets or store_addr in result.reached)
        with self._lock:
            first_time = host not in self._ok
            self._in_flight.discard(host)
        self._record(host, ok)
        if ok:
            logger.info("elastic: host %s passed the ssh check%s", host,
                        f" and reaches the store at {self.store_target}" if targets else "")
        elif first_time:
            why = result.problem if not result.ok else (
                f"it cannot connect to the rendezvous store at {self.store_target} (a firewall, or another "
                f"network: choose the interface every host shares with --network-interfaces)")
            logger.warning("elastic: leaving out host %s (checked again every %.0f s): %s", host, RECHECK_S, why)

    def usable(self, host: str) -> bool:
        """Whether workers can be started on ``host`` now."""
        if not ssh.is_remote(host):
            return True
        with self._lock:
            return self._ok.get(host, False)
