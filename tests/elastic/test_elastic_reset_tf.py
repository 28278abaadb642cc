"""Issue 38 (E5, TensorFlow): a reset forgets the local gradient aggregation of the step it broke.

With ``backward_passes_per_step`` > 1 the passes are summed into accumulator variables and counted; a failure
between two passes left a pass of the broken step counted and summed, so the first step after the reset applied
it (and the ranks, a newcomer counting from zero, disagreed on which pass reduces).
"""
from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

import horovod.tensorflow as hvd  # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402


@pytest.fixture
def single():
    hvd.init()
    yield
    hvd.shutdown()


def test_a_reset_between_two_passes_forgets_the_first(single):
    w = tf.Variable([0.0, 0.0])
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=2)
    state = hvd.elastic.TensorFlowState([w], step=0)
    attempts = []

    def one_pass(scale: float) -> None:
        optimizer.minimize(lambda: tf.reduce_sum(w * tf.constant([1.0, 2.0]) * scale), var_list=[w])

    @hvd.elastic.run
    def train(state):
        attempts.append(state.step)
        if len(attempts) == 1:
            one_pass(10.0)                 # the broken step's first pass: counted and summed...
            raise HorovodInternalError("a peer died between two passes")
        one_pass(1.0)
        one_pass(1.0)                      # ...so before the fix this pass was the second, applying 11 and 22
        state.step += 1
        state.commit()

    train(state)
    assert attempts == [0, 0]
    assert w.numpy().tolist() == [-2.0, -4.0]
    assert int(optimizer._aggregation.counter.numpy()) == 0
