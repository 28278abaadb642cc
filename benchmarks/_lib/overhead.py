"""The Python cost of one binding call above the engine: time per call at np = 1, and calls per layer (cProfile).

At np = 1 the engine has nobody to wait for (it plans and reduces in the calling thread), so what a call costs is
almost all Python: the binding, the shared glue (``horovod/common``), the engine API that builds requests, and the
runtime that plans and executes them. Timing the same 8-byte allreduce through each entry point, interleaved in one
process, shows what each layer adds; cProfile counts the function calls each layer makes (deterministic, unlike the
times on a shared machine). Runs inside one worker process (:func:`worker`); :mod:`benchmarks.latency_stages`
starts it and prints the tables.
"""
from __future__ import annotations

import cProfile
import faulthandler
import json
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

#: Layers of a call, by the file a function lives in (first match wins); the rest is numpy, torch and builtins.
LAYERS = [("binding", ("horovod/numpy/", "horovod/torch/")), ("common", ("horovod/common/",)),
          ("engine API", ("horovod/engine/collectives.py", "horovod/engine/handles.py",
                          "horovod/engine/naming.py", "horovod/engine/state.py")),
          ("runtime", ("horovod/engine/", "horovod/transport/"))]


def _layer(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    for layer, parts in LAYERS:
        if any(p in path for p in parts):
            return layer
    return "numpy, torch, builtins"


def _calls(numpy_mod) -> List[Tuple[str, Callable[[], object]]]:
    """``(label, one call)`` for every entry point measured; torch's only when torch imports."""
    from horovod.engine import collectives

    x = numpy_mod.ones(2, numpy_mod.float32)
    out = numpy_mod.empty_like(x)

    def engine_api():
        return collectives.allreduce_async([x], ["allreduce.floor"], outputs=[out], attended=True).wait()

    import horovod.numpy as hvd_np
    calls = [("engine API only (collectives.allreduce_async + wait)", engine_api),
             ("horovod.numpy.allreduce", lambda: hvd_np.allreduce(x, name="np")),
             ("horovod.numpy.allreduce_", lambda: hvd_np.allreduce_(x, name="np_")),
             ("horovod.numpy.allreduce_async + synchronize",
              lambda: hvd_np.synchronize(hvd_np.allreduce_async(x, name="np_async")))]
    try:
        import torch
        import horovod.torch as hvd_torch
    except ImportError:
        return calls
    t = torch.ones(2)
    return calls + [("horovod.torch.allreduce", lambda: hvd_torch.allreduce(t, name="torch")),
                    ("horovod.torch.allreduce_", lambda: hvd_torch.allreduce_(t, name="torch_")),
                    ("horovod.torch.allreduce_async + synchronize",
                     lambda: hvd_torch.synchronize(hvd_torch.allreduce_async(t, name="torch_async")))]


def _avoid_idle_poll_deadlock() -> None:
    """At np = 1 the background thread's idle poll can take the drive lock just as a call enqueues, then keep
    driving for that call's in-flight entry, which only the caller (waiting for the lock in ``_run_alone``) can
    execute: the call hangs (seen within seconds of back-to-back calls). Fixed in engine/runtime.py in session 8;
    kept so that ``--against`` an older checkout still runs: tell the background thread that a lone process's
    in-flight entries never need it. Only the background thread's choice changes; the calls measured take the same
    path."""
    from horovod.engine.runtime import Runtime

    original = Runtime._needs_background

    def needs_background(self) -> bool:
        if self.size == 1 and self._inflight:
            return self._stop_requested
        return original(self)
    Runtime._needs_background = needs_background  # type: ignore[method-assign]


def worker(calls_per_rep: int, reps: int, out: str) -> None:
    """Measure every entry point (interleaved, ``reps`` rounds of ``calls_per_rep`` calls) and profile each."""
    import numpy as np
    import horovod.numpy as hvd

    faulthandler.dump_traceback_later(90, exit=True)   # a hung run says where instead of waiting for the driver
    _avoid_idle_poll_deadlock()
    hvd.init()
    calls = _calls(np)
    for _, fn in calls:
        for _ in range(200):
            fn()
    times: Dict[str, List[float]] = {label: [] for label, _ in calls}
    for _ in range(reps):
        for label, fn in calls:
            start = time.perf_counter()
            for _ in range(calls_per_rep):
                fn()
            times[label].append((time.perf_counter() - start) / calls_per_rep)
    profiles: Dict[str, Dict[str, float]] = {}
    for label, fn in calls:
        prof = cProfile.Profile()
        n = 1000
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        per_layer: Dict[str, float] = {}
        for (filename, _line, _name), row in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            if filename != __file__:   # not the measuring lambdas themselves
                per_layer[_layer(filename)] = per_layer.get(_layer(filename), 0) + row[1] / n   # all calls
        profiles[label] = per_layer
    hvd.shutdown()
    faulthandler.cancel_dump_traceback_later()
    result = {"horovod": os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__))),
              "median_s": {k: statistics.median(v) for k, v in times.items()},
              "min_s": {k: min(v) for k, v in times.items()}, "calls": profiles}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
