"""The launcher's side of the hang doctor: one dump directory per job, collecting every rank's dump when something
looks hung, and the verdict in the launcher's messages.

- Every worker gets ``HOROVOD_FLIGHT_RECORDER_DIR`` (a fresh directory per job unless the user chose one).
- Workers announce ``host|pid`` in the rendezvous store at ``init()``; rank 0 asks for dumps there when the stall
  inspector warns (:mod:`horovod.engine.flight_dump`).  The watch thread sees the request and sends ``SIGUSR1`` to
  every rank on this host — the signal reaches ranks stuck outside Horovod too — waits (bounded) until every live
  rank wrote a dump, records what it knows of each rank (stopped, exited, running) in ``launcher.json``, and prints
  the doctor's verdict.  ``SIGUSR1`` to the launcher does the same on demand.
- When a worker fails, the job is stopped only after the same collection (a few seconds at most), so the failure
  message carries the verdict and the survivors' dumps exist.

Ranks on other hosts are not signalled (their own dumps on stall errors and failures still land in the directory
when it is shared storage).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Mapping, Optional

from horovod.doctor import DumpDirectoryError, report
from horovod.engine import flight_dump
from horovod.engine.flight_dump import COLLECT_TIMEOUT_S, STORE_SCOPE
from horovod.runner.exec import WorkerExit
from horovod.runner.hosts import is_local_host, rank_ranges

logger = logging.getLogger("horovod.runner")

DIR_ENV = "HOROVOD_FLIGHT_RECORDER_DIR"
_POLL_S = 0.1
#: Requests this soon after a collection are the same stall seen by another rank (the fast lane warns on each).
REQUEST_QUIET_S = 10.0


def _is_local(host: str) -> bool:
    return host == socket.gethostname() or is_local_host(host)


class NotServing:
    """The launcher's ``SIGUSR1`` handler while no :class:`HangWatch` can collect (the launcher is still starting,
    or the job runs under mpirun): it says why instead of dying (the default action) or staying silent."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, signum, frame) -> None:
        logger.warning("a flight-recorder dump was asked for (SIGUSR1), but it cannot be served: %s", self.why)


#: Why a request is not served under ``horovodrun --mpi`` (there, rank 0 collects by itself).
UNDER_MPIRUN = ("under --mpi the ranks collect by themselves: rank 0 at a stall warning, or any rank on "
                "hvd.dump_flight_recorder(all_ranks=True); or send SIGUSR1 to a rank's pid (see docs/debugging.md)")
#: Why a request is not served while the launcher starts.
STARTING = "the launcher is still starting the job (checking hosts); ask again once the workers run"


def _replaceable(handler) -> bool:
    return handler in (signal.SIG_DFL, None) or isinstance(handler, NotServing)


class HangWatch:
    """One job's dump directory, collection and verdict (see the module docstring).

    Args:
        store: the job's rendezvous store (the launcher's in-process ``MemoryStore``).
        worker_env: the workers' environment (a user's ``HOROVOD_FLIGHT_RECORDER_DIR`` wins).
        hosts: rank → host name.
    """

    def __init__(self, store, worker_env: Mapping[str, str], hosts: Mapping[int, str]):
        self.store = store
        self.hosts = dict(hosts)
        self._made_directory = not worker_env.get(DIR_ENV)
        self.directory = worker_env.get(DIR_ENV) or tempfile.mkdtemp(prefix="horovod-doctor-")
        self.exits: Dict[int, WorkerExit] = {}
        self.verdict: str = ""
        #: Wait only for dumps of this generation (elastic jobs: the epoch); ``None``: any recent dump.
        self.generation: Optional[int] = None
        self._stop = threading.Event()
        self._collect_lock = threading.Lock()
        self._seen_request: Optional[bytes] = None
        self._last_collect = -REQUEST_QUIET_S
        # A collection may still run when the next epoch (or Ray call) begins: its verdict is about the one before,
        # so it must neither become the new one's nor silence the new one's first stall (REQUEST_QUIET_S).
        self._verdict_lock = threading.Lock()
        self._round = 0   # counts fresh_verdict()
        #: A SIGUSR1 that came before every rank reached init(): served once they have (see :meth:`on_request`).
        self._pending = threading.Event()
        self._previous_handler: Any = None   # the SIGUSR1 handler to restore at stop()
        self._thread = threading.Thread(target=self._watch, name="horovod-doctor-watch", daemon=True)

    def env(self) -> Dict[str, str]:
        return {DIR_ENV: self.directory}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "HangWatch":
        self._thread.start()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            try:
                current = signal.getsignal(signal.SIGUSR1)
                if _replaceable(current):
                    self._previous_handler = current
                    signal.signal(signal.SIGUSR1, self._on_signal)
            except (ValueError, OSError):
                pass
        return self

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            try:
                if signal.getsignal(signal.SIGUSR1) == self._on_signal:
                    signal.signal(signal.SIGUSR1, self._previous_handler or signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._thread.join(1.0)
        if self._made_directory:
            try:
                os.rmdir(self.directory)   # only when empty: a job that never dumped leaves nothing behind
            except OSError:
                pass

    def _on_signal(self, signum, frame) -> None:
        threading.Thread(target=self.on_request, daemon=True).start()

    def _waiting_for(self) -> list:
        """The ranks of this job (or generation) that have not announced themselves at ``init()`` yet."""
        pids = flight_dump.announced(self.store.scope(STORE_SCOPE))
        return sorted(r for r in self.hosts if r not in pids and r not in self.exits)

    def on_request(self) -> str:
        """A dump asked for from outside (``SIGUSR1``): collected now when every rank reached ``init()``; else said
        so at once, and collected as soon as they all have (the watch thread sees it)."""
        missing = self._waiting_for()
        if not missing:
            return self.collect("SIGUSR1 to the launcher")
        self._pending.set()
        logger.warning("a flight-recorder dump was asked for (SIGUSR1), but it cannot be served yet: rank(s) %s of "
                       "%d have not reached hvd.init() (still starting, or stuck before it); it will be collected "
                       "as soon as every rank has", rank_ranges(missing), len(self.hosts))
        return ""

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            if self._pending.is_set() and not self._waiting_for():
                self._pending.clear()
                self.collect("SIGUSR1 to the launcher, served once every rank reached hvd.init()")
            request = self.store.get((STORE_SCOPE, "request"))
            if request is not None and request != self._seen_request \
                    and time.monotonic() - self._last_collect >= REQUEST_QUIET_S:
                self._seen_request = request
                reason = request.decode(errors="replace").split("|", 2)[-1]
                self.collect(f"rank 0 reported a {reason}" if "stall" in reason else reason)

    # -- collection -------------------------------------------------------------------------------------------
    def collect(self, reason: str, announce: bool = True, signal_ranks: bool = True) -> str:
        """Signal every local rank to dump (unless ``signal_ranks`` is false: the dumps there are read as they
        are), wait for the dumps (bounded), write ``launcher.json``, and return (and with ``announce``, print) the
        verdict."""
        with self._collect_lock:
            began, round_ = time.monotonic(), self._round
            pids = flight_dump.announced(self.store.scope(STORE_SCOPE))
            if signal_ranks:
                targets = {r: pid for r, pid in flight_dump.local_ranks(pids, _is_local).items()
                           if r not in self.exits}
                flight_dump.gather(self.directory, targets, self.generation)
            exits = {r: e.returncode for r, e in self.exits.items()}
            flight_dump.write_process_view(self.directory, reason,
                                           flight_dump.process_view(pids, exits, self.hosts, _is_local),
                                           self.generation)
            try:
                lines = report(self.directory)
            except DumpDirectoryError:
                if announce:   # asked for: never silence
                    logger.warning("no rank wrote a flight-recorder dump after %s (%d announced at init(), none "
                                   "answered within %.0f s); nothing to diagnose", reason, len(pids),
                                   COLLECT_TIMEOUT_S)
                return ""   # nothing dumped (a job that failed before init): nothing to say
            except (OSError, ValueError, KeyError) as exc:
                lines = [f"Horovod doctor: no verdict ({exc!r})"]
            took = time.monotonic() - began
            verdict = "\n".join(lines + [f"  dumps: {self.directory} (collected in {took:.1f} s after {reason}); "
                                         f"rerun: python -m horovod.doctor {self.directory}"])
            if announce:
                logger.warning("%s", verdict)
            with self._verdict_lock:
                if round_ == self._round:   # (else a new epoch began while this one's dumps were collected)
                    self.verdict, self._last_collect = verdict, time.monotonic()
            return verdict

    def before_stop(self, first: WorkerExit) -> None:
        """A worker failed: collect before the job is stopped, so the failure message can carry the verdict."""
        self.exits[first.rank] = first
        self.collect(f"rank {first.rank} exited with {first.returncode}", announce=False)

    def failure_text(self) -> str:
        return self.verdict

    # -- jobs of several generations (elastic epochs, Ray calls): one watch for all ------------------------------
    def fresh_verdict(self) -> None:
        """A new generation or call: the last verdict was about an earlier one, and a stall is collected at once."""
        with self._verdict_lock:
            self.verdict, self._last_collect, self._round = "", -REQUEST_QUIET_S, self._round + 1

    def new_generation(self, generation: int, hosts: Mapping[int, str]) -> None:
        """An elastic job's next epoch: new ranks (their announcements come again), its dumps are waited for."""
        self.generation, self.hosts, self.exits = generation, dict(hosts), {}
        self.fresh_verdict()
        for key in list(self.store.scope(STORE_SCOPE)):
            if key.startswith("pid."):
                self.store.delete((STORE_SCOPE, key))

    def with_verdict(self, error: Exception, reason: str) -> Exception:
        """``error`` (a whole-job failure) with the latest generation's verdict appended to its message: the one
        collected at a stall in that generation, else one over the dumps there now (the ranks dumped on the failure
        themselves; between epochs they have no engine to answer a signal)."""
        verdict = self.verdict or self.collect(reason, announce=False, signal_ranks=False)
        if verdict and error.args:
            error.args = (f"{error.args[0]}\n{verdict}",) + tuple(error.args[1:])
        return error


def request_dump(launcher_pid: int) -> int:
    """``horovodrun --dump-flight-recorder PID``: signal a running launcher to collect (its own output shows the
    verdict).  Refuses a pid that is not a horovodrun: SIGUSR1 would kill most other programs.  Returns the exit
    status."""
    try:
        with open(f"/proc/{launcher_pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        argv = None
    if argv is not None and not any(b"horovodrun" in a or b"horovod.runner" in a for a in argv):
        seen = b" ".join(argv[:3]).decode(errors="replace")
        print(f"horovodrun: error: pid {launcher_pid} is not a horovodrun ({seen}"
              f"); pass the launcher's pid (pgrep -f horovodrun)", file=sys.stderr)
        return 2
    try:
        os.kill(launcher_pid, signal.SIGUSR1)
    except OSError as exc:
        print(f"horovodrun: error: cannot signal pid {launcher_pid}: {exc}", file=sys.stderr)
        return 2
    print(f"horovodrun: asked horovodrun (pid {launcher_pid}) to collect its ranks' hang dumps; its output shows the "
          f"verdict within {COLLECT_TIMEOUT_S:.0f} s, or why it cannot give one yet")
    return 0
