"""Train a small MLP on scikit-learn's handwritten digits with horovod.torch on Ray actors.

    python examples/ray/train_digits.py                      # a local Ray instance, 2 workers
    python examples/ray/train_digits.py --address auto       # join a running Ray cluster
    python examples/ray/train_digits.py --elastic --max-workers 4

``RayExecutor`` starts one actor per worker, and ``executor.run(train)`` runs ``train`` in each of them: every
rank trains on its shard of the data, gradients are averaged by ``DistributedOptimizer``, and rank 0 reports the
loss of each epoch through ``ray_logger`` to the callback below, which prints it here, on the driver.

With ``--elastic`` the same training runs under ``hvd.elastic.run``: workers may die or Ray nodes come and go, and
training continues from the last commit (``RayExecutor(min_workers=..., max_workers=...)``).
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import ray

from horovod.ray import RayExecutor


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.torch on Ray, digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster to join ('auto': the running one); "
                                                        "default: RAY_ADDRESS, else start Ray locally")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--elastic", action="store_true", help="elastic training (min 1, max --max-workers)")
    parser.add_argument("--max-workers", type=int, default=None, help="with --elastic (default --num-workers)")
    return parser.parse_args(argv)


def train(epochs: int, lr: float, batch_size: int, elastic: bool = False, seed: int = 42) -> Dict[str, List[float]]:
    """Runs in every worker actor; returns the loss of each epoch (averaged over ranks) and the final accuracy."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.torch as hvd
    from horovod.ray import ray_logger

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed)
    train_set = TensorDataset(x_train, y_train)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def average(value: float, name: str) -> float:
        return float(hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name))

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            return float((model(x_test).argmax(dim=1) == y_test).float().mean())

    def one_epoch(sampler, epoch: int) -> float:
        model.train()
        total, count = 0.0, 0
        for data, target in DataLoader(train_set, batch_size=batch_size, sampler=sampler):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(data)
            count += len(data)
        loss = average(total / max(count, 1), f"loss.{epoch}")
        ray_logger.log({"epoch": epoch, "loss": loss, "size": hvd.size()})
        return loss

    if not elastic:
        from torch.utils.data.distributed import DistributedSampler

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
        losses = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            losses.append(one_epoch(sampler, epoch))
        return {"losses": losses, "accuracy": accuracy()}

    # Elastic: the state (model, optimizer, epoch, losses so far) survives resets; commit once per epoch.
    sampler = hvd.elastic.ElasticSampler(train_set, seed=seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, losses=[])

    def on_reset():
        # The job changed size: keep the learning rate proportional to it.
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def fit(state):
        for epoch in range(state.epoch, epochs):
            state.epoch = epoch
            state.losses = state.losses + [one_epoch(state.sampler, state.epoch)]
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()
        return {"losses": state.losses, "accuracy": accuracy()}

    return fit(state)


def main(argv=None) -> None:
    args = parse_args(argv)
    ray.init(address=args.address)
    settings = RayExecutor.create_settings(timeout_s=60)
    if args.elastic:
        executor = RayExecutor(settings, min_workers=1, max_workers=args.max_workers or args.num_workers,
                               cpus_per_worker=args.cpus_per_worker)
    else:
        executor = RayExecutor(settings, num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker)
    executor.start()
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
                                              "elastic": args.elastic},
                               callbacks=[lambda info: print(f"epoch {info['epoch']}: loss {info['loss']:.4f} "
                                                             f"({info['size']} workers)", flush=True)])
    finally:
        executor.shutdown()
    losses = results[0]["losses"]
    print(f"{len(results)} workers; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"test accuracy {results[0]['accuracy']:.3f}")


if __name__ == "__main__":
    main()
