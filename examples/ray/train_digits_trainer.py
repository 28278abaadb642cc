"""Train a small MLP on scikit-learn's handwritten digits with horovod.torch on Ray Train (``HorovodTrainer``).

    python examples/ray/train_digits_trainer.py                   # a local Ray instance (or RAY_ADDRESS), 2 workers
    python examples/ray/train_digits_trainer.py --address auto    # join a running Ray cluster
    horovodrun -np 2 python examples/ray/train_digits_trainer.py  # the same training function, without Ray

``HorovodTrainer`` is a Ray Train trainer: Ray Train starts the workers (``ScalingConfig``), restarts them after a
failure (``FailureConfig(max_failures=...)``) and keeps the checkpoints (``RunConfig(storage_path=...)``); Horovod
averages the gradients.  The training function reports each epoch's loss and accuracy with ``ray.train.report``,
rank 0 with a checkpoint, and resumes from ``ray.train.get_checkpoint()`` when Ray Train restarted it.

Started by ``horovodrun``, the same script runs the function in each of its processes: ``hvd.init()`` joins them,
``ray.train.get_context()`` gives Horovod's rank and size, and checkpoints are written under
``<storage-path>/<name>/rank_0``.  No download: the digits ship with scikit-learn.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="horovod.torch on Ray Train, digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster to join ('auto': the running one); "
                                                        "default: RAY_ADDRESS, else start Ray locally")
    parser.add_argument("--num-workers", type=int, default=2, help="Ray Train workers (ignored under horovodrun)")
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts Ray Train may make")
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "horovod-ray-train"),
                        help="where Ray Train keeps the run's checkpoints")
    parser.add_argument("--name", default=None, help="the run's name, its directory under --storage-path (default: "
                                                     "a new one; a run given an existing name resumes it)")
    return parser.parse_args(argv)


def train_func(config):
    """Runs in every worker; reports each epoch's metrics (rank 0 with a checkpoint)."""
    import ray.train
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=config["seed"])
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=config["seed"])

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9)
    start = 0
    checkpoint = ray.train.get_checkpoint()   # set when Ray Train restarted the workers after a failure
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "model.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            return float((model(x_test).argmax(dim=1) == y_test).float().mean())

    for epoch in range(start, config["epochs"]):
        began = time.perf_counter()
        model.train()
        sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for data, target in DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(data)
            count += len(data)
        loss = float(hvd.allreduce(torch.tensor(total / max(count, 1), dtype=torch.float64), name=f"loss.{epoch}"))
        seconds = time.perf_counter() - began
        metrics = {"epoch": epoch, "loss": loss, "accuracy": accuracy(), "workers": hvd.size(),
                   "seconds": seconds, "samples_per_s": count * hvd.size() / seconds, "resumed_at": start}
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.4f} ({hvd.size()} workers, {seconds:.1f} s, "
                  f"{metrics['samples_per_s']:.0f} samples/s)", flush=True)
        with tempfile.TemporaryDirectory() as directory:
            saved = None
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           os.path.join(directory, "model.pt"))
                saved = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=saved)   # every rank reports; Ray Train keeps rank 0's checkpoint


def main(argv=None) -> None:
    args = parse_args(argv)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from horovod.ray import HorovodTrainer

    under_launcher = "HOROVOD_RANK" in os.environ   # started by horovodrun: no Ray cluster needed
    if not under_launcher and not ray.is_initialized():
        ray.init(address=args.address)
    trainer = HorovodTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size, "seed": 42},
        scaling_config=ScalingConfig(num_workers=args.num_workers,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                             failure_config=FailureConfig(max_failures=args.max_failures)))
    result = trainer.fit()
    if os.environ.get("HOROVOD_RANK", "0") == "0":
        metrics = result.metrics
        print(f"{metrics['workers']} workers; final loss {metrics['loss']:.4f}; test accuracy "
              f"{metrics['accuracy']:.3f}; checkpoint {result.checkpoint.path if result.checkpoint else None}",
              flush=True)


if __name__ == "__main__":
    main()
