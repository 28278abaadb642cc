"""The elastic driver: keeps a job running while hosts come and go and workers fail.

The driver serves the job's authenticated rendezvous store and talks to the workers only through it (the
protocol is described in :mod:`horovod.engine.membership`):

- Every second it asks the discovery script which hosts exist.  Usable hosts are the discovered ones that
  are not blacklisted; their slots, up to ``--max-np``, are the workers it *wants* (:func:`layout.plan_members`:
  survivors of the current epoch first, in rank order, then newcomers).
- It starts a process for every wanted slot that has none (``HOROVOD_ELASTIC=1``,
  ``HOROVOD_ELASTIC_WORKER_ID=<host>:<slot>``), and stops processes that are no longer wanted once they left
  their epoch.
- When the wanted workers differ from the current epoch's members it bumps ``hosts``; the running workers see
  it at their next ``state.commit()`` and reset together (``HostsUpdatedInterrupt``).
- A worker exiting non-zero blacklists its host (for ever, or for a growing cooldown) and stops the other
  workers there; the survivors see a failed collective, restore their last commit and reset.
- Once every wanted worker has announced that it left its last epoch (``ready/<id>`` = that epoch), the
  driver publishes the next epoch's ``assignment``.  Each new epoch after the first is a reset and counts
  against ``--reset-limit``.
- With fewer than ``--min-np`` usable slots it waits up to ``--elastic-timeout`` seconds for more, unless every
  worker has failed (then no host is usable either): the job fails at once, as a static job would.
- The job succeeds when the members of the last epoch exit 0 (workers that were still waiting to join are
  stopped then).

Everything that decides (which workers, which ranks, blacklist cooldowns) is a pure function in
:mod:`layout` and :mod:`blacklist`; this module does the job, the store, discovery and the epochs, and its base
:class:`~horovod.runner.elastic.workers.ElasticWorkers` (:mod:`workers`) the worker processes and their exits.
"""
from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional

from horovod.engine import membership
from horovod.runner import exec as _exec
from horovod.runner import ssh
from horovod.runner.elastic.blacklist import HostBlacklist
from horovod.runner.elastic.discovery import DiscoveryError
from horovod.runner.elastic.layout import assign_ranks, host_of, plan_members
from horovod.runner.elastic.remote import RemoteHosts, rendezvous_address
# The job's settings and outcome live in settings.py; importable from here as well, where the driver is.
from horovod.runner.elastic.settings import ElasticJobError, ElasticResult, ElasticSettings  # noqa: F401
from horovod.runner.elastic.settings import WorkerProcess, WorkerRecord as _Worker
# Importable from here too, where it was before the split.
from horovod.runner.elastic.workers import HOST_FAILURES_BEFORE_BLACKLIST, ElasticWorkers  # noqa: F401
from horovod.runner.exec import WorkerExit
from horovod.runner.hosts import HostInfo, is_local_host
from horovod.engine.teardown import CULPRIT_SCOPE
from horovod.runner.doctor_watch import HangWatch
from horovod.runner.job import JobSettings, job_env
from horovod.runner.output import OutputSink
from horovod.transport.rendezvous import MemoryStore, RendezvousServer

logger = logging.getLogger(__name__)

#: The original's wording, kept for callers that match it.
RESET_LIMIT_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"

#: Longest the driver sleeps before looking at the store again (workers announce readiness there).
_TICK = 0.2

#: Workers wait this much longer than the driver for an epoch, so that a driver timeout is what the user sees.
WORKER_TIMEOUT_MARGIN = 60


class ElasticDriver(ElasticWorkers):
    """Runs one elastic job; see the module docstring.

    Args:
        settings: the job.
        parent_env: the launcher's environment, inherited by the workers.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, settings: ElasticSettings, parent_env: Mapping[str, str],
                 clock: Callable[[], float] = time.monotonic):
        settings.validate()
        self.settings = settings
        self.parent_env = dict(parent_env)
        self._clock = clock
        self.blacklist = HostBlacklist(settings.cooldown_range, clock=clock)
        self._events: "queue.Queue[tuple]" = queue.Queue()
        self._stop = threading.Event()
        self._host_order: List[str] = []
        self._slots: Dict[str, int] = {}
        self._unlaunchable_warned: set = set()
        self._discovery_error: Optional[str] = None
        self._workers: Dict[str, _Worker] = {}
        self._all_procs: List[WorkerProcess] = []
        self._members: List[str] = []
        self._epoch = -1
        self._resets = 0
        self._hosts_version = 0
        self._bumped_for: Optional[frozenset] = None
        self._short_since: Optional[float] = None
        self._blamed_since: Dict[str, float] = {}   # worker id -> when the others were all waiting for it
        self._finishing = False
        self._failures: List[WorkerExit] = []
        self._host_failures: Dict[str, int] = {}   # since the host was last blacklisted
        self._late_failures: List[WorkerExit] = []   # failures after a worker had finished
        self._store: Optional[MemoryStore] = None
        self._sink: Optional[OutputSink] = None
        self._command: List[str] = []
        self._env: Dict[str, str] = {}
        self._remote: Optional[RemoteHosts] = None   # None: the launcher that made us starts the workers
        self._hang: Optional[HangWatch] = None   # the hang doctor: one dump directory, generations by file name

    # -- public ---------------------------------------------------------------------------------------
    @property
    def store(self) -> MemoryStore:
        """The rendezvous store of the running job (set by :meth:`run` before anything reads it)."""
        if self._store is None:
            raise RuntimeError("the elastic driver's store was used before run() started the rendezvous")
        return self._store

    def run(self, setup: Optional[Callable[[RendezvousServer], None]] = None) -> ElasticResult:
        """Run the job to its end.

        Args:
            setup: called with the running store before any worker starts.

        Raises:
            ElasticJobError: reset limit exceeded, too few slots within the elastic timeout, or a worker of the
                last epoch failed after others had finished.
        """
        s = self.settings
        secret = secrets.token_bytes(32)   # per job; reaches the workers only through their environment
        first: Optional[List[HostInfo]] = None
        host = s.rendezvous_host
        if s.accepts_host is None:
            # Where the store listens depends on the hosts: discover them first.  (A launcher with its own
            # starter, Spark or Ray, may discover through the store: it discovers once the store runs.)
            first = self._first_discovery()
            timeout = float(max(1, s.start_timeout))
            ssh_settings = ssh.SshSettings.create(s.ssh_port, s.ssh_identity_file)
            host, passed = rendezvous_address(first, s.discovery, ssh_settings, timeout, s.nics, s.rendezvous_host)
            self._remote = RemoteHosts(ssh_settings, timeout, passed)
        with RendezvousServer(secret, host=host) as server:
            self._store = server.store
            if self._remote is not None:
                self._remote.store_target = f"{server.host}:{server.port}"
            if setup is not None:
                setup(server)
            self._command = list(s.command(server.host, server.port) if callable(s.command) else s.command)
            base = JobSettings(num_proc=s.num_proc, hosts=[], command=self._command, knob_env=s.knob_env,
                               nics=s.nics, output_dir=s.output_dir, prefix_timestamp=s.prefix_timestamp,
                               start_timeout=s.start_timeout, extra_env=s.extra_env)
            self._env = job_env(self.parent_env, base, server.host, server.port, secret)
            self._env["HOROVOD_ELASTIC"] = "1"
            self._env["HOROVOD_ELASTIC_TIMEOUT"] = str(int(s.elastic_timeout) + WORKER_TIMEOUT_MARGIN)
            self._hang = HangWatch(server.store, self._env, {})
            self._env.update(self._hang.env())
            self._sink = OutputSink(max(s.max_np or 0, s.num_proc), prefix_timestamp=s.prefix_timestamp,
                                    output_dir=s.output_dir, stdout=s.stdout, stderr=s.stderr)
            logger.info("elastic job: rendezvous store at %s:%s; -np %d, --min-np %d, --max-np %s",
                        server.host, server.port, s.num_proc, s.min_np, s.max_np)
            self._on_hosts(first if first is not None else self._first_discovery())
            discovery = threading.Thread(target=self._discovery_loop, name="hvd-elastic-discovery", daemon=True)
            discovery.start()
            self._hang.start()
            try:
                return self._loop()
            except ElasticJobError as exc:
                raise self._hang.with_verdict(exc, f"the elastic job failed in epoch {self._epoch}") from None
            finally:
                self._hang.stop()
                self._stop.set()
                self._stop_workers(self._all_procs)
                self._sink.finish()

    # -- discovery ------------------------------------------------------------------------------------
    def _first_discovery(self) -> List[HostInfo]:
        try:
            return self.settings.discovery.find()
        except DiscoveryError as exc:
            # Usually a wrong path or a broken script: say so now rather than after the elastic timeout.
            raise ValueError(f"{exc} (the first host discovery must succeed)") from None

    def _discover_now(self) -> None:
        try:
            hosts = self.settings.discovery.find()
        except DiscoveryError as exc:
            self._events.put(("discovery_error", str(exc)))
            return
        if self._remote is not None:
            # Checks run in threads of their own; a host that passes is used from the next discovery on.
            self._remote.check([h.hostname for h in hosts])
        self._events.put(("hosts", hosts))

    def _discovery_loop(self) -> None:
        while not self._stop.wait(self.settings.discovery_interval):
            self._discover_now()

    def _on_hosts(self, hosts: List[HostInfo]) -> None:
        if self._discovery_error is not None:
            logger.warning("host discovery works again")
            self._discovery_error = None
        usable = []
        accepts = self._remote.usable if self._remote is not None else (self.settings.accepts_host or is_local_host)
        for host in hosts:
            if not accepts(host.hostname):
                # RemoteHosts says why for its hosts; a launcher's own test (Spark, Ray) is said here.
                if self._remote is None and host.hostname not in self._unlaunchable_warned:
                    self._unlaunchable_warned.add(host.hostname)
                    logger.warning("ignoring discovered host %s: this launcher cannot start workers there",
                                   host.hostname)
                continue
            usable.append(host)
        names = [h.hostname for h in usable]
        order = [n for n in self._host_order if n in names] + [n for n in names if n not in self._host_order]
        slots = {h.hostname: h.slots for h in usable}
        if order != self._host_order or slots != self._slots:
            logger.info("discovered hosts: %s", ", ".join(f"{n}:{slots[n]}" for n in order) or "none")
        self._host_order, self._slots = order, slots

    def _usable_hosts(self) -> List[HostInfo]:
        return [HostInfo(n, self._slots[n]) for n in self._host_order if not self.blacklist.is_blacklisted(n)]

    # -- main loop ------------------------------------------------------------------------------------
    def _loop(self) -> ElasticResult:
        while True:
            try:
                events = [self._events.get(timeout=_TICK)]
            except queue.Empty:
                events = []
            while True:
                try:
                    events.append(self._events.get_nowait())
                except queue.Empty:
                    break
            for event in events:
                self._handle(event)
            result = self._step()
            if result is not None:
                return result

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "hosts":
            self._on_hosts(event[1])
        elif kind == "discovery_error":
            if event[1] != self._discovery_error:
                logger.warning("%s; keeping the last known hosts", event[1])
            self._discovery_error = event[1]
        elif kind == "exit":
            self._on_exit(*event[1:])

    def _step(self) -> Optional[ElasticResult]:
        if self._finishing:
            return self._finish_if_done()
        self._fail_if_every_worker_failed()
        self._stop_frozen_members()
        s = self.settings
        alive = {w.wid for w in self._workers.values() if w.running and not w.removed}
        wanted = plan_members(self._members, self._usable_hosts(), alive, s.max_np)
        need = s.num_proc if self._epoch < 0 else s.min_np
        enough = len(wanted) >= need
        if enough:
            if self._short_since is not None:
                logger.warning("elastic: %d slots available again (need %d); continuing", len(wanted), need)
            self._short_since = None
        else:
            self._check_slot_timeout(len(wanted), need)
        self._stop_unwanted(set(wanted))
        if self._epoch >= 0:
            self._maybe_bump_hosts(wanted)
        if self._epoch >= 0 or enough:
            for index, wid in enumerate(wanted):
                self._ensure_started(wid, index)
        if enough and all(self._idle(wid) for wid in wanted):
            self._publish(wanted)
        return None

    def _check_slot_timeout(self, have: int, need: int) -> None:
        now = self._clock()
        flag = "-np" if self._epoch < 0 else "--min-np"
        if self._short_since is None:
            self._short_since = now
            logger.warning("elastic: only %d usable slots, need %s %d%s; waiting up to %.0f s for more", have, flag,
                           need, " to start" if self._epoch < 0 else "", self.settings.elastic_timeout)
            return
        if now - self._short_since <= self.settings.elastic_timeout:
            return
        hosts = ", ".join(f"{n}:{self._slots[n]}" for n in self._host_order) or "none"
        black = ", ".join(self.blacklist.blacklisted()) or "none"
        detail = f"; last discovery error: {self._discovery_error}" if self._discovery_error else ""
        raise ElasticJobError(
            f"Timed out after {self.settings.elastic_timeout:.0f} s waiting for {need} usable slots ({flag} {need}): "
            f"{have} available. Discovered hosts: {hosts}; blacklisted hosts: "
            f"{black}{detail}. Make more hosts available, lower {flag}, or raise --elastic-timeout.",
            first=self._failures[0] if self._failures else None, exits=self._failures)

    # -- epochs ---------------------------------------------------------------------------------------
    def _maybe_bump_hosts(self, wanted: List[str]) -> None:
        target = frozenset(wanted)
        if target == frozenset(self._members) or target == self._bumped_for:
            return
        removal_only = target < frozenset(self._members)
        self._hosts_version += 1
        self._bumped_for = target
        self.store.put((membership.SCOPE, "hosts"),
                        json.dumps({"version": self._hosts_version, "removal_only": removal_only}).encode())
        logger.info("hosts changed (version %d, %s): workers reset at their next commit", self._hosts_version,
                    "removals only" if removal_only else "additions")

    def _publish(self, order: List[str]) -> None:
        if self._epoch >= 0:
            limit = self.settings.reset_limit
            if limit is not None and self._resets >= limit:
                raise ElasticJobError(RESET_LIMIT_MESSAGE.format(limit),
                                      first=self._failures[0] if self._failures else None, exits=self._failures)
            self._resets += 1
        epoch = self._epoch + 1
        ranks = assign_ranks(order)
        kept = set(order)
        removed = sorted({w for w in self._members if w not in kept} |
                         {w.wid for w in self._workers.values() if w.running and w.wid not in kept})
        doc = {"epoch": epoch, "hosts_version": self._hosts_version,
               "workers": {wid: list(layout) for wid, layout in ranks.items()}, "removed": removed}
        # Workers left out learn it from the assignment and may exit at once, with an error if they were still
        # in their first init(): mark them first, so that their exit is not taken for a failure.
        for worker in self._workers.values():
            if worker.running and worker.wid not in kept:
                self._remove(worker, f"it is not part of epoch {epoch}")
        if self._hang is not None:   # before the workers learn the epoch: their announcements are of the new one
            self._hang.new_generation(epoch, {rank: host_of(wid) for rank, wid in enumerate(order)})
        self.store.put((membership.SCOPE, "assignment"), json.dumps(doc).encode())
        self.store.clear_scope(CULPRIT_SCOPE)   # reports name ranks of the epoch that just ended
        for wid in order:
            self._workers[wid].last_epoch = epoch
        previous = len(self._members)
        self._members, self._epoch = list(order), epoch
        self._bumped_for = None
        if epoch == 0:
            logger.info("elastic: epoch 0 with %d workers: %s", len(order), ", ".join(order))
        else:
            logger.warning("elastic: reset %d: epoch %d with %d workers (was %d): %s", self._resets, epoch,
                           len(order), previous, ", ".join(order))

    def _finish_if_done(self) -> Optional[ElasticResult]:
        """Once a worker finished: wait for every busy worker to exit; workers waiting for an epoch are stopped."""
        if any(w.running and not w.removed and not self._idle(w.wid) for w in self._workers.values()):
            return None
        members = [self._workers[w] for w in self._members]
        failed = [WorkerExit(m.label, m.host, m.exit_code) for m in members
                  if m.exit_code not in (None, 0) and not m.removed]
        failed += [f for f in self._late_failures if f not in failed]
        for worker in self._workers.values():
            if worker.running:
                self._remove(worker, "the job has finished")
        if failed:
            raise ElasticJobError(f"{_exec.FAILURE_HEADLINE}\n{failed[0].describe()}", first=failed[0],
                                  exits=failed)
        logger.info("elastic job finished after %d resets", self._resets)
        return ElasticResult(list(self._members), self._epoch + 1, self._resets, self.store)

