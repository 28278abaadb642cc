"""Rank 0's part of a progress step: take requests in, decide one order, tell the members, tune, watch for stalls.

A mixin of :class:`horovod.engine.runtime.Runtime` (it runs inside the runtime's drive loop and shares its state);
the decisions themselves — which tensors are ready, conflicts, stalls — are :class:`horovod.engine.negotiation.Coordinator`'s.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

from horovod.engine import flight_dump, fusion
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError
from horovod.engine.messages import ControlMessage, Response

logger = logging.getLogger("horovod.engine.runtime")


class CoordinatorRole:
    """The coordinator's step (rank 0 only): see :meth:`_coordinate`."""

    def _coordinate(self, readable) -> bool:
        coord = self.coordinator
        now = time.monotonic()
        for peer in readable:
            messages = self._receive(peer)
            if messages is None:
                return False
            for msg in messages:
                if self._obey_shutdown(msg):
                    return False
                for wire in msg.requests:
                    req, data = self.mirror_cache.decode(peer, wire)
                    self.timeline.negotiate(req, now)
                    coord.add(req, now, data)
        coord.check_kind_conflicts()
        self._inspect_stalls(now)
        ready = coord.take_ready()
        if ready:
            self.timeline.negotiated(ready, now)
            if not self._held:
                self._held_since = now
            self._held.extend(ready)
        # A positive cycle time holds ready tensors a little, so more of them can be fused together.
        if self._held and now - self._held_since >= self.config.cycle_time_ms / 1000.0:
            planned = fusion.plan(self._held, self.config.fusion_threshold, self.config.disable_group_fusion)
            self._held = []
            params, self._tuned = self._tuned, None
            failed = self._send_responses(planned, params)
            if failed:
                self._die(PeerFailureError(f"ranks {failed} are unreachable (they exited or crashed). "
                                           f"{SHUTDOWN_MESSAGE}"), notify=True)
                return False
            self._execute_all(planned)
            if self.autotuner is not None:
                self._autotune(planned, now)
        return True

    def _send_responses(self, planned: List[Response], params: Optional[dict]) -> List[int]:
        """Send each response to the members of its process set; returns the ranks that could not be reached.

        Non-members never see a set's traffic: an idle rank that is not reading its connection must not have it
        filled by collectives it takes no part in.
        """
        everyone = list(self.control.peers)
        if all(resp.process_set == 0 or resp.process_set not in self.sets for resp in planned):
            return self.control.broadcast(ControlMessage(responses=planned, params=params))
        per_peer: Dict[int, List[Response]] = {peer: [] for peer in everyone}
        for resp in planned:
            info = self.sets.get(resp.process_set)
            for peer in (everyone if info is None else [r for r in info.ranks if r in per_peer]):
                per_peer[peer].append(resp)
        messages = {peer: ControlMessage(responses=resps, params=params)
                    for peer, resps in per_peer.items() if resps or params}
        return self.control.send_each(messages)

    def _autotune(self, planned: List[Response], now: float) -> None:
        nbytes = sum(fusion.response_bytes(r) for r in planned if r.kind in fusion.FUSIBLE)
        if nbytes == 0:
            return
        changes = self.autotuner.record(nbytes, now)
        if changes:
            # The coordinator plans fusion and holds tensors, so the change takes effect here at once; the other
            # ranks learn it with the next responses.
            self.config = self.config.replace(**changes)
            self._tuned = changes

    def _inspect_stalls(self, now: float) -> None:
        if self.config.stall_check_disable or now - self._last_stall_check < self._stall_every:
            return
        self._last_stall_check = now
        warn_after = self.config.stall_check_time_seconds
        stalled = self.coordinator.stalled(now, warn_after)
        if stalled:
            lines = "\n".join(f"  set {sid} '{name}': waiting {age:.0f} s for ranks {missing}"
                              for sid, name, missing, age in stalled)
            logger.warning(
                "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and "
                "are waiting for remainder of ranks for more than %d seconds. This may indicate that different "
                "ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, "
                "which will cause deadlock.\nMissing ranks:\n%s", warn_after, lines)
            flight_dump.on_stall_warning(self)   # [hang doctor]
        shutdown_after = self.config.stall_shutdown_time_seconds
        if shutdown_after:
            # As the original: a shutdown time below the warning time is raised to it (warned at init).
            self.coordinator.fail_stalled(now, max(shutdown_after, warn_after),
                                          "Stalled collective exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
