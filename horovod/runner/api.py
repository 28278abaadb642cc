"""``horovod.run``: run a Python function on ``num_proc`` processes and collect what each returns.

The function (with its arguments) is cloudpickled into the job's authenticated rendezvous store; every
worker runs ``python -m horovod.runner.run_task <addr> <port>`` (:mod:`horovod.runner.run_task`), calls it,
and stores its cloudpickled result, which :func:`run` returns ordered by rank.  A function defined in an
importable module is pickled by reference, so the workers must be able to import that module too (as
with the original); functions defined in ``__main__`` travel by value.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import cloudpickle

from horovod.runner import cli
from horovod.runner.exec import LaunchNotAvailableError, WorkerExit
from horovod.runner.hosts import parse_nics
from horovod.runner.job import JobSettings, run_gloo_job
from horovod.runner.launch import _configure_logging, _not_available, job_settings, launch_mode
from horovod.runner.mpi_job import run_mpi_job
from horovod.transport.rendezvous import MemoryStore, RendezvousServer
from horovod.runner.run_task import FUNC_KEY, FUNC_SCOPE, results_by_rank, tracebacks


class _HorovodArgs(argparse.Namespace):
    """Every ``horovodrun`` dest as an attribute, at its command-line default (``num_proc`` = 1).

    Built for :func:`run` and for tests that drive the launcher without a command line.
    """

    def __init__(self) -> None:
        for name, value in cli.defaults().items():
            setattr(self, name, value)
        self.num_proc: Optional[int] = 1
        self.run_func: Optional[Callable[..., Any]] = None
        self.executable: Optional[str] = None

    def __repr__(self) -> str:
        return f"_HorovodArgs({', '.join(f'{k}={v!r}' for k, v in sorted(vars(self).items()))})"


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"horovod.run(): '{old}' is deprecated, use '{new}' instead", DeprecationWarning, stacklevel=3)


def _failure_details(first: WorkerExit, store: MemoryStore) -> str:
    text = tracebacks(store, first.rank)
    return "\n" + text if text else ""


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = 1, min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence[int]] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None, host_discovery_script: Optional[str] = None,
        start_timeout: Optional[int] = None, ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        disable_cache: Optional[bool] = None, output_filename: Optional[str] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None, mpi_args: Optional[str] = None,
        network_interface: Optional[str] = None, network_interfaces: Union[None, str, Sequence[str]] = None,
        executable: Optional[str] = None, np: Optional[int] = None, min_np: Optional[int] = None,
        max_np: Optional[int] = None) -> List[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` processes and return every rank's result.

    Each process sees the launcher's environment (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ...) and may call
    ``hvd.init()``.  Output of the workers is forwarded with ``[rank]<stdout>:`` prefixes.

    Args:
        func: the function; it and its arguments must be picklable by cloudpickle.
        args, kwargs: its arguments.
        num_proc: number of processes.
        hosts: ``"host1:2,host2:4"``; ``hostfile``: a file of ``host slots=N`` lines (not both).
        start_timeout: seconds a worker waits for the function to reach it (default HOROVOD_START_TIMEOUT / 30).
        output_filename: also write each rank's output under this directory.
        verbose: log what the launcher does.
        use_gloo, use_mpi: the controller (not both); ``use_mpi`` runs the workers under ``mpirun``.
        network_interfaces: interfaces to use, a list or a comma-separated string.
        executable: the Python interpreter of the workers (default: this one).
        min_num_proc, max_num_proc, slots, reset_limit, cooldown_range, host_discovery_script: elastic mode
            (see :mod:`horovod.runner.elastic`); results are those of the first ``min_num_proc`` ranks.
        ssh_port, ssh_identity_file, disable_cache, mpi_args: accepted for multi-host / MPI launches.
        np, min_np, max_np, network_interface: deprecated spellings of the above.

    Returns:
        The return values, ``result[r]`` from rank ``r``.

    Raises:
        ValueError: ``hosts`` and ``hostfile`` together, ``use_gloo`` and ``use_mpi`` together, or bad values.
        NotImplementedError: a launch mode that is not available (no mpirun for ``use_mpi``).
        RuntimeError: a worker failed; the message names it and carries its traceback.
    """
    if np is not None:
        _deprecated("np", "num_proc")
        num_proc = np
    if min_np is not None:
        _deprecated("min_np", "min_num_proc")
        min_num_proc = min_np
    if max_np is not None:
        _deprecated("max_np", "max_num_proc")
        max_num_proc = max_np
    if network_interface is not None:
        _deprecated("network_interface", "network_interfaces")
        if network_interfaces is None:
            network_interfaces = network_interface
    if hosts and hostfile:
        raise ValueError("horovod.run(): give either hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("horovod.run(): give either use_gloo or use_mpi, not both")

    hargs = _HorovodArgs()
    hargs.num_proc = num_proc
    hargs.min_num_proc, hargs.max_num_proc = min_num_proc, max_num_proc
    hargs.slots, hargs.reset_limit = slots, reset_limit
    hargs.cooldown_range = list(cooldown_range) if cooldown_range is not None else None
    hargs.hosts, hargs.hostfile, hargs.host_discovery_script = hosts, hostfile, host_discovery_script
    hargs.start_timeout = start_timeout
    hargs.ssh_port, hargs.ssh_identity_file = ssh_port, ssh_identity_file
    hargs.disable_cache = bool(disable_cache)
    hargs.output_filename = output_filename
    hargs.verbose = bool(verbose)
    hargs.use_gloo, hargs.use_mpi = use_gloo, use_mpi
    hargs.mpi_args = mpi_args
    hargs.nics = parse_nics(network_interfaces)
    python = hargs.executable = executable or sys.executable
    hargs.run_func = func

    if verbose:
        _configure_logging(True)
    mode = launch_mode(hargs)
    if mode not in ("gloo", "mpi", "elastic"):
        _not_available(mode, hargs)

    parent_env = dict(os.environ)
    # The workers must import the same horovod as the caller, even from an uninstalled source tree.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = parent_env.get("PYTHONPATH", "")
    if root not in pythonpath.split(os.pathsep):
        pythonpath = root + (os.pathsep + pythonpath if pythonpath else "")
    payload = cloudpickle.dumps(functools.partial(func, *args, **(kwargs or {})))
    if mode == "elastic":
        from horovod.runner.elastic.launch import run_elastic_function

        return run_elastic_function(hargs, payload, parent_env, {"PYTHONPATH": pythonpath})

    def command(addr: str, port: int) -> List[str]:
        return [python, "-m", "horovod.runner.run_task", addr, str(port)]

    def publish(server: RendezvousServer) -> None:
        server.store.put((FUNC_SCOPE, FUNC_KEY), payload)

    settings: JobSettings = job_settings(hargs, command, parent_env)
    settings.stdin_to_rank0 = False   # the caller's standard input stays the caller's
    settings.extra_env["PYTHONPATH"] = pythonpath
    run_job = run_mpi_job if mode == "mpi" else run_gloo_job
    store = run_job(settings, parent_env, setup=publish, failure_details=_failure_details)

    return results_by_rank(store, settings.num_proc, "horovod.run()")


__all__ = ["run", "_HorovodArgs", "LaunchNotAvailableError"]
