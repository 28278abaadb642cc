"""The PyTorch examples run under the real launcher (``python -m horovod.runner -np 2 ...``) and do what they
promise: the digits MLP's loss falls and it classifies the test set; the synthetic benchmark prints its
throughput lines.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _horovodrun(script: str, *args: str, np_: int = 2) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable,
                           os.path.join(REPO, "examples", "torch", script), *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_train_digits_loss_falls():
    out = _horovodrun("train_digits.py", "--epochs", "5")
    epochs = re.findall(r"epoch (\d+): loss ([0-9.]+), test accuracy ([0-9.]+), [0-9.]+ s, [0-9]+ samples/s", out)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3, 4, 5], out
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(epochs[-1][2]) > 0.85, epochs


def test_synthetic_benchmark_reports_throughput():
    out = _horovodrun("synthetic_benchmark.py", "--num-iters", "2", "--num-batches-per-iter", "2",
                      "--num-warmup-batches", "1", "--fp16-allreduce")
    assert re.search(r"Iter #1: [0-9.]+ img/sec per CPU", out), out
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+ \+-[0-9.]+", out), out
