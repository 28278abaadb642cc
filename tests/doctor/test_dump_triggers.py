"""Dumps on request: ``hvd.dump_flight_recorder()`` and SIGUSR1 in a rank, and ``horovodrun
--dump-flight-recorder PID`` (SIGUSR1 to the launcher) collecting every rank of a job that hangs with the stall
inspector off."""
from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import textwrap
import time

from multiproc import output_lines
from test_planted_hangs import PLANTED, job_env, marker_line

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    for i in range(3):
        hvd.allreduce(np.ones(4), name=f"w{i}")
    print("PATH", hvd.dump_flight_recorder("asked by the test"))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()   # arrives during the sleep
    time.sleep(2)  # SIGNALLED HERE
""")


def test_dump_flight_recorder_and_sigusr1_in_a_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = job_env(tmp_path, "auto")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = next(line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("PATH "))
    dumps = sorted(glob.glob(str(tmp_path / "dumps" / "g0-rank0-*.json")))
    assert path in dumps and len(dumps) == 2, (dumps, out.stderr)
    asked, signalled = (json.load(open(p)) for p in dumps)
    assert asked["reason"] == "asked by the test" and signalled["reason"] == "SIGUSR1"
    assert [c["name"] for c in asked["collectives"]] == ["allreduce.w0", "allreduce.w1", "allreduce.w2"]
    assert all(c["state"] == "done" for c in asked["collectives"])
    main = next(t for t in signalled["threads"] if t["main"])
    # Taken from a thread of its own: the main thread is seen where it was, not in the handler.
    assert main["frames"][-1][:2] == [str(script), SCRIPT.splitlines().index("time.sleep(2)  # SIGNALLED HERE") + 1]
    assert main["frames"][-1][4] is False


def test_horovodrun_collects_every_rank_on_request(tmp_path):
    env = job_env(tmp_path, "shm", HOROVOD_STALL_CHECK_DISABLE="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="0")
    argv = [sys.executable, "-m", "horovod.runner", "-np", "3", sys.executable, str(PLANTED), "sleep"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, hanging, verdict = [], set(), None
    try:
        for line in output_lines(proc, 120):
            lines.append(line)
            if "planted: rank" in line:
                hanging.add(line)
                if len(hanging) == 3:
                    time.sleep(1.0)   # the waiting ranks reach their allreduce
                    ask = subprocess.run([sys.executable, "-m", "horovod.runner", "--dump-flight-recorder",
                                          str(proc.pid)], env=env, capture_output=True, text=True, timeout=60)
                    assert ask.returncode == 0, ask.stderr
            if "after SIGUSR1 to the launcher" in line:
                verdict = "".join(lines)
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    text = "".join(lines)
    assert verdict is not None, text[-4000:]
    assert "Horovod doctor (3 of 3 ranks dumped" in verdict
    assert f"rank 2 never submitted allreduce 'grad.fc1.bias' (its collective #10): it is in " \
           f"{marker_line('sleep', 'culprit')}" in verdict
    assert f"ranks 0 and 1 wait in it ({marker_line('sleep', 'waiter')})" in verdict


def test_dump_request_refuses_a_pid_that_is_not_horovodrun(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        ask = subprocess.run([sys.executable, "-m", "horovod.runner", "--dump-flight-recorder", str(sleeper.pid)],
                             env=job_env(tmp_path, "auto"), capture_output=True, text=True, timeout=60)
        assert ask.returncode == 2 and "is not a horovodrun" in ask.stderr
        assert sleeper.poll() is None   # SIGUSR1 would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()


ALL_RANKS = textwrap.dedent("""
    import time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    for i in range(3):
        hvd.allreduce(np.ones(4), name=f"w{i}")
    if hvd.rank() == 0:
        hvd.dump_flight_recorder("checkpoint", all_ranks=True)
    time.sleep(8)  # EVERY RANK WAITS HERE
""")


def test_dump_of_every_rank_on_request_from_one_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(ALL_RANKS)
    argv = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, str(script)]
    out = subprocess.run(argv, env=job_env(tmp_path, "auto"), capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    line = ALL_RANKS.splitlines().index("time.sleep(8)  # EVERY RANK WAITS HERE") + 1
    assert "Horovod doctor (2 of 2 ranks dumped" in text, text[-4000:]
    # Each rank's first dump: rank 0's own at the call, rank 1's when the launcher signalled it.
    assert (f"no collective is waiting on any rank (all completed): rank 0 in job.py:{line - 1} "
            f"(`hvd.dump_flight_recorder(\"checkpoint\", all_ranks=True)`); rank 1 in job.py:{line} "
            f"(`time.sleep(8)  # EVERY RANK WAITS HERE`)") in text, text[-4000:]
    assert "after checkpoint" in text
