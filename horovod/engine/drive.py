"""The drive loop: who makes progress, when, and what one step of progress is.

Progress — reading the control connections, negotiating on rank 0, running the warm path's rounds, executing
responses — is made by whichever thread holds the state's *drive* lock, one at a time:

* a caller that waits on a handle drives progress itself when nobody else is (leader/follower), so a blocking
  collective costs no thread hand-off at all;
* otherwise the background thread drives, for as long as anything is in flight (asynchronous collectives keep
  overlapping with the caller's computation) and, on the coordinator, for process sets it serves but is not in.

An idle background thread parks on a condition variable and polls the control connections about once a second
(heartbeats, shutdown notices, stall checks, rounds others opened). Whoever drives blocks in ``select`` on the
control connections, the warm path's board and a wake-up socketpair; only a waiting caller re-checks briefly
first, and only when every local rank has a core of its own (:mod:`horovod.transport.spin`). The background thread
never spins: it would take the GIL from the caller's computation.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from typing import Any, List, Optional, Sequence

from horovod.engine import fusion
from horovod.engine.coordination import Coordination
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, HorovodInternalError, PeerFailureError
from horovod.engine.follower import Follower
from horovod.engine.hold import Hold
from horovod.engine.job import forked_error
from horovod.engine.messages import Response
from horovod.engine.outbox import Outbox
from horovod.engine.responses import Responses
from horovod.engine.teardown import Teardown
from horovod.transport.base import TransportError
from horovod.transport.sockets import PeerError
from horovod.transport.spin import Spinner

logger = logging.getLogger("horovod.engine.runtime")

_BOARD_READY = [None]   # a spinning waiter found the round board ready (not a selector event)


class Driver:
    """The drive loop over the engine's parts (see the module docstring).

    Args:
        state: the engine's state.
        teardown, follower, outbox, responses: the parts a step runs.
        coordination: rank 0's negotiation step (None on other ranks).
        spinner: how long a waiting caller re-checks before it blocks.
    """

    def __init__(self, state: EngineState, teardown: Teardown, follower: Follower, outbox: Outbox,
                 responses: Responses, coordination: Optional[Coordination], spinner: Spinner):
        self.state = state
        self.teardown = teardown
        self.follower = follower
        self.outbox = outbox
        self.responses = responses
        self.coordination = coordination
        self.spinner = spinner
        selector = state.selector
        selector.register(state.wakeup.reader, selectors.EVENT_READ, None)
        for peer, sock in state.control.peers.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        for fd in state.warm.board.fds if state.warm is not None else ():
            selector.register(fd, selectors.EVENT_READ, "board")
        for fd in state.lane.board.fds if state.lane is not None else ():
            selector.register(fd, selectors.EVENT_READ, "lane")   # partners waiting for this rank's entries
        self._park = threading.Condition(threading.Lock())
        self._background_wanted = False
        self._outwaiting = False   # the background thread waits for a hold to end: calls need not wake it
        self._urgent = False       # ... but an urgent call does
        #: A lone asynchronous call held for its caller (:mod:`horovod.engine.hold`); set with the fast lane.
        self.hold: Optional[Hold] = None
        self.thread = threading.Thread(target=self._run, name="horovod-background", daemon=True)

    # -- who drives -----------------------------------------------------------------------------------------------
    def drive(self, handle, timeout: Optional[float] = None) -> None:
        """Make progress from the calling thread until ``handle`` is done, if nobody else is driving.

        Returns early (the caller then waits on the handle) when another thread drives: that thread keeps driving
        while anything is in flight, or hands over to the background thread when it stops.
        """
        state = self.state
        if os.getpid() != state.pid:
            raise forked_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not state.drive_lock.acquire(blocking=False):
            return
        try:
            while not handle.done():
                try:
                    wait = self.select_timeout()
                except Exception as exc:   # a bug in the driver fails the engine loudly, not the caller alone
                    self.crash(exc)
                    return
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    wait = remaining if wait is None else min(wait, remaining)
                if not self.guarded_step(wait, spin=True):
                    return
        finally:
            state.drive_lock.release()
            # Checked after releasing, so an entry enqueued while we drove is never left without a driver.
            if self.needs_background():
                self.call_background()

    def coordinator_last_word(self, wait: float = 1.0) -> Optional[BaseException]:
        """After a send to the coordinator failed: read what it sent before it closed, and the engine's end.

        A coordinator that fails relays the first cause ("rank 1 has not been heard from ...") and then closes; a
        worker whose own send hits the closed connection first would otherwise report only a broken pipe. Returns
        the engine's death, if it is known after reading (another driver may be reading it: wait for it a while).
        """
        state = self.state
        if state.dead is None and state.drive_lock.acquire(timeout=wait):
            try:
                self._hear_coordinator()
            finally:
                state.drive_lock.release()
        return state.dead

    def _hear_coordinator(self) -> None:
        """Holding the drive lock: read what the coordinator sent, obeying a shutdown notice among it."""
        if self.state.dead is None and self.state.coordinator is None:
            for message in self.follower.receive(0) or []:
                if self.follower.obey_shutdown(message):
                    break

    def needs_background(self) -> bool:
        """Whether progress must continue without a waiting caller."""
        state = self.state
        if state.dead is not None:
            return False
        if state.stop_requested or (state.inflight and state.size > 1
                                    and not (self.hold is not None and self.hold.holding())):
            return True   # a job of one process runs its entries in the caller (agreement.Alone)
        warm = state.warm
        if warm is not None and (warm.state.in_round or warm.deferred):
            return True   # everyone waits for this rank's round; its messages wait for the round
        coord, coordination = state.coordinator, self.coordination
        if coord is None or coordination is None:
            return False   # only rank 0 coordinates
        # Rank 0 serves process sets it is not a member of, and holds ready responses during a cycle-time window.
        return bool(coordination.held) or coord.has_ready() or state.serves_outsiders

    def call_background(self, urgent: bool = False) -> None:
        """Have the background thread drive; ``urgent``: now, even while it waits for a hold to end (shutdown, a
        failure), which a new call does not need (its own hold ends later)."""
        if self._background_wanted and not urgent:
            return   # already called: it will drive for as long as anything is in flight
        with self._park:
            self._background_wanted = True
            self._urgent = self._urgent or urgent
            if urgent or not self._outwaiting:
                self._park.notify()

    def _park_background(self) -> bool:
        """Block the background thread until it is needed; False when woken only by the idle-poll timer."""
        period = min(1.0, self.state.liveness.interval)
        with self._park:
            while not self._background_wanted and not self.needs_background():
                if not self._park.wait(period):
                    return False
            self._background_wanted = False
            return True

    def _outwait_hold(self, hold: Hold) -> bool:
        """Let a held call's caller take it first: sleep until its hold ends, taking neither the GIL nor the drive
        lock from the caller. Whether progress is needed then (a hold to end, or anything else)."""
        with self._park:
            self._outwaiting = True
            try:
                while not self._urgent:
                    due = hold.due()   # (a later call's hold when the caller took this one and issued another)
                    if due is None:
                        return self.needs_background()
                    left = due - time.monotonic()
                    if left <= 0:
                        return True
                    self._park.wait(left)
                return True
            finally:
                self._outwaiting = self._urgent = False

    def _run(self) -> None:
        self._pin_thread()
        state = self.state
        while state.dead is None:
            needed = self._park_background()
            if state.dead is not None:
                return
            hold = self.hold
            if needed and hold is not None and not self._outwait_hold(hold):
                continue   # the caller took it and is done: nothing to drive
            # A caller that drives polls as it goes; when it is done it calls us back if anything else is still
            # in flight.
            if not state.drive_lock.acquire(blocking=needed, timeout=1.0 if needed else -1):
                continue
            try:
                if not needed:   # idle poll: heartbeats, notices, stalls, rounds others wait in
                    state.idle_polling = True
                    try:
                        if not self.guarded_step(0.0):
                            return
                    finally:
                        state.idle_polling = False
                while self.needs_background():
                    if not self.guarded_step(self.select_timeout()):
                        return
            finally:
                state.drive_lock.release()

    def _pin_thread(self) -> None:
        """HOROVOD_THREAD_AFFINITY: one core id per local rank for this rank's background thread."""
        config = self.state.config
        cores = [c for c in str(config.thread_affinity or "").split(",") if c.strip()]
        local_rank = config.topology.local_rank
        if not cores or not hasattr(os, "sched_setaffinity"):
            return
        if local_rank >= len(cores):
            logger.warning("HOROVOD_THREAD_AFFINITY lists %d cores but this is local rank %d; not pinning",
                           len(cores), local_rank)
            return
        try:
            os.sched_setaffinity(threading.get_native_id(), {int(cores[local_rank])})
        except (OSError, ValueError) as exc:
            logger.warning("could not pin the background thread to core %s: %s", cores[local_rank], exc)

    # -- one step -------------------------------------------------------------------------------------------------
    def guarded_step(self, timeout: Optional[float], spin: bool = False) -> bool:
        """:meth:`_step`, turning failures into the engine's death; False once the engine is finished."""
        if self.state.dead is not None:
            return False
        try:
            return self._step(timeout, spin)
        except (PeerError, TransportError, OSError) as exc:
            self.teardown.die_of_peer_failure(exc)
        except BaseException as exc:  # a bug must fail the handles loudly, not hang them
            self.crash(exc)
        return False

    def crash(self, exc: BaseException) -> None:
        """A bug: fail every handle loudly (the engine ends), never leave them hanging."""
        logger.exception("horovod progress engine crashed")
        self.teardown.die(HorovodInternalError(f"Horovod background thread crashed: {exc!r}"), notify=True)

    def _step(self, timeout: Optional[float], spin: bool = False) -> bool:
        """Wait up to ``timeout`` for control traffic, then negotiate and execute what is ready."""
        state = self.state
        coord = state.coordinator
        if self.hold is not None and self.hold.due() is not None:
            self.hold.end(ended_by=time.monotonic())   # numbered slow, queued as any asynchronous call
        if self.outbox.queued:
            try:
                self.outbox.flush()
            except PeerError:
                self._hear_coordinator()   # a coordinator that failed said why first (the rank that failed)
                if state.dead is not None:
                    return False
                raise
        if coord is not None and coord.has_ready():
            timeout = 0.0
        warm = state.warm
        if warm is not None and state.dead is None:
            # Post this rank's new hits before waiting: the other ranks may be waiting for exactly that. A round that
            # finished here may have completed the caller's handle: then do not block.
            rounds_done = warm.state.done
            if not self.advance_rounds():
                return False
            if warm.state.done != rounds_done:
                timeout = 0.0
        readable = self._wait(timeout, spin)
        with state.lock:
            stop = state.stop_requested
        if stop:
            self.teardown.leave(SHUTDOWN_MESSAGE)
            return False
        if self.coordination is not None:
            if not self.coordination.coordinate(readable):
                return False
        elif not self.follower.follow(readable):
            return False
        if warm is not None and state.dead is None:
            if not self.advance_rounds():
                return False
        device_failure = state.executor.device_failure()
        if device_failure is not None:
            self.teardown.die_of_peer_failure(device_failure)
            return False
        silent = state.liveness.silent()
        if silent:
            peer, quiet = silent[0]
            self.teardown.die(PeerFailureError(
                f"rank {peer} has not been heard from for {quiet:.0f} s (its process is frozen, its host is "
                f"unreachable, or it is overloaded; HOROVOD_GLOO_TIMEOUT_SECONDS="
                f"{state.config.gloo_timeout_seconds}). {SHUTDOWN_MESSAGE}", culprit=peer), notify=True)
            return False
        return True

    def _wait(self, timeout: Optional[float], spin: bool) -> List[int]:
        """Wait for control traffic (spinning first when ``spin``); the peers whose connections are readable."""
        state = self.state
        selector, warm = state.selector, state.warm
        events: Optional[Sequence[Any]] = None
        if spin and timeout != 0.0:
            if warm is None:
                events = self.spinner.spin(lambda: selector.select(0))
            else:
                events = self.spinner.spin(lambda: selector.select(0) or (_BOARD_READY if warm.ready() else None))
                if events is _BOARD_READY:
                    events = ()
        if events is None:
            if warm is not None and timeout != 0.0:
                cap = warm.sleep_cap()
                if cap is not None:
                    timeout = cap if timeout is None else min(timeout, cap)
                warm.board.set_waiting(True)
                if warm.ready():
                    timeout = 0.0
                try:
                    events = selector.select(timeout)
                finally:
                    warm.board.set_waiting(False)
            else:
                events = selector.select(timeout)
        readable = []
        for key, _ in events:
            if key.data == "board":
                if warm is not None:
                    warm.board.drain(key.fd)
            elif key.data == "lane":
                if state.lane is not None:
                    state.lane.board.drain(key.fd)
            elif key.data is None:
                state.wakeup.drain()
            else:
                readable.append(key.data)
                state.liveness.heard(key.data)
        return readable

    def select_timeout(self) -> Optional[float]:
        state = self.state
        timeouts = [state.liveness.next_check_in()] if state.control.peers else []
        if self.coordination is not None:
            due = self.coordination.due_in()
            if due is not None:
                timeouts.append(due)
        due = self.hold.due() if self.hold is not None else None
        if due is not None:
            timeouts.append(max(0.0, due - time.monotonic()))
        if state.warm is not None:
            deadline = state.warm.next_deadline()
            if deadline is not None:
                timeouts.append(max(0.0, deadline - time.monotonic()))
        return min(timeouts) if timeouts else None

    # -- the warm path --------------------------------------------------------------------------------------------
    def advance_rounds(self) -> bool:
        """Post, finish and run rounds of the warm path as far as possible now (see horovod/engine/rounds.py)."""
        state = self.state
        assert state.warm is not None, "called only with a warm path"
        state.warm.advance(time.monotonic(), self.follower.run_message, self._run_warm, self.outbox.send_cold,
                           self.follower.read_control, self._answers_rounds)
        return state.dead is None

    def _answers_rounds(self) -> bool:
        """Whether this rank joins a round others opened even with nothing to add: while anything is in flight
        here (it may wait for that round), on the coordinator's idle poll, and at the background thread's."""
        state = self.state
        return bool(state.inflight) or state.idle_polling or state.serves_outsiders

    def _run_warm(self, templates: List[Response]) -> None:
        config = self.state.config
        planned = fusion.plan(templates, config.fusion_threshold, config.disable_group_fusion)
        self.responses.execute_all(planned)
        if self.coordination is not None and self.state.autotuner is not None:
            self.coordination.autotune(planned, time.monotonic())
