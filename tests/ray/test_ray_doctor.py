"""The hang doctor under Ray (conftest.py's two-node cluster on this machine): a rank that skips a collective; the
executor collects every actor's dump (the actors announce their pids, this machine's are signalled) and the
failure carries the verdict naming the rank, the tensor and the lines marked ``# HANG:ray_skip:<role>``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from horovod.doctor import report  # noqa: E402
from horovod.ray import RayExecutor  # noqa: E402

pytestmark = pytest.mark.usefixtures("cluster")

HERE = Path(__file__).resolve()
BIG = np.ones(512, dtype=np.float32)   # 2 KiB: past the fast lane, through the coordinator


def marker_line(role: str) -> str:
    for number, text in enumerate(HERE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# HANG:ray_skip:{role}"):
            return f"test_ray_doctor.py:{number} (`{text.strip()}`)"
    raise AssertionError(f"no marker ray_skip:{role}")


def skip_one_collective():
    """Healthy steps, then the last rank skips 'grad.fc2.weight' (a module function: shipped by reference, so the
    doctor sees this file's lines)."""
    import horovod.numpy as hvd

    culprit = hvd.size() - 1
    for _ in range(3):
        hvd.allreduce(BIG, name="grad.fc1.weight")
        hvd.allreduce(BIG, name="grad.fc2.weight")
        hvd.allgather(BIG[:4], name="stats")
    if hvd.rank() != culprit:
        hvd.allreduce(BIG, name="grad.fc2.weight")  # HANG:ray_skip:waiter
    hvd.allgather(BIG[:4], name="stats")  # HANG:ray_skip:culprit


def static_job():
    import horovod.numpy as hvd

    hvd.init()
    skip_one_collective()


def elastic_job():
    """The same hang in an elastic job: it comes back in every epoch, until the reset limit fails the job."""
    import horovod.numpy as hvd
    from horovod.common.elastic import ObjectState, default_reset, run_fn

    hvd.init()
    run_fn(lambda state: skip_one_collective(), default_reset)(ObjectState(hvd.broadcast_object, hvd.rank, step=0))


def failure_of(job, monkeypatch, dumps: Path, **executor_args) -> BaseException:
    """Run ``job`` on a RayExecutor with short stall knobs (the executor hands the driver's HOROVOD_* knobs to the
    actors) and return the exception it failed with."""
    for name, value in {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5",
                        "HOROVOD_FLIGHT_RECORDER_DIR": str(dumps)}.items():
        monkeypatch.setenv(name, value)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), cpus_per_worker=1, **executor_args)
    executor.start()
    try:
        with pytest.raises(Exception) as failure:
            executor.run(job)
    finally:
        executor.shutdown()
    return failure.value


def test_static_executor_collects_and_its_failure_carries_the_verdict(tmp_path, monkeypatch):
    error = failure_of(static_job, monkeypatch, tmp_path / "dumps", num_workers=2)
    notes = "\n".join(getattr(error, "__notes__", []))
    verdict = "\n".join(report(str(tmp_path / "dumps")))
    expected = ["Horovod doctor (2 of 2 ranks dumped", "rank 1 skipped allreduce 'grad.fc2.weight'",
                "and went on to allgather 'stats'", marker_line("culprit"),
                f"rank 0 waits in it ({marker_line('waiter')})"]
    for piece in expected:
        assert piece in verdict, f"{piece!r} not in the verdict:\n{verdict}"
        assert piece in notes, f"{piece!r} not in the failure's notes:\n{notes}\n{error}"
    assert "collected in" in notes and "after rank 0 reported a stall warning" in notes, notes


def test_elastic_executor_fails_at_the_reset_limit_with_the_latest_epochs_verdict(tmp_path, monkeypatch):
    error = failure_of(elastic_job, monkeypatch, tmp_path / "dumps", min_workers=2, max_workers=2, reset_limit=1,
                       elastic_timeout=60)
    message = str(error)
    assert "number of resets during elastic job exceeded limit: 1" in message, message
    for piece in ["Horovod doctor (2 of 2 ranks dumped, generation 1)", "rank 1 skipped allreduce 'grad.fc2.weight'",
                  marker_line("culprit"), f"rank 0 waits in it ({marker_line('waiter')})"]:
        assert piece in message, f"{piece!r} not in the failure:\n{message}"
