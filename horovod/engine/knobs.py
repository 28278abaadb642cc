"""What a knob is: how :class:`horovod.engine.config.Config` declares one, parses its value and checks it.

A knob is a field of the frozen ``Config`` dataclass whose default comes from :func:`knob`: the call returns the
default (so mypy types the field by its annotation and refuses a misspelt name) and files a :class:`Knob` in the
field's metadata, which carries the rest: the ``HOROVOD_*`` variable, the ``horovodrun`` flag, the config-file
key, the help line and the values accepted (finite, in range, one of its choices).  The one table is therefore the
class body of ``Config``; ``config.KNOBS`` is read back from it.

Every value is checked where the table declares its limits: :func:`horovod.engine.config.load` checks what it
reads (so ``hvd.init()`` fails on the rank that has a bad value before it connects anywhere), ``Config`` checks
what it is built with (``replace()`` included), and the launcher checks its flags and config file before it
starts a worker (:func:`Knob.check_flag`).  A rejection names the variable (or flag), the value received and
what is accepted.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, Tuple, TypeVar

MIB = 1024 * 1024

#: Key of a knob field's metadata that holds its :class:`Knob`.
METADATA_KEY = "horovod.knob"

_T = TypeVar("_T")

_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off", "")


@dataclass(frozen=True)
class Knob:
    """One tunable, as the table declares it.

    Attributes:
        name: attribute name on :class:`~horovod.engine.config.Config`.
        type: ``int``, ``float``, ``bool`` or ``str``.
        default: value when nothing sets it.
        env: the ``HOROVOD_*`` variable carrying it to workers (``None``: launcher-only).
        flag: the ``horovodrun`` long flag, or ``None``.
        config_key: ``section.key`` in the YAML config file, or ``None``.
        help: one line for ``horovodrun --help``.
        negatable: the flag also has a ``--no-`` form (booleans).
        flag_scale: a flag value is multiplied by this before it goes into ``env`` (MiB → bytes).
        inverted: the flag / config value is the logical complement of the env value.
        aliases: extra spellings of the flag.
        minimum: smallest accepted number (numbers are also always finite).
        maximum: largest accepted number.
        choices: the accepted strings, compared without regard to case (the value keeps the case given).
        pattern: a regular expression a string value must match in full (``""``: any string).
        pattern_help: what ``pattern`` accepts, in words, for messages.
        directory: a string value (when not empty) names a directory this process must be able to write to, or to
            create, checked as soon as it is read (see :meth:`check_directory`).
    """

    name: str
    type: type
    default: Any
    env: Optional[str]
    flag: Optional[str]
    config_key: Optional[str]
    help: str
    negatable: bool = False
    flag_scale: float = 1
    inverted: bool = False
    aliases: Tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    choices: Tuple[str, ...] = ()
    pattern: str = ""
    pattern_help: str = ""
    directory: bool = False

    # -- what is accepted -------------------------------------------------------------------------------
    def accepted(self, scale: float = 1) -> str:
        """The accepted values in words, e.g. ``'an integer from 0 to 1048576'`` (limits divided by ``scale``)."""
        if self.type is bool:
            return "0 or 1 (also true/false, yes/no, on/off)"
        if self.type in (int, float):
            kind = "an integer" if self.type is int and scale == 1 else "a finite number"
            low = _number(self.minimum / scale) if self.minimum is not None else None
            high = _number(self.maximum / scale) if self.maximum is not None else None
            if low is not None and high is not None:
                return f"{kind} from {low} to {high}"
            if low is not None:
                return f"{kind} >= {low}"
            if high is not None:
                return f"{kind} <= {high}"
            return kind
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices) + " (any case)"
        if self.pattern:
            return self.pattern_help or f"text matching {self.pattern!r}"
        if self.directory:
            return "a directory this user can create or write to (or empty)"
        return "any text"

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` (already of the knob's type) is not accepted, or ``None`` when it is."""
        if self.type is bool:
            return None
        if self.type in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"it is a {type(value).__name__}, not a number"
            if not math.isfinite(value):
                return "it is not finite"
            if self.type is int and not float(value).is_integer():
                return "it is not a whole number"
            if self.minimum is not None and value < self.minimum:
                return "it is too small"
            if self.maximum is not None and value > self.maximum:
                return "it is too large"
            return None
        if not isinstance(value, str):
            return f"it is a {type(value).__name__}, not text"
        if self.choices and value.strip().lower() not in {c.lower() for c in self.choices}:
            return "it is not one of the choices"
        if self.pattern and not re.fullmatch(self.pattern, value):
            return "it does not have the accepted form"
        return None

    def _rejection(self, shown: str, reason: str, scale: float = 1) -> ValueError:
        where = f"(knob {self.name})" if self.env is None or shown.startswith(self.env) else \
            f"(knob {self.name}, {self.env})"
        return ValueError(f"{shown} {where} is not accepted: {reason}; expected {self.accepted(scale)}. "
                          f"Fix the value, or leave it out for the default ({_shown_default(self, scale)}).")

    def check(self, value: Any, shown: Optional[str] = None) -> None:
        """Raise when ``value`` is not accepted.

        Args:
            value: the parsed value.
            shown: how the value was given, for the message (default: ``name=value``).

        Raises:
            ValueError: naming the knob, the value received and what is accepted.
        """
        reason = self.problem(value)
        if reason is not None:
            raise self._rejection(shown or f"{self.name}={value!r}", reason)

    def check_flag(self, value: Any, given: str) -> None:
        """Check a ``horovodrun`` flag (or config-file) value, in the flag's units, before any worker starts.

        Args:
            value: the flag value (MiB for ``--fusion-threshold-mb``; ``stall_check`` for ``--no-stall-check``).
            given: the flag or config key that gave it, for the message.

        Raises:
            ValueError: naming the flag, the variable it sets, the value received and what is accepted.
        """
        if self.type is bool or value is None:
            return
        shown = f"{given} {value!r}"
        if self.directory and value:
            self.check_directory(value, shown)
        if self.flag_scale != 1:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self._rejection(shown, "it is not a finite number", self.flag_scale)
            value = value * self.flag_scale
            value = int(value) if self.type is int else float(value)
        reason = self.problem(value)
        if reason is not None:
            raise self._rejection(shown, reason, self.flag_scale)

    def check_directory(self, value: str, shown: str) -> None:
        """Raise (ValueError, naming the variable or flag) unless ``value`` is a directory this process may write to
        or create: checked when read, as a hang dump could only log the failure and lose the dump. The test is a
        probe made and removed (``os.access`` says yes to root even on /proc), so nothing is left on any host."""
        path = where = os.path.abspath(value)
        while not os.path.lexists(where):   # creating the path starts in its nearest existing ancestor
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise self._rejection(shown, "it is not a directory" if where == path else
                                  f"it cannot be created: {where} is not a directory")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".horovod-probe-", dir=where))
        except OSError as exc:
            raise self._rejection(shown, f"this user may not write to it ({exc.strerror})" if where == path else
                                  f"it cannot be created in {where} ({exc.strerror})") from None

    # -- text --------------------------------------------------------------------------------------------
    def parse(self, raw: str) -> Any:
        """Parse the knob's environment string (booleans: 0 or 1, or a word; 0.28.1 took any number >= 1).

        Raises:
            ValueError: naming the variable, the text received and what is accepted.
        """
        text = raw.strip()
        shown = f"{self.env or self.name}={raw!r}"
        if self.type is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            number = _to_float(text)
            if number is None or not math.isfinite(number):
                raise self._rejection(shown, "it is not a boolean")
            # 0.28.1 read any number >= 1 as on; a 2 or 7 is more likely a slip than a "yes": refuse, do not guess.
            if number not in (0, 1):
                raise self._rejection(shown, "it is a number other than 0 and 1")
            return number == 1
        if self.type is int:
            try:
                return int(text)
            except ValueError:
                pass
            number = _to_float(text)
            if number is None:
                raise self._rejection(shown, "it is not a number")
            if not math.isfinite(number):
                raise self._rejection(shown, "it is not finite")
            if not number.is_integer():
                raise self._rejection(shown, "it is not a whole number")
            return int(number)
        if self.type is float:
            number = _to_float(text)
            if number is None:
                raise self._rejection(shown, "it is not a number")
            return number
        return text

    def load(self, raw: str) -> Any:
        """:meth:`parse` then :meth:`check` (and :meth:`check_directory`) one environment string; its value."""
        value = self.parse(raw)
        shown = f"{self.env or self.name}={raw!r}"
        self.check(value, shown)
        if self.directory and value:
            self.check_directory(value, shown)
        return value


def knob(default: _T, env: Optional[str], help: str, *, flag: Optional[str] = None,
         config_key: Optional[str] = None, negatable: bool = False, flag_scale: float = 1, inverted: bool = False,
         aliases: Tuple[str, ...] = (), minimum: Optional[float] = None, maximum: Optional[float] = None,
         choices: Tuple[str, ...] = (), pattern: str = "", pattern_help: str = "", directory: bool = False) -> _T:
    """Declare a field of ``Config`` as a knob (see :class:`Knob` for the arguments).

    Returns:
        A dataclass field with ``default`` whose metadata holds the knob; typed as the default so that the field's
        annotation is what mypy sees.
    """
    spec = Knob("", type(default), default, env, flag, config_key, help, negatable, flag_scale, inverted,
                aliases, minimum, maximum, choices, pattern, pattern_help, directory)
    return dataclasses.field(default=default, metadata={METADATA_KEY: spec})   # typed _T by typeshed


def table(cls: type, hints: dict) -> Tuple[Knob, ...]:
    """The knobs declared on dataclass ``cls``, in declaration order, named after their fields.

    Raises:
        TypeError: a knob's default does not have its field's type, or its default is not accepted (a
            mistake in the table, caught at import).
    """
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(METADATA_KEY)
        if spec is None:
            continue
        declared = hints[f.name]
        if spec.type is not declared:
            raise TypeError(f"knob {f.name}: default {spec.default!r} is a {spec.type.__name__}, the field is "
                            f"declared {declared!r}")
        spec = dataclasses.replace(spec, name=f.name)
        if spec.problem(spec.default) is not None:
            raise TypeError(f"knob {f.name}: the default {spec.default!r} is not {spec.accepted()}")
        out.append(spec)
    return tuple(out)


def _to_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _shown_default(k: Knob, scale: float = 1) -> str:
    if k.type is bool:
        return "1" if k.default else "0"
    if k.type in (int, float) and scale != 1:
        return _number(k.default / scale)
    return repr(k.default) if k.type is str else str(k.default)
