"""Elastic PyTorch training on synthetic data: workers may join, leave or crash while it trains.

    echo localhost:2 > examples/elastic/hosts.txt
    horovodrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script examples/elastic/discover_hosts.sh \\
        python examples/elastic/train_elastic.py

(see README.md next to this file for adding and removing "hosts" while it runs).

The model, the optimizer, the data sampler's position and the epoch live in a ``hvd.elastic.TorchState``.
``state.commit()`` every few batches saves them in memory; when a worker fails the others roll back to the last
commit, when hosts change everybody keeps the current state, and in both cases Horovod re-initialises with the
new set of workers and broadcasts the state before training continues.  The ``ElasticSampler`` hands out only
the samples of the epoch not processed yet, split over however many workers there are now; the learning rate
follows the number of workers through a reset callback.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="elastic horovod.torch on synthetic data",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic data set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker (scaled by size)")
    parser.add_argument("--commit-every", type=int, default=5, help="batches between two commits")
    parser.add_argument("--batch-delay", type=float, default=0.02,
                        help="seconds of pretend work per batch, so that there is time to add or remove hosts")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def synthetic_data(samples: int, seed: int) -> TensorDataset:
    """A linearly separable two-class problem, identical on every worker (same seed)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=gen)
    w = torch.randn(20, generator=gen)
    y = (x @ w > 0).long()
    return TensorDataset(x, y)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(args.seed)

    dataset = synthetic_data(args.samples, args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    def scale_learning_rate() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([scale_learning_rate])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if hvd.rank() == 0:
            print(f"training with {hvd.size()} workers from epoch {state.epoch}, "
                  f"{state.sampler.processed_num} samples into it", flush=True)
        while state.epoch < args.epochs:
            model.train()
            for batch_idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                time.sleep(args.batch_delay)
                state.sampler.record_batch(batch_idx, args.batch_size)
                if batch_idx % args.commit_every == args.commit_every - 1:
                    state.commit()
                if hvd.rank() == 0 and batch_idx % 20 == 0:
                    print(f"epoch {state.epoch} batch {batch_idx}/{len(loader)} size {hvd.size()} "
                          f"loss {loss.item():.4f}", flush=True)
            # The epoch is over: the next one starts from its first sample, whatever happens from here on.
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epochs, {hvd.size()} workers at the end, accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
