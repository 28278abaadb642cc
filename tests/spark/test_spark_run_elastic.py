"""``horovod.spark.run_elastic`` on the shared two-executor cluster: a Spark task's Python worker is killed by pid
in the middle of training, and training goes on from the last commit (spark_elastic_helpers.py: the scenario and
its checks)."""
import io
import sys
import time

import cloudpickle
import numpy as np
import pytest

import horovod.spark
from spark_elastic_helpers import check_resumed_from_last_commit, log_event, park_if_victim, result, \
    run_killing_rank_1

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 30
KILL_AT = 8


def _train(log_dir):
    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState, default_reset, run_fn

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, w=np.zeros(2), sizes=[])

    def train(state):
        log_event(log_dir, ev="join", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            park_if_victim(log_dir, hvd.rank(), state.step, KILL_AT)
            total = hvd.allreduce(np.ones(2), op=hvd.Sum, name="grad")
            state.w = state.w + total
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
            time.sleep(0.1)

    run_fn(train, default_reset)(state)
    return result(hvd.rank(), state.step, state.w, state.sizes)


def test_python_worker_killed_mid_training_continues_from_last_commit(spark, tmp_path):
    results, killed = run_killing_rank_1(_train, str(tmp_path))
    check_resumed_from_last_commit(results, killed, str(tmp_path), STEPS, KILL_AT)


def test_run_elastic_plain_job_and_bad_counts(spark):
    def fn():
        import horovod.numpy as hvd

        hvd.init()
        return hvd.rank(), hvd.size(), float(hvd.allreduce(np.array([1.0]), op=hvd.Sum)[0])

    assert horovod.spark.run_elastic(fn, num_proc=2, verbose=0, stdout=io.StringIO()) == [(0, 2, 2.0), (1, 2, 2.0)]
    with pytest.raises(ValueError, match="min_num_proc <= num_proc <= max_num_proc"):
        horovod.spark.run_elastic(fn, num_proc=3, max_num_proc=2)
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start\."):
        horovod.spark.run_elastic(fn, num_proc=5, start_timeout=3, verbose=0)
    # Nothing is left behind in the cluster: a job right after gets every slot.
    assert horovod.spark.run(fn, num_proc=4, verbose=0, stdout=io.StringIO()) == [(r, 4, 4.0) for r in range(4)]
