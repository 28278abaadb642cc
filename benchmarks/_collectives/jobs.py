"""The driver side of a collectives run: one job per world size and launcher, each under a timeout, their JSON
lines collected."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Dict, List, Optional, Tuple

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

    def run(self, label: str, cmd: List[str], env: Dict[str, str], out: str, timeout: float) -> bool:
        self.log(f"{label}: starting")
        t0 = time.monotonic()
        res = launch.run_job(cmd, env, timeout)
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

    def hvd_job(self, np_: int, transport: str, gloo: bool, phases: List[str]) -> None:
        label = f"np={np_} horovodrun {transport}" + (" + gloo" if gloo else "")
        path, out = self._spec(kind="hvd", job=label, transport=transport, gloo=gloo,
                               gloo_port=launch.free_port(), phases=phases, **self.common())
        cmd = launch.horovodrun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                     ["--start-timeout", "120"])
        env = launch.repo_env({"HOROVOD_TRANSPORT": transport})
        self.run(label, cmd, env, out, self.args.job_timeout)

    def mpi_job(self, np_: int, phases: List[str]) -> None:
        label = f"np={np_} mpirun"
        path, out = self._spec(kind="mpi", job=label, phases=phases, **self.common())
        cmd = launch.mpirun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                 shlex.split(self.args.mpirun_args))
        self.run(label, cmd, launch.mpi_env({"HOROVOD_TRANSPORT": "mpi"}), out, self.args.job_timeout)

    def memory_job(self, impl: str, transport: Optional[str]) -> None:
        label = f"memory {impl}" + (f" {transport}" if transport else "")
        path, out = self._spec(kind="memory", job=label, rss_impl=impl, rss_bytes=64 * MIB,
                               gloo_port=launch.free_port(), transport=transport, timeout=120.0)
        argv = [sys.executable, self.script, "--worker", path]
        if impl == "openmpi":
            cmd = launch.mpirun_cmd(2, argv, shlex.split(self.args.mpirun_args))
            env = launch.mpi_env()
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
