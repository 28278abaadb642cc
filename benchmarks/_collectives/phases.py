"""The rank side of a collectives job: the sweep (every collective at every size), latency and fusion."""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from benchmarks._collectives.cases import F32, LATENCY_PATTERNS, REDUCTIONS, Case
from benchmarks._collectives.impls import Emitter, Sync
from benchmarks._lib.measure import MIB


def validate(impls, case: Case, sync: Sync) -> Tuple[list, Dict[str, Callable], Dict[str, dict]]:
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


def rotate(seq: list, k: int) -> list:
    k %= max(1, len(seq))
    return seq[k:] + seq[:k]


def op_groups(ops: Sequence[str]) -> List[List[str]]:
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
    for group in op_groups(spec["ops"]):
        for nbytes in spec["sizes"]:
            wall0 = time.perf_counter()
            # (op, case, impl, call) for every implementation of every op of the group that passed validation
            racers = []
            for op in group:
                case = Case(op, nbytes, rank, size)
                active, calls, errors = validate(impls, case, sync)
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
                for i in rotate(order, rnd):
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
    active, calls, errors = validate(impls, case, sync)
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
            for impl in rotate(active, b):
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


