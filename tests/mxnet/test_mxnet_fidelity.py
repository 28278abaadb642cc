"""horovod.mxnet where it must match Horovod 0.28.1 exactly, in the MXNet venv (NumPy 1.x): float16 scale factors
are applied in float32 (NumPy 1.x would compute a float16 array times a float32 scalar in float16), a scalar
reducescatter raises ValueError on every rank, alltoall refuses non-integer splits.  Every rank checks, then the
ranks still run a collective together (nobody was left waiting by a one-sided failure).
"""
from __future__ import annotations

import pytest

from checks import Checks, assert_no_failures
from mxnet_helpers import mxnet_unavailable, run

_WHY = mxnet_unavailable()
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)


def fidelity_worker() -> dict:
    import mxnet as mx
    import numpy as np

    import horovod.mxnet as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    f = Checks(r)

    # 11. float16 with pre/postscale: the result is the float32 computation rounded once to float16, on every
    #     rank (17 x 17 = 289 values, the shape where NumPy 1.x's half arithmetic gave 12 different elements).
    def half(p):
        return (np.arange(289, dtype=np.float32).reshape(17, 17) * 0.37 + p).astype(np.float16)

    for pre, post in ((1.0, 1.0 / 3.0), (1.0 / 3.0, 1.0), (0.1, 7.0)):
        scaled = [(half(p).astype(np.float32) * np.float32(pre)).astype(np.float16) for p in range(n)]
        total = np.sum([s.astype(np.float32) for s in scaled], axis=0).astype(np.float16) if n > 1 else scaled[0]
        want = (total.astype(np.float32) * np.float32(post)).astype(np.float16)
        got = hvd.allreduce(mx.nd.array(half(r), dtype="float16"), op=hvd.Sum, prescale_factor=pre,
                            postscale_factor=post, name=f"half_{pre}_{post}").asnumpy()
        f.true(got.dtype == np.float16, f"float16 result dtype {got.dtype}")
        what = f"float16 Sum with prescale {pre} and postscale {post} computed in float32"
        if n <= 2:   # two halves add exactly in float32: the whole result is determined bit for bit
            f.equal(got, want, what)
        else:        # three or more: the transport's order of additions may round differently
            f.close(got, want, what, rtol=2e-3, atol=1e-2)
    avg = hvd.allreduce(mx.nd.array(half(r), dtype="float16"), op=hvd.Average, name="half_avg").asnumpy()
    total = np.sum([half(p).astype(np.float32) for p in range(n)], axis=0).astype(np.float16)
    f.close(avg, (total.astype(np.float32) / np.float32(n)).astype(np.float16), "float16 Average in float32",
            rtol=0 if n <= 2 else 2e-3, atol=0 if n <= 2 else 1e-2)

    # 12. a scalar reducescatter raises ValueError on every rank (grouped too), before any collective
    f.raises("scalar reducescatter", ValueError, lambda: hvd.reducescatter(mx.nd.array(1.0)),
             match="does not support scalar inputs")
    f.raises("scalar grouped_reducescatter", ValueError,
             lambda: hvd.grouped_reducescatter([mx.nd.ones((2, 1)), mx.nd.array(1.0)]),
             match="does not support scalar inputs")

    # 13. non-integer splits are refused (NDArray and numpy); integer ones of any integer dtype work
    rows = mx.nd.ones((n, 2))
    f.raises("float32 NDArray splits", ValueError, lambda: hvd.alltoall(rows, splits=mx.nd.ones((n,))),
             match="integers")
    f.raises("float64 numpy splits", ValueError, lambda: hvd.alltoall(rows, splits=np.ones(n)), match="integers")
    out, received = hvd.alltoall(rows, splits=mx.nd.ones((n,), dtype="int32"))
    f.equal(received.asnumpy(), np.ones(n, dtype=np.int32), "int32 NDArray splits still work")
    out, received = hvd.alltoall(rows, splits=np.ones(n, dtype=np.int64))
    f.equal(out.asnumpy(), np.ones((n, 2), dtype=np.float32), "int64 numpy splits still work")

    # every rank is still in step
    f.equal(hvd.allreduce(mx.nd.array([float(r)]), op=hvd.Sum, name="after").asnumpy(),
            np.array([sum(range(n))], dtype=np.float32), "collective after the refusals")
    return f.report()


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_fidelity(np_):
    assert_no_failures(run(fidelity_worker, np_), minimum_checks=12)
