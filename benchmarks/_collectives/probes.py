"""Measurements of the machine itself, in the driver: what transports it offers, the wake-up floor, the cost of
writing into memory not in cache, and numpy's single-core copy ceiling."""
from __future__ import annotations

import importlib
import math
import os
import statistics
import time
from typing import Any, Dict, Optional, Sequence

import numpy as np

from benchmarks._collectives.cases import F32
from benchmarks._lib.measure import MIB
from benchmarks._lib.report import version


def shm_available() -> bool:
    try:
        importlib.import_module("horovod.transport.shm")  # registers itself on CPUs it supports
        from horovod.transport.base import REGISTRY
    except Exception:
        return False
    return "shm" in REGISTRY


def mpi_available() -> Optional[str]:
    """None when mpirun + mpi4py are usable, else why not."""
    import shutil

    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    if version("mpi4py") is None:
        return "mpi4py is not installed"
    return None


def wakeup_probe(iters: int) -> Dict[str, Any]:
    """The machine's floor for a collective after compute: two processes, each sleeps 1 ms, then one byte goes
    to the peer (which is blocked in ``recv``) and one byte comes back; the round trip is timed. Nothing spins.
    """
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the peer: answer every byte after the same "compute"
        a.close()
        try:
            for _ in range(iters + 20):
                time.sleep(0.001)
                if not b.recv(1):
                    break
                b.sendall(b"y")
        finally:
            os._exit(0)
    b.close()
    times = []
    try:
        for i in range(iters + 20):
            time.sleep(0.001)
            t0 = time.perf_counter()
            a.sendall(b"x")
            a.recv(1)
            if i >= 20:
                times.append(time.perf_counter() - t0)
    finally:
        a.close()
        os.waitpid(pid, 0)
    arr = np.array(times)
    return {"kind": "wakeup", "np": 2, "median_s": float(np.median(arr)), "p90_s": float(np.percentile(arr, 90)),
            "mean_s": float(arr.mean()), "iters": len(times)}


def cold_write_probe(nbytes: int, rounds: int, chunk: int = MIB) -> Dict[str, Any]:
    """What a *new* result costs beyond an in-place one on this machine, whatever the collective does.

    An in-place allreduce writes each reduced chunk back over input it has just read, so those cache lines are
    already in cache; a new result writes the same bytes into memory that is not (the CPU reads every line before
    writing it).  Two processes (the ranks of an np = 2 allreduce share the memory bus) copy ``nbytes`` chunk by
    chunk at the same time, after evicting the caches: once into the chunk just read, once into a separate
    buffer.  The difference is the floor a new result pays on top of in place.
    """
    import socket

    n, step = max(1, nbytes // 4), max(1, chunk // 4)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    peer = b if pid == 0 else a
    (a if pid == 0 else b).close()
    try:
        src, dst, staging = np.ones(n, F32), np.ones(n, F32), np.empty(step, F32)
        evict = np.ones(max(256 * MIB, 4 * nbytes), np.uint8)

        def timed(out: np.ndarray) -> float:
            evict[::64] += 1
            peer.sendall(b"r")   # start together
            peer.recv(1)
            t0 = time.perf_counter()
            for lo in range(0, n, step):
                piece = staging[:min(step, n - lo)]
                np.copyto(piece, src[lo:lo + step])    # read the chunk (the reduction's input)
                np.copyto(out[lo:lo + step], piece)    # then write the result chunk
            return time.perf_counter() - t0

        hot = statistics.median([timed(src) for _ in range(max(3, rounds))])
        cold = statistics.median([timed(dst) for _ in range(max(3, rounds))])
    finally:
        if pid == 0:
            os._exit(0)
        peer.close()
        os.waitpid(pid, 0)
    return {"kind": "coldwrite", "bytes": n * 4, "hot_s": hot, "cold_s": cold, "extra_s": max(0.0, cold - hot)}


def memcpy_ceiling(sizes: Sequence[int], rounds: int, sample_s: float) -> Dict[int, float]:
    """Median seconds of one ``np.copyto`` of ``size`` bytes on this (single) thread."""
    out = {}
    for nbytes in sizes:
        src = np.ones(max(1, nbytes // 4), F32)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        probe = time.perf_counter() - t0
        k = int(min(100000, max(1, math.ceil(sample_s / max(probe, 1e-8)))))
        samples = []
        for _ in range(max(3, rounds)):
            t0 = time.perf_counter()
            for _ in range(k):
                np.copyto(dst, src)
            samples.append((time.perf_counter() - t0) / k)
        out[src.nbytes] = statistics.median(samples)
    return out


