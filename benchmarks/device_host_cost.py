"""The Python part of one GPU collective's host cost, measured on a CPU: the device executor over the stand-in NCCL.

Usage::

    python benchmarks/device_host_cost.py                   # 2000 calls of each case, a table
    python benchmarks/device_host_cost.py --calls 200 --json out.json --profile

A GPU allreduce costs the host: the engine's bookkeeping (shared with host tensors), the device executor's Python,
the framework's stream/event/copy calls, and NCCL's enqueue.  Here the "GPU" is host memory
(``tests/conformance/emulated_device.py``'s ``NcclHostBackend``, whose stream and event calls cost nothing) and NCCL
is the stand-in (``tests/gpu/standin_nccl``, compiled with ``cc``; record mode: each call appends one line to a log
and returns), so what is measured is the engine and the device executor's Python: the part this repository controls,
tracked by CI without a GPU.  At np = 1 in one process, interleaved: an 8-byte allreduce of a host array (the
engine alone), of a device array on the NCCL path, and three device arrays fused in one group.  ``--profile`` adds
cProfile's split of the device case by module (engine, device executor, backend, NCCL binding).

On a GPU the framework's calls come on top (torch: events, ``record_stream``, stream switches, copies):
``tests/gpu/device_check.sh`` measures the whole on the device.  Numbers move with the machine's load; compare the
rows of one run.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "conformance"))
SOURCE = os.path.join(REPO, "tests", "gpu", "standin_nccl", "nccl_standin.c")


def build_standin() -> str:
    """Compile the stand-in NCCL (cached by the source's hash); raises SystemExit without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("no C compiler (cc): the stand-in NCCL cannot be built; install gcc or clang")
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"hvd-standin-nccl-{digest}-{os.getuid()}")
    target = os.path.join(folder, "libnccl.so.2")
    if not os.path.exists(target):
        os.makedirs(folder, exist_ok=True)
        partial = f"{target}.{os.getpid()}.tmp"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", partial, SOURCE, "-lm"], check=True, timeout=120)
        os.replace(partial, target)
    return target


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _groups(stats: pstats.Stats) -> Dict[str, float]:
    """cProfile's own time by where the function lives."""
    out: Dict[str, float] = {}
    for (path, _line, _name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "device_executor" in path or "device_nccl" in path or "device_watchdog" in path:
            group = "device executor"
        elif "emulated_device" in path:
            group = "device backend (emulated)"
        elif "transport/nccl" in path or path == "~":
            group = "builtins (C calls, locks) and the NCCL binding"
        elif "horovod" in path:
            group = "engine and binding"
        else:
            group = "other"
        out[group] = out.get(group, 0.0) + own
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", action="store_true", help="split the device case's time by module")
    args = parser.parse_args(argv)

    folder = tempfile.mkdtemp(prefix="hvd-device-cost-")
    os.environ.update({"HOROVOD_NCCL_SO_PATH": build_standin(), "STANDIN_NCCL_DIR": folder,
                       "STANDIN_NCCL_MODE": "record", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1",
                       "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "0",
                       "HOROVOD_CROSS_SIZE": "1"})
    import emulated_device

    import horovod.numpy as hvd

    host_adapter = hvd._collectives.adapter
    emulated_device.install_nccl(hvd, os.environ["HOROVOD_NCCL_SO_PATH"])
    device_adapter = hvd._collectives.adapter
    hvd.init()
    x = np.ones(2, np.float32)
    fused = [np.ones(2, np.float32), np.ones(3, np.float32), np.ones(4, np.float32)]

    def host() -> object:
        hvd._collectives.adapter = host_adapter
        return hvd.allreduce(x, name="host", op=hvd.Sum)

    def device() -> object:
        hvd._collectives.adapter = device_adapter
        return hvd.allreduce(x, name="device", op=hvd.Sum)

    def device_fused() -> object:
        hvd._collectives.adapter = device_adapter
        return hvd.grouped_allreduce(fused, name="fused", op=hvd.Sum)

    cases = {"host array (engine only)": host, "device array, NCCL path": device,
             "3 device arrays, one fused response": device_fused}
    for fn in cases.values():   # warm up: NCCL set-up, caches
        _time(fn, 20)
    samples: Dict[str, List[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            samples[name].append(_time(fn, args.calls))
    result: Dict[str, object] = {
        "load_average": os.getloadavg()[0], "calls": args.calls, "rounds": args.rounds,
        "us_per_call": {name: 1e6 * float(np.median(v)) for name, v in samples.items()}}
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        _time(device, args.calls)
        profiler.disable()
        groups = _groups(pstats.Stats(profiler))
        result["profile_us_per_call"] = {k: 1e6 * v / args.calls for k, v in sorted(groups.items())}
    hvd.shutdown()
    shutil.rmtree(folder, ignore_errors=True)

    print(f"## Host cost of one collective, np = 1, stand-in NCCL (load average {result['load_average']:.1f})\n")
    print("| case | µs per call |\n|---|---:|")
    for name, us in result["us_per_call"].items():  # type: ignore[union-attr]
        print(f"| {name} | {us:.1f} |")
    if args.profile:
        print("\n| device case, own time by module (cProfile: inflated) | µs per call |\n|---|---:|")
        for name, us in result["profile_us_per_call"].items():  # type: ignore[union-attr]
            print(f"| {name} | {us:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
