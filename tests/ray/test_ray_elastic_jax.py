"""Elastic horovod.jax on a real Ray cluster (conftest.py): ``JaxState`` and a step whose allreduce runs inside
``jax.jit``; an actor is killed, a new one takes its slot, and training continues from the last commit.

The model and the checks are those of test_ray_elastic.py (ray_elastic_worker's toy model, replayed bit for bit
from the ``(step, size)`` history); only the training function is JAX.
"""
from __future__ import annotations

import functools
import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("optax")
jax = pytest.importorskip("jax")
if not hasattr(jax, "Array"):   # tests/jax found as a namespace package: JAX is not installed
    pytest.skip("jax is not installed (pip install 'horovod-next[jax]')", allow_module_level=True)

from horovod.ray import RayExecutor  # noqa: E402
from ray_elastic_worker import LR, _log, grad  # noqa: E402
from test_ray_elastic import Job, check_continuity, check_no_workers_left  # noqa: E402

pytestmark = pytest.mark.usefixtures("cluster")


def train_jax(log_path: str, stop_path: str, min_steps: int, step_delay: float = 0.05):
    import time

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd
    from horovod.common import basics
    from horovod.ray import ray_logger

    hvd.init()
    state = hvd.elastic.JaxState(params={"w": jnp.zeros(4)}, step=0, history=[])
    summed = jax.jit(lambda g: hvd.allreduce(g, op=hvd.Sum, name="grad"))

    @hvd.elastic.run
    def loop(state):
        epoch = basics.runtime().epoch.epoch
        _log(log_path, ev="join", epoch=epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
        while True:
            stop = hvd.rank() == 0 and state.step >= min_steps and os.path.exists(stop_path)
            if hvd.broadcast_object(stop, root_rank=0, name="stop"):
                return {"w": np.asarray(state.params["w"]).tolist(), "history": state.history,
                        "step": state.step, "rank": hvd.rank(), "size": hvd.size()}
            total = np.asarray(summed(jnp.asarray(grad(state.step, hvd.rank()))))
            state.params = {"w": jnp.asarray(np.asarray(state.params["w"]) - LR * total / hvd.size())}
            state.history = state.history + [(state.step, hvd.size())]
            state.step += 1
            _log(log_path, ev="commit", epoch=epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
            state.commit()
            ray_logger.log({"step": state.step, "size": hvd.size()})
            time.sleep(step_delay)

    return loop(state)


class JaxJob(Job):
    def _run(self):
        try:
            self.result = self.executor.run(functools.partial(train_jax, self.log, self.stop, self.min_steps),
                                            callbacks=[self.logged.append])
        except BaseException as exc:   # noqa: BLE001 - re-raised in finish()
            self.error = exc


def test_killed_jax_actor_is_replaced_and_training_continues(tmp_path):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=2,
                           cpus_per_worker=1, elastic_timeout=120)
    job = JaxJob(executor, tmp_path).start()
    try:
        first = job.wait_for_commits(size=2)
        victim = executor.driver.current_members()[-1]
        ray.kill(executor.driver.worker_actors()[victim], no_restart=True)
        job.wait_for_commits(size=2, after_epoch=first)
        results = job.finish()
    finally:
        executor.shutdown()
    assert len(results) == 2
    check_continuity(job, results)
    assert max(e["epoch"] for e in job.events("join")) >= 1, "the kill must have caused a reset"
    check_no_workers_left(job)
