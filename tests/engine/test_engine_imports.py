"""The engine is framework-free, and the binding's queries behave before init.  Checked in fresh interpreters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_helpers import NOT_INITIALIZED, REPO_DIR

FRAMEWORKS = ("torch", "tensorflow", "mxnet", "keras", "jax", "tf_keras")

NO_FRAMEWORKS = r"""
import importlib, json, pkgutil, sys

FRAMEWORKS = %r
attempts = []

class Recorder:
    # records every attempt to import a framework, even one that is not installed or is caught by the importer
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FRAMEWORKS:
            attempts.append(name)
        return None

sys.meta_path.insert(0, Recorder())
import horovod.engine
modules = []
for pkg in ("horovod.engine", "horovod.common"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.iter_modules(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        modules.append(info.name)
import numpy as np
import horovod.numpy as hvd
hvd.init()
hvd.allreduce(np.ones(3), name="x")
hvd.allgather(np.ones(2), name="y")
hvd.broadcast_object({"a": 1})
hvd.shutdown()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FRAMEWORKS)
print(json.dumps({"modules": modules, "attempts": sorted(set(attempts)), "loaded": loaded}))
""" % (FRAMEWORKS,)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))}
    env["PYTHONPATH"] = REPO_DIR
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_engine_never_imports_a_framework():
    proc = _python(NO_FRAMEWORKS)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "horovod.engine.runtime" in out["modules"] and "horovod.engine.negotiation" in out["modules"]
    assert out["loaded"] == [], f"framework modules loaded: {out['loaded']}"
    assert out["attempts"] == [], f"framework imports attempted: {out['attempts']}"


BEFORE_INIT = r"""
import json
import horovod.numpy as hvd
out = {}
for q in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous"):
    try:
        out[q] = ["returned", repr(getattr(hvd, q)())]
    except Exception as exc:
        out[q] = [type(exc).__name__, str(exc)]
out["is_initialized"] = hvd.is_initialized()
hvd.init()
out["after"] = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.is_initialized()]
hvd.shutdown()
out["after_shutdown"] = hvd.is_initialized()
print(json.dumps(out))
"""


def test_rank_queries_before_init_raise_the_documented_value_error():
    proc = _python(BEFORE_INIT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for q in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"):
        assert out[q] == ["ValueError", NOT_INITIALIZED], (q, out[q])
    assert out["is_initialized"] is False
    # a plain `python script.py` (no launcher) is a job of one
    assert out["after"] == [0, 1, 0, 1, True]
    assert out["after_shutdown"] is False
