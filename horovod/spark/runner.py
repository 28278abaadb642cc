"""``horovod.spark.run`` and ``horovod.spark.run_elastic``: a Horovod job whose ranks are Spark tasks.

pyspark is imported only when a job runs, so ``import horovod.spark`` is cheap and works without it.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Union

import cloudpickle

import horovod.spark.driver as sd
from horovod.runner.hosts import parse_nics

logger = logging.getLogger(__name__)


def _num_proc(sc, num_proc: Optional[int], verbose: int) -> int:
    if num_proc is None:
        num_proc = sc.defaultParallelism
        if verbose >= 1:
            logger.info("Running %d processes (inferred from spark.default.parallelism)...", num_proc)
    elif verbose >= 1:
        logger.info("Running %d processes...", num_proc)
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"num_proc must be a positive integer (one Spark task per Horovod process), got {num_proc!r}")
    return num_proc


def _payload(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> bytes:
    if not callable(fn):
        raise TypeError(f"horovod.spark.run(): fn must be callable, got {type(fn).__name__}")
    try:
        return cloudpickle.dumps(functools.partial(fn, *args, **(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"horovod.spark.run(): fn and its arguments must be picklable by cloudpickle to reach the "
                        f"Spark tasks: {exc}") from exc


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None, verbose: int = 1,
        nics: Union[None, str, Sequence[str]] = None, prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` as a Horovod job of ``num_proc`` Spark tasks; every rank's result, by rank.

    The tasks are one barrier stage (all scheduled together or not at all); each runs its rank as a child
    process that may call ``hvd.init()``. Ranks of one host get consecutive numbers and shared memory.

    Args:
        fn: the function; it and its arguments travel to the executors with cloudpickle.
        args, kwargs: its arguments.
        num_proc: Horovod processes = Spark tasks (default: ``spark.default.parallelism``).
        start_timeout: seconds for the tasks to be scheduled and start (default ``HOROVOD_SPARK_START_TIMEOUT``,
            else 600).
        use_mpi, use_gloo: the controller (not both). Default: the built-in one (shared memory within a
            host, TCP across hosts, no MPI needed). ``use_mpi=True`` starts the ranks with Open MPI's ``mpirun``
            (its daemons run in the Spark tasks), as the original did.
        extra_mpi_args: more ``mpirun`` arguments (``use_mpi=True``).
        env: the workers' environment (default: the driver's ``os.environ``); Horovod's variables go on top.
        stdout, stderr: where the ranks' tagged output goes (default: this process's streams).
        verbose: 0 quiet, 1 log the process count, 2 also the rank layout.
        nics: network interfaces for the job (the store binds to the first one's address).
        prefix_output_with_timestamp: put the time before every forwarded line.
        executable: the workers' Python interpreter (default: the one running each Spark task).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RuntimeError: no active SparkContext; a rank failed (the message names it and carries its traceback);
            the Spark job failed.
        TimeoutError: the tasks did not start in time (the original's "Timed out waiting for Spark tasks to
            start..." message).
        ValueError: bad arguments.
        NotImplementedError: ``use_mpi=True`` without Open MPI's ``mpirun`` or mpi4py.
    """
    if use_gloo and use_mpi:
        raise ValueError("horovod.spark.run(): give either use_gloo or use_mpi, not both")
    sc = sd.active_spark_context()
    timeout = sd.start_timeout(start_timeout, os.environ)
    num_proc = _num_proc(sc, num_proc, verbose)
    payload = _payload(fn, args, kwargs)
    job_args = (sc, num_proc, timeout, dict(os.environ) if env is None else dict(env), parse_nics(nics))
    job_kwargs: Dict[str, Any] = dict(stdout=stdout, stderr=stderr, prefix_timestamp=prefix_output_with_timestamp,
                                      executable=executable, verbose=verbose)
    from horovod.spark.driver_static import StaticSparkJob

    job: StaticSparkJob
    if use_mpi:
        from horovod.spark.driver_mpi import MpiSparkJob

        job = MpiSparkJob(*job_args, extra_mpi_args=extra_mpi_args, **job_kwargs)
    else:
        job = StaticSparkJob(*job_args, **job_kwargs)
    return job.run(payload)


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
                elastic_timeout: Optional[float] = None, reset_limit: Optional[int] = None,
                env: Optional[Dict[str, str]] = None, stdout: Optional[IO[str]] = None,
                stderr: Optional[IO[str]] = None, verbose: int = 1, nics: Union[None, str, Sequence[str]] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None) -> List[Any]:
    """Run ``fn`` as an elastic Horovod job on Spark tasks; the results of the last epoch's ranks, by rank.

    Every Spark task (every attempt of it) is a host of one slot. A task whose worker fails is failed, and
    Spark retries it; the retry joins the job as a new host. The survivors restore their last commit and go
    on (``fn`` must use ``hvd.elastic.run`` and a ``State``). Between ``min_num_proc`` and ``max_num_proc``
    workers train; below ``min_num_proc`` the job waits up to ``elastic_timeout`` for tasks to come back.

    Args:
        fn, args, kwargs: as for :func:`run`.
        num_proc: tasks to start with (default: ``spark.default.parallelism``).
        min_num_proc, max_num_proc: fewest / most workers (default: ``num_proc``; the original documented
            ``min = max = num_proc``, fault tolerance only).
        start_timeout: as for :func:`run`.
        elastic_timeout: seconds to wait for ``min_num_proc`` workers (default ``HOROVOD_ELASTIC_TIMEOUT``,
            else 600).
        reset_limit: most resets (default: unlimited).
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp: as for :func:`run`.
        min_np, max_np: deprecated spellings of ``min_num_proc`` / ``max_num_proc``.
    """
    if min_np is not None and min_num_proc is None:
        min_num_proc = min_np
    if max_np is not None and max_num_proc is None:
        max_num_proc = max_np
    sc = sd.active_spark_context()
    timeout = sd.start_timeout(start_timeout, os.environ)
    num_proc = _num_proc(sc, num_proc, verbose)
    payload = _payload(fn, args, kwargs)
    from horovod.spark.elastic import ElasticSparkJob

    job = ElasticSparkJob(sc, num_proc=num_proc, min_np=min_num_proc if min_num_proc is not None else num_proc,
                          max_np=max_num_proc if max_num_proc is not None else num_proc, start_timeout=timeout,
                          elastic_timeout=elastic_timeout, reset_limit=reset_limit,
                          env=dict(os.environ) if env is None else dict(env), nics=parse_nics(nics), stdout=stdout,
                          stderr=stderr, prefix_timestamp=prefix_output_with_timestamp)
    return job.run(payload)
