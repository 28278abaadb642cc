"""Train a small MLP on scikit-learn's handwritten digits with horovod.torch.

    horovodrun -np 2 python examples/torch/train_digits.py

Every rank trains on its own shard of the training set (``DistributedSampler`` with Horovod's rank and size),
gradients are averaged by ``DistributedOptimizer``, the initial state is broadcast from rank 0, and rank 0
prints the training loss and test accuracy (averaged over all ranks) after each epoch, with the epoch's time and
the samples per second the whole job trained.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("HOROVOD_RANK", "0") == "0":
    # Importing torch and scikit-learn takes a while (tens of seconds on a slow or busy machine): say so first.
    print("loading PyTorch and scikit-learn ...", file=sys.stderr, flush=True)

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.torch on the digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def metric_average(value: float, name: str) -> float:
    """The mean of a Python number over all ranks."""
    return float(hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name))


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=args.seed)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # Each step sees size() times more samples than one process would: scale the learning rate with it.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} processes, {len(train_set)} samples per epoch", flush=True)
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        total, count = 0.0, 0
        began = time.perf_counter()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(data)
            count += len(data)
        train_loss = metric_average(total / max(count, 1), "train_loss")
        # Every rank's samples, over the slowest rank's time (the averaging above waited for it).
        seconds = time.perf_counter() - began
        samples = metric_average(float(count), "train_samples") * hvd.size()

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += int((model(data).argmax(dim=1) == target).sum())
                seen += len(data)
        accuracy = metric_average(correct / max(seen, 1), "test_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {train_loss:.4f}, test accuracy {accuracy:.3f}, {seconds:.2f} s, "
                  f"{samples / seconds:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
