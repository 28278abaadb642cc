"""The device path where CI runs (no GPU): device arrays of a host-memory backend negotiated across real ranks.

The conformance suite runs every collective × dtype through it (binding ``device``); these tests check what is
particular to devices: the set's agreed mode and its notice, and a CPU tensor against a device tensor.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np

from multiproc import run_ranks

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
import emulated_device  # noqa: E402  (tests/conformance)

cloudpickle.register_pickle_by_value(emulated_device)   # the ranks get it with the job


# The ranks install an emulated device backend into horovod.numpy (process-wide): fresh ranks for every test,
# not warm ones (tests/rank_pool.py), so no test inherits another's backend.
WARM_RANKS = False


def _staged_job():
    import logging

    import horovod.numpy as hvd
    from horovod.engine import state

    notices = []

    class Keep(logging.Handler):
        def emit(self, record):
            notices.append(record.getMessage())

    logging.getLogger("horovod.engine.device_executor").addHandler(Keep())
    emulated_device.install(hvd)
    hvd.init()
    out = hvd.allreduce(np.arange(6, dtype=np.float32) + hvd.rank(), op=hvd.Sum, name="x")
    # Read now: once another rank shuts down, this engine is torn down too and forgets its device plane.
    mode = state.runtime().executor.devices.mode(0)
    fused = [hvd.synchronize(h) for h in [hvd.allreduce_async(np.full(3, i, np.int64), op=hvd.Sum, name=f"f{i}")
                                          for i in range(3)]]
    for step in range(6):   # the same names step after step: repeated collectives (the response cache, warm path)
        again = hvd.allreduce(np.arange(6, dtype=np.float32) + hvd.rank(), op=hvd.Sum, name="x")
        assert again.tolist() == out.tolist(), (step, again, out)
        assert [hvd.synchronize(h).tolist() for h in [hvd.allreduce_async(np.full(3, i, np.int64), op=hvd.Sum,
                                                                          name=f"f{i}") for i in range(3)]] == \
            [f.tolist() for f in fused], step
    hvd.shutdown()
    return out.tolist(), [f.tolist() for f in fused], mode, notices


def test_device_arrays_are_staged_when_nccl_cannot_serve():
    results = run_ranks(_staged_job, 2, timeout=120)
    for out, fused, mode, _notices in results:
        assert out == (2 * np.arange(6) + 1).tolist()
        assert fused == [[2 * i] * 3 for i in range(3)]
        assert mode == "HOST"
    assert any("staged through host memory" in n for n in results[0][3]), results[0][3]


def _mixed_job():
    import horovod.numpy as hvd

    if int(os.environ["HOROVOD_RANK"]) == 1:
        emulated_device.install(hvd)
    hvd.init()
    try:
        hvd.allreduce(np.ones(4, np.float32), name="mixed")
    except Exception as exc:  # noqa: BLE001  (the test reads the type and text)
        return f"{type(exc).__name__}: {exc}"
    finally:
        hvd.shutdown()
    return "no error"


def test_host_and_device_tensors_under_one_name_fail_every_rank():
    for text in run_ranks(_mixed_job, 2, timeout=120):
        assert "Mismatched CPU/GPU device selection" in text and "rank 0" in text and "rank 1" in text, text
