"""Turning a resolved config into a running engine: rendezvous, control plane, data plane, background thread.

Transports are chosen by name from the registry, with an explicit priority: an explicit ``HOROVOD_TRANSPORT``
(or ``HOROVOD_CPU_OPERATIONS=mpi``) wins; otherwise MPI under ``mpirun``, shared memory when every rank is on
this host, hierarchical shared memory + TCP when the job spans hosts, TCP as the fallback.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import secrets
import socket
from typing import Any, Sequence, cast


from horovod.engine import config as _config
from horovod.engine import boards, membership
from horovod.engine.config import Config
from horovod.engine.controller import ControlPlane
from horovod.engine.job import JobLinks
from horovod.engine.runtime import Runtime
from horovod.transport import sockets
from horovod.transport.cpus import bind_process
from horovod.transport.base import REGISTRY, Bootstrap, LocalTransport, TransportOptions

logger = logging.getLogger(__name__)

_TRANSPORT_MODULES = {"tcp": "horovod.transport.tcp", "shm": "horovod.transport.shm",
                      "mpi": "horovod.transport.mpi", "hierarchical": "horovod.transport.hierarchical"}


class InitError(ValueError):
    """``init()`` could not assemble the job (bad launch environment, unreachable peers)."""


def _load_transport(name: str):
    if name not in REGISTRY:
        module = _TRANSPORT_MODULES.get(name)
        if module is None:
            raise InitError(f"unknown transport '{name}'; choose one of auto, {', '.join(_TRANSPORT_MODULES)}")
        importlib.import_module(module)
    if name not in REGISTRY:
        raise InitError(f"transport '{name}' is not available in this installation")
    return REGISTRY[name]


def _available(name: str) -> bool:
    try:
        _load_transport(name)
        return True
    except (ImportError, InitError):
        return False


def choose_transport(config: Config, mpi_comm=None) -> str:
    """The data plane for this job (pure decision from config and topology)."""
    topo = config.topology
    explicit = (config.transport or "auto").lower()
    if explicit != "auto":
        return explicit
    wants_mpi = (config.cpu_operations or "").lower() == "mpi" or (config.controller or "").lower() == "mpi"
    forbids_mpi = (config.cpu_operations or "").lower() == "gloo"
    if mpi_comm is not None or wants_mpi or (topo.launched_by == "mpirun" and not forbids_mpi):
        if _available("mpi"):
            return "mpi"
    if topo.local_size == topo.size and _available("shm"):
        return "shm"
    if topo.local_size < topo.size and _available("hierarchical"):
        return "hierarchical"
    return "tcp"


class _MpiRendezvous:
    """Under ``mpirun`` there is no launcher: rank 0 serves the rendezvous in-process and shares its address."""

    def __init__(self, comm, bind_addr: str):
        from horovod.transport.rendezvous import RendezvousClient, RendezvousServer

        self.server = None
        if comm.Get_rank() == 0:
            secret = secrets.token_bytes(32)
            self.server = RendezvousServer(secret, host=bind_addr).start()
            info = (bind_addr, self.server.port, secret)
        else:
            info = None
        addr, port, secret = comm.bcast(info, root=0)
        self.secret = secret
        self.client = RendezvousClient(addr, port, secret)


#: How many abandoned epochs in a row one ``init()`` of an elastic worker joins the next epoch after.
ABANDONED_EPOCH_RETRIES = 20


def start(config: Config, process_sets: Sequence[Sequence[int]] = (), generation: int = 0,
          mpi_comm=None) -> Runtime:
    """Build and start the engine for this process (see :func:`_start`); an elastic worker whose epoch was
    abandoned while it formed (a member exited) joins the driver's next epoch instead of failing."""
    for attempt in range(ABANDONED_EPOCH_RETRIES + 1):
        try:
            return _start(config, process_sets, generation, mpi_comm)
        except membership.EpochAbandoned as exc:
            if attempt == ABANDONED_EPOCH_RETRIES:
                raise
            logger.warning("%s", exc)
    raise AssertionError("unreachable")


def _start(config: Config, process_sets: Sequence[Sequence[int]] = (), generation: int = 0,
           mpi_comm=None) -> Runtime:
    """Build and start the engine for this process.

    Args:
        config: resolved knobs and topology.
        process_sets: static process sets (global ranks), registered with ids 1, 2, ...
        generation: how many times this process initialised before; keeps rendezvous keys fresh.
        mpi_comm: an mpi4py communicator given to ``hvd.init(comm=...)``.

    Raises:
        InitError: the environment does not describe a complete job.
    """
    topo = config.topology
    rank, size = topo.rank, topo.size
    if mpi_comm is not None:
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    elif topo.launched_by == "mpirun":
        try:
            from horovod.transport.mpi import configure_mpi4py

            configure_mpi4py(config.mpi_threads_disable)
            from mpi4py import MPI
        except ImportError as exc:
            raise InitError("this process was started by mpirun but mpi4py is not installed; "
                            "`pip install mpi4py` (or horovod-next[mpi]), or launch with horovodrun") from exc
        mpi_comm = MPI.COMM_WORLD
    if size == 1 and not (config.elastic and topo.rendezvous_addr):
        return Runtime(config, 0, 1, LocalTransport(), ControlPlane(0, 1, {}), process_sets).start()

    timeout = float(max(config.init_timeout_seconds, config.gloo_timeout_seconds))
    rendezvous_server = None
    if topo.rendezvous_addr and mpi_comm is None:
        from horovod.transport.rendezvous import RendezvousClient

        if topo.secret is None:
            raise InitError("HOROVOD_GLOO_RENDEZVOUS_ADDR is set but the job secret is missing from the "
                            "environment; start workers with horovodrun (or horovod.run)")
        if topo.rendezvous_port is None:
            raise InitError(f"HOROVOD_GLOO_RENDEZVOUS_ADDR is set ({topo.rendezvous_addr}) but "
                            f"HOROVOD_GLOO_RENDEZVOUS_PORT is not; start workers with horovodrun (or horovod.run)")
        store = RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret, timeout=timeout)
        secret = topo.secret
        bind_addr = sockets.local_address_for(topo.rendezvous_addr)
    elif mpi_comm is not None:
        bind_addr = _mpi_bind_address(mpi_comm, topo.local_size == size, topo.iface)
        rendezvous = _MpiRendezvous(mpi_comm, bind_addr)
        store, secret, rendezvous_server = rendezvous.client, rendezvous.secret, rendezvous.server
    else:
        raise InitError(
            f"HOROVOD_SIZE={size} but no rendezvous server is known (HOROVOD_GLOO_RENDEZVOUS_ADDR is unset) and "
            f"this process was not started by mpirun; launch the script with `horovodrun -np {size} ...`")

    scope = f"g{generation}"
    epoch = None
    if config.elastic:
        config, epoch = _join_elastic_epoch(config, store, timeout)
        # Waits end when the driver abandons the epoch; it quacks like the client (a wrapper, not a subclass).
        store = cast(Any, membership.EpochStore(store, epoch.epoch))
        topo = config.topology
        rank, size = topo.rank, topo.size
        scope = f"e{epoch.epoch}"
        if size == 1:
            return Runtime(config, 0, 1, LocalTransport(), ControlPlane(0, 1, {}), process_sets,
                           JobLinks(store=store, epoch=epoch)).start()
    if config.bind_cores:
        bind_process(topo.local_rank, topo.local_size)   # before the engine starts its threads
    control = ControlPlane.connect(rank, size, store, scope + "-ctl", secret, bind_addr, timeout)
    name = choose_transport(config, mpi_comm)
    factory = _load_transport(name)
    boot = Bootstrap(rank, size, local_rank=topo.local_rank, local_size=topo.local_size,
                     cross_rank=topo.cross_rank, cross_size=topo.cross_size, hostname=topo.hostname, store=store,
                     secret=secret, bind_addr=bind_addr, timeout=float(config.gloo_timeout_seconds),
                     scope=scope + "-" + name,
                     options=TransportOptions(
                         small_message_bytes=config.small_message_bytes, mpi_comm=mpi_comm,
                         shm_single_copy_bytes=config.shm_single_copy_bytes,
                         # Multi-host jobs use it unless HOROVOD_HIERARCHICAL_ALLREDUCE=0 says otherwise.
                         hierarchical_allreduce=config.hierarchical_allreduce
                         or "hierarchical_allreduce" not in config.fixed,
                         hierarchical_allgather=config.hierarchical_allgather,
                         mpi_threads_disable=config.mpi_threads_disable))
    try:
        world = factory(boot)
    except Exception:
        control.close()
        raise
    try:
        board, lane = boards.open_boards(config, world, boot, config.spin_budget_us)
    except Exception:
        world.close()
        control.close()
        raise
    logger.debug("rank %d: transport %s ready", rank, name)
    job = JobLinks(store=store, epoch=epoch, rendezvous_server=rendezvous_server, mpi_comm=mpi_comm)
    return Runtime(config, rank, size, world, control, process_sets, job, transport_name=name,
                   round_board=board, lane_board=lane).start()


def _mpi_bind_address(comm, one_host: bool, iface: str) -> str:
    """The address this rank listens on under mpirun: loopback on one host, else one the other hosts can reach.

    Ranks share their IPv4 addresses over MPI; each binds to the local address that routes to another host's
    first address (``HOROVOD_GLOO_IFACE`` wins when this host has that interface).
    """
    if one_host:
        return "127.0.0.1"
    from horovod.transport.network import interface_addresses

    mine = interface_addresses()
    if iface and iface in mine:
        return mine[iface]
    everyone = comm.allgather(sorted(a for a in mine.values() if not a.startswith("127.")))
    own = set(everyone[comm.Get_rank()])
    for addrs in everyone:
        foreign = [a for a in addrs if a not in own]
        if foreign:
            return sockets.local_address_for(foreign[0])
    return sockets.local_address_for(socket.gethostname())


_last_epoch = -1


def _join_elastic_epoch(config: Config, store, timeout: float):
    """Wait for the elastic driver to place this worker in a new epoch; returns the updated config."""
    global _last_epoch
    topo = config.topology
    worker_id = topo.elastic_worker_id or f"{topo.hostname}:{topo.local_rank}"
    _config.set_environ("HOROVOD_ELASTIC_WORKER_ID", worker_id)
    wait = float(max(timeout, config.elastic_timeout_seconds))
    a = membership.wait_for_assignment(store, worker_id, _last_epoch, wait)
    _last_epoch = a.epoch
    # Later readers of the environment (user code, child processes) see the new layout, as in the original.
    for name, value in (("HOROVOD_RANK", a.rank), ("HOROVOD_SIZE", a.size), ("HOROVOD_LOCAL_RANK", a.local_rank),
                        ("HOROVOD_LOCAL_SIZE", a.local_size), ("HOROVOD_CROSS_RANK", a.cross_rank),
                        ("HOROVOD_CROSS_SIZE", a.cross_size), ("HOROVOD_HOSTNAME", a.hostname)):
        _config.set_environ(name, str(value))
    topology = dataclasses.replace(topo, rank=a.rank, size=a.size, local_rank=a.local_rank,
                                   local_size=a.local_size, cross_rank=a.cross_rank, cross_size=a.cross_size,
                                   hostname=a.hostname, elastic_worker_id=worker_id)
    return dataclasses.replace(config, topology=topology), a
