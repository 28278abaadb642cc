"""TF2 custom training loop with horovod.tensorflow.DistributedGradientTape on synthetic data.

Run:  horovodrun -np 2 python examples/tensorflow/tf2_custom_loop.py

Each rank trains on its own shard of a synthetic regression problem; the tape averages the gradients across
ranks, so every rank applies the same update and the weights stay identical.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="single-rank learning rate (scaled by size)")
    args = parser.parse_args()

    hvd.init()
    # Pin one GPU per process when there are GPUs (harmless on CPU-only machines).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    # Synthetic data: y = x . w_true + noise; every rank draws its own shard.
    rng = np.random.default_rng(1234 + hvd.rank())
    w_true = np.linspace(-1.0, 1.0, 16).astype(np.float32)[:, None]
    x = rng.normal(size=(args.steps * args.batch_size, 16)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.normal(size=(len(x), 1)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)

    model = keras.Sequential([keras.layers.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(args.lr * hvd.size())
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(features, targets, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(targets, model(features, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # Start every rank from rank 0's weights (after the first step, so the optimizer's slots exist).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    for step, (features, targets) in enumerate(dataset):
        loss = train_step(features, targets, step == 0)
        if step % 50 == 0 and hvd.rank() == 0:
            print(f"step {step:4d}  loss {float(loss):.5f}")

    # All ranks hold the same weights; check it with one allgather of a checksum.
    checksum = tf.reshape(tf.add_n([tf.reduce_sum(v) for v in model.trainable_variables]), [1])
    sums = hvd.allgather(checksum).numpy()
    if hvd.rank() == 0:
        print(f"final loss {float(loss):.5f}; weight checksums per rank: {np.round(sums, 5).tolist()}")
        assert np.allclose(sums, sums[0]), "ranks diverged"


if __name__ == "__main__":
    main()
