"""Allreduce through :class:`horovod.transport.mpi.MpiTransport` next to raw mpi4py, 4 KiB .. 64 MiB.

Run: ``mpirun -np 2 python benchmarks/transport_mpi.py [--dtype float32] [--min-bytes 4096] [--max-bytes 64Mi]``
(as root add ``--allow-run-as-root``; above 2 ranks on this machine add ``--oversubscribe``).

Prints one row per message size: mean time per allreduce (the slowest rank's), algorithm bandwidth
(bytes / time) and bus bandwidth (algbw x 2(n-1)/n, the traffic a ring moves per link), for both paths.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpi4py import MPI  # noqa: E402  (after the path tweak, so the checkout is used)

from horovod.transport.base import Bootstrap  # noqa: E402
from horovod.transport.mpi import create_mpi  # noqa: E402


def parse_bytes(text: str) -> int:
    units = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    low = text.strip().lower().rstrip("b")
    for suffix, factor in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * factor)
    return int(low)


def timed(comm, fn, seconds: float) -> float:
    """Mean seconds per call of ``fn`` on the slowest rank; every rank runs the same number of calls."""
    for _ in range(3):
        fn()
    comm.Barrier()
    start = time.perf_counter()
    fn()
    probe = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    iters = max(5, min(10_000, int(seconds / max(probe, 1e-7))))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="numpy dtype to reduce (default float32)")
    parser.add_argument("--min-bytes", default="4Ki", type=parse_bytes)
    parser.add_argument("--max-bytes", default="64Mi", type=parse_bytes)
    parser.add_argument("--float16", default="numpy", choices=["numpy", "native", "upcast"],
                        help="how MpiTransport reduces float16 (see MpiTransport)")
    parser.add_argument("--seconds", default=0.3, type=float, help="measuring time per size and path")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    transport = create_mpi(Bootstrap(rank, size, options={"mpi_comm": world, "mpi_float16": args.float16}))
    raw = world.Dup()
    dtype = np.dtype(args.dtype)
    bus = 2 * (size - 1) / size if size > 1 else 1.0

    if rank == 0:
        print(f"# allreduce sum, {dtype}, np={size}, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"thread level {MPI.Query_thread()}, float16 via {transport.float16}")
        print(f"{'bytes':>10} | {'MpiTransport us':>15} {'algbw GB/s':>10} {'busbw GB/s':>10} | "
              f"{'mpi4py us':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} | {'ratio':>5}")
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        n = max(1, nbytes // dtype.itemsize)
        # zeros: repeated sums never overflow, so no inf/NaN slow paths distort the timing
        a = np.zeros(n, dtype=dtype)
        b = np.zeros(n, dtype=dtype)
        t_ours = timed(world, lambda: transport.allreduce(a, "sum"), args.seconds)
        t_raw = timed(world, lambda: raw.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), args.seconds)
        if rank == 0:
            real = n * dtype.itemsize
            ours_bw, raw_bw = real / t_ours / 1e9, real / t_raw / 1e9
            print(f"{real:>10} | {t_ours * 1e6:>15.1f} {ours_bw:>10.2f} {ours_bw * bus:>10.2f} | "
                  f"{t_raw * 1e6:>10.1f} {raw_bw:>10.2f} {raw_bw * bus:>10.2f} | {t_raw / t_ours:>5.2f}",
                  flush=True)
        nbytes *= 4
    transport.close()
    raw.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
