"""Elastic JAX job driven by test_jax_elastic.py (run by ``horovodrun`` as a worker): JaxState + a jitted step.

It trains the toy model of ``tests/elastic/elastic_worker.py`` and writes the same log (``start``, ``join``,
``commit``, ``done``, ``crash`` JSON lines in ``ELASTIC_TEST_LOG``, through the shared ``job_worker.py``), so
``elastic_helpers.check_training`` can recompute the final model bit for bit from the committed (step, size)
history.  What is JAX here:

- the model ``w`` (float64) lives in ``JaxState.params``; ``step`` and ``history`` are plain values;
- the gradients of all ranks are gathered inside ``jax.jit`` (``hvd.allgather`` as an ordered host callback):
  the program's result shape is ``(size, 4)``, so after a resize the step only works because
  ``horovod.jax.elastic.run`` cleared JAX's caches and the step was traced again;
- a killed peer makes that callback fail inside the compiled program, which must come back as
  ``HorovodInternalError`` (restore the last commit) through ``horovod.jax.elastic.run``.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import horovod.jax as hvd  # noqa: E402
from horovod.common import basics  # noqa: E402

# The worker side every ElasticJob script shares (this script runs from tests/jax, not next to it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "elastic"))
from job_worker import LR, STEP_DELAY, crashes_logged, grad, log, stop_requested  # noqa: E402


@jax.jit
def gathered_sum(g):
    return hvd.allgather(g[None, :]).sum(axis=0)   # small integers: exact in any summation order


with crashes_logged():
    hvd.init()
log(ev="start", pid=os.getpid())
# Every rank starts from a different model on purpose (rank 0's is the zeros the replay starts from): the first
# sync must make them equal.
state = hvd.elastic.JaxState(params={"w": jnp.full(4, float(hvd.rank()))}, step=0, history=[])


@hvd.elastic.run
def train(state) -> None:
    log(ev="join", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(), step=state.step,
        w=np.asarray(state.params["w"]).tolist())
    while True:
        if hvd.broadcast_object(stop_requested(hvd.rank(), state.step), root_rank=0, name="stop"):
            return
        total = np.asarray(gathered_sum(jnp.asarray(grad(state.step, hvd.rank()))))
        state.params = {"w": jnp.asarray(np.asarray(state.params["w"]) - LR * (total / hvd.size()))}
        state.history = state.history + [[state.step, hvd.size()]]
        state.step += 1
        log(ev="commit", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
        state.commit()
        time.sleep(STEP_DELAY)


with crashes_logged():
    train(state)
if hvd.rank() == 0:
    log(ev="done", w=np.asarray(state.params["w"]).tolist(), history=state.history, step=state.step)
