"""The engine's side of the fast lane (:mod:`horovod.engine.fast_lane`), as the engine's
:class:`~horovod.engine.agreement.Agreement` where the transport offers a lane: every request is numbered on the
lane; a lone blocking small collective is decided there when every rank proposed it, a lone asynchronous one is held
a moment for its caller (:mod:`horovod.engine.hold`), and what the lane does not decide goes to the coordinator."""
from __future__ import annotations

import time
from functools import partial
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import ops, result_pool
from horovod.engine.agreement import Admission, Coordinated
from horovod.engine.drive import Driver
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, StallError
from horovod.engine.fast_lane import FastLane
from horovod.engine.handles import Entry, Handle, HostEntry
from horovod.engine.hold import Hold
from horovod.engine.messages import Request, Response
from horovod.engine.negotiation import reduce_payloads
from horovod.engine.outbox import Outbox
from horovod.transport.base import TransportError


class LaneUse:
    """Posting on and deciding through the lane (see the module docstring).

    Args:
        state: the engine's state.
        lane: this rank's fast lane.
        driver: the drive loop (the housekeeping a waiting rank does, and who drives after it).
        outbox: requests not yet handed to the coordinator (a proposal needs it empty).
        then: where what the lane does not decide goes.
        hold: where a lone asynchronous call waits a moment for its caller (None: never held).
    """

    def __init__(self, state: EngineState, lane: FastLane, driver: Driver, outbox: Outbox, then: Coordinated,
                 hold: Optional[Hold] = None):
        self.state = state
        self.lane = lane
        self.driver = driver
        self.outbox = outbox
        self.then = then
        self.hold = hold

    # -- the Agreement ------------------------------------------------------------------------------------------
    def admit(self, entries: List[Entry], attended: bool) -> Admission:
        """Under the state's lock: number the call on the lane (a held call first, before it), hold it, or propose
        it (holding the drive lock when it is proposed). The ticket: ``(the released hold's request, the lane
        number or 0 when posted slow, whether the data travels on the board)``, or None when held."""
        state, lane, hold = self.state, self.lane, self.hold
        released: Optional[Request] = None
        if hold is not None:
            if hold.entry is not None:
                released = hold.release()   # a held call is numbered before anything issued after it
            if not attended and released is None and len(entries) == 1:
                placement = self.placement(entries)
                if placement is not None:
                    hold.keep(entries[0], placement)
                    return self.drive_held, None
        if attended:
            on_board = self.placement(entries)
            if on_board is not None and state.drive_lock.acquire(blocking=False):
                entry = entries[0]
                # (``entries[1:]``, not ``len``: no call more for every lone collective)
                seq = lane.propose(entry.request, entry.tensor, on_board) if not entries[1:] else \
                    lane.propose_group([e.request for e in entries], [e.tensor for e in entries])
                if not seq:
                    state.drive_lock.release()
                return self.driver.drive, (released, seq, on_board)
        lane.note([e.request for e in entries], state.spanning)
        return self.driver.drive, (released, 0, False)

    def carry(self, ticket: Any, entries: List[Entry], attended: bool) -> None:
        """Settle a proposal on the lane; what it does not decide goes to the coordinator."""
        if ticket is None:   # held
            self.driver.call_background()   # it ends the hold unless the caller waits first
            return
        released, seq, on_board = ticket
        if released is not None:
            self.outbox.add([released])
        if seq and self.settle(seq, entries, on_board):
            return
        self.then.carry(None, entries, attended)

    def drive_held(self, handle: Handle, timeout: Optional[float] = None) -> None:
        """The driver of a held call's handle: its caller waits for it now, so it goes on the fast lane as a
        blocking call would have; once it is no longer held, :meth:`Driver.drive`."""
        state, hold = self.state, self.hold
        assert hold is not None, "only a lane with a hold holds calls"
        if timeout is not None:   # the lane waits for every rank, however long: the coordinator's way
            hold.end()
            self.driver.drive(handle, timeout)
            return
        # Whoever holds the drive lock now (the background thread, looking whether it is needed) lets go of it
        # soon, or ends the hold itself when the hold is over.
        due = hold.due()
        if state.drive_lock.acquire(timeout=0.0 if due is None else max(0.0, due - time.monotonic())):
            seq = 0
            with state.lock:
                entry, on_board = hold.take(handle)
                if entry is not None:
                    seq = self.propose_held(entry, on_board)
            if not seq:
                state.drive_lock.release()
            elif entry is not None and self.settle(seq, [entry], on_board):   # (releases the drive lock)
                return
            if entry is not None:   # not decided on the lane: the coordinator's way, driven right here
                self.then.carry(None, [entry], attended=True)
        self.driver.drive(handle, timeout)

    # -- the lane -----------------------------------------------------------------------------------------------
    def placement(self, entries: List[Entry]) -> Optional[bool]:
        """Under the state's lock: whether ``entries`` are one collective the lane may take now, and how
        (:meth:`horovod.engine.fast_lane.FastLane.placement`); None when they are not."""
        state, coordination = self.state, self.driver.coordination
        if (not state.inflight and not self.outbox.queued
                and (coordination is None or not coordination.held)   # (rank 0 holds no responses back)
                and not state.timeline.enabled
                # While a set of only some ranks exists, its non-members never propose, so no entry could be fast;
                # and a rank that passes it where another passes the global set posts no entry the proposer could
                # see: propose nothing then (every request reaches the coordinator, which reports mismatches).
                and state.every_set_spans):
            if len(entries) == 1:
                return self.lane.placement(entries[0].request, entries[0].tensor)
            group = entries[0].request.group   # a whole group of several: grouped_allreduce
            if group is not None and group[1] == len(entries):
                return self.lane.group_placement([e.request for e in entries], [e.tensor for e in entries])
        return None

    def propose_held(self, entry: Entry, on_board: bool) -> int:
        """Under the state's lock and holding the drive lock: propose a held call (:mod:`horovod.engine.hold`) whose
        caller now waits for it; its lane number for :meth:`settle`, or 0 when it was posted slow."""
        entry.request.blocking = True   # as if issued blocking: its caller waits for it
        return self.lane.propose(entry.request, entry.tensor, on_board)

    def _done(self, entry: Entry, output: Any) -> None:
        """``entry`` was carried out on the lane: ``output`` is its result."""
        req, state = entry.request, self.state
        state.recorder.lane_done(req)   # [hang doctor]
        with state.lock:
            state.inflight.pop((req.process_set, req.name), None)
        entry.handle.complete(entry.index, output)

    def settle(self, seq: int, entries: List[Entry], on_board: bool) -> bool:
        """Decide lane number ``seq`` (holding the drive lock; ``on_board`` as :meth:`post` said); True when the
        entries' handle is done with them (carried out here, or failed with the engine), False when they go to the
        coordinator."""
        entry = entries[0]
        req = entry.request
        state, lane, driver = self.state, self.lane, self.driver
        housekeeping = lambda: driver.guarded_step(0.0)   # noqa: E731
        try:
            plan: Optional[Response] = None
            if entries[1:]:   # a group: every tensor's result, from the one payload each rank posted
                outcome, outputs = lane.settle(seq, req, housekeeping, partial(group_result, entries, state.size))
                if outcome == "fast":
                    for e, out in zip(entries, outputs or ()):
                        self._done(e, out)
                    return True
            elif on_board:
                outcome, output = lane.settle(seq, req, housekeeping,
                                              partial(lane_result, entry, state.size))
            else:
                outcome, plan = lane.settle(seq, req, housekeeping,
                                            partial(plane_response, req, state.size))
            if outcome == "slow":
                return False
            if outcome == "stalled":
                driver.teardown.die(StallError(
                    f"Stalled collective exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: "
                    f"{ops.KIND_NAMES[req.kind].lower()} '{req.name}' waited for ranks {lane.board.missing(seq)}. "
                    f"{SHUTDOWN_MESSAGE}"), notify=True)
            if outcome != "fast":
                return True   # the engine finished while waiting: the handle failed with it
            if plan is not None:   # agreed: every rank runs it on the data plane now, as the coordinator's response
                output = state.executor.execute_on_host(plan, [entry])[0]
            state.recorder.lane_done(req)   # [hang doctor] (as _done, inline: every lone collective comes here)
            with state.lock:
                state.inflight.pop((req.process_set, req.name), None)
            entry.handle.complete(entry.index, output)
            return True
        except (TransportError, OSError) as exc:
            driver.teardown.die_of_peer_failure(exc)
            return True
        except Exception as exc:  # noqa: BLE001  (a bug fails every handle loudly, as in the drive loop)
            driver.crash(exc)
            return True
        finally:
            state.drive_lock.release()
            if driver.needs_background():
                driver.call_background()


def group_result(entries: Sequence[HostEntry], size: int, payloads: List[memoryview]) -> List[Any]:
    """Every result of a grouped allreduce on the lane (:meth:`horovod.engine.fast_lane.FastLane.propose_group`):
    the reduced concatenation, cut into each tensor's output (allocated when the call returns new ones)."""
    total = reduce_payloads([entries[0].request], payloads, size)
    results, at = [], 0
    for entry in entries:
        assert entry.tensor is not None, "a collective on the lane has its input"
        piece, at = total[at:at + entry.tensor.size], at + entry.tensor.size
        if entry.output is None:
            entry.output = piece.reshape(entry.request.shape)
        else:
            np.copyto(entry.output.reshape(-1), piece, casting="no")
        results.append(entry.output)
    return results


def lane_result(entry: HostEntry, size: int, payloads: List[memoryview]) -> Any:
    """This rank's result of the lane's collective ``entry`` from every rank's payload (rank order), written
    into the entry's output (allocated when the call returns a new one), as the executor would."""
    req = entry.request
    output = entry.output
    assert entry.tensor is not None, "a collective on the lane has its input"
    if req.kind == ops.ALLREDUCE:
        # This rank's own payload is read from its input (in this core's cache), not back from its record on the
        # board (a 256 KiB allreduce 0.8-0.9x); not in place, where the result overwrites it while others are read.
        # (In place means the output *is* the input array: the engine API's contract, see ``allreduce_async``.)
        if output is not entry.tensor:
            payloads[req.rank] = entry.tensor.data
        if output is not None and req.dtype != ops.BFLOAT16:   # (bfloat16 is reduced in float32, then narrowed)
            reduce_payloads([req], payloads, size, out=output.reshape(-1))   # no new array, no copy
            return output
        total = reduce_payloads([req], payloads, size)
        if output is None:
            output = entry.output = total.reshape(req.shape)
        else:
            np.copyto(output.reshape(-1), total, casting="no")
        return output
    dtype = ops.storage_dtype(req.dtype)
    if req.kind == ops.BROADCAST:
        if output is None:
            output = entry.output = result_pool.empty(req.shape, dtype)
        source = entry.tensor if req.rank == req.root else payloads[req.root]
        if output is not source:   # in place at the root: nothing to copy
            np.copyto(output.reshape(-1), np.frombuffer(source, dtype=dtype), casting="no")
        return output
    # The same for the moves' own share (reading it back from the board cost a third of a 1 MiB allgather).
    mine = entry.tensor.reshape(-1).view(np.uint8)
    if req.kind == ops.REDUCESCATTER:
        # This rank's block of rows (the executor's split: the first rows % size ranks get one more).
        splits = ops.split_rows(req.shape[0], size)
        start, stop = ops.block_bounds(splits, req.rank, ops.row_elems(req.shape) * dtype.itemsize)
        block = [p[start:stop] for p in payloads]
        block[req.rank] = mine[start:stop].data
        out = reduce_payloads([req], block, size).reshape((splits[req.rank],) + tuple(req.shape[1:]))
        entry.output = out
        return out
    row = ops.row_elems(req.shape) * dtype.itemsize
    if req.kind == ops.ALLTOALL:
        return _alltoall_result(req, payloads, mine, size, row, dtype)
    # ALLGATHER: the rows of every rank, in rank order.
    rows = [len(p) // row if row else 0 for p in payloads]
    out = result_pool.empty((sum(rows),) + tuple(req.shape[1:]), dtype)
    flat, offset = out.reshape(-1).view(np.uint8), 0
    for rank, payload in enumerate(payloads):
        flat[offset:offset + len(payload)] = mine if rank == req.rank else np.frombuffer(payload, dtype=np.uint8)
        offset += len(payload)
    entry.output = out
    return out


def _alltoall_result(req: Request, payloads: Sequence[memoryview], mine: np.ndarray, size: int, row: int,
                     dtype: np.dtype) -> Tuple[np.ndarray, np.ndarray]:
    """An alltoall's ``(rows received, splits received)``: every payload starts with the rows its rank sends each
    rank (int64), then its rows; this rank's are after those its rank sends the lower ranks (its own rows come
    from ``mine``, its input's bytes)."""
    header, me = 8 * size, req.rank
    splits = [np.frombuffer(p[:header], np.int64).tolist() for p in payloads]   # (ints: no numpy sums below)
    received = [s[me] for s in splits]
    out = result_pool.empty((sum(received),) + tuple(req.shape[1:]), dtype)
    flat, offset = out.reshape(-1).view(np.uint8), 0
    for rank, (payload, sent, rows) in enumerate(zip(payloads, splits, received)):
        start = sum(sent[:me]) * row
        flat[offset:offset + rows * row] = mine[start:start + rows * row] if rank == me \
            else np.frombuffer(payload[header + start:header + start + rows * row], np.uint8)
        offset += rows * row
    return out, np.asarray(received, dtype=np.int32)


def plane_response(req: Request, size: int, payloads: Sequence[memoryview]) -> Response:
    """The response the coordinator would have sent for ``req`` once every rank proposed it with its data off the
    board: the request's own parameters, and what each rank posted of its shape (an allgather's rows, an
    alltoall's splits: the executor needs every rank's)."""
    resp = Response(kind=req.kind, names=[req.name], process_set=req.process_set, dtype=req.dtype, op=req.op,
                    root=req.root, prescale=req.prescale, postscale=req.postscale, shapes=[req.shape])
    if req.kind == ops.ALLGATHER:
        resp.first_dims = [[int(np.frombuffer(p, np.int64)[0]) for p in payloads]]
    elif req.kind == ops.ALLTOALL:
        resp.splits = [[np.frombuffer(p, np.int64).tolist() for p in payloads]]
    return resp
