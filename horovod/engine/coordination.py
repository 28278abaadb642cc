"""Rank 0's part of a progress step: take requests in, decide one order, tell the members, tune, watch for stalls.

A part of the engine over its :class:`~horovod.engine.engine_state.EngineState` (it runs inside the drive loop); the
decisions themselves — which tensors are ready, conflicts, stalls — are
:class:`horovod.engine.negotiation.Coordinator`'s.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, cast

from horovod.engine import flight_dump, fusion, rounds
from horovod.engine.cache import Wire
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, STALL_WARNING, PeerFailureError
from horovod.engine.follower import Follower
from horovod.engine.messages import ControlMessage, Response
from horovod.engine.negotiation import Coordinator
from horovod.engine.outbox import Outbox
from horovod.engine.responses import Responses
from horovod.engine.teardown import Teardown

logger = logging.getLogger("horovod.engine.runtime")


class Coordination:
    """The coordinator's step (rank 0 only): see :meth:`coordinate`.

    Args:
        state: the engine's state.
        follower: reads the workers' connections and obeys shutdown notices.
        outbox: drops the cache slots of requests that reach the coordinator.
        teardown: ends the engine when a worker is unreachable.
        responses: carries out what the coordinator decided, on this rank.
    """

    def __init__(self, state: EngineState, follower: Follower, outbox: Outbox, teardown: Teardown,
                 responses: Responses):
        self.state = state
        self.follower = follower
        self.outbox = outbox
        self.teardown = teardown
        self.responses = responses
        config = state.config
        self.held: List[Response] = []   # ready responses held for a positive cycle time
        self._held_since = 0.0
        self._tuned: Optional[Dict[str, Any]] = None   # knob values to announce with the next responses
        self._last_stall_check = time.monotonic()
        # How often the coordinator inspects stalls (the stall knobs are never tuned at run time).
        self._stall_every = float(max(1, min(config.stall_check_time_seconds,
                                             config.stall_shutdown_time_seconds or config.stall_check_time_seconds)))

    @property
    def coord(self) -> Coordinator:
        coord = self.state.coordinator
        assert coord is not None, "coordination runs on rank 0 only"
        return coord

    def coordinate(self, readable) -> bool:
        coord, mirror = self.coord, self.state.mirror_cache
        assert mirror is not None, "rank 0 mirrors every rank's request slots"
        now = time.monotonic()
        for peer in readable:
            messages = self.follower.receive(peer)
            if messages is None:
                return False
            for msg in messages:
                if self.follower.obey_shutdown(msg):
                    return False
                for wire in msg.requests:
                    req, data = mirror.decode(peer, cast(Wire, wire))
                    self.state.timeline.negotiate(req, now)
                    self.outbox.note_cold(req)
                    coord.add(req, now, data)
        coord.check_kind_conflicts()
        self._inspect_stalls(now)
        ready = coord.take_ready()
        if ready:
            self.state.timeline.negotiated(ready, now)
            if self.state.slot_table is not None and self.state.warm is not None and self.state.warm.usable:
                ready = [self._with_slot(resp) for resp in ready]
            if not self.held:
                self._held_since = now
            self.held.extend(ready)
        # A positive cycle time holds ready tensors a little, so more of them can be fused together.
        if self.held and now - self._held_since >= self.state.config.cycle_time_ms / 1000.0:
            planned = fusion.plan(self.held, self.state.config.fusion_threshold, self.state.config.disable_group_fusion)
            self.held = []
            params, self._tuned = self._tuned, None
            if not self._dispatch(planned, params):
                return False
        elif self.outbox.has_invalidations() or (self._tuned and self.state.warm is not None):
            # Dropped slots must reach every rank even when nothing is ready (their hits come here in full), and
            # so must tuned knobs when every step runs warm.
            params, self._tuned = self._tuned, None
            if not self._dispatch([], params):
                return False
        return True

    def due_in(self) -> Optional[float]:
        """Seconds until timed work of this step is due (a cycle-time window ends, stalls are inspected)."""
        now = time.monotonic()
        due = []
        if self.held:
            due.append(max(0.0, self._held_since + self.state.config.cycle_time_ms / 1000.0 - now))
        if not self.state.config.stall_check_disable:
            due.append(max(0.05, self._last_stall_check + self._stall_every - now))
        return min(due) if due else None

    def _dispatch(self, planned: List[Response], params: Optional[dict]) -> bool:
        """Send ``planned`` to the ranks and run it here (with the warm path: once this round is finished)."""
        warm = self.state.warm
        invalidate = self.outbox.take_invalidations()
        tag = warm.state.posted if warm is not None else 0
        failed = self._send_responses(planned, params, tag, invalidate)
        if warm is not None:
            warm.sent_since_post = True   # fence it before the next round (multi-host)
        if failed:
            self.teardown.die(PeerFailureError(f"ranks {failed} are unreachable (they exited or crashed). "
                                       f"{SHUTDOWN_MESSAGE}"), notify=True)
            return False
        if warm is not None:
            warm.deferred.append(ControlMessage(responses=planned, params=params, round=tag, invalidate=invalidate))
            return True
        self.responses.execute_all(planned)
        if self.state.autotuner is not None:
            self.autotune(planned, time.monotonic())
        return True

    def _with_slot(self, resp: Response) -> Response:
        """``resp`` with a response-cache slot when it may be cached (a copy: the coordinator reuses responses)."""
        if not rounds.cacheable(resp):
            return resp
        table = self.state.slot_table
        assert table is not None, "slots are assigned only with a warm path"
        slot = table.assign((0, resp.names[0]))
        return dataclasses.replace(resp, slots=[slot])

    def _send_responses(self, planned: List[Response], params: Optional[dict], tag: int = 0,
                        invalidate: Optional[List[int]] = None) -> List[int]:
        """Send each response to the members of its process set; returns the ranks that could not be reached.

        Non-members never see a set's traffic: an idle rank that is not reading its connection must not have it
        filled by collectives it takes no part in (dropped cache slots and tuned knobs go to everyone).
        """
        everyone = list(self.state.control.peers)
        invalidate = invalidate or []
        if all(resp.process_set == 0 or resp.process_set not in self.state.sets for resp in planned):
            return self.state.control.broadcast(ControlMessage(responses=planned, params=params, round=tag,
                                                         invalidate=invalidate))
        per_peer: Dict[int, List[Response]] = {peer: [] for peer in everyone}
        for resp in planned:
            info = self.state.sets.get(resp.process_set)
            for peer in (everyone if info is None else [r for r in info.ranks if r in per_peer]):
                per_peer[peer].append(resp)
        messages = {peer: ControlMessage(responses=resps, params=params, round=tag, invalidate=invalidate)
                    for peer, resps in per_peer.items() if resps or params or invalidate}
        return self.state.control.send_each(messages)

    def autotune(self, planned: List[Response], now: float) -> None:
        nbytes = sum(fusion.response_bytes(r) for r in planned if r.kind in fusion.FUSIBLE)
        if nbytes == 0:
            return
        tuner = self.state.autotuner
        assert tuner is not None, "called only when autotuning"
        changes = tuner.record(nbytes, now)
        if changes:
            # The coordinator plans fusion and holds tensors, so the change takes effect here at once; the other
            # ranks learn it with the next responses. With the warm path every rank fuses its own hits, so rank 0
            # changes with the others, when it runs that message.
            if self.state.warm is None:
                self.state.config = self.state.config.replace(**changes)
            self._tuned = {**(self._tuned or {}), **changes}

    def _inspect_stalls(self, now: float) -> None:
        if self.state.config.stall_check_disable or now - self._last_stall_check < self._stall_every:
            return
        self._last_stall_check = now
        warn_after = self.state.config.stall_check_time_seconds
        stalled = self.coord.stalled(now, warn_after)
        if stalled:
            lines = "\n".join(f"  set {sid} '{name}': waiting {age:.0f} s for ranks {missing}"
                              for sid, name, missing, age in stalled)
            logger.warning(STALL_WARNING, warn_after, lines)
            flight_dump.on_stall_warning(self.state)   # [hang doctor]
        shutdown_after = self.state.config.stall_shutdown_time_seconds
        if shutdown_after:
            # As the original: a shutdown time below the warning time is raised to it (warned at init).
            self.coord.fail_stalled(now, max(shutdown_after, warn_after),
                                          "Stalled collective exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
