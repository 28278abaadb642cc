"""What docs/timeline.md and ``--timeline-filename``'s help say about the timeline is what a real job writes:
recorded from ``hvd.init()`` on without ``start_timeline()``, nothing under ``DYNAMIC`` until it, and
DistributedOptimizer's gradient buckets named ``allreduce.bucket.<first parameter>+<n>``."""
from __future__ import annotations

import json
import re

import pytest

from horovod.engine import config
from runner_helpers import REPO, child_env

TORCH_WORKER = """
import torch
import horovod.torch as hvd
hvd.init()
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
hvd.allreduce(torch.ones(3), name="metric")
"""

NUMPY_WORKER = """
import numpy as np
import horovod.numpy as hvd
hvd.init()
hvd.allreduce(np.ones(3), name="before")
"""


def _rows(path):
    events = json.loads(path.read_text())
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e.get("args", {})]
    shapes = {}
    pid_name = {e["pid"]: e["args"]["name"] for e in events
                if e.get("name") == "process_name" and "name" in e.get("args", {})}
    for e in events:
        if e.get("ph") == "E" and "shape" in e.get("args", {}):
            shapes[pid_name[e["pid"]]] = e["args"]["shape"]
    return names, shapes


def test_the_help_says_when_a_timeline_is_written():
    text = config.KNOBS_BY_NAME["timeline"].help
    assert "from hvd.init() on" in text and "DYNAMIC" in text and "docs/timeline.md" in text, text
    assert (REPO / "docs" / "timeline.md").exists()


def test_a_timeline_file_is_written_from_init_without_start_timeline(hvdrun, script, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "t.json"
    result = hvdrun(["-np", "2", "--timeline-filename", str(path), "python", script(TORCH_WORKER)])
    assert result.returncode == 0, result.stderr[-3000:]
    names, shapes = _rows(path)
    # The docs' example, literally: a 8->4->2 MLP's four gradients in one bucket named after the last bias.
    doc = (REPO / "docs" / "timeline.md").read_text()
    assert "allreduce.bucket.2.bias+3" in doc and "`[46]`" in doc
    assert "allreduce.bucket.2.bias+3" in names and shapes["allreduce.bucket.2.bias+3"] == "[46]", (names, shapes)
    assert "allreduce.metric" in names
    assert all(re.fullmatch(r"allreduce\.(bucket\.[\w.]+\+\d+|metric)", n) for n in names), names


def test_dynamic_records_nothing_until_start_timeline(hvdrun, script, tmp_path):
    result = hvdrun(["-np", "2", "python", script(NUMPY_WORKER)],
                    env=child_env(HOROVOD_TIMELINE="DYNAMIC"), cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker.py"]   # no file named DYNAMIC, no trace
