"""Where an elastic job may run right now: a host discovery script, or a fixed host list.

A discovery script prints one host per line, ``host`` or ``host:slots``; a bare host gets ``--slots-per-host``
slots (1 when that flag is not given).  Blank lines and ``#`` comments are ignored.  The driver runs the script
about once a second, so it should be quick; it runs with a timeout and a failing run keeps the last good answer.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Dict, Iterable, List, Optional, Sequence

from horovod.runner.hosts import HostInfo

logger = logging.getLogger(__name__)

#: Seconds one run of the discovery script may take.
DEFAULT_SCRIPT_TIMEOUT = 10.0


class DiscoveryError(RuntimeError):
    """The discovery script could not be run, failed, or printed something that is not a host list."""


def _has_slots(line: str) -> bool:
    if line.startswith("["):            # bracketed IPv6 literal: "[::1]:2"
        return "]:" in line
    return line.count(":") == 1         # a bare IPv6 literal has several colons and no slot count


def parse_discovery_output(lines: Iterable[str], default_slots: Optional[int] = None,
                           source: str = "host discovery script") -> List[HostInfo]:
    """Parse the lines of a discovery script into hosts, in the order printed.

    A host printed twice keeps the larger slot count (scripts built from several sources do this).

    Raises:
        DiscoveryError: a line is malformed; the message quotes it.
    """
    slots_for_bare = default_slots if default_slots is not None else 1
    found: Dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if _has_slots(line):
            text = line
        else:
            text = f"[{line}]:{slots_for_bare}" if ":" in line else f"{line}:{slots_for_bare}"
        try:
            host = HostInfo.from_string(text)
        except ValueError as exc:
            raise DiscoveryError(f"{source}, line {number}: {exc}") from None
        found[host.hostname] = max(found.get(host.hostname, 0), host.slots)
    return [HostInfo(name, slots) for name, slots in found.items()]


class HostDiscovery:
    """Interface: ``find()`` returns the hosts available now (raises :class:`DiscoveryError` on failure)."""

    def find(self) -> List[HostInfo]:  # pragma: no cover - interface
        raise NotImplementedError


class FixedHosts(HostDiscovery):
    """Elastic flags with ``-H`` / ``--hostfile``: the host list never changes (failed hosts still drop out)."""

    def __init__(self, hosts: Sequence[HostInfo]):
        self._hosts = list(hosts)

    def find(self) -> List[HostInfo]:
        return list(self._hosts)


class HostDiscoveryScript(HostDiscovery):
    """Runs ``script`` (an executable path, or any shell command) and parses what it prints.

    Args:
        script: the ``--host-discovery-script`` value.
        default_slots: ``--slots-per-host``; slots of hosts printed without ``:slots``.
        timeout: seconds one run may take.
    """

    def __init__(self, script: str, default_slots: Optional[int] = None,
                 timeout: float = DEFAULT_SCRIPT_TIMEOUT):
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout

    def find(self) -> List[HostInfo]:
        # shell=True: the original documents "a script", and users pass e.g. "python discover.py".  Its own
        # session (process group): on a timeout the whole group is killed, not only the shell, so nothing the
        # script started (a hung ssh, curl, sleep) is left running behind the driver.
        try:
            proc = subprocess.Popen(self.script, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError as exc:
            raise DiscoveryError(f"cannot run host discovery script {self.script!r}: {exc}") from None
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DiscoveryError(f"host discovery script {self.script!r} did not finish within "
                                 f"{self.timeout:.0f} s and was killed with every process it started; it runs "
                                 f"every second and must be quick") from None
        except BaseException:
            _kill_group(proc)
            raise
        if proc.returncode != 0:
            err = stderr.strip().splitlines()[-1:] or ["(no error output)"]
            raise DiscoveryError(f"host discovery script {self.script!r} exited with status {proc.returncode}: "
                                 f"{err[0]}")
        return parse_discovery_output(stdout.splitlines(), self.default_slots,
                                      source=f"host discovery script {self.script!r}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the script's process group (its session: everything it started) and reap the shell."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass   # the group is gone already
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()   # a child that escaped the group may still hold the pipes: do not read them
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        logger.warning("host discovery script (pid %d) did not exit after SIGKILL", proc.pid)
