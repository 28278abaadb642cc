"""GPU training throughput: horovod.torch DistributedOptimizer against DistributedDataParallel on NCCL.

    python benchmarks/gpu_training.py                          # np = 1 and 2, ResNet-style and transformer-style
    python benchmarks/gpu_training.py --np 2 --models resnet --blocks 6 --block-steps 10 --json out.json
    python benchmarks/gpu_training.py --device cpu --np 1 --models tiny --blocks 2 --block-steps 2   # smoke (Gloo)

One ``horovodrun`` job per process count runs both contenders in the same processes: every rank starts Horovod and
an NCCL ``torch.distributed`` process group, builds two identical copies of the model (one under
``hvd.DistributedOptimizer``, one wrapped in ``DistributedDataParallel``) and alternates blocks of training steps
between them (hvd, ddp, ddp, hvd, ...), each block timed between device synchronizations, so load and clocks hit
both alike.  Both sides use one NCCL: run with ``HOROVOD_NCCL_SO_PATH=X LD_PRELOAD=X`` (torch's own NCCL is then
the same library; tests/gpu/device_check.sh does).  Two ranks on one GPU need NCCL >= 2.30 and
``NCCL_MULTI_RANK_GPU_ENABLE=1``: they time-slice the GPU, so the ratio compares the libraries' overheads, not
scaling.  Reported per model: samples/s of each side, the ratio (goal >= 0.95), CPU ms per step, and the host time
of one small allreduce call on each side (back-to-back calls, one synchronize at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "GPU_TRAINING_RESULT "


def build(name: str):
    """The models: ``resnet`` (ResNet-18-style, 11 M parameters, 32x32 images), ``transformer`` (6 encoder layers,
    d = 512, 19 M parameters, 128 tokens), ``tiny`` (a smoke test's)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU(), nn.Linear(32, 10)), "image"
    if name == "resnet":
        class Block(nn.Module):
            def __init__(self, cin: int, cout: int, stride: int):
                super().__init__()
                self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                          nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
                self.skip = (nn.Identity() if stride == 1 and cin == cout else
                             nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

            def forward(self, x):
                return torch.relu(self.body(x) + self.skip(x))

        layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
        return nn.Sequential(*layers), "image"
    if name == "transformer":
        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(1000, 512)
                layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, 6)
                self.head = nn.Linear(512, 10)

            def forward(self, tokens):
                return self.head(self.encoder(self.embed(tokens)).mean(1))

        return Encoder(), "tokens"
    raise ValueError(f"unknown model {name!r} (resnet, transformer, tiny)")


def _batch(kind: str, n: int, device):
    import torch

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(n, 3, 32, 32, generator=gen) if kind == "image"
         else torch.randint(0, 1000, (n, 128), generator=gen))
    return x.to(device), torch.randint(0, 10, (n,), generator=gen).to(device)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    results = {}
    for name in args.models.split(","):
        model, kind = build(name)
        x, y = _batch(kind, args.batch_size, device)
        ours = model.to(device)
        theirs, _ = build(name)
        theirs = torch.nn.parallel.DistributedDataParallel(theirs.to(device), device_ids=[device.index] if cuda
                                                           else None)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01),
                                       named_parameters=ours.named_parameters())
        hvd.broadcast_parameters(ours.state_dict(), root_rank=0)
        ddp_opt = torch.optim.SGD(theirs.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step_hvd():
            opt.zero_grad()
            loss_fn(ours(x), y).backward()
            opt.step()

        def step_ddp():
            ddp_opt.zero_grad()
            loss_fn(theirs(x), y).backward()
            ddp_opt.step()

        sides = {"horovod": step_hvd, "ddp": step_ddp}
        for fn in sides.values():
            for _ in range(args.warmup):
                fn()
        sync()
        samples = {s: [] for s in sides}
        cpu = {s: [] for s in sides}
        order = ["horovod", "ddp", "ddp", "horovod"] * ((args.blocks + 1) // 2)
        for side in order[:2 * args.blocks]:
            dist.barrier()
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(args.block_steps):
                sides[side]()
            sync()
            took = time.perf_counter() - start
            samples[side].append(args.block_steps * args.batch_size * size / took)
            cpu[side].append(1e3 * (time.process_time() - cpu_start) / args.block_steps)
        results[name] = {s: {"samples_per_sec": statistics.median(samples[s]),
                             "cpu_ms_per_step": statistics.median(cpu[s]), "blocks": samples[s]} for s in sides}
    small = torch.ones(256, device=device)
    calls = {}
    for side, call in (("horovod", lambda: hvd.allreduce_(small, name="host.cost")),
                       ("ddp", lambda: dist.all_reduce(small))):
        for _ in range(20):
            call()
        sync()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = time.perf_counter() - start
        sync()
        calls[side] = 1e6 * host / args.calls
    from horovod.engine import state

    mode = state.runtime().executor.devices.mode(0) if cuda else "host"
    dist.destroy_process_group()
    hvd.shutdown()
    if rank == 0:
        print(RESULT_TAG + json.dumps({"np": size, "mode": mode, "models": results, "host_us_per_call": calls}),
              flush=True)


def run_job(args, np_: int) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + np_ + (os.getpid() % 1000)))
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, os.path.abspath(__file__),
           "--worker", "--device", args.device, "--models", args.models, "--batch-size", str(args.batch_size),
           "--blocks", str(args.blocks), "--block-steps", str(args.block_steps), "--warmup", str(args.warmup),
           "--calls", str(args.calls)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if RESULT_TAG in line:
            return json.loads(line.split(RESULT_TAG, 1)[1])
    raise RuntimeError(f"np={np_}: no result (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--np", default="1,2")
    parser.add_argument("--models", default="resnet,transformer")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per side")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calls", type=int, default=500, help="small allreduces timed for the host cost per call")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("SKIPPED: no CUDA device here (--device cpu runs the same comparison on the CPU, on Gloo)")
            return 0
    runs = [run_job(args, int(n)) for n in args.np.split(",")]
    device = "cpu"
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name(0)
    print(f"\n{device}, batch {args.batch_size}/rank, {args.blocks} blocks of {args.block_steps} steps per side, "
          f"NCCL_MULTI_RANK_GPU_ENABLE={os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE', '')}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| model | np | hvd data plane | horovod.torch samples/s | DDP samples/s | ratio | hvd CPU ms/step | "
          "DDP CPU ms/step | hvd host µs/call | DDP host µs/call |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        for model, res in run["models"].items():
            h, d = res["horovod"], res["ddp"]
            print(f"| {model} | {run['np']} | {run['mode']} | {h['samples_per_sec']:.1f} | {d['samples_per_sec']:.1f} "
                  f"| {h['samples_per_sec'] / d['samples_per_sec']:.2f} | {h['cpu_ms_per_step']:.1f} | "
                  f"{d['cpu_ms_per_step']:.1f} | {run['host_us_per_call']['horovod']:.0f} | "
                  f"{run['host_us_per_call']['ddp']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
