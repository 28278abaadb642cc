"""What a very large allreduce costs: in place, into a new result, and against touching that much fresh memory.

Usage::

    python benchmarks/big_result.py                      # 2 GiB float32 per rank, np = 2, 3 rounds
    python benchmarks/big_result.py --size 256M --rounds 2 --chart big.png

The question: a 2 GiB allreduce into a *new* result takes about twice as long as in place.  Is that the
collective, or the kernel handing out 2 GiB of fresh pages?  One ``horovodrun`` job (np ranks on this host), every
rank at once, each phase between barriers, the slowest rank's time:

- *first touch*: the first time each process allocates and writes ``--size`` of memory (before anything else);
- *in place*: ``hvd.allreduce_(x)`` on the resident input;
- *new result*: ``hvd.allreduce(x)``: the same reduction into an array allocated by the call (then freed);
- *touch, recycled*: ``np.empty_like(x)`` filled with zeros, after the earlier phases freed that much memory.

Rounds alternate the order of the last three; the first round also pays the data plane's first use of that size
(the range column shows it).  Around every phase rank 0 reads ``/proc/vmstat``'s
``compact_stall`` (the kernel stopped an allocation to compact memory) and ``thp_fault_fallback`` (a huge page
was wanted and not found): a first touch that meets fragmented memory shows up there.  The results are checked
against numpy once.  Memory: up to 3 × ``--size`` per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch  # noqa: E402
from benchmarks._lib.measure import GIB, fmt_time, format_size, parse_size, summarize  # noqa: E402
from benchmarks._lib.report import header, table, write_json  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
PHASES = ("first touch", "in place", "new result", "touch, recycled")
VMSTAT = ("compact_stall", "thp_fault_fallback")
STRIDE = 4099  # checked elements: a prime stride, so every chunk boundary of the data plane is crossed


def vmstat() -> Dict[str, int]:
    """The counters of VMSTAT (0 where this kernel does not have them)."""
    out = {k: 0 for k in VMSTAT}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in out:
                    out[key] = int(value)
    except OSError:
        pass
    return out


def worker(nbytes: int, rounds: int) -> None:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    n = nbytes // 4
    x: Optional[np.ndarray] = None
    error = None

    def first_touch() -> None:
        nonlocal x
        x = np.empty(n, np.float32)
        x.fill(1.0)

    def check(what: str, got, want) -> None:
        # a strided sample of the result: a full comparison would allocate another --size of memory
        nonlocal error
        if error is None and not np.array_equal(got[::STRIDE], want):
            error = f"rank {rank}: {what}: the result differs from numpy's (every {STRIDE}th element compared)"

    def in_place() -> None:
        want = x[::STRIDE] * np.float32(size)
        hvd.allreduce_(x, op=hvd.Sum, name="big.inplace")
        check("in place", x, want)

    def new_result() -> None:
        y = hvd.allreduce(x, op=hvd.Sum, name="big.new")
        check("new result", y, x[::STRIDE] * np.float32(size))
        del y

    def touch_recycled() -> None:
        y = np.empty_like(x)
        y.fill(0.0)
        del y

    calls = {"first touch": first_touch, "in place": in_place, "new result": new_result,
             "touch, recycled": touch_recycled}
    samples: Dict[str, List[float]] = {p: [] for p in PHASES}
    counters: Dict[str, Dict[str, int]] = {p: {k: 0 for k in VMSTAT} for p in PHASES}

    def timed(phase: str) -> None:
        hvd.barrier()
        before = vmstat()
        t0 = time.perf_counter()
        calls[phase]()
        dt = time.perf_counter() - t0
        worst = hvd.allreduce(np.array([dt]), op=hvd.Max, name=f"big.time.{phase}")  # the slowest rank
        hvd.barrier()
        after = vmstat()
        samples[phase].append(float(worst[0]))
        for k in VMSTAT:
            counters[phase][k] += after[k] - before[k]

    timed("first touch")
    later = list(PHASES[1:])
    for r in range(rounds):
        for phase in (later if r % 2 == 0 else later[::-1]):
            timed(phase)
    if rank == 0:
        print(RESULT_TAG + json.dumps({"np": size, "bytes": nbytes, "samples_s": samples, "vmstat": counters,
                                       "error": error}), flush=True)
    hvd.shutdown()


def render(data: dict, info: Dict[str, str]) -> str:
    lines = [f"# A {format_size(data['bytes'])} float32 allreduce, np = {data['np']}", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items()] + [""]
    rows = []
    for phase in PHASES:
        s = data["samples_s"][phase]
        if not s:
            continue
        stats = summarize(s)
        med = stats["median_s"]
        rows.append([phase, fmt_time(med), f"{fmt_time(stats['min_s'])} – {fmt_time(stats['max_s'])}", str(len(s)),
                     f"{data['bytes'] / med / 1e9:.2f}",
                     *(str(data["vmstat"][phase][k]) for k in VMSTAT)])
    lines += table(["phase", "median (slowest rank)", "range", "samples", "GB/s per rank", *VMSTAT], rows)
    if data.get("error"):
        lines += ["", f"**Wrong result**: {data['error']}"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=2 * GIB, help="bytes per rank (default 2G)")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of in place / new result / recycled touch")
    ap.add_argument("--transport", default="shm", help="HOROVOD_TRANSPORT of the job (default shm)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the samples and counters to this file")
    ap.add_argument("--chart", default=None, metavar="FILE.png", help="draw the median of each phase (matplotlib)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.size, args.rounds)
        return 0
    info = header(argv)
    cmd = launch.horovodrun_cmd(args.np, [sys.executable, os.path.abspath(__file__), "--worker", "--size",
                                          str(args.size), "--rounds", str(args.rounds)], ["--start-timeout", "120"])
    res = launch.run_job(cmd, launch.repo_env({"HOROVOD_TRANSPORT": args.transport}), args.timeout)
    line = next((ln for ln in res.stdout.splitlines() if RESULT_TAG in ln), None)  # after horovodrun's [0] prefix
    if not res.ok or line is None:
        raise SystemExit(f"the big-result job failed: {res.describe()}")
    data = json.loads(line.split(RESULT_TAG, 1)[1])
    info["load average"] += f", {os.getloadavg()[0]:.2f} at end (1-minute)"
    sys.stdout.write(render(data, info))
    if args.json:
        write_json(args.json, {"info": info, **data})
    if args.chart:
        from benchmarks import charts

        medians = {p: summarize(data["samples_s"][p])["median_s"] for p in PHASES if data["samples_s"][p]}
        charts.bars({format_size(data["bytes"]): medians}, args.chart, ylabel="seconds (slowest rank)",
                    title=f"{format_size(data['bytes'])} float32 allreduce, np = {data['np']}",
                    note=f"{info['date']}; load average {info['load average']}")
    return 1 if data.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
