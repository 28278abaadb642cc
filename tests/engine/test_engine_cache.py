"""The response cache (HOROVOD_CACHE_CAPACITY): slots on each rank, the coordinator's mirror, skipped validation.

The pure parts are checked directly; the end-to-end tests run real ranks and check every result against numpy,
including the cases where a cache could go wrong: slots reused after eviction, a rank that changes a tensor's
shape under the same name, and ranks whose cached requests were each valid but never together.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import run
from horovod.engine import ops
from horovod.engine.cache import CoordinatorCache, RequestCache
from horovod.engine.messages import ERROR, Request
from horovod.engine.negotiation import Coordinator


def req(rank, name="t", shape=(3,), payload=None, dtype="float32", op=ops.Sum):
    return Request(rank=rank, name=name, kind=ops.ALLREDUCE, dtype=dtype, shape=shape, op=op, payload=payload)


# ------------------------------------------------------------------------------------------------ pure parts
def test_a_repeated_request_travels_as_its_slot():
    cache = RequestCache(4)
    first = cache.encode(req(1))
    assert isinstance(first, Request) and first.slot == 0
    assert cache.encode(req(1)) == (0, None)
    other = cache.encode(req(1, shape=(4,)))
    assert isinstance(other, Request) and other.slot == 1


def test_inline_bytes_travel_with_the_slot_and_are_not_part_of_the_signature():
    cache = RequestCache(4)
    a = cache.encode(req(1, payload=b"\x01" * 12))
    assert isinstance(a, Request) and a.payload == b"\x01" * 12
    assert cache.encode(req(1, payload=b"\x02" * 12)) == (a.slot, b"\x02" * 12)


def test_the_least_recently_used_slot_is_reused_and_the_mirror_follows():
    cache, mirror = RequestCache(2), CoordinatorCache()
    for name in ("a", "b"):
        mirror.decode(1, cache.encode(req(1, name)))
    mirror.decode(1, cache.encode(req(1, "a")))          # "b" is now the least recently used
    c = cache.encode(req(1, "c"))
    assert isinstance(c, Request) and c.slot == 1        # took "b"'s slot
    template, _ = mirror.decode(1, c)
    assert template.name == "c"
    assert mirror.decode(1, cache.encode(req(1, "c")))[0] is template
    assert mirror.decode(1, cache.encode(req(1, "a")))[0].name == "a"
    assert isinstance(cache.encode(req(1, "b")), Request)  # evicted: sent in full again


def test_capacity_zero_sends_everything_in_full():
    cache, mirror = RequestCache(0), CoordinatorCache()
    for _ in range(3):
        wire = cache.encode(req(1, payload=b"\0" * 12))
        assert isinstance(wire, Request) and wire.slot == -1
        assert mirror.decode(1, wire)[1] == b"\0" * 12


def _negotiate(coord, caches, mirror, shapes, name="t"):
    for rank, shape in enumerate(shapes):
        wire = caches[rank].encode(req(rank, name, shape=shape))
        template, data = mirror.decode(rank, wire)
        coord.add(template, 0.0, data)
    return coord.take_ready()


def test_requests_valid_separately_but_never_together_are_still_validated():
    """Each rank's cached request for "t" was negotiated successfully, but with different partners."""
    coord, mirror = Coordinator(2, cache_capacity=8), CoordinatorCache()
    caches = [RequestCache(8), RequestCache(8)]
    assert _negotiate(coord, caches, mirror, [(3,), (3,)])[0].kind == ops.ALLREDUCE
    assert _negotiate(coord, caches, mirror, [(5,), (5,)])[0].kind == ops.ALLREDUCE
    (resp,) = _negotiate(coord, caches, mirror, [(3,), (5,)])   # both are cache hits
    assert resp.kind == ERROR and "Mismatched ALLREDUCE tensor shapes" in resp.error
    (resp,) = _negotiate(coord, caches, mirror, [(5,), (5,)])
    assert resp.kind == ops.ALLREDUCE and resp.shapes == [(5,)]


# ------------------------------------------------------------------------------------------------ real ranks
def cache_worker() -> dict:
    import os


    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    size = hvd.size()
    problems = []

    def check(got, want, what):
        if not np.array_equal(got, want):
            problems.append(f"{what}: got {got.tolist()}, expected {want.tolist()}")

    # The same names every step, more of them than a small cache holds, tiny (inline) and larger ones.
    for step in range(12):
        for i in range(6):
            n = 2 if i % 2 else 300
            x = np.arange(n, dtype=np.float32) + rank + step + i
            want = sum(np.arange(n, dtype=np.float32) + r + step + i for r in range(size))
            check(hvd.allreduce(x, op=hvd.Sum, name=f"w{i}"), want, f"step {step} w{i}")
    # A rank changes the shape under a cached name: every rank gets the mismatch, then all goes on.
    mismatch = None
    try:
        hvd.allreduce(np.ones(4 if rank == size - 1 else 3, np.float32), name="w1")
    except hvd.HorovodInternalError as exc:
        mismatch = str(exc)
    check(hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="w1"), np.full(2, float(size), np.float32),
          "after the mismatch")
    hvd.shutdown()
    return {"problems": problems, "mismatch": mismatch}


@pytest.mark.parametrize("capacity", ["0", "1", "3", "1024"])
@pytest.mark.parametrize("np_", [2, 3])
def test_cached_collectives_stay_correct_and_mismatches_still_reach_every_rank(np_, capacity):
    results = run(cache_worker, np_, "tcp", env={"HOROVOD_CACHE_CAPACITY": capacity}, timeout=120)
    for rank, out in enumerate(results):
        assert not out["problems"], f"rank {rank}: {out['problems']}"
        assert out["mismatch"] and "Mismatched ALLREDUCE tensor shapes" in out["mismatch"], \
            f"rank {rank}: {out['mismatch']!r}"
