"""Allreduce on CUDA tensors: horovod against torch.distributed, same GPU(s), same run.

    python benchmarks/gpu.py                      # every configuration this machine can run
    python benchmarks/gpu.py --sizes-mib 1,16,256 --np 1,2

For each process count it runs, one after the other, horovod (``horovod.torch`` on CUDA tensors, NCCL or
host-staged as the engine chooses) and torch.distributed (NCCL where it can take the ranks, Gloo on CUDA tensors
where two ranks share one GPU on an NCCL older than 2.30), and prints algorithm and bus bandwidth per size
(bus bandwidth = bytes × 2(n-1)/n ÷ time, NCCL's own definition; at np = 1 the algorithm bandwidth is shown).
Each timing is the median of rounds of back-to-back in-place float32 allreduces ended by one device synchronize.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int) -> int:
    return max(3, min(50, (256 * MIB) // max(nbytes, 1)))


def _time(op, sync, nbytes: int, rounds: int = 5) -> float:
    """Median seconds per allreduce of ``nbytes``."""
    n = _iters(nbytes)
    op()
    sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            op()
        sync()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def worker(impl: str, sizes, backend: str) -> None:
    import torch

    if impl == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size, local = hvd.rank(), hvd.size(), hvd.local_rank()
    else:
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = rank
    torch.cuda.set_device(local % torch.cuda.device_count())
    if impl != "horovod":
        dist.init_process_group(backend, rank=rank, world_size=size)
    rows = []
    for mib in sizes:
        t = torch.ones(int(mib * MIB) // 4, dtype=torch.float32, device="cuda")
        if impl == "horovod":
            op = lambda: hvd.allreduce_(t, op=hvd.Sum, name="bench")   # noqa: E731
        else:
            op = lambda: dist.all_reduce(t)                             # noqa: E731
        seconds = _time(op, torch.cuda.synchronize, t.numel() * 4)
        rows.append({"mib": mib, "seconds": seconds})
    mode = ""
    if impl == "horovod":
        from horovod.engine import state

        mode = state.runtime().executor.devices.mode(0) or ""
        hvd.shutdown()
    else:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps({"impl": impl, "np": size, "mode": mode or backend, "rows": rows}), flush=True)


def _launch(impl: str, np_: int, sizes, backend: str, env_extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    args = [os.path.abspath(__file__), "--worker", impl, "--backend", backend,
            "--sizes-mib", ",".join(str(s) for s in sizes)]
    if impl == "horovod":
        cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable] + args
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)]
    else:
        port = _free_port()
        procs = [subprocess.Popen([sys.executable] + args, stdout=subprocess.PIPE, text=True,
                                  env=dict(env, RANK=str(r), WORLD_SIZE=str(np_), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port)))
                 for r in range(np_)]
    result = None
    for p in procs:
        out, _ = p.communicate(timeout=600)
        for line in out.splitlines():
            if "RESULT " in line:
                result = json.loads(line.split("RESULT ", 1)[1])
        if p.returncode:
            print(f"{impl} np={np_} ({backend}) failed with exit code {p.returncode}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    parser.add_argument("--np", default="1,2")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.backend)
        return
    import torch

    from horovod.common.basics import nccl_built

    version = nccl_built()
    print(f"device: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
          f"NCCL {version}")
    results = []
    for np_ in [int(n) for n in args.np.split(",")]:
        shares_gpu = np_ > torch.cuda.device_count()
        configs = [("horovod", "nccl", {})]
        if shares_gpu and version >= 23000:
            configs = [("horovod", "nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}),
                       ("torch.distributed", "nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}),
                       ("horovod", "host", {"HOROVOD_GPU_OPERATIONS": "HOST"})]
        elif shares_gpu:
            configs += [("torch.distributed", "gloo", {})]
        else:
            configs += [("torch.distributed", "nccl", {})]
        for impl, backend, extra in configs:
            res = _launch(impl, np_, sizes, backend, extra)
            if res:
                results.append(res)
    print()
    print("| implementation | np | data plane | size | time | algbw GB/s | busbw GB/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for res in results:
        n = res["np"]
        for row in res["rows"]:
            nbytes = row["mib"] * MIB
            alg = nbytes / row["seconds"] / 1e9
            bus = alg * (2 * (n - 1) / n) if n > 1 else alg
            print(f"| {res['impl']} | {n} | {res['mode']} | {row['mib']:g} MiB | {row['seconds'] * 1e3:.3f} ms | "
                  f"{alg:.1f} | {bus:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
