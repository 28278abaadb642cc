"""The running engine's state: one typed object that every part of the engine works on.

The engine's parts (:mod:`~horovod.engine.intake`, :mod:`~horovod.engine.agreement`, :mod:`~horovod.engine.outbox`,
:mod:`~horovod.engine.drive`, :mod:`~horovod.engine.follower`, :mod:`~horovod.engine.coordination`,
:mod:`~horovod.engine.responses`, :mod:`~horovod.engine.teardown`, :class:`~horovod.engine.lane_use.LaneUse`)
each hold this object and the few other parts they call, passed explicitly; none reaches into another's private
attributes. What is shared lives here under public names, with the lock that guards it.
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from horovod.engine.autotune import Autotuner
from horovod.engine.cache import CoordinatorCache, RequestCache
from horovod.engine.config import Config
from horovod.engine.controller import ControlPlane
from horovod.engine.executor import Executor
from horovod.engine.fast_lane import FastLane
from horovod.engine.flight_recorder import FlightRecorder
from horovod.engine.handles import Entry
from horovod.engine.job import JobLinks, ProcessSetInfo
from horovod.engine.liveness import Liveness
from horovod.engine.negotiation import Coordinator
from horovod.engine.rounds import SlotTable
from horovod.engine.timeline import Timeline
from horovod.engine.warm import WarmPath
from horovod.transport.base import Transport

#: A collective in flight on this rank: (process set id, tensor name).
Key = Tuple[int, str]


class WakeUp:
    """A socketpair whose read end sits in the driver's selector: one byte makes whoever drives leave ``select``."""

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.pending = False

    def wake(self) -> None:
        if self.pending:
            return   # one pending wake-up byte is enough
        self.pending = True
        try:
            self.writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass   # a byte is already pending (or we are closing)

    def drain(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        # Cleared after draining: a wake-up skipped in between is for work the rest of this step, or the next
        # driver, sees anyway (the outbox and ready responses are checked every step).
        self.pending = False

    def close(self) -> None:
        for s in (self.reader, self.writer):
            try:
                s.close()
            except OSError:
                pass


@dataclass(eq=False)
class EngineState:
    """Everything one engine (one ``init()``) shares between its parts."""

    config: Config
    rank: int
    size: int
    transport_name: str
    world: Transport
    control: ControlPlane
    job: JobLinks
    executor: Executor
    timeline: Timeline
    recorder: FlightRecorder
    liveness: Liveness
    request_cache: RequestCache
    sets: Dict[int, ProcessSetInfo]
    coordinator: Optional[Coordinator] = None
    mirror_cache: Optional[CoordinatorCache] = None   # rank 0: every worker's request slots
    autotuner: Optional[Autotuner] = None
    lane: Optional[FastLane] = None
    warm: Optional[WarmPath] = None
    slot_table: Optional[SlotTable] = None            # rank 0 with a warm path: the slots it assigns
    pid: int = field(default_factory=os.getpid)       # a forked child must not touch the parent's engine
    #: Guards ``inflight``, ``dead`` and ``stop_requested`` (user threads enqueue while a driver completes).
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: One driver at a time (see :mod:`horovod.engine.drive`).
    drive_lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: Dict[Key, Entry] = field(default_factory=dict)
    dead: Optional[BaseException] = None
    stop_requested: bool = False
    finishing: bool = False      # finishing the open round after an orderly shutdown notice
    idle_polling: bool = False   # the background thread's once-a-second poll is running
    closed: bool = False
    flight_generation: int = 0   # [hang doctor] set by init(): names this engine's dumps
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    wakeup: WakeUp = field(default_factory=WakeUp)
    # What every collective asks of ``sets``, kept up to date by register_set / remove_set (see _sets_changed).
    spanning: Tuple[int, ...] = ()     # ids of the sets that hold every rank
    every_set_spans: bool = True       # no set of only some ranks exists
    serves_outsiders: bool = False     # rank 0 serves a set it is not a member of (it must keep driving for it)

    def __post_init__(self) -> None:
        self._sets_changed()

    # -- job links ------------------------------------------------------------------------------------------------
    @property
    def store(self):
        return self.job.store

    @property
    def epoch(self):
        return self.job.epoch

    @property
    def rendezvous_server(self):
        return self.job.rendezvous_server

    @property
    def mpi_comm(self):
        return self.job.mpi_comm

    # -- process sets ---------------------------------------------------------------------------------------------
    def register_set(self, set_id: int, ranks: Sequence[int]) -> ProcessSetInfo:
        ranks = tuple(sorted(ranks))
        transport = self.world.subgroup(ranks) if self.rank in ranks else None
        info = ProcessSetInfo(set_id, ranks, transport)
        self.sets[set_id] = info
        if self.coordinator is not None and set_id not in self.coordinator.sets:
            self.coordinator.register_set(set_id, ranks)
        self.executor.set_ranks[set_id] = ranks
        self._sets_changed()
        return info

    def remove_set(self, set_id: int) -> Optional[ProcessSetInfo]:
        """Forget process set ``set_id`` here (its transport is the caller's to close); returns what it was."""
        info = self.sets.pop(set_id, None)
        self._sets_changed()
        return info

    def _sets_changed(self) -> None:
        self.spanning = tuple(sid for sid, info in self.sets.items() if len(info.ranks) == self.size)
        self.every_set_spans = len(self.spanning) == len(self.sets)
        self.serves_outsiders = self.coordinator is not None and any(
            not info.included(self.rank) for info in self.sets.values())

    def transport_for(self, set_id: int) -> Transport:
        transport = self.sets[set_id].transport
        if transport is None:
            raise ValueError(f"rank {self.rank} is not a member of process set {set_id}")
        return transport

    # -- entries in flight ----------------------------------------------------------------------------------------
    def entries(self, set_id: int, names: Sequence[str]) -> List[Optional[Entry]]:
        with self.lock:
            return [self.inflight.get((set_id, name)) for name in names]

    def pop_entries(self, set_id: int, names: Sequence[str]) -> List[Optional[Entry]]:
        with self.lock:
            return [self.inflight.pop((set_id, name), None) for name in names]
