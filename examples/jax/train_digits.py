"""Train a small MLP on scikit-learn's handwritten digits with horovod.jax, plain JAX and optax.

    horovodrun -np 2 python examples/jax/train_digits.py

Every rank trains on its own shard of each shuffled epoch; ``hvd.DistributedOptimizer`` averages the gradients
across ranks inside the jitted step (an ordered host callback), the initial parameters are broadcast from rank 0
(``params = hvd.broadcast_parameters(params)``: JAX arrays are immutable, the broadcast tree is returned), and
rank 0 prints the training loss and test accuracy (averaged over all ranks) after each epoch.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.jax as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.jax on the digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def init_params(key, sizes=(64, 64, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def logits(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=args.seed)
    # This rank's share of the test set; the training shards are drawn per epoch below.
    x_test, y_test = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    # Every rank initialises with its own seed; the broadcast makes rank 0's parameters everyone's.
    params = hvd.broadcast_parameters(init_params(jax.random.PRNGKey(args.seed + hvd.rank())), root_rank=0)
    # Each step sees size() times more samples than one process would: scale the learning rate with it.
    tx = hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)   # gradients averaged across ranks here
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def correct(params, xb, yb):
        return jnp.sum(jnp.argmax(logits(params, xb), axis=1) == yb)

    rng = np.random.default_rng(args.seed)
    per_rank = len(x_train) // hvd.size()
    steps = per_rank // args.batch_size
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))                        # the same on every rank (same seed)
        mine = order[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
        total = 0.0
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
            total += float(loss)
        train_loss = float(hvd.allreduce(jnp.asarray(total / steps), name="train_loss"))
        accuracy = float(hvd.allreduce(jnp.asarray(int(correct(params, x_test, y_test)) / len(y_test)),
                                       name="test_accuracy"))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {train_loss:.4f}, test accuracy {accuracy:.3f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
