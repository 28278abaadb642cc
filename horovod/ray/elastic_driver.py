"""The project's elastic driver, with Ray actors instead of processes.

:class:`~horovod.runner.elastic.driver.ElasticDriver` decides everything (which workers, which ranks, when to
reset, blacklisting, the reset limit) and talks to the workers only through the rendezvous store.  This subclass
changes how a worker starts and stops — an actor pinned to its Ray node instead of a local process — and where
the store listens (``settings.rendezvous_host``: the driver's Ray node address instead of loopback, so actors on
other machines reach it).

An :class:`ActorProcess` looks like the ``subprocess.Popen`` the driver expects: its "exit code" is 0 when the
function returned, 1 when it raised, -9 when the actor died (killed, or its node went away).
"""
from __future__ import annotations

import logging
import re
import subprocess
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod.ray.worker import BaseHorovodWorker
from horovod.runner.elastic.driver import ElasticDriver, ElasticSettings
from horovod.runner.elastic.settings import WorkerProcess
from horovod.runner.exec import WorkerSpec

logger = logging.getLogger(__name__)

#: Exit code of a worker whose actor died (as if killed by SIGKILL).
ACTOR_DIED = -9

_NODE_ID = re.compile(r"^[0-9a-f]{56}$")


def actor_placement(host: str, resources: Dict[str, float]) -> Dict[str, Any]:
    """Ray options that start a worker on ``host``: a node id (from :class:`RayHostDiscovery`) or a node address."""
    options: Dict[str, Any] = {"num_cpus": resources.get("CPU", 1), "num_gpus": resources.get("GPU", 0)}
    if _NODE_ID.match(host):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=host, soft=False)
    else:
        options["resources"] = {f"node:{host}": 0.01}
    return options


def any_host(hostname: str) -> bool:
    """Workers can start on every Ray node the discovery reports."""
    return True


class ActorProcess:
    """One elastic worker: an actor running ``func`` (duck-types the parts of ``subprocess.Popen`` the driver uses)."""

    stdout = None   # Ray forwards the actors' output to the driver itself
    stderr = None

    def __init__(self, actor, ref, wid: str):
        self.actor = actor
        self.wid = wid
        self.pid = f"actor {wid}"
        self.returncode: Optional[int] = None
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self._ref = ref
        self._lock = threading.Lock()

    @classmethod
    def start(cls, wid: str, env: Dict[str, str], func: Callable[[], Any], options: Dict[str, Any],
              queue=None) -> "ActorProcess":
        actor: Any = ray.remote(BaseHorovodWorker).options(**options).remote(int(env["HOROVOD_RANK"]),
                                                                              int(env["HOROVOD_SIZE"]))
        actor.update_env_vars.remote(env)
        if queue is not None:
            actor.set_queue.remote(queue)
        return cls(actor, actor.run_elastic.remote(func), wid)

    def _collect(self) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            try:
                code, self.result = ray.get(self._ref)
            except ray.exceptions.RayActorError as exc:
                code, self.error = ACTOR_DIED, exc
            except Exception as exc:   # noqa: BLE001 - the function raised: the worker "exits" with 1
                code, self.error = 1, exc
                logger.warning("elastic worker %s failed:\n%s", self.wid, exc)
            self.returncode = code

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            ready, _ = ray.wait([self._ref], timeout=0)
            if ready:
                self._collect()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            ready, _ = ray.wait([self._ref], timeout=timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.pid, timeout or 0.0)
            self._collect()
        assert self.returncode is not None   # _collect() sets it
        return self.returncode

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:   # noqa: BLE001 - already gone
            pass

    terminate = kill


class RayElasticDriver(ElasticDriver):
    """:class:`ElasticDriver` whose workers are actors running ``func``.

    Args:
        settings: the job (``command`` is unused).
        func: what every worker runs (it calls ``hvd.init()`` and trains under ``hvd.elastic.run``).
        resources: Ray resources of one worker (``{"CPU": c}``, plus ``"GPU"``).
        queue: a ``ray.util.queue.Queue`` for :mod:`horovod.ray.ray_logger`, or ``None``.
    """

    def __init__(self, settings: ElasticSettings, func: Callable[[], Any], resources: Dict[str, float],
                 queue=None):
        # Every discovered Ray node is usable: workers reach the store over the network, not through loopback.
        settings.accepts_host = settings.accepts_host or any_host
        super().__init__(settings, parent_env={})
        self._func = func
        self._resources = dict(resources)
        self._queue = queue

    def results(self, members: List[str]) -> List[Any]:
        """What the functions of ``members`` returned, in that order."""
        return [self._actor(wid).result for wid in members]

    def worker_actors(self) -> Dict[str, Any]:
        """``{worker id: actor handle}`` of the workers still running (e.g. to inspect or kill one)."""
        return {wid: self._actor(wid).actor for wid, w in list(self._workers.items())
                if w.running and w.proc.poll() is None}

    def current_members(self) -> List[str]:
        """Worker ids of the current epoch, by rank."""
        return list(self._members)

    def _actor(self, wid: str) -> ActorProcess:
        return cast(ActorProcess, self._workers[wid].proc)   # _start_worker starts nothing else

    # -- how workers start and stop: actors, not processes (an actor's pid may belong to another machine) --------
    def _start_worker(self, wid: str, spec: WorkerSpec) -> ActorProcess:
        return ActorProcess.start(wid, spec.env, self._func, actor_placement(spec.hostname, self._resources),
                                  self._queue)

    def _stop_workers(self, procs: Sequence[WorkerProcess]) -> None:
        for proc in procs:
            cast(ActorProcess, proc).kill()
