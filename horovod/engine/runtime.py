"""The progress engine: queue → negotiate → fuse → execute → complete handles.

:class:`Runtime` builds one engine (one ``init()``) and is its public face for the layers above: ``enqueue`` and
``drive`` for the collectives, ``start``/``shutdown``, and read access to the engine's identity and state. The
work is done by parts, each over the one typed :class:`~horovod.engine.engine_state.EngineState` and the few other
parts it calls, passed explicitly:

* :class:`~horovod.engine.intake.Intake` — a collective's entry: the checks a rank makes alone, then the engine's
  :class:`~horovod.engine.agreement.Agreement` (a job of one, the coordinator with the warm path, or the fast lane
  in front of them);
* :class:`~horovod.engine.outbox.Outbox` — requests on their way to the coordinator;
* :class:`~horovod.engine.drive.Driver` — who makes progress and what one step is (the background thread);
* :class:`~horovod.engine.follower.Follower` — the coordinator's messages on every rank;
* :class:`~horovod.engine.coordination.Coordination` — rank 0's negotiation step;
* :class:`~horovod.engine.responses.Responses` — carrying responses out through the executor;
* :class:`~horovod.engine.teardown.Teardown` — leaving and failing;
* :class:`~horovod.engine.lane_use.LaneUse` and :class:`~horovod.engine.warm.WarmPath` — the fast lane (an
  agreement) and the warm path's rounds, when the transport offers their boards.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, Optional, Sequence

from horovod.engine import flight_dump
from horovod.engine.agreement import Agreement, Alone, Coordinated
from horovod.engine.autotune import Autotuner
from horovod.engine.boards import LaneBoard, RoundBoard
from horovod.engine.cache import CoordinatorCache, RequestCache
from horovod.engine.config import Config
from horovod.engine.controller import ControlPlane
from horovod.engine.coordination import Coordination
from horovod.engine.drive import Driver
from horovod.engine.engine_state import EngineState
from horovod.engine.executor import Executor
from horovod.engine.fast_lane import FastLane
from horovod.engine.flight_recorder import FlightRecorder
from horovod.engine.follower import Follower
from horovod.engine.hold import Hold
from horovod.engine.intake import Intake
from horovod.engine.job import NO_JOB, JobLinks, ProcessSetInfo
from horovod.engine.lane_use import LaneUse
from horovod.engine.liveness import Liveness
from horovod.engine.negotiation import Coordinator
from horovod.engine.outbox import Outbox
from horovod.engine.responses import Responses
from horovod.engine.rounds import SlotTable
from horovod.engine.teardown import Teardown
from horovod.engine.timeline import Timeline
from horovod.engine.warm import WarmPath
from horovod.transport.base import Transport
from horovod.transport.spin import Spinner

logger = logging.getLogger(__name__)


class Runtime:
    """One engine instance (one ``init()``): builds the state and the parts, and is their public face.

    Args:
        config: resolved knobs.
        rank, size: this process's place in the world.
        world: the data-plane transport of the whole job.
        control: the control plane.
        static_sets: process sets registered at init, in id order (ids 1, 2, ...).
        job: the store, elastic epoch, rendezvous server and MPI communicator of the job, when there are.
        transport_name: the transport's registered name (default: the world transport's own).
        round_board: the warm path's board (:func:`horovod.engine.boards.open_boards`), if any.
        lane_board: the fast lane's board (:func:`horovod.engine.boards.open_boards`), if any.
    """

    def __init__(self, config: Config, rank: int, size: int, world: Transport, control: ControlPlane,
                 static_sets: Sequence[Sequence[int]] = (), job: JobLinks = NO_JOB,
                 transport_name: Optional[str] = None, round_board: Optional[RoundBoard] = None,
                 lane_board: Optional[LaneBoard] = None):
        sets: Dict[int, ProcessSetInfo] = {0: ProcessSetInfo(0, range(size), world)}
        executor = Executor(rank, {0: sets[0].ranks}, lambda set_id: state.transport_for(set_id), config)
        timeline = Timeline.create(config, rank, world.name)
        spinner = Spinner(config.spin_budget_us)
        lane = FastLane.open(lane_board, config, size)
        warm = WarmPath.open(round_board, config, size, control, timeline.enabled, rank == 0)
        state = self.state = EngineState(
            config=config, rank=rank, size=size, transport_name=transport_name or world.name, world=world,
            control=control, job=job, executor=executor, timeline=timeline,
            recorder=FlightRecorder(config.flight_recorder_size),   # [hang doctor] the last collectives
            # Every byte from a peer counts as life, on the control plane and the data plane (issue 38, E2).
            liveness=Liveness(control.peers, control.send_bytes, config.gloo_timeout_seconds, control=control,
                              world=world),
            request_cache=RequestCache(config.cache_capacity),   # this rank's own requests
            sets=sets,
            coordinator=Coordinator(size, config.cache_capacity) if rank == 0 else None,
            mirror_cache=CoordinatorCache() if rank == 0 else None,
            autotuner=Autotuner(config, config.autotune_log) if config.autotune and rank == 0 else None,
            lane=lane,
            warm=warm,
            slot_table=SlotTable(warm.state.cache.capacity) if warm is not None and rank == 0 else None)
        executor.timeline_of = lambda: state.timeline
        for i, ranks in enumerate(static_sets, start=1):
            state.register_set(i, ranks)
        if rank == 0 and 0 < config.stall_shutdown_time_seconds < config.stall_check_time_seconds \
                and not config.stall_check_disable:
            logger.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=%d is less than HOROVOD_STALL_CHECK_TIME_SECONDS=%d; "
                           "stalled collectives fail after %d s instead", config.stall_shutdown_time_seconds,
                           config.stall_check_time_seconds, config.stall_check_time_seconds)
        self.teardown = Teardown(state)
        self.responses = Responses(state)
        self.follower = Follower(state, self.teardown, self.responses, lambda: self.driver.advance_rounds())
        self.outbox = Outbox(state)
        self.coordination = (Coordination(state, self.follower, self.outbox, self.teardown, self.responses)
                             if rank == 0 else None)
        self.driver = Driver(state, self.teardown, self.follower, self.outbox, self.responses, self.coordination,
                             spinner)
        self.agreement = self._agreement()
        self.intake = Intake(state, self.agreement)
        #: Queue entries for negotiation (:meth:`horovod.engine.intake.Intake.enqueue`): the intake's own bound
        #: method, so the seam costs no frame of its own on every collective.
        self.enqueue = self.intake.enqueue
        # The GPU watchdog (engine/device_watchdog.py) fails work on its own thread: the driver ends the engine.
        executor.on_device_failure = self._on_device_failure
        if state.lane is not None:   # [hang doctor] a stall on the lane dumps like the coordinator's
            state.lane.on_stall = lambda: flight_dump.on_stall_warning(state)

    def _agreement(self) -> Agreement:
        """This engine's strategy of agreement (:mod:`horovod.engine.agreement`): one per situation."""
        state, driver = self.state, self.driver
        if state.size == 1:
            return Alone(state, driver)
        coordinated = Coordinated(state, self.outbox, driver)
        if state.lane is None:
            return coordinated
        hold_us = state.config.fast_lane_hold_us
        driver.hold = Hold(state, state.lane, self.outbox, hold_us / 1e6) if hold_us > 0 else None
        return LaneUse(state, state.lane, driver, self.outbox, coordinated, driver.hold)

    def _on_device_failure(self, error: BaseException) -> None:
        self.state.wakeup.wake()
        self.driver.call_background(urgent=True)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "Runtime":
        self.driver.thread.start()
        self.state.liveness.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the background thread; pending collectives fail with the shutdown error."""
        state = self.state
        if os.getpid() != state.pid:
            return   # the parent's engine: its threads are not here, and its peers must not hear from us
        with state.lock:
            state.stop_requested = True
        state.wakeup.wake()
        self.driver.call_background(urgent=True)
        self.driver.thread.join(timeout)
        self.teardown.close_all()

    @property
    def alive(self) -> bool:
        return self.state.dead is None and not self.state.stop_requested

    # -- collectives ----------------------------------------------------------------------------------
    def drive(self, handle, timeout: Optional[float] = None) -> None:
        """Make progress from the calling thread until ``handle`` is done (see :meth:`Driver.drive`)."""
        self.driver.drive(handle, timeout)

    # -- what the layers above read -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def size(self) -> int:
        return self.state.size

    @property
    def config(self) -> Config:
        return self.state.config   # autotune may replace it while the engine runs

    @property
    def transport_name(self) -> str:
        return self.state.transport_name

    @property
    def world(self) -> Transport:
        return self.state.world

    @property
    def control(self) -> ControlPlane:
        return self.state.control

    @property
    def sets(self) -> Dict[int, ProcessSetInfo]:
        return self.state.sets

    @property
    def executor(self) -> Executor:
        return self.state.executor

    @property
    def recorder(self) -> FlightRecorder:
        return self.state.recorder

    @property
    def autotuner(self) -> Optional[Autotuner]:
        return self.state.autotuner

    @property
    def epoch(self):
        return self.state.job.epoch

    @property
    def store(self):
        return self.state.job.store

    @property
    def timeline(self) -> Timeline:
        return self.state.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline) -> None:   # start_timeline() / stop_timeline()
        self.state.timeline = timeline
