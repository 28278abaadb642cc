"""Hierarchical allreduce (shared memory inside a host, TCP across hosts) with two host names on one machine."""
from __future__ import annotations

import pytest

from multiproc import run_ranks
from horovod.transport.hierarchical import even_counts, host_groups


def test_host_groups_keep_rank_order_and_first_seen_host_order():
    assert host_groups(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]
    assert even_counts(10, 3) == [4, 3, 3]


def _hierarchical_job(sizes):
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    transport = basics.runtime().transport_name
    failures = []
    for n in sizes:
        for dtype in ("float32", "float64", "int64"):
            inputs = [np.random.default_rng(r * 1000 + n).integers(-50, 50, n).astype(dtype) for r in range(size)]
            expected = np.sum(inputs, axis=0, dtype=dtype)
            got = hvd.allreduce(inputs[rank], op=hvd.Sum, name=f"h.{n}.{dtype}")
            if not np.array_equal(got, expected):
                failures.append((n, dtype))
            got_max = hvd.allreduce(inputs[rank], op=hvd.Max, name=f"hmax.{n}.{dtype}")
            if not np.array_equal(got_max, np.max(inputs, axis=0)):
                failures.append(("max", n, dtype))
    # Other collectives go over the flat mesh; check one of each kind still agrees.
    gathered = hvd.allgather(np.full((rank + 1,), rank), name="g")
    if gathered.tolist() != [r for r in range(size) for _ in range(r + 1)]:
        failures.append("allgather")
    return transport, hvd.local_size(), failures


@pytest.mark.parametrize("hosts", [
    ["localhost", "localhost", "127.0.0.1", "127.0.0.1"],   # homogeneous: 2 + 2
    ["localhost", "localhost", "127.0.0.1"],                # uneven: 2 + 1 (leaders cross)
])
def test_hierarchical_allreduce_matches_numpy(hosts):
    sizes = [0, 1, 3, 1000, 300_000]
    results = run_ranks(_hierarchical_job, len(hosts), args=(sizes,), hosts=hosts, timeout=120)
    for rank, (transport, local_size, failures) in enumerate(results):
        assert transport == "hierarchical"
        assert local_size == hosts.count(hosts[rank])
        assert failures == [], f"rank {rank}: {failures}"


def test_hierarchical_can_be_switched_off():
    results = run_ranks(_hierarchical_job, 4, args=([5, 100_000],),
                        hosts=["localhost", "localhost", "127.0.0.1", "127.0.0.1"],
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, timeout=120)
    assert all(failures == [] for _, _, failures in results)
