"""``horovodrun --mpi`` and ``horovod.run(use_mpi=True)`` on this machine with the real mpirun.

The pieces that need no MPI (tag rewriting, failure parsing, environment, ssh arguments) run everywhere; the
rest is skipped with the reason when mpirun or mpi4py is missing.  Runs across hosts are in test_ssh_hosts.py.
"""
from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys

import pytest

from horovod.runner import mpi_job, mpi_run
from horovod.runner.job import JobSettings
from horovod.runner.hosts import HostInfo
from runner_helpers import CALL_TIMEOUT_S, REPO, child_env, launcher_argv

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpirun and mpi4py are not installed")

OMPI5 = mpi_run.MpiImplementation(mpi_run.OPENMPI, (5, 0, 11))
OMPI4 = mpi_run.MpiImplementation(mpi_run.OPENMPI, (4, 1, 5))
MPICH = mpi_run.MpiImplementation(mpi_run.MPICH, (4, 1, 2))

OMPI5_FAILURE = """--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-23096@1,1]
   Exit code:    3
--------------------------------------------------------------------------
"""
OMPI4_FAILURE = """--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[36765,1],2]
  Exit code:    9
--------------------------------------------------------------------------
"""
OMPI4_SIGNAL = "mpirun noticed that process rank 3 with PID 4242 on node worker7 exited on signal 9 (Killed).\n"
OMPI5_SIGNAL = "prterun noticed that process rank 1 with PID 9049 on node vm exited on\nsignal 15 (Terminated).\n"


def _env(**extra):
    env = child_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def _hvdrun(args, env=None, timeout=CALL_TIMEOUT_S):
    return subprocess.run(launcher_argv(args), capture_output=True, text=True, timeout=timeout, env=env or _env(),
                          cwd=str(REPO), stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------ no MPI needed

@pytest.mark.parametrize("impl, raw, expected", [
    (OMPI5, b"[1,3]<stdout>: hello\n", (3, "stdout", b"hello\n")),
    (OMPI5, b"[1,0]<stderr>:  indented\n", (0, "stderr", b" indented\n")),
    (OMPI4, b"[1,12]<stdout>:hello\n", (12, "stdout", b"hello\n")),
    (OMPI5, b"prterun detected a failure\n", (None, "stderr", b"prterun detected a failure\n")),
    (MPICH, b"[2] hello\n", (2, "stderr", b"hello\n")),
])
def test_rank_tags_are_rewritten(impl, raw, expected):
    assert mpi_job.MpiOutput(impl).rewrite(raw, "stderr") == expected


def test_forwarded_lines_look_like_the_builtin_launchers(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    forward = mpi_job.MpiOutput(OMPI5, output_dir=str(tmp_path), size=2, stdout=out, stderr=err)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    os.write(w_out, b"[1,1]<stdout>: one\nunrelated mpirun chatter\n")
    os.write(w_err, b"[1,0]<stderr>: oops\n")
    os.close(w_out)
    os.close(w_err)
    forward.attach({"stdout": os.fdopen(r_out, "rb"), "stderr": os.fdopen(r_err, "rb")})
    forward.finish()
    assert out.getvalue().splitlines() == ["[1]<stdout>:one", "unrelated mpirun chatter"]
    assert err.getvalue() == "[0]<stderr>:oops\n"
    assert (tmp_path / "rank.1" / "stdout").read_text() == "one\n"
    assert (tmp_path / "rank.0" / "stderr").read_text() == "oops\n"
    assert list(forward.untagged) == ["unrelated mpirun chatter\n"]


@pytest.mark.parametrize("text, fragment, rank", [
    (OMPI5_FAILURE, "exit code 1: the first process to fail was rank 1, which exited with code 3", 1),
    (OMPI4_FAILURE, "the first process to fail was rank 2, which exited with code 9", 2),
    (OMPI4_SIGNAL, "rank 3 on worker7, which was killed by signal 9", 3),
    (OMPI5_SIGNAL, "rank 1 on vm, which was killed by signal 15", 1),
    ("something else\n", "mpirun failed with exit code 1 and did not say which process failed", None),
])
def test_failures_name_the_first_rank(text, fragment, rank):
    message, first = mpi_job.describe_failure(1, text.splitlines(keepends=True))
    assert fragment in message
    assert (first.rank if first else None) == rank


def test_environment_of_the_ranks():
    settings = JobSettings(num_proc=2, hosts=[HostInfo("localhost", 2)], command=["x"],
                           knob_env={"HOROVOD_FUSION_THRESHOLD": "1048576"}, nics=["eth1"])
    env = mpi_job.mpi_env({"PATH": "/bin", "HOROVOD_RANK": "5", "_HOROVOD_SECRET_KEY": "ab" * 32,
                           "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "OMPI_COMM_WORLD_RANK": "1",
                           "BASH_FUNC_x%%": "() { :; }", "PWD": "/w"}, settings)
    assert "HOROVOD_RANK" not in env and "_HOROVOD_SECRET_KEY" not in env   # another job's identity
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in env
    assert env["HOROVOD_FUSION_THRESHOLD"] == "1048576" and env["PYTHONUNBUFFERED"] == "1"
    assert env["HOROVOD_GLOO_IFACE"] == "eth1"
    names = mpi_job.exported_names(env)
    assert "PATH" in names and "HOROVOD_FUSION_THRESHOLD" in names
    assert not {"OMPI_COMM_WORLD_RANK", "BASH_FUNC_x%%", "PWD"} & set(names)


def test_mpi_ranks_get_the_builtin_launchers_thread_and_binding_defaults():
    from horovod.runner.threads import default_omp_threads

    settings = JobSettings(num_proc=3, hosts=[HostInfo("localhost", 2), HostInfo("far", 1)], command=["x"])
    env = mpi_job.mpi_env({"PATH": "/bin"}, settings)
    # one environment for every rank: the busiest host's share
    assert env["OMP_NUM_THREADS"] == str(default_omp_threads(2)) and env["HOROVOD_BIND_CORES"] == "1"
    assert {"OMP_NUM_THREADS", "HOROVOD_BIND_CORES"} <= set(mpi_job.exported_names(env))
    mine = mpi_job.mpi_env({"OMP_NUM_THREADS": "7", "HOROVOD_BIND_CORES": "0"}, settings)
    assert (mine["OMP_NUM_THREADS"], mine["HOROVOD_BIND_CORES"]) == ("7", "0")   # the user's values win
    settings.binding_args = "--bind-to core --map-by slot"   # mpirun binds: the workers do not bind again
    assert mpi_job.mpi_env({}, settings)["HOROVOD_BIND_CORES"] == "0"
    assert [mpi_job.mpi_binds(a) for a in ("-bind-to none", "--bind-to=socket", "-bind-to core", None, "-x A")] == [
        False, True, True, False, False]


def test_ssh_arguments_for_open_mpi():
    assert mpi_job.ssh_mpi_args(OMPI5, 2222, "/k", None) == [
        "--mca", "plm_ssh_args", "-p 2222 -i /k -o BatchMode=yes -o StrictHostKeyChecking=no"]
    assert mpi_job.ssh_mpi_args(OMPI4, None, None, None)[:2] == ["--mca", "plm_rsh_args"]
    assert mpi_job.ssh_mpi_args(OMPI5, 2222, None, "--mca plm_ssh_args '-p 1'") == []   # the user's win
    assert mpi_job.ssh_mpi_args(MPICH, None, None, None) == []


def test_missing_mpirun_is_a_clear_error(tmp_path):
    env = _env(PATH=str(tmp_path))   # nothing on PATH: the launcher itself runs by absolute path
    proc = _hvdrun(["--mpi", "-np", "2", "true"], env=env)
    assert proc.returncode == 2
    assert "'mpirun' was not found on PATH" in proc.stderr and "--gloo" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------- real mpirun

ENV_SCRIPT = r"""
import os
print("ENV", os.environ.get("OMPI_COMM_WORLD_RANK"), os.environ.get("HOROVOD_RANK"),
      os.environ.get("HOROVOD_FUSION_THRESHOLD"), os.environ.get("HOROVOD_CYCLE_TIME"),
      os.environ.get("EXTRA_VAR"), os.environ.get("_HOROVOD_SECRET_KEY"))
"""


@needs_mpi
def test_numpy_example_under_mpirun():
    proc = _hvdrun(["--mpi", "-np", "2", sys.executable, "examples/numpy_allreduce.py"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "<stdout>:rank" in line)
    assert [line.split(" sum=")[0] for line in lines] == ["[0]<stdout>:rank 0/2 (local 0/2):",
                                                          "[1]<stdout>:rank 1/2 (local 1/2):"]
    assert all("sum=[1.0, 3.0, 5.0, 7.0] avg=[0.5, 1.5, 2.5, 3.5]" in line for line in lines)


BINDING_WORKER = """
import os
import horovod.numpy as hvd
hvd.init()
print("PLACED", hvd.local_rank(), os.environ.get("OMP_NUM_THREADS"),
      ",".join(map(str, sorted(os.sched_getaffinity(0)))), flush=True)
hvd.shutdown()
"""


@needs_mpi
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs at least 2 cores")
def test_mpi_workers_get_threads_and_core_binding_as_under_gloo(script):
    """README: every worker gets OMP_NUM_THREADS and its share of the cores; under --mpi they once got neither."""
    from horovod.runner.threads import default_omp_threads
    from horovod.transport.cpus import share_of

    cpus = sorted(os.sched_getaffinity(0))
    proc = _hvdrun(["--mpi", "-np", "2", sys.executable, script(BINDING_WORKER)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    placed = {int(m[0]): (m[1], [int(c) for c in m[2].split(",")])
              for m in re.findall(r"<stdout>:PLACED (\d) (\S+) (\S+)", proc.stdout)}
    share = str(default_omp_threads(2))
    assert placed == {0: (share, share_of(cpus, 0, 2)), 1: (share, share_of(cpus, 1, 2))}, proc.stdout
    assert "horovodrun: starting 2 processes on localhost under mpirun" in proc.stderr, proc.stderr
    assert proc.stderr.count("Setting OMP_NUM_THREADS") == 1, proc.stderr


@needs_mpi
def test_knobs_and_launcher_flags_reach_mpirun(script, tmp_path):
    worker = script(ENV_SCRIPT)
    env = _env(HOROVOD_RANK="9", _HOROVOD_SECRET_KEY="cd" * 32, EXTRA_VAR="extra")
    proc = _hvdrun(["--mpi", "-np", "2", "--fusion-threshold-mb", "3", "--cycle-time-ms", "2.5", "--verbose",
                    "--mpi-args=-x EXTRA_VAR", "--binding-args", "-bind-to none -map-by slot", "--tcp",
                    "--prefix-output-with-timestamp", "--output-filename", str(tmp_path / "out"),
                    sys.executable, worker], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = sorted(re.sub(r"^.*\[(\d)\]<stdout>:", r"[\1]", line) for line in proc.stdout.splitlines()
                   if "<stdout>:ENV" in line)
    assert found == [f"[{r}]ENV {r} None 3145728 2.5 extra None" for r in range(2)]
    assert all(re.match(r"^\w{3} \w{3} +\d+ [\d:]+ \d{4} \[\d\]<stdout>:", line)
               for line in proc.stdout.splitlines() if "<stdout>:" in line)
    command = next(line for line in proc.stderr.splitlines() if "running: mpirun" in line)
    assert "--bind-to none --map-by slot" in command and "-x HOROVOD_FUSION_THRESHOLD" in command
    assert "--mca btl" in command   # --tcp
    assert "cd" * 32 not in proc.stderr
    assert (tmp_path / "out" / "rank.1" / "stdout").read_text().startswith("ENV 1 None 3145728")


@needs_mpi
def test_a_failing_rank_fails_mpirun_and_is_named(script):
    # Rank 1 dies while rank 0 still works (a rank that exits after MPI_Finalize is not always reported).
    worker = script("import os, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                    "if MPI.COMM_WORLD.Get_rank() == 1:\n    os._exit(3)\ntime.sleep(60)\n")
    proc = _hvdrun(["--mpi", "-np", "2", sys.executable, worker])
    assert proc.returncode == 1, proc.stderr
    assert "horovodrun: mpirun failed with exit code" in proc.stderr
    assert "the first process to fail was rank 1" in proc.stderr and "exited with code 3" in proc.stderr


API_DRIVER = r"""
import os
from horovod.runner import run

def ranks_and_sums():
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="t")
    result = (hvd.rank(), hvd.size(), os.environ.get("OMPI_COMM_WORLD_RANK"), float(total[0]))
    hvd.shutdown()
    return result

def fails_on_rank_one():
    if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
        raise ArithmeticError("rank one is unhappy")
    return "fine"

print("RESULT", run(ranks_and_sums, num_proc=2, use_mpi=True))
try:
    run(fails_on_rank_one, num_proc=2, use_mpi=True)
except RuntimeError as exc:
    print("ERROR", repr(str(exc)))
"""


@needs_mpi
def test_horovod_run_with_use_mpi(script, tmp_path):
    driver = script(API_DRIVER, name="driver.py")   # functions of __main__ travel by value
    proc = subprocess.run([sys.executable, driver], capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          env=_env(), cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [(0, 2, '0', 3.0), (1, 2, '1', 3.0)]" in proc.stdout
    error = next(line for line in proc.stdout.splitlines() if line.startswith("ERROR"))
    assert "mpirun failed with exit code" in error and "rank 1 raised:" in error
    assert "ArithmeticError: rank one is unhappy" in error


SEED_ALLREDUCE = """
import numpy as np
import horovod.numpy as hvd
hvd.init()
print("SUM", hvd.rank(), hvd.allreduce(np.ones(3) * (hvd.rank() + 1), op=hvd.Sum).tolist(), flush=True)
"""


@needs_mpi
def test_the_seed_documents_mpirun_line_as_the_readme_spells_it_for_open_mpi_5(tmp_path):
    """README's "Running under mpirun" line, verbatim (Open MPI 5 wants --bind-to/--map-by with two dashes)."""
    script = tmp_path / "train.py"
    script.write_text(SEED_ALLREDUCE)
    line = ("mpirun -np 2 -H localhost:2 --bind-to none --map-by slot -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH "
            "-x PATH -mca pml ob1 -mca btl ^openib python train.py")
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        assert line in f.read(), "README's mpirun line changed: keep this test and the README in step"
    env = child_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("LD_LIBRARY_PATH", "")
    proc = subprocess.run(line.split(), cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"SUM (\d) \[3\.0, 3\.0, 3\.0\]", proc.stdout)) == ["0", "1"], proc.stdout
