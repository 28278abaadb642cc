"""The progress engine: queue → negotiate → fuse → execute → complete handles.

Framework calls enqueue :class:`Entry` objects; their requests wait in the rank's outbox until whoever drives
next hands them to the coordinator (a worker about to wait sends its own at once).  Progress — reading the
control connections, negotiating on rank 0, executing responses — is made by whichever thread holds the *drive*
lock, one at a time:

* a caller that waits on a handle drives progress itself when nobody else is (leader/follower), so a blocking
  collective costs no thread hand-off at all;
* otherwise the background thread drives, for as long as anything is in flight (asynchronous collectives keep
  overlapping with the caller's computation) and, on the coordinator, for process sets it serves but is not in.

An idle background thread parks on a condition variable and polls the control connections about once a second
(heartbeats, shutdown notices, stall checks).  Whoever drives blocks in ``select`` on the control connections
and a wake-up socketpair; only a waiting caller re-checks briefly first, and only when every local rank has a
core of its own (:mod:`horovod.transport.spin`).  The background thread never spins.

The runtime is the drive loop; each step's work is an explicit part of its own, over the runtime's state: rank 0's
negotiation (:mod:`horovod.engine.coordination`: it decides one execution order and sends it to the members of each
process set before executing it itself), carrying out responses (:mod:`horovod.engine.responses`), leaving or
failing (:mod:`horovod.engine.teardown`), the fast lane (:mod:`horovod.engine.fast_lane`) and the warm path's rounds
(:mod:`horovod.engine.warm`).
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from horovod.transport.spin import Spinner, default_budget_us
from horovod.engine.coordination import Coordination
from horovod.engine.errors import SHUTDOWN_MESSAGE, HorovodInternalError, PeerFailureError, ShutdownError
from horovod.engine.job import NO_JOB, JobLinks, ProcessSetInfo, forked_error
from horovod.engine.responses import Responses
from horovod.engine.teardown import Teardown
from horovod.engine import fusion
from horovod.engine.config import Config
from horovod.engine.controller import ControlPlane
from horovod.engine.executor import Executor
from horovod.engine.fast_lane import FastLane, LaneUse
from horovod.engine import flight_dump
from horovod.engine.flight_recorder import FlightRecorder
from horovod.engine.autotune import Autotuner
from horovod.engine.cache import CoordinatorCache, RequestCache
from horovod.engine.handles import Entry
from horovod.engine.liveness import Liveness
from horovod.engine.messages import ControlMessage, Request, Response
from horovod.engine.negotiation import Coordinator
from horovod.engine.rounds import SlotTable
from horovod.engine.timeline import Timeline
from horovod.engine.warm import WarmPath
from horovod.transport.base import RoundBoard, Transport, TransportError
from horovod.transport.sockets import PeerError

logger = logging.getLogger(__name__)

_BOARD_READY = [None]   # a spinning waiter found the round board ready (not a selector event)


class Runtime:
    """One engine instance (one ``init()``): the drive loop, over the state below, with explicit parts —
    :attr:`coordination` (rank 0's negotiation step), :attr:`responses` (carrying responses out), :attr:`teardown`
    (leaving and failing), :attr:`lane_use` (the fast lane) and :attr:`_warm` (the warm path's rounds) — each
    holding this runtime as the one state it works on.

    Args:
        config: resolved knobs.
        rank, size: this process's place in the world.
        world: the data-plane transport of the whole job.
        control: the control plane.
        static_sets: process sets registered at init, in id order (ids 1, 2, ...).
        job: the store, elastic epoch, rendezvous server and MPI communicator of the job, when there are.
        transport_name: the transport's registered name (default: the world transport's own).
        round_board: the warm path's board (default: the world transport's, on one host).
    """

    def __init__(self, config: Config, rank: int, size: int, world: Transport, control: ControlPlane,
                 static_sets: Sequence[Sequence[int]] = (), job: JobLinks = NO_JOB,
                 transport_name: Optional[str] = None, round_board: Optional[RoundBoard] = None):
        self.config = config
        self.rank, self.size = rank, size
        self.transport_name = transport_name or world.name
        # A child forked while this engine runs inherits it without its threads, and its connections belong to
        # the parent: the child must not touch them (it would break the parent's job).
        self._pid = os.getpid()
        self.store, self.epoch = job.store, job.epoch
        self.rendezvous_server, self.mpi_comm = job.rendezvous_server, job.mpi_comm
        self.world = world
        self.control = control
        self.sets: Dict[int, ProcessSetInfo] = {0: ProcessSetInfo(0, range(size), world)}
        self.coordinator = Coordinator(size, config.cache_capacity) if rank == 0 else None
        self.request_cache = RequestCache(config.cache_capacity)   # this rank's own requests
        self.mirror_cache = CoordinatorCache() if rank == 0 else None   # rank 0: every worker's slots
        for i, ranks in enumerate(static_sets, start=1):
            self._register_set(i, ranks)
        self.executor = Executor(rank, {i: s.ranks for i, s in self.sets.items()}, self._transport_for, config)
        self.timeline = Timeline.create(config, rank, world.name)
        self.recorder = FlightRecorder(config.flight_recorder_size)   # [hang doctor] the last collectives
        self.executor.timeline_of = lambda: self.timeline
        self._lock = threading.Lock()
        self._inflight: Dict[Tuple[int, str], Entry] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_pending = False
        self._dead: Optional[BaseException] = None
        self._stop_requested = False
        self._held: List[Response] = []
        self._outbox: List[Request] = []   # this rank's requests, handed to the coordinator by the next driver
        self._outbox_lock = threading.Lock()
        self._held_since = 0.0
        self._last_stall_check = time.monotonic()
        # How often the coordinator inspects stalls (the stall knobs are never tuned at run time).
        self._stall_every = float(max(1, min(config.stall_check_time_seconds,
                                             config.stall_shutdown_time_seconds or config.stall_check_time_seconds)))
        if rank == 0 and 0 < config.stall_shutdown_time_seconds < config.stall_check_time_seconds \
                and not config.stall_check_disable:
            logger.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=%d is less than HOROVOD_STALL_CHECK_TIME_SECONDS=%d; "
                           "stalled collectives fail after %d s instead", config.stall_shutdown_time_seconds,
                           config.stall_check_time_seconds, config.stall_check_time_seconds)
        self.liveness = Liveness(control.peers, control.send_bytes, config.gloo_timeout_seconds,
                                 control=control, world=world)   # [liveness] every byte in counts (issue 38, E2)
        self.autotuner = Autotuner(config, config.autotune_log) if config.autotune and rank == 0 else None
        self._tuned: Optional[dict] = None   # knob values to announce with the next responses
        # Progress: one driver at a time (see the module docstring).
        self._drive = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        for peer, sock in control.peers.items():
            self._selector.register(sock, selectors.EVENT_READ, peer)
        self._park = threading.Condition(threading.Lock())
        self._background_wanted = False
        # Only a waiting caller spins: the background thread must leave the GIL to the caller's computation.
        self._spinner = Spinner(default_budget_us(config.topology.local_size, config.spin_us))
        self._lane = FastLane.open(world, config, size, self._spinner.budget_s * 1e6)
        # The warm path (horovod/engine/rounds.py): repeated collectives agreed by one AND per round.
        self._warm = WarmPath.open(round_board or world.round_board(), config, size, control,
                                   self.timeline.enabled, rank == 0)
        self.slot_table = SlotTable(self._warm.state.cache.capacity) if self._warm and rank == 0 else None
        self._invalidations: List[int] = []   # rank 0: slots every rank must drop, sent with the next message
        self._finishing = False
        self._idle_polling = False
        self._closed = False
        self.teardown = Teardown(self)
        self.responses = Responses(self)
        self.coordination = Coordination(self)
        self.lane_use = LaneUse(self)
        for fd in self._warm.board.fds if self._warm is not None else ():
            self._selector.register(fd, selectors.EVENT_READ, "board")
        if self._lane is not None:   # [hang doctor] a stall on the lane dumps like the coordinator's
            self._lane.on_stall = lambda: flight_dump.on_stall_warning(self)
        self._thread = threading.Thread(target=self._run, name="horovod-background", daemon=True)

    # -- the parts' entry points, used across parts ------------------------------------------------------
    def _coordinate(self, readable) -> bool:
        return self.coordination._coordinate(readable)

    def _autotune(self, planned: List[Response], now: float) -> None:
        self.coordination._autotune(planned, now)

    def _execute_all(self, responses: List[Response]) -> None:
        self.responses._execute_all(responses)

    def _die(self, error: BaseException, notify: bool) -> None:
        self.teardown._die(error, notify)

    def _leave(self, reason: str) -> None:
        self.teardown._leave(reason)

    def _close_all(self) -> None:
        self.teardown._close_all()

    def _post_on_lane(self, requests: List[Request], attended: bool) -> int:
        return self.lane_use._post_on_lane(requests, attended)

    def _settle_on_lane(self, seq: int, entry: Entry) -> bool:
        return self.lane_use._settle_on_lane(seq, entry)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "Runtime":
        self._thread.start()
        self.liveness.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the background thread; pending collectives fail with the shutdown error."""
        if os.getpid() != self._pid:
            return   # the parent's engine: its threads are not here, and its peers must not hear from us
        with self._lock:
            self._stop_requested = True
        self._wake()
        self._call_background()
        self._thread.join(timeout)
        self._close_all()

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._stop_requested

    # -- process sets ---------------------------------------------------------------------------------
    def _register_set(self, set_id: int, ranks: Sequence[int]) -> ProcessSetInfo:
        ranks = tuple(sorted(ranks))
        transport = self.world.subgroup(ranks) if self.rank in ranks else None
        info = ProcessSetInfo(set_id, ranks, transport)
        self.sets[set_id] = info
        if self.coordinator is not None and set_id not in self.coordinator.sets:
            self.coordinator.register_set(set_id, ranks)
        if hasattr(self, "executor"):
            self.executor.set_ranks[set_id] = ranks
        return info

    def _transport_for(self, set_id: int) -> Transport:
        transport = self.sets[set_id].transport
        if transport is None:
            raise ValueError(f"rank {self.rank} is not a member of process set {set_id}")
        return transport

    # -- enqueue (user threads) -----------------------------------------------------------------------
    def enqueue(self, entries: List[Entry], attended: bool = False) -> None:
        """Queue entries for negotiation.

        ``attended``: the caller waits on these handles right away and so drives their progress itself; the
        background thread is not woken (waking it costs more than the whole collective on a small host).

        Raises:
            ValueError: a name is already in flight, or this rank is not a member of the process set.
            HorovodInternalError: the engine has failed or shut down.
        """
        if os.getpid() != self._pid:
            raise forked_error()
        with self._lock:
            if self._dead is not None:
                raise type(self._dead)(str(self._dead))
            if self._stop_requested:
                raise ShutdownError(SHUTDOWN_MESSAGE)
            keys = []
            seen = set()   # a group may hold thousands of tensors: no list scans
            for entry in entries:
                req = entry.request
                pset = self.sets.get(req.process_set)
                if pset is None:
                    raise ValueError(f"Process set {req.process_set} is not registered (it may have been removed); "
                                     f"register it with hvd.add_process_set() on every rank first.")
                if not pset.included(self.rank):
                    raise ValueError(f"Rank {self.rank} is not a member of the provided process set "
                                     f"(ranks {list(pset.ranks)}).")
                key = (req.process_set, req.name)
                if key in self._inflight or key in seen:
                    raise ValueError(
                        f"Requested a collective on tensor name '{req.name}', but a collective with that name is "
                        f"still in progress on this rank. Wait for it (synchronize) or use a different name.")
                keys.append(key)
                seen.add(key)
            direct = [e.request for e in entries]
            if attended:
                for req in direct:
                    req.blocking = True
            lane_seq = self._post_on_lane(direct, attended) if self._lane is not None else 0
            for key, entry in zip(keys, entries):
                self._inflight[key] = entry
                entry.handle.driver = self.drive
            self.recorder.enqueued(direct)   # [hang doctor]
        if lane_seq and self._settle_on_lane(lane_seq, entries[0]):
            return
        if self.size == 1:
            self._run_alone(direct)
            return
        # Requests queue in the outbox; whoever drives next sends them (rank 0: records them in the coordinator),
        # so a burst of asynchronous calls leaves in one control message.
        with self._outbox_lock:
            first = not self._outbox
            self._outbox.extend(direct)
        if attended and self.coordinator is None:
            # A caller that is about to wait sends at once (behind anything queued before, to keep the order).
            try:
                self._flush_outbox()
            except PeerError as exc:
                with self._lock:
                    for entry in entries:
                        self._inflight.pop((entry.request.process_set, entry.request.name), None)
                raise PeerFailureError(f"cannot reach the coordinator (rank 0): {exc}. {SHUTDOWN_MESSAGE}") from exc
        elif first and self._drive.locked():
            self._wake()   # whoever drives may be blocked in select; otherwise the next driver sees the outbox
        if not attended:
            self._call_background()

    def _flush_outbox(self) -> None:
        """Hand queued requests to the coordinator: in one message from a worker, directly on rank 0."""
        with self._outbox_lock:   # held throughout: concurrent flushers must not reorder a rank's requests
            batch, self._outbox = self._outbox, []
            if not batch:
                return
            if self._warm is not None:
                batch = self._warm.take(batch, time.monotonic())
                if not batch:
                    return
            if self.coordinator is None:
                self.control.send(0, ControlMessage(requests=[self.request_cache.encode(r) for r in batch]))
                return
            now = time.monotonic()
            for req in batch:
                self.timeline.negotiate(req, now)
                template, data, _ = self.request_cache.canonical(req)
                self._note_cold(template)
                self.coordinator.add(template, now, data)

    def _send_cold(self, requests: List[Request]) -> None:
        """Hand waiting hits of the warm path to the coordinator in full (see horovod/engine/rounds.py)."""
        if self.coordinator is None:
            self.control.send(0, ControlMessage(requests=[self.request_cache.encode(r) for r in requests]))
            return
        now = time.monotonic()
        for req in requests:
            template, data, _ = self.request_cache.canonical(req)
            self._note_cold(template)
            self.coordinator.add(template, now, data)

    def _note_cold(self, req: Request) -> None:
        """Rank 0: a request of the global set that reaches the coordinator drops its name's cache slot on every
        rank, so that the other ranks' hits for it come here too and every request is checked as before."""
        if self.slot_table is not None and req.process_set == 0:
            slot = self.slot_table.invalidate((0, req.name))
            if slot is not None:
                self._invalidations.append(slot)

    def _run_alone(self, requests) -> None:
        """A job of one process has nobody to wait for: plan and execute right here, without any hand-off."""
        coord = self.coordinator
        assert coord is not None, "a job of one process coordinates itself"
        with self._drive:   # other user threads may call collectives at the same time
            now = time.monotonic()
            for req in requests:
                self.timeline.negotiate(req, now)
                coord.add(req, now)
            ready = coord.take_ready()
            self.timeline.negotiated(ready, now)
            self._execute_all(fusion.plan(ready, self.config.fusion_threshold, self.config.disable_group_fusion))

    def _wake(self) -> None:
        """Make whoever drives leave ``select``; one pending wake-up byte is enough."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up byte is already pending (or we are closing)

    # -- background thread ----------------------------------------------------------------------------
    def _pin_thread(self) -> None:
        """HOROVOD_THREAD_AFFINITY: one core id per local rank for this rank's background thread."""
        cores = [c for c in str(self.config.thread_affinity or "").split(",") if c.strip()]
        local_rank = self.config.topology.local_rank
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

    # -- progress -------------------------------------------------------------------------------------
    def drive(self, handle, timeout: Optional[float] = None) -> None:
        """Make progress from the calling thread until ``handle`` is done, if nobody else is driving.

        Returns early (the caller then waits on the handle) when another thread drives: that thread keeps driving
        while anything is in flight, or hands over to the background thread when it stops.
        """
        if os.getpid() != self._pid:
            raise forked_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._drive.acquire(blocking=False):
            return
        try:
            while not handle.done():
                wait = self._select_timeout()
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    wait = remaining if wait is None else min(wait, remaining)
                if not self._guarded_step(wait, spin=True):
                    return
        finally:
            self._drive.release()
            # Checked after releasing, so an entry enqueued while we drove is never left without a driver.
            if self._needs_background():
                self._call_background()

    def _needs_background(self) -> bool:
        """Whether progress must continue without a waiting caller."""
        if self._dead is not None:
            return False
        if self._stop_requested or (self._inflight and self.size > 1):
            return True   # a job of one process runs its entries in the caller (_run_alone), never in the background
        warm = self._warm
        if warm is not None and (warm.state.in_round or warm.deferred):
            return True   # everyone waits for this rank's round; its messages wait for the round
        coord = self.coordinator
        # Rank 0 serves process sets it is not a member of, and holds responses during a cycle-time window.
        return coord is not None and (bool(self._held) or coord.has_ready() or
                                      any(not info.included(self.rank) for info in self.sets.values()))

    def _call_background(self) -> None:
        if self._background_wanted:
            return   # already called: it will drive for as long as anything is in flight
        with self._park:
            self._background_wanted = True
            self._park.notify()

    def _park_background(self) -> bool:
        """Block the background thread until it is needed; False when woken only by the idle-poll timer."""
        period = min(1.0, self.liveness.interval)
        with self._park:
            while not self._background_wanted and not self._needs_background():
                if not self._park.wait(period):
                    return False
            self._background_wanted = False
            return True

    def _run(self) -> None:
        self._pin_thread()
        while self._dead is None:
            needed = self._park_background()
            if self._dead is not None:
                return
            # A caller that drives polls as it goes; when it is done it calls us back if anything else is still
            # in flight.
            if not self._drive.acquire(blocking=needed, timeout=1.0 if needed else -1):
                continue
            try:
                if not needed:   # idle poll: heartbeats, notices, stalls, rounds others wait in
                    self._idle_polling = True
                    try:
                        if not self._guarded_step(0.0):
                            return
                    finally:
                        self._idle_polling = False
                while self._needs_background():
                    if not self._guarded_step(self._select_timeout()):
                        return
            finally:
                self._drive.release()

    def _guarded_step(self, timeout: Optional[float], spin: bool = False) -> bool:
        """:meth:`_step`, turning failures into the engine's death; False once the engine is finished."""
        if self._dead is not None:
            return False
        try:
            return self._step(timeout, spin)
        except (PeerError, TransportError, OSError) as exc:
            self._die_of_peer_failure(exc)
        except BaseException as exc:  # a bug must fail the handles loudly, not hang them
            logger.exception("horovod progress engine crashed")
            self._die(HorovodInternalError(f"Horovod background thread crashed: {exc!r}"), notify=True)
        return False

    def _step(self, timeout: Optional[float], spin: bool = False) -> bool:
        """One round: wait up to ``timeout`` for control traffic, then negotiate and execute what is ready."""
        coord = self.coordinator
        if self._outbox:
            self._flush_outbox()
        if coord is not None and coord.has_ready():
            timeout = 0.0
        events: Optional[Sequence[Any]] = None
        warm = self._warm
        if warm is not None and self._dead is None:
            # Post this rank's new hits before waiting: the other ranks may be waiting for exactly that. A round that
            # finished here may have completed the caller's handle: then do not block.
            rounds_done = warm.state.done
            if not self._advance_rounds():
                return False
            if warm.state.done != rounds_done:
                timeout = 0.0
        if spin and timeout != 0.0:
            if warm is None:
                events = self._spinner.spin(lambda: self._selector.select(0))
            else:
                events = self._spinner.spin(
                    lambda: self._selector.select(0) or (_BOARD_READY if warm.ready() else None))
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
                    events = self._selector.select(timeout)
                finally:
                    warm.board.set_waiting(False)
            else:
                events = self._selector.select(timeout)
        readable = []
        for key, _ in events:
            if key.data == "board":
                if warm is not None:
                    warm.board.drain(key.fd)
            elif key.data is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
                # Cleared after draining: a wake-up skipped in between is for work the rest of this step, or the
                # next driver, sees anyway (the outbox and ready responses are checked every step).
                self._wake_pending = False
            else:
                readable.append(key.data)
                self.liveness.heard(key.data)
        with self._lock:
            stop = self._stop_requested
        if stop:
            self._leave(SHUTDOWN_MESSAGE)
            return False
        if coord is not None:
            if not self._coordinate(readable):
                return False
        elif not self._follow(readable):
            return False
        if warm is not None and self._dead is None:
            if not self._advance_rounds():
                return False
        silent = self.liveness.silent()
        if silent:
            peer, quiet = silent[0]
            self._die(PeerFailureError(
                f"rank {peer} has not been heard from for {quiet:.0f} s (its process is frozen, its host is "
                f"unreachable, or it is overloaded; HOROVOD_GLOO_TIMEOUT_SECONDS="
                f"{self.config.gloo_timeout_seconds}). {SHUTDOWN_MESSAGE}", culprit=peer), notify=True)
            return False
        return True

    def _select_timeout(self) -> Optional[float]:
        timeouts = [self.liveness.next_check_in()] if self.control.peers else []
        if self._held:
            timeouts.append(max(0.0, self._held_since + self.config.cycle_time_ms / 1000.0 - time.monotonic()))
        if self.coordinator is not None and not self.config.stall_check_disable:
            timeouts.append(max(0.05, self._last_stall_check + self._stall_every - time.monotonic()))
        if self._warm is not None:
            due = self._warm.next_deadline()
            if due is not None:
                timeouts.append(max(0.0, due - time.monotonic()))
        return min(timeouts) if timeouts else None

    def _die_of_peer_failure(self, exc: BaseException) -> None:
        """Fail the engine because a peer or the link to it failed, naming that rank when the error does."""
        peer = getattr(exc, "peer", None)
        culprit = peer if isinstance(peer, int) and not isinstance(peer, bool) else None
        self._die(PeerFailureError(self._describe_failure(exc), culprit=culprit), notify=True)

    def _describe_failure(self, exc: BaseException) -> str:
        return (f"Horovod detected that a peer failed during a collective on rank {self.rank}: {exc}. "
                f"Check the other ranks' output for the original error; in elastic mode the job will reset.")

    # worker side
    def _receive(self, peer: int) -> Optional[List[ControlMessage]]:
        """Messages from ``peer`` in order, up to and including a shutdown notice; ``None`` if the peer is gone.

        Whatever arrived before a shutdown notice must still be handled (the last responses of a rank that
        finished), so the caller processes the list and then :meth:`_obey_shutdown`.
        """
        try:
            messages = self.control.receive(peer)
        except PeerError as exc:
            relay = self.coordinator is not None
            who = f"rank {peer}" if relay else "the coordinator (rank 0)"
            self._die(PeerFailureError(f"{who} closed its control connection (the process exited or crashed): "
                                       f"{exc}. {SHUTDOWN_MESSAGE}", culprit=peer), notify=relay)
            return None
        for i, msg in enumerate(messages):
            if msg.shutdown:
                return messages[:i + 1]
        return messages

    def _obey_shutdown(self, msg: ControlMessage) -> bool:
        """Go down when ``msg`` says so (the coordinator relays it to everyone); True if it did."""
        if not msg.shutdown:
            return False
        if self._warm is not None and not msg.failure and not self._finishing:
            # An orderly leave: the leaver finished its rounds, so this rank can finish them too and run what the
            # coordinator sent before the notice (the last responses of a rank that finished).
            self._finishing = True
            try:
                self._warm.finish_open_round(self._advance_rounds)
            except (PeerError, TransportError, OSError):
                pass
        reason = msg.reason or SHUTDOWN_MESSAGE
        self._die(PeerFailureError(reason) if msg.failure else ShutdownError(reason),
                  notify=self.coordinator is not None)
        return True

    def _follow(self, readable) -> bool:
        if 0 in readable:
            messages = self._receive(0)
            if messages is None:
                return False
            for msg in messages:
                if self._obey_shutdown(msg):
                    return False
                if self._warm is not None:
                    if not self._warm.fence(msg):
                        self._warm.deferred.append(msg)   # runs once its round is finished here
                else:
                    self._run_message(msg)
        return True

    def _run_message(self, msg: ControlMessage) -> None:
        """Carry out one message of the coordinator: tuned knobs, dropped and assigned cache slots, responses."""
        if msg.params:
            self.config = self.config.replace(**msg.params)
        if self._warm is not None and (msg.invalidate or any(r.slots for r in msg.responses)):
            with self._lock:
                own = {}
                for resp in msg.responses:
                    if resp.slots:
                        for name in resp.names:
                            entry = self._inflight.get((resp.process_set, name))
                            if entry is not None:
                                own[name] = entry.request
            self._warm.apply(msg, own)
        self._execute_all(msg.responses)

    # -- the warm path --------------------------------------------------------------------------------
    def _advance_rounds(self) -> bool:
        """Post, finish and run rounds of the warm path as far as possible now (see horovod/engine/rounds.py)."""
        assert self._warm is not None, "called only with a warm path"
        self._warm.advance(time.monotonic(), self._run_message, self._run_warm, self._send_cold, self._read_control,
                           self._answers_rounds)
        return self._dead is None

    def _answers_rounds(self) -> bool:
        """Whether this rank joins a round others opened even with nothing to add: while anything is in flight
        here (it may wait for that round), on the coordinator's idle poll, and at the background thread's."""
        return bool(self._inflight) or self._idle_polling or (
            self.coordinator is not None and any(not info.included(self.rank) for info in self.sets.values()))

    def _run_warm(self, templates: List[Response]) -> None:
        planned = fusion.plan(templates, self.config.fusion_threshold, self.config.disable_group_fusion)
        self._execute_all(planned)
        if self.autotuner is not None:
            self._autotune(planned, time.monotonic())

    def _read_control(self) -> bool:
        """A worker: take in whatever the coordinator has sent (kept until its round is finished); False once the
        engine is finished. Nothing while it finishes its rounds after a shutdown notice: everything sent before
        the notice came with it."""
        if self.coordinator is None and 0 in self.control.peers and not self._finishing:
            self._follow([0])
        return self._dead is None
