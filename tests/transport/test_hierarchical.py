"""Hierarchical allreduce (shared memory inside a host, TCP across hosts) with two host names on one machine."""
from __future__ import annotations

import pytest

from checks import Checks, assert_no_failures
from multiproc import run_ranks
from horovod.transport.hierarchical import even_counts, host_groups


def test_host_groups_keep_rank_order_and_first_seen_host_order():
    assert host_groups(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]
    assert even_counts(10, 3) == [4, 3, 3]


def _hierarchical_job(sizes):
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics
    from horovod.engine import ops

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    transport = basics.runtime().transport_name
    chk = Checks(rank)
    for n in sizes:
        for dtype in ("float32", "float64", "int64"):
            inputs = [np.random.default_rng(r * 1000 + n).integers(-50, 50, n).astype(dtype) for r in range(size)]
            expected = np.sum(inputs, axis=0, dtype=dtype)
            chk.equal(hvd.allreduce(inputs[rank], op=hvd.Sum, name=f"h.{n}.{dtype}"), expected, f"sum {n} {dtype}")
            chk.equal(hvd.allreduce(inputs[rank], op=hvd.Max, name=f"hmax.{n}.{dtype}"), np.max(inputs, axis=0),
                      f"max {n} {dtype}")
            # Average: each rank finishes its share before the hosts exchange them; the same bits as dividing
            # the exact (integer-valued) sum afterwards.
            average = expected.copy()
            ops.divide_inplace(average, size)
            chk.equal(hvd.allreduce(inputs[rank], op=hvd.Average, name=f"havg.{n}.{dtype}"), average,
                      f"average {n} {dtype}")
    # Other collectives go over the flat mesh; check one of each kind still agrees.
    gathered = hvd.allgather(np.full((rank + 1,), rank), name="g")
    chk.true(gathered.tolist() == [r for r in range(size) for _ in range(r + 1)], f"allgather {gathered}")
    return transport, hvd.local_size(), chk.report()


@pytest.mark.parametrize("hosts", [
    ["localhost", "localhost", "127.0.0.1", "127.0.0.1"],   # homogeneous: 2 + 2
    ["localhost", "localhost", "127.0.0.1"],                # uneven: 2 + 1 (leaders cross)
])
def test_hierarchical_allreduce_matches_numpy(hosts):
    sizes = [0, 1, 3, 1000, 300_000]
    results = run_ranks(_hierarchical_job, len(hosts), args=(sizes,), hosts=hosts, timeout=120)
    for rank, (transport, local_size, _) in enumerate(results):
        assert transport == "hierarchical"
        assert local_size == hosts.count(hosts[rank])
    assert_no_failures([report for _, _, report in results])


def test_hierarchical_can_be_switched_off():
    results = run_ranks(_hierarchical_job, 4, args=([5, 100_000],),
                        hosts=["localhost", "localhost", "127.0.0.1", "127.0.0.1"],
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, timeout=120)
    assert_no_failures([report for _, _, report in results])


def _allgather_job(row_counts):
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    world = basics.runtime().world
    chk = Checks(rank)
    for rows in row_counts:
        for dtype in ("float32", "int64", "uint8"):
            # Rank r contributes rows(r) rows of 3 values that name their rank: the result must be in rank order.
            mine = rows(rank)
            piece = (np.arange(mine * 3).reshape(mine, 3) + 1000 * rank).astype(dtype)
            got = hvd.allgather(piece, name=f"ag.{rows(0)}.{rows(1)}.{dtype}")
            expected = np.concatenate([(np.arange(rows(r) * 3).reshape(rows(r), 3) + 1000 * r).astype(dtype)
                                       for r in range(size)])
            chk.equal(got, expected, f"allgather rows {rows(0)}, {rows(1)}... {dtype}")
    grouped = hvd.grouped_allgather([np.full((2,), rank), np.full((rank + 1, 2), rank * 1.5)], name="gag")
    chk.true(grouped[0].tolist() == [r for r in range(size) for _ in range(2)] and
             grouped[1][:, 0].tolist() == [r * 1.5 for r in range(size) for _ in range(r + 1)], "grouped allgather")
    return world.name, getattr(world, "allgather_enabled", None), chk.report()


@pytest.mark.parametrize("hosts", [
    ["localhost", "localhost", "127.0.0.1", "127.0.0.1"],   # hosts hold rank ranges: gathered in place
    ["localhost", "127.0.0.1", "localhost", "127.0.0.1"],   # interleaved: gathered host by host, then reordered
    ["localhost", "localhost", "127.0.0.1"],                # uneven
])
def test_hierarchical_allgather_matches_numpy(hosts):
    row_counts = [lambda r: r + 1, lambda r: 0 if r % 2 else 50_000, lambda r: 0]
    results = run_ranks(_allgather_job, len(hosts), args=(row_counts,), hosts=hosts,
                        env={"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}, timeout=120)
    assert [(name, enabled) for name, enabled, _ in results] == [("hierarchical", True)] * len(hosts)
    assert_no_failures([report for _, _, report in results])
