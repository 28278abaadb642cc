"""Workers on other hosts: the ssh reachability check before a job, and the ssh starter of :mod:`horovod.runner.exec`.

A remote worker is started as::

    ssh [-p PORT] [-i KEY] -o BatchMode=yes -o StrictHostKeyChecking=no HOST \\
        'cd CWD >/dev/null 2>&1; for py in PYTHON python3 python; do ... exec env K=V ... "$py" -c WRAPPER CMD...'

The job secret is *not* on that command line (anyone on either host could read it with ``ps``): the launcher
writes it as the first line of ssh's standard input, and the small :data:`WRAPPER` on the remote side reads it,
puts it in the worker's environment and starts the worker in its own process group.  The wrapper keeps reading
its standard input: when that ends -- the launcher stopped the job, died, or the connection broke -- it stops
the worker (SIGTERM, SIGKILL after a grace period), so no worker outlives its job.  Remote workers therefore
get no standard input of their own.

Before anything starts, :func:`prepare_remote_hosts` checks every remote host in parallel with one ssh call
each, which also reports which of this machine's addresses the host can connect to (see
:mod:`horovod.transport.network`); failures name the host, what ssh said and what to do.  Successful checks are
cached for an hour (:mod:`horovod.runner.check_cache`) unless ``--disable-cache``.
"""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from horovod.engine import config
from horovod.transport import network
from horovod.runner.check_cache import CheckCache, make_key
from horovod.runner.exec import (DEFAULT_GRACE_SECONDS, WorkerSpec, WorkerStartError, die_with_launcher,
                                 register_starter)
from horovod.runner.hosts import is_local_host

logger = logging.getLogger(__name__)

#: Options on every ssh call: never prompt (a prompt would hang the launcher), accept unknown host keys.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no")

#: Exit status of ``ssh`` itself failing (connection refused, lost, authentication...).
SSH_FAILED = 255

#: Printed by the check on the remote side; its absence means the remote shell did not run our command.
CHECK_MARKER = "horovodrun-ssh-check-ok"

# Variables that describe this machine or this shell rather than the job (the original's list, plus the
# ssh session variables of a launcher that was itself started over ssh).
_LOCAL_ONLY = frozenset({"OLDPWD", "PWD", "SHLVL", "_", "HOSTNAME", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
                         "SSH_AUTH_SOCK", config.SECRET_ENV})

#: Runs on the remote host as ``python -c WRAPPER <command...>``; see the module docstring.
WRAPPER = r"""
import os, signal, subprocess, sys, threading
try:   # a parent-death signal inherited through exec would kill us before we could stop the worker
    import ctypes
    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)
except Exception:
    pass
line = b""
while not line.endswith(b"\n"):
    # Unbuffered, one byte at a time: nothing after the secret line may be consumed here.
    byte = os.read(0, 1)
    if not byte:
        sys.stderr.write("horovodrun: the launcher went away before sending the job secret; not starting\n")
        sys.exit(2)
    line += byte
secret = line.strip().decode()
if secret:
    os.environ["_HOROVOD_SECRET_KEY"] = secret
try:
    child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, start_new_session=True)
except FileNotFoundError:
    sys.stderr.write("horovodrun: command %r not found on this host; check the command and PATH\n" % sys.argv[1])
    sys.exit(127)
except PermissionError:
    sys.stderr.write("horovodrun: %r is not executable on this host\n" % sys.argv[1])
    sys.exit(126)
stopping = []
def kill(sig):
    try:
        os.killpg(child.pid, sig)
    except OSError:
        pass
def stop(*_):
    if not stopping:
        stopping.append(True)
        kill(signal.SIGTERM)
        timer = threading.Timer(GRACE, kill, (signal.SIGKILL,))
        timer.daemon = True
        timer.start()
def watch():
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    stop()
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, stop)
threading.Thread(target=watch, daemon=True).start()
while True:   # in steps: a signal the kernel hands the watch thread runs its handler only when this thread runs
    try:
        code = child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        pass
kill(signal.SIGKILL if stopping else signal.SIGTERM)
sys.stderr.flush()
os._exit(code if code >= 0 else 128 - code)
""".replace("GRACE", repr(DEFAULT_GRACE_SECONDS))

#: Runs on the remote host during the check: prints the marker, then the probe targets it can connect to.
PROBE = r"""
import socket, sys, threading
print("MARKER", flush=True)
reached = []
def connect(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=TIMEOUT).close()
        reached.append(target)
    except OSError:
        pass
threads = [threading.Thread(target=connect, args=(t,)) for t in sys.argv[1:]]
for t in threads:
    t.start()
for t in threads:
    t.join()
for target in reached:
    print("reach", target, flush=True)
"""

_PROBE_CONNECT_TIMEOUT = 3.0
_CHECK_EXTRA_SECONDS = 10.0


class HostCheckError(WorkerStartError):
    """A remote host cannot be used (ssh fails, no Python there, or it cannot reach this machine)."""


@dataclass(frozen=True)
class SshSettings:
    """How to reach remote hosts.

    Attributes:
        port: ``-p/--ssh-port`` (ssh's default when None).
        identity_file: ``-i/--ssh-identity-file``.
    """

    port: Optional[int] = None
    identity_file: Optional[str] = None

    def argv(self, host: str, options: Sequence[str] = ()) -> List[str]:
        """``ssh [-p port] [-i key] -o BatchMode=yes -o StrictHostKeyChecking=no [options] host``."""
        cmd = ["ssh"]
        if self.port is not None:
            cmd += ["-p", str(self.port)]
        if self.identity_file:
            cmd += ["-i", self.identity_file]
        return cmd + list(SSH_OPTIONS) + list(options) + [host]

    def describe(self) -> str:
        parts = [f"port {self.port}" if self.port is not None else "default port"]
        if self.identity_file:
            parts.append(f"key {self.identity_file}")
        return ", ".join(parts)

    @classmethod
    def create(cls, port: Optional[int], identity_file: Optional[str]) -> "SshSettings":
        """Validate the flags: a port in range and an identity file that exists.

        Raises:
            ValueError: naming the flag and the value.
        """
        if port is not None and not 0 < int(port) < 65536:
            raise ValueError(f"-p/--ssh-port {port} is not a TCP port (1-65535)")
        if identity_file:
            identity_file = os.path.expanduser(identity_file)
            if not os.path.isfile(identity_file):
                raise ValueError(f"-i/--ssh-identity-file {identity_file!r} does not exist or is not a file")
        return cls(int(port) if port is not None else None, identity_file or None)


def is_remote(hostname: str) -> bool:
    return not is_local_host(hostname)


def remote_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables a remote worker gets on its command line: the job's, minus this machine's and the secret."""
    out = {}
    for name, value in env.items():
        if (not name or "=" in name or name in _LOCAL_ONLY or name.startswith("BASH_FUNC_")
                or name.endswith("CUDA_VISIBLE_DEVICES")):
            continue
        out[name] = value
    return out


def _python_choices() -> List[str]:
    # The launcher's own interpreter first: clusters usually share the same installation path.
    return [sys.executable or "python3", "python3", "python"]


def _with_python(code: str, args: Sequence[str], env: Optional[Mapping[str, str]] = None) -> str:
    """sh: run ``python -c code args`` with the first interpreter found, optionally under ``env K=V ...``."""
    prefix = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " if env else ""
    tried = " ".join(_python_choices())
    run = f'exec {prefix}"$_hvd_py" -c {shlex.quote(code)} ' + " ".join(shlex.quote(a) for a in args)
    return (f"for _hvd_py in {' '.join(shlex.quote(p) for p in _python_choices())}; do "
            f'if command -v "$_hvd_py" >/dev/null 2>&1; then {run}; fi; done; '
            f"echo {shlex.quote(f'horovodrun: no Python interpreter on this host (tried {tried})')} >&2; exit 127")


def remote_command(cwd: str, env: Mapping[str, str], command: Sequence[str]) -> str:
    """The shell command ssh runs on the remote host for one worker (see the module docstring)."""
    return f"cd {shlex.quote(cwd)} >/dev/null 2>&1; " + _with_python(WRAPPER, command, env)


def probe_command(targets: Sequence[str]) -> str:
    """The shell command of the ssh check: prints :data:`CHECK_MARKER`, then ``reach addr:port`` lines."""
    code = PROBE.replace("MARKER", CHECK_MARKER).replace("TIMEOUT", repr(_PROBE_CONNECT_TIMEOUT))
    return _with_python(code, targets)


def _launcher_env() -> Dict[str, str]:
    # The ssh client itself needs HOME, PATH, SSH_AUTH_SOCK...; never the job secret.
    return {k: v for k, v in os.environ.items() if k != config.SECRET_ENV}


def start_ssh(spec: WorkerSpec) -> subprocess.Popen:
    """Starter for remote hosts: run ``spec`` over ssh, the secret on ssh's standard input (never on argv)."""
    settings = spec.extra.get("ssh")
    if not isinstance(settings, SshSettings):   # (None where the job gave no ssh settings)
        settings = SshSettings()
    secret = spec.env.get(config.SECRET_ENV, "")
    argv = settings.argv(spec.hostname) + [remote_command(spec.cwd or os.getcwd(), remote_env(spec.env),
                                                          spec.command)]
    try:
        # ssh dies with the launcher; the remote wrapper sees its stdin close and stops the worker.
        proc = subprocess.Popen(argv, env=_launcher_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_launcher())
    except FileNotFoundError:
        raise WorkerStartError(f"cannot start rank {spec.rank} on {spec.hostname}: the ssh client ('ssh') is not "
                               f"installed or not on PATH", exit_code=127) from None
    assert proc.stdin is not None   # stdin=PIPE
    try:
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        pass   # ssh already failed; its exit status and message tell why
    # stdin stays open: closing it (or this process ending) tells the remote wrapper to stop the worker.
    return proc


register_starter("ssh", is_remote, start_ssh, priority=-10)   # a fallback: specific starters win


# ------------------------------------------------------------------------------------------------- the check

@dataclass
class HostCheck:
    """Outcome of checking one host.

    Attributes:
        host: the host name as given.
        ok: ssh worked and ran Python there.
        reached: ``addr`` of the probe targets the host connected to.
        problem: what went wrong, in words, with the advice (empty when ok).
        cached: the result came from the cache (no ssh call).
    """

    host: str
    ok: bool
    reached: List[str] = field(default_factory=list)
    problem: str = ""
    cached: bool = False


def explain_ssh_failure(host: str, settings: SshSettings, returncode: Optional[int], output: str,
                        timeout: float) -> str:
    """Turn a failed check into: what happened, and what to do."""
    said = "; ".join(line.strip() for line in output.strip().splitlines()[-3:] if line.strip())
    said = f" (ssh said: {said})" if said else ""
    port = settings.port if settings.port is not None else 22
    low = output.lower()
    if returncode is None:
        return (f"no answer within {timeout:.0f} s{said}; is the host up and reachable from here? Raise "
                f"--start-timeout if it is just slow")
    if "could not resolve hostname" in low or "name or service not known" in low:
        return f"the host name does not resolve{said}; check DNS or /etc/hosts, or give its address"
    if "connection refused" in low:
        return (f"nothing accepts ssh connections on port {port}{said}; is sshd running there, and is the port "
                f"right (-p/--ssh-port)?")
    if "timed out" in low or "no route to host" in low or "network is unreachable" in low:
        return f"the host does not answer on port {port}{said}; is it up, and on a network this machine reaches?"
    if "permission denied" in low or "too many authentication failures" in low:
        return (f"key authentication failed{said}; horovodrun needs passwordless ssh: add your public key to "
                f"~/.ssh/authorized_keys there, or name the key with -i/--ssh-identity-file")
    if "host key verification failed" in low or "remote host identification has changed" in low:
        return f"the host key was rejected{said}; remove the stale entry with `ssh-keygen -R {host}`"
    if returncode == 127 and "no python interpreter" in low:
        return f"ssh works but there is no Python on that host{said}; install Python and Horovod there"
    if returncode == SSH_FAILED:
        return f"ssh failed{said}"
    return f"the check command exited with status {returncode}{said}; the remote shell may print errors at login"


def _check_one(host: str, settings: SshSettings, targets: Sequence[str], timeout: float) -> HostCheck:
    # ssh gives up connecting after `timeout` and says why; the extra seconds are for the remote shell and the probe.
    argv = settings.argv(host, ["-o", f"ConnectTimeout={max(1, int(timeout))}"]) + [probe_command(targets)]
    try:
        proc = subprocess.run(argv, env=_launcher_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout + _CHECK_EXTRA_SECONDS, check=False,
                              start_new_session=True)
    except FileNotFoundError:
        return HostCheck(host, False, problem="the ssh client ('ssh') is not installed or not on PATH")
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return HostCheck(host, False, problem=explain_ssh_failure(host, settings, None, err,
                                                                  timeout + _CHECK_EXTRA_SECONDS))
    out = proc.stdout.decode(errors="replace")
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0 or CHECK_MARKER not in out:
        return HostCheck(host, False, problem=explain_ssh_failure(host, settings, proc.returncode, err or out,
                                                                  timeout))
    reached = []
    for line in out.splitlines():
        if line.startswith("reach "):
            target = line.split(" ", 1)[1].strip()
            reached.append(target.rsplit(":", 1)[0])
    return HostCheck(host, True, reached=reached)


def check_hosts(hosts: Sequence[str], settings: SshSettings, timeout: float,
                targets: Sequence[str] = ()) -> Dict[str, HostCheck]:
    """ssh to every host at once (each call bounded by ``timeout`` seconds) and collect the outcomes."""
    results: Dict[str, HostCheck] = {}
    lock = threading.Lock()

    def run(host: str) -> None:
        outcome = _check_one(host, settings, targets, timeout)
        with lock:
            results[host] = outcome

    threads = [threading.Thread(target=run, args=(h,), name=f"hvd-ssh-check-{h}", daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + _CHECK_EXTRA_SECONDS + 5)
    for host in hosts:
        results.setdefault(host, HostCheck(host, False, problem=f"the check did not finish within {timeout:.0f} s"))
    return results


def _failure_message(failed: Sequence[HostCheck], total: int, settings: SshSettings) -> str:
    lines = [f"cannot use {len(failed)} of {total} remote host(s) over ssh ({settings.describe()}):"]
    for check in failed:
        lines.append(f"  {check.host}: {check.problem}")
    example = " ".join(shlex.quote(a) for a in settings.argv(failed[0].host)) + " true"
    lines.append(f"Every remote host must accept `{example}` without any prompt; nothing was started.")
    return "\n".join(lines)


@dataclass(frozen=True)
class RemotePlan:
    """What a multi-host job needs to know once its hosts passed the check.

    Attributes:
        ssh: how to reach them.
        address: the address of this machine every host can connect to (None when not asked for).
    """

    ssh: SshSettings
    address: Optional[network.Candidate]


def prepare_remote_hosts(hosts: Sequence[str], settings: SshSettings, timeout: float, nics: Sequence[str] = (),
                         cache: Optional[CheckCache] = None, need_address: bool = True) -> RemotePlan:
    """Check every remote host over ssh and find an address of this machine all of them reach.

    Args:
        hosts: the remote hosts of the job.
        settings: ssh port and key.
        timeout: seconds each ssh call may take (``--start-timeout``).
        nics: ``--network-interfaces``: only their addresses are candidates.
        cache: where successes are remembered (a disabled cache checks every time).
        need_address: also choose the launcher's address (the built-in launcher's rendezvous store).

    Raises:
        HostCheckError: a host failed the check, or no address of this machine is reachable from all hosts.
        ValueError: ``nics`` names no interface of this machine.
    """
    cache = cache or CheckCache(enabled=False)
    hosts = list(dict.fromkeys(hosts))
    ssh_keys = {h: make_key("ssh", h, settings.port, settings.identity_file) for h in hosts}
    addr_key = make_key("address", sorted(hosts), settings.port, settings.identity_file, sorted(nics))
    interfaces = network.interface_addresses()

    address: Optional[network.Candidate] = None
    if need_address:
        cached = cache.get(addr_key)
        if isinstance(cached, list) and len(cached) == 2 and cached[1] in interfaces.values():
            address = network.Candidate(cached[0], cached[1])
            logger.info("launcher address %s: cached", address)
        elif cached is not None:
            cache.forget([addr_key])
    to_check = [h for h in hosts if not (cache.get(ssh_keys[h]) and (address or not need_address))]
    for host in hosts:
        if host not in to_check:
            logger.info("ssh check of %s: ok (cached)", host)
    if not to_check:
        return RemotePlan(settings, address)

    probe_needed = need_address and address is None
    candidates: List[network.Candidate] = []
    if probe_needed:
        candidates = network.candidate_addresses(hosts, nics, interfaces)
        if not candidates:
            raise HostCheckError("this machine has no network address other than loopback, so workers on "
                                 f"{', '.join(hosts)} cannot reach it; connect it to their network")
    with network.AddressProbe(candidates) as probe:
        logger.info("checking ssh to %s (%s)%s", ", ".join(to_check), settings.describe(),
                    f"; probing {', '.join(str(c) for c in candidates)}" if candidates else "")
        results = check_hosts(to_check, settings, float(timeout), list(probe.targets))
    failed = [results[h] for h in to_check if not results[h].ok]
    if failed:
        raise HostCheckError(_failure_message(failed, len(hosts), settings))
    for host in to_check:
        logger.info("ssh check of %s: ok; reaches %s", host, ", ".join(results[host].reached) or "nothing")
    cache.put_many({ssh_keys[h]: True for h in to_check})
    if probe_needed:
        address, reached = network.choose_address(candidates, {h: results[h].reached for h in to_check})
        if address is None:
            lines = [f"the workers could not reach this machine: no address of it is reachable from every host "
                     f"(tried {', '.join(str(c) for c in candidates)}):"]
            lines += [f"  {h} reached: {', '.join(a) or 'none of them'}" for h, a in reached.items()]
            lines.append("A firewall may block incoming connections here, or the hosts are on different networks; "
                         "name the interface the hosts share with --network-interfaces.")
            raise HostCheckError("\n".join(lines))
        logger.info("launcher address for %s: %s", ", ".join(hosts), address)
        cache.put(addr_key, [address.iface, address.addr])
    return RemotePlan(settings, address)


__all__ = ["SshSettings", "HostCheck", "HostCheckError", "RemotePlan", "prepare_remote_hosts", "check_hosts",
           "remote_command", "remote_env", "probe_command", "start_ssh", "explain_ssh_failure", "is_remote",
           "WRAPPER", "SSH_FAILED"]
