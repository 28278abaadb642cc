"""The driver side of a collectives run: one job per world size, launcher and repetition, each under a timeout,
their JSON lines collected.

Each library is launched as its own users launch it, in a job of its own: this project by ``horovodrun`` (or by
``mpirun`` on its mpi transport), torch.distributed's Gloo by ``torchrun`` (standalone rendezvous, no core
binding), Open MPI's mpi4py by ``mpirun``.  A peer never runs inside this project's job: ``horovodrun`` binds each
rank to a core, which made Gloo 13–22× slower at 4 KiB than under torchrun on the 2-core development machine."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from benchmarks._lib import launch
from benchmarks._lib.measure import MIB


class Runner:
    """Starts the jobs one by one, collects their JSON lines, and remembers what failed."""

    def __init__(self, args, tmp: str, script: str):
        # script: the entry point whose ``--worker SPEC`` runs a rank (benchmarks/_collectives/worker.py)
        self.args, self.tmp, self.script = args, tmp, script
        self.records: List[dict] = []
        self.failures: List[str] = []
        self.t_start = time.monotonic()
        self.seq = 0
        # how each library's jobs were started: "this project, shm" -> the command line (the run header prints them)
        self.launches: Dict[str, str] = {}

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def _spec(self, **spec) -> Tuple[str, str]:
        self.seq += 1
        out = os.path.join(self.tmp, f"job{self.seq}.jsonl")
        path = os.path.join(self.tmp, f"job{self.seq}.json")
        spec["out"] = out
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        return path, out

    def _collect(self, out: str, label: str) -> int:
        n = 0
        for path in [out] + [os.path.join(self.tmp, p) for p in sorted(os.listdir(self.tmp))
                             if p.startswith(os.path.basename(out) + ".rank")]:
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        rec.setdefault("job", label)
                        self.records.append(rec)
                        n += 1
        return n

    def note_launch(self, what: str, cmd: List[str], env_note: str = "") -> None:
        """Remember how ``what`` was launched (the world size shown as N, the spec file's path as SPEC)."""
        if what not in self.launches:
            shown = ["N" if i and cmd[i - 1] in ("-np", "--nproc-per-node") else "SPEC" if a.startswith(self.tmp)
                     else os.path.relpath(a) if a == self.script else a for i, a in enumerate(cmd)]
            shown = [a for a in shown if a != "--oversubscribe"]
            if any(os.path.basename(a) == "mpirun" for a in cmd[:1]):
                env_note = ", ".join(x for x in (env_note, "--oversubscribe added when N > cores") if x)
            self.launches[what] = f"`{shlex.join(shown)}`" + (f" ({env_note})" if env_note else "")

    def run(self, label: str, cmd: List[str], env: Dict[str, str], out: str, timeout: float,
            start: Optional[Callable[[], launch.JobResult]] = None) -> bool:
        """Run one job under ``timeout`` (``start``: how, when it is not ``cmd`` in ``env`` as one process tree),
        collect its records; False (and a failure noted) when it failed."""
        self.log(f"{label}: starting")
        t0 = time.monotonic()
        res = start() if start is not None else launch.run_job(cmd, env, timeout)
        n = self._collect(out, label)
        done = any(r.get("kind") == "done" for r in self.records if r.get("job") == label)
        if not res.ok:
            msg = f"{label}: {res.describe(2000)}"
            self.failures.append(msg)
            self.log(f"{label}: FAILED after {time.monotonic() - t0:.0f} s ({n} results kept)\n{msg}")
            return False
        self.log(f"{label}: done in {time.monotonic() - t0:.0f} s ({n} results{'' if done else ', incomplete'})")
        return True

    def common(self) -> dict:
        a = self.args
        return {"ops": a.ops, "sizes": a.sizes, "rounds": a.rounds, "sample_s": a.sample_ms / 1000.0,
                "max_iters": 5000, "lat_iters": a.lat_iters, "lat_block": 100, "fusion_reps": a.fusion_reps,
                "fusion_rounds": a.fusion_rounds, "fusion_inline_variants": not a.quick, "timeout": 120.0}

    def hvd_job(self, np_: int, transport: str, phases: List[str], rep: int = 0, torch: bool = False) -> None:
        """This project under ``horovodrun`` (its engine, a raw transport beside it, and with ``torch`` the
        horovod.torch binding), as its users launch it: the launcher binds each rank to its cores."""
        label = f"np={np_} horovodrun {transport} rep {rep}"
        path, out = self._spec(kind="hvd", job=label, transport=transport, torch=torch, phases=phases, rep=rep,
                               **self.common())
        cmd = launch.horovodrun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                     ["--start-timeout", "120"])
        self.note_launch(f"this project, {transport}", cmd, f"HOROVOD_TRANSPORT={transport}")
        env = launch.repo_env({"HOROVOD_TRANSPORT": transport})
        self.run(label, cmd, env, out, self.args.job_timeout)

    def mpi_job(self, np_: int, phases: List[str], rep: int = 0) -> None:
        """This project on its mpi transport, under ``mpirun`` (how its users start it on MPI)."""
        label = f"np={np_} mpirun hvd rep {rep}"
        path, out = self._spec(kind="mpi", job=label, phases=phases, rep=rep, **self.common())
        cmd = launch.mpirun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                 shlex.split(self.args.mpirun_args))
        self.note_launch("this project, mpi", cmd, "HOROVOD_TRANSPORT=mpi")
        self.run(label, cmd, launch.mpi_env({"HOROVOD_TRANSPORT": "mpi"}), out, self.args.job_timeout)

    def gloo_job(self, np_: int, phases: List[str], rep: int = 0) -> None:
        """torch.distributed on Gloo in its own ``torchrun`` job: standalone rendezvous, no core binding, the
        threads torchrun sets (see :func:`benchmarks._lib.launch.torchrun_env`)."""
        label = f"np={np_} torchrun gloo rep {rep}"
        path, out = self._spec(kind="gloo", job=label, phases=phases, rep=rep, **self.common())
        cmd = self.gloo_cmd(np_, path)
        self.note_launch("torch Gloo", cmd, "OMP_NUM_THREADS and HOROVOD_* unset in its environment")
        self.run(label, cmd, launch.torchrun_env(), out, self.args.job_timeout)

    def gloo_cmd(self, np_: int, spec_path: str) -> List[str]:
        """The command line of the Gloo peer's job."""
        return launch.torchrun_cmd(np_, [self.script, "--worker", spec_path])

    def openmpi_job(self, np_: int, phases: List[str], rep: int = 0) -> None:
        """mpi4py on Open MPI in its own ``mpirun`` job (nothing of this project in its processes)."""
        label = f"np={np_} mpirun openmpi rep {rep}"
        path, out = self._spec(kind="openmpi", job=label, phases=phases, rep=rep, **self.common())
        cmd = launch.mpirun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                 shlex.split(self.args.mpirun_args))
        self.note_launch("Open MPI (mpi4py)", cmd)
        self.run(label, cmd, launch.mpi_env(), out, self.args.job_timeout)

    def memory_job(self, impl: str, transport: Optional[str]) -> None:
        label = f"memory {impl}" + (f" {transport}" if transport else "")
        path, out = self._spec(kind="memory", job=label, rss_impl=impl, rss_bytes=64 * MIB, transport=transport,
                               timeout=120.0)
        argv = [sys.executable, self.script, "--worker", path]
        if impl == "openmpi":
            cmd = launch.mpirun_cmd(2, argv, shlex.split(self.args.mpirun_args))
            env = launch.mpi_env()
        elif impl == "gloo":  # its own job, as for the sweep
            cmd, env = self.gloo_cmd(2, path), launch.torchrun_env()
        else:
            cmd = launch.horovodrun_cmd(2, argv, ["--start-timeout", "120"])
            env = launch.repo_env({"HOROVOD_TRANSPORT": transport} if transport else None)
        if self.run(label, cmd, env, out, 180):
            for rec in self.records:
                if rec.get("job") == label:
                    rec["transport"] = transport

    def raw_job(self, np_: int, transport: str, options: dict, phases: List[str]) -> None:
        """A transport alone (``benchmarks/transports.py``): horovodrun for shm and tcp, mpirun for mpi."""
        label = f"np={np_} {transport} transport" + (f" {options}" if options else "")
        path, out = self._spec(kind="raw", job=label, transport=transport, options=options, phases=phases,
                               **self.common())
        argv = [sys.executable, self.script, "--worker", path]
        if transport == "mpi":
            cmd, env = launch.mpirun_cmd(np_, argv, shlex.split(self.args.mpirun_args)), launch.mpi_env()
        else:
            cmd = launch.horovodrun_cmd(np_, argv, ["--start-timeout", "120"])
            env = launch.repo_env({"HOROVOD_TRANSPORT": transport})
        self.run(label, cmd, env, out, self.args.job_timeout)
