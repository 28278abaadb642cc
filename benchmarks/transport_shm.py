"""Benchmark the shared-memory transport: float32 sum-allreduce (and friends) from 8 bytes to 64 MiB.

Usage::

    python benchmarks/transport_shm.py                  # np = 2 and 4, allreduce
    python benchmarks/transport_shm.py --np 2 --op allgatherv --opt shm_spin_us=0

Prints, per size, the mean time per call (the slowest rank's), the algorithm bandwidth (bytes / time) and the bus
bandwidth (algbw scaled by the bytes each rank must move: 2(n-1)/n for allreduce, (n-1)/n for allgather and
reduce-scatter, 1 for broadcast), as in nccl-tests.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from horovod.transport.rendezvous import RendezvousClient, RendezvousServer  # noqa: E402
from horovod.transport.base import Bootstrap  # noqa: E402
from horovod.transport.shm import create_shm  # noqa: E402

SIZES = [8] + [4096 * 4 ** i for i in range(8)]  # 8 B, 4 KiB .. 64 MiB


def _bus_factor(op: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "allgatherv": (n - 1) / n, "reducescatter": (n - 1) / n,
            "broadcast": 1.0, "alltoallv": (n - 1) / n}[op]


def _run(t, op: str, nbytes: int, iters: int) -> float:
    n = max(1, nbytes // 4)
    size = t.size
    if op == "allreduce":
        buf = np.zeros(n, np.float32)  # repeated sums of anything else end in inf
        call = lambda: t.allreduce(buf)  # noqa: E731
    elif op == "broadcast":
        buf = np.ones(n, np.float32)
        call = lambda: t.broadcast(buf, 0)  # noqa: E731
    elif op == "allgatherv":
        per = max(1, n // size)
        send, recv = np.ones(per, np.float32), np.empty(per * size, np.float32)
        call = lambda: t.allgatherv(send, recv, [per] * size)  # noqa: E731
    elif op == "reducescatter":
        per = max(1, n // size)
        send, recv = np.ones(per * size, np.float32), np.empty(per, np.float32)
        call = lambda: t.reducescatter(send, recv, [per] * size)  # noqa: E731
    else:
        per = max(1, n // size)
        send, recv = np.ones(per * size, np.float32), np.empty(per * size, np.float32)
        call = lambda: t.alltoallv(send, [per] * size, recv, [per] * size)  # noqa: E731
    for _ in range(min(3, iters)):
        call()
    t.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def _worker(rank, size, port, secret, opts, op, sizes, budget, queue):
    store = RendezvousClient("127.0.0.1", port, secret)
    boot = Bootstrap(rank, size, local_rank=rank, local_size=size, store=store, secret=secret, scope="bench",
                     timeout=60, options=opts)
    t = create_shm(boot)
    try:
        for nbytes in sizes:
            # calibrate: every rank must run the same number of iterations, so rank 0's estimate is broadcast
            probe = np.array([_run(t, op, nbytes, 3)], np.float64)
            t.broadcast(probe, 0)
            iters = int(max(5, min(20000, budget / max(probe[0], 1e-7))))
            dt = np.array([_run(t, op, nbytes, iters)], np.float64)
            t.allreduce(dt, "max")
            if rank == 0:
                queue.put((nbytes, dt[0], iters))
    finally:
        t.close()
        if rank == 0:
            queue.put(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--op", default="allreduce",
                    choices=["allreduce", "broadcast", "allgatherv", "reducescatter", "alltoallv"])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per size")
    ap.add_argument("--opt", action="append", default=[], help="transport option key=value (int/float)")
    args = ap.parse_args()
    opts = {}
    for kv in args.opt:
        k, _, v = kv.partition("=")
        opts[k] = float(v) if "." in v else (int(v) if v.lstrip("-").isdigit() else v)
    ctx = mp.get_context("fork")
    for size in args.np:
        secret = secrets.token_bytes(16)
        with RendezvousServer(secret) as srv:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(r, size, srv.port, secret, opts, args.op, args.sizes,
                                                       args.budget, queue)) for r in range(size)]
            for p in procs:
                p.start()
            print(f"\n{args.op} float32, np = {size}, options {opts or 'default'} ({os.cpu_count()} cpus)")
            print(f"{'bytes':>12} {'iters':>7} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
            while True:
                item = queue.get(timeout=600)
                if item is None:
                    break
                nbytes, dt, iters = item
                algbw = nbytes / dt / 1e9
                print(f"{nbytes:>12} {iters:>7} {dt * 1e6:>12.1f} {algbw:>13.3f} "
                      f"{algbw * _bus_factor(args.op, size):>13.3f}", flush=True)
            for p in procs:
                p.join(60)


if __name__ == "__main__":
    main()
