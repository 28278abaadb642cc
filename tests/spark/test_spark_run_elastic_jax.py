"""``horovod.spark.run_elastic`` with a JAX training function: ``horovod.jax.elastic.JaxState`` and a step whose
allreduce runs inside ``jax.jit``; a Spark task's Python worker is killed by pid mid-training and the survivor goes
on from its last commit (the failed collective surfaces inside the compiled step and must restore the state).
The scenario and its checks are those of test_spark_run_elastic.py (spark_elastic_helpers.py)."""
import sys
import time

import cloudpickle
import numpy as np
import pytest

pytest.importorskip("optax")
jax = pytest.importorskip("jax")
if not hasattr(jax, "Array"):   # tests/jax found as a namespace package: JAX is not installed
    pytest.skip("jax is not installed (pip install 'horovod-next[jax]')", allow_module_level=True)

from spark_elastic_helpers import check_resumed_from_last_commit, log_event, park_if_victim, result, \
    run_killing_rank_1  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 24
KILL_AT = 6


def _train(log_dir):
    import jax
    import jax.numpy as jnp

    import horovod.jax as hvd

    hvd.init()
    state = hvd.elastic.JaxState(params={"w": jnp.zeros(2)}, step=0, sizes=[])

    @jax.jit
    def step(params):
        return {"w": params["w"] + hvd.allreduce(jnp.ones(2), op=hvd.Sum, name="grad")}

    @hvd.elastic.run
    def train(state):
        log_event(log_dir, ev="join", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            park_if_victim(log_dir, hvd.rank(), state.step, KILL_AT)
            state.params = step(state.params)
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
            time.sleep(0.1)

    train(state)
    return result(hvd.rank(), state.step, np.asarray(state.params["w"]), state.sizes)


def test_jax_worker_killed_mid_training_continues_from_last_commit(spark, tmp_path):
    results, killed = run_killing_rank_1(_train, str(tmp_path))
    check_resumed_from_last_commit(results, killed, str(tmp_path), STEPS, KILL_AT)
