"""Recycled result memory (horovod/engine/result_pool.py): a block comes back only when nothing can reach it."""
from __future__ import annotations

import numpy as np
import pytest

from horovod.engine import result_pool
from horovod.engine.result_pool import MIN_BYTES, ResultPool, _Lease

from tests.engine.engine_helpers import run

BIG = MIN_BYTES // 4  # float32 elements of a pooled result


@pytest.fixture(autouse=True)
def empty_pool():
    result_pool.pool().clear()
    yield
    result_pool.pool().clear()


def test_block_returns_only_when_the_last_view_is_gone():
    a = result_pool.empty((BIG,), np.float32)
    assert isinstance(a.base, _Lease) and a.flags.writeable and a.flags.c_contiguous
    address = a.ctypes.data
    view = a[10:20].reshape(2, 5)
    del a
    assert result_pool.pool().free_bytes == 0  # the view still reaches the memory
    del view
    assert result_pool.pool().free_bytes == MIN_BYTES
    b = result_pool.empty((BIG // 2, 2), np.float32)  # same byte count, other shape: the block is reused
    assert b.ctypes.data == address and b.shape == (BIG // 2, 2)
    assert result_pool.pool().free_bytes == 0


def test_live_results_never_share_memory():
    first = result_pool.empty(BIG, np.float32)
    first[:] = 1
    second = result_pool.empty(BIG, np.float32)
    second[:] = 2
    assert not np.shares_memory(first, second)
    assert np.all(first == 1) and np.all(second == 2)


def test_torch_tensor_keeps_the_block():
    torch = pytest.importorskip("torch")
    a = result_pool.empty(BIG, np.float32)
    t = torch.from_numpy(a)
    del a
    assert result_pool.pool().free_bytes == 0
    t.fill_(3.0)
    assert float(t.sum()) == 3.0 * BIG
    del t
    assert result_pool.pool().free_bytes == MIN_BYTES


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.float16, np.int64, np.complex64])
def test_dtypes_and_scalar_shapes(dtype):
    itemsize = np.dtype(dtype).itemsize
    a = result_pool.empty(MIN_BYTES // itemsize, dtype)
    assert a.dtype == np.dtype(dtype) and a.shape == (MIN_BYTES // itemsize,) and isinstance(a.base, _Lease)
    small = result_pool.empty((3, 2), dtype)
    assert small.base is None and small.shape == (3, 2)  # below MIN_BYTES: plain numpy


@pytest.mark.parametrize("shape", [np.int64(MIN_BYTES // 4), (np.int32(MIN_BYTES // 8), 2), [MIN_BYTES // 4],
                                   (2, 0), 0, (), (np.uint8(5),)])
def test_every_way_a_shape_is_spelled(shape):
    """Shapes come as ints, numpy integers, tuples and lists of either (a response's shapes, ``sum`` of numpy
    splits); each gives the plain-int shape numpy would, pooled from MIN_BYTES."""
    a = result_pool.empty(shape, np.float32)
    expected = np.empty(shape, np.float32).shape
    assert a.shape == expected and all(type(d) is int for d in a.shape)
    assert a.flags.c_contiguous and a.flags.writeable
    assert isinstance(a.base, _Lease) == (a.nbytes >= MIN_BYTES)
    a.reshape(-1)[...] = 7   # every byte of it is ours
    assert a.size == 0 or float(a.reshape(-1)[-1]) == 7.0


def test_a_negative_dimension_fails_as_numpy_fails():
    with pytest.raises(ValueError):
        result_pool.empty((4, -1), np.float32)


def test_cap_drops_the_least_recently_freed():
    pool = ResultPool(max_bytes=3 * 1024)
    blocks = [np.empty(1024, np.uint8) for _ in range(4)]
    for b in blocks:
        pool.release(b)
    assert pool.free_bytes == 3 * 1024
    taken = {id(pool.take(1024)) for _ in range(3)}
    assert taken == {id(b) for b in blocks[1:]}  # blocks[0], freed first, was dropped
    assert pool.free_bytes == 0
    pool.release(np.empty(4 * 1024, np.uint8))  # larger than the whole cap: never kept
    assert pool.free_bytes == 0


def _two_results_in_a_row():
    import horovod.numpy as hvd

    hvd.init()
    try:
        x = np.full(BIG, hvd.rank() + 1, np.float32)
        first = hvd.allreduce(x, op=hvd.Sum, name="first")
        second = hvd.allreduce(x * 10, op=hvd.Sum, name="second")  # must not land in first's memory
        del second
        third = hvd.allreduce(x * 100, op=hvd.Sum, name="third")  # may reuse second's block
        n = hvd.size()
        total = n * (n + 1) / 2
        return (bool(np.all(first == total)), bool(np.all(third == 100 * total)), bool(np.all(x == hvd.rank() + 1)),
                isinstance(first.base, _Lease))
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_engine_results_stay_intact_while_alive(transport):
    for first_ok, third_ok, input_ok, pooled in run(_two_results_in_a_row, 2, transport=transport):
        assert first_ok and third_ok and input_ok and pooled


def test_a_request_takes_the_smallest_block_that_fits_without_much_slack():
    pool = ResultPool(max_bytes=1 << 30)
    blocks = {n: np.empty(n, np.uint8) for n in (1000, 1300, 2000)}
    for b in blocks.values():
        pool.release(b)
    assert pool.take(1200) is blocks[1300]            # fits, 8 % larger
    assert pool.take(1400) is not blocks[2000]        # 2000 would waste 43 %: a new block
    assert pool.take(1000) is blocks[1000]
    assert pool.free_bytes == 2000
    # The process-wide pool may hold blocks of earlier tests in this process, one of which could fit better:
    # start it empty so that the block freed here is the one to reuse.
    result_pool.pool().clear()
    # (Both above MIN_BYTES: below it results come from numpy, and the test would check malloc, not the pool.)
    a = result_pool.empty(BIG + 2000, np.float32)     # a slightly smaller result reuses a freed block
    address = a.ctypes.data
    del a
    b = result_pool.empty(BIG + 1000, np.float32)
    assert b.ctypes.data == address and b.shape == (BIG + 1000,)


def test_blocks_nobody_takes_are_dropped_after_the_idle_time():
    now = [0.0]
    pool = ResultPool(max_bytes=1 << 30, max_idle_s=10.0, clock=lambda: now[0])
    pool.release(np.empty(4096, np.uint8))
    now[0] = 5.0
    kept = np.empty(8192, np.uint8)
    pool.release(kept)
    now[0] = 12.0
    assert pool.take(100000).nbytes == 100000          # any use of the pool drops the block idle for 12 s
    assert pool.free_bytes == 8192
    assert pool.take(8192) is kept                      # idle for 7 s only: still there


def _mixed_size_soak(ops: int):
    """Small allreduces with an occasional large one of an ever-changing size (new results, dropped at once)."""
    import horovod.numpy as hvd

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    hvd.init()
    try:
        rng = np.random.default_rng(7)   # the same sizes on every rank
        peak_pool = 0
        warm = None
        wrong = 0
        for i in range(ops):
            n = int(rng.integers(1 << 18, 8 << 20)) if i % 25 == 0 else int(rng.integers(1, 4096))
            r = hvd.allreduce(np.ones(n, np.float32), op=hvd.Sum, name=f"t{i % 5}")
            wrong += int(r[0] != hvd.size() or r[-1] != hvd.size())
            del r
            peak_pool = max(peak_pool, result_pool.pool().free_bytes)
            if i == 50:
                warm = rss_mib()
        return wrong, peak_pool, rss_mib() - warm
    finally:
        hvd.shutdown()


def test_mixed_size_soak_keeps_memory_bounded():
    """Before the bound, RSS grew by the pool's whole 256 MiB cap of never-reused exact-size blocks."""
    cap_mib = result_pool.MAX_POOLED_BYTES / (1 << 20)
    for wrong, peak_pool, grown_mib in run(_mixed_size_soak, 2, transport="shm", args=(1500,), timeout=300):
        assert wrong == 0
        assert peak_pool <= result_pool.MAX_POOLED_BYTES
        assert grown_mib < cap_mib + 64, f"RSS grew by {grown_mib:.0f} MiB over the soak (pool cap {cap_mib:.0f} MiB)"


def test_cached_interfaces_stay_bounded_and_go_with_their_block():
    """Leases cache each block's array interface per shape: results of many shapes from one block stay right and
    the cache bounded, and a block the pool lets go of takes its entries along (a new block may reuse its id)."""
    top = BIG + 3 * result_pool._FACES_MAX   # every size within MAX_SLACK below the first (and pooled: >= BIG)
    for i in range(3 * result_pool._FACES_MAX):   # one block serves all
        a = result_pool.empty((top - i,), np.float32)
        a[...] = i
        assert a.shape == (top - i,) and a[-1] == i
        del a
    assert len(result_pool._FACES) <= result_pool._FACES_MAX
    assert all(len(faces) <= result_pool._FACES_MAX for faces in result_pool._FACES.values())
    pool = result_pool.pool()
    cap = pool.max_bytes
    pool.max_bytes = MIN_BYTES   # room for one free block: the second one freed pushes the first out
    try:
        pool.clear()
        first, second = result_pool.empty((BIG,), np.float32), result_pool.empty((BIG,), np.float32)
        first_id = id(first.base.block)
        assert first_id in result_pool._FACES
        del first, second
        assert first_id not in result_pool._FACES and pool.free_bytes == MIN_BYTES
    finally:
        pool.max_bytes = cap
