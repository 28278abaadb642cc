"""``strategy="horovod"`` resolves for a user who imports ``horovod.torch`` or ``horovod.lightning``, before or after
Lightning, under both package names; ``import horovod`` alone imports neither torch nor Lightning.  Each case runs
in a fresh interpreter (one process, no launcher: Horovod runs as a single rank)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESOLVE = r"""
import importlib, json, sys
imports = %r
loaded = {}
for name in imports:
    importlib.import_module(name)
    loaded[name] = sorted(m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules)
result = {"loaded": loaded, "strategies": {}}
for package in ("lightning.pytorch", "pytorch_lightning"):
    if package.split(".")[0] not in sys.modules:
        continue
    pl = importlib.import_module(package)
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False)
    s = trainer.strategy
    result["strategies"][package] = [type(s).__module__, type(s).__name__, type(s.cluster_environment).__name__,
                                     trainer.world_size, trainer.global_rank]
print(json.dumps(result))
"""


def _run(imports):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", RESOLVE % (list(imports),)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"imports {imports}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


LIGHTNING = ["horovod.lightning.strategy", "HorovodStrategy", "HorovodEnvironment", 1, 0]
PL = ["horovod.lightning.pl_strategy", "HorovodStrategy", "HorovodEnvironment", 1, 0]


def test_horovod_first_then_both_lightning_packages():
    pytest.importorskip("pytorch_lightning")
    out = _run(["horovod", "horovod.torch", "lightning.pytorch", "pytorch_lightning"])
    assert out["loaded"]["horovod"] == [], "import horovod must not import torch or Lightning"
    assert out["loaded"]["horovod.torch"] == ["torch"], out["loaded"]
    assert out["strategies"] == {"lightning.pytorch": LIGHTNING, "pytorch_lightning": PL}, out


def test_lightning_first_then_horovod_lightning():
    out = _run(["lightning.pytorch", "horovod.lightning"])
    assert out["strategies"] == {"lightning.pytorch": LIGHTNING}, out


def test_reduce_op_names_map_to_horovod_ops():
    torch = pytest.importorskip("torch")
    import horovod.torch as hvd
    from horovod.lightning._collectives import reduce_op

    ReduceOp = torch.distributed.ReduceOp
    cases = {None: hvd.Average, "mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
             "min": hvd.Min, "SUM": hvd.Sum, ReduceOp.SUM: hvd.Sum, ReduceOp.AVG: hvd.Average,
             ReduceOp.MAX: hvd.Max, ReduceOp.MIN: hvd.Min, ReduceOp.PRODUCT: hvd.Product}
    for op, want in cases.items():
        assert reduce_op(op) == want, op
    for bad in ("median", ReduceOp.BAND):
        with pytest.raises(ValueError, match="unsupported reduce_op"):
            reduce_op(bad)
