"""Where a collective enters the engine: the checks every rank makes alone, then the engine's
:class:`~horovod.engine.agreement.Agreement` (a job of one, the fast lane, or the coordinator with the warm path)
agrees on it with the other ranks and carries it out.
"""
from __future__ import annotations

import os
from typing import List

from horovod.engine.agreement import Agreement
from horovod.engine.engine_state import EngineState, Key
from horovod.engine.errors import SHUTDOWN_MESSAGE, NameInFlightError, ShutdownError
from horovod.engine.handles import Entry
from horovod.engine.job import forked_error


class Intake:
    """Accepting collectives from user threads (see the module docstring).

    Args:
        state: the engine's state.
        agreement: how this engine's ranks agree on collectives.
    """

    def __init__(self, state: EngineState, agreement: Agreement):
        self.state = state
        self.agreement = agreement

    def enqueue(self, entries: List[Entry], attended: bool = False) -> None:
        """Queue entries for negotiation.

        ``attended``: the caller waits on these handles right away and so drives their progress itself; the
        background thread is not woken (waking it costs more than the whole small collective on a small host).

        Raises:
            ValueError: a name is already in flight, or this rank is not a member of the process set.
            HorovodInternalError: the engine has failed or shut down.
        """
        state, agreement = self.state, self.agreement
        if os.getpid() != state.pid:
            raise forked_error()
        with state.lock:
            if state.dead is not None:
                raise type(state.dead)(str(state.dead))
            if state.stop_requested:
                raise ShutdownError(SHUTDOWN_MESSAGE)
            keys = self._check(entries)
            if attended:
                for entry in entries:
                    entry.request.blocking = True
            drive, ticket = agreement.admit(entries, attended)
            for key, entry in zip(keys, entries):
                state.inflight[key] = entry
                entry.handle.driver = drive
            state.recorder.enqueued(entries)   # [hang doctor]
        agreement.carry(ticket, entries, attended)

    def _check(self, entries: List[Entry]) -> List[Key]:
        """Under the state's lock: each entry's key, after the checks a rank makes on its own."""
        state = self.state
        keys: List[Key] = []
        seen = set()   # a group may hold thousands of tensors: no list scans
        for entry in entries:
            req = entry.request
            pset = state.sets.get(req.process_set)
            if pset is None:
                raise ValueError(f"Process set {req.process_set} is not registered (it may have been removed); "
                                 f"register it with hvd.add_process_set() on every rank first.")
            if req.process_set and not pset.included(state.rank):   # (the global set holds every rank)
                raise ValueError(f"Rank {state.rank} is not a member of the provided process set "
                                 f"(ranks {list(pset.ranks)}).")
            key = (req.process_set, req.name)
            if key in state.inflight or key in seen:
                raise NameInFlightError(
                    f"Requested a collective on tensor name '{req.name}', but a collective with that name is "
                    f"still in progress on this rank. Wait for it (synchronize) or use a different name.")
            keys.append(key)
            seen.add(key)
        return keys
