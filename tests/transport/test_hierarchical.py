"""What only the hierarchical transport has: how it groups ranks by host, and that the engine picks it for a job
spread over hosts (two host names of this machine) and hands it the HOROVOD_HIERARCHICAL_* knobs.

Its collectives against numpy, on several fake host layouts (2 + 2, 2 + 1, interleaved, 1 + 3, one host) with
the knobs on and off, at np = 1 to 4, are in the shared transport suite (test_transport_conformance.py).
"""
from __future__ import annotations

import pytest

from checks import Checks, assert_no_failures
from multiproc import run_ranks
from horovod.transport.hierarchical import even_counts, host_groups


def test_host_groups_keep_rank_order_and_first_seen_host_order():
    assert host_groups(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]
    assert even_counts(10, 3) == [4, 3, 3]


def _engine_job():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    world = basics.runtime().world
    chk = Checks(rank)
    inputs = [np.arange(300_000, dtype=np.float64) * (r + 1) for r in range(size)]
    want = np.sum(inputs, axis=0) / size   # exact: integers, then one division
    chk.equal(hvd.allreduce(inputs[rank], op=hvd.Average, name="avg"), want, "Average through the engine")
    got = hvd.allgather(np.full((rank + 1, 2), rank), name="ag")
    chk.equal(got, np.concatenate([np.full((r + 1, 2), r) for r in range(size)]), "ragged allgather")
    grouped = hvd.grouped_allgather([np.full((2,), rank), np.full((rank + 1, 2), rank * 1.5)], name="gag")
    chk.equal(grouped[1], np.concatenate([np.full((r + 1, 2), r * 1.5) for r in range(size)]), "grouped allgather")
    return world.name, hvd.local_size(), world.enabled, world.allgather_enabled, chk.report()


@pytest.mark.parametrize("hosts,env,enabled,allgather", [
    (["localhost", "localhost", "127.0.0.1"], {}, True, False),
    (["localhost", "127.0.0.1", "localhost", "127.0.0.1"],
     {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}, False, True),
], ids=["2+1-defaults", "interleaved-knobs-flipped"])
def test_engine_picks_hierarchical_for_several_hosts_and_passes_its_knobs(hosts, env, enabled, allgather):
    results = run_ranks(_engine_job, len(hosts), hosts=hosts, env=env, timeout=120)
    for rank, (name, local_size, on, gather_on, _) in enumerate(results):
        assert (name, local_size) == ("hierarchical", hosts.count(hosts[rank])), (rank, name, local_size)
        assert (on, gather_on) == (enabled, allgather), (rank, on, gather_on)
    assert_no_failures([report for *_, report in results])
