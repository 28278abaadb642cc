"""One static job with the built-in (Gloo-style) controller: secret, rendezvous store, workers, outcome.

Shared by ``horovodrun`` (:mod:`horovod.runner.launch`) and the Python API (:mod:`horovod.runner.api`).
"""
from __future__ import annotations

import logging
import os
import secrets
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from horovod.engine import config
from horovod.runner import ssh
from horovod.runner.check_cache import CheckCache
from horovod.runner.doctor_watch import HangWatch
from horovod.runner.exec import DEFAULT_GRACE_SECONDS, WorkerExit, WorkerSpec, run_workers
from horovod.runner.hosts import HostInfo, SlotInfo, get_host_assignments
from horovod.runner.output import OutputSink
from horovod.engine.teardown import CULPRIT_SCOPE
from horovod.transport.rendezvous import MemoryStore, RendezvousServer
from horovod.runner.threads import set_worker_threads

logger = logging.getLogger(__name__)

#: Address the single-host rendezvous store binds to: never wider than the job needs.
LOCAL_RENDEZVOUS_HOST = "127.0.0.1"

Command = Union[Sequence[str], Callable[[str, int], Sequence[str]]]


@dataclass
class JobSettings:
    """Everything a static job needs, resolved from flags / API arguments.

    Attributes:
        num_proc: processes to start (exactly this many, see :func:`get_host_assignments`).
        hosts: hosts in rank order.
        command: argv of every worker, or a function of the rendezvous ``(addr, port)`` returning it.
        knob_env: ``HOROVOD_*`` tuning variables from flags and the config file.
        nics: network interfaces the job should use (first one → ``HOROVOD_GLOO_IFACE``).
        output_dir: per-rank output directory (``--output-filename``).
        prefix_timestamp: prefix forwarded lines with the time.
        start_timeout: seconds workers may take to reach the rendezvous (exported as HOROVOD_START_TIMEOUT).
        stdin_to_rank0: rank 0 inherits the launcher's standard input (the others get none).
        grace_seconds: SIGTERM → SIGKILL delay when stopping workers.
        extra_env: more variables for every worker.
        ssh_port, ssh_identity_file: how to reach remote hosts (``-p``, ``-i``).
        disable_cache: check remote hosts every time instead of trusting an hour-old success.
        mpi_args, binding_args, tcp: ``--mpi-args``, ``--binding-args``, ``--tcp`` (mpirun jobs only).
    """

    num_proc: int
    hosts: List[HostInfo]
    command: Command
    knob_env: Dict[str, str] = field(default_factory=dict)
    nics: List[str] = field(default_factory=list)
    output_dir: Optional[str] = None
    prefix_timestamp: bool = False
    start_timeout: int = 30
    stdin_to_rank0: bool = True
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    extra_env: Dict[str, str] = field(default_factory=dict)
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    disable_cache: bool = False
    mpi_args: Optional[str] = None
    binding_args: Optional[str] = None
    tcp: bool = False


def remote_plan(settings: JobSettings, hostnames: Sequence[str],
                need_address: bool = True) -> Optional[ssh.RemotePlan]:
    """Check the job's remote hosts over ssh (None when every host is this machine).

    Raises:
        ssh.HostCheckError: a host cannot be used; nothing has been started.
    """
    remote = [h for h in dict.fromkeys(hostnames) if ssh.is_remote(h)]
    if not remote:
        return None
    return ssh.prepare_remote_hosts(remote, ssh.SshSettings.create(settings.ssh_port, settings.ssh_identity_file),
                                    max(1, settings.start_timeout), settings.nics,
                                    CheckCache(enabled=not settings.disable_cache), need_address)


def _ssh_hint(first: WorkerExit) -> str:
    if first.returncode == ssh.SSH_FAILED and ssh.is_remote(first.hostname):
        return (f"ssh to {first.hostname} exited with status {ssh.SSH_FAILED}: the connection failed or was lost "
                f"(host down, sshd stopped, network failure), or the remote process was killed by a signal.")
    return ""


def reported_culprits(store: MemoryStore) -> List[Tuple[int, int, str]]:
    """``(culprit, reporter, message)`` for every rank that saw another rank fail, by reporter."""
    reports = []
    for reporter, raw in sorted(store.scope(CULPRIT_SCOPE).items(), key=lambda kv: int(kv[0])):
        culprit, _, message = raw.decode(errors="replace").partition("|")
        try:
            reports.append((int(culprit), int(reporter), message))
        except ValueError:
            continue
    return reports


def first_failures(reports: Sequence[Tuple[int, int, str]]) -> List[int]:
    """The ranks that failed first according to ``reports``.

    A rank that itself reported somebody else's failure was alive and watching: it is a witness, not a cause,
    even if a third rank blamed it (it was waiting on the frozen rank too).  Only when that rule leaves nobody
    (ranks blaming each other) are all named.
    """
    culprits = sorted({culprit for culprit, _, _ in reports})
    witnesses = {reporter for culprit, reporter, _ in reports if culprit != reporter}
    return [c for c in culprits if c not in witnesses] or culprits


def culprit_text(first: WorkerExit, store: MemoryStore) -> str:
    """What the ranks that saw another rank fail reported, when that rank is not the one that exited first.

    A frozen or unreachable rank never exits: the first rank to exit is then a witness, not the cause.
    """
    reports = reported_culprits(store)
    culprits = first_failures(reports)
    if not reports or culprits == [first.rank]:
        return ""
    lines = [f"Cause: rank{'s' if len(culprits) > 1 else ''} {', '.join(map(str, culprits))} failed first, as seen "
             f"by the other ranks (rank {first.rank} only exited first):"]
    lines += [f"  rank {reporter}: {message}" for _, reporter, message in reports]
    return "\n".join(lines)


def job_env(parent_env: Mapping[str, str], settings: JobSettings, addr: str, port: int,
            secret: bytes) -> Dict[str, str]:
    """The environment shared by every worker of the job (per-slot variables come on top)."""
    env = {k: v for k, v in parent_env.items() if k != config.SECRET_ENV}
    env.update(settings.knob_env)
    env.update(settings.extra_env)
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_START_TIMEOUT": str(settings.start_timeout),
        "PYTHONUNBUFFERED": "1",
    })
    if settings.nics:
        env["HOROVOD_GLOO_IFACE"] = settings.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(settings.nics)
    env[config.SECRET_ENV] = secret.hex()
    return env


def worker_specs(slots: Sequence[SlotInfo], command: Sequence[str], env: Mapping[str, str],
                 stdin_to_rank0: bool) -> List[WorkerSpec]:
    specs = []
    for slot in slots:
        worker_env = dict(env)
        worker_env.update(slot.env())
        set_worker_threads(worker_env, slot.local_size)
        stdin = None if (stdin_to_rank0 and slot.rank == 0) else subprocess.DEVNULL
        specs.append(WorkerSpec(rank=slot.rank, hostname=slot.hostname, command=list(command), env=worker_env,
                                stdin=stdin))
    return specs


def run_gloo_job(settings: JobSettings, parent_env: Mapping[str, str],
                 setup: Optional[Callable[[RendezvousServer], None]] = None,
                 failure_details: Optional[Callable[[WorkerExit, MemoryStore], str]] = None) -> MemoryStore:
    """Run a static job on local hosts and return the rendezvous store's contents once it ended.

    Args:
        settings: the job.
        parent_env: the launcher's environment, inherited by the workers.
        setup: called with the running store before any worker starts (e.g. to publish a function).
        failure_details: extra text for a failure message, given the failed worker and the store.

    Raises:
        JobFailedError: a worker exited non-zero (the others were terminated).
        WorkerStartError, LaunchNotAvailableError, ValueError: the job could not start.
    """
    slots = get_host_assignments(settings.hosts, settings.num_proc)
    plan = remote_plan(settings, [slot.hostname for slot in slots])
    # One host: loopback only.  Several: the address every host reached in the check (never 0.0.0.0).
    bind_host = plan.address.addr if plan is not None and plan.address is not None else LOCAL_RENDEZVOUS_HOST
    secret = secrets.token_bytes(32)   # per job; travels only in the workers' environment, never logged
    with RendezvousServer(secret, host=bind_host) as server:
        logger.info("rendezvous store at %s:%s; %d processes on %s", server.host, server.port, len(slots),
                    ",".join(f"{h.hostname}:{h.slots}" for h in settings.hosts))
        if setup is not None:
            setup(server)
        command = settings.command(server.host, server.port) if callable(settings.command) else settings.command
        env = job_env(parent_env, settings, server.host, server.port, secret)
        watch = HangWatch(server.store, env, {slot.rank: slot.hostname for slot in slots})   # the hang doctor
        env.update(watch.env())
        specs = worker_specs(slots, command, env, settings.stdin_to_rank0)
        if plan is not None:
            for spec in specs:
                if ssh.is_remote(spec.hostname):
                    spec.extra["ssh"] = plan.ssh
                    spec.cwd = os.getcwd()
        sink = OutputSink(len(slots), prefix_timestamp=settings.prefix_timestamp, output_dir=settings.output_dir)

        def details(first: WorkerExit) -> str:
            parts = [culprit_text(first, server.store), _ssh_hint(first),
                     failure_details(first, server.store) if failure_details else "", watch.failure_text()]
            return "\n".join(p for p in parts if p)
        watch.start()
        try:
            run_workers(specs, sink, settings.grace_seconds, failure_details=details,
                        blamed=lambda: first_failures(reported_culprits(server.store)), before_stop=watch.before_stop)
        finally:
            watch.stop()
        return server.store
