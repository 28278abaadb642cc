"""A grouped collective with a different number of tensors on each rank (issue 53): every rank gets the mismatch
error at once, naming what each rank passed, as every other mismatch does, instead of waiting for the stall
inspector; the job goes on, and the same group name works again once the ranks agree."""
from __future__ import annotations

import pytest

from engine_helpers import TRANSPORTS, run, transport_skip_reason

#: Guards only: without the check the stalled groups fail here rather than at the run's timeout. A mismatch must
#: be reported long before (it is, at once); the message, not the time, is what the test checks.
STALL_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "20", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}


def grouped_count_worker() -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    size = hvd.size()
    odd = rank == size - 1   # the last rank passes one tensor fewer (rank 1 at np = 2)

    def tensors(n):
        return [np.full(3, float(i + 1)) for i in range(n)]

    cases = {
        "named": lambda: hvd.grouped_allreduce(tensors(2 if odd else 3), name="g_named", op=hvd.Sum),
        "unnamed": lambda: hvd.grouped_allreduce(tensors(2 if odd else 3), op=hvd.Sum),
        # A group of one is a lone call on the fast lane; the others' group of two is not.
        "one_vs_two": lambda: hvd.grouped_allreduce(tensors(1 if odd else 2), name="g_one", op=hvd.Sum),
        "async": lambda: hvd.synchronize(hvd.grouped_allreduce_async(tensors(4 if odd else 3), name="g_async",
                                                                      op=hvd.Sum)),
        "allgather": lambda: hvd.grouped_allgather([np.ones((2, 2))] * (1 if odd else 2), name="g_gather"),
    }
    out = {}
    for label, call in cases.items():
        try:
            call()
            out[label] = ("no error", False, "")
        except Exception as exc:  # noqa: BLE001 (the wrong type is reported, not raised)
            out[label] = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc))
        # The job goes on, and the name is free again: the same group, agreed this time, runs.
        again = hvd.grouped_allreduce(tensors(2), name=f"g_{label}_again", op=hvd.Sum)
        out[label + "/again"] = [a.tolist() for a in again] == [[float(size * (i + 1))] * 3 for i in range(2)]
        if label == "named":
            same = hvd.grouped_allreduce(tensors(3), name="g_named", op=hvd.Sum)
            out[label + "/same name"] = [a.tolist() for a in same] == [[float(size * (i + 1))] * 3
                                                                       for i in range(3)]
    hvd.shutdown()
    return out


#: label -> (the counts each rank passed, rank 0's and the last rank's, for the message)
COUNTS = {"named": (3, 2), "unnamed": (3, 2), "one_vs_two": (2, 1), "async": (3, 4), "allgather": (2, 1)}


def _expected_fragments(label: str, np_: int):
    mine, odd = COUNTS[label]
    others = ", ".join(str(r) for r in range(np_ - 1))
    plural = "s" if np_ > 2 else ""
    kind = "grouped_allgather" if label == "allgather" else "grouped_allreduce"
    return [f"Mismatched {kind} group sizes", f"rank{plural} {others} passed {mine} tensor",
            f"rank {np_ - 1} passed {odd} tensor", "same number of tensors"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_grouped_count_mismatch_fails_every_rank_at_once(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    results = run(grouped_count_worker, 2, transport, env=STALL_ENV, timeout=150)
    problems = []
    for rank, out in enumerate(results):
        for label in COUNTS:
            kind, internal, text = out[label]
            missing = [f for f in _expected_fragments(label, 2) if f not in text]
            if not internal or kind != "MismatchError" or missing:
                problems.append(f"rank {rank} {label}: {kind}: {text!r} (expected a MismatchError with {missing})")
            if not out[label + "/again"]:
                problems.append(f"rank {rank} {label}: the same group, agreed, did not run afterwards")
        if not out["named/same name"]:
            problems.append(f"rank {rank}: the group name that failed did not work again")
    assert not problems, "\n".join(problems)


def test_grouped_count_mismatch_reaches_a_rank_that_submits_late():
    # np = 3: the coordinator sees the mismatch from two ranks; the third, whichever count it passes, still gets it.
    results = run(grouped_count_worker, 3, "tcp", env=STALL_ENV, timeout=150)
    problems = []
    for rank, out in enumerate(results):
        for label in COUNTS:
            kind, internal, text = out[label]
            if not internal or kind != "MismatchError" or "group sizes" not in text:
                problems.append(f"rank {rank} {label}: {kind}: {text!r}")
            if not out[label + "/again"]:
                problems.append(f"rank {rank} {label}: the same group, agreed, did not run afterwards")
    assert not problems, "\n".join(problems)
