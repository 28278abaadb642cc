"""What each rank runs in the device run's NCCL-between-ranks checks (tests/gpu/test_gpu_nccl_ranks.py): process
sets on two streams, a peer killed with a collective in flight, and communicators rebuilt by a new engine.

Values are small integers (exact in every dtype), checked against numpy.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict

import numpy as np


def _setup():
    import torch

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch, hvd


def _mode(set_id: int = 0) -> str:
    from horovod.engine import state

    return state.runtime().executor.devices.mode(set_id) or "none"


def process_sets_two_streams(steps: int = 6) -> Dict[str, object]:
    """HOROVOD_NUM_NCCL_STREAMS=2: each rank's own set and the world, interleaved (issue 36 item 1: every member of a
    set must take the same communicator for the same collective, whatever the other sets did)."""
    torch, hvd = _setup()
    rank, size = hvd.rank(), hvd.size()
    own = [hvd.add_process_set([r]) for r in range(size)]
    wrong = []
    for step in range(steps):
        if step % 2 == rank % 2:   # the ranks' own sets move at different times
            mine = hvd.allreduce(torch.full((3,), float(rank), device="cuda"), op=hvd.Sum, name=f"own.{step}",
                                 process_set=own[rank])
            if mine.tolist() != [float(rank)] * 3:
                wrong.append(f"own set step {step}: {mine.tolist()}")
        for count in (5, 7):
            x = torch.arange(count, device="cuda", dtype=torch.float32) + rank
            got = hvd.allreduce(x, op=hvd.Sum, name=f"w{count}.{step}").cpu().numpy()
            want = size * np.arange(count) + size * (size - 1) / 2
            if not np.array_equal(got, want):
                wrong.append(f"world {count} step {step}: {got.tolist()} != {want.tolist()}")
    torch.cuda.synchronize()
    modes = [_mode(0), _mode(own[rank].process_set_id)]
    hvd.shutdown()
    return {"wrong": wrong, "modes": modes}


def killed_peer(victim: int = 1, timeout: float = 120.0) -> Dict[str, object]:
    """Rank ``victim`` kills itself right after enqueuing a large allreduce (its kernel in flight); every other
    rank must get an error, and its GPU must not stay blocked (its next device synchronize returns)."""
    import signal

    torch, hvd = _setup()
    x = torch.ones(64 << 20, device="cuda")   # 256 MiB: still running on the GPU when the victim dies
    hvd.allreduce(torch.ones(4, device="cuda"), name="warm")
    torch.cuda.synchronize()
    if hvd.rank() == victim:
        hvd.allreduce_async_(x, name="big.0")
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    error = "no error"
    try:
        for i in range(1000):   # keep collectives in flight until the engine sees the death
            hvd.synchronize(hvd.allreduce_async_(x, name=f"big.{i}"))
            if time.monotonic() - start > timeout:
                break
    except Exception as exc:  # noqa: BLE001  (the test reads the type and text)
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    synced = threading.Event()
    waiter = threading.Thread(target=lambda: (torch.cuda.synchronize(), synced.set()), daemon=True)
    waiter.start()
    waiter.join(timeout)
    try:
        hvd.shutdown()
    except Exception:  # noqa: BLE001  (the engine has failed already)
        pass
    return {"error": error, "seconds_to_error": took, "gpu_released": synced.is_set()}


def rebuilt_communicators(rounds: int = 3) -> Dict[str, object]:
    """A new engine after shutdown (what an elastic reset does) creates new NCCL communicators that work."""
    import torch

    import horovod.torch as hvd

    wrong, modes = [], []
    for r in range(rounds):
        hvd.init()
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        size = hvd.size()
        got = hvd.allreduce(torch.full((4,), float(hvd.rank() + r), device="cuda"), op=hvd.Sum, name="again")
        want = float(sum(q + r for q in range(size)))
        if got.tolist() != [want] * 4:
            wrong.append(f"round {r}: {got.tolist()} != {want}")
        modes.append(_mode(0))
        torch.cuda.synchronize()
        hvd.shutdown()
    return {"wrong": wrong, "modes": modes}


def hierarchical_allreduce() -> Dict[str, object]:
    """HOROVOD_HIERARCHICAL_ALLREDUCE=1, four ranks as two hosts of two (HOROVOD_HOSTNAME) on the one GPU: NCCL
    inside each host, the CPU transport across them (single, Average, and three fused asynchronous tensors)."""
    from horovod.engine import state

    torch, hvd = _setup()
    r, size = hvd.rank(), hvd.size()
    wrong = []
    got = hvd.allreduce(torch.arange(7, dtype=torch.float32, device="cuda") + r, op=hvd.Sum, name="one")
    if got.tolist() != [float(size * i + sum(range(size))) for i in range(7)]:
        wrong.append(f"sum: {got.tolist()}")
    got = hvd.allreduce(torch.full((3, 3), 4.0 * (r + 1), device="cuda"), op=hvd.Average, name="avg")
    if got.flatten().tolist() != [4.0 * sum(range(1, size + 1)) / size] * 9:
        wrong.append(f"average: {got.flatten().tolist()}")
    handles = [hvd.allreduce_async(torch.arange(5, dtype=torch.int64, device="cuda") * (r + 1), op=hvd.Sum,
                                   name=f"fused.{i}") for i in range(3)]
    for h in handles:
        got = hvd.synchronize(h)
        if got.tolist() != [i * sum(range(1, size + 1)) for i in range(5)]:
            wrong.append(f"fused: {got.tolist()}")
    plane = state.runtime().executor.devices._planes[0]
    shape = {"local": [c.size for c in plane.local], "cross": None if plane.cross is None else plane.cross.size}
    torch.cuda.synchronize()
    hvd.shutdown()
    return {"wrong": wrong, "mode": plane.mode, "shape": shape}
