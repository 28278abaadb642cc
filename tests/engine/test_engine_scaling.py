"""Pre- and post-scaling and Average, bit for bit: float16 is scaled in float32 with a float32 factor and rounded
once; integers are scaled in float64 and truncated; Average is a true division by the set size (Horovod 0.28.1's
CPU arithmetic, which scripts' expected values are computed with)."""
from __future__ import annotations

import pytest

from engine_helpers import run

FACTOR = 0.7160988  # not representable in float16: a factor rounded to half first gives other results


def _scaling_job(factor):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(7)
    failures = []
    rows = slice(rank * 4, (rank + 1) * 4)
    # 3 columns travel inline with the requests (reduced by the coordinator), 300 through the data plane
    for cols, dtype in ((c, d) for c in (3, 300) for d in (np.float16, np.int32, np.int64, np.float32)):
        base = rng.integers(-100, 100, (4 * size, cols))
        x = base.astype(dtype)
        if dtype == np.float16:
            pre = (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
            post = lambda s: (s.astype(np.float32) * np.float32(factor)).astype(np.float16)  # noqa: E731
        elif dtype == np.float32:
            pre = x * np.float32(factor)
            post = lambda s: s * np.float32(factor)  # noqa: E731
        else:  # integers: float64, truncated toward zero
            pre = np.trunc(x.astype(np.float64) * factor).astype(dtype)
            post = lambda s: np.trunc(s.astype(np.float64) * factor).astype(dtype)  # noqa: E731
        cases = {
            "allreduce prescale": (hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor, name=f"p{x.dtype}{cols}"),
                                   pre * size),
            "allreduce postscale": (hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor, name=f"q{x.dtype}{cols}"),
                                    post(x * size)),
            "reducescatter prescale": (hvd.reducescatter(x, op=hvd.Sum, prescale_factor=factor,
                                                         name=f"r{x.dtype}{cols}"), (pre * size)[rows]),
            "reducescatter postscale": (hvd.reducescatter(x, op=hvd.Sum, postscale_factor=factor,
                                                          name=f"s{x.dtype}{cols}"), post(x * size)[rows]),
        }
        # Average divides the sum by the set size (x / 3, not x * (1/3): they differ in the last bit)
        mine = (base * 7 + rank).astype(dtype)
        total = sum((base * 7 + r).astype(dtype) for r in range(size))
        if dtype == np.float16:
            average = (total.astype(np.float32) / np.float32(size)).astype(np.float16)
        elif dtype == np.float32:
            average = total / np.float32(size)
        else:
            average = np.trunc(total / size).astype(dtype)  # toward zero, like torch's rounding_mode="trunc"
        cases["allreduce average"] = (hvd.allreduce(mine, op=hvd.Average, name=f"a{x.dtype}{cols}"), average)
        cases["reducescatter average"] = (hvd.reducescatter(mine, op=hvd.Average, name=f"b{x.dtype}{cols}"),
                                          average[rows])
        for label, (got, want) in cases.items():
            if got.dtype != want.dtype or not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)[:3]
                failures.append(f"{label} {np.dtype(dtype)} x{cols}: elements {bad.tolist()} got "
                                f"{got.reshape(-1)[bad].tolist()} want {want.reshape(-1)[bad].tolist()}")
    hvd.shutdown()
    return failures


@pytest.mark.parametrize("np_", [2, 3])
def test_scaling_matches_the_originals_arithmetic_bit_for_bit(np_):
    for rank, failures in enumerate(run(_scaling_job, np_, "shm", args=(FACTOR,))):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)
