"""Elastic jobs of ``RayExecutor(min_workers=..., max_workers=...)``.

``run(fn)`` starts one actor per slot of the usable Ray nodes (up to ``max_workers``), each running ``fn``,
which trains under ``hvd.elastic.run``.  When an actor or a whole node dies, the survivors restore their last
commit and continue in a new epoch; when Ray gains nodes (more CPUs), new actors join at the next commit.
The driver side is the project's elastic driver (:mod:`horovod.ray.elastic_driver`).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray

from horovod.ray import ray_logger
from horovod.ray.discovery import RayHostDiscovery, TestDiscovery
from horovod.ray.elastic_driver import RayElasticDriver
from horovod.ray.settings import MiniSettings, knob_env_from, rendezvous_bind_host
from horovod.ray.strategy import worker_resources
from horovod.runner.elastic.blacklist import validate_cooldown_range
from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.driver import ElasticJobError, ElasticSettings
from horovod.engine import config

logger = logging.getLogger(__name__)

__all__ = ["ElasticAdapter", "RayHostDiscovery", "TestDiscovery"]


class ElasticAdapter:
    """What an elastic :class:`~horovod.ray.RayExecutor` delegates to (arguments as the executor's)."""

    def __init__(self, settings: MiniSettings, min_workers: int = 1, max_workers: Optional[int] = None,
                 cpus_per_worker: float = 1, use_gpu: bool = False, gpus_per_worker: Optional[float] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence[int]] = None,
                 elastic_timeout: float = 600, override_discovery: bool = True,
                 env_vars: Optional[Dict[str, Any]] = None):
        if min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {min_workers}")
        if max_workers is not None and max_workers < min_workers:
            raise ValueError(f"max_workers ({max_workers}) is below min_workers ({min_workers})")
        validate_cooldown_range(list(cooldown_range) if cooldown_range is not None else None)
        self.settings = settings
        self.min_workers, self.max_workers = min_workers, max_workers
        self.resources = worker_resources(cpus_per_worker, use_gpu, gpus_per_worker)
        self.reset_limit = reset_limit
        self.cooldown_range = (int(cooldown_range[0]), int(cooldown_range[1])) if cooldown_range is not None else None
        self.elastic_timeout = elastic_timeout
        self.env_vars = {k: str(v) for k, v in (env_vars or {}).items()}
        if override_discovery or settings.discovery is None:
            self.discovery: HostDiscovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_slot=cpus_per_worker,
                                                             gpus_per_slot=gpus_per_worker or 1)
        else:
            self.discovery = _as_host_discovery(settings.discovery)
        self.driver: Optional[RayElasticDriver] = None
        self._started = False
        self._queue = None

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None,
              extra_env_vars: Optional[Dict[str, Any]] = None) -> None:
        """Check Ray is up; workers start with each :meth:`run` (elastic jobs have no long-lived executable)."""
        if executable_cls is not None:
            raise NotImplementedError("elastic jobs start fresh actors for every run(); executable_cls is only for "
                                      "static jobs (num_workers / num_hosts)")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init() (or ray.init(address='auto') to join a "
                               "running cluster) before start()")
        self.env_vars.update({k: str(v) for k, v in (extra_env_vars or {}).items()})
        self._started = True

    def run(self, fn: Callable, args: Optional[list] = None, kwargs: Optional[dict] = None,
            callbacks: Optional[Sequence[Callable]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` as an elastic job; what the last epoch's ranks returned, in rank order.

        Raises:
            horovod.runner.elastic.driver.ElasticJobError: the reset limit was exceeded, too few slots for longer
                than ``elastic_timeout``, or workers of the last epoch failed.
        """
        if not self._started:
            raise RuntimeError("run(): call start() first")
        call = _Bound(fn, args, kwargs)
        settings = ElasticSettings(
            num_proc=self.min_workers, min_np=self.min_workers, max_np=self.max_workers, command=[],
            discovery=self.discovery, elastic_timeout=float(self.elastic_timeout), reset_limit=self.reset_limit,
            cooldown_range=self.cooldown_range, knob_env=knob_env_from(dict(config.environ())),
            nics=list(self.settings.nics or []), start_timeout=int(self.settings.timeout_s),
            extra_env=dict(self.env_vars), rendezvous_host=rendezvous_bind_host(self.settings.nics))
        queue = self._ensure_queue() if callbacks else None
        self.driver = RayElasticDriver(settings, call, self.resources, queue=queue)
        stop = threading.Event()
        pump = None
        if callbacks:
            pump = threading.Thread(target=_pump, args=(queue, list(callbacks), stop), name="hvd-ray-callbacks",
                                    daemon=True)
            pump.start()
        try:
            result = self.driver.run()
        except ElasticJobError as exc:
            # The driver speaks horovodrun's flags; say what they are called here.
            exc.add_note(f"(on Ray: -np/--min-np is min_workers={self.min_workers}, --max-np is max_workers="
                         f"{self.max_workers}, --elastic-timeout is elastic_timeout={self.elastic_timeout}; a Ray "
                         f"node has CPU // {self.resources['CPU']:g} slots)")
            raise
        finally:
            stop.set()
            if pump is not None:
                pump.join(timeout=5)
        return self.driver.results(result.members)

    def _ensure_queue(self):
        if self._queue is None:
            self._queue = ray_logger.driver_queue()
        return self._queue

    def shutdown(self) -> None:
        ray_logger.close_queue(self._queue)
        self._queue = None
        self._started = False


def _pump(queue, callbacks: List[Callable], stop: threading.Event) -> None:
    """Hand rank 0's logged values to the callbacks until the job ends (then once more)."""
    while True:
        finished = stop.wait(0.1)
        try:
            while not queue.empty():
                value = queue.get_nowait()
                for callback in callbacks:
                    callback(value)
        except Exception:   # noqa: BLE001 - a broken callback or queue must not take the job down
            logger.exception("elastic Ray job: callbacks stopped")
            return
        if finished:
            return


class _Bound:
    def __init__(self, fn: Callable, args: Optional[list], kwargs: Optional[dict]):
        self.fn, self.args, self.kwargs = fn, list(args or []), dict(kwargs or {})

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)


class _HostsAndSlots(HostDiscovery):
    """Adapts an object with ``find_available_hosts_and_slots()`` (the original's interface) to the driver's."""

    def __init__(self, source):
        self.source = source

    def find(self):
        from horovod.runner.hosts import HostInfo

        return [HostInfo(h, int(n)) for h, n in self.source.find_available_hosts_and_slots().items() if int(n) > 0]


def _as_host_discovery(source) -> HostDiscovery:
    if isinstance(source, HostDiscovery):
        return source
    if hasattr(source, "find_available_hosts_and_slots"):
        return _HostsAndSlots(source)
    raise TypeError(f"settings.discovery must have find_available_hosts_and_slots() (e.g. RayHostDiscovery), "
                    f"got {type(source).__name__}")
