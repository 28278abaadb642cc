"""``horovodrun`` refuses a knob value the table does not accept (issue 38) before it starts any worker, naming the
flag (or config key, or inherited variable), the value received and what is accepted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USAGE_EXIT = 2


def _horovodrun(args, tmp_path, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "_HOROVOD_SECRET_KEY"}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "horovod.runner", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("words, fragments", [
    (["--cycle-time-ms", "nan"], ["--cycle-time-ms nan", "HOROVOD_CYCLE_TIME", "a finite number from 0 to 60000"]),
    (["--fusion-threshold-mb", "2000000"], ["--fusion-threshold-mb 2000000", "from 0 to 1048576"]),
    (["--gloo-timeout-seconds", "0"], ["--gloo-timeout-seconds 0", "an integer from 1 to"]),
    (["--cache-capacity", "99999999"], ["--cache-capacity 99999999", "an integer from 0 to 1048576"]),
    (["--transport", "bogus"], ["argument --transport: invalid choice: 'bogus'"]),
    (["--thread-affinity", "first"], ["--thread-affinity 'first'", "comma-separated core ids"]),
], ids=["cycle-time-nan", "fusion-threshold-too-large", "gloo-timeout-0", "cache-capacity-too-large",
        "transport-bogus", "thread-affinity-words"])
def test_a_bad_flag_value_stops_horovodrun_naming_the_flag(words, fragments, tmp_path):
    proc = _horovodrun([*words, "-np", "1", sys.executable, "-c", "print('worker ran')"], tmp_path)
    assert proc.returncode == USAGE_EXIT, proc.stdout + proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr
    assert "worker ran" not in proc.stdout


def test_a_bad_config_file_value_names_its_key(tmp_path):
    (tmp_path / "hvd.yaml").write_text("params:\n  cycle_time_ms: .inf\n")
    proc = _horovodrun(["--config-file", "hvd.yaml", "-np", "1", sys.executable, "-c", "print('worker ran')"],
                       tmp_path)
    assert proc.returncode == USAGE_EXIT, proc.stdout + proc.stderr
    assert "config key params.cycle_time_ms inf" in proc.stderr and "finite" in proc.stderr, proc.stderr
    assert "worker ran" not in proc.stdout


def test_a_bad_inherited_variable_stops_horovodrun_before_any_worker(tmp_path):
    proc = _horovodrun(["-np", "1", sys.executable, "-c", "print('worker ran')"], tmp_path, HOROVOD_SPIN_US="inf")
    assert proc.returncode == USAGE_EXIT, proc.stdout + proc.stderr
    assert "HOROVOD_SPIN_US='inf'" in proc.stderr and "a finite number from 0 to 1000000" in proc.stderr, \
        proc.stderr
    assert "worker ran" not in proc.stdout


def test_good_values_reach_the_worker_in_the_tables_spelling(tmp_path):
    show = "import os; print('knobs', os.environ['HOROVOD_CYCLE_TIME'], os.environ['HOROVOD_TRANSPORT'])"
    proc = _horovodrun(["--cycle-time-ms", "0.5", "--transport", "TCP", "-np", "1", sys.executable, "-c", show],
                       tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "knobs 0.5 tcp" in proc.stdout, proc.stdout
