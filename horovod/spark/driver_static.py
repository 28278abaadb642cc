"""``horovod.spark.run``'s job: ``num_proc`` Spark tasks in one barrier stage, one Horovod rank each.

1. The driver starts the job's authenticated rendezvous store (per-job secret) on the address the executors
   reach it at, and puts the cloudpickled function there (:mod:`horovod.runner.run_task`'s scope).
2. Once the cluster offers ``num_proc`` slots, one barrier stage of ``num_proc`` tasks is submitted, so all
   ranks are scheduled together or not at all. Every task registers its host id with the store.
3. With every task registered (within ``start_timeout``), ranks are laid out like ``horovodrun`` does: the
   tasks of one host get consecutive ranks (:func:`horovod.runner.hosts.get_host_assignments`), so ranks of
   one host use shared memory and hosts talk over tcp / hierarchical. Each task gets its command and the
   job environment (:func:`horovod.runner.job.job_env` + the slot's variables + ``OMP_NUM_THREADS``).
4. Each task runs ``python -m horovod.runner.run_task`` as a child and forwards its output; the driver prints
   it with ``[rank]<stdout>:`` tags. The first failure (a traceback reported by a rank, a non-zero exit, a
   lost task) aborts the job at once: every task stops its worker, the job group is cancelled (no Spark
   retries), and the error names the rank and carries its traceback.
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence


from horovod.runner.doctor_watch import HangWatch
from horovod.runner.exec import JobFailedError, WorkerExit
from horovod.runner.hosts import HostInfo, get_host_assignments
from horovod.runner.job import JobSettings, culprit_text, job_env
from horovod.runner.output import OutputSink
from horovod.runner.run_task import ERROR_SCOPE, FUNC_KEY, FUNC_SCOPE, results_by_rank, tracebacks
from horovod.runner.threads import set_worker_threads
import horovod.spark.driver as sd
import horovod.spark.task_protocol as proto
from horovod.spark.driver_output import OutputRelay
from horovod.spark.task import TaskSpec, barrier_partition
from horovod.transport.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)

#: Seconds between two looks at the store while the job runs.
POLL_INTERVAL = 0.1
#: Seconds the driver waits for the tasks to stop their workers after an abort.
STOP_WAIT = 20.0


def layout(hosts_by_index: Sequence[str]) -> List[tuple]:
    """``[(slot, task index)]`` in rank order: hosts in the order their first task appears, ranks of one host
    consecutive, lower task indices first (task 0 is always rank 0)."""
    order: Dict[str, List[int]] = {}
    for index, host in enumerate(hosts_by_index):
        order.setdefault(host, []).append(index)
    slots = get_host_assignments([HostInfo(h, len(ix)) for h, ix in order.items()], len(hosts_by_index))
    cursor = {h: iter(ix) for h, ix in order.items()}
    return [(slot, next(cursor[slot.hostname])) for slot in slots]


class StaticSparkJob:
    """One ``horovod.spark.run`` call (see the module docstring)."""

    def __init__(self, sc, num_proc: int, start_timeout: float, env: Mapping[str, str], nics: Sequence[str] = (),
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None, prefix_timestamp: bool = False,
                 executable: Optional[str] = None, verbose: int = 1, host_per_executor: bool = False):
        self.sc = sc
        self.host_per_executor = host_per_executor
        self.verbose = verbose
        self.num_proc = num_proc
        self.start_timeout = start_timeout
        self.env = dict(env)
        self.nics = list(nics)
        self.executable = executable or proto.TASK_PYTHON
        self.sink = OutputSink(num_proc, prefix_timestamp=prefix_timestamp, stdout=stdout, stderr=stderr)
        self._slots: List[tuple] = []
        self._hang: Optional[HangWatch] = None   # the hang doctor's collection, once the workers are placed
        self._beats = proto.HeartbeatWatch()

    # -- the whole run ----------------------------------------------------------------------------------
    def run(self, payload: bytes) -> List[Any]:
        secret = secrets.token_bytes(32)   # per job; reaches the tasks only inside Spark's closure, never logged
        addr = sd.driver_address(self.sc, self.nics)
        deadline = time.monotonic() + self.start_timeout
        with RendezvousServer(secret, host=addr) as server:
            store = server.store
            store.put((FUNC_SCOPE, FUNC_KEY), payload)
            spec = TaskSpec(server.host, server.port, secret, elastic=False,
                            command_timeout=self.start_timeout + 60.0, host_per_executor=self.host_per_executor)
            barrier = not sd.dynamic_allocation(self.sc)
            if barrier:
                sd.wait_for_slots(self.sc, self.num_proc, deadline, self.start_timeout)
            else:
                logger.warning("horovod.spark: dynamic allocation is on, which barrier stages do not support; the "
                               "tasks run as a plain stage and the job starts once all %d have registered",
                               self.num_proc)
            n = self.num_proc

            def rdd(sc):
                base = sc.parallelize(range(n), n)
                return (base.barrier() if barrier else base).mapPartitions(barrier_partition(spec))

            job = sd.SparkJobThread(self.sc, f"Horovod Spark Run ({n} processes)", rdd).start()
            relay = OutputRelay(self.sink, lambda s, k: store.get((s, k)), lambda s, k: store.delete((s, k)))
            success = False
            try:
                hosts = self._wait_for_registration(store, job, deadline)
                self._start_workers(store, hosts, server.host, server.port, secret, relay)
                results = self._watch(store, job)
                success = True
                return results
            finally:
                if not success:
                    store.put((proto.ABORT_SCOPE, proto.ABORT_KEY), b"the driver stopped the job")
                    self._wait_for_exits(store, job)
                    job.cancel()
                if not job.join(STOP_WAIT if success else 10.0):
                    job.cancel()
                    job.join(10.0)
                relay.close()
                if self._hang is not None:
                    self._hang.stop()

    # -- steps ----------------------------------------------------------------------------------------
    def _wait_for_registration(self, store, job: sd.SparkJobThread, deadline: float) -> List[str]:
        while True:
            tasks = store.scope(proto.TASK_SCOPE)
            if len(tasks) >= self.num_proc:
                return [proto.load(tasks[str(i)])["host"] for i in range(self.num_proc)]
            if job.done:
                raise RuntimeError(f"the Spark job of horovod.spark.run ended before all {self.num_proc} tasks "
                                   f"started ({len(tasks)} did): {job.failure_text()}")
            if time.monotonic() > deadline:
                raise sd.timeout_error("tasks did not all start", len(tasks), self.num_proc,
                                       sd.available_slots(self.sc), self.start_timeout)
            time.sleep(POLL_INTERVAL)

    def _start_workers(self, store, hosts: List[str], addr: str, port: int, secret: bytes,
                       relay: OutputRelay) -> None:
        self._slots = layout(hosts)
        settings = JobSettings(num_proc=self.num_proc, hosts=[], command=[], nics=self.nics,
                               start_timeout=int(self.start_timeout))
        settings.extra_env["PYTHONPATH"] = sd.worker_pythonpath(self.env)
        base = job_env(self.env, settings, addr, port, secret)
        self._hang = HangWatch(store, base, {slot.rank: slot.hostname for slot, _ in self._slots})
        base.update(self._hang.env())
        self._hang.start()
        command = [self.executable, "-m", "horovod.runner.run_task", addr, str(port)]
        logger.log(logging.INFO if self.verbose >= 2 else logging.DEBUG, "horovod.spark: %d ranks on %d hosts: %s",
                   self.num_proc, len(set(hosts)),
                   ", ".join(f"rank {slot.rank} = task {index} on {slot.hostname}" for slot, index in self._slots))
        for slot, index in self._slots:
            env = dict(base)
            env.update(slot.env())
            set_worker_threads(env, slot.local_size)
            relay.attach(str(index), slot.rank)
            store.put((proto.CMD_SCOPE, str(index)), proto.command_doc(command, env))

    def _watch(self, store, job: sd.SparkJobThread) -> List[Any]:
        """Wait for every rank to finish; the first failure stops the job."""
        rank_of = {str(index): slot.rank for slot, index in self._slots}
        host_of = {slot.rank: slot.hostname for slot, _ in self._slots}
        first_attempts = {k: proto.load(v) for k, v in store.scope(proto.TASK_SCOPE).items()}
        while True:
            exits = {rank_of[k]: int(v) for k, v in store.scope(proto.EXIT_SCOPE).items() if k in rank_of}
            errors = store.scope(ERROR_SCOPE)
            failed = sorted(r for r, code in exits.items() if code != 0)
            if errors or failed:
                rank = int(next(iter(errors))) if errors else failed[0]
                raise self._failure(store, rank, host_of[rank])
            if len(exits) == self.num_proc:
                return self._results(store)
            lost = self._lost_task(store, first_attempts, exits, rank_of)
            if lost is not None:
                rank, why = lost
                raise JobFailedError(WorkerExit(rank, host_of[rank], -9), details=why)
            if job.done and len(store.scope(proto.EXIT_SCOPE)) < self.num_proc:
                time.sleep(1.0)   # the last exit statuses may still be on their way
                if len(store.scope(proto.EXIT_SCOPE)) < self.num_proc:
                    raise RuntimeError(f"the Spark job of horovod.spark.run ended before every rank finished: "
                                       f"{job.failure_text()}")
            time.sleep(POLL_INTERVAL)

    def _lost_task(self, store, first_attempts, exits, rank_of) -> Optional[tuple]:
        now = time.monotonic()
        for key, raw in store.scope(proto.TASK_SCOPE).items():
            doc = proto.load(raw)
            if doc != first_attempts.get(key) and rank_of[key] not in exits:
                return rank_of[key], (f"Spark restarted task {key} (attempt {doc['attempt']}): the Python worker or "
                                      f"the executor running rank {rank_of[key]} was lost")
        for key, rank in rank_of.items():
            if rank in exits:
                continue
            if self._beats.silent(store, key, now):
                return rank, (f"the Spark task running rank {rank} (task {key}) sent no heartbeat for "
                              f"{proto.BEAT_TIMEOUT:.0f} s: its Python worker or executor was lost")
        return None

    def _failure(self, store, rank: int, host: str) -> JobFailedError:
        deadline = time.monotonic() + 5.0
        index = next(i for slot, i in self._slots if slot.rank == rank)
        raw = store.get((proto.EXIT_SCOPE, str(index)))
        while raw is None and time.monotonic() < deadline:   # it reported its traceback and is exiting now
            time.sleep(POLL_INTERVAL)
            raw = store.get((proto.EXIT_SCOPE, str(index)))
        first = WorkerExit(rank, host, int(raw) if raw is not None else 1)
        if self._hang is not None:   # collect the other ranks' dumps before the job is stopped
            self._hang.before_stop(first)
        parts = [culprit_text(first, store), tracebacks(store, rank),
                 self._hang.failure_text() if self._hang is not None else ""]
        return JobFailedError(first, details="\n".join(p for p in parts if p))

    def _results(self, store) -> List[Any]:
        return results_by_rank(store, self.num_proc, "horovod.spark.run()")

    def _wait_for_exits(self, store, job: sd.SparkJobThread) -> None:
        """After an abort: give the tasks that started a worker the time to stop it (no stray processes).

        A task that is gone (Spark started another attempt, or no heartbeat for a few seconds) is not waited
        for: its worker died with it.
        """
        started = set(store.scope(proto.CMD_SCOPE))
        first = {k: store.get((proto.TASK_SCOPE, k)) for k in started}
        beats = {k: (store.get((proto.BEAT_SCOPE, k)), time.monotonic()) for k in started}
        deadline = time.monotonic() + STOP_WAIT
        while time.monotonic() < deadline and not job.done:
            now = time.monotonic()
            pending = []
            for key in started - set(store.scope(proto.EXIT_SCOPE)):
                beat = store.get((proto.BEAT_SCOPE, key))
                if beat != beats[key][0]:
                    beats[key] = (beat, now)
                silent = now - beats[key][1] > 3 * proto.BEAT_INTERVAL
                if store.get((proto.TASK_SCOPE, key)) == first[key] and not silent:
                    pending.append(key)
            if not pending:
                return
            time.sleep(POLL_INTERVAL)
