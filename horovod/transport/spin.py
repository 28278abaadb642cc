"""Bounded, adaptive spinning before a blocking wait.

On this kind of machine a process that blocks and is woken by another costs tens of microseconds before it runs
again (the idle core has to be woken), which is more than a whole small collective.  Re-checking for a few
microseconds first avoids that when the peer is about to answer.  Spinning only pays when every process has a
core of its own — on an oversubscribed host it steals the very core the peer needs — so callers pass a budget of 0
there, and a spin that keeps finding nothing backs off so a slow peer does not cost a core for nothing.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

from horovod.transport.cpus import usable_cpus

T = TypeVar("T")

_BACKOFF_MAX = 64  # waits that skip spinning after repeated fruitless spins


def default_budget_us(local_processes: int, budget_us: float) -> float:
    """``budget_us`` when every local process has a core of its own, else 0 (never spin on a crowded host).

    The host's cores count, not this process's bound share of them (a bound worker has a core of its own)."""
    return budget_us if local_processes <= usable_cpus() else 0.0


class Spinner:
    """Polls ``check`` for up to ``budget_us`` microseconds, backing off after spins that found nothing.

    Args:
        budget_us: longest spin; 0 disables spinning.
    """

    def __init__(self, budget_us: float):
        self.budget_s = max(0.0, float(budget_us)) * 1e-6
        self._skip = self._backoff = 0

    def spin(self, check: Callable[[], T]) -> Optional[T]:
        """The first truthy result of ``check()`` within the budget, else ``None`` (then block)."""
        end = self.start()
        if end is None:
            return None
        while True:
            result = check()
            if result:
                self.finish(True)
                return result
            if time.perf_counter() > end:
                self.finish(False)
                return None

    def start(self) -> Optional[float]:
        """For a caller that spins with its own loop: the ``perf_counter`` deadline of this spin, or ``None`` when
        this wait should not spin (no budget, or backing off); report how it went with :meth:`finish`."""
        if not self.budget_s:
            return None
        if self._skip:
            self._skip -= 1
            return None
        return time.perf_counter() + self.budget_s

    def finish(self, found: bool) -> None:
        """A spin ended; one that found nothing means the peer was not about to answer (it is busy or
        descheduled): spin less often for a while."""
        self._backoff = 0 if found else min(_BACKOFF_MAX, 2 * self._backoff or 1)
        self._skip = self._backoff
