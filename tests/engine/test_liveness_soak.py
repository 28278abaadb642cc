"""Soak: real TensorFlow and PyTorch training on this (oversubscribed) machine with a short
``HOROVOD_GLOO_TIMEOUT_SECONDS`` must never report a live peer dead (issue 38, E2).

Was: a ``DistributedGradientTape`` loop at np = 2 died after minutes with "rank 0 has not been heard from for 30 s"
3 ms after its last allreduce (the warm path read the coordinator's heartbeats without counting them). With a 3 s
timeout the same loop died within seconds. The tests train for a bounded time (rank 0's clock decides when every
rank stops) and assert only the outcome: every rank finished every step, with the same weights.
"""
from __future__ import annotations

import pytest

from engine_helpers import run

SECONDS = 15.0   # five timeouts of 3 s (30 until session 11)
ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "3", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}


def tf_worker(seconds: float) -> dict:
    import time

    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    rank = hvd.rank()
    tf.random.set_seed(1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)])
    model.build((None, 32))
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    hvd.broadcast_variables(model.variables, root_rank=0)
    end = time.monotonic() + seconds
    steps = 0
    while True:
        go = hvd.broadcast(tf.constant([1 if time.monotonic() < end else 0]), 0, name="go")
        if not int(go.numpy()[0]):
            break
        x = tf.constant(rng.normal(size=(64, 32)).astype(np.float32))
        y = tf.constant(rng.integers(0, 10, size=(64,)))
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        steps += 1
    digest = float(sum(float(tf.reduce_sum(v)) for v in model.trainable_variables))
    digests = hvd.allgather_object(digest)
    hvd.shutdown()
    return {"steps": steps, "digests": digests}


def torch_worker(seconds: float) -> dict:
    import time

    import torch

    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    end = time.monotonic() + seconds
    steps = 0
    while True:
        go = hvd.broadcast(torch.tensor([1 if time.monotonic() < end else 0]), 0, name="go")
        if not int(go[0]):
            break
        x = torch.randn(64, 32, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
    digest = float(sum(p.detach().sum() for p in model.parameters()))
    digests = hvd.allgather_object(digest)
    hvd.shutdown()
    return {"steps": steps, "digests": digests}


def _check(results) -> None:
    steps = {out["steps"] for out in results}
    assert len(steps) == 1 and steps.pop() > 0, results
    digests = results[0]["digests"]
    assert max(digests) - min(digests) <= 1e-3 * max(1.0, abs(digests[0])), f"weights diverged: {digests}"


@pytest.mark.parametrize("np_", [3])   # (2 as well until session 10: ~45 s of CI that never failed alone)
def test_tensorflow_training_never_reports_a_live_peer_dead(np_):
    pytest.importorskip("tensorflow")
    _check(run(tf_worker, np_, "shm", args=(SECONDS,), env=ENV, timeout=600))


@pytest.mark.parametrize("np_", [4])   # oversubscribed 2:1, the harshest (2 as well until session 10)
def test_torch_training_never_reports_a_live_peer_dead(np_):
    pytest.importorskip("torch")
    _check(run(torch_worker, np_, "shm", args=(SECONDS,), env=ENV, timeout=600))
