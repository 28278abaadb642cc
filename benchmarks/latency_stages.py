"""Where the time of one small allreduce goes: per-stage timestamps on both ranks of an np = 2 job.

Usage::

    python benchmarks/latency_stages.py                 # patterns: back to back, 1 ms compute before each
    python benchmarks/latency_stages.py --calls 1000 --transport shm
    python benchmarks/latency_stages.py --python-overhead [--against /path/to/other/checkout]
    python benchmarks/latency_stages.py --hot-path-calls [--transport shm,tcp] [--collectives allreduce,allgather]

Each rank stamps ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, one clock for every process of the machine) at the
stages of an 8-byte ``horovod.numpy.allreduce``, once on each path such a call can take. On the *fast lane* (the
default on one host): the call starts; the rank's entry is on the board; every rank's entry has been seen; the
rank has reduced the payloads; the call returns. Through the *coordinator* (``HOROVOD_FAST_LANE=0``): the call
starts; the worker's request leaves (``send``); rank 0 reads it (``receive``); rank 0's responses leave
(``broadcast``); the worker reads them; each call returns. A ``select`` that blocked and woke up is stamped too.
The stamps come from wrapping those engine methods for the length of the job (a diagnostic: it adds a few
microseconds per stage). The table shows the median time of each stamp after the earlier of the two calls
started, and the median call time per rank.

``--hot-path-calls`` counts (cProfile, deterministic) the Python function calls each rank's calling thread makes
per warm blocking 4 KiB collective at np = 2 (allreduce, or each of ``--collectives``), by layer, with the busiest
functions (:mod:`benchmarks._lib.hot_calls`).

``--python-overhead`` asks a narrower question: what the Python above the engine costs per call. At np = 1 (the
engine has nobody to wait for) it times the same 8-byte allreduce through the engine API alone and through each
binding entry point, interleaved in one process, and counts with cProfile the function calls each layer makes
(binding, ``horovod/common``, engine API, runtime). ``--against DIR`` measures another checkout's ``horovod`` in
alternating runs (e.g. ``git archive <rev> horovod | tar -x -C DIR`` for a before/after table).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import hot_calls, launch, overhead  # noqa: E402
from benchmarks._lib.report import header, table  # noqa: E402

PATTERNS = {"b2b": "back to back", "compute": "1 ms compute before each"}
PATHS = {"lane": ("fast lane", "1"), "coordinator": ("coordinator, HOROVOD_FAST_LANE=0", "0")}
STAGES = [("start", "call starts"), ("posted", "entry on the lane board"), ("decided", "every rank's entry seen"),
          ("reduced", "payloads reduced"), ("sent", "request leaves (worker)"),
          ("select_woke", "blocked select wakes"), ("received", "control message read"),
          ("resp_sent", "responses leave (rank 0)"), ("end", "call returns")]


def worker(pattern: str, calls: int, out: str) -> None:
    import horovod.numpy as hvd
    from horovod.common import basics
    from horovod.engine import controller, lane_use
    from horovod.engine import lane_board as shm_lane

    clock = time.perf_counter_ns
    current: Dict[str, int] = {}

    def stamp_around(owner, name: str, label: str, after: bool) -> None:
        original = getattr(owner, name)

        def stamped(*args, **kwargs):
            if not after:
                current.setdefault(label, clock())
            result = original(*args, **kwargs)
            if after:
                current.setdefault(label, clock())
            return result
        setattr(owner, name, stamped)

    def stamp_decided(original):
        def decide(*args, **kwargs):
            result = original(*args, **kwargs)
            if result[0]:
                current.setdefault("decided", clock())
            return result
        return decide

    stamp_around(shm_lane.ShmLane, "post_fast", "posted", after=True)
    shm_lane.ShmLane.decide = stamp_decided(shm_lane.ShmLane.decide)
    stamp_around(lane_use, "lane_result", "reduced", after=True)
    stamp_around(controller.ControlPlane, "send", "sent", after=False)
    stamp_around(controller.ControlPlane, "broadcast", "resp_sent", after=False)
    stamp_around(controller.ControlPlane, "receive", "received", after=True)
    hvd.init()
    selector = basics.runtime().state.selector
    plain_select = selector.select

    def select(timeout=None):
        events = plain_select(timeout)
        if events and timeout != 0:
            current.setdefault("select_woke", clock())
        return events
    selector.select = select

    x = np.ones(2, np.float32)
    for _ in range(100):
        hvd.allreduce(x, name="stages")
    records: List[Dict[str, int]] = []
    for _ in range(calls):
        if pattern == "compute":
            time.sleep(0.001)
        current.clear()
        current["start"] = clock()
        hvd.allreduce(x, name="stages")
        current["end"] = clock()
        records.append(dict(current))
    with open(f"{out}.{hvd.rank()}", "w", encoding="utf-8") as f:
        json.dump(records, f)
    hvd.shutdown()


def analyse(out: str) -> Dict[str, object]:
    with open(f"{out}.0", encoding="utf-8") as f:
        r0 = json.load(f)
    with open(f"{out}.1", encoding="utf-8") as f:
        r1 = json.load(f)
    rows: Dict[str, List[float]] = {}
    for a, b in zip(r0, r1):
        t0 = min(a["start"], b["start"])
        for who, rec in (("rank 0", a), ("rank 1", b)):
            for key, value in rec.items():
                rows.setdefault(f"{who}|{key}", []).append((value - t0) / 1e3)
    calls = {"rank 0": float(np.median([a["end"] - a["start"] for a in r0])) / 1e3,
             "rank 1": float(np.median([b["end"] - b["start"] for b in r1])) / 1e3}
    return {"rows": {k: (float(np.median(v)), len(v)) for k, v in rows.items()}, "calls": calls, "n": len(r0)}


def python_overhead(args) -> int:
    """Time and count each entry point at np = 1, for this checkout and (alternating) ``--against``'s."""
    checkouts = [("this checkout", launch.REPO)] + ([("--against", os.path.abspath(args.against))]
                                                     if args.against else [])
    runs: Dict[str, List[dict]] = {label: [] for label, _ in checkouts}
    hangs = 0
    with tempfile.TemporaryDirectory() as tmp:
        for run, (label, path) in itertools.product(range(args.runs), checkouts):
            out = os.path.join(tmp, f"{run}-{len(runs[label])}-{label[:4]}.json")
            env = launch.repo_env({"PYTHONPATH": path}, drop_prefixes=("HOROVOD_", "OMPI_", "PMI"))
            # Run by file name (not -m from this checkout) so that `horovod` comes from PYTHONPATH alone.
            job = None
            for _attempt in range(3):   # np = 1 can hang in the engine (a race; the worker's watchdog ends it)
                job = launch.run_job([sys.executable, overhead.__file__, str(args.calls), "7", out], env,
                                     timeout=600, cwd=tmp)
                hangs += "Timeout (0:" in job.stderr
                if job.ok:
                    break
            assert job is not None
            if not job.ok:
                raise RuntimeError(f"the np = 1 overhead worker failed for {label} ({path}): {job.describe()}")
            with open(out, encoding="utf-8") as f:
                runs[label].append(json.load(f))
    for key, value in header(None).items():
        print(f"- {key}: {value}")
    print(f"- load average at end: {os.getloadavg()[0]:.2f}; {args.runs} runs per checkout, alternating; each run: "
          f"7 interleaved rounds of {args.calls} calls per entry point\n")
    if hangs:
        print(f"- {hangs} worker run(s) hung at np = 1 and were repeated (the engine's idle-poll race)")
    entries = list(runs[checkouts[0][0]][0]["median_s"])
    head = ["entry point (8 B float32, np = 1)"] + [f"µs/call, {label}" for label, _ in checkouts]
    rows = []
    for entry in entries:
        cells = [entry]
        for label, _ in checkouts:
            medians = [r["median_s"][entry] * 1e6 for r in runs[label] if entry in r["median_s"]]
            best = [r["min_s"][entry] * 1e6 for r in runs[label] if entry in r["min_s"]]
            cells.append("–" if not medians else f"{float(np.median(medians)):.1f} ({min(best):.1f})")
        rows.append(cells)
    print("Median over runs of each run's median time per call; in brackets the best round of any run (the least "
          "disturbed by other load on the machine).\n")
    print("\n".join(table(head, rows)) + "\n")
    layers = [name for name, _ in overhead.LAYERS] + ["numpy, torch, builtins"]
    for label, path in checkouts:
        calls = runs[label][0]["calls"]
        print(f"Function calls per call by layer (cProfile), {label} ({path}):\n")
        rows = [[entry] + [f"{calls[entry].get(layer, 0):.0f}" for layer in layers] +
                [f"{sum(calls[entry].values()):.0f}"] for entry in entries if entry in calls]
        print("\n".join(table(["entry point"] + layers + ["total"], rows)) + "\n")
    return 0


def hot_path_calls(transports: List[str], collectives: List[str]) -> int:
    """Python calls per warm blocking collective on each rank's calling thread, np = 2, per transport."""
    for key, value in header(None).items():
        print(f"- {key}: {value}")
    print(f"- {hot_calls.CALLS} profiled calls of each 4 KiB float32 horovod.numpy collective after "
          f"{hot_calls.WARMUP} warm-up calls (cProfile on the calling thread: counts, not times)\n")
    layers = [name for name, _ in overhead.LAYERS] + ["numpy, torch, builtins"]
    rows, tops = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for collective, transport in itertools.product(collectives, transports):
            out = os.path.join(tmp, f"{collective}-{transport}")
            env = launch.repo_env({"HOROVOD_TRANSPORT": transport}, drop_prefixes=("HOROVOD_", "OMPI_", "PMI"))
            cmd = [sys.executable, hot_calls.__file__, out, "4096", collective]
            job = launch.run_job(launch.horovodrun_cmd(2, cmd), env, timeout=600, cwd=tmp)
            if not job.ok:
                raise RuntimeError(f"the hot-path worker failed on {collective}, {transport}: {job.describe()}")
            for rank in (0, 1):
                with open(f"{out}.{rank}", encoding="utf-8") as f:
                    rec = json.load(f)
                rows.append([collective, transport, str(rank)] +
                            [f"{rec['layers'].get(layer, 0):.0f}" for layer in layers] + [f"{rec['per_call']:.0f}"])
                tops[f"{collective}, {transport}, rank {rank}"] = rec["top"]
    print("Python function calls on the calling thread per warm blocking collective (np = 2):\n")
    print("\n".join(table(["collective", "transport", "rank"] + layers + ["total"], rows)) + "\n")
    for who, top in tops.items():
        print(f"Busiest functions, {who} (calls per collective):\n")
        print("\n".join(table(["function", "calls"], [[name, f"{n:.1f}"] for name, n in top[:12]])) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--transport", default=None,
                    help="shm (default), tcp...; with --hot-path-calls comma-separated (default shm,tcp)")
    ap.add_argument("--python-overhead", action="store_true",
                    help="np = 1: the Python cost per call above the engine, per entry point and layer")
    ap.add_argument("--against", metavar="DIR", help="with --python-overhead: also measure DIR's horovod")
    ap.add_argument("--runs", type=int, default=3, help="with --python-overhead: runs per checkout")
    ap.add_argument("--hot-path-calls", action="store_true",
                    help="np = 2: Python calls per warm blocking collective (--collectives) on the calling thread "
                         "(transports: --transport, comma-separated; default shm,tcp)")
    ap.add_argument("--collectives", default="allreduce",
                    help=f"with --hot-path-calls: comma-separated, of {','.join(hot_calls.COLLECTIVES)}")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hot_path_calls:
        return hot_path_calls((args.transport or "shm,tcp").split(","),
                              args.collectives.split(","))
    if args.python_overhead:
        if args.calls == 400:
            args.calls = 2000
        return python_overhead(args)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return 0
    args.transport = args.transport or "shm"
    print(f"# Stages of one 8-byte allreduce, np = 2, HOROVOD_TRANSPORT={args.transport}, load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print("Median microseconds after the earlier rank's call started (rank 0 is the coordinator).\n")
    with tempfile.TemporaryDirectory() as tmp:
        for (path, (path_label, lane)), (pattern, label) in itertools.product(PATHS.items(), PATTERNS.items()):
            out = os.path.join(tmp, f"{path}-{pattern}")
            env = dict(os.environ, HOROVOD_TRANSPORT=args.transport, HOROVOD_FAST_LANE=lane)
            subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, __file__,
                            "--worker", pattern, str(args.calls), out], env=env, check=True, timeout=600,
                           stdout=subprocess.DEVNULL)
            res = analyse(out)
            print(f"## {path_label}: {label}\n")
            print("| stage | rank 0 | rank 1 |")
            print("| --- | ---: | ---: |")
            for key, text in STAGES:
                if not any(f"{who}|{key}" in res["rows"] for who in ("rank 0", "rank 1")):
                    continue
                cells = []
                for who in ("rank 0", "rank 1"):
                    value = res["rows"].get(f"{who}|{key}")
                    cells.append("–" if value is None else f"{value[0]:.1f}" + (
                        f" ({value[1]} of {res['n']} calls)" if value[1] < res["n"] else ""))
                print(f"| {text} | {cells[0]} | {cells[1]} |")
            print(f"| **call time** | {res['calls']['rank 0']:.1f} | {res['calls']['rank 1']:.1f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
