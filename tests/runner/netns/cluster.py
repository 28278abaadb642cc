"""Several real hosts on one machine: network namespaces with their own address, host name and sshd.

Layout (all inside namespaces; the machine's own network is not touched)::

    driver ns  (10.200.0.1 on bridge br0)  -- runs horovodrun; /etc/hosts there names every host
      ├─ veth ── hostA ns  10.200.0.2  sshd on port 2222, hostname hostA (own UTS namespace)
      ├─ veth ── hostB ns  10.200.0.3  sshd on port 2222, hostname hostB
      └─ veth ── hostC ns  10.200.0.4  no sshd (connection refused)
    hostZ = 10.200.0.99: nobody (no answer)

Keys (a throwaway client key and host key) and configs live in a temporary directory.  ``ssh`` is reached
through a wrapper in ``<dir>/bin`` that adds ``-F <dir>/ssh_config`` (no known_hosts file is written anywhere).
Everything is bounded by timeouts and :meth:`NetnsCluster.down` removes it all, also after a failed ``up``.

Also a command line for manual experiments::

    python tests/runner/netns/cluster.py up /tmp/hvd-cluster    # prints how to use it; Ctrl-C tears it down
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

SSH_PORT = 2222
SUBNET = "10.200.0"
STEP_TIMEOUT = 20.0
SETUP_SCRIPT = Path(__file__).with_name("setup_hosts.sh")
#: Namespace names start with this (``HVD_NETNS_PREFIX`` overrides it: parallel checkouts can tell theirs apart),
#: then the creating process's id and one letter per host.
PREFIX = os.environ.get("HVD_NETNS_PREFIX", "hvdt")
_NAME_RE = re.compile(rf"^{re.escape(PREFIX)}(\d+)[a-z]$")


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the fake cluster (not root, no namespaces, no sshd); the message says why."""


@dataclass
class FakeHost:
    name: str
    ns: str
    addr: str
    sshd: bool
    proc: Optional[subprocess.Popen] = None


def _run(argv: Sequence[str], timeout: float = STEP_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def ensure_tools(install: bool = True) -> None:
    """Check (and, as root with apt, install) ip, unshare, ssh and sshd.

    Raises:
        ClusterUnavailable: something is missing or not permitted.
    """
    if not sys.platform.startswith("linux"):
        raise ClusterUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise ClusterUnavailable("creating network namespaces needs root")
    missing = [t for t in ("ip", "unshare", "ssh", "ssh-keygen") if shutil.which(t) is None]
    if not os.path.exists("/usr/sbin/sshd"):
        missing.append("sshd")
    if missing and install:
        try:
            _run(["bash", str(SETUP_SCRIPT)], timeout=660)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise ClusterUnavailable(f"missing {', '.join(missing)} and could not install them: {exc}") from None
        return ensure_tools(install=False)
    if missing:
        raise ClusterUnavailable(f"missing {', '.join(missing)}; run {SETUP_SCRIPT} as root")


def remove_stale() -> None:
    """Delete namespaces left behind by earlier test runs whose process is gone."""
    try:
        listing = _run(["ip", "netns", "list"], check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace(name)
            _run(["ip", "netns", "del", name], check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _namespace_pids(ns: str) -> List[int]:
    try:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_namespace(ns: str) -> None:
    for pid in _namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class NetnsCluster:
    """The fake cluster; see the module docstring.

    Args:
        workdir: a private directory for keys, configs and logs.
        hosts: None for the layout above; a number N (1..8) for hostA, hostB, ... (10.200.0.2, .3, ...), every
            one with its sshd (``benchmarks/collectives.py --hosts N``).
    """

    def __init__(self, workdir: Path, hosts: Optional[int] = None):
        self.dir = Path(workdir)
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.driver_ns = self.prefix + "d"
        self.driver_addr = f"{SUBNET}.1"
        if hosts is None:   # the tests' layout: two hosts with sshd, hostC without
            layout = [("hostA", True), ("hostB", True), ("hostC", False)]
        elif 1 <= hosts <= 8:   # ``hosts`` hosts, every one with sshd (the benchmarks' layout)
            layout = [(f"host{chr(ord('A') + i)}", True) for i in range(hosts)]
        else:
            raise ValueError(f"hosts={hosts}: expected 1 to 8")
        # namespace names: the prefix and one letter ("d" is the driver's)
        self.hosts: Dict[str, FakeHost] = {
            name: FakeHost(name, self.prefix + "abcefghi"[i], f"{SUBNET}.{2 + i}", sshd=sshd)
            for i, (name, sshd) in enumerate(layout)}
        self.unreachable = ("hostZ", f"{SUBNET}.99")
        self.key = self.dir / "id_ed25519"
        self.bin = self.dir / "bin"
        self._created: List[str] = []

    # ----------------------------------------------------------------------------------------- lifecycle
    def up(self) -> "NetnsCluster":
        """Create namespaces, network, keys and sshd processes; wait until every sshd accepts connections.

        Raises:
            ClusterUnavailable: namespaces are not permitted here.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale()
        try:
            _run(["ip", "netns", "add", self.driver_ns])
        except RuntimeError as exc:
            raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from None
        self._created.append(self.driver_ns)
        try:
            self._network()
            self._keys()
            for host in self.hosts.values():
                if host.sshd:
                    self.start_sshd(host.name)
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        d = self.driver_ns
        _run(["ip", "-n", d, "link", "set", "lo", "up"])
        _run(["ip", "-n", d, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", d, "addr", "add", f"{self.driver_addr}/24", "dev", "br0"])
        _run(["ip", "-n", d, "link", "set", "br0", "up"])
        for index, host in enumerate(self.hosts.values()):
            _run(["ip", "netns", "add", host.ns])
            self._created.append(host.ns)
            veth = f"v{index}"
            _run(["ip", "-n", d, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns])
            _run(["ip", "-n", d, "link", "set", veth, "master", "br0", "up"])
            _run(["ip", "-n", host.ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0"])
            _run(["ip", "-n", host.ns, "link", "set", "eth0", "up"])
        names = ["127.0.0.1 localhost", f"{self.driver_addr} driver"]
        names += [f"{h.addr} {h.name}" for h in self.hosts.values()]
        names.append(f"{self.unreachable[1]} {self.unreachable[0]}")
        for ns in [self.driver_ns] + [h.ns for h in self.hosts.values()]:
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for what runs in <ns>.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text("\n".join(names) + "\n")

    def _keys(self) -> None:
        for path in (self.key, self.dir / "host_key"):
            if not path.exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)])
        auth = self.dir / "authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        auth.chmod(0o600)
        (self.dir / "ssh_config").write_text(
            "Host *\n    UserKnownHostsFile /dev/null\n    GlobalKnownHostsFile /dev/null\n    LogLevel ERROR\n")
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {self.dir / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        os.makedirs("/run/sshd", exist_ok=True)   # sshd's privilege-separation directory

    def start_sshd(self, name: str) -> None:
        """Start (or restart) the sshd of ``name`` and wait until it accepts connections."""
        host = self.hosts[name]
        config = self.dir / f"sshd_{name}.conf"
        config.write_text("\n".join([
            f"ListenAddress {host.addr}", f"Port {SSH_PORT}", f"HostKey {self.dir / 'host_key'}",
            f"PidFile {self.dir / f'sshd_{name}.pid'}", f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "PrintMotd no", "LogLevel ERROR", "MaxStartups 100", ""]))
        log = open(self.dir / f"sshd_{name}.log", "ab")
        # Own UTS namespace: socket.gethostname() on that "host" says its name, as on a real one.
        host.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c",
             f"hostname {name} && exec /usr/sbin/sshd -D -e -f {config}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            probe = self.ssh(name, "hostname", timeout=STEP_TIMEOUT, check=False)
            if probe.returncode == 0 and probe.stdout.strip() == name:
                return
            if host.proc.poll() is not None or time.monotonic() > deadline:
                text = (self.dir / f"sshd_{name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of {name} did not come up: {probe.stderr.strip()} / {text.strip()}")
            time.sleep(0.2)

    def kill_host(self, name: str) -> None:
        """Crash a host: SIGKILL everything in its namespace (sshd, sessions, workers)."""
        _kill_namespace(self.hosts[name].ns)
        proc = self.hosts[name].proc
        if proc is not None:
            try:
                proc.wait(timeout=STEP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass

    def host_pids(self, name: str) -> List[int]:
        return _namespace_pids(self.hosts[name].ns)

    def host_pids_running(self, name: str, text: str) -> List[int]:
        """The pids on host ``name`` whose command line contains ``text`` (the ones that exited meanwhile left out)."""
        return [pid for pid in self.host_pids(name) if text in _cmdline(pid)]

    def down(self) -> None:
        """Kill every process in the namespaces, delete them and their /etc/netns files (never raises)."""
        for host in self.hosts.values():
            if host.ns in self._created:
                _kill_namespace(host.ns)
            if host.proc is not None:
                try:
                    host.proc.kill()
                    host.proc.wait(timeout=STEP_TIMEOUT)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        if self.driver_ns in self._created:
            _kill_namespace(self.driver_ns)
        for ns in reversed(self._created):
            try:
                _run(["ip", "netns", "del", ns], check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._created = []

    # -------------------------------------------------------------------------------------------- using it
    def env(self, base: Dict[str, str]) -> Dict[str, str]:
        """``base`` with the ssh wrapper first on PATH."""
        env = dict(base)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', os.defpath)}"
        return env

    def in_driver(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside the driver's namespace."""
        return ["ip", "netns", "exec", self.driver_ns, *argv]

    def ssh(self, name: str, command: str, timeout: float = STEP_TIMEOUT, check: bool = True):
        argv = self.in_driver([str(self.bin / "ssh"), "-p", str(SSH_PORT), "-i", str(self.key), "-o", "BatchMode=yes",
                               "-o", "StrictHostKeyChecking=no", "-o", "ConnectTimeout=5", name, command])
        try:
            return _run(argv, timeout=timeout, check=check)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", "timed out")

    def ssh_flags(self) -> List[str]:
        """The horovodrun flags that reach the hosts."""
        return ["-p", str(SSH_PORT), "-i", str(self.key)]


def cluster_or_skip(directory: Path, sshd_hosts: Sequence[str] = ()) -> Iterator[NetnsCluster]:
    """The body of a test module's ``cluster`` fixture (``yield from`` it): a cluster up in ``directory``, with
    sshd also started on ``sshd_hosts`` (hostC has none by default), torn down after; the test is skipped, with
    the reason, where this machine cannot build one."""
    import pytest

    try:
        ensure_tools()
        fake = NetnsCluster(directory).up()
    except ClusterUnavailable as exc:
        pytest.skip(f"no fake cluster on this machine: {exc}")
    try:
        for host in sshd_hosts:
            fake.start_sshd(host)
        yield fake
    finally:
        fake.down()


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "up":
        print("usage: cluster.py up <dir>", file=sys.stderr)
        return 2
    ensure_tools()
    cluster = NetnsCluster(Path(argv[1])).up()
    try:
        print(f"driver namespace: {cluster.driver_ns}; hosts: "
              + ", ".join(f"{h.name}={h.addr}" for h in cluster.hosts.values()))
        print(f"try: PATH={cluster.bin}:$PATH ip netns exec {cluster.driver_ns} python -m horovod.runner -np 4 "
              f"-H hostA:2,hostB:2 {' '.join(cluster.ssh_flags())} python examples/numpy_allreduce.py")
        print("Ctrl-C tears everything down")
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
