"""Allreduce time and bandwidth of the built-in TCP transport on this machine.

Starts a rendezvous server and ``np`` local processes, then for each size times a float32 sum allreduce
(after warm-up) and prints, per size, the slowest rank's mean time, the algorithm bandwidth (bytes / time) and the
bus bandwidth (algbw * 2 (np - 1) / np, the figure comparable across world sizes, as in nccl-tests).

Usage:
    python benchmarks/transport_tcp.py                  # np = 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/transport_tcp.py --np 2 --min 8 --max 64M --iters 20
    python benchmarks/transport_tcp.py --op max --dtype float64 --option tcp_chunk_bytes=524288
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import secrets
import sys
import time
from typing import Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod.transport.rendezvous import RendezvousClient, RendezvousServer  # noqa: E402
from horovod.transport.base import Bootstrap  # noqa: E402
from horovod.transport.tcp import create_tcp  # noqa: E402


def _parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _sizes(lo: int, hi: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if s < (1 << 20) else 2
    if out[-1] != hi:
        out.append(hi)
    return out


def _iters_for(nbytes: int, base: int) -> int:
    if base:
        return base
    return max(5, min(2000, int(2e8 // max(nbytes, 1))))


def _worker(rank, size, addr, port, secret, args, q) -> None:
    try:
        store = RendezvousClient(addr, port, secret, timeout=60)
        boot = Bootstrap(rank, size, store=store, secret=secret, timeout=60, scope="bench",
                         options=args.options)
        t = create_tcp(boot)
        dtype = np.dtype(args.dtype)
        results: Dict[int, float] = {}
        for nbytes in _sizes(args.min, args.max):
            # Values that are fixed points of the op (0 + 0, 1 * 1) keep every iteration's data identical.
            fill = 1 if args.op == "product" else 0
            buf = np.full(max(1, nbytes // dtype.itemsize), fill, dtype=dtype)
            iters = _iters_for(nbytes, args.iters)
            for _ in range(max(2, iters // 10)):
                t.allreduce(buf, args.op)
            t.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                t.allreduce(buf, args.op)
            results[buf.nbytes] = (time.perf_counter() - t0) / iters
        t.barrier()
        t.close()
        q.put((rank, results))
    except BaseException as exc:  # report, do not hang the driver
        q.put((rank, exc))


def bench(np_: int, args) -> None:
    secret = secrets.token_bytes(16)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with RendezvousServer(secret) as server:
        procs = [ctx.Process(target=_worker, args=(r, np_, server.host, server.port, secret, args, q), daemon=True)
                 for r in range(np_)]
        for p in procs:
            p.start()
        per_rank = {}
        deadline = time.monotonic() + args.timeout
        try:
            while len(per_rank) < np_:
                rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
                if isinstance(res, BaseException):
                    raise SystemExit(f"rank {rank} failed: {res!r}")
                per_rank[rank] = res
        except queue.Empty:
            raise SystemExit(f"benchmark at np={np_} did not finish within {args.timeout} s") from None
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    print(f"\nallreduce {args.dtype} {args.op}, np={np_}, tcp transport (options {args.options or 'default'})")
    print(f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for nbytes in sorted(per_rank[0]):
        dt = max(per_rank[r][nbytes] for r in per_rank)
        algbw = nbytes / dt / 1e9
        busbw = algbw * 2 * (np_ - 1) / np_
        print(f"{nbytes:>12} {dt * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, action="append", help="world size (repeatable; default 2 and 4)")
    ap.add_argument("--min", type=_parse_size, default=4096, help="smallest message (e.g. 8, 4K, 1M)")
    ap.add_argument("--max", type=_parse_size, default=64 << 20, help="largest message (default 64M)")
    ap.add_argument("--iters", type=int, default=0, help="timed iterations per size (default: adaptive)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="sum", choices=["sum", "min", "max", "product"])
    ap.add_argument("--option", action="append", default=[], metavar="KEY=INT",
                    help="transport option, e.g. small_message_bytes=65536 or tcp_chunk_bytes=1048576")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds per world")
    args = ap.parse_args(argv)
    args.options = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    for np_ in args.np or [2, 4]:
        bench(np_, args)


if __name__ == "__main__":
    main()
