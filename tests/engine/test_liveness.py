"""Liveness (horovod/engine/liveness.py): a slow collective or a starved thread is not a dead peer; a frozen one is.

Issue 38, E2. Every byte a peer sends, on the control connection or the data plane, counts as life; the verdict
re-reads the connections before it declares anybody dead. The tests run real ranks with a short
``HOROVOD_GLOO_TIMEOUT_SECONDS`` and assert outcomes only (a slow machine stretches them, it never fails them).
"""
from __future__ import annotations

import pytest

from engine_helpers import run, transport_skip_reason

#: How much longer than the timeout the throttled collective must last for the case to count as reached.
LONG_ENOUGH = 1.25


def throttled_worker(mib: int, timeout: float, stop_s: float, run_s: float, attempts: int) -> dict:
    """Rank 0 throttles rank 1 (SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, each stop shorter than the timeout)
    while a large allreduce runs, so that it lasts several timeouts; then tiny allreduces must still work. Up to
    ``attempts`` rounds (larger each time), until one outlasted the timeout by a margin (rank 0 decides)."""
    import os
    import signal
    import threading
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pids = hvd.allgather_object(os.getpid())
    bad, took = [], []
    for attempt in range(attempts):
        big = np.full((attempt + 1) * mib * (1 << 20) // 4, rank + 1, np.float32)
        # Both ranks have their input before the throttling starts: filling hundreds of MiB a third of the time
        # (on a loaded machine) could otherwise keep rank 1 silent for a whole timeout before it reaches the ring.
        hvd.allreduce(np.zeros(1, np.float32), name=f"ready{attempt}")
        stop = threading.Event()

        def throttle(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                os.kill(pids[1], signal.SIGSTOP)
                stop.wait(stop_s)
                os.kill(pids[1], signal.SIGCONT)
                stop.wait(run_s)

        thread = threading.Thread(target=throttle, daemon=True) if rank == 0 else None
        start = time.monotonic()
        if thread is not None:
            thread.start()
        try:
            out = hvd.allreduce(big, op=hvd.Sum, name=f"big{attempt}")
        finally:
            stop.set()
            if thread is not None:
                thread.join()
                os.kill(pids[1], signal.SIGCONT)
        took.append(time.monotonic() - start)
        want = size * (size + 1) / 2
        if not (out == want).all():
            bad.append(f"big{attempt}: {np.count_nonzero(out != want)} wrong elements, e.g. {out[out != want][:3]}")
        del out, big
        for i in range(3):
            tiny = hvd.allreduce(np.full(4, rank, np.float32), op=hvd.Sum, name=f"tiny{attempt}.{i}")
            if not (tiny == size * (size - 1) / 2).all():
                bad.append(f"tiny{attempt}.{i}: got {tiny}")
            time.sleep(timeout / 2)   # idle between collectives: the heartbeats alone must keep the peers alive
        if hvd.broadcast_object(took[-1] >= LONG_ENOUGH * timeout, 0, name=f"enough{attempt}"):
            break
    hvd.shutdown()
    return {"took": max(took), "bad": bad}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_collective_longer_than_timeout_then_next_one_works(transport):
    """Was (issue 38, E2): the silence verdict ran right after the collective, inside the same drive step, before
    anything read the control connections again; so a collective longer than HOROVOD_GLOO_TIMEOUT_SECONDS
    completed and the next tiny allreduce failed with PeerFailureError on both ranks, each blaming the other."""
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    # Each stop lasts a quarter of it, so any stretch of one timeout holds at least two of the throttled rank's
    # half-second runs: with a third (3 s), a loaded CI machine once kept it from sending a byte for a whole timeout.
    timeout = 4.0
    results = run(throttled_worker, 2, transport, args=(128, timeout, 1.0, 0.5, 4), timeout=900,
                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout))})
    for rank, out in enumerate(results):
        assert not out["bad"], f"rank {rank}: {out['bad']}"
    took = results[0]["took"]
    if took < LONG_ENOUGH * timeout:   # the outcome is what is asserted; this only says the case was not reached
        pytest.skip(f"the throttled allreduce took only {took:.1f} s here, not {LONG_ENOUGH}x the {timeout} s timeout")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_training_shaped_loop_outlives_many_timeouts(transport):
    """Was (issue 38, E2): on the warm path a worker read its control connection outside ``select``
    (``Runtime._read_control``), taking the coordinator's heartbeats in without counting them, so a training loop
    at np = 2 declared the live coordinator dead after the timeout ("rank 0 has not been heard from"; TF's
    DistributedGradientTape died of it after minutes with the default 30 s)."""
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    seconds = 20.0   # ten times the timeout
    results = run(training_shaped_worker, 2, transport, args=(seconds, 0.01), timeout=600,
                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "2"})
    for rank, out in enumerate(results):
        assert not out["bad"], f"rank {rank}: {out['bad']}"
        assert out["steps"] > 0


def training_shaped_worker(seconds: float, compute: float) -> dict:
    """Steps of: asynchronous gradient allreduces, ``compute`` seconds of Python holding the GIL, synchronize; for
    ``seconds`` by rank 0's clock (it decides when everyone stops)."""
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    bad = []
    end = time.monotonic() + seconds
    step = 0
    while True:
        go = hvd.broadcast(np.array([time.monotonic() < end], np.int32), 0, name="go")
        if not go[0]:
            break
        handles = [hvd.allreduce_async(np.full(n, rank + step, np.float32), op=hvd.Sum, name=f"grad{i}")
                   for i, n in enumerate((16, 3000, 5))]
        t0 = time.monotonic()
        while time.monotonic() - t0 < compute:   # the framework's computation, holding the GIL
            pass
        want = sum(r + step for r in range(size))
        for i, h in enumerate(handles):
            out = hvd.synchronize(h)
            if not (out == want).all():
                bad.append(f"step {step} grad{i}: {out[:2]} != {want}")
        step += 1
    hvd.shutdown()
    return {"steps": step, "bad": bad}


def frozen_mid_collective_worker(mib: int, victim: int, workdir: str) -> dict:
    """Rank 0 freezes ``victim`` (SIGSTOP, for good) a moment into a large allreduce; the survivors report their
    error, the wall-clock time it came and the freeze's time; then rank 0 kills the frozen rank."""
    import os
    import signal
    import threading
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    pids = hvd.allgather_object(os.getpid())
    hvd.allreduce(np.ones(4, np.float32), name="warmup")
    big = np.ones(mib * (1 << 20) // 4, np.float32)
    frozen_at = os.path.join(workdir, "frozen_at")

    def freeze() -> None:
        time.sleep(0.3)
        os.kill(pids[victim], signal.SIGSTOP)
        with open(frozen_at + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(frozen_at + ".tmp", frozen_at)

    if rank == 0:
        threading.Thread(target=freeze, daemon=True).start()
    outcome: dict = {"error": None, "culprit": None}
    try:
        for i in range(1000):   # until the freeze breaks one (the first is normally long enough)
            hvd.allreduce(big, name=f"big{i}")
    except hvd.HorovodInternalError as exc:
        outcome["at"] = time.time()
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        outcome["culprit"] = getattr(exc, "culprit", None)
    with open(frozen_at) as f:
        outcome["frozen_at"] = float(f.read())
    open(os.path.join(workdir, f"done{rank}"), "w").close()
    if rank == 0:   # release the frozen rank once every survivor has its outcome
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(workdir, f"done{r}")) for r in range(hvd.size()) if r != victim):
            time.sleep(0.1)
        os.kill(pids[victim], signal.SIGKILL)
    hvd.shutdown()
    return outcome


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_frozen_mid_collective_is_named_soon(transport, tmp_path):
    """A peer that stops in the middle of a long collective: every survivor fails soon after its last byte (the
    transport's own wait bounds it) and names the frozen rank, not a healthy one."""
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    timeout, victim = 3, 2
    results = run(frozen_mid_collective_worker, 3, transport, args=(256, victim, str(tmp_path)), timeout=300,
                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(timeout)}, expect_failure=True)
    survivors = {r: o for r, o in enumerate(results) if r != victim}
    for rank, (status, out) in survivors.items():
        assert status == "ok", f"rank {rank}: {out}"
        assert out["error"] is not None, f"rank {rank}: the job went on without rank {victim}"
        assert f"rank {victim}" in out["error"], f"rank {rank} did not name rank {victim}: {out['error']}"
        assert out["culprit"] in (victim, None), f"rank {rank} blamed rank {out['culprit']}: {out['error']}"
        # The freeze is the victim's last byte at the latest. Generous for a loaded machine, and still far below
        # the time the collective would have taken.
        assert out["at"] - out["frozen_at"] < timeout + 30, (rank, out)
        print(f"rank {rank}: failed {out['at'] - out['frozen_at']:.1f} s after the freeze: {out['error'][:200]}")


# ------------------------------------------------------------------------------------------------ units
def test_queued_bytes_count_as_life_and_the_same_queue_does_not():
    """The verdict looks at what is queued unread (nothing consumed): new bytes are life, an unchanged queue is
    not (a peer frozen after its last heartbeat stays silent however long nobody reads)."""
    import socket

    from horovod.engine.liveness import Liveness

    mine, theirs = socket.socketpair()
    try:
        live = Liveness({1: mine}, lambda peer, payload: None, timeout=5.0)
        t0 = live._heard[1]
        assert live.silent(now=t0 + 6.0) == [(1, 6.0)]   # nothing arrived: silent
        theirs.sendall(b"x" * 10)
        assert live.silent(now=t0 + 6.0) == []           # queued, unread: heard at this look
        assert mine.recv(1, socket.MSG_PEEK) == b"x"     # and nothing was consumed
        assert [p for p, _ in live.silent(now=t0 + 12.0)] == [1]   # the same 10 bytes are no new sign of life
        theirs.sendall(b"y")
        assert live.silent(now=t0 + 12.0) == []
    finally:
        mine.close()
        theirs.close()


def test_control_reads_by_any_path_count_as_life():
    """Was (issue 38, E2): only a control socket seen readable by the drive loop's ``select`` counted; a read by
    another path (the warm path's) consumed the heartbeat unnoticed."""
    import socket
    import time

    from horovod.engine.controller import ControlPlane
    from horovod.engine.liveness import HEARTBEAT, Liveness
    from horovod.transport import sockets

    mine, theirs = socket.socketpair()
    try:
        control = ControlPlane(0, 2, {1: mine})
        live = Liveness(control.peers, control.send_bytes, timeout=5.0)   # the control plane found through send
        start = live._heard[1]
        sockets.send_frame(theirs, HEARTBEAT)
        deadline = time.monotonic() + 10
        while not control.receive(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert control.last_heard(1) >= start
        assert live.silent(now=control.last_heard(1) + 4.0) == []
        assert [p for p, _ in live.silent(now=control.last_heard(1) + 6.0)] == [1]
    finally:
        mine.close()
        theirs.close()
