"""Elastic JAX job driven by test_jax_elastic.py (run by ``horovodrun`` as a worker): JaxState + a jitted step.

It trains the toy model of ``tests/elastic/elastic_worker.py`` and writes the same log (``start``, ``join``,
``commit``, ``done``, ``crash`` JSON lines in ``ELASTIC_TEST_LOG``), so ``elastic_helpers.check_training`` can
recompute the final model bit for bit from the committed (step, size) history.  What is JAX here:

- the model ``w`` (float64) lives in ``JaxState.params``; ``step`` and ``history`` are plain values;
- the gradients of all ranks are gathered inside ``jax.jit`` (``hvd.allgather`` as an ordered host callback):
  the program's result shape is ``(size, 4)``, so after a resize the step only works because
  ``horovod.jax.elastic.run`` cleared JAX's caches and the step was traced again;
- a killed peer makes that callback fail inside the compiled program, which must come back as
  ``HorovodInternalError`` (restore the last commit) through ``horovod.jax.elastic.run``.
"""
from __future__ import annotations

import json
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import horovod.jax as hvd  # noqa: E402
from horovod.common import basics  # noqa: E402

LR = 0.5
LOG = os.environ["ELASTIC_TEST_LOG"]
STOP = os.environ["ELASTIC_TEST_STOP"]
MIN_STEPS = int(os.environ.get("ELASTIC_TEST_MIN_STEPS", "0"))
STEP_DELAY = float(os.environ.get("ELASTIC_TEST_STEP_DELAY", "0.05"))
WID = os.environ["HOROVOD_ELASTIC_WORKER_ID"]


def log(**event) -> None:
    event["id"] = WID
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())   # one write: lines of different workers never mix
    finally:
        os.close(fd)


def grad(step: int, rank: int) -> np.ndarray:
    return np.array([step % 5 + rank, 1.0, (step * rank) % 3, rank], dtype=np.float64)


@jax.jit
def gathered_sum(g):
    return hvd.allgather(g[None, :]).sum(axis=0)   # small integers: exact in any summation order


try:
    hvd.init()
except BaseException as exc:
    log(ev="crash", pid=os.getpid(), error=repr(exc))
    raise
log(ev="start", pid=os.getpid())
# Every rank starts from a different model on purpose (rank 0's is the zeros the replay starts from): the first
# sync must make them equal.
state = hvd.elastic.JaxState(params={"w": jnp.full(4, float(hvd.rank()))}, step=0, history=[])


@hvd.elastic.run
def train(state) -> None:
    log(ev="join", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(), step=state.step,
        w=np.asarray(state.params["w"]).tolist())
    while True:
        stop = hvd.rank() == 0 and state.step >= MIN_STEPS and os.path.exists(STOP)
        if hvd.broadcast_object(stop, root_rank=0, name="stop"):
            return
        total = np.asarray(gathered_sum(jnp.asarray(grad(state.step, hvd.rank()))))
        state.params = {"w": jnp.asarray(np.asarray(state.params["w"]) - LR * (total / hvd.size()))}
        state.history = state.history + [[state.step, hvd.size()]]
        state.step += 1
        log(ev="commit", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
        state.commit()
        time.sleep(STEP_DELAY)


try:
    train(state)
except BaseException as exc:
    if not isinstance(exc, SystemExit):
        log(ev="crash", pid=os.getpid(), error=repr(exc))
    raise
if hvd.rank() == 0:
    log(ev="done", w=np.asarray(state.params["w"]).tolist(), history=state.history, step=state.step)
