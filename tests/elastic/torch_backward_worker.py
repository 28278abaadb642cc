"""Elastic PyTorch job whose steps can be interrupted inside ``loss.backward()`` (test_elastic_torch_backward.py).

The model is the toy of :mod:`job_worker` in torch form: two float64 parameters ``b`` and ``c`` whose gradient at
step ``s`` on rank ``r`` is exactly ``grad(s, r)``, trained by ``hvd.DistributedOptimizer(SGD(lr=LR))``; with
power-of-two sizes the average is exact, so ``b`` and ``c`` both equal the model ``check_training`` replays from
the committed ``(step, size)`` history.

The loss is ``Slow(sum(b * g)) + sum(c * g)``: backward reaches ``c`` first (its gradient is handed to the engine
by the optimizer's hook), then sleeps ``ELASTIC_TEST_BACKWARD_SLEEP`` seconds inside ``Slow`` on every
``ELASTIC_TEST_BACKWARD_EVERY``-th step, and only then produces ``b``'s gradient.  Before sleeping it logs a
``backward`` event (epoch, rank, step, and how many entries the optimizer holds pending), so a test can kill a
peer while this rank is inside backward with gradients in flight.  Other events as in elastic_worker.py.
"""
from __future__ import annotations

import os
import time

import torch

import horovod.torch as hvd
from horovod.common import basics
from job_worker import LR, STEP_DELAY, crashes_logged, grad, log, stop_requested

SLEEP = float(os.environ.get("ELASTIC_TEST_BACKWARD_SLEEP", "0"))
EVERY = int(os.environ.get("ELASTIC_TEST_BACKWARD_EVERY", "0"))

torch.set_num_threads(1)
with crashes_logged():
    hvd.init()
log(ev="start", pid=os.getpid())


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))


model = Toy()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0, history=[])


def epoch() -> int:
    return basics.runtime().epoch.epoch


class Slow(torch.autograd.Function):
    """Identity whose backward may sleep: the middle of backward, with ``c``'s gradient already handed over."""

    @staticmethod
    def forward(ctx, x):
        ctx.step = Slow.step
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if EVERY and ctx.step % EVERY == EVERY - 1:
            log(ev="backward", epoch=epoch(), rank=hvd.rank(), step=ctx.step, pending=len(optimizer._handles))
            time.sleep(SLEEP)
        return g

    step = 0


@hvd.elastic.run
def train(state) -> None:
    log(ev="join", epoch=epoch(), rank=hvd.rank(), size=hvd.size(), step=state.step)
    while True:
        stop = stop_requested(hvd.rank(), state.step)
        if hvd.broadcast_object(stop, root_rank=0, name="stop"):
            return
        g = torch.from_numpy(grad(state.step, hvd.rank()))
        optimizer.zero_grad()
        Slow.step = state.step
        loss = Slow.apply((model.b * g).sum()) + (model.c * g).sum()
        loss.backward()
        optimizer.step()
        state.history = state.history + [[state.step, hvd.size()]]
        state.step += 1
        log(ev="commit", epoch=epoch(), rank=hvd.rank(), size=hvd.size(), step=state.step)
        state.commit()
        time.sleep(STEP_DELAY)


with crashes_logged():
    train(state)
    final = torch.stack([model.b.detach(), model.c.detach()])
    every = hvd.allgather(final[None], name="final-model")
if hvd.rank() == 0:
    log(ev="done", w=model.b.detach().tolist(), history=state.history, step=state.step,
        same_on_every_rank=bool((every == every[0]).all()) and bool(torch.equal(final[0], final[1])))
