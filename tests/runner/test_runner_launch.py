"""End-to-end: the real launcher (``python -m horovod.runner`` and the ``horovodrun`` script) in subprocesses."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from horovod.common.util import module_installed

from runner_helpers import CALL_TIMEOUT_S, child_env, launcher_argv

ENV_WORKER = """
import json, os, sys
keys = ["HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
        "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "PYTHONUNBUFFERED", "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_CYCLE_TIME", "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_LOG_HIDE_TIME", "HOROVOD_GLOO_IFACE",
        "NCCL_SOCKET_IFNAME", "INHERITED_BY_WORKERS"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
# The secret goes to a file, never to the output under test.
with open(os.path.join(sys.argv[1], "secret." + os.environ["HOROVOD_RANK"]), "w") as f:
    f.write(os.environ["_HOROVOD_SECRET_KEY"])
print("to stderr", os.environ["HOROVOD_RANK"], file=sys.stderr)
"""


def _envs(stdout: str):
    found = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[(\d+)\]<stdout>:ENV (.*)", line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_dead(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _wait_files(paths, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(p.exists() and p.read_text().strip() for p in paths):
        time.sleep(0.05)
    assert all(p.exists() for p in paths), f"workers did not start within {timeout} s: {paths}"


def test_workers_get_their_environment_and_prefixed_output(hvdrun, script, tmp_path):
    path = script(ENV_WORKER)
    result = hvdrun(["-np", "3", "--verbose", "python", path, str(tmp_path)],
                    env=child_env(INHERITED_BY_WORKERS="yes"))
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert sorted(envs) == [0, 1, 2]
    ports = set()
    for rank, env in envs.items():
        assert env["HOROVOD_RANK"] == str(rank)
        assert (env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_SIZE"], env["HOROVOD_LOCAL_RANK"]) == ("3", "3", str(rank))
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("0", "1")
        assert env["HOROVOD_HOSTNAME"] == "localhost"
        assert (env["HOROVOD_CONTROLLER"], env["HOROVOD_CPU_OPERATIONS"]) == ("gloo", "gloo")
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["INHERITED_BY_WORKERS"] == "yes"
        assert env["HOROVOD_FUSION_THRESHOLD"] is None   # no flag, no variable: the engine default applies
        ports.add(int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]))
    assert len(ports) == 1
    secrets_ = {(tmp_path / f"secret.{r}").read_text() for r in range(3)}
    assert len(secrets_) == 1
    secret = secrets_.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert secret not in result.stdout and secret not in result.stderr   # never logged, even with --verbose
    assert sorted(line for line in result.stderr.splitlines() if "<stderr>" in line) == [
        f"[{r}]<stderr>:to stderr {r}" for r in range(3)]


def test_each_job_has_its_own_secret(hvdrun, script, tmp_path):
    path = script(ENV_WORKER)
    seen = set()
    for _ in range(2):
        assert hvdrun(["-np", "1", "python", path, str(tmp_path)]).returncode == 0
        seen.add((tmp_path / "secret.0").read_text())
    assert len(seen) == 2


def test_knob_flags_reach_the_workers(hvdrun, script, tmp_path):
    path = script(ENV_WORKER)
    result = hvdrun(["-np", "2", "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5", "--no-stall-check",
                     "--log-without-timestamp", "--network-interfaces", "lo,eth0", "python", path, str(tmp_path)])
    assert result.returncode == 0, result.stderr
    for env in _envs(result.stdout).values():
        assert env["HOROVOD_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
        assert env["HOROVOD_CYCLE_TIME"] == "3.5"
        assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
        assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
        assert (env["HOROVOD_GLOO_IFACE"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "lo,eth0")


def test_config_file_and_later_flag(hvdrun, script, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 9\n")
    path = script(ENV_WORKER)
    result = hvdrun(["-np", "1", "--cycle-time-ms", "1", "--config-file", str(cfg), "--fusion-threshold-mb", "4",
                     "python", path, str(tmp_path)])
    assert result.returncode == 0, result.stderr
    env = _envs(result.stdout)[0]
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(4 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "9.0"


def test_exactly_np_workers_even_with_more_slots(hvdrun, script, tmp_path):
    result = hvdrun(["-np", "2", "-H", "localhost:4", "python", script(ENV_WORKER), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert sorted(envs) == [0, 1]
    assert all(e["HOROVOD_SIZE"] == "2" and e["HOROVOD_LOCAL_SIZE"] == "2" for e in envs.values())


def test_two_local_host_names_are_two_hosts(hvdrun, script, tmp_path):
    result = hvdrun(["-np", "4", "-H", "localhost:2,127.0.0.1:2", "python", script(ENV_WORKER), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert [envs[r]["HOROVOD_HOSTNAME"] for r in range(4)] == ["localhost", "localhost", "127.0.0.1", "127.0.0.1"]
    assert [envs[r]["HOROVOD_LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert [envs[r]["HOROVOD_CROSS_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert all(e["HOROVOD_CROSS_SIZE"] == "2" and e["HOROVOD_LOCAL_SIZE"] == "2" for e in envs.values())


def test_hostfile(hvdrun, script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{socket.gethostname()} slots=1\nlocalhost slots=2\n")
    result = hvdrun(["-np", "3", "-hostfile", str(hostfile), "python", script(ENV_WORKER), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert [envs[r]["HOROVOD_HOSTNAME"] for r in range(3)] == [socket.gethostname(), "localhost", "localhost"]


def test_output_filename_writes_padded_rank_dirs(hvdrun, tmp_path):
    out = tmp_path / "logs"
    result = hvdrun(["-np", "11", "--output-filename", str(out),
                     "sh", "-c", 'echo "out $HOROVOD_RANK"; echo "err $HOROVOD_RANK" >&2'])
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"rank.{r:02d}" for r in range(11)]
    for rank in range(11):
        assert (out / f"rank.{rank:02d}" / "stdout").read_text() == f"out {rank}\n"
        assert (out / f"rank.{rank:02d}" / "stderr").read_text() == f"err {rank}\n"
    # The terminal still gets the tagged lines.
    assert "[10]<stdout>:out 10" in result.stdout.splitlines()


def test_prefix_timestamp(hvdrun):
    result = hvdrun(["-np", "1", "-prefix-timestamp", "sh", "-c", "echo hello"])
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} \[0\]<stdout>:hello", result.stdout.strip())


def test_standard_input_goes_to_rank_zero_only(hvdrun, script):
    path = script("import os, sys\nprint('got', os.environ['HOROVOD_RANK'], repr(sys.stdin.read()))\n")
    result = hvdrun(["-np", "2", "python", path], input="piped text\n")
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == ["[0]<stdout>:got 0 'piped text\\n'", "[1]<stdout>:got 1 ''"]


PIDS_WORKER = """
import os, subprocess, sys, time
rank = os.environ["HOROVOD_RANK"]
# A grandchild in the worker's process group: it must be stopped with the worker.
child = subprocess.Popen(["sleep", "600"])
tmp = os.path.join(sys.argv[1], "pids." + rank)
with open(tmp + ".part", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(tmp + ".part", tmp)
print("ready", rank, flush=True)
if len(sys.argv) > 2 and rank == sys.argv[2]:
    # The failing rank waits until everyone runs, so the others really have to be terminated.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(sys.argv[1], f"pids.{r}")) for r in range(int(os.environ["HOROVOD_SIZE"]))):
        time.sleep(0.05)
    print("failing now", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


def _pids(tmp_path: Path, size: int):
    return [int(p) for r in range(size) for p in (tmp_path / f"pids.{r}").read_text().split()]


def test_failing_rank_terminates_the_others_and_is_named(hvdrun, script, tmp_path):
    path = script(PIDS_WORKER)
    result = hvdrun(["-np", "3", "python", path, str(tmp_path), "1"])
    assert result.returncode == 1
    assert ("Horovod detected that one or more processes exited with non-zero status, thus causing the job to be "
            "terminated. The first process to do so was:") in result.stderr
    assert "Rank: 1\nHost: localhost\nExit code: 3" in result.stderr
    assert "[1]<stderr>:failing now" in result.stderr
    assert _wait_dead(_pids(tmp_path, 3)) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_stops_every_worker(script, tmp_path, sig):
    path = script(PIDS_WORKER)
    proc = subprocess.Popen(launcher_argv(["-np", "2", "python", path, str(tmp_path)]), env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_files([tmp_path / "pids.0", tmp_path / "pids.1"])
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, err
    assert "workers were stopped" in err
    assert _wait_dead(_pids(tmp_path, 2)) == []


def _kill_9_leaves_no_workers(launcher_args, tmp_path) -> list:
    """Start the launcher, SIGKILL it once both workers run; the workers still alive 2 s later."""
    proc = subprocess.Popen(launcher_argv(launcher_args), env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_files([tmp_path / "pids.0", tmp_path / "pids.1"])
        proc.kill()
        proc.wait(timeout=CALL_TIMEOUT_S)
        workers = [int((tmp_path / f"pids.{r}").read_text().split()[0]) for r in range(2)]
        return _wait_dead(workers, timeout=2.0)
    finally:
        for pid in _pids(tmp_path, 2) if (tmp_path / "pids.1").exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)   # the grandchildren (and any survivor) of the test
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the parent-death signal is Linux's")
def test_kill_9_of_the_launcher_takes_the_workers_down(script, tmp_path):
    """A launcher killed with SIGKILL runs no cleanup: the workers must go by themselves (parent-death signal)."""
    alive = _kill_9_leaves_no_workers(["-np", "2", "python", script(PIDS_WORKER), str(tmp_path)], tmp_path)
    assert alive == [], "workers outlived the launcher's SIGKILL by 2 s"


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the parent-death signal is Linux's")
def test_kill_9_of_the_elastic_driver_takes_the_workers_down(script, tmp_path):
    discovery = tmp_path / "discover.sh"
    discovery.write_text("#!/bin/sh\necho localhost:2\n")
    discovery.chmod(0o755)
    alive = _kill_9_leaves_no_workers(["-np", "2", "--min-np", "1", "--host-discovery-script", str(discovery),
                                       "python", script(PIDS_WORKER), str(tmp_path)], tmp_path)
    assert alive == [], "elastic workers outlived the driver's SIGKILL by 2 s"


FREEZE_WORKER = """
import os, signal, sys
import numpy as np
import horovod.numpy as hvd
hvd.init()
for i in range(1000):
    if hvd.rank() == 1 and i == 10:
        os.kill(os.getpid(), signal.SIGSTOP)   # frozen, not dead: it never exits by itself
    if sys.argv[1] == "async":   # the request reaches rank 0 from the engine's drive loop, not the caller
        hvd.synchronize(hvd.allreduce_async(np.ones(1 << 15, np.float32), name=f"t{i % 4}"))
    else:
        hvd.allreduce(np.ones(1 << 15, np.float32), name=f"t{i % 4}")
"""


# Rank 0 sees rank 1 frozen, tells the others why and closes; a survivor whose own send to rank 0 fails first must
# still report rank 0's reason (it reads what rank 0 sent before closing), not the broken pipe.
@pytest.mark.parametrize("call", ["blocking", "async"])
def test_a_frozen_rank_is_named_as_the_cause_not_the_first_rank_to_exit(hvdrun, script, call):
    result = hvdrun(["-np", "3", "python", script(FREEZE_WORKER), call],
                    env=child_env(HOROVOD_TRANSPORT="tcp", HOROVOD_GLOO_TIMEOUT_SECONDS="3"))
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert "Cause: rank 1 failed first, as seen by the other ranks" in err, err[-3000:]
    # every survivor's own error names rank 1 as well
    for rank in (0, 2):
        assert f"[{rank}]<stderr>:horovod.engine.errors.PeerFailureError: rank 1 " in err, err[-3000:]


CATCHING_FREEZE_WORKER = """
import os, signal, sys
import numpy as np
import horovod.numpy as hvd
hvd.init()
try:
    for i in range(1000):
        if hvd.rank() == 1 and i == 10:
            os.kill(os.getpid(), signal.SIGSTOP)   # frozen for good
        hvd.allreduce(np.ones(1000, np.float32), name="t")
except hvd.HorovodInternalError as exc:
    print("caught:", exc)
    sys.exit(0)   # the survivors end cleanly: only the launcher can notice that rank 1 never will
"""


def test_a_frozen_rank_is_stopped_when_the_survivors_caught_the_error_and_exited_cleanly(hvdrun, script):
    from horovod.runner.exec import BLAMED_RANK_GRACE_SECONDS

    start = time.monotonic()
    result = hvdrun(["-np", "3", "python", script(CATCHING_FREEZE_WORKER)],
                    env=child_env(HOROVOD_TRANSPORT="tcp", HOROVOD_GLOO_TIMEOUT_SECONDS="3"))
    took = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert "Rank: 1" in err and "Rank 1 stopped responding" in err, err[-3000:]
    assert err.count("caught:") == 0 and result.stdout.count("caught:") == 2, result.stdout[-3000:]
    assert took < 3 + BLAMED_RANK_GRACE_SECONDS + 30, f"the launcher took {took:.0f} s to give up on rank 1"


STOPPED_FROM_OUTSIDE_WORKER = """
import os, sys, time
import numpy as np
import horovod.numpy as hvd
hvd.init()
with open(os.path.join(sys.argv[1], f"pid.{hvd.rank()}"), "w") as f:
    f.write(str(os.getpid()))
for i in range(10 ** 7):
    hvd.allreduce(np.ones(1000, np.float32), name="t")   # 4,000 bytes: recursive doubling at np = 3
"""


def test_a_rank_stopped_from_outside_is_the_only_one_blamed(hvdrun, script, tmp_path):
    """np = 3 over TCP: rank 0 waits for rank 1 (its proxy), rank 1 for rank 2; only rank 2 is at fault."""
    import threading

    def stop_rank_2():
        pid_file = tmp_path / "pid.2"
        _wait_files([pid_file])
        time.sleep(1.0)   # well inside the loop
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_2, daemon=True)
    stopper.start()
    result = hvdrun(["-np", "3", "python", script(STOPPED_FROM_OUTSIDE_WORKER), str(tmp_path)],
                    env=child_env(HOROVOD_TRANSPORT="tcp", HOROVOD_GLOO_TIMEOUT_SECONDS="3"))
    stopper.join(5)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Cause: rank 2 failed first" in result.stderr, result.stderr[-3000:]


def test_a_rank_that_reported_another_ranks_failure_is_a_witness_not_a_cause():
    from horovod.runner.job import first_failures

    # rank 0 waited on rank 1, which waited on rank 2: rank 1 was alive enough to report.
    assert first_failures([(1, 0, "waited for 1"), (2, 1, "waited for 2")]) == [2]
    assert first_failures([(2, 0, "x"), (2, 1, "y")]) == [2]
    # Ranks blaming each other (a deadlock): nobody is cleared.
    assert first_failures([(1, 0, "x"), (0, 1, "y")]) == [0, 1]


OMP_WORKER = """
import os
print("OMP", os.environ.get("OMP_NUM_THREADS"))
"""


def test_omp_num_threads_defaults_to_the_cores_per_worker_unless_set(hvdrun, script):
    from horovod.transport.cpus import usable_cpus

    path = script(OMP_WORKER)
    result = hvdrun(["-np", "2", "python", path])
    assert result.returncode == 0, result.stderr
    expected = max(1, usable_cpus() // 2)
    assert sorted(re.findall(r"\[\d\]<stdout>:OMP (\S+)", result.stdout)) == [str(expected)] * 2, result.stdout
    assert result.stderr.count("Setting OMP_NUM_THREADS") == 1, result.stderr   # said once, not per worker
    mine = hvdrun(["-np", "2", "python", path], env=child_env(OMP_NUM_THREADS="3"))
    assert sorted(re.findall(r"\[\d\]<stdout>:OMP (\S+)", mine.stdout)) == ["3", "3"], mine.stdout
    assert "Setting OMP_NUM_THREADS" not in mine.stderr


BINDING_WORKER = """
import os
import horovod.numpy as hvd
hvd.init()
print("CPUS", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
def affinity(tid):
    try:
        return frozenset(os.sched_getaffinity(int(tid)))
    except ProcessLookupError:   # a thread that ended since the listing
        return None
print("THREADS", len({a for a in map(affinity, os.listdir("/proc/self/task")) if a is not None}))
hvd.shutdown()
"""


def _bound_cpus(stdout):
    return {int(rank): [int(c) for c in cpus.split(",")]
            for rank, cpus in re.findall(r"\[(\d+)\]<stdout>:CPUS (\S+)", stdout)}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs at least 2 cores")
def test_workers_are_bound_to_disjoint_shares_of_the_cores_unless_told_not_to(hvdrun, script):
    from horovod.transport.cpus import share_of

    cpus = sorted(os.sched_getaffinity(0))
    path = script(BINDING_WORKER)
    result = hvdrun(["-np", "2", "python", path])
    assert result.returncode == 0, result.stderr
    bound = _bound_cpus(result.stdout)
    assert bound == {0: share_of(cpus, 0, 2), 1: share_of(cpus, 1, 2)}, result.stdout
    assert not set(bound[0]) & set(bound[1]) and len(bound[0]) == len(cpus) // 2
    # every thread of a worker (the engine's included) is on the worker's share
    assert re.findall(r"<stdout>:THREADS (\d+)", result.stdout) == ["1", "1"], result.stdout
    unbound = hvdrun(["--no-bind-cores", "-np", "2", "python", path])
    assert unbound.returncode == 0, unbound.stderr
    assert _bound_cpus(unbound.stdout) == {0: cpus, 1: cpus}, unbound.stdout
    mine = hvdrun(["-np", "2", "python", path], env=child_env(HOROVOD_BIND_CORES="0"))
    assert _bound_cpus(mine.stdout) == {0: cpus, 1: cpus}, mine.stdout
    # the user's thread pools would not fit a share: every core stays theirs; threads that fit: bound
    wide = hvdrun(["-np", "2", "python", path], env=child_env(OMP_NUM_THREADS=str(len(cpus))))
    assert _bound_cpus(wide.stdout) == {0: cpus, 1: cpus}, wide.stdout
    narrow = hvdrun(["-np", "2", "python", path], env=child_env(OMP_NUM_THREADS="1"))
    assert _bound_cpus(narrow.stdout) == bound, narrow.stdout
    # more workers than cores: nothing to share out, every worker keeps every core
    crowded = hvdrun(["-np", str(len(cpus) + 1), "python", path])
    assert crowded.returncode == 0, crowded.stderr
    assert _bound_cpus(crowded.stdout) == {r: cpus for r in range(len(cpus) + 1)}, crowded.stdout


def test_core_shares_are_contiguous_disjoint_and_equal():
    from horovod.transport.cpus import share_of

    assert share_of(range(8), 0, 3) == [0, 1] and share_of(range(8), 2, 3) == [4, 5]
    assert share_of([3, 1, 7, 5], 1, 2) == [5, 7]
    assert share_of(range(2), 0, 1) is None          # one worker: the whole host
    assert share_of(range(2), 0, 3) is None          # more workers than cores
    assert share_of(range(4), 4, 4) is None          # a local rank outside the host


def test_success_exit_code_zero_and_nonzero_code_is_one(hvdrun):
    assert hvdrun(["-np", "2", "true"]).returncode == 0
    result = hvdrun(["-np", "2", "sh", "-c", 'exit $((HOROVOD_RANK * 4))'])
    assert result.returncode == 1
    assert "Rank: 1" in result.stderr and "Exit code: 4" in result.stderr


def test_command_not_found(hvdrun):
    result = hvdrun(["-np", "2", "no-such-command-for-horovodrun"])
    assert result.returncode == 127
    assert "command 'no-such-command-for-horovodrun' not found" in result.stderr


def test_check_build_is_truthful(hvdrun):
    result = hvdrun(["--check-build"])
    assert result.returncode == 0, result.stderr

    def mark(ok):
        return "[X]" if ok else "[ ]"

    have = {m: module_installed(m) for m in ("tensorflow", "torch", "mxnet", "jax", "mpi4py")}
    out = result.stdout
    # The original's first line still starts it; the installation's own version follows (from its metadata).
    assert out.startswith(f"Horovod v0.28.1 (horovod-next {_installed_version()}):"), out
    frameworks = out.split("Available Frameworks:")[1].split("Available Controllers:")[0]
    controllers = out.split("Available Controllers:")[1].split("Available Tensor Operations:")[0]
    ops = out.split("Available Tensor Operations:")[1]
    assert f"{mark(have['tensorflow'])} TensorFlow" in frameworks
    assert f"{mark(have['torch'])} PyTorch" in frameworks
    assert f"{mark(have['mxnet'])} MXNet" in frameworks
    assert f"{mark(have['jax'])} JAX" in frameworks and "[X] NumPy" in frameworks   # every binding is listed
    assert f"{mark(have['mpi4py'])} MPI" in controllers and "[X] Gloo" in controllers
    assert "[ ] NCCL" in ops and f"{mark(have['mpi4py'])} MPI" in ops and "[X] Gloo" in ops


def _installed_version():
    from importlib import metadata

    try:
        return metadata.version("horovod-next")
    except metadata.PackageNotFoundError:
        pytest.skip("horovod-next is not installed (pip install -e .): no package metadata to read the version from")


def test_version(hvdrun):
    """The distribution's own version first, then the Horovod API it implements (what 0.28.1 printed alone)."""
    import horovod

    for flag in ("--version", "-v"):
        result = hvdrun([flag])
        assert (result.returncode, result.stdout.strip()) == (
            0, f"horovod-next {_installed_version()} (Horovod {horovod.__version__} API)"), result.stdout
    assert horovod.__version__ == "0.28.1"   # the API version scripts compare against stays the original's
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"`horovod-next {_installed_version()} (Horovod 0.28.1 API)`" in readme, "README shows another version"


@pytest.mark.parametrize("args, fragment", [
    (["--bogus", "-np", "1", "true"], "unrecognized arguments: --bogus"),
    (["-np", "x", "true"], "argument -np/--num-proc: invalid int value: 'x'"),
    (["-np", "2"], "no command to run"),
    (["true"], "-np/--num-proc is required"),
    (["-np", "0", "true"], "-np/--num-proc must be >= 1"),
    (["-np", "3", "-H", "localhost:2", "true"], "requested 3 processes but the hosts provide only 2 slots"),
    (["-np", "2", "--host-discovery-script", "d.sh", "true"], "host discovery script 'd.sh' exited with status"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "true"], "cannot read --hostfile"),
])
def test_usage_errors_exit_2(hvdrun, args, fragment):
    result = hvdrun(args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_console_script(tmp_path):
    exe = shutil.which("horovodrun")
    if exe is None:
        pytest.skip("the horovodrun console script is not installed (pip install -e .)")
    result = subprocess.run([exe, "-np", "2", "sh", "-c", "echo rank $HOROVOD_RANK"], capture_output=True,
                            text=True, timeout=CALL_TIMEOUT_S, env=child_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:rank 0", "[1]<stdout>:rank 1"]


VANISHING_WORKER = """
import os
import numpy as np
import horovod.numpy as hvd
hvd.init()
hvd.allreduce(np.ones(4, np.float32), name="warmup")
if hvd.rank() == 1:
    os._exit(0)   # gone without a word, and with status 0: the launcher's headline is rank 0's error
hvd.allreduce(np.ones(4, np.float32), name="after")
"""


def test_a_vanished_peer_is_reported_once_not_twice(hvdrun, script):
    """The survivor's error used to say the same sentence twice: 'rank 1 closed its control connection (the process
    exited or crashed): rank 1 closed the control connection (the process exited or crashed).'"""
    result = hvdrun(["-np", "2", "python", script(VANISHING_WORKER)], env=child_env(HOROVOD_TRANSPORT="tcp"))
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "closed its control connection" in line]
    assert lines, result.stderr[-3000:]
    for line in lines:
        assert line.count("closed") == 1 and line.count("exited or crashed") == 1, line
        assert "rank 1" in line, line


def test_the_launcher_says_what_it_starts_and_where(hvdrun):
    """Before the workers' (often long) imports: how many processes, on which hosts, which ranks each."""
    one = hvdrun(["-np", "2", "true"])
    assert one.returncode == 0, one.stderr
    assert one.stderr.splitlines()[0] == "horovodrun: starting 2 processes on localhost", one.stderr
    two = hvdrun(["-np", "3", "-H", "localhost:2,127.0.0.1:1", "true"])
    assert two.returncode == 0, two.stderr
    assert "horovodrun: starting 3 processes on 2 hosts: localhost (ranks 0-1), 127.0.0.1 (rank 2)" in two.stderr


def test_placement_text_names_every_hosts_ranks():
    from horovod.runner.hosts import HostInfo, get_host_assignments, placement_text

    slots = get_host_assignments([HostInfo("a", 3), HostInfo("b", 1), HostInfo("c", 2)], 5)
    assert placement_text(slots) == "5 processes on 3 hosts: a (ranks 0-2), b (rank 3), c (rank 4)"
    assert placement_text(get_host_assignments([HostInfo("localhost", 4)], 1)) == "1 process on localhost"
