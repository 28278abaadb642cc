"""The launcher's hang watch across an elastic job's epochs (or Ray calls): a collection still running when the
next epoch begins is about the epoch before. Seen in CI (session 14) under load: epoch 0's collection finished just
after epoch 1 had begun, its verdict became epoch 1's, and the quiet period after it swallowed epoch 1's own stall
report, so the job's failure carried epoch 0's verdict."""
from __future__ import annotations

import time

from horovod.runner import doctor_watch
from horovod.runner.doctor_watch import REQUEST_QUIET_S, HangWatch
from horovod.transport.rendezvous import MemoryStore

EPOCH0 = ["Horovod doctor (2 of 2 ranks dumped, generation 0):", "  - rank 1 skipped allreduce 'x'"]


def _watch(tmp_path) -> HangWatch:
    return HangWatch(MemoryStore(), {doctor_watch.DIR_ENV: str(tmp_path)}, {0: "localhost", 1: "localhost"})


def test_a_collection_that_ends_in_the_next_epoch_is_not_that_epochs_verdict(tmp_path, monkeypatch):
    watch = _watch(tmp_path)

    def epoch_ends_while_reading(directory):
        watch.new_generation(1, {0: "localhost", 1: "localhost"})   # the driver starts epoch 1 meanwhile
        return EPOCH0

    monkeypatch.setattr(doctor_watch, "report", epoch_ends_while_reading)
    said = watch.collect("rank 0 reported a stall warning", announce=False, signal_ranks=False)
    assert said.startswith("\n".join(EPOCH0)), said     # still announced as what it is: epoch 0's verdict
    assert watch.verdict == "", "epoch 0's verdict became epoch 1's"
    assert time.monotonic() - watch._last_collect >= REQUEST_QUIET_S, "epoch 1's first stall would be ignored"


def test_a_collection_within_one_epoch_is_its_verdict(tmp_path, monkeypatch):
    watch = _watch(tmp_path)
    monkeypatch.setattr(doctor_watch, "report", lambda directory: EPOCH0)
    said = watch.collect("rank 0 reported a stall warning", announce=False, signal_ranks=False)
    assert watch.verdict == said and said.startswith("\n".join(EPOCH0))
    assert time.monotonic() - watch._last_collect < REQUEST_QUIET_S   # a second request soon after waits
