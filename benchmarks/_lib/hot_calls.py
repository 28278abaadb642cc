"""Python function calls on the calling thread per warm blocking allreduce, at np = 2 (cProfile).

A warm collective (its response cached on every rank) should cost a handful of Python frames between the binding
and the transport. This counts them, deterministically (call counts, not times: a loaded machine does not change
them): each rank warms a 4 KiB ``horovod.numpy.allreduce`` up, then profiles ``CALLS`` more on its calling thread
and writes the calls per collective by layer and the busiest functions. Run by :mod:`benchmarks.latency_stages`
(``--hot-path-calls``) under ``horovodrun -np 2``.
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


def worker(out: str, nbytes: int = 4096) -> None:
    import horovod.numpy as hvd

    hvd.init()
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(WARMUP):
        hvd.allreduce(x, name="hot")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        hvd.allreduce(x, name="hot")
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
    worker(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
