"""The device run's lifecycle scenarios on the CPU, with the stand-in NCCL (see test_nccl_standin.py): a peer killed
with a collective in flight, and a new engine (an elastic reset) rebuilding its communicators."""
from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np

from multiproc import run_ranks
from tests.gpu import standin

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
import emulated_device  # noqa: E402  (tests/conformance)

cloudpickle.register_pickle_by_value(emulated_device)


# The ranks install an emulated device backend into horovod.numpy (process-wide): fresh ranks for every test,
# not warm ones (tests/rank_pool.py), so no test inherits another's backend.
WARM_RANKS = False


def _killed_peer_job():
    import signal
    import time

    import horovod.numpy as hvd

    backend = emulated_device.install_nccl(hvd, os.environ["HOROVOD_NCCL_SO_PATH"])
    hvd.init()
    hvd.allreduce(np.ones(4, np.float32), name="warm", op=hvd.Sum)
    if hvd.rank() == 1:
        hvd.allreduce_async(np.ones(4, np.float32), name="inflight.0", op=hvd.Sum)
        os.kill(os.getpid(), signal.SIGKILL)
    error = "no error"
    start = time.monotonic()
    try:
        for i in range(1000):
            hvd.allreduce(np.ones(4, np.float32), name=f"inflight.{i}", op=hvd.Sum)
            if time.monotonic() - start > 120:
                break
    except Exception as exc:  # noqa: BLE001  (the test reads the type and text)
        error = f"{type(exc).__name__}: {exc}"
    deadline = time.monotonic() + 60
    while backend.busy() and time.monotonic() < deadline:   # the engine's teardown aborts the communicators
        time.sleep(0.05)
    return error, backend.busy()


def test_a_killed_peer_fails_the_survivor_and_frees_its_gpu(tmp_path):
    env = standin.env(tmp_path, STANDIN_NCCL_WAIT="3", HOROVOD_GLOO_TIMEOUT_SECONDS="10",
                      HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS="20")
    outcomes = run_ranks(_killed_peer_job, 2, env=env, timeout=240, expect_failure=True)
    assert outcomes[1].status == "died", outcomes[1]
    status, (error, busy) = outcomes[0]
    assert status == "ok" and error != "no error", outcomes[0]
    assert "rank 1" in error, error
    assert not busy, "the survivor's communicators were not aborted: its GPU would wait for the dead peer"


def _rebuild_job():
    import horovod.numpy as hvd

    emulated_device.install_nccl(hvd, os.environ["HOROVOD_NCCL_SO_PATH"])
    out = []
    for r in range(2):
        hvd.init()
        out.append(hvd.allreduce(np.full(3, hvd.rank() + r, np.float32), name="again", op=hvd.Sum).tolist())
        hvd.shutdown()
    return out


def test_a_new_engine_rebuilds_its_communicators(tmp_path):
    for out in run_ranks(_rebuild_job, 2, env=standin.env(tmp_path), timeout=240):
        assert out == [[1.0] * 3, [3.0] * 3], out
    words = standin.calls(tmp_path, 0)
    made = [w[0] for w in words if len(w) > 2 and w[2] == "init"]
    freed = [w[0] for w in words if len(w) > 2 and w[2] in ("destroy", "abort")]
    assert len(set(made)) == 2 and sorted(made) == sorted(freed), (made, freed)


def _lost_work_job():
    import signal
    import time

    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState
    from horovod.engine import state as engine_state

    emulated_device.install_nccl(hvd, os.environ["HOROVOD_NCCL_SO_PATH"])
    hvd.init()
    hvd.allreduce(np.ones(4, np.float32), name="warm", op=hvd.Sum)
    hvd.allreduce(np.ones(4, np.float32), name="stuck", op=hvd.Sum)   # rank 0's GPU never finishes it
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    runtime = engine_state.current
    assert runtime is not None
    deadline = time.monotonic() + 120
    while runtime.state.dead is None and time.monotonic() < deadline:   # the peer's death ends this engine
        time.sleep(0.05)
    try:
        ObjectState(hvd.broadcast_object, hvd.rank, epoch=1).commit()
        return "committed"
    except Exception as exc:  # noqa: BLE001  (the test reads the type and text)
        return f"{type(exc).__name__}: {exc}"


def test_commit_refuses_state_from_gpu_work_an_engine_failure_aborted(tmp_path):
    """Item 4: the engine ended (a peer died) while rank 0's collective was still running on its GPU; the
    communicators were aborted, so the result is partial: commit() must not save the state."""
    env = standin.env(tmp_path, HOROVOD_GLOO_TIMEOUT_SECONDS="10", HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS="600",
                      STANDIN_NCCL_WAIT="2")
    outcomes = run_ranks(_lost_work_job, 2, env=env, timeout=240, expect_failure=True,
                         rank_env_overrides={0: {"STANDIN_NCCL_FAIL": "hang:2"}})
    status, text = outcomes[0]
    assert status == "ok", outcomes[0]
    assert text.startswith("HorovodInternalError") and "were aborted" in text and "allreduce.stuck" in text, text
