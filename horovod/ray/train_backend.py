"""The Ray Train backend of :class:`horovod.ray.HorovodTrainer`: this project's rendezvous for a worker group.

Ray Train (v2, the default in Ray 2.60) starts a group of worker actors for every attempt of a run and calls the
backend's ``on_start`` with it before the training function starts; ``on_shutdown`` before the group is torn down
(after a normal end, or after a failure when ``FailureConfig(max_failures=...)`` starts a new group).  On start,
:class:`HorovodBackend`

1. asks every worker which Ray node it runs on (only the public worker-group calls are used: ``execute``);
2. numbers the workers as ``horovodrun`` numbers slots: node by node (each Ray node is one host of the job, as in
   :class:`~horovod.ray.RayExecutor`), local and cross ranks from :func:`~horovod.runner.hosts.get_host_assignments`.
   Ray Train numbers its workers node by node too, so ``hvd.rank()`` equals
   ``ray.train.get_context().get_world_rank()``;
3. starts an authenticated rendezvous store (a fresh 32-byte secret per group) in the process running the backend
   (Ray Train's controller actor, on the driver's node);
4. writes each worker's ``HOROVOD_*`` variables — the same ones a ``horovodrun`` worker gets, secret included —
   into the worker actor's environment.  The training function's ``hvd.init()`` reads them.

The secret reaches the workers only as an argument of a Ray call; it is never logged.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import ray
from ray.train.backend import Backend, BackendConfig

from horovod.engine import config
from horovod.ray.settings import knob_env_from, rendezvous_bind_host
from horovod.runner.hosts import HostInfo, SlotInfo, get_host_assignments
from horovod.runner.job import JobSettings, job_env
from horovod.runner.threads import set_worker_threads
from horovod.transport.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)

#: How long ``on_shutdown`` waits for the workers to shut their engines down.
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class HorovodConfig(BackendConfig):
    """How :class:`~horovod.ray.HorovodTrainer` sets Horovod up in its workers.

    The fields of Ray's removed ``ray.train.horovod.HorovodConfig`` are accepted, so configurations written for it
    still construct; the ones about ssh mean nothing here (the workers are Ray actors, nothing uses ssh).

    Attributes:
        nics: network interfaces; the first one carries the job's traffic (``HOROVOD_GLOO_IFACE``) and the
            rendezvous store listens on its address (default: the driver's Ray node address).
        verbose: accepted for compatibility (log levels follow ``HOROVOD_LOG_LEVEL``).
        key: accepted for compatibility and ignored: every worker group gets a fresh random secret.
        ssh_port, ssh_identity_file, ssh_str: accepted for compatibility; unused.
        timeout_s: seconds the ranks may take to meet at ``hvd.init()`` (``HOROVOD_START_TIMEOUT``).
        placement_group_timeout_s: seconds the set-up calls to the workers may take (Ray Train places the
            workers itself, under ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``).
        env_vars: more variables for every worker (strings).
        knob_env: the ``HOROVOD_*`` tuning variables for the workers; ``None`` (the default) takes those set in
            the environment of the process that creates the config (the driver), as ``horovodrun`` forwards
            its own: Ray actors do not inherit the driver's environment.
    """

    nics: Optional[Union[Set[str], Sequence[str]]] = None
    verbose: int = 1
    key: Optional[str] = field(default=None, repr=False)
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    timeout_s: int = 300
    placement_group_timeout_s: float = 100
    env_vars: Dict[str, str] = field(default_factory=dict)
    knob_env: Optional[Dict[str, str]] = None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.placement_group_timeout_s <= 0:
            raise ValueError(f"HorovodConfig: timeout_s and placement_group_timeout_s must be > 0, got "
                             f"{self.timeout_s} and {self.placement_group_timeout_s}")
        if self.knob_env is None:
            self.knob_env = knob_env_from(dict(config.environ()))

    @property
    def backend_cls(self):
        return HorovodBackend

    @property
    def nic_list(self) -> List[str]:
        """``nics`` as a list (a set has no first element: it is sorted)."""
        if not self.nics:
            return []
        return sorted(self.nics) if isinstance(self.nics, (set, frozenset)) else list(self.nics)

    def to_dict(self) -> Dict[str, Any]:
        """What Ray Train's state export shows (never the key)."""
        return {"nics": self.nic_list, "timeout_s": self.timeout_s,
                "placement_group_timeout_s": self.placement_group_timeout_s}


# -- run inside the worker actors -------------------------------------------------------------------------------
def _describe_worker() -> Tuple[str, str, int]:
    """``(Ray node id, IP address, pid)`` of the worker actor this runs in."""
    import os

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()


def _configure_worker(env: Dict[str, str]) -> None:
    """Write the worker's ``HOROVOD_*`` variables; an engine left running here from before is shut down."""
    from horovod.engine import state

    if state.current is not None:
        from horovod.common import basics

        basics.shutdown()
    for name, value in env.items():
        config.set_environ(name, value)


def _shutdown_worker() -> None:
    """Shut down an engine the training function left running (so its peers' sockets close cleanly)."""
    from horovod.engine import state

    if state.current is not None:
        from horovod.common import basics

        basics.shutdown()


def worker_slots(node_ids: Sequence[str]) -> List[SlotInfo]:
    """The slot of each worker (in the worker group's order), numbered node by node.

    Each Ray node is one host.  Nodes are ordered by their first worker and a node's workers keep their order,
    so a group that Ray Train numbered node by node keeps its numbering: slot ``i``'s rank is ``i``.
    """
    per_node: Dict[str, List[int]] = {}
    for index, node in enumerate(node_ids):
        per_node.setdefault(node, []).append(index)
    slots = get_host_assignments([HostInfo(node, len(indices)) for node, indices in per_node.items()],
                                 len(node_ids))
    order = [index for indices in per_node.values() for index in indices]
    by_index = dict(zip(order, slots))
    return [by_index[i] for i in range(len(node_ids))]


class HorovodBackend(Backend):
    """Starts the rendezvous of each Ray Train worker group and configures its workers (module docstring)."""

    #: Every worker of a node sees all GPUs Ray gave that node's workers (``hvd.local_rank()`` picks one).
    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._server: Optional[RendezvousServer] = None

    def on_start(self, worker_group, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, HorovodConfig), type(backend_config)
        self._stop_server()   # a group torn down without on_shutdown (an abort) left its store here
        try:
            self._start(worker_group, backend_config)
        except BaseException:
            self._stop_server()
            raise

    def _start(self, worker_group, backend_config: HorovodConfig) -> None:
        timeout = float(backend_config.placement_group_timeout_s)
        described = _get(worker_group.execute_async(_describe_worker), timeout, "ask the workers for their node")
        slots = worker_slots([node for node, _ip, _pid in described])
        if any(slot.rank != index for index, slot in enumerate(slots)):
            logger.warning("HorovodTrainer: Ray Train did not number its workers node by node; Horovod ranks "
                           "differ from Ray Train's world ranks: %s", [s.rank for s in slots])
        secret = secrets.token_bytes(32)
        nics = backend_config.nic_list
        server = self._server = RendezvousServer(secret, host=rendezvous_bind_host(nics)).start()
        job = JobSettings(num_proc=len(slots), hosts=[], command=[], knob_env=dict(backend_config.knob_env or {}),
                          nics=nics, start_timeout=int(backend_config.timeout_s),
                          extra_env={k: str(v) for k, v in backend_config.env_vars.items()})
        base = job_env({}, job, server.host, server.port, secret)
        refs = []
        for index, slot in enumerate(slots):
            env = dict(base)
            env.update(slot.env())
            set_worker_threads(env, slot.local_size)
            env.update(job.extra_env)
            refs.append(worker_group.execute_single_async(index, _configure_worker, env))
        _get(refs, timeout, "configure the workers")
        logger.info("HorovodTrainer: %d workers on %d Ray node(s), rendezvous at %s:%s", len(slots),
                    len({s.hostname for s in slots}), server.host, server.port)

    def on_shutdown(self, worker_group, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, HorovodConfig), type(backend_config)
        try:
            refs = worker_group.execute_async(_shutdown_worker)
            # Bounded: after a failure an engine may wait for its dead peer; Ray Train kills the actors next anyway.
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(float(backend_config.timeout_s),
                                                                         SHUTDOWN_TIMEOUT_S))
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:   # noqa: BLE001 - a dead worker (the failure being recovered from)
                    logger.debug("HorovodTrainer: a worker could not shut its engine down: %s", exc)
        finally:
            self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _get(refs: List[Any], timeout: float, what: str) -> List[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"HorovodTrainer: could not {what} within placement_group_timeout_s={timeout:g} s; "
                           f"the cluster may be overloaded or a node may have died (raise "
                           f"HorovodConfig(placement_group_timeout_s=...) on a slow cluster)") from None
