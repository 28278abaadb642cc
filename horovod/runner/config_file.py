"""``horovodrun --config-file``: a YAML file of tuning parameters, with the original's keys.

Layout (every key optional)::

    controller: gloo            # or mpi
    params: {fusion_threshold_mb, cycle_time_ms, cache_capacity, hierarchical_allreduce, ...}
    autotune: {enabled, log_file, warmup_samples, steps_per_sample, bayes_opt_max_samples,
               gaussian_process_noise}
    timeline: {filename, mark_cycles}
    stall_check: {enabled, warning_time_seconds, shutdown_time_seconds}
    library_options: {mpi_threads_disable, num_nccl_streams, thread_affinity, gloo_timeout_seconds}
    logging: {level, with_timestamp}

The keys come from the knob table's ``config_key``.  Values have flag meaning (MB, ``enabled``,
``with_timestamp``).  Flags given after ``--config-file`` win over the file; flags before it lose.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping

import yaml

from horovod.engine import config
from horovod.runner import cli

logger = logging.getLogger(__name__)

#: Top-level key choosing the controller (a knob without a flag: it maps onto --gloo / --mpi).
CONTROLLER_KEY = "controller"
_CONTROLLERS = {"gloo": "use_gloo", "mpi": "use_mpi", "jsrun": "use_jsrun"}


def load(path: str) -> Dict[str, Any]:
    """Read a config file.

    Raises:
        ValueError: the file is missing, is not YAML, or is not a mapping (the message names the file).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read --config-file {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config-file {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path!r} must hold a mapping of sections (params, autotune, ...), "
                         f"got {type(data).__name__}")
    return data


def _coerce(knob: config.Knob, key: str, value: Any) -> Any:
    kind = knob.type
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"config key {key}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"config key {key}: expected an integer, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"config key {key}: expected an integer, got {value!r}") from None
        if not number.is_integer():
            raise ValueError(f"config key {key}: expected an integer, got {value!r}")
        return int(number)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"config key {key}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"config key {key}: expected a number, got {value!r}") from None
    text = str(value)
    if knob.name == "log_level":
        text = text.upper()
        if text not in cli.LOG_LEVELS:
            raise ValueError(f"config key {key}: expected one of {', '.join(cli.LOG_LEVELS)}, got {value!r}")
    return text


def values_from_config(data: Mapping[str, Any], source: str = "config file") -> Dict[str, Any]:
    """Map a loaded config onto parser dests (``{"fusion_threshold_mb": 32, "use_gloo": True, ...}``).

    Unknown keys are reported with a warning (the original ignored them silently).

    Raises:
        ValueError: a value has the wrong type, or ``controller`` is not gloo / mpi / jsrun.
    """
    by_key = {k.config_key: k for k in cli.flag_knobs() if k.config_key}
    out: Dict[str, Any] = {}
    for top, section in data.items():
        if top == CONTROLLER_KEY:
            name = str(section).lower()
            if name not in _CONTROLLERS:
                raise ValueError(f"{source}: controller must be one of {', '.join(_CONTROLLERS)}, got {section!r}")
            for ctl, dest in _CONTROLLERS.items():
                out[dest] = True if ctl == name else None
            continue
        if not isinstance(section, dict):
            if top in by_key:  # a top-level knob key
                out[cli.knob_dest(by_key[top])] = _coerce(by_key[top], top, section)
            else:
                logger.warning("%s: ignoring unknown key %r", source, top)
            continue
        for key, value in section.items():
            full = f"{top}.{key}"
            knob = by_key.get(full)
            if knob is None:
                logger.warning("%s: ignoring unknown key %r", source, full)
                continue
            if value is None:
                continue
            out[cli.knob_dest(knob)] = _coerce(knob, full, value)
    return out


def apply(args: Any, data: Mapping[str, Any], source: str = "config file") -> None:
    """Set ``args`` from the config, except for dests given on the command line after ``--config-file``.

    Records the dests it set in ``args.config_values`` (the environment beats them, see
    :func:`horovod.runner.cli.knob_env`).
    """
    overrides = set(getattr(args, cli.OVERRIDES_ATTR, None) or ())
    values = values_from_config(data, source)
    if overrides & set(cli.CONTROLLER_DESTS):
        for dest in cli.CONTROLLER_DESTS:
            values.pop(dest, None)
    applied = set(getattr(args, cli.FROM_CONFIG_ATTR, None) or ())
    for dest, value in values.items():
        if dest in overrides:
            continue
        setattr(args, dest, value)
        applied.add(dest)
    setattr(args, cli.FROM_CONFIG_ATTR, applied)


def validate(args: Any) -> None:
    """Reject negative numeric knob values and a Gaussian-process noise outside [0, 1].

    Raises:
        ValueError: ``'<name>=<value> must be >= 0'`` (or ``must be in [0, 1]``), as the original.
    """
    for knob, dest, value in cli.iter_knob_values(args):
        if knob.type in (int, float) and value < 0:
            raise ValueError(f"{dest}={value} must be >= 0")
        if knob.name == "autotune_gaussian_process_noise" and not 0 <= value <= 1:
            raise ValueError(f"{dest}={value} must be in [0, 1]")
