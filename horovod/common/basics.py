"""init / shutdown and the rank queries every binding re-exports."""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from horovod.common import mpi_abort
from horovod.common.process_sets import ProcessSet, global_process_set, registered_process_sets
from horovod.engine import config as _config
from horovod.engine import flight_dump
from horovod.engine import result_pool
from horovod.engine import state as _state
from horovod.engine.state import NOT_INITIALIZED  # noqa: F401  (re-exported)
from horovod.engine.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from horovod.engine.runtime import Runtime

logger = logging.getLogger("horovod")


_lock = threading.RLock()
_generation = 0
_sets = registered_process_sets()   # the registry lives with the process sets; init/shutdown fill and empty it
_atexit_registered = False

_LOG_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
               "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def _configure_logging(cfg) -> None:
    level = _LOG_LEVELS.get(str(cfg.log_level).upper(), logging.WARNING)
    logger.setLevel(level)
    # Add our own handler only where nobody configured logging; records still propagate to the root.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        fmt = "[%(levelname)s %(filename)s:%(lineno)d] %(message)s" if cfg.log_hide_time else \
            "[%(asctime)s: %(levelname)s %(filename)s:%(lineno)d] %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(handler)


def init(comm: Optional[Union[Sequence[int], object]] = None,
         process_sets: Optional[Union[Sequence[ProcessSet], str]] = None) -> None:
    """Start the engine: connect to the other ranks and start the background thread.

    Idempotent while running.  ``shutdown()`` followed by ``init()`` starts a fresh engine (elastic training
    relies on it).

    Args:
        comm: ``None`` for all ranks, or an mpi4py communicator (MPI jobs).
        process_sets: static :class:`ProcessSet` objects to register (ids 1, 2, ...), or ``"dynamic"``.

    Raises:
        ValueError: initialisation failed (the message says why and what to do).
    """
    global _generation, _atexit_registered
    with _lock:
        current = _running()
        if current is not None and current.alive:
            return
        if current is not None:
            current.shutdown()
            _state.current = None
        if isinstance(process_sets, str):
            if process_sets != "dynamic":
                raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}")
            _config.set_environ("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
            process_sets = []
        static = list(process_sets or [])
        seen = set()
        for ps in static:
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets entries must be ProcessSet objects, got {ps!r}")
            if tuple(ps.ranks) in seen:
                raise ValueError(f"Duplicate process set ranks {ps.ranks} passed to hvd.init().")
            seen.add(tuple(ps.ranks))
        mpi_comm: Any = None   # an mpi4py communicator (mpi4py is optional, so untyped)
        if comm is not None and hasattr(comm, "Get_rank"):
            mpi_comm = comm
        elif comm is not None:
            if not isinstance(comm, Iterable):
                raise ValueError(f"hvd.init(comm={comm!r}): expected an mpi4py communicator or a list of ranks")
            given = list(comm)
            ranks = sorted(int(r) for r in given)
            cfg0 = _config.load()
            if ranks != list(range(cfg0.topology.size)):
                raise ValueError(f"hvd.init(comm={given}): a rank subset as the world is not supported by "
                                 f"this engine; use process sets (hvd.ProcessSet({given})) instead.")
        cfg = _config.load()
        _configure_logging(cfg)
        size = cfg.topology.size if mpi_comm is None else mpi_comm.Get_size()
        for ps in static:
            bad = [r for r in ps.ranks if not 0 <= r < size]
            if bad:
                raise ValueError(f"Process set {ps.ranks} has ranks {bad} outside the job of size {size}.")
        from horovod.engine import bootstrap, collectives

        try:
            started = bootstrap.start(cfg, [ps.ranks for ps in static], _generation, mpi_comm)
            _state.current = started
        except (OSError, TimeoutError, RuntimeError, ValueError) as exc:
            raise ValueError(f"Horovod initialization failed: {exc}") from exc
        _attach_flight_recorder(_state.current, _generation)
        _generation += 1
        collectives.reset_names()
        _sets.clear()
        global_process_set.ranks = list(range(started.size))
        _sets[0] = global_process_set
        for i, ps in enumerate(static, start=1):
            ps.process_set_id = i
            _sets[i] = ps
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    if mpi_comm is not None or cfg.topology.launched_by == "mpirun":
        # MPI is initialised now: an uncaught exception on this rank must end the whole mpirun job.
        mpi_abort.install_excepthook()


def shutdown() -> None:
    """Stop the engine; pending collectives fail.  ``init()`` may be called again afterwards."""
    with _lock:
        runtime = _running()
        if runtime is None:
            return
        _state.current = None
        for ps in list(_sets.values()):
            if ps.process_set_id not in (0, None):
                ps._invalidate()
        _sets.clear()
    runtime.shutdown()
    result_pool.pool().clear()  # a finished job keeps no recycled result memory


def set_generation(generation: int) -> None:
    """Number the next ``init()`` of this process ``generation`` (its rendezvous keys derive from it).

    Every ``init()`` takes the next number, so ranks that started together agree.  A launcher whose long-lived
    workers (Ray actors) join several jobs, some after a failed one, sets the same number on every rank first.
    """
    global _generation
    with _lock:
        _generation = int(generation)


# -- the hang doctor's hooks (docs/debugging.md) ------------------------------------------------------------------

def dump_flight_recorder(reason: str = "requested", all_ranks: bool = False) -> Optional[str]:
    """Write this rank's hang dump (its last collectives and the stacks of all its threads) and return its path.

    The directory is ``HOROVOD_FLIGHT_RECORDER_DIR`` (horovodrun: one per job); ``python -m horovod.doctor DIR``
    reads it.  ``all_ranks=True`` also asks the launcher to have every rank dump (under horovodrun).

    Raises:
        ValueError: Horovod is not initialised.
    """
    engine = runtime().state
    path = flight_dump.dump(engine, reason)
    if all_ranks:
        flight_dump.request_all(engine, reason)
    return path


def _attach_flight_recorder(rt, generation: int) -> None:
    # Elastic jobs number their dumps by epoch (every rank of an epoch agrees on it); others by init count.
    epoch = getattr(getattr(rt, "epoch", None), "epoch", None)
    rt.state.flight_generation = epoch if isinstance(epoch, int) else generation
    flight_dump.announce(rt.state, _install_dump_signal())


_signal_installed = False


def _install_dump_signal() -> bool:
    """SIGUSR1 makes this process dump (the launcher sends it to every rank, stuck or not).  Only where nobody
    else handles SIGUSR1, and only from the main thread (where Python allows it).  True when it is ours."""
    global _signal_installed
    if not hasattr(signal, "SIGUSR1"):
        return False
    if _signal_installed:
        return signal.getsignal(signal.SIGUSR1) is _on_dump_signal
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGUSR1, _on_dump_signal)
        _signal_installed = True
    except (ValueError, OSError):
        return False
    return True


def _on_dump_signal(signum, frame) -> None:
    # The handler runs in the main thread between two bytecodes; the dump is taken from a thread of its own, so the
    # main thread returns at once to where it was stuck and its stack shows that place, not this handler.
    rt = _state.current
    if rt is None:
        return
    threading.Thread(target=flight_dump.dump, args=(rt.state, "SIGUSR1"), name="horovod-dump", daemon=True).start()
    flight_dump.signal_children(signum)


def is_initialized() -> bool:
    return _state.current is not None


def _new_lock_in_forked_child() -> None:
    # Another thread of the parent may have held the lock at the fork; in the child it would never be released.
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_forked_child)


def _running() -> Optional[Runtime]:
    """The running engine or None."""
    return _state.current


def runtime() -> Runtime:
    """The running engine.

    Raises:
        ValueError: not initialised.
    """
    return _state.runtime()


def _topology():
    return runtime().config.topology


def size() -> int:
    """Number of processes in the job."""
    return runtime().size


def rank() -> int:
    """This process's global rank."""
    return runtime().rank


def local_size() -> int:
    """Number of processes on this host."""
    rt = runtime()
    return rt.size if rt.size == 1 else _topology().local_size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    rt = runtime()
    return 0 if rt.size == 1 else _topology().local_rank


def cross_size() -> int:
    """Number of hosts that have a process with this process's local rank."""
    rt = runtime()
    return 1 if rt.size == 1 else _topology().cross_size


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with this local rank."""
    rt = runtime()
    return 0 if rt.size == 1 else _topology().cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    rt = runtime()
    topo = _topology()
    return rt.size == 1 or topo.local_size * topo.cross_size == rt.size


def mpi_threads_supported() -> bool:
    """Whether MPI supports MPI_THREAD_MULTIPLE.

    Raises:
        ValueError: MPI is not in use (the job runs on the built-in transports).
    """
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled: mpi_threads_supported() needs a job running on MPI "
                         "(launch with mpirun or horovodrun --mpi).")
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True when collectives run over MPI."""
    current = _running()
    return current is not None and current.transport_name == "mpi"


def mpi_built() -> bool:
    """True when mpi4py (and so an MPI library) is importable."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """True when the built-in transports (the Gloo role of the original) are in use."""
    current = _running()
    return current is not None and current.transport_name != "mpi"


def gloo_built() -> bool:
    """Always True: the built-in TCP / shared-memory transports need nothing installed."""
    return True


def nccl_built() -> int:
    """The NCCL version this process can load (``major*10000 + minor*100 + patch``, e.g. 22805), or 0.

    Looked up as GPU collectives would (``HOROVOD_NCCL_SO_PATH``, the nvidia-nccl wheel, the system library).
    """
    from horovod.engine import config, device

    return device.nccl_version(config.load().nccl_so_path)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when a CUDA driver with at least one GPU is present (GPU collectives can run here)."""
    from horovod.engine import device

    return device.cuda_devices() > 0


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline to ``file_path`` (rank 0); needs ``HOROVOD_TIMELINE`` set at init.

    Raises:
        ValueError: not initialised, or HOROVOD_TIMELINE was not set (use ``HOROVOD_TIMELINE=DYNAMIC``).
    """
    rt = runtime()
    if not rt.config.timeline:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC (or a file path) before hvd.init() to use "
                         "hvd.start_timeline().")
    from horovod.engine import timeline

    timeline.start_dynamic(rt, file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline (the file stays valid JSON)."""
    from horovod.engine import timeline

    timeline.stop_dynamic(runtime())
