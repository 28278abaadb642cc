"""The elastic driver's worker processes: starting one in a slot, watching it exit, stopping it, and what its exit
means (a new worker in its slot, or its host blacklisted; a frozen member stopped; the job failed when every worker
did).

:class:`ElasticWorkers` is the half of :class:`~horovod.runner.elastic.driver.ElasticDriver` that deals with
processes; the driver (the job, the store, discovery and epochs) derives from it and owns the state both halves
share, declared below.  A launcher whose workers are not processes (Ray's actors) overrides
:meth:`ElasticWorkers._start_worker` and :meth:`ElasticWorkers._stop_workers`.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
from typing import Callable, Dict, List, Optional, Sequence, cast

from horovod.engine import membership
from horovod.runner import exec as _exec
from horovod.runner import ssh
from horovod.runner.doctor_watch import HangWatch
from horovod.runner.elastic.blacklist import HostBlacklist
from horovod.runner.elastic.layout import host_of
from horovod.runner.elastic.remote import RemoteHosts
from horovod.runner.elastic.settings import ElasticJobError, ElasticSettings, WorkerProcess
from horovod.runner.elastic.settings import WorkerRecord as _Worker, describe_exit_code
from horovod.runner.exec import WorkerExit, WorkerSpec
from horovod.runner.job import first_failures, reported_culprits
from horovod.runner.output import OutputSink
from horovod.runner.threads import set_worker_threads
from horovod.transport.rendezvous import MemoryStore

# The driver's logger: these lines were the driver's before the split, and log filters and readers know that name.
logger = logging.getLogger("horovod.runner.elastic.driver")

#: Worker failures a host may have before it is blacklisted while it still runs healthy workers (a host whose
#: workers have all failed is blacklisted at once).
HOST_FAILURES_BEFORE_BLACKLIST = 3


class ElasticWorkers:
    """The worker processes of an elastic job (see the module docstring)."""

    # Set by ElasticDriver.__init__ (and run()); the methods below read and update them.
    settings: ElasticSettings
    blacklist: HostBlacklist
    _clock: Callable[[], float]
    _events: "queue.Queue[tuple]"
    _slots: Dict[str, int]
    _workers: Dict[str, _Worker]
    _all_procs: List[WorkerProcess]
    _members: List[str]
    _epoch: int
    _blamed_since: Dict[str, float]
    _finishing: bool
    _failures: List[WorkerExit]
    _host_failures: Dict[str, int]
    _late_failures: List[WorkerExit]
    _sink: Optional[OutputSink]
    _command: List[str]
    _env: Dict[str, str]
    _remote: Optional[RemoteHosts]
    _hang: Optional[HangWatch]

    @property
    def store(self) -> MemoryStore:
        raise NotImplementedError   # the driver's: the rendezvous store of the running job

    # -- processes ------------------------------------------------------------------------------------
    def _ready_epoch(self, wid: str) -> Optional[int]:
        raw = self.store.get((membership.SCOPE, f"ready/{wid}"))
        try:
            return int(raw.decode()) if raw is not None else None
        except ValueError:
            return None

    def _idle(self, wid: str) -> bool:
        """The worker is running and waiting for an epoch newer than the last one it was placed in."""
        worker = self._workers.get(wid)
        return (worker is not None and worker.running and not worker.removed
                and self._ready_epoch(wid) == worker.last_epoch
                and worker.proc.poll() is None)   # its exit may not have reached the event queue yet

    def _ensure_started(self, wid: str, label: int) -> None:
        worker = self._workers.get(wid)
        if worker is not None and worker.running:
            return   # running (or still being stopped: the slot is reused once it is gone)
        self._launch(wid, label)

    def _start_worker(self, wid: str, spec: WorkerSpec) -> WorkerProcess:
        """Start one worker process (a subclass may start something that quacks like ``Popen`` instead: ``pid``,
        ``stdout``, ``stderr``, ``poll()``, ``wait(timeout)``, e.g. a Ray actor)."""
        return _exec._start(spec)

    def _stop_workers(self, procs: Sequence[WorkerProcess]) -> None:
        """Stop workers started by :meth:`_start_worker` (SIGTERM to their groups, SIGKILL after the grace)."""
        _exec.terminate(cast(Sequence[subprocess.Popen], procs), self.settings.grace_seconds)   # ours: processes

    def _free_label(self, planned: int) -> int:
        """The output prefix of a new worker: its planned rank, or the lowest one no running worker prints under.

        After a reset the survivors keep the prefix they started with while their ranks change, so a newcomer's
        planned rank may be a survivor's prefix; two processes printing as one rank would be indistinguishable.
        """
        used = {w.label for w in self._workers.values() if w.running}
        if planned not in used:
            return planned
        return min(set(range(len(used) + 1)) - used)

    def _launch(self, wid: str, label: int) -> None:
        host = host_of(wid)
        label = self._free_label(label)
        # A new process under a reused id must not mistake the old one's records for its own.
        self.store.delete((membership.SCOPE, f"ready/{wid}"))
        self._scrub_assignment(wid)
        env = dict(self._env)
        env.update({"HOROVOD_ELASTIC_WORKER_ID": wid, "HOROVOD_HOSTNAME": host,
                    # Provisional layout: the real one arrives with the worker's first epoch.
                    "HOROVOD_RANK": str(label), "HOROVOD_SIZE": str(max(label + 1, self.settings.num_proc)),
                    "HOROVOD_LOCAL_RANK": wid.rsplit(":", 1)[1], "HOROVOD_LOCAL_SIZE": str(self._slots.get(host, 1)),
                    "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"})
        set_worker_threads(env, self._slots.get(host, 1))
        spec = WorkerSpec(rank=label, hostname=host, command=list(self._command), env=env,
                          stdin=subprocess.DEVNULL)
        if self._remote is not None and ssh.is_remote(host):
            spec.extra["ssh"] = self._remote.ssh
            spec.cwd = os.getcwd()
        proc = self._start_worker(wid, spec)
        self._all_procs.append(proc)
        worker = _Worker(wid, proc, label)
        self._workers[wid] = worker
        assert self._sink is not None   # run() made it before any worker starts
        self._sink.attach(label, {"stdout": proc.stdout, "stderr": proc.stderr})
        logger.info("started worker %s (pid %s)", wid, proc.pid)
        threading.Thread(target=self._watch, args=(wid, proc), name=f"hvd-elastic-watch-{wid}", daemon=True).start()

    def _watch(self, wid: str, proc: WorkerProcess) -> None:
        self._events.put(("exit", wid, proc, proc.wait()))

    def _remove(self, worker: _Worker, why: str) -> None:
        """Stop a worker that is no longer wanted; its exit status is not a failure."""
        if worker.removed or not worker.running:
            return
        worker.removed = True
        logger.info("stopping worker %s: %s", worker.wid, why)
        threading.Thread(target=self._stop_workers, args=([worker.proc],),
                         name=f"hvd-elastic-stop-{worker.wid}", daemon=True).start()

    def _stop_unwanted(self, wanted: set) -> None:
        members = set(self._members)
        for worker in list(self._workers.values()):
            if not worker.running or worker.removed or worker.wid in wanted:
                continue
            if worker.wid in members and not self._idle(worker.wid):
                continue   # still training in the current epoch: it leaves at the next reset
            self._remove(worker, "its slot is no longer part of the job")

    def _on_exit(self, wid: str, proc: WorkerProcess, code: int) -> None:
        worker = self._workers.get(wid)
        if worker is None or worker.proc is not proc:
            return   # an earlier process of a reused slot
        worker.exit_code = code
        if code != 0 and not self._finishing and wid in self._members and worker.last_epoch == self._epoch:
            self._abandon_epoch(wid, code)
        if worker.removed:
            logger.info("worker %s stopped (%s)", wid, code)
            return
        if code == 0:
            # Training is over (a script that never joins an epoch counts too, as in the original).
            if not self._finishing:
                joined = "" if wid in self._members else " without joining an epoch"
                logger.info("worker %s finished%s; the job ends when the other members do", wid, joined)
            self._finishing = True
            return
        failure = WorkerExit(worker.label, worker.host, code)
        self._failures.append(failure)
        if wid in self._members and worker.last_epoch == self._epoch and self._hang is not None:
            rank = self._members.index(wid)
            self._hang.exits[rank] = WorkerExit(rank, worker.host, code)   # the doctor's view of the epoch
        if self._finishing:
            self._late_failures.append(failure)
        where = (f"rank {self._members.index(wid)} of epoch {self._epoch}" if wid in self._members and
                 worker.last_epoch == self._epoch else "not in an epoch yet" if worker.last_epoch < 0 else
                 f"last in epoch {worker.last_epoch}")
        failures = self._host_failures[worker.host] = self._host_failures.get(worker.host, 0) + 1
        # Healthy = still running after training in an epoch: a replacement started moments ago proves nothing
        # about the host (when several of its workers die at once, their exits may arrive one step apart).
        healthy = [o for o in self._workers.values()
                   if o.host == worker.host and o is not worker and o.running and o.last_epoch >= 0
                   and o.proc.poll() is None]
        if healthy and failures < HOST_FAILURES_BEFORE_BLACKLIST:
            # One process failed on a host that still runs others: replace it there; the survivors keep their
            # state and the job resumes from the last commit with the same size.
            logger.warning("worker %s (%s) exited with %s; starting a new worker in its slot on %s (failure %d of "
                           "%d before the host is blacklisted)", wid, where, describe_exit_code(code), worker.host,
                           failures, HOST_FAILURES_BEFORE_BLACKLIST)
            return
        self._host_failures.pop(worker.host, None)
        cooldown = self.blacklist.blacklist(worker.host)
        how = "for good" if cooldown is None else f"for {cooldown:.1f} s"
        logger.warning("worker %s (%s) exited with %s; blacklisting host %s %s", wid, where,
                       describe_exit_code(code), worker.host, how)
        for other in self._workers.values():
            if other.host == worker.host and other.running:
                self._remove(other, f"host {worker.host} is blacklisted")

    # -- failures -------------------------------------------------------------------------------------
    def _fail_if_every_worker_failed(self) -> None:
        """No worker is left and some failed: nobody holds the job's state any more, and every host that ran
        one is blacklisted; waiting for slots would only delay the error by ``--elastic-timeout``."""
        if not self._failures or any(w.running and not w.removed for w in self._workers.values()):
            return
        black = ", ".join(self.blacklist.blacklisted()) or "none"
        first = self._failures[0]
        raise ElasticJobError(
            f"{_exec.FAILURE_HEADLINE}\n{first.describe()}\nEvery worker of the elastic job failed "
            f"({len(self._failures)} failure(s)); blacklisted hosts: {black}. Nothing is left to continue from: "
            f"see the workers' output above.", first=first, exits=self._failures)

    def _stop_frozen_members(self) -> None:
        """Stop a member the others reported as failed once every other member is waiting for the next epoch.

        A frozen worker (``kill -STOP``, a hung driver) never exits and never becomes ready, so the next epoch would
        wait for it until the workers' own elastic timeout; after :data:`BLAMED_RANK_GRACE_SECONDS` it is stopped,
        which makes it an ordinary failure (replaced in its slot, or its host blacklisted).
        """
        if self._epoch < 0:
            return
        now = self._clock()
        blamed = set()
        for rank in first_failures(reported_culprits(self.store)):
            if not 0 <= rank < len(self._members):
                continue
            wid = self._members[rank]
            worker = self._workers.get(wid)
            if worker is None or not worker.running or worker.removed or self._idle(wid):
                continue
            if worker.last_epoch != self._epoch:
                continue   # a fresh process already replaces the failed one in its slot: it is starting, not frozen
            others = [self._workers[m] for m in self._members if m != wid]
            if not all(self._idle(o.wid) or not o.running for o in others):
                continue
            blamed.add(wid)
            since = self._blamed_since.setdefault(wid, now)
            if now - since >= _exec.BLAMED_RANK_GRACE_SECONDS:
                logger.warning("worker %s (rank %d of epoch %d) was reported as failed by the others and has not "
                               "rejoined %.0f s after they all did (frozen?): stopping it", wid, rank, self._epoch,
                               _exec.BLAMED_RANK_GRACE_SECONDS)
                del self._blamed_since[wid]
                threading.Thread(target=self._stop_workers, args=([worker.proc],), name=f"hvd-elastic-stop-{wid}",
                                 daemon=True).start()
        for wid in [w for w in self._blamed_since if w not in blamed]:
            del self._blamed_since[wid]

    # -- the store's records of a worker --------------------------------------------------------------
    def _abandon_epoch(self, wid: str, code: int) -> None:
        """A member of the current epoch exited: members still forming it (inside ``init()``, waiting for this one)
        stop waiting and announce that they left it, so the next epoch follows at once instead of after their init
        timeout; members already training find out from their next collective, as before."""
        why = f"worker {wid} (rank {self._members.index(wid)}) exited with {describe_exit_code(code)}"
        self.store.put((membership.SCOPE, membership.ABANDONED_KEY), membership.abandon_value(self._epoch, why))
        logger.info("elastic: epoch %d abandoned: %s", self._epoch, why)

    def _scrub_assignment(self, wid: str) -> None:
        raw = self.store.get((membership.SCOPE, "assignment"))
        if raw is None:
            return
        doc = json.loads(raw.decode())
        if wid not in doc["workers"] and wid not in doc.get("removed", []):
            return
        # Its old process is gone and the current epoch failed or is ending with it; a fresh process must
        # wait for the next epoch instead of joining this one (or reading itself as removed).
        doc["workers"].pop(wid, None)
        doc["removed"] = [w for w in doc.get("removed", []) if w != wid]
        self.store.put((membership.SCOPE, "assignment"), json.dumps(doc).encode())
