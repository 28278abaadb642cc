"""The warm path's AND across hosts over real sockets: N ranks' ``TcpRoundBoard``s in one process.

Each simulated rank has the engine's own :class:`horovod.engine.tcp_round_board.TcpRoundBoard`, connected to its
log2(N) partners by Unix socket pairs (the same frames and system calls as TCP, without the network). Rank 0 runs
in a forked process of its own, driven as the engine's drive loop drives it (post, drain whichever partner socket
is readable, take the result); this process drives the other N - 1 ranks the same way. Reported per round:

* rank 0's CPU (``time.thread_time`` from its post to its result, waits excluded), which is what grows with N if
  anything does;
* frames and bytes rank 0 sends (and every other rank: at most log2(N) + 1 frames each);
* the wall time of the whole simulated round, all N ranks' work on one thread — an upper bound for a real cycle,
  whose ranks run in parallel on their own hosts (there the critical path is log2(N) frame latencies).

Run from the repository root::

    python benchmarks/round_boards.py                    # N = 2 ... 1024 (the descriptors this machine allows)
    python benchmarks/round_boards.py --n 64 512 --rounds 50 --json out.json

"""
from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib.report import write_json  # noqa: E402
from horovod.engine.tcp_round_board import TcpRoundBoard, partners  # noqa: E402


def _connect(n: int) -> List[Dict[int, socket.socket]]:
    socks: List[Dict[int, socket.socket]] = [{} for _ in range(n)]
    for rank in range(n):
        for peer in partners(rank, n):
            if peer > rank:
                a, b = socket.socketpair()
                socks[rank][peer], socks[peer][rank] = a, b
    return socks


def _vectors(n: int, round_no: int, words: int) -> Tuple[List[np.ndarray], np.ndarray]:
    """Every rank's vector of ``round_no`` (the same on both sides of the fork) and their AND."""
    rng = np.random.default_rng(round_no)
    vectors = [rng.integers(0, 2**63, words, dtype=np.uint64) | np.uint64(1) for _ in range(n)]
    return vectors, np.bitwise_and.reduce(np.stack(vectors), axis=0)


def _selector(boards: Sequence[TcpRoundBoard]) -> selectors.BaseSelector:
    selector = selectors.DefaultSelector()
    for board in boards:
        for fd in board.fds:
            selector.register(fd, selectors.EVENT_READ, board)
    return selector


def _drive(selector: selectors.BaseSelector, boards: Sequence[TcpRoundBoard], r: int,
           timeout: float = 60.0) -> None:
    """Drain whichever board's socket is readable until every board has round ``r``'s AND (as the engine's drive
    loop: a board is asked for its result after its socket was drained)."""
    deadline = time.monotonic() + timeout
    pending = {board for board in boards if not board.complete(r)}
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"round {r} did not complete in {timeout:.0f} s")
        for key, _ in selector.select(1.0):
            board = key.data
            board.drain(key.fd)
            if board in pending and board.complete(r):
                pending.discard(board)


def _rank0(board: TcpRoundBoard, n: int, rounds: int, words: int, report: socket.socket) -> None:
    """Rank 0 in a process of its own (its code runs with its own caches, as on a real host)."""
    cpus, wrong = [], 0
    out = np.zeros(words, np.uint64)
    selector = _selector([board])
    for r in range(1, rounds + 1):
        vectors, expected = _vectors(n, r, words)
        t = time.thread_time()
        board.post(r, vectors[0])
        _drive(selector, [board], r)
        board.result(r, words, out)
        cpus.append(time.thread_time() - t)
        wrong += not np.array_equal(out, expected)
    report.sendall(json.dumps(dict(cpus=cpus, wrong=wrong, frames=board.frames_out, bytes=board.bytes_out))
                   .encode() + b"\n")


def measure(n: int, rounds: int, words: int = 19) -> dict:
    """Rank 0's median CPU per round (in a forked process) and the round's wall time with the other N - 1 ranks
    driven by this process; every rank's AND is checked against numpy."""
    socks = _connect(n)
    report_r, report_w = socket.socketpair()
    pid = os.fork()
    if pid == 0:   # rank 0
        try:
            for rank in range(1, n):
                for sock in socks[rank].values():
                    sock.close()
            _rank0(TcpRoundBoard(0, n, socks[0]), n, rounds, words, report_w)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            report_w.sendall(json.dumps(dict(error=repr(exc))).encode() + b"\n")
        finally:
            os._exit(0)
    for sock in socks[0].values():
        sock.close()
    boards = [TcpRoundBoard(rank, n, socks[rank]) for rank in range(1, n)]
    selector = _selector(boards)
    walls, wrong = [], 0
    out = np.zeros(words, np.uint64)
    try:
        for r in range(1, rounds + 1):
            vectors, expected = _vectors(n, r, words)
            wall = time.perf_counter()
            for board, vec in zip(boards, vectors[1:]):
                board.post(r, vec)
            _drive(selector, boards, r)
            walls.append(time.perf_counter() - wall)
            for board in boards:
                board.result(r, words, out)
                wrong += not np.array_equal(out, expected)
        line = report_r.makefile().readline()
    finally:
        os.waitpid(pid, 0)
        for board in boards:
            board.close()
    got = json.loads(line) if line else dict(error="rank 0's process reported nothing")
    if "error" in got:
        raise RuntimeError(f"N = {n}: rank 0 failed: {got['error']}")
    if wrong or got["wrong"]:
        raise RuntimeError(f"N = {n}: {wrong + got['wrong']} wrong ANDs")
    skip = min(2, rounds - 1)
    return dict(n=n, rank0_cpu_us=statistics.median(got["cpus"][skip:]) * 1e6,
                wall_ms=statistics.median(walls[skip:]) * 1e3, rank0_frames_out=got["frames"] / rounds,
                rank0_bytes_out=got["bytes"] / rounds)


def fds_needed(n: int) -> int:
    return sum(len(partners(rank, n)) for rank in range(n)) + 64


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4, 16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", help="write the records to this file")
    args = parser.parse_args(argv)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"{'N':>5} {'rank 0 CPU µs':>14} {'round wall ms (all N on one thread)':>36} {'rank 0 frames':>14} "
          f"{'rank 0 bytes':>13}")
    records = []
    for n in args.n:
        if fds_needed(n) > limit:
            print(f"{n:5d}  skipped: needs {fds_needed(n)} descriptors, the limit is {limit}")
            continue
        rec = measure(n, args.rounds)
        records.append(rec)
        print(f"{n:5d} {rec['rank0_cpu_us']:14.1f} {rec['wall_ms']:36.2f} {rec['rank0_frames_out']:14.0f} "
              f"{rec['rank0_bytes_out']:13.0f}", flush=True)
    if args.json:
        write_json(args.json, records)


if __name__ == "__main__":
    main()
