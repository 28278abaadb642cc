"""Planted hangs under horovodrun, at np = 2 and 3 over shm and tcp: the verdict names the rank, the tensor and the
user's source line (tests/doctor/planted.py marks each line a rank is left on)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from horovod.doctor import report
from multiproc import output_lines

pytestmark = pytest.mark.slow   # about 40 horovodrun jobs, ~5 minutes on the 2-core VM

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PLANTED = HERE / "planted.py"


def marker_line(scenario: str, role: str) -> str:
    """``planted.py:<n> (`<code>`)`` for the line marked ``# HANG:<scenario>:<role>``."""
    for number, text in enumerate(PLANTED.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# HANG:{scenario}:{role}"):
            return f"planted.py:{number} (`{text.strip()}`)"
    raise AssertionError(f"no marker {scenario}:{role} in planted.py")


def job_env(tmp_path, transport: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "_HOROVOD_SECRET_KEY"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"HOROVOD_TRANSPORT": transport, "HOROVOD_FLIGHT_RECORDER_DIR": str(tmp_path / "dumps"),
                "HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5",
                "HOROVOD_GLOO_TIMEOUT_SECONDS": "15"})
    env.update(extra)
    return env


def run_planted(tmp_path, scenario: str, np_: int, transport: str):
    argv = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, str(PLANTED), scenario]
    proc = subprocess.run(argv, env=job_env(tmp_path, transport), capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    verdict = "\n".join(report(str(tmp_path / "dumps")))
    # The launcher's failure message carries the same verdict (a dump that landed after it may add detail).
    first = next(line for line in verdict.splitlines() if line.startswith("  - "))[:90]
    assert first in output.split("exited with non-zero status")[-1], \
        f"launcher's failure message lacks the verdict {first!r}:\n{output[-4000:]}"
    return verdict, output


def others(np_: int) -> str:
    waiters = list(range(np_ - 1))
    return "rank 0" if len(waiters) == 1 else f"ranks {' and '.join(map(str, waiters))}"


# Every scenario with one waiter over shared memory and with two over TCP (until session 11 all four pairings:
# ~150 s more of CI, and no scenario ever failed at one pairing only; the two below still reach both boards of the
# fast lane, both transports and both verdict shapes).
@pytest.mark.parametrize("np_,transport", [(2, "shm"), (3, "tcp")])
@pytest.mark.parametrize("scenario", ["skip", "order", "sleep", "sleep_tiny", "sigstop", "kill", "process_set",
                                      "loader", "torch_loader"])
def test_planted_hang(tmp_path, scenario, np_, transport):
    culprit = np_ - 1
    verdict, output = run_planted(tmp_path, scenario, np_, transport)
    waiter_line = marker_line(scenario, "waiter")
    culprit_line = marker_line(scenario, "culprit") if scenario not in ("sigstop", "kill") else None
    wait = "waits" if np_ == 2 else "wait"
    if scenario == "skip":
        expected = [f"rank {culprit} skipped allreduce 'grad.fc2.weight'", "and went on to allgather 'stats'",
                    culprit_line, f"{others(np_)} {wait} in it ({waiter_line})"]
    elif scenario == "order":
        expected = ["issued allgather 'a' and allreduce 'b' in opposite orders",
                    f"{others(np_)} {wait} in allgather 'a' at {waiter_line}",
                    f"rank {culprit} waits in allreduce 'b' at {culprit_line}"]
    elif scenario == "sleep":
        expected = [f"rank {culprit} never submitted allreduce 'grad.fc1.bias'",
                    f"it is in {culprit_line} (no collective for ",
                    f"{others(np_)} {wait} in it ({waiter_line})"]
    elif scenario == "sleep_tiny":   # the fast lane's stall warning and stall error (shm), the coordinator's (tcp)
        expected = [f"rank {culprit} never submitted allreduce 'loss'", f"it is in {culprit_line} (no collective for ",
                    f"{others(np_)} {wait} in it ({waiter_line})"]
    elif scenario == "sigstop":
        expected = [f"rank {culprit} (host ", "is stopped (SIGSTOP or a debugger)",
                    f"{others(np_)} {wait} in allreduce 'grad.fc1.bias' ({waiter_line})"]
    elif scenario == "kill":
        expected = [f"rank {culprit} (host ", "was killed by SIGKILL",
                    "its last completed collective was allgather 'stats'",
                    f"{others(np_)} {wait} in allreduce 'grad.fc1.bias' ({waiter_line})"]
    elif scenario == "process_set":
        expected = [f"process-set mismatch: {others(np_)} issued an unnamed allreduce", "on the global process set",
                    f"but rank {culprit} issued its collective", f"on process set 1 (ranks [{culprit}]) instead",
                    f"it is now in {culprit_line}", f"({waiter_line})"]
    else:   # a data loader's worker process (a plain forked one, and torch's DataLoader)
        expected = [f"rank {culprit} never submitted allreduce 'batch.stats'", f"it is in {culprit_line}",
                    "waiting for its child process (pid ", f"in {marker_line(scenario, 'worker')}",
                    f"{others(np_)} {wait} in it ({waiter_line})"]
    for piece in expected:
        assert piece in verdict, f"{piece!r} not in the verdict:\n{verdict}\n--- job output:\n{output[-3000:]}"
    assert f"{np_ - (1 if scenario in ('sigstop', 'kill') else 0)} of {np_} ranks dumped" in verdict


def run_until_dumped(tmp_path, scenario: str, np_: int, transport: str, launcher_args) -> str:
    """Run a planted hang until every rank dumped (a job under mpirun may not end by itself: MPI's finalize waits
    for the sleeping rank), then stop it and return the verdict."""
    argv = [sys.executable, "-m", "horovod.runner", "-np", str(np_), *launcher_args, sys.executable, str(PLANTED),
            scenario]
    dumps = tmp_path / "dumps"
    proc = subprocess.Popen(argv, env=job_env(tmp_path, transport), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if {p.name.split("-")[1] for p in dumps.glob("g*-rank*.json")} >= {f"rank{r}" for r in range(np_)}:
                time.sleep(0.5)   # let late dumps land
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    try:
        return "\n".join(report(str(dumps)))
    except Exception as exc:
        raise AssertionError(f"no verdict ({exc}); job output:\n{output[-4000:]}") from exc


@pytest.mark.parametrize("transport,launcher_args", [
    ("auto", ("-H", "localhost:1,127.0.0.1:1")),   # two "hosts": the hierarchical transport
    ("mpi", ("--mpi",)),                           # mpirun: no store to watch, the ranks' own stall-error dumps
])
def test_planted_hangs_over_hierarchical_and_mpi(tmp_path, transport, launcher_args):
    if transport == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed")
    for scenario in ("sleep", "order"):
        verdict = run_until_dumped(tmp_path / scenario, scenario, 2, transport, launcher_args)
        chosen = {json.load(open(p))["transport"] for p in (tmp_path / scenario / "dumps").glob("g*.json")}
        assert chosen == {"hierarchical" if transport == "auto" else "mpi"}, chosen
        if scenario == "sleep":
            assert (f"rank 1 never submitted allreduce 'grad.fc1.bias' (its collective #10): it is in "
                    f"{marker_line('sleep', 'culprit')}") in verdict, verdict
        else:
            assert (f"rank 0 waits in allgather 'a' at {marker_line('order', 'waiter')}, rank 1 waits in allreduce "
                    f"'b' at {marker_line('order', 'culprit')}") in verdict, verdict


def test_eight_ranks_dumped_and_collected_within_seconds_of_the_stall_warning(tmp_path):
    """No stall shutdown: the job hangs for good; the launcher collects every rank's dump at the warning."""
    env = job_env(tmp_path, "shm", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="0", HOROVOD_STALL_CHECK_TIME_SECONDS="3")
    argv = [sys.executable, "-m", "horovod.runner", "-np", "8", sys.executable, str(PLANTED), "sleep"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    warned = collected = None
    lines = []
    try:
        for line in output_lines(proc, 150):
            lines.append(line)
            if warned is None and "One or more tensors were submitted" in line:
                warned = time.monotonic()
            match = re.search(r"collected in ([0-9.]+) s after rank 0 reported a stall warning", line)
            if match:
                collected = time.monotonic()
                took = float(match.group(1))
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "".join(lines)
    assert warned is not None and collected is not None, text[-4000:]
    assert took < 5.0 and collected - warned < 8.0, text[-4000:]
    assert "Horovod doctor (8 of 8 ranks dumped" in text
    assert "rank 7 never submitted allreduce 'grad.fc1.bias'" in text
    assert "ranks 0–6 wait in it" in text
