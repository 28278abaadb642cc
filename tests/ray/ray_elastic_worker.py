"""The training function of the elastic Ray tests (runs inside the worker actors).

The "model" is a float64 vector ``w``.  Step ``s`` on ``n`` ranks applies ``w -= LR * sum_r grad(s, r) / n`` with a
real allreduce; every term is a small integer, so the test recomputes ``w`` bit for bit from the ``(step, size)``
history kept in the state.  Each worker appends JSON lines to ``log_path``:

- ``join``   (id, pid, epoch, rank, size, step): the training function was entered after a (re)sync;
- ``commit`` (id, pid, epoch, rank, size, step): ``state.commit()`` is about to save this step.

Rank 0 stops the job once ``stop_path`` exists and at least ``min_steps`` steps were made.  :func:`loop` is the
training function of every framework's job; a framework's ``train`` (:func:`train` here, ``train_jax`` in
test_ray_elastic_jax.py) only builds its state and says how a step, the model and the stop decision are done.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np

LR = 0.5


def grad(step: int, rank: int) -> np.ndarray:
    return np.array([step % 5 + rank, 1.0, (step * rank) % 3, rank], dtype=np.float64)


def replay(history) -> np.ndarray:
    """``w`` after the given ``(step, size)`` history, computed the way the workers do."""
    w = np.zeros(4)
    for step, size in history:
        total = sum(grad(step, r) for r in range(size))
        w = w - LR * total / size
    return w


def log(path: str, **event) -> None:
    event["id"] = os.environ.get("HOROVOD_ELASTIC_WORKER_ID", "?")
    event["pid"] = os.getpid()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())   # one write: lines of different workers never mix
    finally:
        os.close(fd)


def loop(state, hvd, log_path: str, stop_path: str, min_steps: int, step_delay: float, *,
         update: Callable[[Any], None], weights: Callable[[Any], list], agree: Callable[[bool], bool]) -> dict:
    """The elastic training function every framework's job runs (wrapped in its framework's retry loop).

    What differs between frameworks comes in: ``update(state)`` makes one step of the model (its allreduce
    included), ``weights(state)`` reads the model as a list, ``agree(stop)`` broadcasts rank 0's stop decision.
    """
    from horovod.common import basics
    from horovod.ray import ray_logger

    epoch = basics.runtime().epoch.epoch   # one call of this function trains in one epoch: a reset re-enters it
    log(log_path, ev="join", epoch=epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
    while True:
        stop = hvd.rank() == 0 and state.step >= min_steps and os.path.exists(stop_path)
        if agree(stop):
            return {"w": weights(state), "history": state.history, "step": state.step,
                    "rank": hvd.rank(), "size": hvd.size()}
        update(state)
        state.history = state.history + [(state.step, hvd.size())]
        state.step += 1
        log(log_path, ev="commit", epoch=epoch, rank=hvd.rank(), size=hvd.size(), step=state.step)
        state.commit()
        ray_logger.log({"step": state.step, "size": hvd.size()})   # rank 0's reach the caller's callbacks
        time.sleep(step_delay)


def train(log_path: str, stop_path: str, min_steps: int, step_delay: float = 0.05):
    """The toy model in ``horovod.numpy``: an ``ObjectState`` and a plain allreduce."""
    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState, default_reset, run_fn

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, w=np.zeros(4), history=[])

    def update(state) -> None:
        total = hvd.allreduce(grad(state.step, hvd.rank()), op=hvd.Sum, name="grad")
        state.w = state.w - LR * total / hvd.size()

    def agree(stop: bool) -> bool:
        return bool(hvd.broadcast(np.array([int(stop)]), root_rank=0, name="stop")[0])

    return run_fn(loop, default_reset)(state, hvd, log_path, stop_path, min_steps, step_delay, update=update,
                                       weights=lambda state: state.w.tolist(), agree=agree)
