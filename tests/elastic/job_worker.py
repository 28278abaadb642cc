"""The worker side of ``elastic_helpers.ElasticJob``, shared by its training scripts (elastic_worker.py,
torch_worker.py, tests/jax/jax_elastic_worker.py): the settings the test passes through the environment, the
training log, and the gradient of the toy model ``check_training`` replays.  Import it in a worker only: it reads
the job's environment on import.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import numpy as np

LOG = os.environ["ELASTIC_TEST_LOG"]
STOP = os.environ["ELASTIC_TEST_STOP"]
MIN_STEPS = int(os.environ.get("ELASTIC_TEST_MIN_STEPS", "0"))
STEP_DELAY = float(os.environ.get("ELASTIC_TEST_STEP_DELAY", "0.05"))
WID = os.environ["HOROVOD_ELASTIC_WORKER_ID"]

#: The toy model's learning rate: step ``s`` on ``n`` ranks applies ``w -= LR * sum_r grad(s, r) / n``.
LR = 0.5


def grad(step: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s gradient at step ``step``: small integers, so every sum is exact in any order."""
    return np.array([step % 5 + rank, 1.0, (step * rank) % 3, rank], dtype=np.float64)


def log(**event) -> None:
    """Append ``event`` (with this worker's id) to the job's training log as one JSON line."""
    event["id"] = WID
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())   # one write: lines of different workers never mix
    finally:
        os.close(fd)


@contextlib.contextmanager
def crashes_logged(expected: str = "") -> Iterator[None]:
    """Log a ``crash`` event (this pid, the error) for any exception leaving the block and re-raise it; an exit,
    or an error whose text contains ``expected`` (an injected failure), is not a crash."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, SystemExit) and not (expected and expected in str(exc)):
            log(ev="crash", pid=os.getpid(), error=repr(exc))
        raise


def stop_requested(rank: int, step: int) -> bool:
    """Rank 0's decision to stop (the worker broadcasts it): the stop file exists and enough steps were made."""
    return rank == 0 and step >= MIN_STEPS and os.path.exists(STOP)
