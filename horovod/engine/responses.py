"""How a rank carries out the coordinator's responses: process-set changes, errors, joins, and collectives
(through :class:`horovod.engine.executor.Executor`), then completes or fails the waiting handles.

A part of :class:`horovod.engine.runtime.Runtime`, run by whoever drives progress.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple, cast

from horovod.engine import flight_dump, naming, ops
from horovod.engine.errors import InvalidArgumentError, MismatchError, StallError
from horovod.engine.messages import ERROR, Response

if TYPE_CHECKING:
    from horovod.engine.runtime import Runtime

# The exception an ERROR response raises, by its error_kind (all RuntimeErrors, as the original's op errors were).
_ERRORS = {"mismatch": MismatchError, "stall": StallError, "usage": InvalidArgumentError}


class Responses:
    """Carrying out responses (see the module docstring).

    Args:
        rt: the engine whose state this part works on.
    """

    def __init__(self, rt: "Runtime"):
        self.rt = rt

    def _execute_all(self, responses: List[Response]) -> None:
        self.rt.recorder.negotiated()   # [hang doctor]
        for resp in responses:
            pset = self.rt.sets.get(resp.process_set)
            if resp.kind != ops.JOIN and (0, naming.JOIN_NAME) in self.rt._inflight:
                # Joined: this rank takes part in what the others run without issuing it (see naming.py).
                naming.skip_unnamed(resp.names, resp.process_set)
            if resp.kind == ops.ADD_PROCESS_SET:
                # The coordinator's payload: (the new set's id, its sorted global ranks).
                set_id, ranks = cast(Tuple[int, Tuple[int, ...]], resp.payload)
                self.rt._register_set(set_id, ranks)
                self._complete(resp, [set_id])
                continue
            if resp.kind == ops.REMOVE_PROCESS_SET:
                # The coordinator's payload: (the id asked for, whether such a set existed).
                set_id, existed = cast(Tuple[int, bool], resp.payload)
                info = self.rt.sets.pop(set_id, None)
                self.rt.executor.forget_set(set_id)   # its NCCL communicators
                if info is not None and info.transport is not None and info.transport is not self.rt.world:
                    info.transport.close()
                self._complete(resp, [existed])
                continue
            if resp.kind == ERROR:
                self._fail_names(resp, _ERRORS.get(resp.error_kind, MismatchError)(resp.error))
                continue
            if pset is None or not pset.included(self.rt.rank):
                continue
            if resp.kind == ops.JOIN:
                if self.rt._warm is not None:
                    self.rt._warm.joined_done()
                self._complete(resp, [resp.last_joined])
                continue
            with self.rt._lock:
                entries = [self.rt._inflight.get((resp.process_set, name)) for name in resp.names]
            self.rt.timeline.start(resp, entries, self.rt.executor.activity_prefix(resp))
            self.rt.recorder.started(resp)   # [hang doctor]
            results = self.rt.executor.execute(resp, entries)
            self.rt.timeline.end(resp)
            self._complete(resp, results, entries)

    def _complete(self, resp: Response, results, entries=None) -> None:
        self.rt.recorder.finished(resp)   # [hang doctor] collectives, joins and process-set changes alike
        with self.rt._lock:
            if entries is None:
                entries = [self.rt._inflight.get((resp.process_set, name)) for name in resp.names]
            for name in resp.names:
                self.rt._inflight.pop((resp.process_set, name), None)
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.handle.complete(entry.index, result)

    def _fail_names(self, resp: Response, error: BaseException) -> None:
        self.rt.recorder.failed(resp)   # [hang doctor] a stall error: every member dumps, the missing ranks too
        if resp.error_kind == "stall":
            flight_dump.dump_once(self.rt, f"stall error: {resp.error}", "stall-error")
        with self.rt._lock:
            entries = [self.rt._inflight.pop((resp.process_set, name), None) for name in resp.names]
        for entry in entries:
            if entry is not None:
                entry.handle.fail(error)
