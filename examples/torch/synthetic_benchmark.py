"""Synthetic training throughput with horovod.torch (images/sec per rank and in total).

    horovodrun -np 2 python examples/torch/synthetic_benchmark.py
    horovodrun -np 2 python examples/torch/synthetic_benchmark.py --model mlp --fp16-allreduce

Random 32x32 images and labels, a model defined below, DistributedOptimizer with the usual Horovod setup
(broadcast of the initial parameters and optimizer state).  torchvision is not needed.
"""
from __future__ import annotations

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd


class SmallCNN(torch.nn.Module):
    """Three conv blocks and a classifier: enough compute for communication to overlap with."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4))
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(128 * 4 * 4, 256), torch.nn.ReLU(), torch.nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class MLP(torch.nn.Module):
    """A wide fully connected network: little compute, many gradient bytes (communication-bound)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.net(x)


MODELS = {"smallcnn": SmallCNN, "mlp": MLP}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="smallcnn", choices=sorted(MODELS), help="model to benchmark")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=5, help="number of warm-up batches")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iter")
    parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch intra-op threads per rank (0: the cores of this host divided among its ranks)")
    parser.add_argument("--use-adasum", action="store_true", default=False, help="use Adasum instead of averaging")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    torch.manual_seed(1234)

    model = MODELS[args.model]()
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()} (torch threads per rank: {threads})")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for it in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{it}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)

    mean, conf = float(np.mean(img_secs)), 1.96 * float(np.std(img_secs))
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
