"""Elastic training with Keras: ``KerasState``, the state-updating callbacks and ``run``.

.. code-block:: python

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=epochs,
                  callbacks=[hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)
"""
from horovod._keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                    UpdateEpochStateCallback)
from horovod.tensorflow.elastic import run  # noqa: F401
