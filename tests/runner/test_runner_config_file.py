"""--config-file: keys, precedence against flags and the environment, validation."""
from __future__ import annotations

import logging

import pytest

from horovod.engine import config
from horovod.runner import cli, config_file, launch

FULL = """
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
  torus_allreduce: true
autotune:
  enabled: true
  log_file: /tmp/autotune.csv
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 40
  gaussian_process_noise: 0.5
timeline:
  filename: /tmp/timeline.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 120
  shutdown_time_seconds: 240
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: "0,1"
  gloo_timeout_seconds: 45
logging:
  level: debug
  with_timestamp: false
"""


@pytest.fixture
def cfg(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(text)
        return str(path)

    return write


def _env(words, parent=None):
    args = launch.parse_args([*words, "true"])
    return args, cli.knob_env(args, parent or {})


def test_every_key_of_the_original(cfg):
    args, env = _env(["--config-file", cfg(FULL)])
    assert args.use_gloo is True
    expected = {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "10.0",
        "HOROVOD_CACHE_CAPACITY": "2048", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_TORUS_ALLREDUCE": "1", "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "/tmp/autotune.csv", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "20", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "40",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5", "HOROVOD_TIMELINE": "/tmp/timeline.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "120", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "240",
        "HOROVOD_MPI_THREADS_DISABLE": "1", "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "0,1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_LOG_HIDE_TIME": "1",
    }
    assert env == expected
    # Every knob that has both a flag and a config key was covered by the file above.
    assert {k.env for k in cli.flag_knobs() if k.config_key and k.name != "transport"} <= set(env)


def test_flags_after_config_file_win_flags_before_lose(cfg):
    path = cfg("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 10\n")
    _, env = _env(["--fusion-threshold-mb", "1", "--config-file", path, "--cycle-time-ms", "3"])
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)   # before: overridden by the file
    assert env["HOROVOD_CYCLE_TIME"] == "3.0"                          # after: overrides the file


def test_bool_pair_after_config_file_wins(cfg):
    path = cfg("params:\n  hierarchical_allreduce: true\nstall_check:\n  enabled: false\n")
    _, env = _env(["--config-file", path, "--no-hierarchical-allreduce", "--stall-check"])
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "0"


def test_environment_beats_config_file_but_not_flags(cfg):
    path = cfg("params:\n  cache_capacity: 10\n  cycle_time_ms: 10\n")
    parent = {"HOROVOD_CACHE_CAPACITY": "99", "HOROVOD_CYCLE_TIME": "7"}
    _, env = _env(["--config-file", path, "--cycle-time-ms", "3"], parent)
    assert "HOROVOD_CACHE_CAPACITY" not in env   # the worker inherits 99 from the environment
    assert env["HOROVOD_CYCLE_TIME"] == "3.0"    # the flag wins over the environment


def test_controller_key(cfg):
    args, _ = _env(["--config-file", cfg("controller: mpi\n")])
    assert (args.use_gloo, args.use_mpi) == (None, True)
    args, _ = _env(["--config-file", cfg("controller: mpi\n"), "--gloo"])
    assert (args.use_gloo, args.use_mpi) == (True, None)
    args, _ = _env(["--mpi", "--config-file", cfg("controller: gloo\n")])
    assert (args.use_gloo, args.use_mpi) == (True, None)


@pytest.mark.parametrize("text, fragment", [
    ("params:\n  fusion_threshold_mb: -1\n", "fusion_threshold_mb=-1 must be >= 0"),
    ("params:\n  cycle_time_ms: -0.5\n", "cycle_time_ms=-0.5 must be >= 0"),
    ("stall_check:\n  warning_time_seconds: -3\n", "stall_check_warning_time_seconds=-3 must be >= 0"),
    ("autotune:\n  gaussian_process_noise: 1.5\n", "autotune_gaussian_process_noise=1.5 must be in [0, 1]"),
    ("autotune:\n  gaussian_process_noise: -0.1\n", "must be"),
])
def test_validation_messages(cfg, text, fragment):
    args = cli.build_parser().parse_args(["--config-file", cfg(text), "true"])
    config_file.apply(args, config_file.load(args.config_file))
    with pytest.raises(ValueError) as info:
        config_file.validate(args)
    assert fragment in str(info.value)


def test_validation_message_is_the_originals():
    args = cli.build_parser().parse_args(["--cache-capacity", "-5", "true"])
    with pytest.raises(ValueError, match=r"^cache_capacity=-5 must be >= 0$"):
        config_file.validate(args)


@pytest.mark.parametrize("text, fragment", [
    ("params:\n  fusion_threshold_mb: lots\n", "params.fusion_threshold_mb: expected an integer"),
    ("params:\n  hierarchical_allreduce: maybe\n", "params.hierarchical_allreduce: expected true or false"),
    ("logging:\n  level: LOUD\n", "logging.level: expected one of"),
    ("controller: carrier-pigeon\n", "controller must be one of"),
    ("- a\n- b\n", "must hold a mapping"),
    ("params: [\n", "not valid YAML"),
])
def test_bad_files_are_usage_errors(cfg, capsys, text, fragment):
    with pytest.raises(SystemExit) as info:
        launch.parse_args(["--config-file", cfg(text), "true"])
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_missing_file(capsys, tmp_path):
    with pytest.raises(SystemExit):
        launch.parse_args(["--config-file", str(tmp_path / "nope.yaml"), "true"])
    assert "cannot read --config-file" in capsys.readouterr().err


def test_unknown_keys_warn_and_are_ignored(cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="horovod.runner.config_file"):
        _, env = _env(["--config-file", cfg("params:\n  fusion_thresold_mb: 3\nverbose: true\n")])
    assert env == {}
    assert "params.fusion_thresold_mb" in caplog.text
    assert "'verbose'" in caplog.text


def test_empty_file_is_fine(cfg):
    _, env = _env(["--config-file", cfg("")])
    assert env == {}


def test_engine_reads_what_the_file_says(cfg):
    _, env = _env(["--config-file", cfg(FULL)])
    values = config.load(env).values
    assert values["fusion_threshold"] == 32 * 1024 * 1024
    assert values["stall_check_disable"] is True
    assert values["log_hide_time"] is True
    assert values["autotune_gaussian_process_noise"] == 0.5
