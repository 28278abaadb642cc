"""This project's transports called directly (no engine): shm, tcp and mpi, with transport options.

Usage::

    python benchmarks/transports.py                                   # shm, tcp and mpi; np = 2 and 4; allreduce
    python benchmarks/transports.py --transport tcp --np 2 --option tcp_chunk_bytes=524288 --option tcp_chunk_bytes=0
    python benchmarks/transports.py --transport shm --ops allreduce,allgather --option shm_spin_us=0 --chart shm.png

The question: what does a transport's own data plane deliver, and what does one option change?  It runs the same
sweep as ``benchmarks/collectives.py`` (the same cases checked against numpy, batches timed between barriers,
the slowest rank's time, busbw as in nccl-tests), but with each transport alone in its job: ``horovodrun``
(``HOROVOD_TRANSPORT`` set, its rendezvous reused) for shm and tcp, ``mpirun`` for mpi.  Each ``--option
KEY=VALUE`` is a job of its own beside the default one, so the table and chart compare them; a key repeated
gives several values.  A key named after a transport (``tcp_chunk_bytes``, ``shm_spin_us``, ``mpi_float16``) runs
on that transport only; any other key (``small_message_bytes``) on every transport.  (This replaces
``transport_shm.py``, ``transport_tcp.py`` and ``transport_mpi.py``.)
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._collectives import cli, probes  # noqa: E402
from benchmarks._collectives.cases import LABELS, register_impl  # noqa: E402
from benchmarks._collectives.jobs import Runner  # noqa: E402
from benchmarks._collectives.render import render  # noqa: E402
from benchmarks._collectives.results import Results  # noqa: E402
from benchmarks._lib.report import header, version  # noqa: E402

SCRIPT = os.path.abspath(__file__)
TITLE = "Transports called directly"
TRANSPORTS = ("shm", "tcp", "mpi")


def parse_option(text: str) -> Dict[str, object]:
    """``KEY=VALUE`` -> ``{KEY: int, float or str}``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option {text!r}: expected KEY=VALUE, e.g. tcp_chunk_bytes=524288")
    for kind in (int, float):
        try:
            return {key: kind(value)}
        except ValueError:
            pass
    return {key: value}


def applies(transport: str, options: Dict[str, object]) -> bool:
    """Whether a variant is run on ``transport``: keys named after another transport are not."""
    return not any(k.split("_", 1)[0] in TRANSPORTS and not k.startswith(transport + "_") for k in options)


def option_label(transport: str, options: Dict[str, object]) -> str:
    """The implementation's name in tables and charts: ``tcp transport`` or ``tcp transport, tcp_chunk_bytes=0``."""
    base = LABELS[f"raw-{transport}"]
    return base + "".join(f", {k}={v}" for k, v in options.items())


def main(argv: Optional[Sequence[str]] = None) -> int:
    if cli.rank_entry(argv):
        return 0
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_sweep_args(ap, "allreduce")
    ap.add_argument("--transport", default="shm,tcp,mpi", help="comma-separated: shm, tcp, mpi")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a transport option (its own job beside the default one); repeatable")
    args = ap.parse_args(argv)
    cli.resolve_sweep_args(ap, args)
    if args.chart_from:
        return cli.redraw(args, TITLE)
    wanted = [t for t in args.transport.split(",") if t]
    bad = [t for t in wanted if t not in TRANSPORTS]
    if bad:
        ap.error(f"--transport: unknown {bad}; choose from shm, tcp, mpi")
    try:
        variants: List[Dict[str, object]] = [{}] + [parse_option(o) for o in args.option]
    except ValueError as exc:
        ap.error(str(exc))
    skipped = {}
    if "shm" in wanted and not probes.shm_available():
        skipped["shm"] = "the shm transport is not available on this machine"
    if "mpi" in wanted and probes.mpi_available():
        skipped["mpi"] = probes.mpi_available()
    transports = [t for t in wanted if t not in skipped]
    for t, why in skipped.items():
        print(f"skipping {t}: {why}", file=sys.stderr)

    info = header(argv)
    tmp = tempfile.mkdtemp(prefix="hvd-bench-")
    try:
        runner = Runner(args, tmp, SCRIPT)
        for np_ in args.np:
            for transport in transports:
                for options in variants:
                    if not applies(transport, options):
                        continue
                    start = len(runner.records)
                    runner.raw_job(np_, transport, options, ["sweep"])
                    if options:  # a variant is an implementation of its own in the tables and charts
                        key = f"raw-{transport}-" + ",".join(f"{k}={v}" for k, v in options.items())
                        register_impl(key, option_label(transport, options))
                        for rec in runner.records[start:]:
                            if rec.get("impl") == f"raw-{transport}":
                                rec["impl"] = key
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = Results(runner.records)
    versions = [f"mpi4py {version('mpi4py')}" if "mpi" in transports else "MPI: not used"]
    cli.complete_header(info, versions, time.monotonic() - runner.t_start)
    if skipped:
        info["skipped"] = "; ".join(f"{t}: {why}" for t, why in skipped.items())
    text = render(args.ops, res, {}, info, runner.failures, "shm", title=TITLE, with_targets=False)
    cli.write_outputs(args, text, info, res, {}, TITLE)
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
