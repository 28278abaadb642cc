"""Elastic horovod.jax on a real Ray cluster (conftest.py): ``JaxState`` and a step whose allreduce runs inside
``jax.jit``; an actor is killed, a new one takes its slot, and training continues from the last commit.

The model, the training loop and the checks are those of test_ray_elastic.py (ray_elastic_worker's toy model,
replayed bit for bit from the ``(step, size)`` history; ray_elastic_helpers' job and checks); only the state, the
step and the stop broadcast are JAX.
"""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("optax")
jax = pytest.importorskip("jax")
if not hasattr(jax, "Array"):   # tests/jax found as a namespace package: JAX is not installed
    pytest.skip("jax is not installed (pip install 'horovod-next[jax]')", allow_module_level=True)

from ray_elastic_helpers import kill_an_actor_mid_training  # noqa: E402
from ray_elastic_worker import LR, grad, loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("cluster")


def train_jax(log_path: str, stop_path: str, min_steps: int, step_delay: float = 0.05):
    """ray_elastic_worker.train in JAX (runs in the actors, which import it from this module)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd

    hvd.init()
    state = hvd.elastic.JaxState(params={"w": jnp.zeros(4)}, step=0, history=[])
    summed = jax.jit(lambda g: hvd.allreduce(g, op=hvd.Sum, name="grad"))

    def update(state) -> None:
        total = np.asarray(summed(jnp.asarray(grad(state.step, hvd.rank()))))
        state.params = {"w": jnp.asarray(np.asarray(state.params["w"]) - LR * total / hvd.size())}

    def agree(stop: bool) -> bool:
        return hvd.broadcast_object(stop, root_rank=0, name="stop")

    return hvd.elastic.run(loop)(state, hvd, log_path, stop_path, min_steps, step_delay, update=update,
                                 weights=lambda state: np.asarray(state.params["w"]).tolist(), agree=agree)


def test_killed_jax_actor_is_replaced_and_training_continues(tmp_path):
    kill_an_actor_mid_training(tmp_path, train_jax, min_workers=2, max_workers=2)
