"""The knob table as a typed, frozen ``Config`` (issue 35) and every knob checked where the table declares it
(issue 38): each bad value is refused by ``load()`` naming the variable, the value and what is accepted, and
``hvd.init()`` on a real rank fails at once instead of hanging (E4: ``HOROVOD_CYCLE_TIME=nan``)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest

from horovod.engine import config, knobs
from horovod.engine.config import KNOBS, Config
from multiproc import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: String knobs that take any text (file names, paths); every other string knob declares choices or a form.
FREE_TEXT = {"autotune_log", "timeline", "nccl_so_path", "flight_recorder_dir"}


# ------------------------------------------------------------------------------------------------ the typed table
def test_config_fields_are_the_knob_table():
    knob_fields = [f.name for f in dataclasses.fields(Config) if knobs.METADATA_KEY in f.metadata]
    assert knob_fields == [k.name for k in KNOBS] and len(KNOBS) >= 40
    assert config.KNOBS_BY_NAME == {k.name: k for k in KNOBS}
    others = {f.name for f in dataclasses.fields(Config)} - set(knob_fields)
    assert others == {"nccl_multi_rank_gpu", "fixed", "topology"}
    # No attribute fallback: an unknown name is an AttributeError at run time too, not a lookup in a dict.
    assert "__getattr__" not in vars(Config)
    cfg = config.load({})
    misspelt = "fusion_threshol"
    with pytest.raises(AttributeError):
        getattr(cfg, misspelt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fusion_threshold = 1   # type: ignore[misc]  # frozen: this assignment is what the test checks


def test_each_field_type_is_its_knobs_type_and_defaults_are_accepted():
    hints = {f.name: f.type for f in dataclasses.fields(Config)}
    cfg = Config()
    for k in KNOBS:
        assert hints[k.name] == k.type.__name__, k.name
        assert type(getattr(cfg, k.name)) is k.type and getattr(cfg, k.name) == k.default, k.name
        assert k.problem(k.default) is None, k.name


_HEAVY_FOR_MYPY = ("torch", "torchmetrics", "jax", "jaxlib", "optax", "lightning", "lightning_fabric",
                   "pytorch_lightning", "tensorflow", "keras", "tf_keras", "ray", "pyspark", "mxnet", "mpi4py",
                   "pandas", "pyarrow", "matplotlib", "rich", "scipy", "sklearn", "ml_dtypes")


def test_a_misspelt_knob_is_a_mypy_error(tmp_path):
    pytest.importorskip("mypy", reason="mypy is a test tool: pip install -e '.[test]'")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "from horovod.engine.config import Config, load\n"
        "cfg: Config = load({})\n"
        "threshold: int = cfg.fusion_threshold + cfg.replace(cache_capacity=0).cache_capacity\n"
        "typo = cfg.fusion_threshol\n"
        "wrong: str = cfg.cycle_time_ms\n"
        "cfg.fusion_threshold = 1\n")
    # Only the snippet's own errors matter: the project's modules are followed silently, and the frameworks behind
    # `horovod/__init__.py` are skipped (analysing torch, jax and Lightning took 60-100 s of CI, this takes ~10).
    ini = tmp_path / "mypy.ini"
    ini.write_text("[mypy]\nignore_missing_imports = True\n[mypy-horovod.*]\nfollow_imports = silent\n"
                   f"[mypy-{','.join(f'{m},{m}.*' for m in _HEAVY_FOR_MYPY)}]\nfollow_imports = skip\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ini), "--cache-dir",
                           str(tmp_path / "cache"), "--no-error-summary", "--show-error-codes", str(snippet)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = {int(m.group(1)): m.group(2) for m in re.finditer(r"snippet\.py:(\d+): error: (.*)", proc.stdout)}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(errors) == [4, 5, 6], proc.stdout   # line 3 (correct names and types) is clean
    assert "has no attribute \"fusion_threshol\"" in errors[4]
    assert "incompatible types" in errors[5].lower()
    assert "read-only" in errors[6] or "frozen" in errors[6]


def test_replace_keeps_the_type_checks_and_the_limits():
    cfg = config.load({}, fusion_threshold=MIB_2)
    tuned = cfg.replace(cycle_time_ms=2.5)
    assert (tuned.cycle_time_ms, tuned.fusion_threshold, tuned.fixed) == (2.5, MIB_2, cfg.fixed)
    assert cfg.cycle_time_ms == 0.0   # frozen: the original is unchanged
    assert tuned.values["cycle_time_ms"] == 2.5 and set(tuned.values) == {k.name for k in KNOBS}
    with pytest.raises(TypeError):
        cfg.replace(cycle_time=1.0)   # a misspelt knob is refused at run time too
    with pytest.raises(ValueError, match="cycle_time_ms"):
        cfg.replace(cycle_time_ms=math.inf)


MIB_2 = 2 * knobs.MIB


# ------------------------------------------------------------------------------------------------ checked values
def test_every_numeric_knob_declares_a_range_and_every_string_knob_its_values():
    for k in KNOBS:
        if k.type in (int, float):
            assert k.minimum is not None and k.maximum is not None, k.name
        elif k.type is str:
            assert bool(k.choices) or bool(k.pattern) or k.name in FREE_TEXT, k.name


def _bad_values(k: knobs.Knob):
    """Values outside what ``k`` declares, as environment strings."""
    if k.type is bool:
        return ["maybe", "nan", "2", "-1"]
    if k.type in (int, float):
        out = ["nan", "inf", "-inf", "lots", repr(k.minimum - 1), repr(k.maximum * 10 + 1)]
        if k.type is int:
            out.append("2.5")
        return out
    if k.choices:
        return ["bogus"]
    if k.pattern:
        return ["0, x"]
    return []


_CASES = [(k, raw) for k in KNOBS if k.env for raw in _bad_values(k)]


@pytest.mark.parametrize("knob,raw", _CASES, ids=[f"{k.env}={raw}" for k, raw in _CASES])
def test_load_refuses_each_bad_value_naming_the_variable(knob, raw):
    with pytest.raises(ValueError) as info:
        config.load({knob.env: raw})
    message = str(info.value)
    assert f"{knob.env}={raw!r}" in message and "expected" in message and knob.name in message


@pytest.mark.parametrize("env,raw,accepted", [
    # Each one passed silently before (issue 38); E4: nan / inf hung the first collective that was not tiny.
    ("HOROVOD_CYCLE_TIME", "nan", "a finite number from 0 to 60000"),
    ("HOROVOD_CYCLE_TIME", "inf", "a finite number from 0 to 60000"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "an integer from 0 to"),
    ("HOROVOD_CACHE_CAPACITY", "1e99", "an integer from 0 to 1048576"),
    ("HOROVOD_SPIN_US", "inf", "a finite number from 0 to 1000000"),
    ("HOROVOD_LOG_LEVEL", "LOUD", "one of 'TRACE', 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'FATAL'"),
    ("HOROVOD_CONTROLLER", "xyz", "one of '', 'gloo', 'mpi'"),
    ("HOROVOD_TRANSPORT", "bogus", "one of 'auto', 'tcp', 'shm', 'mpi', 'hierarchical'"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "0", "an integer from 1 to"),
    ("HOROVOD_THREAD_AFFINITY", "first", "comma-separated core ids"),
    # Each one passed silently before (issue 53): a boolean was any number >= 1, and the dump directory was only
    # tried when the first dump was written, whose failure is logged, so the hang dump was lost without a word.
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "2", "0 or 1"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "7", "0 or 1"),
    ("HOROVOD_FLIGHT_RECORDER_DIR", "/proc/nope", "a directory this user can create or write to"),
])
def test_the_values_the_issue_reported(env, raw, accepted):
    with pytest.raises(ValueError) as info:
        config.load({env: raw})
    assert f"{env}={raw!r}" in str(info.value) and accepted in str(info.value)


def test_booleans_take_0_1_and_the_words():
    for raw, value in (("0", False), ("1", True), ("1.0", True), (" true ", True), ("Off", False), ("", False)):
        assert config.load({"HOROVOD_HIERARCHICAL_ALLREDUCE": raw}).hierarchical_allreduce is value, raw


def test_the_flight_recorder_directory_is_checked_without_a_trace_or_refused_naming_why(tmp_path):
    later = tmp_path / "dumps" / "job"   # made by the first dump, as before; checked now
    assert config.load({"HOROVOD_FLIGHT_RECORDER_DIR": str(later)}).flight_recorder_dir == str(later)
    assert config.load({"HOROVOD_FLIGHT_RECORDER_DIR": str(tmp_path)}).flight_recorder_dir == str(tmp_path)
    assert list(tmp_path.iterdir()) == []   # the probes are gone, and nothing was made for good
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad, why in ((a_file, "it is not a directory"), (a_file / "below", "cannot be created")):
        with pytest.raises(ValueError) as info:
            config.load({"HOROVOD_FLIGHT_RECORDER_DIR": str(bad)})
        assert f"HOROVOD_FLIGHT_RECORDER_DIR={str(bad)!r}" in str(info.value) and why in str(info.value)
    # horovodrun's flag is refused before any worker starts.
    knob = config.KNOBS_BY_NAME["flight_recorder_dir"]
    with pytest.raises(ValueError, match=r"--flight-recorder-dir '/proc/nope' .*cannot be created"):
        knob.check_flag("/proc/nope", "--flight-recorder-dir")


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.type in (int, float)], ids=lambda k: k.name)
def test_limits_are_inclusive(knob):
    for edge in (knob.minimum, knob.maximum):
        raw = str(int(edge)) if knob.type is int else repr(float(edge))
        assert getattr(config.load({knob.env: raw}), knob.name) == edge


def test_choices_take_any_case_and_keep_it():
    cfg = config.load({"HOROVOD_LOG_LEVEL": "debug", "HOROVOD_TRANSPORT": "TCP", "HOROVOD_CONTROLLER": "Gloo",
                       "HOROVOD_THREAD_AFFINITY": "0, 3"})
    assert (cfg.log_level, cfg.transport, cfg.controller, cfg.thread_affinity) == ("debug", "TCP", "Gloo", "0, 3")


def test_explicit_arguments_and_direct_construction_are_checked_too():
    with pytest.raises(ValueError, match=r"cycle_time_ms=nan \(given explicitly\)"):
        config.load({}, cycle_time_ms=math.nan)
    with pytest.raises(ValueError, match="cache_capacity"):
        Config(cache_capacity=-1)
    with pytest.raises(ValueError, match="not finite"):
        Config(cycle_time_ms=math.inf)   # E4: an engine can no longer be handed an endless batching window
    with pytest.raises(ValueError, match="not one of the choices"):
        Config(transport="bogus")


def test_flag_values_are_checked_in_the_flags_units():
    k = config.KNOBS_BY_NAME["fusion_threshold"]
    k.check_flag(0.5, "--fusion-threshold-mb")            # half a MiB is fine
    with pytest.raises(ValueError) as info:
        k.check_flag(float("inf"), "--fusion-threshold-mb")
    assert "--fusion-threshold-mb inf" in str(info.value) and "from 0 to 1048576" in str(info.value)
    with pytest.raises(ValueError, match="--fusion-threshold-mb 2000000 .*from 0 to 1048576"):
        k.check_flag(2_000_000, "--fusion-threshold-mb")


# ------------------------------------------------------------------------------------------------ real processes
def _init_then_allreduce():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    try:   # reached only without the check: with cycle time nan this collective never ran (E4)
        return float(hvd.allreduce(np.ones(1 << 18, np.float32), op=hvd.Sum)[0])
    finally:
        hvd.shutdown()


def test_init_on_every_rank_fails_at_once_on_a_bad_knob():
    outcomes = run_ranks(_init_then_allreduce, 2, env={"HOROVOD_CYCLE_TIME": "nan",
                                                        "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"},
                         timeout=180, expect_failure=True)
    for outcome in outcomes:
        status, _ = outcome
        assert status == "error", outcome
        assert outcome.error["type"] == "ValueError", outcome.error
        assert "HOROVOD_CYCLE_TIME='nan'" in outcome.error["message"], outcome.error
        assert "a finite number from 0 to 60000" in outcome.error["message"], outcome.error


def test_init_on_every_rank_refuses_an_unusable_flight_recorder_directory():
    outcomes = run_ranks(_init_then_allreduce, 2, env={"HOROVOD_FLIGHT_RECORDER_DIR": "/proc/nope"},
                         timeout=180, expect_failure=True)
    for outcome in outcomes:
        status, _ = outcome
        assert status == "error", outcome
        assert "HOROVOD_FLIGHT_RECORDER_DIR='/proc/nope'" in outcome.error["message"], outcome.error
        assert "a directory this user can create or write to" in outcome.error["message"], outcome.error
