"""The horovodrun parser: generated knob flags, their environment, and argument errors."""
from __future__ import annotations

import pytest

from horovod.engine import config
from horovod.runner import cli, launch
from horovod.runner.api import _HorovodArgs

FLAG_KNOBS = cli.flag_knobs()


def _sample(knob):
    """A non-default flag value for ``knob`` and the command-line words that give it."""
    if knob.type is bool:
        return False if knob.inverted else True, [knob.flag]
    if knob.choices:
        return knob.choices[1], [knob.flag, knob.choices[1].lower()]   # any case; the table's spelling comes back
    if knob.name == "thread_affinity":
        return "0,1", [knob.flag, "0,1"]
    if knob.type is int:
        return 7, [knob.flag, "7"]
    if knob.type is float:
        return 0.25, [knob.flag, "0.25"]
    return "some-value", [knob.flag, "some-value"]


def _parse(words):
    return launch.parse_args([*words, "true"])


def test_every_flagged_knob_is_a_parser_option():
    options = {opt for action in cli.build_parser()._actions for opt in action.option_strings}
    for knob in FLAG_KNOBS:
        assert knob.flag in options
        if knob.negatable:
            assert "--no-" + knob.flag[2:] in options
    assert len(FLAG_KNOBS) >= 20  # the table, not a hand-written subset


@pytest.mark.parametrize("knob", FLAG_KNOBS, ids=lambda k: k.flag)
def test_flag_round_trips_through_worker_environment(knob):
    value, words = _sample(knob)
    args = _parse(words)
    assert getattr(args, cli.knob_dest(knob)) == value
    env = cli.knob_env(args, {})
    assert env == {knob.env: config.flag_to_env(knob, value)}
    # What the engine reads back is the flag's meaning, in engine units.
    loaded = config.load(env).values[knob.name]
    if knob.type is bool:
        assert loaded is True  # the flag turns the behaviour it names on (inverted: the *_disable / hide knob)
    elif knob.flag_scale != 1:
        assert loaded == value * knob.flag_scale
    else:
        assert loaded == value
    assert knob.name in config.load(env).fixed


@pytest.mark.parametrize("knob", [k for k in FLAG_KNOBS if k.type is bool], ids=lambda k: k.flag)
def test_bool_flag_opposite_spelling(knob):
    if knob.inverted:
        opposite = cli._positive_flag(knob.flag)
    elif knob.negatable:
        opposite = "--no-" + knob.flag[2:]
    else:
        pytest.skip("no opposite spelling")
    env = cli.knob_env(_parse([opposite]), {})
    assert config.load(env).values[knob.name] is False
    assert env[knob.env] == "0"


@pytest.mark.parametrize("knob", [k for k in FLAG_KNOBS if k.type is bool and (k.negatable or k.inverted)],
                         ids=lambda k: k.flag)
def test_bool_pairs_are_mutually_exclusive(knob, capsys):
    opposite = cli._positive_flag(knob.flag) if knob.inverted else "--no-" + knob.flag[2:]
    with pytest.raises(SystemExit) as info:
        _parse([knob.flag, opposite])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_known_spellings_of_the_original():
    args = _parse(["--fusion-threshold-mb", "32", "--cycle-time-ms", "20", "--no-stall-check",
                   "--log-without-timestamp", "--autotune", "--timeline-filename", "/tmp/t.json"])
    env = cli.knob_env(args, {})
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "20.0"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["HOROVOD_AUTOTUNE"] == "1"
    assert env["HOROVOD_TIMELINE"] == "/tmp/t.json"
    assert args.log_with_timestamp is False


def test_unset_flags_export_nothing():
    assert cli.knob_env(_parse([]), {}) == {}


def test_launcher_flags():
    args = launch.parse_args(["-np", "4", "-H", "a:2,b:2", "--start-timeout", "9", "--network-interfaces",
                              "eth0,eth1", "--network-interface", "eth2", "--output-filename", "out",
                              "-prefix-timestamp", "--verbose", "-p", "2222", "-i", "key", "--disable-cache",
                              "--gloo", "--mpi-args=-x FOO", "--tcp", "--binding-args", "-bind-to none",
                              "--min-np", "2", "--max-np", "8", "--slots-per-host", "2", "--elastic-timeout", "5",
                              "--reset-limit", "3", "--blacklist-cooldown-range", "1", "10",
                              "python", "train.py", "--lr", "0.1", "-np", "99"])
    assert (args.num_proc, args.hosts, args.start_timeout) == (4, "a:2,b:2", 9)
    assert args.nics == ["eth0", "eth1", "eth2"]
    assert (args.output_filename, args.prefix_output_with_timestamp, args.verbose) == ("out", True, True)
    assert (args.ssh_port, args.ssh_identity_file, args.disable_cache) == (2222, "key", True)
    assert (args.use_gloo, args.use_mpi, args.use_jsrun) == (True, None, None)
    assert (args.mpi_args, args.tcp_flag, args.binding_args) == ("-x FOO", True, "-bind-to none")
    assert (args.min_num_proc, args.max_num_proc, args.slots) == (2, 8, 2)
    assert (args.elastic_timeout, args.reset_limit, args.cooldown_range) == (5, 3, [1, 10])
    # Everything after the command belongs to the command.
    assert args.command == ["python", "train.py", "--lr", "0.1", "-np", "99"]


def test_single_dash_long_options():
    args = launch.parse_args(["-np", "2", "-hostfile", "hf", "-cb"])
    assert (args.num_proc, args.hostfile, args.check_build) == (2, "hf", True)


@pytest.mark.parametrize("words, fragment", [
    (["--bogus", "-np", "1", "true"], "unrecognized arguments: --bogus"),
    (["-np", "two", "true"], "argument -np/--num-proc: invalid int value: 'two'"),
    (["--gloo", "--mpi", "true"], "argument --mpi: not allowed with argument --gloo"),
    (["-H", "a:1", "-hostfile", "f", "true"], "not allowed with argument"),
    (["--log-level", "LOUD", "true"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--fusion-threshold-mb", "-1", "true"], "fusion_threshold_mb=-1 must be >= 0"),
    (["--autotune-gaussian-process-noise", "1.5", "true"], "must be in [0, 1]"),
])
def test_argument_errors_are_argparse_errors(words, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        launch.parse_args(words)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "usage: horovodrun" in err


def test_horovod_args_has_every_dest():
    hargs = _HorovodArgs()
    assert hargs.num_proc == 1
    for dest in cli.defaults():
        assert hasattr(hargs, dest)
    for knob in FLAG_KNOBS:
        assert getattr(hargs, cli.knob_dest(knob)) is None


def test_start_timeout_resolution():
    assert launch.start_timeout(None, {}) == 30
    assert launch.start_timeout(None, {"HOROVOD_START_TIMEOUT": "45"}) == 45
    assert launch.start_timeout(5, {"HOROVOD_START_TIMEOUT": "45"}) == 5
    with pytest.raises(ValueError, match="HOROVOD_START_TIMEOUT"):
        launch.start_timeout(None, {"HOROVOD_START_TIMEOUT": "soon"})


def test_launch_mode():
    assert launch.launch_mode(_parse([])) == "gloo"
    assert launch.launch_mode(_parse(["--mpi"])) == "mpi"
    assert launch.launch_mode(_parse(["--jsrun"])) == "jsrun"
    assert launch.launch_mode(_parse(["--host-discovery-script", "d.sh"])) == "elastic"
    assert launch.launch_mode(_parse(["--min-np", "1"])) == "elastic"
