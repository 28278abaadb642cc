"""``horovod.run`` in elastic mode: the function runs under the elastic driver and its results come back by the
ranks of the last epoch."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import horovod

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import this test module


def _train():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState, default_reset, run_fn

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, total=0)

    def train(state):
        state.total = int(hvd.allreduce(np.array([hvd.rank() + 1]), op=hvd.Sum, name="x")[0])
        state.commit()
        return hvd.rank(), hvd.size(), state.total

    return run_fn(train, default_reset)(state)


def test_run_elastic_returns_results_by_final_rank():
    results = horovod.run(_train, num_proc=2, min_num_proc=2, max_num_proc=2, hosts="localhost:1,127.0.0.1:1")
    assert results == [(0, 2, 3), (1, 2, 3)]


def test_run_elastic_returns_the_first_min_np_results():
    with pytest.warns(DeprecationWarning, match="min_np"):
        results = horovod.run(_train, np=2, min_np=1, hosts="localhost:2")
    assert results == [(0, 2, 3)]
