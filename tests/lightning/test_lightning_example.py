"""examples/lightning/train_digits.py under the real launcher (``python -m horovod.runner -np 2``): rank 0 prints
one line per epoch, the loss falls, the digits are classified, and the best checkpoint is the only file written."""
from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_digits_example_under_horovodrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable,
                           os.path.join(REPO, "examples", "lightning", "train_digits.py"), "--epochs", "3",
                           "--checkpoint-dir", str(ckpt)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    epochs = re.findall(r"epoch (\d+): loss ([0-9.]+), val accuracy ([0-9.]+) \(2 ranks\)", out)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3], out
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < 0.5 * losses[0], losses
    final = re.search(r"final: val loss ([0-9.]+), val accuracy ([0-9.]+)", out)
    assert final and float(final.group(2)) > 0.85, out
    assert out.count("final:") == 1, "only rank 0 prints"
    assert len(os.listdir(ckpt)) == 1 and os.listdir(ckpt)[0].endswith(".ckpt"), os.listdir(ckpt)
