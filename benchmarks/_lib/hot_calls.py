"""Python function calls on the calling thread per warm blocking collective, at np = 2 (cProfile).

A warm collective (its response cached on every rank) should cost a handful of Python frames between the binding
and the transport. This counts them, deterministically (call counts, not times: a loaded machine does not change
them): each rank warms a 4 KiB ``horovod.numpy`` collective up (allreduce unless told another), then profiles
``CALLS`` more on its calling thread and writes the calls per collective by layer and the busiest functions. Run
by :mod:`benchmarks.latency_stages` (``--hot-path-calls``) under ``horovodrun -np 2``.
"""
from __future__ import annotations

import cProfile
import json
import pstats
import sys
from collections import Counter

import numpy as np

from benchmarks._lib.overhead import _layer

CALLS = 200
WARMUP = 50


#: The collectives counted, each as a user calls it (results new arrays, as the benchmarks' engine rows).
COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


def _call(hvd, collective: str, x: np.ndarray):
    if collective == "allreduce":
        return lambda: hvd.allreduce(x, name="hot")
    if collective == "allgather":
        return lambda: hvd.allgather(x, name="hot")
    if collective == "broadcast":
        return lambda: hvd.broadcast(x, 0, name="hot")
    if collective == "alltoall":
        return lambda: hvd.alltoall(x, name="hot")
    if collective == "reducescatter":
        return lambda: hvd.reducescatter(x, name="hot")
    raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")


def worker(out: str, nbytes: int = 4096, collective: str = "allreduce") -> None:
    import horovod.numpy as hvd

    hvd.init()
    call = _call(hvd, collective, np.ones(nbytes // 4, np.float32))
    for _ in range(WARMUP):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        call()
    profile.disable()
    stats = pstats.Stats(profile).stats   # type: ignore[attr-defined]
    layers: Counter = Counter()
    functions: Counter = Counter()
    for (filename, line, name), (_primitive, total, *_rest) in stats.items():
        layers[_layer(filename)] += total
        short = filename.replace("\\", "/").split("/horovod/")[-1] if "/horovod/" in filename else filename
        functions[f"{short}:{line}({name})"] += total
    record = {"rank": hvd.rank(), "per_call": sum(layers.values()) / CALLS,
              "layers": {k: v / CALLS for k, v in layers.items()},
              "top": [(f, n / CALLS) for f, n in functions.most_common(120)]}
    with open(f"{out}.{hvd.rank()}", "w", encoding="utf-8") as f:
        json.dump(record, f)
    hvd.shutdown()


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096,
           sys.argv[3] if len(sys.argv) > 3 else "allreduce")
