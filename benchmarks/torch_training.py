"""Training throughput: horovod.torch DistributedOptimizer vs torch DistributedDataParallel on Gloo.

    python benchmarks/torch_training.py                       # np = 2, both models
    python benchmarks/torch_training.py --np 2 --blocks 8 --block-steps 10 --models mlp --no-scaling

One ``horovodrun`` job runs both contenders in the same processes: every rank starts Horovod *and* a Gloo
``torch.distributed`` process group, builds two identical copies of the model (one with
``hvd.DistributedOptimizer``, one wrapped in ``DistributedDataParallel``) and then alternates blocks of training
steps between them (hvd, ddp, ddp, hvd, hvd, ddp, ...).  Same data, optimizer, threads and processes; a busy
machine slows both alike, so the comparison survives noise that separate runs would not.  Each block is timed
between barriers; the table reports the median samples/s of each side and the CPU time per step (all threads of
rank 0, which includes each library's background threads).  A second job of one process then gives the scaling
table (weak scaling: samples/s at np ÷ (np × samples/s of one process)); ``--threads-effect`` adds a job with
torch's own thread default (every rank sizes its pool for the whole host) against the launcher's.  Prints tables;
asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch as _launch  # noqa: E402

RESULT_TAG = "BENCH_RESULT "


# -- the workload, identical on both sides ---------------------------------------------------------------
def build(model_name: str):
    import torch

    torch.manual_seed(0)
    if model_name == "smallcnn":   # ~0.6 M parameters: compute-bound
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(), torch.nn.Linear(2048, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    if model_name == "mlp":        # ~4.2 M parameters (17 MB of gradients per step): communication-bound
        return torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    if model_name == "deepmlp":    # 66 parameter tensors of ~64 KB: bound by the cost of each gradient's collective
        layers = [torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 128), torch.nn.ReLU()]
        for _ in range(31):
            layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(128, 10))
    raise ValueError(f"unknown model {model_name!r}")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)

    results = {}
    for model_name in args.models.split(","):
        hvd_model = build(model_name)
        hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01, momentum=0.9),
                                           named_parameters=hvd_model.named_parameters())
        hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)
        ddp_model = torch.nn.parallel.DistributedDataParallel(build(model_name))
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
        # "local": the same model and optimizer with no communication at all, in the same processes: what the
        # machine gives np ranks that compute side by side (the ceiling of any data-parallel library here)
        local_model = build(model_name)
        local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
        sides = {"horovod": (hvd_model, hvd_opt), "ddp": (ddp_model, ddp_opt), "local": (local_model, local_opt)}

        def run_steps(side: str, steps: int) -> None:
            model, opt = sides[side]
            for _ in range(steps):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

        for side in sides:
            run_steps(side, args.warmup)
        rates = {side: [] for side in sides}
        cpu = {side: 0.0 for side in sides}
        for block in range(args.blocks):
            order = ["horovod", "ddp", "local"] if block % 2 == 0 else ["local", "ddp", "horovod"]
            for side in order:
                dist.barrier()
                wall, proc = time.perf_counter(), time.process_time()
                run_steps(side, args.block_steps)
                cpu[side] += time.process_time() - proc
                dist.barrier()
                rates[side].append(args.block_steps * args.batch_size * world / (time.perf_counter() - wall))
        steps = args.blocks * args.block_steps
        results[model_name] = {side: {"samples_per_sec": statistics.median(rates[side]), "blocks": rates[side],
                                      "cpu_ms_per_step": 1000.0 * cpu[side] / steps} for side in sides}
    if rank == 0:
        print(RESULT_TAG + json.dumps(results), flush=True)
    dist.destroy_process_group()


def run_job(args, np_: int, threads: int = 0, env_extra: Optional[dict] = None) -> dict:
    """One job of ``np_`` ranks running every model on both sides (``threads`` torch threads per rank, default
    ``--threads``); rank 0's results."""
    env = _launch.repo_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_launch.free_port()),
                            **(env_extra or {})})
    cmd = _launch.horovodrun_cmd(np_, [
        sys.executable, os.path.abspath(__file__), "--worker", "--models", args.models, "--batch-size",
        str(args.batch_size), "--blocks", str(args.blocks), "--block-steps", str(args.block_steps), "--warmup",
        str(args.warmup), "--threads", str(threads or args.threads)])
    # run_job kills the whole job (launcher and ranks) on timeout
    proc = _launch.run_job(cmd, env, args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if RESULT_TAG in ln), None)
    if not proc.ok or line is None:
        raise SystemExit(f"benchmark job (np={np_}) failed: {proc.describe()}")
    return json.loads(line.split(RESULT_TAG, 1)[1])


def print_scaling(results: dict, alone: dict, np_: int) -> None:
    """Weak scaling: np ranks against one process, and against np ranks that compute without communicating."""
    print(f"\nScaling at np={np_} (same batch and torch threads per process). *vs 1 process* = samples/s ÷ "
          f"({np_} × one process's samples/s; the mean of the sides there, which all do the same work alone); "
          f"*vs no communication* = samples/s ÷ the same ranks training without any collective, in the same "
          f"job (the machine's own ceiling for {np_} processes)\n")
    print("| model    | side             | np samples/s | vs 1 process | vs no communication |")
    print("|----------|------------------|-------------:|-------------:|--------------------:|")
    for model, res in results.items():
        one = statistics.mean(alone[model][side]["samples_per_sec"] for side in alone[model])
        ceiling = res["local"]["samples_per_sec"]
        for side, label in (("horovod", "horovod.torch"), ("ddp", "DDP+Gloo"), ("local", "no communication")):
            many = res[side]["samples_per_sec"]
            print(f"| {model:<8} | {label:<16} | {many:>12.1f} | {many / (np_ * one):>11.0%} | "
                  f"{many / ceiling:>18.0%} |")
    print("\none process, samples/s: " + json.dumps({m: {s: round(r[s]["samples_per_sec"]) for s in r}
                                                     for m, r in alone.items()}))


def print_threads_effect(results: dict, crowded: dict, args) -> None:
    """The launcher's thread default against torch's own (every rank sizing its pool for the whole host)."""
    cores = os.cpu_count() or 1
    print(f"\nThreads: {args.threads} torch thread(s) per rank (the launcher's OMP_NUM_THREADS default, workers "
          f"bound to their cores) against {cores} per rank (torch's default when OMP_NUM_THREADS is unset; "
          f"unbound), np={args.np}\n")
    print("| model    | side          | default threads samples/s | torch's default samples/s | speed-up |")
    print("|----------|---------------|--------------------------:|--------------------------:|---------:|")
    for model, res in results.items():
        for side, label in (("horovod", "horovod.torch"), ("ddp", "DDP+Gloo")):
            ours, theirs = res[side]["samples_per_sec"], crowded[model][side]["samples_per_sec"]
            print(f"| {model:<8} | {label:<13} | {ours:>25.1f} | {theirs:>25.1f} | {ours / theirs:>7.2f}× |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _launch.add_training_args(parser, models="smallcnn,mlp,deepmlp", blocks=8, block_steps=10, timeout=900,
                              framework="torch", order="alternating")
    parser.add_argument("--no-scaling", dest="scaling", action="store_false",
                        help="skip the one-process run that the scaling table compares against")
    parser.add_argument("--threads-effect", action="store_true",
                        help="also run with torch's default threads (all cores per rank) to show what the "
                             "launcher's OMP_NUM_THREADS default is worth")
    args = parser.parse_args(argv)
    _launch.resolve_threads(args)
    if args.worker:
        return worker(args)

    results = run_job(args, args.np)
    print(f"\nnp={args.np}, batch {args.batch_size}/rank, {args.blocks} alternating blocks of {args.block_steps} "
          f"steps per side (+{args.warmup} warm-up), {args.threads} torch thread(s)/rank, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| model    | horovod.torch samples/s | DDP+Gloo samples/s | ratio hvd/DDP | "
          "hvd CPU ms/step | DDP CPU ms/step |")
    print("|----------|------------------------:|-------------------:|--------------:|"
          "----------------:|----------------:|")
    for model, res in results.items():
        h, d = res["horovod"], res["ddp"]
        print(f"| {model:<8} | {h['samples_per_sec']:>23.1f} | {d['samples_per_sec']:>18.1f} | "
              f"{h['samples_per_sec'] / d['samples_per_sec']:>13.2f} | {h['cpu_ms_per_step']:>15.1f} | "
              f"{d['cpu_ms_per_step']:>15.1f} |")
    print("\nper-block samples/s: " + json.dumps({m: {s: [round(v) for v in r[s]["blocks"]] for s in r}
                                                  for m, r in results.items()}))
    if args.chart:
        from benchmarks import charts
        from benchmarks._lib.report import chart_note

        charts.throughput(results, {"horovod": "horovod.torch", "ddp": "DDP + Gloo", "local": "no communication"},
                          args.chart, title=f"torch training, np = {args.np}, batch {args.batch_size}/rank",
                          note=chart_note(f"{args.blocks} blocks of {args.block_steps} steps per side"))
    if args.scaling and args.np > 1:
        print_scaling(results, run_job(args, 1), args.np)
    if args.threads_effect:
        cores = os.cpu_count() or 1
        crowded = run_job(args, args.np, threads=cores, env_extra={"OMP_NUM_THREADS": str(cores)})
        print_threads_effect(results, crowded, args)


if __name__ == "__main__":
    main()
