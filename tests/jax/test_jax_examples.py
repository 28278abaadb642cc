"""The JAX example runs under the real launcher (``python -m horovod.runner -np 2 ...``) and does what it promises:
the digits MLP's loss falls epoch by epoch and it classifies the test set."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from jax_helpers import REPO, require_jax

require_jax()


def test_train_digits_loss_falls():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable,
                           os.path.join(REPO, "examples", "jax", "train_digits.py"), "--epochs", "4"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    epochs = re.findall(r"epoch (\d+): loss ([0-9.]+), test accuracy ([0-9.]+)", proc.stdout)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3, 4], proc.stdout
    losses = [float(loss) for _, loss, _ in epochs]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.3 * losses[0], losses
    assert float(epochs[-1][2]) > 0.85, epochs
