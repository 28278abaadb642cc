"""Toy elastic training job driven by the fault-injection tests (run by ``horovodrun`` as a worker).

The "model" is a float64 vector ``w``.  Step ``s`` on a job of ``n`` ranks applies
``w -= LR * sum_r grad(s, r) / n`` where the sum is a real allreduce; every term is a small integer, so the
sum is exact and the test can recompute ``w`` bit for bit from the ``(step, size)`` history carried in the
state.  Every worker appends JSON lines to ``ELASTIC_TEST_LOG``:

- ``start``  (id, pid): the process started;
- ``join``   (id, epoch, rank, size, step): the training function was entered after a (re)sync;
- ``commit`` (id, epoch, rank, size, step): ``state.commit()`` is called (its save always happens);
- ``done``   (rank 0 only: w, history, step): training finished;
- ``crash``  (pid, error): the worker is exiting with an unexpected exception.

Training stops once ``ELASTIC_TEST_STOP`` exists (rank 0 decides and tells the others) and at least
``ELASTIC_TEST_MIN_STEPS`` steps were made.  ``ELASTIC_TEST_FAULTS`` is a JSON list of
``{"id": worker id, "step": s}``: that worker raises once when it reaches step ``s`` (before committing it).
"""
from __future__ import annotations

import json
import os
import socket
import time

import numpy as np

import horovod.numpy as hvd
from horovod.common import basics
from horovod.common.elastic import ObjectState, default_reset, run_fn

LR = 0.5
LOG = os.environ["ELASTIC_TEST_LOG"]
STOP = os.environ["ELASTIC_TEST_STOP"]
MIN_STEPS = int(os.environ.get("ELASTIC_TEST_MIN_STEPS", "0"))
STEP_DELAY = float(os.environ.get("ELASTIC_TEST_STEP_DELAY", "0.05"))
FAULTS = json.loads(os.environ.get("ELASTIC_TEST_FAULTS", "[]"))
WID = os.environ["HOROVOD_ELASTIC_WORKER_ID"]


def grad(step: int, rank: int) -> np.ndarray:
    return np.array([step % 5 + rank, 1.0, (step * rank) % 3, rank], dtype=np.float64)


def log(**event) -> None:
    event["id"] = WID
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())   # one write: lines of different workers never mix
    finally:
        os.close(fd)


def maybe_fail(step: int) -> None:
    for fault in FAULTS:
        if fault["id"] == WID and fault["step"] == step:
            marker = f"{STOP}.fault.{WID}.{step}"
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError(f"injected failure on worker {WID} at step {step}")


def epoch() -> int:
    return basics.runtime().epoch.epoch


try:
    hvd.init()
except BaseException as exc:
    log(ev="crash", pid=os.getpid(), error=repr(exc))   # a worker failing before it trained: say why
    raise
log(ev="start", pid=os.getpid(), uname=socket.gethostname())
# Through the launcher's output, under the prefix it gave this process (the tests check prefixes are unique).
print(f"worker {os.environ.get('HOROVOD_ELASTIC_WORKER_ID')} pid {os.getpid()}", flush=True)
state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, w=np.zeros(4), history=[])


def train(state: ObjectState) -> None:
    log(ev="join", epoch=epoch(), rank=hvd.rank(), size=hvd.size(), step=state.step)
    while True:
        stop = hvd.rank() == 0 and state.step >= MIN_STEPS and os.path.exists(STOP)
        if hvd.broadcast(np.array([int(stop)]), root_rank=0, name="stop")[0]:
            return
        total = hvd.allreduce(grad(state.step, hvd.rank()), op=hvd.Sum, name="grad")
        state.w = state.w - LR * (total / hvd.size())
        state.history = state.history + [[state.step, hvd.size()]]
        state.step += 1
        maybe_fail(state.step)
        # Logged before commit(): its first half (save) cannot fail, its second (the host check) can, and a
        # saved step counts as committed.
        log(ev="commit", epoch=epoch(), rank=hvd.rank(), size=hvd.size(), step=state.step)
        state.commit()
        time.sleep(STEP_DELAY)


try:
    run_fn(train, default_reset)(state)
except BaseException as exc:
    if not isinstance(exc, SystemExit) and "injected failure" not in str(exc):
        log(ev="crash", pid=os.getpid(), error=repr(exc))
    raise
every = hvd.allgather(state.w[None, :], name="final-w")   # the model as every rank holds it
if hvd.rank() == 0:
    log(ev="done", w=state.w.tolist(), history=state.history, step=state.step,
        same_on_every_rank=bool((every == every[0]).all()))
