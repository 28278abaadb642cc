"""``RayExecutor``: a Horovod job whose workers are Ray actors.

The executor reserves a placement group, starts one :class:`~horovod.ray.worker.BaseHorovodWorker` actor per
worker, numbers them node by node (ranks of one Ray node are consecutive and talk through shared memory, ranks
on different nodes over TCP), serves the job's authenticated rendezvous store from the calling process, and
writes each actor's ``HOROVOD_*`` variables — the same ones ``horovodrun`` gives a worker process — into the actor
before any function runs.  The functions call ``hvd.init()`` themselves, as with the original.

With ``min_workers`` / ``max_workers`` the executor runs elastic jobs instead (:mod:`horovod.ray.elastic_v2`).
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import ray

from horovod.common.exceptions import HorovodInternalError
from horovod.engine import config
from horovod.ray import ray_logger
from horovod.ray.settings import MiniSettings, knob_env_from, rendezvous_bind_host
from horovod.ray.strategy import ColocatedStrategy, PackStrategy, Placement, worker_resources
from horovod.ray.worker import BaseHorovodWorker
from horovod.runner.doctor_watch import HangWatch
from horovod.runner.hosts import HostInfo, SlotInfo, get_host_assignments
from horovod.runner.job import JobSettings, job_env
from horovod.runner.threads import set_worker_threads
from horovod.transport.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)

#: After one rank failed, how long to wait for the others' outcome, to report the cause rather than a witness.
FAILURE_GRACE_S = 10.0


class Coordinator:
    """Turns the nodes the actors landed on into Horovod ranks.

    Ranks are numbered node by node (nodes in the order of their first actor, actors in start order), so that
    the ranks of one node are consecutive; local and cross ranks follow :func:`get_host_assignments`.
    """

    def __init__(self, settings: MiniSettings):
        self.settings = settings
        self._node_of_worker: Dict[int, str] = {}

    def register(self, hostname: str, node_id: str, world_rank: int) -> None:
        """Record that the actor started as ``world_rank`` runs on ``node_id`` (``hostname`` is its host name)."""
        self._node_of_worker[world_rank] = node_id

    @property
    def world_size(self) -> int:
        return len(self._node_of_worker)

    def finalize_registration(self) -> Dict[int, SlotInfo]:
        """``{actor index: its slot}``; the slot's ``rank`` is the actor's Horovod rank."""
        per_node: Dict[str, List[int]] = {}
        for index in sorted(self._node_of_worker):
            per_node.setdefault(self._node_of_worker[index], []).append(index)
        hosts = [HostInfo(node, len(indices)) for node, indices in per_node.items()]
        slots = get_host_assignments(hosts, self.world_size)
        order = [index for indices in per_node.values() for index in indices]
        return {index: slot for index, slot in zip(order, slots)}


class RayExecutor:
    """A Horovod job on Ray actors (see the module docstring and docs/ray.md).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: workers, packed onto as few nodes as possible; or give ``num_hosts``.
        num_hosts: nodes to use, with ``num_workers_per_host`` workers on each (every one a different node).
        num_workers_per_host: workers per node with ``num_hosts``.
        cpus_per_worker, use_gpu, gpus_per_worker: Ray resources of each worker.
        use_current_placement_group: inside a placement group, take the workers' resources from it.
        min_workers, max_workers: run elastic jobs with this many workers (either one makes the job elastic).
        reset_limit, cooldown_range, elastic_timeout, override_discovery: elastic jobs, as for ``horovodrun``.
    """

    def __init__(self, settings: MiniSettings, num_workers: Optional[int] = None, num_hosts: Optional[int] = None,
                 num_workers_per_host: int = 1, cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None, use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Tuple[int, int]] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True):
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError(f"gpus_per_worker={gpus_per_worker} needs use_gpu=True")
        if cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
        self.settings = settings
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker
        self.elastic = min_workers is not None or max_workers is not None
        self._adapter = None
        if self.elastic:
            if num_workers is not None or num_hosts is not None:
                raise ValueError("an elastic RayExecutor takes min_workers/max_workers, not num_workers/num_hosts "
                                 f"(got num_workers={num_workers}, num_hosts={num_hosts}); drop one or the other")
            from horovod.ray.elastic_v2 import ElasticAdapter

            self._adapter = ElasticAdapter(settings, min_workers=min_workers or 1, max_workers=max_workers,
                                           cpus_per_worker=cpus_per_worker, use_gpu=use_gpu,
                                           gpus_per_worker=gpus_per_worker, reset_limit=reset_limit,
                                           cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                                           override_discovery=override_discovery)
            return
        resources = worker_resources(cpus_per_worker, use_gpu, gpus_per_worker)
        if num_workers is not None and num_hosts is not None:
            raise ValueError(f"give either num_workers ({num_workers}) or num_hosts ({num_hosts}) with "
                             f"num_workers_per_host, not both")
        self.strategy: Union[PackStrategy, ColocatedStrategy]
        if num_workers is not None:
            if num_workers < 1:
                raise ValueError(f"num_workers must be >= 1, got {num_workers}")
            self.strategy = PackStrategy(num_workers, resources, settings.placement_group_timeout_s,
                                         use_current_placement_group)
        elif num_hosts is not None:
            if num_hosts < 1 or num_workers_per_host < 1:
                raise ValueError(f"num_hosts and num_workers_per_host must be >= 1, got {num_hosts} and "
                                 f"{num_workers_per_host}")
            self.strategy = ColocatedStrategy(num_hosts, num_workers_per_host, resources,
                                              settings.placement_group_timeout_s, use_current_placement_group)
        else:
            raise ValueError("RayExecutor needs num_workers=N (or num_hosts=H with num_workers_per_host=W) for a "
                             "static job, or min_workers/max_workers for an elastic one")
        self.num_workers = self.strategy.num_workers
        self.workers: List[Any] = []          # actor handles in rank order
        self._placement: Optional[Placement] = None
        self._server: Optional[RendezvousServer] = None
        self._hang: Optional[HangWatch] = None   # the hang doctor's collection for the executor's calls
        self._queue = None
        self._calls = 0
        self._failed = False   # the last gathered call failed: the next one starts fresh engines everywhere

    @property
    def driver(self):
        """The elastic driver of the running (or last) elastic job; ``None`` for static jobs."""
        return self._adapter.driver if self._adapter is not None else None

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[Sequence[str]] = None) -> MiniSettings:
        """Settings for :class:`RayExecutor` (see :class:`MiniSettings`)."""
        return MiniSettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, ssh_str=ssh_str,
                            placement_group_timeout_s=placement_group_timeout_s,
                            nics=list(nics) if nics else None)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None, executable_args: Optional[list] = None,
              executable_kwargs: Optional[dict] = None, extra_env_vars: Optional[Dict[str, Any]] = None) -> None:
        """Start the workers (and, in each, ``executable_cls(*executable_args, **executable_kwargs)``).

        Raises:
            RuntimeError: Ray is not initialised, or the executor was started already.
            TimeoutError: Ray could not place or start the workers in time.
        """
        if self._adapter is not None:
            self._adapter.start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
            return
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init() (or ray.init(address='auto') to join a "
                               "running cluster) before RayExecutor.start()")
        if self.workers:
            raise RuntimeError("this RayExecutor is already started; call shutdown() before starting it again")
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars or {})
        except BaseException:
            self.shutdown()
            raise

    def _start(self, executable_cls, executable_args, executable_kwargs, extra_env_vars) -> None:
        self._placement = self.strategy.place()
        remote_cls = ray.remote(BaseHorovodWorker)
        resources = self.strategy.resources
        actors: List[Any] = [remote_cls.options(num_cpus=resources["CPU"], num_gpus=resources.get("GPU", 0),
                                     scheduling_strategy=self._placement.scheduling(i)).remote(i, self.num_workers)
                  for i in range(self.num_workers)]
        self.workers = actors   # start order until the ranks are known (shutdown() must find them either way)
        described = _get(self.settings, [a.describe.remote() for a in actors], "start the worker actors")
        coordinator = Coordinator(self.settings)
        for index, (node_id, ip, _pid) in enumerate(described):
            coordinator.register(ip, node_id, index)
        slots = coordinator.finalize_registration()
        by_rank = sorted(slots, key=lambda index: slots[index].rank)
        self.workers = [actors[i] for i in by_rank]

        secret = secrets.token_bytes(32)   # per job; reaches the actors only as a Ray call argument
        self._server = RendezvousServer(secret, host=rendezvous_bind_host(self.settings.nics)).start()
        job = JobSettings(num_proc=self.num_workers, hosts=[], command=[],
                          knob_env=knob_env_from(dict(config.environ())), nics=list(self.settings.nics or []),
                          start_timeout=int(self.settings.timeout_s),
                          extra_env={k: str(v) for k, v in extra_env_vars.items()})
        base = job_env({}, job, self._server.host, self._server.port, secret)
        # The hang doctor: the actors announce their pids at init(); those on this machine are signalled to dump.
        self._hang = HangWatch(self._server.store, base, {s.rank: s.hostname for s in slots.values()}).start()
        base.update(self._hang.env())
        gpus = self._visible_gpus(by_rank, slots) if self.use_gpu else {}
        envs = []
        for index in by_rank:
            env = dict(base)
            env.update(slots[index].env())
            set_worker_threads(env, slots[index].local_size)
            if index in gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[index]
            env.update({k: str(v) for k, v in extra_env_vars.items()})
            envs.append(env)
        _get(self.settings, [w.update_env_vars.remote(env) for w, env in zip(self.workers, envs)],
             "configure the workers")
        _get(self.settings, [w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                             for w in self.workers], "create the executable in every worker")
        logger.info("RayExecutor: %d workers on %d node(s), rendezvous at %s:%s", self.num_workers,
                    len({s.hostname for s in slots.values()}), self._server.host, self._server.port)

    def _visible_gpus(self, by_rank: List[int], slots: Dict[int, SlotInfo]) -> Dict[int, str]:
        """Every worker of a node sees all GPUs Ray gave that node's workers (local_rank picks one)."""
        actors = {index: self.workers[pos] for pos, index in enumerate(by_rank)}
        ids = dict(zip(by_rank, _get(self.settings, [actors[i].get_gpu_ids.remote() for i in by_rank],
                                     "read the workers' GPU ids")))
        per_node: Dict[str, set] = {}
        for index, gpu_ids in ids.items():
            per_node.setdefault(slots[index].hostname, set()).update(gpu_ids)
        return {index: ",".join(str(g) for g in sorted(per_node[slots[index].hostname])) for index in by_rank}

    def shutdown(self) -> None:
        """Stop every worker actor, release the placement group and stop the rendezvous store."""
        if self._adapter is not None:
            self._adapter.shutdown()
            return
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:   # noqa: BLE001 - already dead
                pass
        self.workers = []
        ray_logger.close_queue(self._queue)
        self._queue = None
        if self._placement is not None:
            self._placement.release()
            self._placement = None
        if self._hang is not None:
            self._hang.stop()
            self._hang = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    # -- calls ----------------------------------------------------------------------------------------------
    def _require_static(self, what: str) -> None:
        if self._adapter is not None:
            raise NotImplementedError(f"{what}() is for static jobs; an elastic RayExecutor (min_workers/"
                                      f"max_workers) runs functions with run()")
        if not self.workers:
            raise RuntimeError(f"{what}(): the executor is not running; call start() first")

    def _run_remote(self, fn: Callable[[Any], Any], callbacks: Optional[Sequence[Callable]] = None) -> List[Any]:
        self._calls += 1
        if callbacks:
            self._ensure_queue()
        fresh, self._failed = self._failed, False
        if self._hang is not None:
            self._hang.fresh_verdict()
        return [w.run_job_call.remote(fn, self._calls, fresh) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        self._require_static("execute")
        return self._gather(self._run_remote(fn, callbacks), callbacks)

    def run(self, fn: Callable, args: Optional[list] = None, kwargs: Optional[dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order.

        ``callbacks`` are called with every value rank 0 passes to :func:`horovod.ray.ray_logger.log`.

        Raises:
            the exception of the worker that failed (its message names the rank); when several failed, the one
            that was not only a witness of another's failure.
        """
        if self._adapter is not None:
            return self._adapter.run(fn, args, kwargs, callbacks)
        self._require_static("run")
        return self._gather(self._run_remote(_Call(fn, args, kwargs), callbacks), callbacks)

    def run_remote(self, fn: Callable, args: Optional[list] = None, kwargs: Optional[dict] = None) -> List[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; its ``ObjectRef`` per rank, in rank order."""
        self._require_static("run_remote")
        return self._run_remote(_Call(fn, args, kwargs))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only."""
        self._require_static("execute_single")
        self._calls += 1
        return ray.get(self.workers[0].run_job_call.remote(fn, self._calls, False))

    # -- results --------------------------------------------------------------------------------------------
    def _ensure_queue(self) -> None:
        if self._queue is None:
            self._queue = ray_logger.driver_queue()
            ray.get([w.set_queue.remote(self._queue) for w in self.workers])

    def _drain(self, callbacks: Optional[Sequence[Callable]]) -> None:
        if not callbacks or self._queue is None:
            return
        while not self._queue.empty():
            value = self._queue.get_nowait()
            for callback in callbacks:
                callback(value)

    def _gather(self, refs: List[Any], callbacks: Optional[Sequence[Callable]] = None) -> List[Any]:
        index_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        failures: Dict[int, BaseException] = {}
        give_up_at = None
        while pending:
            poll = 0.1 if callbacks else (1.0 if failures else None)
            done, pending = ray.wait(pending, num_returns=1, timeout=poll)
            self._drain(callbacks)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:   # noqa: BLE001 - reported below
                    failures[index_of[ref]] = exc
            if failures:
                if any(not _witness(e) for e in failures.values()):
                    break   # the cause is known; the others fail as witnesses (their engines lost a peer)
                give_up_at = give_up_at or time.monotonic() + FAILURE_GRACE_S
                if time.monotonic() > give_up_at:
                    break
        self._drain(callbacks)
        if failures:
            self._failed = True
            causes = [r for r in sorted(failures) if not _witness(failures[r])]
            rank = (causes or [min(failures)])[0]
            error = failures[rank]
            if isinstance(error, ray.exceptions.RayActorError):
                # The actor could not say which rank it was: say it here.
                error.add_note(f"(the actor of Horovod rank {rank} of {len(refs)} died)")
            if self._hang is not None:   # the verdict of a stall in this call, or one collected now
                verdict = self._hang.verdict or self._hang.collect(f"rank {rank} failed", announce=False)
                if verdict:
                    error.add_note(verdict)
            raise error
        return ray.get(refs)


def _witness(exc: BaseException) -> bool:
    """A rank that failed only because another one did (its engine lost a peer)."""
    return isinstance(exc, HorovodInternalError)


class _Call:
    """``fn(*args, **kwargs)`` as a function of the worker's executable (which it ignores)."""

    def __init__(self, fn: Callable, args: Optional[list], kwargs: Optional[dict]):
        self.fn, self.args, self.kwargs = fn, list(args or []), dict(kwargs or {})

    def __call__(self, _executable: Any) -> Any:
        return self.fn(*self.args, **self.kwargs)


def _get(settings: MiniSettings, refs: List[Any], what: str) -> List[Any]:
    """``ray.get`` bounded by the placement timeout, with a message that says what did not happen."""
    timeout = float(settings.placement_group_timeout_s)
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"RayExecutor: could not {what} within placement_group_timeout_s={timeout:g} s; the "
                           f"cluster may be overloaded or a node may have died") from None
