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
``ELASTIC_TEST_MIN_STEPS`` steps were made (job_worker.py: the settings, the log and the gradient every
worker script of ElasticJob shares).  ``ELASTIC_TEST_FAULTS`` is a JSON list of
``{"id": worker id, "step": s}``: that worker raises once when it reaches step ``s`` (before committing it).
``ELASTIC_TEST_DIE_AFTER_ASSIGNMENT`` is ``{"id": worker id, "epoch": e}``: that worker's process exits (status
3, as a crash would) the moment ``init()`` hands it its rank in epoch ``e`` or later, before it connects to anyone
(once: a process started later in the same slot lives); with ``"stage": "connected"``, once it has connected to
the coordinator instead (its death then breaks the others' handshakes rather than leaving them waiting).
``ELASTIC_TEST_SLOW_RESTART`` is ``{"id": worker id, "seconds": s}``: every process started in that slot after the
first sleeps ``s`` seconds before ``init()``.
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
from job_worker import LR, STOP, WID, STEP_DELAY, crashes_logged, grad, log, stop_requested

FAULTS = json.loads(os.environ.get("ELASTIC_TEST_FAULTS", "[]"))
DIE_AFTER_ASSIGNMENT = json.loads(os.environ.get("ELASTIC_TEST_DIE_AFTER_ASSIGNMENT", "null"))


def die_after_assignment() -> None:
    """Make this process exit right after it receives its rank in the chosen epoch (a death inside a reset): at
    once (``"stage": "assigned"``, the default), or once it has connected to the coordinator (``"connected"``)."""
    from horovod.engine import bootstrap, controller

    join = bootstrap._join_elastic_epoch
    connect = controller.ControlPlane.connect.__func__
    chosen = {"epoch": None}

    def die(epoch: int) -> None:
        marker = f"{STOP}.died.{WID}"   # once: a replacement in the same slot lives
        if epoch >= DIE_AFTER_ASSIGNMENT["epoch"] and not os.path.exists(marker):
            open(marker, "w").close()
            log(ev="dies_after_assignment", epoch=epoch, pid=os.getpid())
            os._exit(3)

    def join_then_die(*args, **kwargs):
        config, assignment = join(*args, **kwargs)
        chosen["epoch"] = assignment.epoch
        if DIE_AFTER_ASSIGNMENT.get("stage", "assigned") == "assigned":
            die(assignment.epoch)
        return config, assignment

    def connect_then_die(cls, *args, **kwargs):
        plane = connect(cls, *args, **kwargs)
        if DIE_AFTER_ASSIGNMENT.get("stage") == "connected" and chosen["epoch"] is not None:
            die(chosen["epoch"])
        return plane

    bootstrap._join_elastic_epoch = join_then_die
    controller.ControlPlane.connect = classmethod(connect_then_die)


def maybe_fail(step: int) -> None:
    for fault in FAULTS:
        if fault["id"] == WID and fault["step"] == step:
            marker = f"{STOP}.fault.{WID}.{step}"
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError(f"injected failure on worker {WID} at step {step}")


def epoch() -> int:
    return basics.runtime().epoch.epoch


SLOW_RESTART = json.loads(os.environ.get("ELASTIC_TEST_SLOW_RESTART", "null"))
if SLOW_RESTART and SLOW_RESTART["id"] == WID:
    if os.path.exists(f"{STOP}.started.{WID}"):
        time.sleep(SLOW_RESTART["seconds"])   # a replacement that starts slowly (imports, a loaded host)
    open(f"{STOP}.started.{WID}", "w").close()
if DIE_AFTER_ASSIGNMENT and DIE_AFTER_ASSIGNMENT["id"] == WID:
    die_after_assignment()
with crashes_logged():   # a worker failing before it trained: say why
    hvd.init()
log(ev="start", pid=os.getpid(), uname=socket.gethostname())
# Through the launcher's output, under the prefix it gave this process (the tests check prefixes are unique).
print(f"worker {os.environ.get('HOROVOD_ELASTIC_WORKER_ID')} pid {os.getpid()}", flush=True)
state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, w=np.zeros(4), history=[])


def train(state: ObjectState) -> None:
    log(ev="join", epoch=epoch(), rank=hvd.rank(), size=hvd.size(), step=state.step)
    while True:
        stop = stop_requested(hvd.rank(), state.step)
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


with crashes_logged(expected="injected failure"):
    run_fn(train, default_reset)(state)
every = hvd.allgather(state.w[None, :], name="final-w")   # the model as every rank holds it
if hvd.rank() == 0:
    log(ev="done", w=state.w.tolist(), history=state.history, step=state.step,
        same_on_every_rank=bool((every == every[0]).all()))
