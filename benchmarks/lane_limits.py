"""The fast lane's limit per kind: each collective on the board against the same collective off it, in one job.

Usage::

    python benchmarks/lane_limits.py                       # np = 2 and 4, 256 KiB .. 1 MiB
    python benchmarks/lane_limits.py --np 4 --sizes 384K,768K --rounds 16
    python benchmarks/lane_limits.py --transport tcp        # the lane over TCP (its board: frames among partners)

A lone blocking allgather, broadcast, alltoall or reducescatter up to its kind's limit (``FastLane.limits``) is
agreed and carried out on the lane's board in one synchronisation; above it the lane only agrees and the data plane
carries the data. Which is faster depends on the kind and the size, so this measures both *in one job*: batches
alternate between the limits as they are (``board``) and every kind's limit lowered to the allreduce's (``plane``:
what the other kinds had before session 17), every rank switching at the same point, so that the machine's noise
hits both alike. Per kind and size: the median over rounds of rank 0's mean time per call in a batch (``horovodrun
-np N``, shm or ``--transport tcp``, ``horovod.numpy``), and board ÷ plane. The results are checked against numpy
once per kind and size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch  # noqa: E402
from benchmarks._lib.measure import format_size, parse_size  # noqa: E402
from benchmarks._lib.report import header, table  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
KINDS = ("allgather", "broadcast", "alltoall", "reducescatter")


def worker(sizes: Sequence[int], rounds: int, batch: int) -> None:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics
    from horovod.engine import ops

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    lane = basics.runtime().state.lane
    assert lane is not None, "the fast lane is off (HOROVOD_FAST_LANE=0?)"
    board = dict(lane.limits)
    plane = {kind: min(limit, lane.limit) for kind, limit in board.items()}
    out = []
    for nbytes in sizes:
        n = nbytes // 4 // size * size   # float32 elements, a multiple of the ranks
        mine = np.arange(n // size, dtype=np.float32) + rank
        bcast = np.arange(n, dtype=np.float32) + rank
        send = np.arange(n, dtype=np.float32).reshape(-1, 1) + rank
        rs = np.arange(n, dtype=np.float32)
        calls = {"allgather": lambda: hvd.allgather(mine, name="ag"),
                 "broadcast": lambda: hvd.broadcast_(bcast, root_rank=0, name="bc"),
                 "alltoall": lambda: hvd.alltoall(send, name="a2a"),
                 "reducescatter": lambda: hvd.reducescatter(rs, name="rs", op=hvd.Sum)}
        payload = {"allgather": n // size * 4, "broadcast": n * 4, "alltoall": n * 4,
                   "reducescatter": n * 4}   # the bytes of a rank's tensor its kind's limit applies to
        block = n // size
        expected = {"allgather": np.concatenate([np.arange(block, dtype=np.float32) + r for r in range(size)]),
                    "broadcast": np.arange(n, dtype=np.float32),
                    "alltoall": np.concatenate([np.arange(rank * block, (rank + 1) * block, dtype=np.float32) + r
                                                for r in range(size)]).reshape(-1, 1),
                    "reducescatter": size * np.arange(rank * block, (rank + 1) * block, dtype=np.float32)}
        for kind in KINDS:
            call = calls[kind]
            result = call()
            if not np.array_equal(bcast if kind == "broadcast" else result, expected[kind]):
                raise SystemExit(f"{kind} of {nbytes} bytes: WRONG result on rank {rank}")
            times = {"board": [], "plane": []}
            for r in range(rounds):
                for mode in (("board", "plane") if r % 2 else ("plane", "board")):
                    lane.limits.update(board if mode == "board" else plane)
                    hvd.allreduce(np.zeros(1), name="bench.sync")
                    start = time.perf_counter()
                    for _ in range(batch):
                        call()
                    times[mode].append((time.perf_counter() - start) / batch)
            lane.limits.update(board)
            out.append({"kind": kind, "bytes": nbytes, "board_s": float(np.median(times["board"])),
                        "plane_s": float(np.median(times["plane"])),
                        "on_board": payload[kind] <= board[getattr(ops, kind.upper())]})
    if rank == 0:
        print(RESULT_TAG + json.dumps({"np": size, "rows": out}), flush=True)
    hvd.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--sizes", default="256K,512K,768K,1M", help="buffer sizes (nccl-tests sizes), comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"),
                    help="HOROVOD_TRANSPORT of the job: shm (the lane's board in shared memory) or tcp (over TCP)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.rounds, args.batch)
        return 0
    for key, value in header(argv if argv is not None else sys.argv[1:]).items():
        print(f"- {key}: {value}")
    for np_ in [int(v) for v in args.np.split(",")]:
        cmd = launch.horovodrun_cmd(np_, [sys.executable, os.path.abspath(__file__), "--worker", "--sizes",
                                          args.sizes, "--rounds", str(args.rounds), "--batch", str(args.batch)])
        res = launch.run_job(cmd, launch.repo_env({"HOROVOD_TRANSPORT": args.transport}), args.timeout)
        line = next((ln for ln in res.stdout.splitlines() if RESULT_TAG in ln), None)
        if not res.ok or line is None:
            print(f"\nnp = {np_}: the job failed: {res.describe()}")
            return 1
        data = json.loads(line.split(RESULT_TAG, 1)[1])
        rows = [[r["kind"], format_size(r["bytes"]), "yes" if r["on_board"] else "no",
                 f"{r['board_s'] * 1e6:.0f} µs", f"{r['plane_s'] * 1e6:.0f} µs", f"{r['board_s'] / r['plane_s']:.2f}"]
                for r in data["rows"]]
        print(f"\nnp = {np_} ({args.transport}; board = the limits as they are, plane = every kind at the allreduce's "
              f"limit):\n")
        print("\n".join(table(["collective", "size", "on the board", "board", "plane", "board ÷ plane"], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
