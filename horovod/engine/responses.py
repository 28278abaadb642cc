"""How a rank carries out the coordinator's responses: process-set changes, errors, joins, and collectives
(through :class:`horovod.engine.executor.Executor`), then completes or fails the waiting handles.

A part of the engine over its :class:`~horovod.engine.engine_state.EngineState`, run by whoever drives progress.
"""
from __future__ import annotations

from typing import List, Tuple, cast

from horovod.engine import flight_dump, naming, ops
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import InvalidArgumentError, MismatchError, StallError
from horovod.engine.messages import ERROR, Response

# The exception an ERROR response raises, by its error_kind (all RuntimeErrors, as the original's op errors were).
_ERRORS = {"mismatch": MismatchError, "stall": StallError, "usage": InvalidArgumentError}


class Responses:
    """Carrying out responses (see the module docstring).

    Args:
        state: the engine's state.
    """

    def __init__(self, state: EngineState):
        self.state = state

    def execute_all(self, responses: List[Response]) -> None:
        self.state.recorder.negotiated()   # [hang doctor]
        for resp in responses:
            pset = self.state.sets.get(resp.process_set)
            if resp.kind != ops.JOIN and (0, naming.JOIN_NAME) in self.state.inflight:
                # Joined: this rank takes part in what the others run without issuing it (see naming.py).
                naming.skip_unnamed(resp.names, resp.process_set)
            if resp.kind == ops.ADD_PROCESS_SET:
                # The coordinator's payload: (the new set's id, its sorted global ranks).
                set_id, ranks = cast(Tuple[int, Tuple[int, ...]], resp.payload)
                self.state.register_set(set_id, ranks)
                self._complete(resp, [set_id])
                continue
            if resp.kind == ops.REMOVE_PROCESS_SET:
                # The coordinator's payload: (the id asked for, whether such a set existed).
                set_id, existed = cast(Tuple[int, bool], resp.payload)
                info = self.state.remove_set(set_id)
                self.state.executor.forget_set(set_id)   # its NCCL communicators
                if info is not None and info.transport is not None and info.transport is not self.state.world:
                    info.transport.close()
                self._complete(resp, [existed])
                continue
            if resp.kind == ERROR:
                self._fail_names(resp, _ERRORS.get(resp.error_kind, MismatchError)(resp.error))
                continue
            if pset is None or not pset.included(self.state.rank):
                continue
            if resp.kind == ops.JOIN:
                if self.state.warm is not None:
                    self.state.warm.joined_done()
                self._complete(resp, [resp.last_joined])
                continue
            entries = self.state.entries(resp.process_set, resp.names)
            self.state.timeline.start(resp, entries, self.state.executor.activity_prefix(resp))
            self.state.recorder.started(resp)   # [hang doctor]
            results = self.state.executor.execute(resp, entries)
            self.state.timeline.end(resp)
            self._complete(resp, results, entries)

    def _complete(self, resp: Response, results, entries=None) -> None:
        self.state.recorder.finished(resp)   # [hang doctor] collectives, joins and process-set changes alike
        popped = self.state.pop_entries(resp.process_set, resp.names)
        if entries is None:
            entries = popped
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.handle.complete(entry.index, result)

    def _fail_names(self, resp: Response, error: BaseException) -> None:
        self.state.recorder.failed(resp)   # [hang doctor] a stall error: every member dumps, the missing ranks too
        if resp.error_kind == "stall":
            flight_dump.dump_once(self.state, f"stall error: {resp.error}", "stall-error")
        for entry in self.state.pop_entries(resp.process_set, resp.names):
            if entry is not None:
                entry.handle.fail(error)
