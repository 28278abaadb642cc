"""The transport conformance cases, one per collective, for any transport (a helper module, not a test).

A case runs inside every rank of a job on one open transport (one :class:`transport_data.Variant`): it builds
every rank's input with :func:`transport_data.data`, so each rank computes the expected result of the whole job
with numpy (:func:`transport_data.fold`), calls the transport and records each comparison in its case's
:class:`checks.Checks`.  :func:`transport_job` opens every variant of a transport in turn and runs the requested
cases on each, so one job per (transport, np) checks everything and each case is still a test of its own.

What differs between transports on purpose is listed in :data:`TRAITS` and checked where it applies.
"""
from __future__ import annotations

import importlib
import itertools
import sys
import threading
import time
import warnings
import zlib
from typing import Callable, Dict, List, Sequence

import cloudpickle
import numpy as np

from checks import Checks
from transport_data import (MOVE_DTYPES, VARIANTS, Variant, a2a_counts, data, digest, even_split, fold,
                            ragged_counts)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# shm reduces in rank order (results are bitwise a numpy fold in rank order); shm and mpi cache their subgroups;
# shm and hierarchical return themselves for the whole group; shm's group of one is a LocalTransport; mpi refuses
# a collective after close() even on one rank.
TRAITS: Dict[str, set] = {
    "tcp": set(),
    "shm": {"rank_order", "caches_subgroups", "whole_group_is_self", "singleton_is_local"},
    "mpi": {"caches_subgroups", "closed_single_rank_raises"},
    "hierarchical": {"whole_group_is_self"},
}
P2P_BIG = (5 << 20) + 3
SUBGROUP_SIZES = (0, 7, 3001)   # run on the first (tiny-threshold) variant: 3001 crosses its switch points


class Ctx:
    """What a case works with: the open transport, its variant, this case's checks.

    The ``check_*`` methods run one collective on ``on = (group, members)`` (default: the transport and the world;
    ``members[i]`` is the world rank of group rank i, whose data the group rank holds) and compare with numpy.
    """

    def __init__(self, t, variant: Variant, transport: str, checks: Checks, agree: Dict[str, str]) -> None:
        self.t, self.v, self.transport, self.c, self.agree = t, variant, transport, checks, agree
        self.rank, self.size = t.rank, t.size
        self.world = (t, list(range(t.size)))
        self.traits = TRAITS[transport]
        self.moved = [d for d in variant.dtypes if d in MOVE_DTYPES] or list(variant.dtypes)

    def call(self, what: str, fn: Callable, *args) -> bool:
        """``fn(*args)``; an exception is a failed check (the other ranks make the same call, so the job goes on)."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001  (recorded, not hidden)
            self.c.error(f"{self.v.label} {what}", exc)
            return False

    def expect(self, what: str, fn: Callable, args: tuple, got: np.ndarray, want: np.ndarray) -> None:
        """Run the collective ``fn(*args)``, then compare ``got`` (its output buffer) with ``want``."""
        if self.call(what, fn, *args):
            self.c.equal(got, want, f"{self.v.label} {what}")

    def check_allreduce(self, key: tuple, n: int, dtype: str, op: str, on=None, into=False, what="") -> None:
        """In place, or ``into`` a new buffer from the read-only input (a write to it would raise)."""
        g, members = on or self.world
        want = fold([data(key, w, n, dtype, op) for w in members], op)
        mine = data(key, self.rank, n, dtype, op)
        out = np.empty(n, dtype) if into else mine.copy()
        self.expect(f"{what}allreduce{' into a new buffer' if into else ''} {op} {dtype} n={n}",
                    g.allreduce_into if into else g.allreduce, (mine, out, op) if into else (out, op), out, want)

    def check_allgatherv(self, key: tuple, counts: List[int], dtype: str, on=None, slack=0, what="") -> None:
        """Into a buffer ``slack`` elements longer than needed, whose tail must stay untouched."""
        g, members = on or self.world
        recv = np.zeros(sum(counts) + slack, dtype)
        want = np.concatenate([data(key, w, counts[k], dtype) for k, w in enumerate(members)] + [recv[:slack]])
        self.expect(f"{what}allgatherv {dtype} counts={counts}", g.allgatherv,
                    (data(key, self.rank, counts[g.rank], dtype), recv, counts), recv, want)

    def check_broadcast(self, key: tuple, n: int, dtype: str, root: int, on=None, what="") -> None:
        g, members = on or self.world
        buf = data(key, self.rank, n, dtype).copy()   # every rank starts from its own data
        self.expect(f"{what}broadcast {dtype} n={n} root={root}", g.broadcast, (buf, root), buf,
                    data(key, members[root], n, dtype))

    def check_alltoallv(self, key: tuple, c: List[List[int]], dtype: str, on=None, what="") -> None:
        """``c[i][j]``: elements group rank i sends to group rank j."""
        g, members = on or self.world
        r = g.rank
        sends = [data(key, w, sum(c[k]), dtype) for k, w in enumerate(members)]
        recv = np.zeros(sum(row[r] for row in c), dtype)
        want = np.concatenate([sends[q][sum(c[q][:r]):sum(c[q][:r + 1])] for q in range(g.size)])
        self.expect(f"{what}alltoallv {dtype} send counts={c[r]}", g.alltoallv,
                    (sends[r], c[r], recv, [row[r] for row in c]), recv, want)

    def check_reducescatter(self, key: tuple, counts: List[int], dtype: str, op: str, on=None, what="") -> None:
        """From a read-only input."""
        g, members = on or self.world
        lo, mine = sum(counts[:g.rank]), counts[g.rank]
        sends = [data(key, w, sum(counts), dtype, op) for w in members]
        recv = np.zeros(mine, dtype)
        self.expect(f"{what}reducescatter {op} {dtype} counts={counts}", g.reducescatter,
                    (sends[g.rank], recv, counts, op), recv, fold([s[lo:lo + mine] for s in sends], op))

    def check_sendrecv(self, key: tuple, n: int, dtype: str, dest, source, on=None, what="") -> None:
        """Send to ``dest`` while receiving from ``source`` (group ranks; either may be None)."""
        g, members = on or self.world
        send = None if dest is None else data(key, self.rank, n, dtype)
        what = f"{what}sendrecv {dtype} n={n} to {dest} from {source}"
        if source is None:
            self.call(what, g.sendrecv, send, dest, None, None)
        else:
            recv = np.zeros(n, dtype)
            self.expect(what, g.sendrecv, (send, dest, recv, source), recv, data(key, members[source], n, dtype))

    def still_works(self, what: str) -> None:
        """One small allreduce: the transport is still in step after ``what``."""
        buf = np.full(2, self.rank, np.int64)
        self.expect(f"allreduce after {what}", self.t.allreduce, (buf, "sum"), buf,
                    np.full(2, sum(range(self.size)), np.int64))


# -- the cases ---------------------------------------------------------------------------------------------------

def allreduce(x: Ctx) -> None:
    """Every op x dtype (ops at one size, see ``Variant.ops_at``) x size in place; sums also into a new buffer."""
    for dtype in x.v.dtypes:
        for n in x.v.sizes_of(dtype):
            for op in x.v.ops_at(n):
                x.check_allreduce(("allreduce", op), n, dtype, op)
            x.check_allreduce(("allreduce", "sum"), n, dtype, "sum", into=True)


def allreduce_finish(x: Ctx) -> None:
    """Average's path: a finish (postscale, then the division) applied while the result is written gives the same
    bits as finishing the whole reduced buffer afterwards, into a new buffer and in place."""
    from horovod.engine import ops

    for dtype in (d for d in x.v.dtypes if d in ("float32", "float64", "float16", "int32", "int64")):
        for n, (post, in_place) in itertools.product(x.v.sizes_of(dtype), ((1.0, False), (1.0, True), (0.5, False))):
            what = f"allreduce_into + finish(postscale={post}){' in place' if in_place else ''} {dtype} n={n}"
            finish = ops.Finish(post, x.size)
            want = fold([data(("finish",), q, n, dtype) for q in range(x.size)], "sum")
            finish(want)
            mine = data(("finish",), x.rank, n, dtype)
            out = mine.copy() if in_place else np.empty(n, dtype)
            x.expect(what, x.t.allreduce_into, (out if in_place else mine, out, "sum", finish), out, want)


def allreduce_rounding(x: Ctx) -> None:
    """Non-integer floats: within rounding of a float64 sum, bitwise the same on every rank (and, where the
    transport promises rank order, bitwise a numpy fold in rank order)."""
    tol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}
    for dtype in (d for d in x.v.dtypes if d in tol):
        for n in x.v.sizes_of(dtype):
            inputs = [data(("rounding",), q, n, dtype, kind="normal") for q in range(x.size)]
            what = f"{x.v.label} allreduce sum of non-integer {dtype} n={n}"
            buf = inputs[x.rank].copy()
            if not x.call(what, x.t.allreduce, buf, "sum"):
                continue
            exact = np.sum([a.astype(np.float64) for a in inputs], axis=0).astype(dtype)
            x.c.close(buf, exact, what, rtol=tol[dtype] * x.size, atol=tol[dtype] * x.size)
            if "rank_order" in x.traits:
                x.c.equal(buf, fold(inputs, "sum"), f"{what}: a numpy fold in rank order")
            x.agree[what] = digest(buf)


def float16_overflow(x: Ctx) -> None:
    """float16 sums past 65504 are inf, float16's defined result, without a RuntimeWarning to the user."""
    if "float16" not in x.v.dtypes:
        return
    for n in (3, 300_000):   # both paths of every transport at its default options
        buf = np.full(n, 6e4, np.float16)
        what = f"float16 overflow n={n}"
        with warnings.catch_warnings(record=True) as caught:   # recorded, not raised: the collective completes
            warnings.simplefilter("always")
            x.expect(what, x.t.allreduce, (buf, "sum"), buf, np.full(n, 6e4 if x.size == 1 else np.inf, np.float16))
        x.c.true(not caught, f"{x.v.label} {what}: warned {[str(w.message) for w in caught][:3]}")


def allgatherv(x: Ctx) -> None:
    """Ragged counts (growing, one rank only, some empty) into a longer buffer whose tail stays untouched."""
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            for counts in ragged_counts(n, x.size):
                x.check_allgatherv(("allgatherv", n), counts, dtype, slack=3)


def broadcast(x: Ctx) -> None:
    """Every root (for one dtype; the others from a rotating root) x dtype x size."""
    for i, dtype in enumerate(x.moved):
        for j, n in enumerate(x.v.sizes_of(dtype)):
            for root in range(x.size) if i == 0 else [(i + j) % x.size]:
                x.check_broadcast(("broadcast",), n, dtype, root)


def alltoallv(x: Ctx) -> None:
    """Splits with empty, uneven and full blocks, and a random split matrix."""
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            random_split = np.random.default_rng([n, x.size]).integers(0, n + 1, (x.size, x.size)).tolist()
            for which, c in enumerate((a2a_counts(n, x.size), random_split)):
                x.check_alltoallv(("alltoallv", which), c, dtype)


def reducescatter(x: Ctx) -> None:
    """Every op x dtype (ops at one size, see ``Variant.ops_at``) x size in even blocks; ragged blocks (one rank
    only, some empty) with sum."""
    for dtype in x.v.dtypes:
        for n in x.v.sizes_of(dtype):
            for op in x.v.ops_at(n):
                x.check_reducescatter(("reducescatter", op, n), even_split(n, x.size), dtype, op)
            for counts in ragged_counts(n, x.size)[1:]:
                x.check_reducescatter(("reducescatter", "sum", n), counts, dtype, "sum")


def sendrecv(x: Ctx) -> None:
    """A ring (to itself on one rank), pairs (the odd rank out passes None), one-way (only two ranks take part); with
    default options, one ring of 5 MiB too (past shm's 4 MiB socket writes)."""
    r, size = x.rank, x.size
    right, left = (r + 1) % size, (r - 1) % size
    if x.v.big_bytes >= 1 << 20:
        x.check_sendrecv(("ring",), P2P_BIG, "uint8", right, left)
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            x.check_sendrecv(("ring",), n, dtype, right, left, what="ring ")
            partner = r ^ 1 if r ^ 1 < size else None
            x.check_sendrecv(("pair",), n, dtype, partner, partner, what="pair ")
            if size > 1 and r in (0, size - 1):
                x.check_sendrecv(("one-way",), n, dtype, size - 1 if r == 0 else None, 0 if r else None,
                                 what="one-way ")


def barrier(x: Ctx) -> None:
    """No rank leaves a barrier before the last one entered it (one clock: the ranks share this machine)."""
    for _ in range(3):
        if x.rank == x.size - 1:
            time.sleep(0.05)
        entered = time.monotonic()
        x.call("barrier", x.t.barrier)
        times = np.zeros(2 * x.size, np.float64)
        x.call("allgatherv of barrier times", x.t.allgatherv, np.array([entered, time.monotonic()]), times,
               [2] * x.size)
        x.c.true(times[1::2].min() >= times[0::2].max(),
                 f"{x.v.label} barrier: a rank left at {times[1::2].min():.4f} before the last entered at "
                 f"{times[0::2].max():.4f}")
    for _ in range(50):
        x.call("50 barriers in a row", x.t.barrier)


def _group_battery(x: Ctx, g, members: List[int], label: str, sizes: Sequence[int]) -> None:
    """One of each collective on group ``g``, whose rank i is world rank ``members[i]``."""
    s, me, on, what = g.size, g.rank, (g, members), label + " "
    x.c.true((me, s) == (members.index(x.rank), len(members)), f"{label}: rank/size {me}/{s}, members {members}")
    for n in sizes:
        x.check_allreduce(("g-ar",), n, "float32", "sum", on, what=what)
        x.check_allgatherv(("g-ag",), [n + 11 * k for k in range(s)], "int64", on, what=what)
        x.check_broadcast(("g-bc",), n, "uint8", s - 1, on, what=what)
        x.check_alltoallv(("g-a2a",), [[n] * s] * s, "float64", on, what=what)
        x.check_reducescatter(("g-rs",), [n] * s, "int32", "max", on, what=what)
        x.check_sendrecv(("g-sr",), n, "int16", (me + 1) % s, (me - 1) % s, on, what=what)
        x.call(f"{label} barrier", g.barrier)


def subgroups(x: Ctx) -> None:
    """Every subset of the world (one global order), nested groups, world collectives in between (non-members go on
    while members are inside), twice (the second time from the cache where there is one), and the argument checks."""
    from horovod.transport.base import LocalTransport

    t, size = x.t, x.size
    subsets = [list(s) for k in range(1, size + 1) for s in itertools.combinations(range(size), k)]
    for attempt in range(2):
        sizes = SUBGROUP_SIZES if attempt == 0 else (7,)
        for members in subsets:
            if x.rank in members:
                label = f"subgroup{members}" + (" again" if attempt else "")
                g = t.subgroup(members)
                if "caches_subgroups" in x.traits and len(members) > 1:
                    x.c.true(t.subgroup(members) is g, f"{label}: not cached")
                if len(members) == size > 1 and "whole_group_is_self" in x.traits:
                    x.c.true(g is t, f"{label}: the whole group is not the transport itself")
                if len(members) == 1 and "singleton_is_local" in x.traits:
                    x.c.true(isinstance(g, LocalTransport), f"{label}: a group of one is a {type(g).__name__}")
                _group_battery(x, g, members, label, sizes)
                if len(members) > 2 and g.rank in (0, len(members) - 1):   # ranks relative to the subgroup
                    _group_battery(x, g.subgroup([0, len(members) - 1]), [members[0], members[-1]],
                                   f"{label}/nested", sizes)
            x.still_works(f"subgroup{members}")
    if size > 1:
        x.c.raises(f"{x.v.label} subgroup without this rank", ValueError, t.subgroup, [(x.rank + 1) % size])
    x.c.raises(f"{x.v.label} subgroup beyond the group", ValueError, t.subgroup, [x.rank, size])


def random_program(x: Ctx) -> None:
    """The same random sequence of collectives, dtypes and sizes on every rank."""
    rng = np.random.default_rng([zlib.crc32(x.v.label.encode()), x.size])   # the same program on every rank
    for i in range(80):
        kind, dtype = int(rng.integers(0, 4)), x.v.dtypes[int(rng.integers(0, len(x.v.dtypes)))]
        n, key, what = int(rng.choice([0, 1, 5, 100, 1000, 5000])), ("random", i), f"#{i} "
        counts = [int(c) for c in rng.integers(0, n + 1, x.size)]
        pick = int(rng.integers(0, 1 << 30))
        if kind == 0:
            op = x.v.ops[pick % len(x.v.ops)]
            x.check_allreduce(key, n, dtype, op, what=what)
        elif kind == 1:
            x.check_broadcast(key, n, dtype, pick % x.size, what=what)
        elif kind == 2:
            x.check_allgatherv(key, counts, dtype, what=what)
        else:
            x.check_reducescatter(key, counts, dtype, "max", what=what)
        if rng.random() < 0.1:
            x.call(f"#{i} barrier", x.t.barrier)


def background_thread(x: Ctx) -> None:
    """Collectives from a thread that is not the main one (the engine's background thread calls the transport)."""
    def work() -> None:
        for dtype in (d for d in x.v.dtypes if d in ("float32", "int64", "float16", "bool", "int8")):
            for n in x.v.sizes_of(dtype):
                x.check_allreduce(("thread",), n, dtype, "max", what="thread: ")
                x.check_broadcast(("thread",), n, dtype, 0, what="thread: ")

    th = threading.Thread(target=work, name="like-the-engine-background-thread")
    th.start()
    th.join(timeout=240)
    x.c.true(not th.is_alive(), f"{x.v.label} thread: did not finish within 240 s")


def unsupported_op(x: Ctx) -> None:
    """An op outside sum/min/max/product (Average is the engine's job) is refused with ValueError, on every rank alike
    and before anything is sent: the transport stays usable.  (On a transport of its own with a short timeout.)"""
    x.c.raises(f"{x.v.label} allreduce with op 'average'", ValueError, x.t.allreduce, np.ones(4, np.float32),
               "average")
    x.still_works("the refused op")


def argument_errors(x: Ctx) -> None:
    """A too short output buffer is refused with ValueError on every rank before anything is sent, so the transport
    stays usable.  (On a transport of its own with a short timeout.)"""
    x.c.raises(f"{x.v.label} allgatherv into a too short buffer", ValueError, x.t.allgatherv, np.ones(5),
               np.zeros(5 * x.size - 1), [5] * x.size)
    x.still_works("the refused call")


def lifecycle(x: Ctx) -> None:
    """close() is idempotent, on a subgroup and on the transport, and a collective afterwards raises TransportError
    (a group of one has nothing to communicate, so only mpi checks there).  Run last: it closes the transport."""
    from horovod.transport.base import TransportError

    if x.size > 1 and x.rank < 2:
        g = x.t.subgroup([0, 1])
        x.call("subgroup barrier", g.barrier)
        x.call("subgroup close", g.close)
        x.call("subgroup close again", g.close)
        x.c.raises(f"{x.v.label} subgroup barrier after its close", TransportError, g.barrier, match="close")
    for what in ("close", "close again"):
        try:
            x.t.close()
            x.c.add(None)
        except Exception as exc:  # noqa: BLE001  (recorded)
            x.c.error(f"{x.v.label} {what}", exc)
    if x.size > 1 or "closed_single_rank_raises" in x.traits:
        x.c.raises(f"{x.v.label} allreduce after close", TransportError, x.t.allreduce, np.ones(3), match="close")
        x.c.raises(f"{x.v.label} barrier after close", TransportError, x.t.barrier, match="close")


# Catalogue order is run order; lifecycle closes the transport, so it comes last.
CASES: Dict[str, Callable[[Ctx], None]] = {f.__name__: f for f in (
    allreduce, allreduce_finish, allreduce_rounding, float16_overflow, allgatherv, broadcast, alltoallv,
    reducescatter, sendrecv, barrier, subgroups, random_program, background_thread, unsupported_op, argument_errors,
    lifecycle)}
# Independent of the options, so run on the first variant only; the others run on every variant.
FIRST_VARIANT_ONLY = {"subgroups", "barrier", "unsupported_op", "argument_errors"}
# Cases that may leave the transport unusable when they find a bug: each gets a transport of its own whose short
# timeout bounds the cost of a desynchronised collective.
OWN_TRANSPORT = {"unsupported_op": 2.0, "argument_errors": 2.0}


def open_variant(transport: str, v: Variant, scope: str = "", timeout: float = 60.0):
    """Inside a rank: connect ``transport`` with ``v``'s options (mpi: on COMM_WORLD; hierarchical: on fake hosts)."""
    from horovod.transport.base import REGISTRY, Bootstrap
    from multiproc import bootstrap, rank_and_size

    importlib.import_module(f"horovod.transport.{transport}")   # registers the factory
    if transport == "mpi":
        boot = Bootstrap(*rank_and_size(), options=v.options)
    else:
        boot = bootstrap(v.label + scope, v.options, timeout=timeout)
        if v.hosts is not None:
            boot.hostname = v.hosts(boot.size)[boot.rank]
    return REGISTRY[transport](boot)


def transport_job(transport: str, names: Sequence[str]) -> Dict[str, dict]:
    """One rank of a (transport, np) job: every variant, the cases ``names`` on each; one report per case."""
    from horovod.transport.base import TransportError
    from multiproc import rank_and_size

    rank, _ = rank_and_size()
    checks = {name: Checks(rank) for name in names}
    agree: Dict[str, Dict[str, str]] = {name: {} for name in names}
    seconds = dict.fromkeys(names, 0.0)   # per case, all variants: where a job's time goes
    for index, v in enumerate(VARIANTS[transport]):
        if v.hosts is not None and v.hosts(rank_and_size()[1]) is None:
            continue
        try:
            t = open_variant(transport, v)
        except TransportError as exc:
            if not v.may_refuse:
                raise
            for name in names:   # refused before any collective, on every rank alike: nothing to run
                checks[name].true("refused" in str(exc) or "cannot" in str(exc), f"{v.label} refused unclearly: {exc}")
            continue
        try:
            for name in names:
                start = time.monotonic()
                if (index > 0 and name in FIRST_VARIANT_ONLY) or (v.cases is not None and name not in v.cases):
                    continue
                if name in OWN_TRANSPORT:
                    own = open_variant(transport, v, "-" + name, OWN_TRANSPORT[name])
                    try:
                        CASES[name](Ctx(own, v, transport, checks[name], agree[name]))
                    finally:
                        own.close()
                else:
                    CASES[name](Ctx(t, v, transport, checks[name], agree[name]))
                seconds[name] += time.monotonic() - start
        finally:
            t.close()
    return {name: dict(checks[name].report(), agree=agree[name], seconds=seconds[name]) for name in names}
