"""The MXNet examples run end to end under ``horovodrun -np 2``, learn, and leave rank 0's checkpoints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mxnet_helpers import REPO, WORKER_ENV, mxnet_unavailable

_WHY = mxnet_unavailable()
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)
pytest.importorskip("sklearn", reason="the examples train on scikit-learn's bundled digits")


def _horovodrun(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(WORKER_ENV)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable,
           os.path.join(REPO, "examples", "mxnet", script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=150)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def test_gluon_example(tmp_path):
    out = _horovodrun("mxnet_gluon_digits.py", "--epochs", "3", "--checkpoint-dir", str(tmp_path))
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(accuracies) == 3, out[-3000:]
    assert accuracies[-1] > 0.85, out[-3000:]
    assert sorted(os.listdir(tmp_path)) == [f"digits-gluon-{e:04d}.params" for e in range(3)]


def test_module_example(tmp_path):
    out = _horovodrun("mxnet_module_digits.py", "--epochs", "3", "--checkpoint-dir", str(tmp_path))
    match = re.search(r"test accuracy ([0-9.]+)", out)
    assert match and float(match.group(1)) > 0.85, out[-3000:]
    assert {f"digits-module-{e:04d}.params" for e in (1, 2, 3)} <= set(os.listdir(tmp_path))
    assert "digits-module-symbol.json" in os.listdir(tmp_path)
