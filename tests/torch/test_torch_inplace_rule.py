"""The in-place rule of asynchronous collectives (issue 38): a tensor must not be modified until synchronize.

horovod.torch enforces it for tensors in CPU memory through torch's version counter: a change between the
``*_async`` call and ``synchronize`` raises instead of returning a timing-dependent mix of old and new values.
"""
from __future__ import annotations

import pytest

from torch_helpers import run

pytest.importorskip("torch")


def modified_worker() -> dict:
    import time

    import torch

    import horovod.torch as hvd
    from horovod.torch.staging import ModifiedWhileInFlight

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict = {}

    def case(label, start, modify, inplace=False):
        # Every rank other than 0 starts late, so rank 0's collective is surely still running when it modifies.
        if rank != 0:
            time.sleep(0.5)
        t = torch.full((1000,), float(rank + 1))
        handle = start(t)
        if rank == 0:
            modify(t)
        try:
            result = hvd.synchronize(handle)
            out[label] = ("returned", float(result[0]))
        except ModifiedWhileInFlight as exc:
            out[label] = ("raised", str(exc))

    case("allreduce_async + add_", lambda t: hvd.allreduce_async(t, op=hvd.Sum, name="a"), lambda t: t.add_(1))
    case("allreduce_async_ + mul_", lambda t: hvd.allreduce_async_(t, op=hvd.Sum, name="b"), lambda t: t.mul_(2))
    case("broadcast_async_ + copy_", lambda t: hvd.broadcast_async_(t, 0, name="c"),
         lambda t: t.copy_(torch.zeros(1000)))
    # Not modified: the same calls return their result, and so does a read of the tensor meanwhile.
    case("allreduce_async, only read", lambda t: hvd.allreduce_async(t, op=hvd.Sum, name="d"), lambda t: t.sum())
    case("allreduce_async_, only read", lambda t: hvd.allreduce_async_(t, op=hvd.Sum, name="e"), lambda t: t.max())
    # The engine still works after the error.
    out["after"] = float(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after")[0])
    out["size"] = size
    hvd.shutdown()
    return out


def test_modified_while_in_flight_raises_on_the_modifying_rank():
    results = run(modified_worker, 2)
    size = results[0]["size"]
    total = size * (size + 1) / 2
    rank0 = results[0]
    for label in ("allreduce_async + add_", "allreduce_async_ + mul_", "broadcast_async_ + copy_"):
        kind, text = rank0[label]
        assert kind == "raised", f"{label}: {rank0[label]}"
        assert "modified in place" in text and "shape (1000,)" in text, text
    assert rank0["allreduce_async, only read"] == ("returned", total)
    assert rank0["allreduce_async_, only read"] == ("returned", total)
    for rank, out in enumerate(results):
        assert out["after"] == size, f"rank {rank}: {out}"
        if rank:   # the other ranks modified nothing: no error there
            assert all(out[label][0] == "returned" for label in out if "async" in label), out
