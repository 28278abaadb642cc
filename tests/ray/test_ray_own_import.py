"""Ray's own ``ray.train.horovod`` (still shipped by Ray 2.60) imports Horovod 0.28.1's internals.

Importing it must not blame horovod-next with a missing module: it must say what to use instead. No cluster is
started: the import alone is the test, in a fresh interpreter so Ray Train's modules do not stay in this one.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.train", reason="Ray's ray.train.horovod needs Ray Train: pip install 'ray[train]'",
                    exc_type=ImportError)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import horovod, os, sys
assert os.path.dirname(horovod.__file__) == os.path.join(sys.argv[1], "horovod"), horovod.__file__
try:
    from ray.train.horovod import HorovodTrainer
except ImportError as exc:
    print(type(exc).__name__ + ": " + str(exc))
else:
    print("imported")
"""


def test_ray_train_horovod_import_names_what_to_use():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", PROBE, ROOT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip()
    assert "No module named" not in said, said
    # What happened, why, and exactly what to import instead.
    assert said.startswith("ImportError: "), said
    assert "ray.train.horovod" in said, said
    assert "from horovod.ray import HorovodTrainer, HorovodConfig" in said, said
    assert "RayExecutor" in said, said
    assert "docs/ray.md" in said, said
