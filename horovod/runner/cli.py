"""The ``horovodrun`` argument parser: launcher flags written here, tuning flags generated from the knob table.

Every knob of :data:`horovod.engine.config.KNOBS` that has a ``flag`` becomes an option whose ``dest`` is the
flag's name (``--fusion-threshold-mb`` → ``fusion_threshold_mb``, as in the original), and whose value is the
*flag value*: what :func:`horovod.engine.config.flag_to_env` turns into the worker's environment.  For an
``inverted`` knob the flag is the negative spelling (``--no-stall-check``, ``--log-without-timestamp``); its
dest is the positive name (``stall_check``, ``log_with_timestamp``) and a hidden positive flag sets it back.

Knob options remember whether they came after ``--config-file`` (in ``args.config_overrides``) so the config
file can override the ones before it and yield to the ones after it (see :mod:`horovod.runner.config_file`).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set

from horovod.engine import config

#: Attribute of the parsed namespace holding the dests given after ``--config-file``.
OVERRIDES_ATTR = "config_overrides"
#: Attribute of the parsed namespace holding the dests whose value came from the config file.
FROM_CONFIG_ATTR = "config_values"

LOG_LEVELS: Sequence[str] = config.KNOBS_BY_NAME["log_level"].choices

#: Dests of the controller flags; the config file's ``controller`` key sets them.
CONTROLLER_DESTS = ("use_gloo", "use_mpi", "use_jsrun")

#: Dests that switch a job to elastic mode.
ELASTIC_DESTS = ("min_num_proc", "max_num_proc", "host_discovery_script", "slots", "elastic_timeout",
                 "reset_limit", "cooldown_range")


def _positive_flag(flag: str) -> str:
    """The positive spelling of an inverted knob's flag (``--no-x`` → ``--x``, ``--a-without-b`` → ``--a-with-b``)."""
    body = flag[2:]
    if body.startswith("no-"):
        return "--" + body[3:]
    if "-without-" in body:
        return "--" + body.replace("-without-", "-with-", 1)
    raise ValueError(f"inverted knob flag {flag!r} has no positive spelling rule; name it '--no-<x>' or "
                     f"'--<a>-without-<b>' (horovod/runner/cli.py:_positive_flag)")


def knob_dest(knob: config.Knob) -> str:
    """The namespace attribute a knob's flag stores into."""
    if knob.flag is None:
        raise ValueError(f"knob {knob.name!r} has no horovodrun flag")
    flag = _positive_flag(knob.flag) if knob.inverted else knob.flag
    return flag.lstrip("-").replace("-", "_")


def flag_knobs() -> List[config.Knob]:
    """Knobs that have a ``horovodrun`` flag, in table order."""
    return [k for k in config.KNOBS if k.flag]


def knob_by_dest() -> Dict[str, config.Knob]:
    return {knob_dest(k): k for k in flag_knobs()}


class _Tracked(argparse.Action):
    """``store`` / ``store_const`` that also records dests given after ``--config-file``.

    argparse runs actions in command-line order, so ``config_file`` is already set exactly when the option
    appears after ``--config-file``.
    """

    def __init__(self, option_strings, dest, nargs=None, const=None, **kwargs):
        if const is not None:
            nargs = 0
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        if getattr(namespace, "config_file", None) is not None:
            overrides = getattr(namespace, OVERRIDES_ATTR, None)
            if overrides is None:
                overrides = set()
                setattr(namespace, OVERRIDES_ATTR, overrides)
            overrides.add(self.dest)


class _NicsAction(argparse.Action):
    """Accumulate ``--network-interfaces eth0,eth1`` / repeated ``--network-interface eth0`` in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = list(getattr(namespace, self.dest, None) or [])
        for nic in str(values).split(","):
            nic = nic.strip()
            if nic and nic not in current:
                current.append(nic)
        setattr(namespace, self.dest, current)


def _choice(knob: config.Knob) -> Callable[[str], str]:
    """Argparse ``type`` of a knob with choices: the table's spelling of a choice given in any case."""
    spelling = {c.lower(): c for c in knob.choices}
    return lambda value: spelling.get(value.strip().lower(), value)


def _shown_default(knob: config.Knob) -> Any:
    if knob.flag_scale != 1 and isinstance(knob.default, (int, float)):
        scaled = knob.default / knob.flag_scale
        return int(scaled) if float(scaled).is_integer() else scaled
    return knob.default


def _add_knob(parser: argparse.ArgumentParser, groups: Dict[str, argparse._ArgumentGroup],
              knob: config.Knob) -> None:
    flag = knob.flag
    if flag is None:
        raise ValueError(f"knob {knob.name!r} has no command-line flag")   # flag_knobs() passes only those that do
    section = (knob.config_key or "other").split(".")[0]
    group = groups.get(section) or groups["other"]
    dest = knob_dest(knob)
    if knob.type is bool:
        pair = group.add_mutually_exclusive_group()
        if knob.inverted:
            pair.add_argument(flag, *knob.aliases, dest=dest, action=_Tracked, const=False, default=None,
                              help=knob.help)
            pair.add_argument(_positive_flag(flag), dest=dest, action=_Tracked, const=True, default=None,
                              help=argparse.SUPPRESS)
        else:
            pair.add_argument(flag, *knob.aliases, dest=dest, action=_Tracked, const=True, default=None,
                              help=knob.help)
            if knob.negatable:
                pair.add_argument("--no-" + flag[2:], dest=dest, action=_Tracked, const=False, default=None,
                                  help=f"Explicitly turn {flag} off.")
        return
    if knob.inverted:
        raise ValueError(f"knob {knob.name!r}: only boolean knobs can be inverted")
    kwargs: Dict[str, Any] = {"type": knob.type}
    if knob.choices:
        kwargs = {"type": _choice(knob), "choices": list(knob.choices)}
    default = _shown_default(knob)
    shown = f" (default: {default})" if default not in ("", None) else ""
    group.add_argument(flag, *knob.aliases, dest=dest, action=_Tracked, default=None,
                       help=knob.help + shown, **kwargs)


#: The PyPI-style name this project is installed under (``pip show horovod-next``).
DISTRIBUTION = "horovod-next"


def distribution_version() -> str:
    """This installation's own version, from its package metadata (``0.28.1.post1``), or a note saying that the
    code runs from a checkout that was never installed."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "(not installed: running from a checkout; pip install -e . records the version)"


def version_line() -> str:
    """What ``horovodrun --version`` prints: ``horovod-next 0.28.1.post1 (Horovod 0.28.1 API)``.

    The original printed the bare ``0.28.1``.  This line names the distribution's own version first and still
    contains the Horovod API version it implements (``horovod.__version__``, unchanged), so a script that looked
    for ``0.28.1`` in the output still finds it; a script that needs one exact value reads ``horovod.__version__``
    (the API) or ``importlib.metadata.version("horovod-next")`` (the release) instead.
    """
    from horovod.version import __version__

    return f"{DISTRIBUTION} {distribution_version()} (Horovod {__version__} API)"


def build_parser() -> argparse.ArgumentParser:
    """The full ``horovodrun`` parser (launcher flags + every knob flag of the table)."""
    parser = argparse.ArgumentParser(
        prog="horovodrun", description="Horovod Runner: start a distributed training job.",
        allow_abbrev=False)
    parser.add_argument("-v", "--version", action="version", version=version_line(),
                        help="Show this installation's version (and the Horovod API version it implements) and "
                             "exit.")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int,
                        help="Total number of processes to start.")
    parser.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                        help="Show which frameworks, controllers and tensor operations are available, and exit.")
    parser.add_argument("--dump-flight-recorder", dest="dump_flight_recorder", type=int, metavar="LAUNCHER_PID",
                        help="Ask the running horovodrun with this pid to collect every rank's hang dump and print "
                             "the hang doctor's verdict (as kill -USR1 LAUNCHER_PID does), and exit.")
    parser.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                        help="Check remote hosts (ssh, reachable address) on every run instead of trusting a "
                             "success from the last 60 minutes (cached in ~/.horovod).")
    parser.add_argument("--start-timeout", dest="start_timeout", type=int,
                        help="Seconds to wait for all processes to start and reach the rendezvous "
                             "(default: HOROVOD_START_TIMEOUT or 30).")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics", action=_NicsAction,
                        help="Comma-separated network interfaces the job uses, e.g. 'eth0,eth1' (default: an "
                             "address of this machine every host can reach, found automatically).")
    parser.add_argument("--output-filename", dest="output_filename",
                        help="Directory where each rank's output goes: <dir>/rank.<rank>/stdout and stderr.")
    parser.add_argument("--verbose", dest="verbose", action="store_true", help="Log what the launcher does.")
    parser.add_argument("--config-file", dest="config_file",
                        help="YAML file of tuning parameters; flags before it are overridden by it, flags "
                             "after it override it.")
    parser.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, help="SSH port on all hosts.")
    parser.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file",
                        help="SSH identity (private key) file.")
    parser.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                        action="store_true", help="Prefix every forwarded output line with the time.")

    groups: Dict[str, argparse._ArgumentGroup] = {
        "params": parser.add_argument_group("tuneable parameter arguments"),
        "autotune": parser.add_argument_group("autotune arguments"),
        "timeline": parser.add_argument_group("timeline arguments"),
        "stall_check": parser.add_argument_group("stall check arguments"),
        "library_options": parser.add_argument_group("library arguments"),
        "logging": parser.add_argument_group("logging arguments"),
        "other": parser.add_argument_group("other engine arguments"),
    }
    for knob in flag_knobs():
        _add_knob(parser, groups, knob)

    elastic = parser.add_argument_group("elastic arguments")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=int,
                         help="Minimum processes for an elastic job.")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=int,
                         help="Maximum processes for an elastic job.")
    elastic.add_argument("--slots-per-host", dest="slots", type=int,
                         help="Slots per host when the discovery script prints bare host names.")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=int,
                         help="Seconds to wait for the minimum number of slots (default 600).")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int,
                         help="Maximum number of resets of an elastic job.")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2,
                         metavar=("MIN", "MAX"), help="Seconds a failed host stays blacklisted: MIN MAX.")

    launch = parser.add_argument_group("launcher arguments")
    launch.add_argument("--mpi-args", dest="mpi_args", help="Extra mpirun arguments (use --mpi-args=\"...\").")
    launch.add_argument("--tcp", dest="tcp_flag", action="store_true",
                        help="Use TCP only for communication (mpirun).")
    launch.add_argument("--binding-args", dest="binding_args", help="Process binding arguments for mpirun/jsrun.")

    host_group = parser.add_argument_group("host arguments").add_mutually_exclusive_group()
    host_group.add_argument("-H", "--hosts", dest="hosts",
                            help="Hosts and slots, e.g. 'host1:2,host2:4' (default: localhost:<np>).")
    host_group.add_argument("-hostfile", "--hostfile", dest="hostfile",
                            help="File of lines '<host> slots=<n>'.")
    host_group.add_argument("--host-discovery-script", dest="host_discovery_script",
                            help="Executable printing 'host[:slots]' per line; enables elastic mode.")

    controller = parser.add_argument_group("controller arguments").add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="use_gloo", action=_Tracked, const=True, default=None,
                            help="Run with the built-in Gloo-style controller (the default unless the job spans "
                                 "several hosts and mpirun + mpi4py are installed).")
    controller.add_argument("--mpi", dest="use_mpi", action=_Tracked, const=True, default=None,
                            help="Launch with mpirun (the default for jobs on several hosts when mpirun and mpi4py "
                                 "are installed).")
    controller.add_argument("--jsrun", dest="use_jsrun", action=_Tracked, const=True, default=None,
                            help="Launch with jsrun on an LSF cluster (hosts from LSB_MCPU_HOSTS unless -H is given).")

    parser.add_argument("command", nargs=argparse.REMAINDER, help="Command to run on every process.")
    return parser


def defaults() -> Dict[str, Any]:
    """Every dest of the parser with its default value."""
    return vars(build_parser().parse_args([]))


def option_for(dest: str) -> str:
    """The first long option that stores into ``dest`` (for messages), e.g. ``min_num_proc`` → ``--min-np``."""
    for action in build_parser()._actions:
        if action.dest == dest and action.option_strings:
            longs = [o for o in action.option_strings if o.startswith("--")]
            return (longs or action.option_strings)[0]
    return "--" + dest.replace("_", "-")


def knob_env(args: Any, parent_env: Mapping[str, str]) -> Dict[str, str]:
    """The ``HOROVOD_*`` variables the knob flags and config file give every worker.

    A value that came from the config file yields to the same variable already set in ``parent_env``
    (precedence: flag > environment > config file > default).

    Raises:
        ValueError: a flag, config-file or inherited ``HOROVOD_*`` value is not accepted by its knob (not finite,
            out of range, not one of its choices), naming the flag (or key, or variable) and what is accepted;
            no worker is started with it.
    """
    from_config: Set[str] = set(getattr(args, FROM_CONFIG_ATTR, None) or ())
    env: Dict[str, str] = {}
    for knob in flag_knobs():
        dest = knob_dest(knob)
        value = getattr(args, dest, None)
        if value is None or knob.env is None:
            continue
        if dest in from_config and parent_env.get(knob.env, "") != "":
            continue
        knob.check_flag(value, f"config key {knob.config_key}" if dest in from_config else str(knob.flag))
        rendered = config.flag_to_env(knob, value)
        if rendered is not None:
            env[knob.env] = rendered
    try:
        config.check_environment({k: v for k, v in parent_env.items() if k not in env})
    except ValueError as exc:
        raise ValueError(f"horovodrun's environment, which every worker inherits: {exc}") from None
    return env


def elastic_requested(args: Any) -> List[str]:
    """Elastic-mode dests that were given (empty: a static job)."""
    return [d for d in ELASTIC_DESTS if getattr(args, d, None) is not None]


def iter_knob_values(args: Any) -> Iterable[tuple]:
    """``(knob, dest, value)`` for every knob flag that has a value."""
    for knob in flag_knobs():
        dest = knob_dest(knob)
        value = getattr(args, dest, None)
        if value is not None:
            yield knob, dest, value


DEFAULT_START_TIMEOUT = 30


def seconds(value: Optional[int], env: Mapping[str, str], variable: str, default: int) -> int:
    """A timeout given as an argument, else in the environment variable ``variable``, else ``default``.

    Raises:
        ValueError: the variable is set but is not a number.
    """
    if value is not None:
        return value
    raw = env.get(variable, "")
    if raw.strip():
        try:
            return int(float(raw))
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a number of seconds") from None
    return default


def start_timeout(value: Optional[int], env: Mapping[str, str]) -> int:
    """``--start-timeout``, else ``HOROVOD_START_TIMEOUT``, else 30 seconds."""
    return seconds(value, env, "HOROVOD_START_TIMEOUT", DEFAULT_START_TIMEOUT)


__all__ = ["build_parser", "distribution_version", "version_line", "DISTRIBUTION",
           "defaults", "knob_dest", "knob_env", "flag_knobs", "knob_by_dest", "LOG_LEVELS",
           "OVERRIDES_ATTR", "FROM_CONFIG_ATTR", "CONTROLLER_DESTS", "ELASTIC_DESTS", "elastic_requested",
           "seconds", "start_timeout", "DEFAULT_START_TIMEOUT"]
