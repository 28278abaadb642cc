"""The hang doctor in a ``horovodrun`` elastic job (a discovery script on localhost): the same planted hang in every
epoch; the driver collects each epoch's dumps when rank 0 reports the stall, the dumps of the epochs stay apart
(``g<epoch>-…`` file names), and the job's failure at the reset limit carries the latest epoch's verdict."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from horovod.doctor import report
from test_planted_hangs import job_env

pytestmark = pytest.mark.slow

PLANTED = Path(__file__).resolve().parent / "planted_elastic.py"


def marker(role: str) -> str:
    for number, text in enumerate(PLANTED.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# HANG:elastic_skip:{role}"):
            return f"planted_elastic.py:{number} (`{text.strip()}`)"
    raise AssertionError(f"no marker elastic_skip:{role}")


def test_each_epoch_is_collected_and_the_failure_names_the_latest(tmp_path):
    hosts = tmp_path / "discover.sh"
    hosts.write_text("#!/bin/sh\necho localhost:2\n")
    hosts.chmod(0o755)
    argv = [sys.executable, "-m", "horovod.runner", "-np", "2", "--min-np", "2", "--reset-limit", "1",
            "--host-discovery-script", str(hosts), sys.executable, str(PLANTED)]
    env = job_env(tmp_path, "shm", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="4")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    finding = (f"rank 1 skipped allreduce 'grad.fc2.weight' (the others' collective #15) and went on to allgather "
               f"'stats', the collective that followed it in earlier steps, at {marker('culprit')}; rank 0 waits in "
               f"it ({marker('waiter')})")
    # Each epoch was collected at its stall warning (every rank signalled, each epoch's verdict its own) ...
    for epoch in (0, 1):
        assert f"Horovod doctor (2 of 2 ranks dumped, generation {epoch}):\n  - {finding}" in output, output[-4000:]
    before_failure = output.split("exceeded limit: 1", 1)[0]
    assert before_failure.count("after rank 0 reported a stall warning") == 2, output[-4000:]
    dumps = tmp_path / "dumps"
    generations = {json.loads(p.read_text())["generation"] for p in dumps.glob("g*-rank*.json")}
    assert generations == {0, 1}, generations
    assert json.loads((dumps / "launcher.json").read_text())["generation"] == 1
    earlier = "\n".join(report(str(dumps), generation=0))   # python -m horovod.doctor DIR --generation 0
    assert f"Horovod doctor (2 of 2 ranks dumped, generation 0):\n  - {finding}" in earlier, earlier
    # ... and the failure message ends with the latest epoch's.
    failure = output.split("exceeded limit: 1", 1)[-1]
    assert f"Horovod doctor (2 of 2 ranks dumped, generation 1):\n  - {finding}" in failure, output[-4000:]
