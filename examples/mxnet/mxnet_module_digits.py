"""Train a symbolic MLP on scikit-learn's handwritten digits with horovod.mxnet and the Module API.

    .venv-mxnet/bin/horovodrun -np 2 .venv-mxnet/bin/python examples/mxnet/mxnet_module_digits.py

The Horovod recipe for ``mx.mod.Module``: ``hvd.init()``; the context pinned by ``hvd.local_rank()``; every rank
reads its own shard; the learning rate is scaled by ``hvd.size()``; the optimizer is wrapped in
``hvd.DistributedOptimizer`` and ``fit`` runs with ``kvstore=None``; the initial ``arg_params`` / ``aux_params``
are broadcast from rank 0; only rank 0 writes checkpoints.  Needs the MXNet venv (mxnet 1.9.1, numpy<1.24) with
scikit-learn.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import mxnet as mx
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.mxnet as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.mxnet Module API training on the digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves checkpoints (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def build_symbol() -> mx.sym.Symbol:
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=64, name="fc1")
    net = mx.sym.Activation(net, act_type="relu", name="relu1")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def main(argv=None) -> float:
    args = parse_args(argv)
    hvd.init()
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING)
    ctx = mx.gpu(hvd.local_rank()) if mx.context.num_gpus() > 0 else mx.cpu(hvd.local_rank())
    mx.random.seed(args.seed + hvd.rank())      # different on purpose: the broadcast below makes them equal

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y.astype(np.float32), test_size=0.25,
                                                        random_state=args.seed)
    shard = slice(hvd.rank(), None, hvd.size())
    train_iter = mx.io.NDArrayIter(x_train[shard], y_train[shard], args.batch_size, shuffle=True,
                                   last_batch_handle="discard", label_name="softmax_label")
    test_iter = mx.io.NDArrayIter(x_test[shard], y_test[shard], args.batch_size, label_name="softmax_label")

    mod = mx.mod.Module(build_symbol(), data_names=["data"], label_names=["softmax_label"], context=ctx)
    mod.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mod.init_params(initializer=mx.init.Xavier())
    arg_params, aux_params = mod.get_params()
    hvd.broadcast_parameters(arg_params, root_rank=0)
    hvd.broadcast_parameters(aux_params, root_rank=0)
    mod.set_params(arg_params, aux_params)

    # rescale_grad makes the per-rank gradient a batch mean; DistributedOptimizer averages it over the ranks.
    opt = mx.optimizer.create("sgd", learning_rate=args.lr * hvd.size(), momentum=0.9,
                              rescale_grad=1.0 / args.batch_size)
    opt = hvd.DistributedOptimizer(opt)

    # Expected here, so not shown: fit() finds the module already bound and initialised (by the broadcast above),
    # and DistributedOptimizer folds 1/size into rescale_grad, which the Module does not know about.
    warnings.filterwarnings("ignore", message="Parameters already initialized")
    warnings.filterwarnings("ignore", message="Optimizer created manually outside Module")
    logging.getLogger().addFilter(lambda record: "Already bound" not in record.getMessage())

    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="hvd-mxnet-module-")
    prefix = os.path.join(checkpoint_dir, "digits-module")
    checkpoint = mx.callback.do_checkpoint(prefix) if hvd.rank() == 0 else None
    mod.fit(train_iter, kvstore=None, optimizer=opt, num_epoch=args.epochs, eval_metric="acc",
            epoch_end_callback=checkpoint)

    # Accuracy over every rank's test shard: the correct and total counts are summed over the ranks.
    correct = total = 0.0
    test_iter.reset()
    for batch in test_iter:
        mod.forward(batch, is_train=False)
        valid = batch.data[0].shape[0] - batch.pad
        pred = mod.get_outputs()[0].asnumpy().argmax(axis=1)[:valid]
        correct += float((pred == batch.label[0].asnumpy()[:valid]).sum())
        total += valid
    correct, total = hvd.allreduce(mx.nd.array([correct, total], dtype="float64"), op=hvd.Sum,
                                   name="eval.counts").asnumpy()
    accuracy = correct / total
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.3f} after {args.epochs} epochs (checkpoints {prefix}-*.params)", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
