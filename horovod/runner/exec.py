"""Start worker processes, watch them, and stop them all when one fails or the launcher is interrupted.

How a worker is started depends on its host.  *Starters* are registered with :func:`register_starter`
(name, which hosts it accepts, a priority); :func:`starter_for` picks the highest-priority starter that
accepts a host.  Only the local starter exists so far: an ssh starter registers itself for remote hosts and
the rest of this module (supervision, termination, output) works unchanged, because a starter only has to
return a :class:`subprocess.Popen` whose ``stdout``/``stderr`` are pipes and whose process group the
launcher may signal.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from horovod.runner.hosts import is_local_host
from horovod.runner.output import OutputSink

logger = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when stopping workers.
DEFAULT_GRACE_SECONDS = 5.0

#: Longest a launcher's main thread blocks in one wait.  Python runs signal handlers only in the main thread, and
#: only when it runs: a SIGINT the kernel hands to one of the launcher's other threads (output readers, watchers)
#: interrupts no wait of the main thread, so an untimed wait could miss Ctrl-C until something else woke it.
SIGNAL_CHECK_SECONDS = 0.5

#: Seconds a rank that the others reported as failed may keep running once every other rank has exited, before
#: the launcher stops it and fails the job (a frozen rank never exits by itself; its peers may exit cleanly).
BLAMED_RANK_GRACE_SECONDS = 10.0

FAILURE_HEADLINE = ("Horovod detected that one or more processes exited with non-zero status, thus causing the "
                    "job to be terminated. The first process to do so was:")


class LaunchNotAvailableError(NotImplementedError):
    """The requested way of launching (remote hosts, mpirun, elastic) is not available in this launcher."""


class WorkerStartError(RuntimeError):
    """A worker's command could not be started at all (not found, not executable).

    Attributes:
        exit_code: the shell convention: 127 not found, 126 not executable, 1 otherwise.
    """

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended (a negative ``returncode`` is the signal that killed it)."""

    rank: int
    hostname: str
    returncode: int

    def describe(self) -> str:
        code = self.returncode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"{code} (killed by {name})"
        else:
            how = str(code)
        return f"Rank: {self.rank}\nHost: {self.hostname}\nExit code: {how}"


class JobFailedError(RuntimeError):
    """A worker exited with a non-zero status; the others were terminated.

    Attributes:
        first: the first worker that failed.
        exits: every worker's exit, ordered by rank.
    """

    def __init__(self, first: WorkerExit, exits: Sequence[WorkerExit] = (), details: str = ""):
        message = f"{FAILURE_HEADLINE}\n{first.describe()}"
        if details:
            message += "\n" + details
        super().__init__(message)
        self.first: Optional[WorkerExit] = first   # subclasses for whole-job failures may have no first worker
        self.exits = list(exits)


@dataclass
class WorkerSpec:
    """What to run for one rank.

    Attributes:
        rank: the worker's rank (for output tags and error messages).
        hostname: the host it runs on (chooses the starter).
        command: argv of the worker.
        env: its complete environment.
        stdin: ``None`` inherits the launcher's standard input, ``subprocess.DEVNULL`` gives it none.
        cwd: working directory (the launcher's when ``None``).
    """

    rank: int
    hostname: str
    command: List[str]
    env: Dict[str, str]
    stdin: Union[None, int] = subprocess.DEVNULL
    cwd: Optional[str] = None
    extra: Dict[str, object] = field(default_factory=dict)


Starter = Callable[[WorkerSpec], subprocess.Popen]


@dataclass(frozen=True)
class _Registration:
    name: str
    accepts: Callable[[str], bool]
    start: Starter
    priority: int


_STARTERS: List[_Registration] = []


def register_starter(name: str, accepts: Callable[[str], bool], start: Starter, priority: int = 0) -> None:
    """Make ``start`` the way to launch workers on hosts for which ``accepts(hostname)`` is true.

    Higher ``priority`` wins; registering a name again replaces it.
    """
    _STARTERS[:] = [r for r in _STARTERS if r.name != name]
    _STARTERS.append(_Registration(name, accepts, start, priority))
    _STARTERS.sort(key=lambda r: -r.priority)


def starter_for(hostname: str) -> Tuple[str, Starter]:
    """The ``(name, start)`` of the starter for ``hostname``.

    Raises:
        LaunchNotAvailableError: no starter accepts the host (today: any remote host).
    """
    for reg in _STARTERS:
        if reg.accepts(hostname):
            return reg.name, reg.start
    raise LaunchNotAvailableError(
        f"host {hostname!r} is not this machine, and launching on other hosts (over ssh) is not available yet "
        f"in this launcher; run on one host with -H localhost:<slots>")


_PR_SET_PDEATHSIG = 1


def _die_with(launcher_pid: int) -> None:
    """In the child, between fork and exec: be killed when the launcher dies, however it dies (even SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher_pid:   # the launcher died before the request took effect
        os._exit(1)


def die_with_launcher() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` tying a child to this process's life (Linux), so a launcher killed with SIGKILL leaves no
    orphans; ``None`` elsewhere. The child dies when the *thread* that started it ends, so start children from a
    thread that lives as long as they should (the launcher's main loop)."""
    if not sys.platform.startswith("linux"):
        return None
    return functools.partial(_die_with, os.getpid())


def start_local(spec: WorkerSpec) -> subprocess.Popen:
    """Start ``spec`` as a child process in a new session (its own process group), tied to the launcher's life.

    A separate group lets the launcher signal the worker *and everything it started*; a separate session
    keeps the terminal's Ctrl-C away from the workers so that the launcher alone decides how they stop.
    """
    return subprocess.Popen(spec.command, env=spec.env, cwd=spec.cwd, stdin=spec.stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_launcher())


register_starter("local", is_local_host, start_local, priority=0)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def terminate(procs: Sequence[subprocess.Popen], grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
    """Stop workers: SIGTERM to each process group, SIGKILL to the ones still running after the grace period.

    A second Ctrl-C during the grace period skips straight to SIGKILL.
    """
    running = [p for p in procs if p.poll() is None]
    for proc in procs:
        # Groups of exited workers too: their leftover children go with them.
        _signal_group(proc, signal.SIGTERM)
        # A stopped (SIGSTOP, ^Z) worker would only see SIGTERM once continued: let it handle it now.
        _signal_group(proc, signal.SIGCONT)
    if not running:
        return
    deadline = time.monotonic() + grace_seconds
    try:
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        logger.warning("interrupted again: killing the workers now")
    for proc in running:
        if proc.poll() is None:
            logger.warning("worker pid %s ignored SIGTERM for %.0f s; sending SIGKILL", proc.pid, grace_seconds)
        _signal_group(proc, signal.SIGKILL)
    for proc in running:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            logger.error("worker pid %s survived SIGKILL", proc.pid)


def wait_interruptibly(proc: subprocess.Popen) -> int:
    """``proc.wait()`` in steps of SIGNAL_CHECK_SECONDS, so that the caller's signal handlers run meanwhile."""
    while True:
        try:
            return proc.wait(timeout=SIGNAL_CHECK_SECONDS)
        except subprocess.TimeoutExpired:
            continue


def _start(spec: WorkerSpec) -> subprocess.Popen:
    _, start = starter_for(spec.hostname)
    try:
        return start(spec)
    except FileNotFoundError:
        raise WorkerStartError(f"cannot start rank {spec.rank} on {spec.hostname}: command {spec.command[0]!r} "
                               f"not found; check the command and PATH", exit_code=127) from None
    except PermissionError:
        raise WorkerStartError(f"cannot start rank {spec.rank} on {spec.hostname}: {spec.command[0]!r} is not "
                               f"executable", exit_code=126) from None
    except OSError as exc:
        raise WorkerStartError(f"cannot start rank {spec.rank} on {spec.hostname}: {exc}") from None


def _stuck_blamed(running: set, blamed: Callable[[], Sequence[int]]) -> List[int]:
    """The running ranks, when every one of them was reported as failed by the others (else empty)."""
    if not running:
        return []
    try:
        reported = set(blamed())
    except Exception:   # reading the reports must never break the wait for the workers
        logger.debug("reading the failure reports failed", exc_info=True)
        return []
    return sorted(running) if running <= reported else []


def run_workers(specs: Sequence[WorkerSpec], sink: OutputSink,
                grace_seconds: float = DEFAULT_GRACE_SECONDS,
                failure_details: Optional[Callable[[WorkerExit], str]] = None,
                blamed: Optional[Callable[[], Sequence[int]]] = None,
                blamed_grace_seconds: float = BLAMED_RANK_GRACE_SECONDS,
                before_stop: Optional[Callable[[WorkerExit], None]] = None) -> List[WorkerExit]:
    """Start every worker, forward its output, and wait for all of them.

    The first worker to exit non-zero stops the job: the others are terminated (:func:`terminate`) and
    :class:`JobFailedError` names it.  An exception in the caller's thread (Ctrl-C, the launcher's SIGTERM
    handler) also terminates every worker before it propagates.

    Args:
        specs: one per rank.
        sink: receives the workers' pipes.
        grace_seconds: SIGTERM → SIGKILL delay.
        failure_details: extra text for the failure message (e.g. the worker's traceback), called once the
            job has stopped.
        blamed: the ranks the workers reported as failed (read while some are still running).  When only such
            ranks are left and they do not exit within ``blamed_grace_seconds``, they are stopped and the job
            fails naming the first of them: a frozen rank whose peers caught the error and exited cleanly would
            otherwise be waited for forever.
        before_stop: called with the first failure before the others are stopped (the hang doctor collects
            the survivors' dumps there; bounded by its own timeout).

    Returns:
        Every worker's exit (all zero), ordered by rank.

    Raises:
        JobFailedError: a worker failed.
        WorkerStartError: a worker could not be started.
        LaunchNotAvailableError: a host has no starter (checked before anything starts).
    """
    for spec in specs:
        starter_for(spec.hostname)  # fail before starting anybody
    procs: Dict[int, subprocess.Popen] = {}
    hosts = {spec.rank: spec.hostname for spec in specs}
    exits: Dict[int, WorkerExit] = {}
    events: "queue.Queue[Tuple[int, int]]" = queue.Queue()
    first_failure: Optional[WorkerExit] = None
    stopped: Optional[int] = None

    def watch(rank: int, proc: subprocess.Popen) -> None:
        events.put((rank, proc.wait()))

    try:
        for spec in specs:
            proc = _start(spec)
            procs[spec.rank] = proc
            logger.info("started rank %s on %s (pid %s)", spec.rank, spec.hostname, proc.pid)
            sink.attach(spec.rank, {"stdout": proc.stdout, "stderr": proc.stderr})
            threading.Thread(target=watch, args=(spec.rank, proc), name=f"hvd-watch-{spec.rank}",
                             daemon=True).start()
        left_blamed_since: Optional[float] = None
        while len(exits) < len(procs):
            # Timed, so that the launcher's signal handlers run (SIGNAL_CHECK_SECONDS); once somebody exited, the
            # wake-ups also notice ranks that the others reported as failed and that stay alive.
            try:
                rank, code = events.get(timeout=SIGNAL_CHECK_SECONDS)
            except queue.Empty:
                if not exits or blamed is None:
                    continue
                frozen = _stuck_blamed(set(procs) - set(exits), blamed)
                if not frozen:
                    left_blamed_since = None
                    continue
                left_blamed_since = left_blamed_since or time.monotonic()
                if time.monotonic() - left_blamed_since < blamed_grace_seconds:
                    continue
                logger.error("rank(s) %s still running %.0f s after every other rank exited, and reported as "
                             "failed by them: stopping the job", frozen, blamed_grace_seconds)
                stopped = frozen[0]
                break
            exits[rank] = WorkerExit(rank, hosts[rank], code)
            logger.info("rank %s exited with %s", rank, code)
            if code != 0:
                first_failure = exits[rank]
                if before_stop is not None:
                    try:
                        before_stop(first_failure)
                    except Exception:   # the job must still be stopped
                        logger.warning("collecting the hang dumps failed", exc_info=True)
                break
    finally:
        terminate(list(procs.values()), grace_seconds)
        sink.finish()
    if stopped is not None:
        first_failure = WorkerExit(stopped, hosts[stopped], procs[stopped].returncode)
        note = (f"Rank {stopped} stopped responding: the other ranks reported it as failed and exited, and it was "
                f"still running {blamed_grace_seconds:.0f} s later (frozen, or stuck outside Horovod), so horovodrun "
                f"stopped it.")
        for rank, proc in procs.items():
            exits.setdefault(rank, WorkerExit(rank, hosts[rank], proc.returncode))
        details = failure_details(first_failure) if failure_details else ""
        raise JobFailedError(first_failure, [exits[r] for r in sorted(exits)],
                             "\n".join(part for part in (note, details) if part))
    if first_failure is not None:
        for rank, proc in procs.items():
            exits.setdefault(rank, WorkerExit(rank, hosts[rank], proc.returncode))
        details = failure_details(first_failure) if failure_details else ""
        raise JobFailedError(first_failure, [exits[r] for r in sorted(exits)], details)
    return [exits[r] for r in sorted(exits)]
