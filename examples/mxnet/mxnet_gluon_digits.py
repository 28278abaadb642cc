"""Train a small Gluon MLP on scikit-learn's handwritten digits with horovod.mxnet and DistributedTrainer.

    .venv-mxnet/bin/horovodrun -np 2 .venv-mxnet/bin/python examples/mxnet/mxnet_gluon_digits.py

The Horovod recipe: ``hvd.init()``; the context pinned by ``hvd.local_rank()`` (a GPU when there is one, the CPU
otherwise); every rank trains on its own shard; the learning rate is scaled by ``hvd.size()``;
``hvd.DistributedTrainer`` averages the gradients; ``hvd.broadcast_parameters`` gives every rank rank 0's initial
weights (the shapes here are inferred at the first forward pass, which is when that broadcast happens); only
rank 0 writes checkpoints.  Needs the MXNet venv (mxnet 1.9.1, numpy<1.24) with scikit-learn.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.mxnet as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.mxnet Gluon training on the digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves parameters (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def load_shard(seed: int):
    """The digits split into train/test the same way on every rank; this rank keeps every size()-th sample."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y.astype(np.float32), test_size=0.25, random_state=seed)
    shard = slice(hvd.rank(), None, hvd.size())
    return x_train[shard], y_train[shard], x_test[shard], y_test[shard]


def evaluate(net, x, y, ctx) -> float:
    """Accuracy over every rank's test shard (correct and total counts are summed over the ranks)."""
    pred = net(mx.nd.array(x, ctx=ctx)).argmax(axis=1).asnumpy()
    counts = mx.nd.array([float((pred == y).sum()), float(len(y))], dtype="float64")
    correct, total = hvd.allreduce(counts, op=hvd.Sum, name="eval.counts").asnumpy()
    return correct / total


def main(argv=None) -> float:
    args = parse_args(argv)
    hvd.init()
    ctx = mx.gpu(hvd.local_rank()) if mx.context.num_gpus() > 0 else mx.cpu(hvd.local_rank())
    mx.random.seed(args.seed + hvd.rank())      # different on purpose: broadcast_parameters makes them equal

    x_train, y_train, x_test, y_test = load_shard(args.seed)
    train = gluon.data.DataLoader(gluon.data.ArrayDataset(x_train, y_train), batch_size=args.batch_size,
                                  shuffle=True, last_batch="discard")

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=ctx)     # deferred: the input size is known at the first batch
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": args.lr * hvd.size(), "momentum": 0.9},
                                     compression=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="hvd-mxnet-gluon-")

    accuracy = 0.0
    for epoch in range(args.epochs):
        total_loss, batches = 0.0, 0
        for data, label in train:
            data, label = data.as_in_context(ctx), label.as_in_context(ctx)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(data.shape[0])
            total_loss += float(loss.mean().asscalar())
            batches += 1
        accuracy = evaluate(net, x_test, y_test, ctx)
        if hvd.rank() == 0:
            path = os.path.join(checkpoint_dir, f"digits-gluon-{epoch:04d}.params")
            net.save_parameters(path)
            print(f"epoch {epoch}: loss {total_loss / max(batches, 1):.4f}  test accuracy {accuracy:.3f}  "
                  f"(checkpoint {path})", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
