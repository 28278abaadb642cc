"""Data-plane speed: this project's collectives next to torch.distributed (Gloo) and Open MPI, in one command.

Usage::

    python benchmarks/collectives.py                  # np = 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/collectives.py --quick          # smoke run: 5 sizes, 3 rounds, 500 latency calls
    python benchmarks/collectives.py --max 256M       # the ladder up to 256 MiB (the numbers for the record)
    python benchmarks/collectives.py --out results.md --json results.json
    python benchmarks/collectives.py --np 2 --ops allreduce --sizes 1M,64M --skip memory,fusion

Duration on the 2-core development machine: ``--quick`` about 1 minute when it is quiet and 2.5 minutes at load 5;
the default about 5.5 minutes at load 5; ``--max 256M`` about 15 minutes at load 6-10.  Open MPI's busy polling
is what a loaded machine slows down most (at load 5, an np = 2 ``Allgather`` took exactly 8 ms per call at every
size), so take the numbers for the record on a quiet machine and keep the load average line of the header.

What is measured (float32, sum where there is a reduction):

* allreduce, allgather, broadcast, alltoall and reducescatter at sizes 4 KiB .. ``--max``, at np = 2 and 4, for
  this project's transports called directly (``tcp``, ``shm``, and ``mpi`` under ``mpirun``), for the full engine
  (``horovod.numpy`` collectives: negotiation, fusion buffer and background thread included) over each of them,
  for ``torch.distributed`` with the Gloo backend, and for mpi4py on Open MPI.  The size is the nccl-tests size:
  the whole buffer (allgather: the gathered output, reducescatter: the input, alltoall: one rank's send buffer).
  Reported: median time per call (each sample is the slowest rank's mean over a batch of calls timed between
  barriers), algbw = size / time, busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (allgather, reducescatter,
  alltoall) or 1 (broadcast).  Implementations that share a job are measured in alternating order, one batch
  each per round, so machine noise hits them alike.  Every implementation's result is checked once against
  numpy at every size before it is timed; a wrong result is reported as WRONG, never as a speed.
* the numpy copy ceiling: ``np.copyto`` on one core at the same sizes.
* latency of one 8-byte allreduce at every world size (median and p90 per call, engine negotiation included).
* tensor fusion: 1,000 allreduces of 4 KiB issued asynchronously then synchronized, with the default
  ``HOROVOD_FUSION_THRESHOLD`` and with 0 (alternating re-initialisations of the engine inside one job).
* memory: peak RSS per rank during a 64 MiB allreduce, minus the RSS before it (the tensor is already
  allocated then) and minus a result array the call allocates, in fresh processes.

Jobs, per world size: ``horovodrun -np N`` with ``HOROVOD_TRANSPORT=shm`` (the engine, a second independent shm
transport beside it, and a Gloo process group, all in the same processes), then ``mpirun -np N --bind-to none``
(``--oversubscribe`` above the core count; the engine on the mpi transport, ``MpiTransport`` alone, and
mpi4py), then ``horovodrun`` with ``HOROVOD_TRANSPORT=tcp``; memory in fresh two-rank jobs at the end.  Every job
runs under a timeout that kills its whole process group; a failed job is named in the notes and the other jobs'
numbers are still printed.  The targets compare the engine on the single-host default transport (shm).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _launch  # noqa: E402
from _launch import KIB, MIB, bus_factor, format_size  # noqa: E402

OPS = ("allreduce", "allreduce-avg", "allreduce-new", "allgather", "broadcast", "alltoall", "reducescatter")
# allreduce-new: the same reduction, but the result is a new array each call (``hvd.allreduce``, not ``allreduce_``);
# implementations without such a call (Gloo) sit it out.  allreduce-avg: the in-place reduction averaged, the op
# training uses (hvd: ``op=Average``; Gloo and Open MPI have no average on CPU: their users sum, then divide).
REDUCTIONS = ("allreduce", "allreduce-avg", "allreduce-new")
# Latency patterns: what runs before each timed 8-byte call.
LATENCY_PATTERNS = ("back to back", "barrier before each", "1 ms compute before each")
F32 = np.float32
PERIOD = 113  # pattern period of the validation data: small integers, so every float32 sum is exact

# Display names, in table column order.
LABELS = {
    "engine-shm": "hvd engine shm", "engine-tcp": "hvd engine tcp", "engine-mpi": "hvd engine mpi",
    "torch-shm": "hvd.torch shm", "torch-tcp": "hvd.torch tcp",
    "raw-shm": "shm transport", "raw-tcp": "tcp transport", "raw-mpi": "mpi transport",
    "gloo": "torch Gloo", "openmpi": "Open MPI (mpi4py)",
}
ORDER = list(LABELS)


# ======================================================================================================
# Rank side
# ======================================================================================================
class Case:
    """One collective at one size on this rank: its buffers, the validation pattern and numpy's answer."""

    def __init__(self, op: str, nbytes: int, rank: int, size: int):
        self.op, self.rank, self.size = op, rank, size
        if op in REDUCTIONS or op == "broadcast":
            count = max(1, nbytes // 4)
        else:  # every rank's block must be whole
            count = max(size, nbytes // 4 // size * size)
        self.count, self.per = count, count // size
        self.nbytes = count * 4
        self.splits = [self.per] * size
        self._expected: Optional[np.ndarray] = None
        if op in REDUCTIONS or op == "broadcast":
            self.buf = np.zeros(count, F32)
        elif op == "allgather":
            self.send, self.recv = np.zeros(self.per, F32), np.zeros(count, F32)
        elif op == "reducescatter":
            self.send, self.recv = np.zeros(count, F32), np.zeros(self.per, F32)
        elif op == "alltoall":
            self.send, self.recv = np.zeros(count, F32), np.zeros(count, F32)
        else:
            raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")

    def _base(self, n: int) -> np.ndarray:
        return np.resize(np.arange(PERIOD, dtype=F32), n)

    def load_pattern(self) -> None:
        """Inputs: the pattern plus this rank's number; outputs: a value no correct result contains."""
        r = F32(self.rank)
        if self.op in REDUCTIONS or self.op == "broadcast":
            np.add(self._base(self.count), r, out=self.buf)
        elif self.op == "allgather":
            np.add(self._base(self.per), r, out=self.send)
            self.recv.fill(-1)
        else:
            np.add(self._base(self.count), r, out=self.send)
            self.recv.fill(-1)

    def expected(self) -> np.ndarray:
        """numpy's answer for this rank (computed once: at 256 MiB it is not free)."""
        if self._expected is None:
            self._expected = self._compute_expected()
        return self._expected

    def _compute_expected(self) -> np.ndarray:
        n, per, r = self.size, self.per, self.rank
        offset = F32(n * (n - 1) // 2)
        if self.op == "allreduce-avg":
            return (self._base(self.count) * F32(n) + offset) / F32(n)
        if self.op in REDUCTIONS:
            return self._base(self.count) * F32(n) + offset
        if self.op == "broadcast":
            return self._base(self.count)  # root 0 adds 0
        if self.op == "allgather":
            return np.concatenate([self._base(per) + F32(p) for p in range(n)])
        if self.op == "reducescatter":
            return self._base(self.count)[r * per:(r + 1) * per] * F32(n) + offset
        block = self._base(self.count)[r * per:(r + 1) * per]
        return np.concatenate([block + F32(p) for p in range(n)])

    def check(self, out: Any) -> Optional[str]:
        """None when ``out`` equals numpy's answer, else what differs."""
        got = np.asarray(out).reshape(-1)
        want = self.expected()
        if got.shape != want.shape:
            return f"result has {got.size} elements, expected {want.size}"
        if np.array_equal(got, want):
            return None
        bad = int(np.flatnonzero(got != want)[0])
        return (f"rank {self.rank}: element {bad} is {float(got[bad])!r}, numpy says {float(want[bad])!r} "
                f"({int(np.count_nonzero(got != want))} of {want.size} differ)")

    def reset_for_timing(self) -> None:
        self._expected = None
        # Repeated in-place sums of zeros stay zeros: no overflow, no inf/NaN slow paths.
        if self.op in REDUCTIONS:
            self.buf.fill(0)


class RawImpl:
    """A transport of this project, called directly."""

    def __init__(self, key: str, transport):
        self.key, self.t = key, transport

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        t = self.t
        if c.op == "allreduce-avg":
            return None  # Average is the engine's (a transport sums)
        if c.op == "allreduce":
            return lambda: (t.allreduce(c.buf, "sum"), c.buf)[1]
        if c.op == "allreduce-new":
            def fresh() -> np.ndarray:
                out = np.empty_like(c.buf)
                t.allreduce_into(c.buf, out, "sum")
                return out
            return fresh
        if c.op == "broadcast":
            return lambda: (t.broadcast(c.buf, 0), c.buf)[1]
        if c.op == "allgather":
            return lambda: (t.allgatherv(c.send, c.recv, c.splits), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (t.reducescatter(c.send, c.recv, c.splits, "sum"), c.recv)[1]
        return lambda: (t.alltoallv(c.send, c.splits, c.recv, c.splits), c.recv)[1]


class EngineImpl:
    """``horovod.numpy`` collectives: the full engine, negotiation included."""

    def __init__(self, key: str, hvd):
        self.key, self.hvd = key, hvd

    def bind(self, c: Case) -> Callable[[], np.ndarray]:
        hvd, name = self.hvd, f"bench.{c.op}.{c.nbytes}"
        if c.op == "allreduce":
            return lambda: hvd.allreduce_(c.buf, op=hvd.Sum, name=name)
        if c.op == "allreduce-avg":
            return lambda: hvd.allreduce_(c.buf, op=hvd.Average, name=name)
        if c.op == "allreduce-new":
            return lambda: hvd.allreduce(c.buf, op=hvd.Sum, name=name)
        if c.op == "broadcast":
            return lambda: hvd.broadcast_(c.buf, 0, name=name)
        if c.op == "allgather":
            return lambda: hvd.allgather(c.send, name=name)
        if c.op == "reducescatter":
            return lambda: hvd.reducescatter(c.send, name=name, op=hvd.Sum)
        return lambda: hvd.alltoall(c.send, name=name)


class GlooImpl:
    """``torch.distributed`` on the Gloo backend, on zero-copy tensor views of the same buffers."""

    key = "gloo"

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        # torch 2.13 renamed the *_into_tensor / *_tensor variants; use whichever this torch has.
        self.allgather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reducescatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        if c.op == "allreduce-new":
            return None  # torch.distributed reduces in place only
        t, dist = self.torch.from_numpy, self.dist
        if c.op in ("allreduce", "allreduce-avg", "broadcast"):
            tb = t(c.buf)
            if c.op == "allreduce":
                return lambda: (dist.all_reduce(tb), c.buf)[1]
            if c.op == "allreduce-avg":
                n = dist.get_world_size()
                return lambda: (dist.all_reduce(tb), tb.div_(n), c.buf)[2]
            return lambda: (dist.broadcast(tb, 0), c.buf)[1]
        ts, tr = t(c.send), t(c.recv)
        if c.op == "allgather":
            return lambda: (self.allgather(tr, ts), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (self.reducescatter(tr, ts), c.recv)[1]
        return lambda: (dist.all_to_all_single(tr, ts), c.recv)[1]


class TorchEngineImpl:
    """``horovod.torch.allreduce`` on a CPU tensor: the binding's own result allocation (new results only)."""

    def __init__(self, key: str, torch, hvd_torch):
        self.key, self.torch, self.hvd = key, torch, hvd_torch

    def bind(self, c: Case) -> Optional[Callable[[], np.ndarray]]:
        if c.op != "allreduce-new":
            return None
        hvd, tensor, name = self.hvd, self.torch.from_numpy(c.buf), f"bench.torch.{c.op}.{c.nbytes}"
        return lambda: hvd.allreduce(tensor, op=hvd.Sum, name=name).numpy()


class MpiImpl:
    """mpi4py buffer-interface collectives on a duplicate of ``COMM_WORLD``."""

    key = "openmpi"

    def __init__(self, MPI, comm):
        self.MPI, self.comm = MPI, comm

    def bind(self, c: Case) -> Callable[[], np.ndarray]:
        MPI, comm = self.MPI, self.comm
        if c.op == "allreduce":
            return lambda: (comm.Allreduce(MPI.IN_PLACE, c.buf, op=MPI.SUM), c.buf)[1]
        if c.op == "allreduce-avg":
            n = F32(comm.Get_size())
            return lambda: (comm.Allreduce(MPI.IN_PLACE, c.buf, op=MPI.SUM), np.divide(c.buf, n, out=c.buf))[1]
        if c.op == "allreduce-new":
            def fresh() -> np.ndarray:
                out = np.empty_like(c.buf)
                comm.Allreduce(c.buf, out, op=MPI.SUM)
                return out
            return fresh
        if c.op == "broadcast":
            return lambda: (comm.Bcast(c.buf, root=0), c.buf)[1]
        if c.op == "allgather":
            return lambda: (comm.Allgather(c.send, c.recv), c.recv)[1]
        if c.op == "reducescatter":
            return lambda: (comm.Reduce_scatter_block(c.send, c.recv, op=MPI.SUM), c.recv)[1]
        return lambda: (comm.Alltoall(c.send, c.recv), c.recv)[1]


class Sync:
    """Barrier and elementwise max across ranks, outside every timed region (a raw transport underneath)."""

    def __init__(self, transport):
        self.t = transport

    def barrier(self) -> None:
        self.t.barrier()

    def max(self, values: Sequence[float]) -> np.ndarray:
        arr = np.array(values, dtype=np.float64).reshape(-1)
        if arr.size:
            self.t.allreduce(arr, "max")
        return arr


class Emitter:
    """Appends JSON lines to this job's result file (rank 0 only, unless ``every_rank``)."""

    def __init__(self, path: str, rank: int, base: Dict[str, Any]):
        self.path, self.rank, self.base = path, rank, base

    def __call__(self, record: Dict[str, Any], every_rank: bool = False) -> None:
        if self.rank != 0 and not every_rank:
            return
        path = self.path if not every_rank else f"{self.path}.rank{self.rank}"
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**self.base, **record, "rank": self.rank}) + "\n")


def _validate(impls, case: Case, sync: Sync) -> Tuple[list, Dict[str, Callable], Dict[str, dict]]:
    """Bind and check every implementation once; drop (on every rank) those that failed anywhere.

    Returns the implementations still in the race, their bound calls, and for the others a record fragment:
    ``{"error": text, "wrong": True}`` when the result differed from numpy, without ``wrong`` when it raised.
    """
    calls, errors, applicable = {}, {}, []
    for impl in impls:
        try:
            call = impl.bind(case)
            if call is None:  # this collective is not theirs (the same answer on every rank)
                continue
            applicable.append(impl)
            case.load_pattern()
            err = case.check(call())
            if err:
                errors[impl.key] = {"error": err, "wrong": True}
        except Exception as exc:  # one broken peer library must not take the others' numbers down
            call = None
            errors[impl.key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if impl not in applicable:
                applicable.append(impl)
        calls[impl.key] = call
    impls = applicable
    # 2 = wrong somewhere, 1 = raised somewhere: every rank drops the same implementations
    flags = sync.max([2.0 if errors.get(impl.key, {}).get("wrong") else 1.0 if impl.key in errors else 0.0
                      for impl in impls])
    active = [impl for impl, bad in zip(impls, flags) if not bad]
    for impl, bad in zip(impls, flags):
        if bad and impl.key not in errors:
            errors[impl.key] = {"error": "failed on another rank", **({"wrong": True} if bad == 2 else {})}
    return active, calls, errors


def _rotate(seq: list, k: int) -> list:
    k %= max(1, len(seq))
    return seq[k:] + seq[:k]


def _op_groups(ops: Sequence[str]) -> List[List[str]]:
    """The ops measured together: the reductions (in place, averaged, new result) share their rounds, so a
    machine whose memory bandwidth changes during the run (a busy neighbour on the host) slows all of them
    alike and their ratios stay honest; every other op is a group of its own."""
    reductions = [op for op in ops if op in REDUCTIONS]
    groups: List[List[str]] = []
    for op in ops:
        if op in REDUCTIONS:
            if op == reductions[0]:
                groups.append(reductions)
        else:
            groups.append([op])
    return groups


def sweep(spec: dict, impls: list, sync: Sync, emit: Emitter, rank: int, size: int) -> None:
    """Every collective at every size, implementations (and the reduction ops of one size) interleaved round
    by round."""
    for group in _op_groups(spec["ops"]):
        for nbytes in spec["sizes"]:
            wall0 = time.perf_counter()
            # (op, case, impl, call) for every implementation of every op of the group that passed validation
            racers = []
            for op in group:
                case = Case(op, nbytes, rank, size)
                active, calls, errors = _validate(impls, case, sync)
                for key, err in errors.items():
                    emit({"kind": "sweep", "op": op, "bytes": case.nbytes, "impl": key, **err})
                case.reset_for_timing()
                racers += [(op, case, impl, calls[impl.key]) for impl in active]
            # Warm-up doubles as the probe that sizes each batch; every rank uses the slowest rank's probe.
            probes = []
            for _op, case, _impl, call in racers:
                times = []
                # large: one call (validation already warmed up); the batch is a single call anyway
                for _ in range(1 if case.nbytes >= 8 * MIB else 8):
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                probes.append(sum(times) / len(times))  # the mean: a stall in the probe must shrink batches
            probes = sync.max(probes)

            def batch(per_call: float) -> int:
                return int(min(spec["max_iters"], max(1, math.ceil(spec["sample_s"] / max(per_call, 1e-7)))))

            iters = [[batch(p)] for p in probes]
            samples: List[List[float]] = [[] for _ in racers]
            order = list(range(len(racers)))
            for rnd in range(spec["rounds"]):
                for i in _rotate(order, rnd):
                    call, k = racers[i][3], iters[i][-1]
                    sync.barrier()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        call()
                    samples[i].append((time.perf_counter() - t0) / k)
                if rnd + 1 < spec["rounds"]:
                    # Re-size the next batches from this round's slowest rank: a machine that turns slow (calls
                    # stalling for milliseconds under load) must not stretch a batch sized for microseconds.
                    last = sync.max([s[-1] for s in samples])
                    for i, t in enumerate(last):
                        iters[i].append(batch(t))
            worst = sync.max([x for s in samples for x in s]).reshape(len(racers), -1) if racers else []
            wall = time.perf_counter() - wall0  # validation, warm-up, barriers and all rounds of every racer
            for (op, case, impl, _call), row, its in zip(racers, worst, iters):
                emit({"kind": "sweep", "op": op, "bytes": case.nbytes, "impl": impl.key,
                      "median_s": float(np.median(row)), "samples_s": [float(x) for x in row],
                      "iters": its, "rounds": spec["rounds"], "wall_s": wall})
            del racers


def latency(spec: dict, impls: list, sync: Sync, emit: Emitter, rank: int, size: int) -> None:
    """8-byte allreduce, call by call, in alternating blocks per implementation, in each of LATENCY_PATTERNS.

    *back to back*: calls follow each other (a tight loop). *barrier before each*: the ranks line up on a raw
    transport barrier before every call, so none arrives late. *1 ms compute before each*: every rank sleeps 1 ms
    before every call, as a training step computes between collectives; peers that have gone to sleep must be
    woken, which a tight loop never shows. Only the collective itself is timed.
    """
    case = Case("allreduce", 8, rank, size)
    active, calls, errors = _validate(impls, case, sync)
    for key, err in errors.items():
        emit({"kind": "latency", "bytes": case.nbytes, "impl": key, "pattern": LATENCY_PATTERNS[0], **err})
    case.reset_for_timing()
    for impl in active:
        for _ in range(50):
            calls[impl.key]()
    pc = time.perf_counter
    for pattern in LATENCY_PATTERNS:
        iters = spec["lat_iters"] if pattern == LATENCY_PATTERNS[0] else max(50, spec["lat_iters"] // 4)
        block = min(spec["lat_block"], iters)
        blocks = max(1, iters // block)
        times: Dict[str, List[float]] = {impl.key: [] for impl in active}
        for b in range(blocks):
            for impl in _rotate(active, b):
                call, out = calls[impl.key], times[impl.key]
                sync.barrier()
                call()  # the first call after a barrier absorbs the ranks' exit skew: not counted
                if pattern == LATENCY_PATTERNS[0]:
                    t_prev = pc()
                    for _ in range(block):
                        call()
                        t = pc()
                        out.append(t - t_prev)
                        t_prev = t
                    continue
                for _ in range(block):
                    if pattern == LATENCY_PATTERNS[1]:
                        sync.barrier()
                    else:
                        time.sleep(0.001)
                    t0 = pc()
                    call()
                    out.append(pc() - t0)
        stats = []
        for impl in active:
            arr = np.array(times[impl.key])
            stats += [float(np.median(arr)), float(np.percentile(arr, 90)), float(arr.mean())]
        stats = sync.max(stats).reshape(len(active), 3) if active else []
        for impl, (med, p90, mean) in zip(active, stats):
            emit({"kind": "latency", "bytes": case.nbytes, "impl": impl.key, "pattern": pattern,
                  "median_s": float(med), "p90_s": float(p90), "mean_s": float(mean),
                  "iters": len(times[impl.key])})


FUSION_VARIANTS = (
    ("default", {}),
    ("off", {"HOROVOD_FUSION_THRESHOLD": "0"}),
    # The same 1,000 tensors in one grouped_allreduce_ call: what fusion costs without 1,000 binding calls.
    ("default, one grouped call", {}),
    # The same tensors carried inline with their requests (HOROVOD_INLINE_BYTES >= 4 KiB) instead of fused.
    ("default, inline 4 KiB", {"HOROVOD_INLINE_BYTES": "4096"}),
    ("off, inline 4 KiB", {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_INLINE_BYTES": "4096"}),
)


def fusion(spec: dict, hvd, sync: Sync, emit: Emitter, rank: int, size: int) -> None:
    """1,000 async 4 KiB allreduces then synchronize; the engine re-initialised per setting, settings alternated."""
    count, tensors = 1000, [np.zeros(1024, F32) for _ in range(1000)]
    names = [f"fusion.{i}" for i in range(count)]
    want = np.array([(i % 7) * size + size * (size - 1) // 2 for i in range(count)], F32)
    variants = [v for v in FUSION_VARIANTS if spec["fusion_inline_variants"] or "inline" not in v[0]]
    saved = {k: os.environ.get(k) for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_INLINE_BYTES")}

    def one_round(grouped: bool) -> None:
        if grouped:
            hvd.grouped_allreduce_(tensors, op=hvd.Sum, name="fusion.grouped")
            return
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm) for t, nm in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    from horovod.common import basics as hvd_basics

    times: Dict[str, List[float]] = {label: [] for label, _ in variants}
    applied: Dict[str, dict] = {}
    error = None
    for rep in range(spec["fusion_reps"]):
        for label, env in (variants if rep % 2 == 0 else variants[::-1]):
            hvd.shutdown()
            for k, v in saved.items():  # the benchmark's own process: it sets knobs the way a user would
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            os.environ.update(env)
            hvd.init()
            cfg = hvd_basics.runtime().config
            applied[label] = {"fusion_threshold": cfg.fusion_threshold, "inline_bytes": cfg.inline_bytes}
            for i, t in enumerate(tensors):
                t.fill(i % 7 + rank)
            one_round("grouped" in label)  # warm-up, checked against numpy
            got = np.array([t[0] for t in tensors], F32)
            if error is None and not (np.array_equal(got, want) and all(np.all(t == t[0]) for t in tensors)):
                bad = int(np.flatnonzero(got != want)[0]) if not np.array_equal(got, want) else -1
                error = f"fusion {label}: tensor {bad} wrong on rank {rank}"
            for t in tensors:
                t.fill(0)
            for _ in range(spec["fusion_rounds"]):
                sync.barrier()
                t0 = time.perf_counter()
                one_round("grouped" in label)
                times[label].append(time.perf_counter() - t0)
    hvd.shutdown()
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    hvd.init()
    bad = sync.max([1.0 if error else 0.0])[0]
    worst = sync.max([x for label, _ in variants for x in times[label]]).reshape(len(variants), -1)
    emit({"kind": "fusion", "count": count, "bytes": 4096, "config": applied,
          "error": error or ("failed on another rank" if bad else None),
          "median_s": {label: float(np.median(row)) for (label, _), row in zip(variants, worst)},
          "samples_s": {label: [float(x) for x in row] for (label, _), row in zip(variants, worst)}})


def _proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * KIB
    return out


def memory(spec: dict, emit: Emitter, rank: int, size: int) -> None:
    """Peak RSS of a 64 MiB allreduce in a fresh process, above the RSS just before it (tensor allocated)."""
    impl = spec["rss_impl"]
    nbytes = spec["rss_bytes"]
    x = None
    if impl.startswith("engine"):
        import horovod.numpy as hvd

        hvd.init()
        warm = hvd.allreduce(np.zeros(2, F32), op=hvd.Sum, name="rss.warm")  # connections up, lazily built parts
        if impl == "engine-inplace":
            call = lambda: hvd.allreduce_(x, op=hvd.Sum, name="rss")  # noqa: E731
        else:
            call = lambda: hvd.allreduce(x, op=hvd.Sum, name="rss")  # noqa: E731
        done = lambda: hvd.allreduce(np.zeros(1, F32), op=hvd.Sum, name="rss.sync")  # noqa: E731
    elif impl == "gloo":
        import datetime as _dt

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['gloo_port']}", rank=rank,
                                world_size=size, timeout=_dt.timedelta(seconds=spec["timeout"]))
        warm = dist.all_reduce(torch.zeros(2))
        call = lambda: (dist.all_reduce(torch.from_numpy(x)), x)[1]  # noqa: E731
        done = lambda: dist.barrier()  # noqa: E731
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        warm = comm.allreduce(1)
        call = lambda: (comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), x)[1]  # noqa: E731
        done = comm.Barrier
    del warm
    x = np.empty(nbytes // 4, F32)
    x.fill(1.0)
    done()
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    before = _proc_status()["VmRSS"]
    out = call()
    extra = out.nbytes if out is not x else 0
    # min/max are reductions: checking the result must not allocate (a bool temporary would count as peak)
    ok = out.size == x.size and float(out.min()) == float(size) == float(out.max())
    del out
    for _ in range(2):
        out = call()
        del out
    done()
    status = _proc_status()
    emit({"kind": "memory", "impl": impl, "bytes": x.nbytes, "rss_before": before, "hwm": status["VmHWM"],
          "result_bytes": extra, "overhead": status["VmHWM"] - before - extra,
          "error": None if ok else f"rank {rank}: 64 MiB allreduce result differs from numpy"}, every_rank=True)
    emit({"kind": "done"})
    if impl.startswith("engine"):
        hvd.shutdown()
    elif impl == "gloo":
        dist.destroy_process_group()


def _raw_transport(name: str, cfg, rank: int, size: int, timeout: float):
    """A second, independent transport of the given kind beside the engine's (same rendezvous, own scope)."""
    from horovod.transport.rendezvous import RendezvousClient
    from horovod.transport.base import Bootstrap

    topo = cfg.topology
    if name == "tcp":
        from horovod.transport.tcp import create_tcp as factory
    else:
        from horovod.transport.shm import create_shm as factory
    store = RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret, timeout=timeout)
    boot = Bootstrap(rank, size, local_rank=topo.local_rank, local_size=topo.local_size, hostname=topo.hostname,
                     store=store, secret=topo.secret, bind_addr="127.0.0.1", timeout=timeout,
                     scope=f"bench-raw-{name}",
                     # the options the engine gives its own transport, so raw and engine run the same algorithms
                     options={"small_message_bytes": cfg.small_message_bytes})
    return factory(boot)


def worker(spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    kind = spec["kind"]
    if kind == "memory":
        rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        size = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        memory(spec, Emitter(spec["out"], rank, {"np": size}), rank, size)
        return

    import horovod.numpy as hvd

    hvd.init()  # first: under mpirun it sets the MPI thread level before mpi4py initialises MPI
    rank, size = hvd.rank(), hvd.size()
    emit = Emitter(spec["out"], rank, {"np": size, "job": spec["job"]})
    cleanup: List[Callable[[], None]] = []
    if kind == "hvd":
        from horovod.engine import config as hvd_config

        transport = spec["transport"]
        raw = _raw_transport(transport, hvd_config.load(), rank, size, spec["timeout"])
        cleanup.append(raw.close)
        impls: list = [RawImpl(f"raw-{transport}", raw), EngineImpl(f"engine-{transport}", hvd)]
        if spec.get("gloo"):
            import datetime as _dt

            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['gloo_port']}", rank=rank,
                                    world_size=size, timeout=_dt.timedelta(seconds=spec["timeout"]))
            cleanup.insert(0, dist.destroy_process_group)
            impls.append(GlooImpl(torch, dist))
            import horovod.torch as hvd_torch  # the same engine, through the torch binding's result allocation

            impls.append(TorchEngineImpl(f"torch-{transport}", torch, hvd_torch))
    else:  # mpi
        from mpi4py import MPI

        from horovod.transport.base import Bootstrap
        from horovod.transport.mpi import create_mpi

        raw = create_mpi(Bootstrap(rank, size, options={"mpi_comm": MPI.COMM_WORLD}))
        comm = MPI.COMM_WORLD.Dup()
        cleanup += [raw.close, comm.Free]
        impls = [RawImpl("raw-mpi", raw), EngineImpl("engine-mpi", hvd), MpiImpl(MPI, comm)]
        library = MPI.Get_library_version().replace("\x00", "")   # Open MPI's string ends with a NUL
        emit({"kind": "meta", "mpi_library": library.strip().splitlines()[0],
              "mpi_thread_level": MPI.Query_thread(), "mpi_vendor": list(map(str, MPI.get_vendor()))})
    sync = Sync(raw)
    from horovod.common import basics as hvd_basics

    emit({"kind": "meta", f"engine_transport_{spec['job']}": hvd_basics.runtime().transport_name})
    phases = spec["phases"]
    t0 = time.monotonic()
    if "latency" in phases:
        latency(spec, impls, sync, emit, rank, size)
        emit({"kind": "phase", "phase": "latency", "seconds": time.monotonic() - t0})
    if "sweep" in phases:
        sweep(spec, impls, sync, emit, rank, size)
    if "fusion" in phases:
        fusion(spec, hvd, sync, emit, rank, size)
    sync.barrier()
    emit({"kind": "done", "seconds": time.monotonic() - t0})
    for fn in cleanup:
        fn()
    hvd.shutdown()


# ======================================================================================================
# Driver side
# ======================================================================================================
def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", _launch.REPO, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        return rev or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _shm_available() -> bool:
    try:
        importlib.import_module("horovod.transport.shm")  # registers itself on CPUs it supports
        from horovod.transport.base import REGISTRY
    except Exception:
        return False
    return "shm" in REGISTRY


def _mpi_available() -> Optional[str]:
    """None when mpirun + mpi4py are usable, else why not."""
    import shutil

    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    if _version("mpi4py") is None:
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


class Runner:
    """Starts the jobs one by one, collects their JSON lines, and remembers what failed."""

    def __init__(self, args, tmp: str):
        self.args, self.tmp = args, tmp
        self.records: List[dict] = []
        self.failures: List[str] = []
        self.t_start = time.monotonic()
        self.seq = 0

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def _spec(self, **spec) -> Tuple[str, str]:
        self.seq += 1
        out = os.path.join(self.tmp, f"job{self.seq}.jsonl")
        path = os.path.join(self.tmp, f"job{self.seq}.json")
        spec["out"] = out
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        return path, out

    def _collect(self, out: str, label: str) -> int:
        n = 0
        for path in [out] + [os.path.join(self.tmp, p) for p in sorted(os.listdir(self.tmp))
                             if p.startswith(os.path.basename(out) + ".rank")]:
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        rec.setdefault("job", label)
                        self.records.append(rec)
                        n += 1
        return n

    def run(self, label: str, cmd: List[str], env: Dict[str, str], out: str, timeout: float) -> bool:
        self.log(f"{label}: starting")
        t0 = time.monotonic()
        res = _launch.run_job(cmd, env, timeout)
        n = self._collect(out, label)
        done = any(r.get("kind") == "done" for r in self.records if r.get("job") == label)
        if not res.ok:
            msg = f"{label}: {res.describe(2000)}"
            self.failures.append(msg)
            self.log(f"{label}: FAILED after {time.monotonic() - t0:.0f} s ({n} results kept)\n{msg}")
            return False
        self.log(f"{label}: done in {time.monotonic() - t0:.0f} s ({n} results{'' if done else ', incomplete'})")
        return True

    def common(self) -> dict:
        a = self.args
        return {"ops": a.ops, "sizes": a.sizes, "rounds": a.rounds, "sample_s": a.sample_ms / 1000.0,
                "max_iters": 5000, "lat_iters": a.lat_iters, "lat_block": 100, "fusion_reps": a.fusion_reps,
                "fusion_rounds": a.fusion_rounds, "fusion_inline_variants": not a.quick, "timeout": 120.0}

    def hvd_job(self, np_: int, transport: str, gloo: bool, phases: List[str]) -> None:
        label = f"np={np_} horovodrun {transport}" + (" + gloo" if gloo else "")
        path, out = self._spec(kind="hvd", job=label, transport=transport, gloo=gloo,
                               gloo_port=_launch.free_port(), phases=phases, **self.common())
        cmd = _launch.horovodrun_cmd(np_, [sys.executable, os.path.abspath(__file__), "--worker", path],
                                     ["--start-timeout", "120"])
        env = _launch.repo_env({"HOROVOD_TRANSPORT": transport})
        self.run(label, cmd, env, out, self.args.job_timeout)

    def mpi_job(self, np_: int, phases: List[str]) -> None:
        label = f"np={np_} mpirun"
        path, out = self._spec(kind="mpi", job=label, phases=phases, **self.common())
        cmd = _launch.mpirun_cmd(np_, [sys.executable, os.path.abspath(__file__), "--worker", path],
                                 shlex.split(self.args.mpirun_args))
        self.run(label, cmd, _launch.mpi_env({"HOROVOD_TRANSPORT": "mpi"}), out, self.args.job_timeout)

    def memory_job(self, impl: str, transport: Optional[str]) -> None:
        label = f"memory {impl}" + (f" {transport}" if transport else "")
        path, out = self._spec(kind="memory", job=label, rss_impl=impl, rss_bytes=64 * MIB,
                               gloo_port=_launch.free_port(), transport=transport, timeout=120.0)
        argv = [sys.executable, os.path.abspath(__file__), "--worker", path]
        if impl == "openmpi":
            cmd = _launch.mpirun_cmd(2, argv, shlex.split(self.args.mpirun_args))
            env = _launch.mpi_env()
        else:
            cmd = _launch.horovodrun_cmd(2, argv, ["--start-timeout", "120"])
            env = _launch.repo_env({"HOROVOD_TRANSPORT": transport} if transport else None)
        if self.run(label, cmd, env, out, 180):
            for rec in self.records:
                if rec.get("job") == label:
                    rec["transport"] = transport


# -- rendering -------------------------------------------------------------------------------------------
def _fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _fmt_bw(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Optional[str] = None) -> List[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


class Results:
    """Indexes the records of every job for the tables."""

    def __init__(self, records: List[dict]):
        self.records = records
        self.sweep: Dict[Tuple[str, int, int, str], dict] = {}
        for r in records:
            if r.get("kind") == "sweep":
                self.sweep[(r["op"], r["np"], r["bytes"], r["impl"])] = r

    def busbw(self, op: str, np_: int, nbytes: int, impl: str) -> Optional[float]:
        r = self.sweep.get((op, np_, nbytes, impl))
        if not r or "median_s" not in r:
            return None
        return nbytes / r["median_s"] / 1e9 * bus_factor(op, np_)

    def latency(self, impl: str, np_: int = 2, pattern: str = LATENCY_PATTERNS[0]) -> Optional[dict]:
        for r in self.records:
            if (r.get("kind") == "latency" and r["impl"] == impl and r["np"] == np_ and "median_s" in r
                    and r.get("pattern", LATENCY_PATTERNS[0]) == pattern):
                return r
        return None

    def kinds(self, kind: str) -> List[dict]:
        return [r for r in self.records if r.get("kind") == kind]


def render(args, res: Results, memcpy: Dict[int, float], info: Dict[str, str], failures: List[str],
           primary: str) -> str:
    lines: List[str] = []
    add = lines.append
    add("# Collectives: this project vs torch.distributed (Gloo) and Open MPI")
    add("")
    for k, v in info.items():
        add(f"- **{k}**: {v}")
    add("")
    add("Method: float32, sum (allreduce-avg: the average; Gloo and Open MPI sum, then divide in place). Size = "
        "the nccl-tests size (allreduce/broadcast: the buffer; allgather: the gathered output; reducescatter: "
        "the input; alltoall: one rank's send buffer). Time = median over rounds of the "
        "slowest rank's mean per call in a batch timed between barriers; implementations in one job alternate "
        "batch by batch. algbw = size / time; busbw = algbw × 2(n−1)/n (allreduce), (n−1)/n (allgather, "
        "reducescatter, alltoall), 1 (broadcast). *hvd engine* = `horovod.numpy` collectives (negotiation, "
        "background thread, result arrays included); *transport* = the same data plane called directly. Every "
        "result was checked against numpy once per size before timing. Busy-polling libraries (Open MPI) lose the "
        "most when other processes compete for the cores: read the numbers with the load average above.")
    add("")

    nps = sorted({k[1] for k in res.sweep})
    present = [impl for impl in ORDER if any(k[3] == impl for k in res.sweep)]
    # -- busbw summaries
    add("## Bus bandwidth (GB/s)")
    for op in args.ops:
        for np_ in nps:
            sizes = sorted({k[2] for k in res.sweep if k[0] == op and k[1] == np_})
            if not sizes:
                continue
            add("")
            add(f"### {op}, np = {np_} (busbw = algbw × {bus_factor(op, np_):.3g})")
            add("")
            rows = []
            for nbytes in sizes:
                row = [format_size(nbytes)]
                for impl in present:
                    rec = res.sweep.get((op, np_, nbytes, impl))
                    if rec is None:
                        row.append("–")
                    elif "median_s" not in rec:
                        row.append("WRONG" if rec.get("wrong") else "error")
                    else:
                        row.append(_fmt_bw(res.busbw(op, np_, nbytes, impl)))
                row.append(f"{nbytes / memcpy[nbytes] / 1e9:.2f}" if nbytes in memcpy else "–")
                rows.append(row)
            lines += _table(["size"] + [LABELS[i] for i in present] + ["np.copyto GB/s"], rows)

    # -- latency
    lat = res.kinds("latency")
    if lat:
        add("")
        add("## Latency: one 8-byte float32 allreduce")
        add("")
        add("Patterns: *back to back* (a tight loop); *barrier before each* (ranks line up first); *1 ms compute "
            "before each* (every rank sleeps 1 ms before each call, as a training step computes between "
            "collectives). Only the call is timed. The *wake-up probe* row is the machine's floor for the last "
            "pattern at np = 2: two processes ping-pong one byte over a Unix socket after the same 1 ms sleep.")
        add("")
        rows = []
        for np_ in sorted({r["np"] for r in lat}):
            for pattern in LATENCY_PATTERNS:
                for impl in present + [i for i in ORDER if i not in present]:
                    for r in lat:
                        if r["impl"] != impl or r["np"] != np_ or r.get("pattern", LATENCY_PATTERNS[0]) != pattern:
                            continue
                        if "median_s" in r:
                            rows.append([str(np_), pattern, LABELS[impl], _fmt_time(r["median_s"]),
                                         _fmt_time(r["p90_s"]), _fmt_time(r["mean_s"]), str(r["iters"])])
                        else:
                            rows.append([str(np_), pattern, LABELS[impl], "WRONG" if r.get("wrong") else "error",
                                         r.get("error", "")[:80], "", ""])
                if pattern == LATENCY_PATTERNS[2]:
                    rows += [[str(np_), pattern, "wake-up probe (floor)", _fmt_time(r["median_s"]),
                              _fmt_time(r["p90_s"]), _fmt_time(r["mean_s"]), str(r["iters"])]
                             for r in res.kinds("wakeup") if r["np"] == np_]
        lines += _table(["np", "pattern", "implementation", "median", "p90", "mean", "calls"], rows)

    # -- fusion
    fus = res.kinds("fusion")
    if fus:
        f = fus[0]
        add("")
        add(f"## Tensor fusion: {f['count']} allreduces of 4 KiB issued async, then synchronized "
            f"(np = {f['np']}, engine {primary})")
        add("")
        med, cfg = f["median_s"], f.get("config", {})
        rows = [[label, str(cfg.get(label, {}).get("fusion_threshold", "?")),
                 str(cfg.get(label, {}).get("inline_bytes", "?")), _fmt_time(t), _fmt_time(t / f["count"]),
                 str(len(f["samples_s"][label]))] for label, t in med.items()]
        lines += _table(["fusion threshold", "engine's fusion_threshold (bytes)", "inline_bytes", "time for all",
                         "per allreduce", "rounds"], rows)
        add("")
        if "default" in med and "off" in med:
            add(f"Fusion gain (threshold 0 time / default time): **{med['off'] / med['default']:.2f}×**"
                + (f"; with the tensors carried inline instead (HOROVOD_INLINE_BYTES=4096): "
                   f"{med['off, inline 4 KiB'] / med['default, inline 4 KiB']:.2f}×"
                   if "off, inline 4 KiB" in med and "default, inline 4 KiB" in med else ""))
        if f.get("error"):
            add(f"\n**Validation failed**: {f['error']}")

    # -- memory
    mem = res.kinds("memory")
    if mem:
        add("")
        add("## Memory: peak RSS of a 64 MiB allreduce, np = 2, fresh processes")
        add("")
        add("Overhead = peak RSS during three calls − RSS just before them (the 64 MiB input already resident) − "
            "the result array the call returns (out-of-place only). Per rank, MiB.")
        add("")
        groups: Dict[str, List[dict]] = {}
        for r in mem:
            groups.setdefault(r["job"], []).append(r)
        rows = []
        names = {"engine-inplace": "hvd engine, `allreduce_` (in place)",
                 "engine-outofplace": "hvd engine, `allreduce` (new result array)",
                 "gloo": "torch Gloo `all_reduce` (in place)", "openmpi": "Open MPI `Allreduce(IN_PLACE)`"}
        for _job, recs in groups.items():
            recs.sort(key=lambda r: r["rank"])
            r0 = recs[0]
            label = names.get(r0["impl"], r0["impl"]) + (f", {r0['transport']}" if r0.get("transport") else "")
            rows.append([label, " / ".join(f"{r['rss_before'] / MIB:.0f}" for r in recs),
                         " / ".join(f"{r['overhead'] / MIB:.1f}" for r in recs),
                         f"{max(r['overhead'] for r in recs) / MIB:.1f}",
                         "; ".join(r["error"] for r in recs if r.get("error")) or "ok"])
        lines += _table(["implementation", "RSS before (MiB, per rank)", "overhead (MiB, per rank)",
                         "max overhead (MiB)", "result"], rows)

    # -- details
    add("")
    add("## Details: median time, algbw and busbw")
    for op in args.ops:
        for np_ in nps:
            keys = sorted((k for k in res.sweep if k[0] == op and k[1] == np_),
                          key=lambda k: (k[2], ORDER.index(k[3])))
            if not keys:
                continue
            add("")
            add(f"### {op}, np = {np_}")
            add("")
            rows = []
            for k in keys:
                r = res.sweep[k]
                nbytes, impl = k[2], k[3]
                if "median_s" not in r:
                    rows.append([format_size(nbytes), LABELS[impl], ("WRONG: " if r.get("wrong") else "error: ")
                                 + r.get("error", "")[:100], "", "", "", ""])
                    continue
                algbw = nbytes / r["median_s"] / 1e9
                ref = res.busbw(op, np_, nbytes, "openmpi")
                bus = algbw * bus_factor(op, np_)
                lo, hi = min(r["iters"]), max(r["iters"])
                rows.append([format_size(nbytes), LABELS[impl], _fmt_time(r["median_s"]), f"{algbw:.3f}",
                             f"{bus:.3f}", f"{bus / ref:.2f}" if ref else "–",
                             f"{r['rounds']} × {lo}" + (f"–{hi}" if hi != lo else "")])
            lines += _table(["size", "implementation", "median time", "algbw GB/s", "busbw GB/s",
                             "busbw ÷ Open MPI", "rounds×calls"], rows, "llrrrrr")
    if memcpy:
        add("")
        add("### numpy copy ceiling (np.copyto, one core)")
        add("")
        lines += _table(["size", "time", "GB/s"],
                        [[format_size(s), _fmt_time(t), f"{s / t / 1e9:.2f}"] for s, t in sorted(memcpy.items())])

    # -- notes
    notes = _notes(res, failures)
    if notes:
        add("")
        add("## Notes")
        add("")
        lines += [f"- {n}" for n in notes]

    # -- targets
    add("")
    add("## Targets")
    add("")
    lines += _table(["target", "measured", "required", "result"], _targets(res, primary), "llll")
    return "\n".join(lines) + "\n"


def _notes(res: Results, failures: List[str]) -> List[str]:
    """Things a reader should not miss: failures, wrong results, and where the engine lags its own transport."""
    notes = []
    for f in failures:
        notes.append("job failed: " + f.splitlines()[0][:400])
    for (op, np_, nbytes, impl), r in sorted(res.sweep.items()):
        if "median_s" not in r and r.get("error"):
            what = "WRONG RESULT" if r.get("wrong") else "error"
            notes.append(f"{LABELS[impl]} {op} np={np_} {format_size(nbytes)}: {what}: {r['error']}")
    for r in res.kinds("fusion") + res.kinds("memory") + res.kinds("latency"):
        if r.get("error") and ("median_s" in r or r["kind"] != "latency"):
            notes.append(f"{r['kind']} {r.get('impl', '')}: {r['error']}")
    # Engine vs the transport underneath it: a constant per-call cost below 1 MiB, ratios above.
    small: Dict[Tuple[str, int], List[float]] = {}
    large: Dict[Tuple[str, str, int], List[str]] = {}
    for (op, np_, nbytes, impl), r in sorted(res.sweep.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][1],
                                                                                 kv[0][2])):
        if not impl.startswith("engine-") or "median_s" not in r:
            continue
        raw = res.sweep.get((op, np_, nbytes, "raw-" + impl.split("-", 1)[1]))
        if not raw or "median_s" not in raw:
            continue
        if nbytes < MIB:
            small.setdefault((impl, np_), []).append(r["median_s"] - raw["median_s"])
        elif r["median_s"] >= 1.5 * raw["median_s"]:
            large.setdefault((impl, op, np_), []).append(
                f"{format_size(nbytes)} {r['median_s'] / raw['median_s']:.1f}× ({_fmt_time(r['median_s'])} vs "
                f"{_fmt_time(raw['median_s'])})")
    for (impl, np_), added in sorted(small.items()):
        notes.append(f"{LABELS[impl]} np={np_}, messages below 1 MiB: the engine adds {_fmt_time(min(added))} .. "
                     f"{_fmt_time(max(added))} per call over the raw {impl.split('-', 1)[1]} transport "
                     f"(median {_fmt_time(statistics.median(added))}, all collectives)")
    for (impl, op, np_), items in sorted(large.items()):
        notes.append(f"{LABELS[impl]} {op} np={np_}: ≥ 1.5× the raw {impl.split('-', 1)[1]} transport's time at "
                     + "; ".join(items))
    for r in res.kinds("memory"):
        if r["impl"].startswith("engine") and r["rank"] == 0 and r["overhead"] > 16 * MIB:
            notes.append(f"memory: {r['impl']} over {r.get('transport')} peaks {r['overhead'] / MIB:.0f} MiB above "
                         f"the input and its result; arrays kept alive by reference cycles (freed only by Python's "
                         f"cyclic GC) look like this")
    fus = res.kinds("fusion")
    if fus and "default" in fus[0]["median_s"] and "off" in fus[0]["median_s"]:
        m = fus[0]["median_s"]
        if m["off"] / m["default"] < 2:
            notes.append(f"tensor fusion gains only {m['off'] / m['default']:.2f}× on 1,000 × 4 KiB: "
                         f"{_fmt_time(m['default'] / fus[0]['count'])} per tensor even when fused, so the "
                         f"per-tensor cost (request, negotiation, completion) dominates, not the data plane")
    return notes


def _targets(res: Results, primary: str) -> List[List[str]]:
    ours = f"engine-{primary}"
    rows = []
    size64 = 64 * MIB

    def ratio_row(what: str, np_: int, peer: str, need: float) -> List[str]:
        a, b = res.busbw("allreduce", np_, size64, ours), res.busbw("allreduce", np_, size64, peer)
        if a is None or b is None:
            return [what, "not measured", f"≥ {need:g}×", "n/a"]
        return [what, f"{a:.2f} vs {b:.2f} GB/s = {a / b:.2f}×", f"≥ {need:g}×", "PASS" if a >= need * b else "FAIL"]

    rows.append(ratio_row(f"allreduce 64 MiB np=2 busbw, {LABELS[ours]} vs Gloo", 2, "gloo", 2.0))
    rows.append(ratio_row(f"allreduce 64 MiB np=2 busbw, {LABELS[ours]} vs Open MPI", 2, "openmpi", 1.2))
    floor = res.kinds("wakeup")
    for pattern, limit in ((LATENCY_PATTERNS[0], 60e-6), (LATENCY_PATTERNS[2], 100e-6)):
        lat, gloo = res.latency(ours, pattern=pattern), res.latency("gloo", pattern=pattern)
        need = f"≤ {limit * 1e6:.0f} µs and ≥ 3× faster than Gloo"
        if pattern == LATENCY_PATTERNS[2] and floor:
            need += f" (or ≤ 1.5× the wake-up floor, {_fmt_time(floor[0]['median_s'])})"
        if not lat:
            rows.append([f"8-byte allreduce np=2, {pattern}, {LABELS[ours]}", "not measured", need, "n/a"])
            continue
        ok = lat["median_s"] <= limit or (pattern == LATENCY_PATTERNS[2] and floor
                                          and lat["median_s"] <= 1.5 * floor[0]["median_s"])
        ok = ok and (gloo is None or gloo["median_s"] >= 3 * lat["median_s"])
        measured = f"{_fmt_time(lat['median_s'])}" + (f" vs Gloo {_fmt_time(gloo['median_s'])} = "
                                                      f"{gloo['median_s'] / lat['median_s']:.1f}×" if gloo else "")
        rows.append([f"8-byte allreduce np=2, {pattern}, {LABELS[ours]}", measured, need, "PASS" if ok else "FAIL"])
    cold = res.kinds("coldwrite")
    for impl in (ours, f"torch-{primary}"):
        new, inplace = res.busbw("allreduce-new", 2, size64, impl), res.busbw("allreduce", 2, size64, ours)
        rows.append([f"allreduce 64 MiB np=2, new result ({LABELS.get(impl, impl)}) ÷ in place ({LABELS[ours]})",
                     f"{new:.2f} ÷ {inplace:.2f} GB/s = {new / inplace:.0%}" if new and inplace else "not measured",
                     "≥ 80 %", ("PASS" if new >= 0.8 * inplace else "FAIL") if new and inplace else "n/a"])
        if new and inplace and cold:
            # The machine's bound: the in-place time plus writing 64 MiB into memory that is not in cache.
            bound_s = size64 / (inplace * 1e9) + cold[0]["extra_s"]
            new_s = size64 / (new * 1e9)
            rows.append([f"  the same, against this machine's bound for a new result (in place + "
                         f"{_fmt_time(cold[0]['extra_s'])} to write 64 MiB into memory not in cache)",
                         f"{_fmt_time(new_s)} vs bound {_fmt_time(bound_s)} = {bound_s / new_s:.0%} of the bound",
                         "(reported)", "n/a"])
    fus = res.kinds("fusion")
    if fus and "default" in fus[0]["median_s"] and "off" in fus[0]["median_s"]:
        m = fus[0]["median_s"]
        gain = m["off"] / m["default"]
        ok = gain >= 10 and not fus[0].get("error")
        rows.append(["fusion gain, 1,000 × 4 KiB allreduce (threshold 0 ÷ default)",
                     f"{_fmt_time(m['off'])} ÷ {_fmt_time(m['default'])} = {gain:.2f}×", "≥ 10×",
                     "PASS" if ok else "FAIL"])
    else:
        rows.append(["fusion gain, 1,000 × 4 KiB allreduce", "not measured", "≥ 10×", "n/a"])
    a, b = res.busbw("allreduce", 4, size64, ours), res.busbw("allreduce", 4, size64, "openmpi")
    rows.append([f"allreduce 64 MiB np=4 busbw, {LABELS[ours]} vs Open MPI ÷ 1.5",
                 f"{a:.2f} vs {b:.2f} GB/s = {a / b:.2f}×" if a and b else "not measured", "≥ 0.67×",
                 ("PASS" if a >= b / 1.5 else "FAIL") if a and b else "n/a"])
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: sizes 4K,64K,1M,16M,64M; fewer repeats")
    ap.add_argument("--max", type=_launch.parse_size, default=None, help="largest size (default 64M; try 256M)")
    ap.add_argument("--sizes", default=None, help="explicit comma-separated sizes, e.g. 8K,1M,64M")
    ap.add_argument("--np", type=int, action="append", help="world size (repeatable; default 2 and 4)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: sweep,latency,fusion,memory,"
                                               "memcpy,gloo,mpi,tcp,shm")
    ap.add_argument("--rounds", type=int, default=None, help="timed batches per implementation and size (7; quick 3)")
    ap.add_argument("--sample-ms", type=float, default=None, help="target length of one batch (20 ms; quick 8)")
    ap.add_argument("--lat-iters", type=int, default=None, help="8-byte allreduce calls per implementation (2000)")
    ap.add_argument("--job-timeout", type=float, default=None, help="seconds before a job is killed (600)")
    ap.add_argument("--mpirun-args", default="--bind-to none",
                    help="extra mpirun arguments (default '--bind-to none': Open MPI's own default binds each rank "
                         "to one core at np <= 2, which was ~20%% slower for mpi4py at 64 MiB here and pins the "
                         "engine's background thread to its main thread's core; pass '' for Open MPI's default)")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    ap.add_argument("--json", default=None, help="write every raw record (samples included) to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0

    q = args.quick
    maxsize = args.max or 64 * MIB
    if args.sizes:
        args.sizes = [_launch.parse_size(s) for s in args.sizes.split(",") if s]
    else:
        args.sizes = _launch.size_ladder(4 * KIB, maxsize, 16 if q else 4)
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"unknown collective(s) {bad}; choose from {', '.join(OPS)}")
    args.np = args.np or [2, 4]
    args.rounds = args.rounds or (3 if q else 7)
    args.sample_ms = args.sample_ms or (8.0 if q else 20.0)
    args.lat_iters = args.lat_iters or (500 if q else 2000)
    args.fusion_reps = 2 if q else 3
    args.fusion_rounds = 2 if q else 3
    args.job_timeout = args.job_timeout or (300.0 if q else 600.0)
    skip = {s for s in args.skip.split(",") if s}

    transports = [t for t in ("shm", "tcp") if t not in skip and (t != "shm" or _shm_available())]
    primary = transports[0] if transports else "shm"
    mpi_missing = _mpi_available() if "mpi" not in skip else "skipped (--skip mpi)"
    gloo = "gloo" not in skip and _version("torch") is not None
    start = datetime.datetime.now().astimezone()
    info = {
        "date": start.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{os.cpu_count()} cores (nproc), {_cpu_model()}, {platform.machine()}, "
                   f"Linux {platform.release()}",
        "command": "python " + " ".join(shlex.quote(a) for a in (sys.argv if argv is None else
                                                                 [sys.argv[0], *argv])),
        "load average": f"{os.getloadavg()[0]:.2f} at start",  # completed at the end
    }

    tmp = tempfile.mkdtemp(prefix="hvd-bench-")  # job specs and their JSON-lines results
    try:
        return _drive(args, tmp, info, transports, primary, mpi_missing, gloo, skip)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drive(args, tmp: str, info: Dict[str, str], transports: List[str], primary: str,
           mpi_missing: Optional[str], gloo: bool, skip: set) -> int:
    """Run every job, then print (and write) the report; 1 when a job failed."""
    q = args.quick
    runner = Runner(args, tmp)
    memcpy = {} if "memcpy" in skip else memcpy_ceiling(args.sizes, args.rounds, args.sample_ms / 1000.0)
    if "latency" not in skip and 2 in args.np:
        runner.records.append(wakeup_probe(max(50, args.lat_iters // 4)))
    if "memcpy" not in skip and 64 * MIB in args.sizes:
        runner.records.append(cold_write_probe(64 * MIB, args.rounds))
    for np_ in args.np:
        phases = [p for p in ("sweep", "latency", "fusion") if p not in skip and (np_ == 2 or p != "fusion")]
        # the primary engine job (with Gloo in the same processes), then Open MPI, then the other transports
        for i, transport in enumerate(transports):
            job_phases = [p for p in phases if p != "fusion" or i == 0]
            if job_phases:
                runner.hvd_job(np_, transport, gloo and i == 0, job_phases)
            if i == 0 and not mpi_missing and [p for p in phases if p != "fusion"]:
                runner.mpi_job(np_, [p for p in phases if p != "fusion"])
        if not transports and not mpi_missing and [p for p in phases if p != "fusion"]:
            runner.mpi_job(np_, [p for p in phases if p != "fusion"])
    if "memory" not in skip:
        for transport in transports if not q else transports[:1]:
            runner.memory_job("engine-inplace", transport)
            runner.memory_job("engine-outofplace", transport)
        if not q:
            if gloo:
                runner.memory_job("gloo", None)
            if not mpi_missing:
                runner.memory_job("openmpi", None)

    res = Results(runner.records)
    meta = {k: v for r in runner.records if r.get("kind") == "meta" for k, v in r.items()}
    versions = [f"Python {platform.python_version()}", f"numpy {np.__version__}"]
    versions.append(f"torch {_version('torch')} (Gloo)" if gloo else "torch: not used")
    versions.append(f"mpi4py {_version('mpi4py')}, {meta.get('mpi_library', 'Open MPI: not run')}"
                    if not mpi_missing else f"MPI: not used ({mpi_missing})")
    info["versions"] = ", ".join(versions)
    info["horovod checkout"] = _git_rev()
    launchers = [f"`python -m horovod.runner -np N --start-timeout 120 python {os.path.relpath(__file__)} --worker "
                 f"SPEC` with HOROVOD_TRANSPORT={t}" for t in transports]
    if not mpi_missing:
        launchers.append(f"`mpirun -np N [--oversubscribe when N > cores] {args.mpirun_args} python "
                         f"{os.path.relpath(__file__)} --worker SPEC`")
    info["launchers"] = "; ".join(launchers)
    info["load average"] += f", {os.getloadavg()[0]:.2f} at end (1-minute)"
    info["duration"] = f"{time.monotonic() - runner.t_start:.0f} s"
    knobs = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    info["HOROVOD_* in the environment"] = ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "none"
    text = render(args, res, memcpy, info, runner.failures, primary)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"info": info, "memcpy_s": memcpy, "records": runner.records}, f, indent=1)
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
