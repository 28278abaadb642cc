"""What the entry points over the collective sweep share (``collectives.py``, ``transports.py``): their flags,
the run header, and the outputs (markdown, JSON, charts)."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

from benchmarks._collectives.cases import OPS
from benchmarks._collectives.results import Results
from benchmarks._lib.measure import KIB, MIB, parse_size, parse_sizes, size_ladder
from benchmarks._lib.report import git_rev, load, write_json

MPIRUN_HELP = ("extra mpirun arguments (default '--bind-to none': Open MPI's own default binds each rank to one core "
               "at np <= 2, which was ~20%% slower for mpi4py at 64 MiB here and pins the engine's background "
               "thread to its main thread's core; pass '' for Open MPI's default)")


def add_sweep_args(ap: argparse.ArgumentParser, ops_default: str) -> None:
    """Sizes, world sizes, collectives, repeats, timeouts and outputs."""
    ap.add_argument("--quick", action="store_true", help="smoke run: sizes 4K,64K,1M,16M,64M; fewer repeats")
    ap.add_argument("--max", type=parse_size, default=None, help="largest size (default 64M; try 256M)")
    ap.add_argument("--sizes", default=None, help="explicit comma-separated sizes, e.g. 8K,1M,64M")
    ap.add_argument("--np", type=int, action="append", help="world size (repeatable; default 2 and 4)")
    ap.add_argument("--ops", default=ops_default, help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--rounds", type=int, default=None, help="timed batches per implementation and size (7; quick 3)")
    ap.add_argument("--sample-ms", type=float, default=None, help="target length of one batch (20 ms; quick 8)")
    ap.add_argument("--lat-iters", type=int, default=None, help="8-byte allreduce calls per implementation (2000)")
    ap.add_argument("--job-timeout", type=float, default=None, help="seconds before a job is killed (600)")
    ap.add_argument("--mpirun-args", default="--bind-to none", help=MPIRUN_HELP)
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    ap.add_argument("--json", default=None, help="write every raw record (samples included) to this file")
    ap.add_argument("--chart", default=None, metavar="FILE.png",
                    help="draw bus bandwidth against size for every implementation (one panel per collective and "
                         "np) into FILE.png, and the latency rows (when measured) into FILE-latency.png; needs "
                         "matplotlib")
    ap.add_argument("--chart-from", default=None, metavar="RUN.json",
                    help="measure nothing: draw --chart from the records of an earlier run's --json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def resolve_sweep_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the defaults that depend on ``--quick`` and check the collectives named."""
    q = args.quick
    args.sizes = parse_sizes(args.sizes) if args.sizes else size_ladder(4 * KIB, args.max or 64 * MIB, 16 if q else 4)
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"unknown collective(s) {bad}; choose from {', '.join(OPS)}")
    args.np = args.np or [2, 4]
    args.rounds = args.rounds or (3 if q else 7)
    args.sample_ms = args.sample_ms or (8.0 if q else 20.0)
    args.lat_iters = args.lat_iters or (500 if q else 2000)
    args.fusion_reps = 2 if q else 3
    args.fusion_rounds = 2 if q else 3
    args.job_timeout = args.job_timeout or (300.0 if q else 600.0)


def complete_header(info: Dict[str, str], versions: List[str], seconds: float) -> None:
    """The lines known only at the end of a run."""
    info["versions"] = ", ".join([f"Python {platform.python_version()}", f"numpy {np.__version__}", *versions])
    info["horovod checkout"] = git_rev()
    info["load average"] += f", {load():.2f} at end (1-minute)"
    info["duration"] = f"{seconds:.0f} s"
    knobs = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    info["HOROVOD_* in the environment"] = ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "none"


def chart_note(info: Dict[str, str]) -> str:
    """The footnote of a chart: when, where, and how loaded the machine was."""
    return f"{info.get('date', '')}; {os.cpu_count()} cores; load average {info.get('load average', '?')}"


def write_outputs(args, text: str, info: Dict[str, str], res: Results, memcpy: Dict[int, float],
                  title: str) -> None:
    """Print the report; write the markdown, the JSON records and the charts that were asked for."""
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        write_json(args.json, {"info": info, "memcpy_s": memcpy, "records": res.records})
    if args.chart:
        draw_charts(args.chart, res, args.ops, title, chart_note(info))


def draw_charts(path: str, res: Results, ops: Sequence[str], title: str, note: str) -> List[str]:
    from benchmarks import charts

    written = []
    panels = res.bandwidth_panels(list(ops))
    if panels:
        written.append(charts.bandwidth(panels, path, title=title, note=note))
    groups = res.latency_groups()
    if groups:
        written.append(charts.bars(groups, charts.sibling(path, "latency"), note=note, log=True,
                                   title="one 8-byte allreduce, np = 2 (median)", ylabel="µs per call"))
    for p in written:
        print(f"chart: {p}", file=sys.stderr)
    return written


def redraw(args, title: str) -> int:
    """``--chart-from RUN.json --chart FILE.png``: the charts of an earlier run, from its JSON records."""
    import json

    if not args.chart:
        raise SystemExit("--chart-from needs --chart FILE.png (where to draw)")
    with open(args.chart_from, encoding="utf-8") as f:
        run = json.load(f)
    res = Results(run["records"])
    ops = [op for op in args.ops if any(k[0] == op for k in res.sweep)]
    return 0 if draw_charts(args.chart, res, ops, title, chart_note(run["info"])) else 1


def rank_entry(argv: Optional[Sequence[str]]) -> bool:
    """Run a rank when the command line is ``--worker SPEC`` (the jobs start the entry point that way)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "--worker":
        from benchmarks._collectives.worker import worker

        worker(args[1])
        return True
    return False
