"""The coordinator's bookkeeping: which named collectives are ready, whether ranks agree, in what order to run.

Pure logic, no I/O: :class:`Coordinator` takes :class:`Request` objects as they arrive from ranks and hands back
:class:`Response` objects in the one order every rank will execute them.  A tensor is ready when every member of
its process set that has not joined has submitted it.  Disagreements (dtype, shape, op, root, scale factors)
become ERROR responses delivered to every rank — never a hang.
"""
from __future__ import annotations

import operator
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union, cast

import numpy as np

from horovod.engine import ops
from horovod.engine.cache import inline_data
from horovod.engine.group_sizes import GroupSizes
from horovod.engine.messages import ERROR, Request, Response
from horovod.transport.base import reduce_into

REDUCTIONS = (ops.ALLREDUCE, ops.REDUCESCATTER)


@dataclass
class _Pending:
    requests: Dict[int, Request] = field(default_factory=dict)
    data: Dict[int, Optional[bytes]] = field(default_factory=dict)   # inline allreduce bytes per rank
    first_seen: float = 0.0


@dataclass
class ProcessSetState:
    """The coordinator's view of one process set."""

    id: int
    ranks: Tuple[int, ...]
    joined: Set[int] = field(default_factory=set)
    last_joined: int = -1
    pending: "OrderedDict[str, _Pending]" = field(default_factory=OrderedDict)
    # group id -> names of that group already ready, waiting for the rest of the group
    groups: Dict[str, List[Response]] = field(default_factory=dict)
    barriers: Set[str] = field(default_factory=set)   # names of barriers submitted and maybe still pending

    @property
    def active(self) -> Set[int]:
        return set(self.ranks) - self.joined

    @property
    def active_count(self) -> int:
        return len(self.ranks) - len(self.joined)


# Kind prefixes of tensor names (see naming.py): one user name under two of them is a mismatch.
_KIND_PREFIXES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
                  "grouped_allreduce", "grouped_allgather", "grouped_reducescatter")


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _mismatch(name: str, sentence: str, a: Request, b: Request) -> str:
    return f"{sentence} (tensor '{name}': rank {a.rank} vs rank {b.rank})"


def validate(name: str, requests: Sequence[Request], joined: Iterable[int] = ()) -> Optional[str]:
    """The error every rank gets when the requests for ``name`` disagree, else ``None``."""
    first = requests[0]
    kind_name = ops.KIND_NAMES.get(first.kind, str(first.kind))
    for other in requests[1:]:
        if other.kind != first.kind:
            return _mismatch(name, f"Mismatched operations: One rank did an {kind_name}, but another rank did an "
                                   f"{ops.KIND_NAMES.get(other.kind, other.kind)}.", first, other)
    if first.kind in (ops.JOIN, ops.BARRIER):
        return None
    for other in requests[1:]:
        if other.process_set != first.process_set:
            return _mismatch(name, f"Mismatched process sets: One rank used process set {first.process_set}, "
                                   f"but another rank used process set {other.process_set}.", first, other)
        if (other.device >= 0) != (first.device >= 0):
            cpu, gpu = (first, other) if first.device < 0 else (other, first)
            return _mismatch(name, "Mismatched CPU/GPU device selection: One or more ranks specified device CPU "
                                   "while other ranks specified device GPU; put the tensor on the same kind of "
                                   "device on every rank.", cpu, gpu)
        if other.dtype != first.dtype:
            return _mismatch(name, f"Mismatched data types: One rank had type {first.dtype}, but another rank had "
                                   f"type {other.dtype}.", first, other)
    if first.kind in REDUCTIONS or first.kind == ops.BROADCAST:
        for other in requests[1:]:
            if tuple(other.shape) != tuple(first.shape):
                return _mismatch(name, f"Mismatched {kind_name} tensor shapes: One rank sent a tensor of shape "
                                       f"{_shape_str(first.shape)}, but another rank sent a tensor of shape "
                                       f"{_shape_str(other.shape)}.", first, other)
    if first.kind in REDUCTIONS:
        for other in requests[1:]:
            if other.op != first.op:
                return _mismatch(name, f"Mismatched reduction operation: One rank did a "
                                       f"{ops.OP_NAMES.get(first.op, first.op)} reduction, but another rank did a "
                                       f"{ops.OP_NAMES.get(other.op, other.op)} reduction.", first, other)
            if (other.prescale, other.postscale) != (first.prescale, first.postscale):
                return _mismatch(name, f"Mismatched prescale and/or postscale factors: One rank sent factors "
                                       f"({first.prescale}, {first.postscale}), but another rank sent factors "
                                       f"({other.prescale}, {other.postscale}).", first, other)
    if first.kind == ops.BROADCAST:
        for other in requests[1:]:
            if other.root != first.root:
                return _mismatch(name, f"Mismatched BROADCAST root ranks: One rank specified root rank {first.root}, "
                                       f"but another rank specified root rank {other.root}.", first, other)
    if first.kind in (ops.ALLGATHER, ops.ALLTOALL):
        if first.kind == ops.ALLGATHER:
            for req in requests:
                if len(req.shape) == 0:
                    return (f"Process-set rank {req.rank} tried to ALLGATHER a rank-zero tensor "
                            f"(tensor '{name}'); allgather needs at least one dimension.")
        for other in requests[1:]:
            if len(other.shape) != len(first.shape):
                return _mismatch(name, f"Mismatched {kind_name} tensor shapes: One rank sent a tensor of rank "
                                       f"{len(first.shape)}, but another rank sent a tensor of rank "
                                       f"{len(other.shape)}.", first, other)
            for dim in range(1, len(first.shape)):
                if other.shape[dim] != first.shape[dim]:
                    return _mismatch(name, f"Mismatched {kind_name} tensor shapes: One rank sent a tensor with "
                                           f"dimension {dim} equal to {first.shape[dim]}, but another rank sent a "
                                           f"tensor with dimension {dim} equal to {other.shape[dim]}.", first, other)
    if first.kind in (ops.ADD_PROCESS_SET, ops.REMOVE_PROCESS_SET):
        for other in requests[1:]:
            if other.payload != first.payload:
                verb = "add" if first.kind == ops.ADD_PROCESS_SET else "remove"
                return _mismatch(name, f"Mismatched {verb}_process_set calls: one rank asked for {first.payload}, "
                                       f"another for {other.payload}; every rank must make the same calls in the "
                                       f"same order.", first, other)
    if set(joined) and first.kind != ops.ALLREDUCE:
        label = {ops.ALLGATHER: "Allgather", ops.BROADCAST: "Broadcast", ops.ALLTOALL: "Alltoall",
                 ops.REDUCESCATTER: "Reducescatter"}.get(first.kind, kind_name)
        return (f"{label} is not supported with Join at this time (tensor '{name}': ranks "
                f"{sorted(set(joined))} have joined).")
    return None


def reduce_inline(requests: Sequence[Request], data: Sequence[Optional[Union[bytes, memoryview]]], set_size: int,
                  joined: bool = False) -> bytes:
    """Reduce small allreduce payloads on the coordinator: :func:`reduce_payloads` as bytes."""
    return reduce_payloads(requests, data, set_size, joined).tobytes()


def reduce_payloads(requests: Sequence[Request], data: Sequence[Optional[Union[bytes, memoryview]]], set_size: int,
                    joined: bool = False, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Reduce small allreduce payloads (on the coordinator, or every rank on the fast lane), with the same
    arithmetic as the transport path; returns ``out`` (flat, of the request's storage dtype; not for bfloat16)
    holding the result, or a new array.

    Ranks that joined sent nothing and contribute zeros, which leave a sum unchanged; Average still divides by
    the whole set's size.
    """
    first = requests[0]
    storage = ops.storage_dtype(first.dtype)
    op = ops.TRANSPORT_OP[first.op]
    total: Optional[np.ndarray] = None
    for raw_bytes in data:
        if raw_bytes is None:
            raise ValueError(f"a rank sent no inline data for tensor '{first.name}'")
        raw = np.frombuffer(raw_bytes, dtype=storage)
        if first.dtype == ops.BFLOAT16:
            value = np.empty(raw.size, dtype=np.float32)
            ops.bf16_to_f32(raw, value)
        elif total is None and out is not None:
            np.copyto(out, raw, casting="no")
            value = out
        elif total is None or first.prescale != 1.0:
            value = raw.copy()   # the payload is read-only (a message, or a peer's record on the lane)
        else:
            value = raw          # reduced straight from the payload
        if first.prescale != 1.0:
            ops.scale_inplace(value, first.prescale)
        if total is None:
            total = value
        else:
            reduce_into(total, value, op)
    if total is None:
        raise ValueError(f"no inline data to reduce for tensor '{first.name}'")
    if joined:
        # Joined ranks contribute zeros, exactly as the executor stages them on the transport path.
        reduce_into(total, np.zeros_like(total), op)
    ops.finish_reduction(total, first.op, first.postscale, set_size)
    if first.dtype == ops.BFLOAT16:
        out = np.empty(total.size, dtype=np.uint16)
        ops.f32_to_bf16(total, out)
        total = out
    return total


class Coordinator:
    """Decides readiness, validity and order of collectives for all process sets.

    Args:
        world_size: number of ranks in the job; process set 0 spans all of them.
    """

    def __init__(self, world_size: int, cache_capacity: int = 0):
        self.sets: Dict[int, ProcessSetState] = {0: ProcessSetState(0, tuple(range(world_size)))}
        # (set, name) -> the cached request objects of its last successful negotiation and, when it depends on
        # nothing else, the response it produced (see engine.cache).
        self._validated: "OrderedDict[Tuple[int, str], Tuple[List[Request], Optional[Response]]]" = OrderedDict()
        self._validated_capacity = max(0, cache_capacity)
        self._ready: List[Response] = []
        self._next_set_id = 1
        # name -> (error, ranks still expected to submit it, the names that failed together): a name used on two
        # process sets at once, or under two kinds, can never become ready; every rank that submits it gets the
        # error instead of waiting forever.
        self._conflicts: Dict[str, Tuple[str, Set[int], Tuple[str, ...]]] = {}
        # (set id, name without its kind prefix) seen pending under two kinds: checked by check_kind_conflicts()
        self._kind_suspects: Set[Tuple[int, str]] = set()
        # sets with a barrier pending and a blocking collective that arrived since: checked likewise
        self._barrier_suspects: Set[int] = set()
        self._group_sizes = GroupSizes()   # grouped calls whose ranks passed different counts

    # -- process sets ---------------------------------------------------------------------------------
    def register_set(self, set_id: int, ranks: Sequence[int]) -> None:
        self.sets[set_id] = ProcessSetState(set_id, tuple(sorted(ranks)))
        self._next_set_id = max(self._next_set_id, set_id + 1)

    # -- requests -------------------------------------------------------------------------------------
    def add(self, req: Request, now: Optional[float] = None, data: Optional[bytes] = None) -> None:
        """Record one rank's request; responses become available through :meth:`take_ready`.

        ``data``: the bytes of an inline allreduce when ``req`` is a cached template without them.
        """
        now = time.monotonic() if now is None else now
        if data is None:
            data = inline_data(req)
        pset = self.sets.get(req.process_set)
        if pset is None:
            self._ready.append(Response(ERROR, [req.name], req.process_set, error_kind="usage",
                                        error=f"Process set {req.process_set} is not registered on the "
                                              f"coordinator (tensor '{req.name}' from rank {req.rank}); register "
                                              f"it with hvd.add_process_set() on every rank first."))
            return
        if req.kind == ops.JOIN:
            pset.joined.add(req.rank)
            pset.last_joined = req.rank
            self._recheck(pset)
            if not pset.active:
                self._ready.append(Response(ops.JOIN, [req.name], pset.id, last_joined=pset.last_joined))
                pset.joined.clear()
                pset.last_joined = -1
            return
        if (self._conflicts and req.name in self._conflicts) or (
                len(self.sets) > 1 and self._conflicting_set(req) is not None):
            self._reject_conflict(req)
            return
        if req.group is not None:
            rejected = self._group_sizes.reject(pset, req)
            if rejected:
                self._ready.extend(rejected)
                return
        entry = pset.pending.get(req.name)
        if entry is None:
            entry = pset.pending[req.name] = _Pending(first_seen=now)
            if len(pset.pending) > 1:   # alone, it cannot clash (the common case: one blocking op at a time)
                kind, _, base = req.name.partition(".")
                if any(f"{other}.{base}" in pset.pending for other in _KIND_PREFIXES if other != kind):
                    self._kind_suspects.add((pset.id, base))
        if req.rank in entry.requests:
            # The enqueue-side check makes this unreachable for well-behaved ranks; say so rather than hang.
            self._ready.append(Response(ERROR, [req.name], pset.id, error_kind="usage",
                                        error=f"Rank {req.rank} submitted '{req.name}' twice before it completed; "
                                              f"wait for the first (synchronize) or use another name."))
            return
        entry.requests[req.rank] = req
        entry.data[req.rank] = data
        if req.kind == ops.BARRIER or (req.blocking and pset.barriers):
            if req.kind == ops.BARRIER:
                pset.barriers.add(req.name)
            self._barrier_suspects.add(pset.id)
        self._check(pset, req.name)

    def _conflicting_set(self, req: Request) -> Optional[ProcessSetState]:
        """A set where ``req.name`` is pending and that provably means the same collective.

        Disjoint sets may use the same name at once.  It is a conflict only when the submitter belongs to the other
        set, or someone who submitted there belongs to the submitter's set: one of them used the wrong set.
        """
        mine = self.sets[req.process_set]
        for other in self.sets.values():
            if other.id == req.process_set or req.name not in other.pending:
                continue
            if req.rank in other.ranks or any(r in mine.ranks for r in other.pending[req.name].requests):
                return other
        return None

    def _reject_conflict(self, req: Request) -> None:
        """Fail ``req.name`` on every set it was submitted to, and remember to fail late submitters too."""
        if req.name not in self._conflicts:
            other = self._conflicting_set(req)
            assert other is not None, "called only when a conflicting set was found"
            first = next(iter(other.pending[req.name].requests.values()))
            error = _mismatch(req.name, f"Mismatched process sets: One rank used process set {first.process_set}, "
                                        f"but another rank used process set {req.process_set}.", first, req)
            expected = set(other.ranks) | set(self.sets[req.process_set].ranks)
            for rank in other.pending.pop(req.name).requests:
                expected.discard(rank)
            self._conflicts[req.name] = (error, expected, (req.name,))
            self._ready.append(Response(ERROR, [req.name], other.id, error=error))
        error, expected, names = self._conflicts[req.name]
        expected.discard(req.rank)
        self._ready.append(Response(ERROR, [req.name], req.process_set, error=error))
        if not expected:
            for name in names:
                self._conflicts.pop(name, None)

    def check_kind_conflicts(self) -> None:
        """Fail names that ranks submitted under different kinds (``allreduce('x')`` here, ``allgather('x')``
        there), which can never become ready.

        Called once all control messages that arrived were recorded, so a rank's burst of asynchronous requests
        is seen whole: two kinds on one name are a mistake only when no rank submitted both of them. Every rank
        gets the error, naming which ranks did what; ranks that have not submitted yet get it when they do.
        """
        while self._barrier_suspects:
            self._check_barrier(self._barrier_suspects.pop())
        while self._kind_suspects:
            set_id, base = self._kind_suspects.pop()
            pset = self.sets.get(set_id)
            if pset is None:
                continue
            names = [f"{kind}.{base}" for kind in _KIND_PREFIXES if f"{kind}.{base}" in pset.pending]
            submitters = [set(pset.pending[name].requests) for name in names]
            if len(names) < 2 or any(a & b for i, a in enumerate(submitters) for b in submitters[i + 1:]):
                continue
            what = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} "
                             f"called {name.partition('.')[0]}" for name, ranks in zip(names, submitters))
            error = (f"Mismatched operations on tensor name '{base}': {what}. Every rank must call the same "
                     f"collective for a name; check the code path each rank takes.")
            expected = set(pset.active).difference(*submitters)
            for name in names:
                del pset.pending[name]
                self._ready.append(Response(ERROR, [name], set_id, error=error))
                if expected:
                    self._conflicts[name] = (error, expected, tuple(names))

    def _check_barrier(self, set_id: int) -> None:
        """Fail a barrier that some ranks wait in while others wait in a collective those ranks never issued
        (``allreduce(x, name='x')`` here, ``barrier()`` there): neither can ever complete. Every rank gets the
        error naming who did what; ranks that have not submitted yet get it when they do."""
        pset = self.sets.get(set_id)
        if pset is None:
            return
        for barrier in [b for b in pset.barriers if b in pset.pending]:
            in_barrier = set(pset.pending[barrier].requests)
            for name, entry in list(pset.pending.items()):
                if name in pset.barriers or name not in pset.pending:
                    continue
                blocked = sorted(r for r, req in entry.requests.items() if req.blocking and r not in in_barrier)
                absent = sorted(in_barrier - set(entry.requests))
                if not blocked or not absent:
                    continue
                kind = ops.KIND_NAMES.get(next(iter(entry.requests.values())).kind, "collective").lower()
                error = (f"Mismatched operations: rank{'s' if len(blocked) > 1 else ''} "
                         f"{', '.join(map(str, blocked))} called {kind} on tensor '{name}', but rank"
                         f"{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} called barrier "
                         f"('{barrier}') instead; every rank must call the same collectives in the same order.")
                names = (name, barrier)
                submitters = set(entry.requests) | in_barrier
                expected = set(pset.active) - submitters
                for failed in names:
                    del pset.pending[failed]
                    self._ready.append(Response(ERROR, [failed], set_id, error=error))
                    if expected:
                        self._conflicts[failed] = (error, expected, names)
                pset.barriers.discard(barrier)
                break
        pset.barriers.intersection_update(pset.pending)

    def _recheck(self, pset: ProcessSetState) -> None:
        for name in list(pset.pending):
            self._check(pset, name)

    def _check(self, pset: ProcessSetState, name: str) -> None:
        entry = pset.pending.get(name)
        if entry is None or not entry.requests:
            return
        # Requests come only from members, so counting is enough unless some have joined.
        if len(entry.requests) < pset.active_count or (pset.joined and not pset.active.issubset(entry.requests)):
            return
        del pset.pending[name]
        response = self._respond(pset, name, entry)
        group = next(iter(entry.requests.values())).group
        if group is None:
            self._ready.append(response)
            return
        gid, gsize = group
        members = pset.groups.setdefault(gid, [])
        members.append(response)
        if len(members) == gsize:
            del pset.groups[gid]
            self._ready.extend(members)

    def _respond(self, pset: ProcessSetState, name: str, entry: _Pending) -> Response:
        ranks = sorted(entry.requests)
        requests = [entry.requests[r] for r in ranks]
        joined = tuple(sorted(pset.joined))
        key = (pset.id, name)
        known = self._validated.get(key) if self._validated_capacity and not joined else None
        seen = known is not None and len(known[0]) == len(requests) and all(map(operator.is_, known[0], requests))
        if seen and known is not None and known[1] is not None:
            return known[1]   # the outcome of the same requests last time (responses are never mutated)
        if not seen:
            error = validate(name, requests, joined)
            if error is not None:
                return Response(ERROR, [name], pset.id, error=error)
        resp = self._build(pset, name, entry, ranks, requests, joined)
        if not seen and not joined and resp.kind != ERROR:
            reusable = resp.payload is None and resp.kind not in (ops.ADD_PROCESS_SET, ops.REMOVE_PROCESS_SET)
            self._remember_valid(key, requests, resp if reusable else None)
        return resp

    def _build(self, pset: ProcessSetState, name: str, entry: _Pending, ranks: List[int],
               requests: List[Request], joined: Tuple[int, ...]) -> Response:
        first = requests[0]
        if first.kind == ops.BROADCAST and first.root not in pset.ranks:
            return Response(ERROR, [name], pset.id,
                            error=f"broadcast root_rank {first.root} is invalid: every rank passed it, but it is not "
                                  f"a rank of the process set {list(pset.ranks)} (tensor '{name}').")
        resp = Response(first.kind, [name], pset.id, dtype=first.dtype, op=first.op, root=first.root,
                        prescale=first.prescale, postscale=first.postscale, shapes=[tuple(first.shape)],
                        joined=joined, group=first.group[0] if first.group else None, device=first.device)
        data = [entry.data[r] for r in ranks]
        if first.kind == ops.ALLREDUCE and all(d is not None for d in data):
            resp.payload = reduce_inline(requests, data, len(pset.ranks), bool(joined))
        elif first.kind == ops.ALLGATHER:
            resp.first_dims = [[entry.requests[r].shape[0] for r in pset.ranks]]
        elif first.kind == ops.ALLTOALL:
            resp.splits = [[list(entry.requests[r].splits or ()) for r in pset.ranks]]
            resp.shapes = [tuple(entry.requests[r].shape) for r in pset.ranks][:1]
        elif first.kind == ops.ADD_PROCESS_SET:
            new_ranks = tuple(sorted(cast(Sequence[int], first.payload)))
            duplicate = [s.id for s in self.sets.values() if s.ranks == new_ranks]
            if duplicate:
                return Response(ERROR, [name], pset.id,
                                error=f"A process set with ranks {list(new_ranks)} is already registered "
                                      f"(id {duplicate[0]}).")
            set_id = self._next_set_id
            self.register_set(set_id, new_ranks)
            resp.payload = (set_id, new_ranks)
        elif first.kind == ops.REMOVE_PROCESS_SET:
            removed = self.sets.pop(cast(int, first.payload), None)
            resp.payload = (first.payload, removed is not None)
        return resp

    def _remember_valid(self, key: Tuple[int, str], requests: List[Request], response: Optional[Response]) -> None:
        """Remember that exactly these cached request objects were negotiated together successfully."""
        if any(r.slot < 0 for r in requests):
            return
        self._validated[key] = (requests, response)
        self._validated.move_to_end(key)
        if len(self._validated) > self._validated_capacity:
            self._validated.popitem(last=False)

    def has_ready(self) -> bool:
        return bool(self._ready)

    def take_ready(self) -> List[Response]:
        """Responses that became ready since the last call, in execution order."""
        ready, self._ready = self._ready, []
        return ready

    # -- stall inspection -----------------------------------------------------------------------------
    def stalled(self, now: float, older_than: float) -> List[Tuple[int, str, List[int], float]]:
        """``(set id, name, missing ranks, seconds waited)`` for every tensor pending longer than ``older_than``."""
        out = []
        for pset in self.sets.values():
            for name, entry in pset.pending.items():
                age = now - entry.first_seen
                if age >= older_than:
                    missing = sorted(pset.active - set(entry.requests))
                    out.append((pset.id, name, missing, age))
        return out

    def fail_stalled(self, now: float, older_than: float, reason: str) -> None:
        """Turn tensors pending longer than ``older_than`` into ERROR responses."""
        for set_id, name, missing, age in self.stalled(now, older_than):
            pset = self.sets[set_id]
            pset.pending.pop(name, None)
            self._ready.append(Response(ERROR, [name], set_id, error_kind="stall",
                                        error=f"{reason}: '{name}' waited {age:.0f} s for ranks {missing}."))
