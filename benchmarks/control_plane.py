"""Rank 0's control-plane work per training step at N = 2 ... 4096 simulated ranks, in one process.

Drives the engine's own control-plane code with the traffic of N ranks; the data plane (moving the tensors) is not
part of it. Each simulated rank's requests are made as a worker makes them (``Request`` objects like
``horovod.engine.collectives`` builds, encoded by its own ``RequestCache``, pickled in a ``ControlMessage``), and
rank 0's side runs the real classes:

* ``negotiation`` (every step before the warm path; today the cold path): rank 0 unpickles one frame per rank,
  resolves the cache slots (``CoordinatorCache``), records every request (``Coordinator.add``), takes what is
  ready, plans fusion (``fusion.plan``) and pickles the responses once for everyone. ``--one-by-one`` sends each
  request in a frame of its own (gradient hooks that fire while the previous request is already gone).
* ``rounds`` (the warm path, :mod:`horovod.engine.rounds`): rank 0 takes its own requests as cache hits, builds its
  vector, ANDs it by recursive doubling with the partial results its log2(N) partners would send (computed from
  the simulated ranks' own ``RoundState`` vectors), finishes the round and plans fusion. Nothing else reaches rank 0.

Rank 0's CPU time per step is what is timed (``time.thread_time``; the benchmark runs one thread), with message
bytes rank 0 receives and sends. The peers' work is done outside the timed region. A cold step (the first, where
every request travels in full) is reported once per configuration.

Run from the repository root::

    python benchmarks/control_plane.py                       # the table, N = 2 ... 4096
    python benchmarks/control_plane.py --n 64 1024 --json out.json

``--json FILE`` writes one record per configuration: n, model, mode, warm, rank0_cpu_ms, bytes_in, bytes_out.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import statistics
import sys
import time
from typing import List, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib.report import write_json  # noqa: E402
from horovod.engine import fusion, ops  # noqa: E402
from horovod.engine.cache import CoordinatorCache, RequestCache  # noqa: E402
from horovod.engine.messages import ControlMessage, Request  # noqa: E402
from horovod.engine.negotiation import Coordinator  # noqa: E402

try:   # the warm path (absent in checkouts before it: then only the negotiation is measured)
    from horovod.engine import rounds  # noqa: E402
except ImportError:  # pragma: no cover
    rounds = None

INLINE_BYTES = 1024
FUSION_BYTES = 128 * 1024 * 1024
CACHE_CAPACITY = 1024


# -- models -------------------------------------------------------------------------------------------------------

def resnet50_shapes() -> List[Tuple[int, ...]]:
    """ResNet-50's 161 parameter tensors (53 convolutions, 53 batch norms with weight and bias, the classifier)."""
    shapes: List[Tuple[int, ...]] = []

    def conv_bn(cin, cout, k):
        shapes.extend([(cout, cin, k, k), (cout,), (cout,)])

    conv_bn(3, 64, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            conv_bn(cin, width, 1)
            conv_bn(width, width, 3)
            conv_bn(width, width * 4, 1)
            if b == 0:
                conv_bn(cin, width * 4, 1)
            cin = width * 4
    shapes.extend([(1000, 2048), (1000,)])
    assert len(shapes) == 161, len(shapes)
    return shapes


def transformer_shapes() -> List[Tuple[int, ...]]:
    """300 tensors of a BERT-large-like encoder: embeddings, 18 layers of 16 tensors, pooler, padding norms."""
    d, f = 1024, 4096
    shapes: List[Tuple[int, ...]] = [(30522, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(18):
        shapes += [(d, d), (d,)] * 4 + [(d,), (d,), (f, d), (f,), (d, f), (d,), (d,), (d,)]
    shapes += [(d, d), (d,)]
    while len(shapes) < 300:
        shapes.append((d,))
    return shapes[:300]


def bucketed(shapes: Sequence[Tuple[int, ...]], bucket_bytes: int = 4 << 20) -> List[Tuple[int, ...]]:
    """The same gradients packed into flat buckets of about ``bucket_bytes`` (the optimizers' bucketing)."""
    out, current = [], 0
    for shape in reversed(shapes):   # gradients arrive last layer first
        n = math.prod(shape)
        if current and (current + n) * 4 > bucket_bytes:
            out.append((current,))
            current = 0
        current += n
    if current:
        out.append((current,))
    return out


MODELS = {
    "resnet50-161": lambda: resnet50_shapes(),
    "resnet50-161-bucketed": lambda: bucketed(resnet50_shapes(), 3 << 20),
    "transformer-300": lambda: transformer_shapes(),
}


def requests_of(rank: int, shapes: Sequence[Tuple[int, ...]], step: int) -> List[Request]:
    """What ``horovod.engine.collectives`` enqueues for one step's gradients on ``rank``."""
    out = []
    for i, shape in enumerate(shapes):
        req = Request(rank=rank, name=f"allreduce.grad.{i}", kind=ops.ALLREDUCE, dtype="float32", shape=shape,
                      op=ops.Average, process_set=0)
        nbytes = 4 * math.prod(shape)
        if nbytes <= INLINE_BYTES:
            req.payload = np.full(math.prod(shape), rank + step, np.float32).tobytes()
        out.append(req)
    return out


# -- the negotiation (cold path; every step before the warm path) --------------------------------------------------

class Negotiation:
    """Rank 0's coordinator with N simulated ranks, each with its own request cache."""

    def __init__(self, n: int, shapes, one_by_one: bool):
        self.n, self.shapes, self.one_by_one = n, shapes, one_by_one
        self.coordinator = Coordinator(n, CACHE_CAPACITY)
        self.mirror = CoordinatorCache()
        self.own = RequestCache(CACHE_CAPACITY)
        self.peers = [RequestCache(CACHE_CAPACITY) for _ in range(n)]

    def frames(self, step: int) -> List[Tuple[int, bytes]]:
        """The frames the workers send this step (made by the workers' code, outside the timed region)."""
        frames = []
        for rank in range(1, self.n):
            wires = [self.peers[rank].encode(r) for r in requests_of(rank, self.shapes, step)]
            if self.one_by_one:
                frames += [(rank, pickle.dumps(ControlMessage(requests=[w]), pickle.HIGHEST_PROTOCOL))
                           for w in wires]
            else:
                frames.append((rank, pickle.dumps(ControlMessage(requests=wires), pickle.HIGHEST_PROTOCOL)))
        return frames

    def step(self, step: int, frames) -> Tuple[float, int, int]:
        """Rank 0's part of one step: (CPU seconds, bytes in, bytes out)."""
        own = requests_of(0, self.shapes, step)
        start = time.thread_time()
        now = time.monotonic()
        coord = self.coordinator
        for req in own:
            template, data, _ = self.own.canonical(req)
            coord.add(template, now, data)
        for rank, frame in frames:
            msg = pickle.loads(frame)
            for wire in msg.requests:
                req, data = self.mirror.decode(rank, wire)
                coord.add(req, now, data)
        coord.check_kind_conflicts()
        ready = coord.take_ready()
        planned = fusion.plan(ready, FUSION_BYTES)
        out = pickle.dumps(ControlMessage(responses=planned), pickle.HIGHEST_PROTOCOL)
        cpu = time.thread_time() - start
        if len(ready) != len(self.shapes):
            raise RuntimeError(f"negotiation: {len(ready)} of {len(self.shapes)} tensors ready")
        return cpu, sum(len(f) for _, f in frames), len(out) * (self.n - 1)


# -- the warm path -------------------------------------------------------------------------------------------------

class Rounds:
    """Rank 0's rounds with N simulated ranks whose caches were filled by one cold step through the coordinator."""

    # Distinct simulated peers whose vectors are computed (every peer's vector is the same in a warm step; beyond
    # this many, partners reuse them cyclically).
    DISTINCT = 63

    def __init__(self, n: int, shapes):
        self.n, self.shapes = n, shapes
        self.distinct = min(n - 1, self.DISTINCT)
        self.states = [rounds.RoundState(CACHE_CAPACITY) for _ in range(1 + self.distinct)]
        self.cold_cpu, self.cold_in, self.cold_out = self._cold()

    def _cold(self) -> Tuple[float, int, int]:
        """The first step: the negotiation plus slot assignment; every rank stores the responses."""
        neg = Negotiation(self.n, self.shapes, one_by_one=False)
        frames = neg.frames(0)
        table = rounds.SlotTable(CACHE_CAPACITY)
        own = requests_of(0, self.shapes, 0)
        start = time.thread_time()
        now = time.monotonic()
        coord = neg.coordinator
        for req in own:
            coord.add(req, now)
        for rank, frame in frames:
            for wire in pickle.loads(frame).requests:
                req, data = neg.mirror.decode(rank, wire)
                coord.add(req, now, data)
        ready = coord.take_ready()
        ready = [resp if not rounds.cacheable(resp) else
                 dataclasses.replace(resp, slots=[table.assign((0, resp.names[0]))]) for resp in ready]
        planned = fusion.plan(ready, FUSION_BYTES)
        message = ControlMessage(responses=planned, round=0)
        out = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        cpu = time.thread_time() - start
        for rank, state in enumerate(self.states):
            mine = {r.name: r for r in requests_of(rank, self.shapes, 0)}
            state.apply([], pickle.loads(out).responses, mine)
        return cpu, sum(len(f) for _, f in frames), len(out) * (self.n - 1)

    def step(self, step: int) -> Tuple[float, int, int]:
        now = time.monotonic()
        # The peers' side (not timed): each takes its requests as hits and builds its vector.
        vectors = []
        for rank in range(1, 1 + self.distinct):
            state = self.states[rank]
            for req in requests_of(rank, self.shapes, step):
                if not state.take(req, now):
                    raise RuntimeError("a simulated peer missed its cache")
            vectors.append(state.vector()[:state.length].copy())
        length = self.states[0].length
        steps = max(1, math.ceil(math.log2(self.n)))
        # What rank 0's partner sends at each step of recursive doubling: the AND over a block of 2^k ranks.
        partials = []
        for k in range(steps):
            block = [vectors[(i - 1) % self.distinct] for i in range(2 ** k, min(2 ** (k + 1), self.n))]
            acc = block[0].copy()
            for v in block[1:32]:
                np.bitwise_and(acc, v, out=acc)
            partials.append(acc.tobytes())
        own = requests_of(0, self.shapes, step)
        state = self.states[0]
        start = time.thread_time()
        for req in own:
            if not state.take(req, now):
                raise RuntimeError("rank 0 missed its cache")
        if state.stale(now):
            raise RuntimeError("rank 0 demoted a hit")
        vec = state.vector()[:length]
        sent = 0
        acc = vec.copy()
        for payload in partials:
            sent += acc.nbytes
            np.bitwise_and(acc, np.frombuffer(payload, dtype=np.uint64), out=acc)
        templates = state.finish(acc)
        planned = fusion.plan(templates, FUSION_BYTES)
        cpu = time.thread_time() - start
        if len(templates) != len(self.shapes) or not planned:
            raise RuntimeError(f"rounds: {len(templates)} of {len(self.shapes)} tensors warm")
        for peer in self.states[1:]:   # the peers finish the same round (not timed)
            peer.finish(acc)
        return cpu, sum(len(p) for p in partials), sent


# -- driver --------------------------------------------------------------------------------------------------------

def measure(n: int, model: str, mode: str, steps: int) -> List[dict]:
    shapes = MODELS[model]()
    records = []
    if mode in ("negotiation", "negotiation-one-by-one"):
        neg = Negotiation(n, shapes, one_by_one=mode.endswith("one-by-one"))
        samples = []
        for step in range(steps + 1):
            cpu, bytes_in, bytes_out = neg.step(step, neg.frames(step))
            if step == 0:
                records.append(dict(n=n, model=model, mode=mode, warm=False, rank0_cpu_ms=cpu * 1e3,
                                    bytes_in=bytes_in, bytes_out=bytes_out))
            else:
                samples.append((cpu, bytes_in, bytes_out))
    else:
        sim = Rounds(n, shapes)
        records.append(dict(n=n, model=model, mode=mode, warm=False, rank0_cpu_ms=sim.cold_cpu * 1e3,
                            bytes_in=sim.cold_in, bytes_out=sim.cold_out))
        samples = [sim.step(step) for step in range(1, steps + 1)]
    cpu = statistics.median(s[0] for s in samples)
    records.append(dict(n=n, model=model, mode=mode, warm=True, rank0_cpu_ms=cpu * 1e3,
                        bytes_in=samples[-1][1], bytes_out=samples[-1][2]))
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 16, 64, 256, 1024, 4096])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=None,
                        choices=["negotiation", "negotiation-one-by-one", "rounds"])
    parser.add_argument("--steps", type=int, default=5, help="warm steps measured (the median is reported)")
    parser.add_argument("--json", help="write the records to this file")
    args = parser.parse_args(argv)
    modes = args.modes or (["negotiation", "rounds"] if rounds is not None else ["negotiation"])
    records = []
    print(f"{'model':24} {'mode':24} {'N':>5} {'warm ms':>9} {'cold ms':>9} {'bytes in':>11} {'bytes out':>11}")
    for model in args.models:
        for mode in modes:
            if mode == "rounds" and rounds is None:
                continue
            for n in args.n:
                steps = args.steps if n <= 1024 else max(2, args.steps // 2)
                recs = measure(n, model, mode, steps)
                records += recs
                cold, warm = recs
                print(f"{model:24} {mode:24} {n:5d} {warm['rank0_cpu_ms']:9.3f} {cold['rank0_cpu_ms']:9.2f} "
                      f"{warm['bytes_in']:11d} {warm['bytes_out']:11d}", flush=True)
    if args.json:
        write_json(args.json, records)


if __name__ == "__main__":
    main()
