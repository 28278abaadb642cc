"""What an elastic job is given (:class:`ElasticSettings`) and how it ends (:class:`ElasticResult`,
:class:`ElasticJobError`); the driver that runs it is :mod:`horovod.runner.elastic.driver`."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.layout import host_of
from horovod.runner.exec import DEFAULT_GRACE_SECONDS, JobFailedError, WorkerExit
from horovod.runner.job import LOCAL_RENDEZVOUS_HOST
from horovod.transport.rendezvous import MemoryStore

#: Seconds between two runs of the discovery script.
DISCOVERY_INTERVAL = 1.0

Command = Union[Sequence[str], Callable[[str, int], Sequence[str]]]


class ElasticJobError(JobFailedError):
    """The elastic job failed as a whole (reset limit, too few slots for too long, a failure while finishing)."""

    def __init__(self, message: str, first: Optional[WorkerExit] = None, exits: Sequence[WorkerExit] = ()):
        RuntimeError.__init__(self, message)
        self.first = first
        self.exits = list(exits)


@dataclass
class ElasticSettings:
    """Everything the driver needs, resolved from flags / API arguments.

    Attributes:
        num_proc: workers needed to start the job (``-np``).
        min_np: fewest workers the job runs with (``--min-np``).
        max_np: most workers (``--max-np``; ``None`` = every available slot).
        command: argv of every worker, or a function of the rendezvous ``(addr, port)`` returning it.
        discovery: where the hosts come from.
        elastic_timeout: seconds to wait for ``min_np`` (``num_proc`` at start) usable slots.
        reset_limit: most resets allowed (``None`` = unlimited).
        cooldown_range: blacklist cooldown ``(MIN, MAX)`` seconds (``None`` = blacklisted for ever).
        knob_env, nics, output_dir, prefix_timestamp, start_timeout, grace_seconds, extra_env: as for a static job.
        discovery_interval: seconds between discovery runs.
        rendezvous_host: the address the job's store binds to when ``accepts_host`` is given (otherwise the
            driver chooses one that remote hosts reach, see :mod:`horovod.runner.elastic.remote`).
        accepts_host: which discovered hosts the driver can start workers on.  Default (``None``): this
            machine's names, and remote hosts that pass an ssh check and reach the store (started over ssh).  A
            launcher that registers its own starter (:func:`horovod.runner.exec.register_starter`), e.g. Spark
            tasks, gives its own test instead.
        ssh_port, ssh_identity_file: how to reach remote hosts (``-p``, ``-i``).
        stdout, stderr: where the workers' tagged output goes (the launcher's own streams by default).
    """

    num_proc: int
    min_np: int
    max_np: Optional[int]
    command: Command
    discovery: HostDiscovery
    elastic_timeout: float = 600.0
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[int, int]] = None
    knob_env: Dict[str, str] = field(default_factory=dict)
    nics: List[str] = field(default_factory=list)
    output_dir: Optional[str] = None
    prefix_timestamp: bool = False
    start_timeout: int = 30
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    extra_env: Dict[str, str] = field(default_factory=dict)
    discovery_interval: float = DISCOVERY_INTERVAL
    rendezvous_host: str = LOCAL_RENDEZVOUS_HOST
    accepts_host: Optional[Callable[[str], bool]] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    stdout: Optional[IO[str]] = None
    stderr: Optional[IO[str]] = None

    def validate(self) -> None:
        """Raises ValueError on inconsistent process counts."""
        if self.min_np < 1:
            raise ValueError(f"--min-np must be >= 1, got {self.min_np}")
        if self.num_proc < self.min_np:
            raise ValueError(f"-np {self.num_proc} is below --min-np {self.min_np}; -np is the number of workers "
                             f"to start with and must be between --min-np and --max-np")
        if self.max_np is not None and self.max_np < self.num_proc:
            raise ValueError(f"--max-np {self.max_np} is below -np {self.num_proc}; -np is the number of workers "
                             f"to start with and must be between --min-np and --max-np")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.elastic_timeout < 0:
            raise ValueError(f"--elastic-timeout must be >= 0, got {self.elastic_timeout}")


@dataclass
class ElasticResult:
    """How an elastic job ended.

    Attributes:
        members: worker ids of the last epoch, by rank.
        epochs: epochs published.
        resets: epochs after the first.
        store: the rendezvous store's contents.
    """

    members: List[str]
    epochs: int
    resets: int
    store: MemoryStore


def describe_exit_code(code: int) -> str:
    """``-9 (killed by SIGKILL)`` for a signal, the number otherwise."""
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


class WorkerProcess(Protocol):
    """What the elastic driver uses of a worker it started: a ``subprocess.Popen``, or what a launcher with its own
    workers starts instead (Ray's actors)."""

    pid: Any
    stdout: Any
    stderr: Any

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...


@dataclass
class WorkerRecord:
    """What the driver knows of one worker process."""

    wid: str
    proc: WorkerProcess
    label: int                      # its output prefix: the rank it was planned for, unless a live worker has it
    last_epoch: int = -1            # last epoch the driver placed it in
    exit_code: Optional[int] = None
    removed: bool = False           # stopped by the driver: its exit is not a failure

    @property
    def host(self) -> str:
        return host_of(self.wid)

    @property
    def running(self) -> bool:
        return self.exit_code is None
