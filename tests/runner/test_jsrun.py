"""``horovodrun --jsrun`` (LSF): the command line built from the LSF environment, and a run through a stand-in
``jsrun`` on PATH that starts the ranks with Open MPI's mpirun (there is no LSF cluster on this machine)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from horovod.runner import js_run
from horovod.runner.hosts import HostInfo, get_host_assignments
from runner_helpers import CALL_TIMEOUT_S, child_env, launcher_argv

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None

STAND_IN = """#!{python}
# Stand-in for LSF's jsrun: record the call and the ERF, then start one process per ERF rank with mpirun.
import json, os, sys
argv = sys.argv[1:]
erf = argv[argv.index("--erf_input") + 1]
with open(erf) as f:
    lines = f.read().splitlines()
with open({log!r}, "w") as f:
    json.dump({{"argv": argv, "erf": lines}}, f)
i = 0
while argv[i].startswith("--"):
    i += 2   # every jsrun option here takes one value
ranks = sum(1 for line in lines if line.startswith("rank:"))
os.execvp("mpirun", ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *argv[i:]])
"""

WORKER = """
import numpy as np
import horovod.numpy as hvd
hvd.init()
print("SUM", hvd.rank(), hvd.size(), hvd.allreduce(np.ones(2) * (hvd.rank() + 1), op=hvd.Sum).tolist(), flush=True)
"""


def test_lsf_hosts_skip_the_launch_node_and_keep_the_slots():
    hosts = js_run.lsf_hosts({"LSB_MCPU_HOSTS": "batch3 1 c01 4 c02 4"})
    assert [(h.hostname, h.slots) for h in hosts] == [("c01", 4), ("c02", 4)]
    with pytest.raises(ValueError, match="LSF job"):
        js_run.lsf_hosts({})
    with pytest.raises(ValueError, match="alternate"):
        js_run.lsf_hosts({"LSB_MCPU_HOSTS": "c01 4 c02"})


def test_erf_and_command_line():
    slots = get_host_assignments([HostInfo("c01", 2), HostInfo("c02", 2)], 3)
    assert js_run.erf_lines(slots) == [
        "overlapping_rs: allow", "cpu_index_using: logical",
        "rank: 0: { hostname: c01; cpu: {0} ; mem: * }",
        "rank: 1: { hostname: c01; cpu: {1} ; mem: * }",
        "rank: 2: { hostname: c02; cpu: {0} ; mem: * }"]
    assert js_run.jsrun_command("/t/r.erf", ["python", "t.py"], mpi_args="-gpu", output_filename="out") == [
        "jsrun", "--erf_input", "/t/r.erf", "--smpiargs", "-gpu", "--stdio_stdout", "out", "--stdio_stderr", "out",
        "python", "t.py"]
    assert js_run.jsrun_command("/t/r.erf", ["x"], binding_args="--rs_per_host 2")[:3] == [
        "jsrun", "--rs_per_host", "2"]


def test_without_jsrun_on_path_the_launcher_says_so(tmp_path):
    env = child_env(PATH=os.path.dirname(sys.executable), LSB_MCPU_HOSTS="c01 2")
    proc = subprocess.run(launcher_argv(["--jsrun", "python", "-c", "pass"]), env=env, capture_output=True,
                          text=True, timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "jsrun is not on PATH" in proc.stderr, proc.stderr


@pytest.mark.skipif(not HAVE_MPI, reason="the stand-in jsrun starts the ranks with mpirun (needs mpi4py too)")
def test_a_job_through_a_stand_in_jsrun(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "jsrun.json"
    (bindir / "jsrun").write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    (bindir / "jsrun").chmod(0o755)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = child_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", LSB_MCPU_HOSTS="batch1 1 localhost 2",
                    OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(launcher_argv(["--jsrun", "--fusion-threshold-mb", "8", sys.executable, str(worker)]),
                          env=env, capture_output=True, text=True, timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"SUM (\d) 2 \[3\.0, 3\.0\]", proc.stdout)) == ["0", "1"], proc.stdout
    call = json.loads(log.read_text())
    assert call["argv"][0] == "--erf_input" and call["argv"][2:] == [sys.executable, str(worker)]
    assert call["erf"][2:] == ["rank: 0: { hostname: localhost; cpu: {0} ; mem: * }",
                               "rank: 1: { hostname: localhost; cpu: {1} ; mem: * }"]
