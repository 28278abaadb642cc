"""Ctrl-C reaches the launcher whichever of its threads the kernel hands the signal to.

A process-directed signal may be delivered to any thread that does not block it; Python runs its handlers only in
the main thread, when that thread runs. A launcher whose main thread blocked untimed (waiting for its workers, or
for mpirun) missed a SIGINT taken by one of its output readers until something else woke it (horovodrun did not
exit within 60 s of a SIGINT under load, session 15). Here the signal is sent to a helper thread on purpose.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runner_helpers import child_env

SCRIPT = """
import os, signal, subprocess, sys, threading, time
from horovod.runner.exec import WorkerSpec, run_workers, wait_interruptibly
from horovod.runner.output import OutputSink

def sigint_to_this_helper_thread():
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)   # not the main thread: as the kernel may choose
threading.Thread(target=sigint_to_this_helper_thread, daemon=True).start()
start = time.monotonic()
try:
    if sys.argv[1] == "workers":
        run_workers([WorkerSpec(0, "localhost", ["sleep", "30"], dict(os.environ))], OutputSink(1), grace_seconds=1)
    else:
        child = subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL)
        try:
            wait_interruptibly(child)
        finally:
            child.kill()
    print("returned")
except KeyboardInterrupt:
    print("interrupted after %.1f s" % (time.monotonic() - start))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX signals")
@pytest.mark.parametrize("wait", ["workers", "mpirun"])
def test_a_sigint_another_thread_took_still_interrupts_the_wait(wait):
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT, wait], env=child_env(), capture_output=True, text=True,
                              timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher's wait for {wait} missed a SIGINT delivered to another thread (still waiting "
                    f"after 15 s)")
    assert "interrupted" in done.stdout, (done.stdout, done.stderr)
    seconds = float(done.stdout.split("after ")[1].split(" s")[0])
    assert seconds < 3.0, done.stdout   # the signal came at 0.5 s; the wait looks every 0.5 s
