"""Hosts whose workers failed: kept out of the job, for ever or for a growing cooldown.

With ``--blacklist-cooldown-range MIN MAX`` a host blacklisted for the ``n``-th time (``n`` = 0, 1, ...) comes
back after ``MIN * 2**n + U(0, 1) * MIN`` seconds, kept within ``[MIN, MAX]``: a flaky host is retried, less and
less often.  Without a range a failed host never comes back.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

#: Bounds the original accepts for the cooldown range (seconds).
MIN_COOLDOWN_LOWER = 1
MAX_COOLDOWN_UPPER = 3600


def validate_cooldown_range(cooldown_range: Optional[Sequence[int]]) -> None:
    """Raises ValueError unless the range is absent or ``1 <= MIN <= MAX <= 3600``."""
    if cooldown_range is None:
        return
    if len(cooldown_range) != 2:
        raise ValueError(f"--blacklist-cooldown-range takes two values MIN MAX (seconds), got {list(cooldown_range)}")
    lower, upper = cooldown_range
    if lower < MIN_COOLDOWN_LOWER or upper > MAX_COOLDOWN_UPPER or lower > upper:
        raise ValueError(f"--blacklist-cooldown-range {lower} {upper}: expected {MIN_COOLDOWN_LOWER} <= MIN <= MAX "
                         f"<= {MAX_COOLDOWN_UPPER} seconds, e.g. '--blacklist-cooldown-range 10 100'")


def cooldown_seconds(times_blacklisted: int, lower: float, upper: float, uniform: float) -> float:
    """How long a host stays out after its ``times_blacklisted``-th failure (counting from 0).

    Args:
        times_blacklisted: how many times the host was blacklisted before this one.
        lower, upper: the cooldown range.
        uniform: a number in [0, 1) (the random part, passed in so that this stays a pure function).
    """
    delay = lower * (2 ** min(times_blacklisted, 30)) + uniform * lower
    return float(min(max(delay, lower), upper))


@dataclass
class _HostRecord:
    times: int = 0                       # how many times the host was blacklisted
    until: Optional[float] = None        # monotonic time it may come back; None = never (while blacklisted)
    blacklisted: bool = False


class HostBlacklist:
    """Blacklist state of every host.

    Args:
        cooldown_range: ``(MIN, MAX)`` seconds, or ``None`` for a permanent blacklist.
        clock: monotonic clock (injectable for tests).
        uniform: source of U(0, 1) numbers (injectable for tests).
    """

    def __init__(self, cooldown_range: Optional[Sequence[int]] = None,
                 clock: Callable[[], float] = time.monotonic, uniform: Callable[[], float] = random.random):
        validate_cooldown_range(cooldown_range)
        self.cooldown_range = tuple(cooldown_range) if cooldown_range is not None else None
        self._clock = clock
        self._uniform = uniform
        self._hosts: Dict[str, _HostRecord] = {}

    def blacklist(self, host: str) -> Optional[float]:
        """Put ``host`` on the blacklist (no-op while it already is); returns the cooldown, ``None`` = for ever."""
        record = self._hosts.setdefault(host, _HostRecord())
        if self.is_blacklisted(host):
            return None if record.until is None else max(0.0, record.until - self._clock())
        record.blacklisted = True
        if self.cooldown_range is None:
            record.until = None
            delay = None
        else:
            delay = cooldown_seconds(record.times, self.cooldown_range[0], self.cooldown_range[1], self._uniform())
            record.until = self._clock() + delay
        record.times += 1
        return delay

    def is_blacklisted(self, host: str) -> bool:
        """True while ``host`` is out; a host whose cooldown ran out is usable again."""
        record = self._hosts.get(host)
        if record is None or not record.blacklisted:
            return False
        if record.until is not None and self._clock() >= record.until:
            record.blacklisted = False
            logger.info("host %s: blacklist cooldown is over; it may be used again", host)
            return False
        return True

    def blacklisted(self) -> List[str]:
        """Hosts out right now."""
        return [h for h in list(self._hosts) if self.is_blacklisted(h)]

    def next_expiry(self) -> Optional[float]:
        """Seconds until the next cooldown ends (``None`` when nothing is waiting for one)."""
        now = self._clock()
        pending = [r.until - now for r in self._hosts.values() if r.blacklisted and r.until is not None]
        return max(0.0, min(pending)) if pending else None
