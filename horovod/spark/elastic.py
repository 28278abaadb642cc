"""``horovod.spark.run_elastic``'s job: the project's elastic driver, with Spark tasks as its hosts.

- ``max_num_proc`` Spark tasks run as a plain (not barrier) stage, so they come and go one by one. Every task
  attempt registers in the job's store as a host of one slot (``spark-task-<index>-<attempt>-<nonce>``), as in
  the original, where each task attempt was a host of its own.
- :class:`SparkTaskDiscovery` reports the tasks that are alive and have not run a worker to its end; the
  :class:`~horovod.runner.elastic.driver.ElasticDriver` (unchanged) decides epochs, ranks, blacklisting and
  resets exactly as for ``horovodrun --host-discovery-script``.
- The driver starts workers through the ``spark`` starter registered here: a local proxy process
  (:mod:`horovod.spark.elastic_proxy`) that has the task run the worker and stands for it (output, exit
  status, SIGTERM), so the driver's supervision works as for local processes.
- When a task's Python worker or executor dies, its Horovod worker dies with it (parent-death signal), the
  survivors restore their last commit, the proxy reports the loss, and Spark retries the task, whose new attempt
  joins as a new host.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import IO, Any, List, Mapping, Optional, Sequence

import cloudpickle

import horovod.spark.driver as sd
import horovod.spark.task_protocol as proto
from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.driver import ElasticDriver, ElasticSettings
from horovod.runner.elastic.launch import RESULT_SCOPE, _ElasticTask, elastic_timeout as resolve_elastic_timeout
from horovod.runner.exec import WorkerSpec, die_with_launcher, register_starter
from horovod.runner.hosts import HostInfo
from horovod.runner.run_task import FUNC_KEY, FUNC_SCOPE
from horovod.spark.task import TaskSpec, elastic_partition
from horovod.transport.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)


def is_spark_task_host(hostname: str) -> bool:
    return hostname.startswith(proto.ELASTIC_HOST_PREFIX)


def start_proxy(spec: WorkerSpec) -> subprocess.Popen:
    """The ``spark`` starter: a local proxy process for a worker that runs in the Spark task ``spec.hostname``."""
    command = [sys.executable, "-m", "horovod.spark.elastic_proxy", *spec.command]
    return subprocess.Popen(command, env=spec.env, cwd=spec.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_launcher())


register_starter("spark", is_spark_task_host, start_proxy, priority=10)


class SparkTaskDiscovery(HostDiscovery):
    """The Spark tasks that can run (or are running) a worker: registered, heartbeat fresh, not yet finished.

    The first call waits up to ``start_timeout`` for ``num_proc`` tasks (the original's start-timeout error).
    """

    def __init__(self, sc, num_proc: int, start_timeout: float):
        self.sc = sc
        self.num_proc = num_proc
        self.start_timeout = start_timeout
        self.server: Optional[RendezvousServer] = None
        self.job: Optional[sd.SparkJobThread] = None
        self._first = True
        self._beats = proto.HeartbeatWatch()

    def live_tasks(self) -> List[dict]:
        if self.server is None:
            raise RuntimeError("SparkTaskDiscovery: asked for tasks before the job's store was set")
        store = self.server.store
        now = time.monotonic()
        latest = {k: proto.load(v) for k, v in store.scope(proto.ATTEMPT_SCOPE).items()}
        finished = set(store.scope(proto.EXIT_SCOPE)) | set(store.scope(proto.KILL_SCOPE))
        live = []
        for key, raw in store.scope(proto.TASK_SCOPE).items():
            doc = proto.load(raw)
            if key in finished or latest.get(str(doc["index"]), doc)["host"] != doc["host"]:
                continue
            if self._beats.silent(store, key, now):
                continue
            live.append(doc)
        return sorted(live, key=lambda d: (d["index"], d["attempt"]))

    def find(self) -> List[HostInfo]:
        if self._first:
            self._first = False
            deadline = time.monotonic() + self.start_timeout
            while len(self.live_tasks()) < self.num_proc:
                if self.job is not None and self.job.done:
                    raise RuntimeError(f"the Spark job of horovod.spark.run_elastic ended before {self.num_proc} "
                                       f"tasks started: {self.job.failure_text()}")
                if time.monotonic() > deadline:
                    raise sd.timeout_error("tasks did not all start", len(self.live_tasks()), self.num_proc,
                                           sd.available_slots(self.sc), self.start_timeout)
                time.sleep(0.1)
        return [HostInfo(doc["host"], 1) for doc in self.live_tasks()]


class ElasticSparkJob:
    """One ``horovod.spark.run_elastic`` call (see the module docstring)."""

    def __init__(self, sc, num_proc: int, min_np: int, max_np: int, start_timeout: float,
                 elastic_timeout: Optional[float], reset_limit: Optional[int], env: Mapping[str, str],
                 nics: Sequence[str] = (), stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
                 prefix_timestamp: bool = False):
        if not min_np <= num_proc <= max_np:
            raise ValueError(f"horovod.spark.run_elastic(): need min_num_proc <= num_proc <= max_num_proc, got "
                             f"{min_np}, {num_proc}, {max_np}")
        self.sc = sc
        self.env = dict(env)
        self.max_np = max_np
        self.discovery = SparkTaskDiscovery(sc, num_proc, start_timeout)
        self.addr = sd.driver_address(sc, nics)

        def command(addr: str, port: int) -> List[str]:
            return [proto.TASK_PYTHON, "-m", "horovod.runner.run_task", addr, str(port)]

        self.settings = ElasticSettings(
            num_proc=num_proc, min_np=min_np, max_np=max_np, command=command, discovery=self.discovery,
            elastic_timeout=float(resolve_elastic_timeout(None, self.env) if elastic_timeout is None
                                  else elastic_timeout), reset_limit=reset_limit,
            nics=list(nics), prefix_timestamp=prefix_timestamp, start_timeout=int(start_timeout),
            rendezvous_host=self.addr, accepts_host=is_spark_task_host, stdout=stdout, stderr=stderr)
        self.settings.extra_env["PYTHONPATH"] = sd.worker_pythonpath(self.env)

    def _setup(self, payload: bytes):
        def setup(server: RendezvousServer) -> None:
            server.store.put((FUNC_SCOPE, FUNC_KEY), cloudpickle.dumps(_ElasticTask(payload)))
            spec = TaskSpec(server.host, server.port, server.secret, elastic=True)
            n = self.max_np

            def rdd(sc):
                return sc.parallelize(range(n), n).mapPartitions(elastic_partition(spec))

            self.discovery.server = server
            self.discovery.job = sd.SparkJobThread(self.sc, f"Horovod Spark Run Elastic (up to {n} processes)",
                                                   rdd).start()
        return setup

    def run(self, payload: bytes) -> List[Any]:
        try:
            result = ElasticDriver(self.settings, self.env).run(setup=self._setup(payload))
        finally:
            job = self.discovery.job
            if job is not None:
                # Tasks still waiting for work (or whose driver store just closed) have nothing left to do.
                if not job.join(10.0):
                    job.cancel()
                    job.join(30.0)
        stored = result.store.scope(RESULT_SCOPE)
        out = []
        for rank, wid in enumerate(result.members):
            raw = stored.get(wid)
            if raw is None:
                raise RuntimeError(f"horovod.spark.run_elastic(): rank {rank} ({wid}) of the last epoch exited "
                                   f"successfully but reported no result; the function must return normally on "
                                   f"every rank")
            out.append(cloudpickle.loads(raw))
        return out
