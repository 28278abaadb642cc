"""The hang doctor under ``horovod.spark.run_elastic`` (the shared two-executor cluster): a rank that skips a
collective in every epoch; the elastic driver collects each epoch's dumps and the job's failure at the reset limit
carries the latest epoch's verdict naming the rank and the tensor (``horovod.spark.run``: test_spark_run.py).
Functions go to the executors by value, so the doctor shows their lines as ``<dynamic-code>``: the test does not
look for this file's line numbers.
"""
import io
import sys

import cloudpickle
import numpy as np
import pytest

import horovod.spark
from horovod.doctor import report

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STALL_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}


def _skip_one_collective():
    """Healthy steps, then the last rank skips 'grad.fc2.weight' and goes on to 'stats'."""
    import horovod.numpy as hvd

    big = np.ones(512, dtype=np.float32)   # 2 KiB: past the fast lane, through the coordinator
    for _ in range(3):
        hvd.allreduce(big, name="grad.fc1.weight")
        hvd.allreduce(big, name="grad.fc2.weight")
        hvd.allgather(big[:4], name="stats")
    if hvd.rank() != hvd.size() - 1:
        hvd.allreduce(big, name="grad.fc2.weight")
    hvd.allgather(big[:4], name="stats")


def _elastic():
    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState, default_reset, run_fn

    hvd.init()
    run_fn(lambda state: _skip_one_collective(), default_reset)(ObjectState(hvd.broadcast_object, hvd.rank, step=0))


EXPECTED = ["Horovod doctor (2 of 2 ranks dumped", "rank 1 skipped allreduce 'grad.fc2.weight'",
            "and went on to allgather 'stats'", "rank 0 waits in it"]


def check(message: str, dumps) -> None:
    verdict = "\n".join(report(str(dumps)))
    for piece in EXPECTED:
        assert piece in verdict, f"{piece!r} not in the verdict:\n{verdict}"
        assert piece in message, f"{piece!r} not in the failure:\n{message}"


def test_run_elastic_fails_at_the_reset_limit_with_the_latest_epochs_verdict(spark, tmp_path):
    env = dict(STALL_ENV, HOROVOD_FLIGHT_RECORDER_DIR=str(tmp_path / "dumps"))
    with pytest.raises(Exception) as failure:
        horovod.spark.run_elastic(_elastic, num_proc=2, min_num_proc=2, max_num_proc=2, reset_limit=1,
                                  start_timeout=120, elastic_timeout=60, env=env, verbose=0,
                                  stdout=io.StringIO(), stderr=io.StringIO())
    message = str(failure.value)
    assert "number of resets during elastic job exceeded limit: 1" in message, message
    assert "generation 1)" in message, message
    check(message, tmp_path / "dumps")

