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
    """What a case works with: the open transport, its variant, this case's checks."""

    def __init__(self, t, variant: Variant, transport: str, checks: Checks, agree: Dict[str, str]) -> None:
        self.t, self.v, self.transport, self.c, self.agree = t, variant, transport, checks, agree
        self.rank, self.size = t.rank, t.size
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

    def reduced(self, key: tuple, n: int, dtype: str, op: str, members: Sequence[int]) -> np.ndarray:
        return fold([data(key, w, n, dtype, op) for w in members], op)


# -- the cases ---------------------------------------------------------------------------------------------------

def allreduce(x: Ctx) -> None:
    """Every op x dtype x size in place; sums also into a new buffer (the input is read-only: a write would raise)."""
    world = range(x.size)
    for dtype, op in itertools.product(x.v.dtypes, x.v.ops):
        for n in x.v.sizes_of(dtype):
            key, what = ("allreduce", op), f"allreduce {op} {dtype} n={n}"
            want = x.reduced(key, n, dtype, op, world)
            buf = data(key, x.rank, n, dtype, op).copy()
            x.expect(what, x.t.allreduce, (buf, op), buf, want)
            if op == "sum":
                out = np.empty(n, dtype)
                x.expect(f"{what} into a new buffer", x.t.allreduce_into, (data(key, x.rank, n, dtype, op), out, op),
                         out, want)


def allreduce_finish(x: Ctx) -> None:
    """Average's path: a finish (postscale, then the division) applied while the result is written gives the same
    bits as finishing the whole reduced buffer afterwards, in place and into a new buffer."""
    from horovod.engine import ops

    for dtype in (d for d in x.v.dtypes if d in ("float32", "float64", "float16", "int32", "int64")):
        for n, post in itertools.product(x.v.sizes_of(dtype), (1.0, 0.5)):
            key, what = ("finish",), f"allreduce_into + finish(postscale={post}) {dtype} n={n}"
            finish = ops.Finish(post, x.size)
            want = x.reduced(key, n, dtype, "sum", range(x.size))
            finish(want)
            out = np.empty(n, dtype)
            x.expect(what, x.t.allreduce_into, (data(key, x.rank, n, dtype), out, "sum", finish), out, want)
            buf = data(key, x.rank, n, dtype).copy()
            x.expect(f"{what} in place", x.t.allreduce_into, (buf, buf, "sum", finish), buf, want)


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
    """Ragged counts (equal, growing, one rank only, some empty) into a longer buffer whose tail stays untouched."""
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            for counts in ragged_counts(n, x.size):
                total, key = sum(counts), ("allgatherv", n)
                recv = np.zeros(total + 3, dtype)
                want = np.concatenate([data(key, q, counts[q], dtype) for q in range(x.size)] +
                                      [np.zeros(3, dtype)])
                x.expect(f"allgatherv {dtype} counts={counts}", x.t.allgatherv,
                         (data(key, x.rank, counts[x.rank], dtype), recv, counts), recv, want)


def broadcast(x: Ctx) -> None:
    """Every root (for one dtype; the others from a rotating root) x dtype x size; each rank starts from its own
    data."""
    for i, dtype in enumerate(x.moved):
        for j, n in enumerate(x.v.sizes_of(dtype)):
            for root in range(x.size) if i == 0 else [(i + j) % x.size]:
                buf = data(("broadcast",), x.rank, n, dtype).copy()
                x.expect(f"broadcast {dtype} n={n} root={root}", x.t.broadcast, (buf, root), buf,
                         data(("broadcast",), root, n, dtype))


def alltoallv(x: Ctx) -> None:
    """Splits with empty, uneven and full blocks, and a random split matrix."""
    r, size = x.rank, x.size
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            rng = np.random.default_rng([n, size])
            for which, c in enumerate((a2a_counts(n, size), rng.integers(0, n + 1, (size, size)).tolist())):
                sends = [data(("alltoallv", which), q, sum(c[q]), dtype) for q in range(size)]
                recv = np.zeros(sum(c[q][r] for q in range(size)), dtype)
                want = np.concatenate([sends[q][sum(c[q][:r]):sum(c[q][:r + 1])] for q in range(size)])
                x.expect(f"alltoallv {dtype} send counts={c[r]}", x.t.alltoallv,
                         (sends[r], c[r], recv, [c[q][r] for q in range(size)]), recv, want)


def reducescatter(x: Ctx) -> None:
    """Every op x dtype x size in even blocks; ragged blocks (one rank only, some empty) with sum.  The input is
    read-only."""
    r = x.rank
    for dtype, op in itertools.product(x.v.dtypes, x.v.ops):
        for n in x.v.sizes_of(dtype):
            for counts in [even_split(n, x.size)] + (ragged_counts(n, x.size)[1:] if op == "sum" else []):
                key, lo = ("reducescatter", op, n), sum(counts[:r])
                sends = [data(key, q, sum(counts), dtype, op) for q in range(x.size)]
                recv = np.zeros(counts[r], dtype)
                x.expect(f"reducescatter {op} {dtype} counts={counts}", x.t.reducescatter,
                         (sends[r], recv, counts, op), recv, fold([s[lo:lo + counts[r]] for s in sends], op))


def sendrecv(x: Ctx) -> None:
    """A ring (to itself on one rank), pairs (the odd rank out passes None), one-way (only two ranks take part); with
    default options, one ring of 5 MiB too (past shm's 4 MiB socket writes)."""
    r, size = x.rank, x.size
    if x.v.big_bytes >= 1 << 20:
        recv = np.zeros(P2P_BIG, np.uint8)
        x.expect(f"sendrecv ring of {P2P_BIG} bytes", x.t.sendrecv, (data(("ring",), r, P2P_BIG, "uint8"),
                 (r + 1) % size, recv, (r - 1) % size), recv, data(("ring",), (r - 1) % size, P2P_BIG, "uint8"))
    for dtype in x.moved:
        for n in x.v.sizes_of(dtype):
            right, left = (r + 1) % size, (r - 1) % size
            recv = np.zeros(n, dtype)
            x.expect(f"sendrecv ring {dtype} n={n}", x.t.sendrecv, (data(("ring",), r, n, dtype), right, recv, left),
                     recv, data(("ring",), left, n, dtype))
            partner = r ^ 1
            if partner < size:
                recv = np.zeros(n, dtype)
                x.expect(f"sendrecv pair {dtype} n={n}", x.t.sendrecv, (data(("pair",), r, n, dtype), partner, recv,
                         partner), recv, data(("pair",), partner, n, dtype))
            else:
                x.call("sendrecv with nothing to do", x.t.sendrecv, None, None, None, None)
            if size > 1 and r == 0:
                x.call(f"send only {dtype} n={n}", x.t.sendrecv, data(("one-way",), 0, n, dtype), size - 1, None, None)
            elif size > 1 and r == size - 1:
                recv = np.zeros(n, dtype)
                x.expect(f"receive only {dtype} n={n}", x.t.sendrecv, (None, None, recv, 0), recv,
                         data(("one-way",), 0, n, dtype))


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
    """One of each collective on group ``g``, whose rank i is world rank ``members[i]`` (data follow world ranks)."""
    s, me = g.size, g.rank
    x.c.true((me, s) == (members.index(x.rank), len(members)), f"{label}: rank/size {me}/{s}, members {members}")
    for n in sizes:
        buf = data(("g-ar",), x.rank, n, "float32").copy()
        x.expect(f"{label} allreduce n={n}", g.allreduce, (buf, "sum"), buf,
                 x.reduced(("g-ar",), n, "float32", "sum", members))
        counts = [n + 11 * k for k in range(s)]
        recv = np.zeros(sum(counts), np.int64)
        x.expect(f"{label} allgatherv n={n}", g.allgatherv, (data(("g-ag",), x.rank, counts[me], "int64"), recv,
                 counts), recv, np.concatenate([data(("g-ag",), w, counts[k], "int64") for k, w in enumerate(members)]))
        buf = data(("g-bc",), x.rank, n, "uint8").copy()
        x.expect(f"{label} broadcast from the last member n={n}", g.broadcast, (buf, s - 1), buf,
                 data(("g-bc",), members[-1], n, "uint8"))
        recv = np.zeros(n * s, np.float64)
        x.expect(f"{label} alltoallv n={n}", g.alltoallv, (data(("g-a2a",), x.rank, n * s, "float64"), [n] * s, recv,
                 [n] * s), recv, np.concatenate([data(("g-a2a",), w, n * s, "float64")[me * n:(me + 1) * n]
                                                 for w in members]))
        recv = np.zeros(n, np.int32)
        x.expect(f"{label} reducescatter max n={n}", g.reducescatter, (data(("g-rs",), x.rank, n * s, "int32"), recv,
                 [n] * s, "max"), recv, fold([data(("g-rs",), w, n * s, "int32")[me * n:(me + 1) * n]
                                              for w in members], "max"))
        recv = np.zeros(n, np.int16)
        x.expect(f"{label} sendrecv ring n={n}", g.sendrecv, (data(("g-sr",), x.rank, n, "int16"), (me + 1) % s, recv,
                 (me - 1) % s), recv, data(("g-sr",), members[(me - 1) % s], n, "int16"))
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
            buf = np.full(3, x.rank, np.int64)
            x.expect(f"world allreduce after subgroup{members}", t.allreduce, (buf, "sum"), buf,
                     np.full(3, sum(range(size)), np.int64))
    if size > 1:
        x.c.raises(f"{x.v.label} subgroup without this rank", ValueError, t.subgroup, [(x.rank + 1) % size])
    x.c.raises(f"{x.v.label} subgroup beyond the group", ValueError, t.subgroup, [x.rank, size])


def random_program(x: Ctx) -> None:
    """The same random sequence of collectives, dtypes and sizes on every rank."""
    cases = CASES_OF_RANDOM_PROGRAM
    rng = np.random.default_rng([zlib.crc32(x.v.label.encode()), x.size])   # the same program on every rank
    for i in range(80):
        dtype = x.v.dtypes[rng.integers(0, len(x.v.dtypes))]
        cases[int(rng.integers(0, len(cases)))](x, rng, i, dtype, int(rng.choice([0, 1, 5, 100, 1000, 5000])))
        if rng.random() < 0.1:
            x.call(f"#{i} barrier", x.t.barrier)


def _rp_allreduce(x: Ctx, rng, i: int, dtype: str, n: int) -> None:
    op = x.v.ops[int(rng.integers(0, len(x.v.ops)))]
    buf = data(("rp", i), x.rank, n, dtype, op).copy()
    x.expect(f"#{i} allreduce {op} {dtype} n={n}", x.t.allreduce, (buf, op), buf,
             x.reduced(("rp", i), n, dtype, op, range(x.size)))


def _rp_broadcast(x: Ctx, rng, i: int, dtype: str, n: int) -> None:
    root = int(rng.integers(0, x.size))
    buf = data(("rp", i), x.rank, n, dtype).copy()
    x.expect(f"#{i} broadcast {dtype} n={n} root={root}", x.t.broadcast, (buf, root), buf,
             data(("rp", i), root, n, dtype))


def _rp_allgatherv(x: Ctx, rng, i: int, dtype: str, n: int) -> None:
    counts = [int(c) for c in rng.integers(0, n + 1, x.size)]
    recv = np.zeros(sum(counts), dtype)
    x.expect(f"#{i} allgatherv {dtype} {counts}", x.t.allgatherv, (data(("rp", i), x.rank, counts[x.rank], dtype),
             recv, counts), recv, np.concatenate([data(("rp", i), q, counts[q], dtype) for q in range(x.size)]))


def _rp_reducescatter(x: Ctx, rng, i: int, dtype: str, n: int) -> None:
    counts = [int(c) for c in rng.integers(0, n + 1, x.size)]
    sends = [data(("rp", i), q, sum(counts), dtype) for q in range(x.size)]
    lo = sum(counts[:x.rank])
    recv = np.zeros(counts[x.rank], dtype)
    x.expect(f"#{i} reducescatter {dtype} {counts}", x.t.reducescatter, (sends[x.rank], recv, counts, "max"), recv,
             fold([s[lo:lo + counts[x.rank]] for s in sends], "max"))


CASES_OF_RANDOM_PROGRAM = (_rp_allreduce, _rp_broadcast, _rp_allgatherv, _rp_reducescatter)


def background_thread(x: Ctx) -> None:
    """Collectives from a thread that is not the main one (the engine's background thread calls the transport)."""
    def work() -> None:
        for dtype in (d for d in x.v.dtypes if d in ("float32", "int64", "float16", "bool", "int8")):
            for n in x.v.sizes_of(dtype):
                buf = data(("thread",), x.rank, n, dtype).copy()
                x.expect(f"thread: allreduce {dtype} n={n}", x.t.allreduce, (buf, "max"), buf,
                         x.reduced(("thread",), n, dtype, "max", range(x.size)))
                buf = data(("thread",), x.rank, n, dtype).copy()
                x.expect(f"thread: broadcast {dtype} n={n}", x.t.broadcast, (buf, 0), buf, data(("thread",), 0, n,
                                                                                                dtype))

    th = threading.Thread(target=work, name="like-the-engine-background-thread")
    th.start()
    th.join(timeout=240)
    x.c.true(not th.is_alive(), f"{x.v.label} thread: did not finish within 240 s")


def unsupported_op(x: Ctx) -> None:
    """An op outside sum/min/max/product (Average is the engine's job) is refused with ValueError, on every rank alike
    and before anything is sent: the transport stays usable.  (On a transport of its own with a short timeout.)"""
    x.c.raises(f"{x.v.label} allreduce with op 'average'", ValueError, x.t.allreduce, np.ones(4, np.float32),
               "average")
    buf = np.full(2, x.rank, np.int64)
    x.expect("allreduce after the refused op", x.t.allreduce, (buf, "sum"), buf,
             np.full(2, sum(range(x.size)), np.int64))


def argument_errors(x: Ctx) -> None:
    """A too short output buffer is refused with ValueError on every rank before anything is sent, so the transport
    stays usable.  (On a transport of its own with a short timeout.)"""
    x.c.raises(f"{x.v.label} allgatherv into a too short buffer", ValueError, x.t.allgatherv, np.ones(5),
               np.zeros(5 * x.size - 1), [5] * x.size)
    buf = np.full(2, x.rank, np.int64)
    x.expect("allreduce after the refused call", x.t.allreduce, (buf, "sum"), buf,
             np.full(2, sum(range(x.size)), np.int64))


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
