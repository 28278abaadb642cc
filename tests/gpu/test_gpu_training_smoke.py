"""benchmarks/gpu_training.py's logic on the CPU (torch on CPU tensors, DDP on Gloo, np = 1, a tiny model): the
device run's training comparison must not fail on a bug a CPU can show."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_training_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "training.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=REPO, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_training.py", "--device", "cpu", "--np", "1", "--models",
                           "tiny", "--blocks", "1", "--block-steps", "2", "--warmup", "1", "--calls", "10",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    sides = run["models"]["tiny"]
    assert run["np"] == 1 and sides["horovod"]["samples_per_sec"] > 0 and sides["ddp"]["samples_per_sec"] > 0, run
    assert set(run["host_us_per_call"]) == {"horovod", "ddp"}
    assert "| tiny | 1 |" in proc.stdout
