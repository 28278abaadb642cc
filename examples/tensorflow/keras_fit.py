"""Keras model.fit with horovod.tensorflow.keras: DistributedOptimizer and the Horovod callbacks.

Run:  horovodrun -np 2 python examples/tensorflow/keras_fit.py

Each rank fits its shard of a synthetic classification problem.  The callbacks broadcast rank 0's initial
weights, warm the learning rate up from ``lr`` to ``lr * size``, and average the epoch metrics across ranks;
rank 0 keeps the best model.
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="single-rank learning rate (scaled by size)")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    hvd.init()

    # Synthetic 3-class problem; every rank draws its own shard of training data, validation is shared.
    rng = np.random.default_rng(hvd.rank())
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], np.float32)

    def draw(n, generator):
        labels = generator.integers(0, 3, n)
        return (centers[labels] + generator.normal(size=(n, 2))).astype(np.float32), labels

    x_train, y_train = draw(1024, rng)
    x_val, y_val = draw(256, np.random.default_rng(999))

    keras.utils.set_random_seed(hvd.rank())          # different initial weights: the broadcast fixes them
    model = keras.Sequential([keras.layers.Input((2,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),       # before anything that reads the metrics
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="hvd-keras-")
    if hvd.rank() == 0:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss",
                                                           filepath=os.path.join(checkpoint_dir, "best.keras")))

    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_val, y_val), callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        print(f"averaged val_accuracy per epoch: {np.round(history.history['val_accuracy'], 3).tolist()}")
        print(f"best model saved to {os.path.join(checkpoint_dir, 'best.keras')}")


if __name__ == "__main__":
    main()
