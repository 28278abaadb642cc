"""What the flight recorder costs: the 8-byte latency and the training rows of docs/benchmarks.md with the
recorder on and off, in the same processes, alternating blocks (so the VM's drift hits both sides alike).

Usage::

    python benchmarks/flight_recorder.py                 # np = 2, shm (the default transport on one host)
    python benchmarks/flight_recorder.py --transport tcp
    python benchmarks/flight_recorder.py --models deepmlp --steps 40

Rows: an 8-byte float32 allreduce back to back (blocking: the fast lane on shm), the same through the coordinator
(``allreduce_async`` + ``synchronize``: the path every asynchronous gradient takes), and training steps of
benchmarks/torch_training.py's models with ``hvd.DistributedOptimizer``.  Every rank flips its recorder
(``runtime.recorder.enabled``) every 20 calls (every training step) at the same point, so load changes on a shared
machine hit both sides alike; medians per side.  A last row times the recorder's hooks alone for one collective
(enqueue, negotiated, started, finished) in a tight loop.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch as _launch  # noqa: E402

RESULT_TAG = "BENCH_RESULT "


def hooks_ns(n: int = 200_000) -> float:
    """Nanoseconds of recorder hooks per collective (the coordinator path's four events)."""
    from horovod.engine import ops
    from horovod.engine.flight_recorder import FlightRecorder
    from horovod.engine.messages import Request, Response

    rec = FlightRecorder(2000)
    req = Request(0, "allreduce.x", ops.ALLREDUCE, "float32", (2,))
    resp = Response(ops.ALLREDUCE, ["allreduce.x"])
    batch = [SimpleNamespace(request=req)]   # the entries of one call, as the intake passes them
    start = time.perf_counter()
    for _ in range(n):
        rec.enqueued(batch)
        rec.negotiated()
        rec.started(resp)
        rec.finished(resp)
    return (time.perf_counter() - start) / n * 1e9


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.engine import state
    from benchmarks.torch_training import build

    hvd.init()
    rank, _world = hvd.rank(), hvd.size()
    recorder = state.current.recorder
    torch.set_num_threads(1)
    tiny = torch.zeros(2, dtype=torch.float32)   # 8 bytes

    def lane():
        t = time.perf_counter()
        hvd.allreduce(tiny, name="lat")
        return (time.perf_counter() - t) * 1e6

    def coordinator():
        t = time.perf_counter()
        hvd.synchronize(hvd.allreduce_async(tiny, name="lat.async"))
        return (time.perf_counter() - t) * 1e6

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    # (label, one unit of work returning its time in µs, units per switch of the recorder, units per side)
    workloads = [("8-byte allreduce, back to back (µs, median)", lane, 20, args.lat_calls),
                 ("8-byte allreduce through the coordinator (µs, median)", coordinator, 20, args.lat_calls)]
    for name in args.models.split(","):
        model = build(name)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

        def step(model=model, opt=opt):
            t = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return (time.perf_counter() - t) * 1e6

        workloads.append((f"training {name} (ms per step, median)", step, 1, args.steps))
    results = {}
    for label, unit, per_switch, per_side in workloads:
        for _ in range(max(per_switch, 10)):
            unit()   # warm-up
        sides = {True: [], False: []}
        # The recorder flips every few units, on every rank at the same unit (the collectives keep the ranks in
        # step), so both sides see the same load on a shared machine.
        for i in range(2 * per_side):
            on = (i // per_switch) % 2 == 0
            recorder.enabled = on
            sides[on].append(unit())
        recorder.enabled = True
        scale = 1e-3 if label.startswith("training") else 1.0
        results[label] = {"on": statistics.median(sides[True]) * scale,
                          "off": statistics.median(sides[False]) * scale, "units": per_side}
    if rank == 0:
        results["hooks"] = hooks_ns()
        print(RESULT_TAG + json.dumps(results), flush=True)
    hvd.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--models", default="smallcnn,mlp,deepmlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=80, help="training steps per side")
    parser.add_argument("--lat-calls", type=int, default=4000, help="latency calls per side")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--chart", default=None, metavar="FILE.png",
                        help="draw each row's time with the recorder on ÷ off into FILE.png (needs matplotlib)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    env = _launch.repo_env({"HOROVOD_TRANSPORT": args.transport})
    cmd = _launch.horovodrun_cmd(args.np, [
        sys.executable, os.path.abspath(__file__), "--worker", "--models", args.models, "--batch-size",
        str(args.batch_size), "--steps", str(args.steps), "--lat-calls", str(args.lat_calls)])
    proc = _launch.run_job(cmd, env, args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if RESULT_TAG in ln), None)
    if not proc.ok or line is None:
        raise SystemExit(f"benchmark job failed: {proc.describe()}")
    results = json.loads(line.split(RESULT_TAG, 1)[1])
    hooks = results.pop("hooks")
    print(f"np={args.np}, transport {args.transport}, load average {os.getloadavg()[0]:.1f}\n")
    print("| row | recorder on | recorder off | on / off | units per side |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, r in results.items():
        print(f"| {label} | {r['on']:.1f} | {r['off']:.1f} | {r['on'] / r['off']:.3f} | {r['units']} |")
    print(f"| recorder hooks alone, one collective (ns) | {hooks:.0f} | 0 | | |")
    if args.chart:
        from benchmarks import charts
        from benchmarks._lib.report import chart_note

        groups = {label.split(" (")[0]: {"recorder on ÷ off": r["on"] / r["off"]} for label, r in results.items()}
        charts.bars(groups, args.chart, ylabel="time on ÷ time off (1 = no cost)", note=chart_note(),
                    title=f"flight recorder on against off, np = {args.np}")


if __name__ == "__main__":
    main()
