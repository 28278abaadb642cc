"""The engine's side of the fast lane (:mod:`horovod.engine.fast_lane`): posting every request on the lane, and
deciding a lone blocking tiny allreduce there when every rank proposed it."""
from __future__ import annotations

from typing import List, cast

from horovod.engine.drive import Driver
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, StallError
from horovod.engine.executor import deliver_inline
from horovod.engine.fast_lane import FastLane
from horovod.engine.handles import Entry
from horovod.engine.messages import Request
from horovod.engine.outbox import Outbox
from horovod.transport.base import TransportError


class LaneUse:
    """Posting on and deciding through the lane (see the module docstring).

    Args:
        state: the engine's state.
        lane: this rank's fast lane.
        driver: the drive loop (the housekeeping a waiting rank does, and who drives after it).
        outbox: requests not yet handed to the coordinator (a proposal needs it empty).
    """

    def __init__(self, state: EngineState, lane: FastLane, driver: Driver, outbox: Outbox):
        self.state = state
        self.lane = lane
        self.driver = driver
        self.outbox = outbox

    def post(self, requests: List[Request], attended: bool) -> int:
        """Under the state's lock: propose a lone blocking tiny allreduce (returns its lane number, holding the
        drive lock), or post slow entries for the requests (returns 0)."""
        state, lane = self.state, self.lane
        if (attended and len(requests) == 1 and not state.inflight and not self.outbox
                and not self.driver.holding() and lane.eligible(requests[0]) and not state.timeline.enabled
                # While a set of only some ranks exists, its non-members never propose, so no entry could be fast;
                # and a rank that passes it where another passes the global set posts no entry the proposer could
                # see: propose nothing then (every request reaches the coordinator, which reports mismatches).
                and all(len(info.ranks) == state.size for info in state.sets.values())
                and state.drive_lock.acquire(blocking=False)):
            seq = lane.propose(requests[0])
            if not seq:
                state.drive_lock.release()
            return seq
        lane.note(requests, state.spanning_sets())
        return 0

    def settle(self, seq: int, entry: Entry) -> bool:
        """Decide lane number ``seq`` (holding the drive lock); True when the entry's handle is done with it
        (reduced here, or failed with the engine), False when it goes to the coordinator."""
        req = entry.request
        state, lane, driver = self.state, self.lane, self.driver
        try:
            outcome, result = lane.settle(seq, req, lambda: driver.guarded_step(0.0))
            if outcome == "slow":
                return False
            if outcome == "stalled":
                driver.teardown.die(StallError(
                    f"Stalled collective exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: allreduce '{req.name}' "
                    f"waited for ranks {lane.board.missing(seq)}. {SHUTDOWN_MESSAGE}"), notify=True)
            if outcome != "fast":
                return True   # the engine finished while waiting: the handle failed with it
            output = deliver_inline(entry, cast(bytes, result), req.dtype, req.shape)
            state.recorder.lane_done(req)   # [hang doctor]
            state.pop_entries(req.process_set, [req.name])
            entry.handle.complete(entry.index, output)
            return True
        except (TransportError, OSError) as exc:
            driver.teardown.die_of_peer_failure(exc)
            return True
        finally:
            state.drive_lock.release()
            if driver.needs_background():
                driver.call_background()
