"""The records of every job of a run, indexed for the tables, the targets and the charts.

A run repeats every job (``--reps``): a sweep or latency record of one implementation at one size exists once per
repetition. Here they become one record whose ``median_s`` is the median over repetitions (``rep_medians_s``
keeps each repetition's, for the spread), and a ratio against a peer is taken within each repetition (the jobs of
one repetition ran minutes apart, those of different repetitions further) and summarised by its median and range.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Tuple

from benchmarks._collectives.cases import LABELS, LATENCY_PATTERNS, ORDER
from benchmarks._lib.measure import bus_factor


class Results:
    """Indexes the records of every job for the tables."""

    def __init__(self, records: List[dict]):
        self.records = records
        groups: Dict[Tuple[str, int, int, str], List[dict]] = {}
        for r in records:
            if r.get("kind") == "sweep":
                groups.setdefault((r["op"], r["np"], r["bytes"], r["impl"]), []).append(r)
        self.sweep: Dict[Tuple[str, int, int, str], dict] = {k: combine(v) for k, v in groups.items()}

    def ratio(self, op: str, np_: int, nbytes: int, impl: str, peer: str) -> Optional[Tuple[float, float, float]]:
        """``impl``'s speed ÷ ``peer``'s (peer's time ÷ impl's), within each repetition both measured in:
        (median, min, max) over those repetitions; None when no repetition measured both."""
        a, b = self.sweep.get((op, np_, nbytes, impl)), self.sweep.get((op, np_, nbytes, peer))
        if not a or not b or "median_s" not in a or "median_s" not in b:
            return None
        return paired_ratio(a, b)

    def busbw(self, op: str, np_: int, nbytes: int, impl: str) -> Optional[float]:
        r = self.sweep.get((op, np_, nbytes, impl))
        if not r or "median_s" not in r:
            return None
        return nbytes / r["median_s"] / 1e9 * bus_factor(op, np_)

    def latency(self, impl: str, np_: int = 2, pattern: str = LATENCY_PATTERNS[0]) -> Optional[dict]:
        """One 8-byte allreduce's latency record, combined over repetitions (None when none was measured)."""
        recs = [r for r in self.records
                if r.get("kind") == "latency" and r["impl"] == impl and r["np"] == np_ and "median_s" in r
                and r.get("pattern", LATENCY_PATTERNS[0]) == pattern]
        return combine(recs) if recs else None

    def kinds(self, kind: str) -> List[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def bandwidth_panels(self, ops: List[str]) -> Dict[str, Dict[str, List[Tuple[int, float]]]]:
        """For charts.bandwidth: ``"op, np = N"`` -> implementation label -> [(bytes, busbw GB/s)]."""
        panels: Dict[str, Dict[str, List[Tuple[int, float]]]] = {}
        keys = sorted(self.sweep, key=lambda k: (k[1], ORDER.index(k[3]) if k[3] in ORDER else len(ORDER), k[2]))
        for op in ops:
            for np_ in sorted({k[1] for k in self.sweep}):
                series: Dict[str, List[Tuple[int, float]]] = {}
                for key in keys:
                    bw = self.busbw(*key) if key[0] == op and key[1] == np_ else None
                    if bw is not None:
                        series.setdefault(LABELS.get(key[3], key[3]), []).append((key[2], bw))
                if series:
                    panels[f"{op}, np = {np_}"] = series
        return panels

    def latency_groups(self, np_: int = 2) -> Dict[str, Dict[str, float]]:
        """For charts.bars: latency pattern -> implementation label -> median µs of one 8-byte allreduce."""
        groups: Dict[str, Dict[str, float]] = {}
        for pattern in LATENCY_PATTERNS:
            for impl in ORDER:
                r = self.latency(impl, np_, pattern)
                if r:
                    groups.setdefault(pattern, {})[LABELS[impl]] = r["median_s"] * 1e6
        return groups


def combine(recs: List[dict]) -> dict:
    """The records of one measurement from every repetition as one: medians over the repetitions that produced a
    time (``rep_medians_s`` by repetition); when none did, the first record (its error)."""
    timed = sorted((r for r in recs if "median_s" in r), key=lambda r: r.get("rep", 0))
    if not timed:
        return recs[0]
    if len(timed) == 1 and len(recs) == 1:
        return timed[0]
    out = dict(timed[0])
    out["rep_medians_s"] = {int(r.get("rep", 0)): r["median_s"] for r in timed}
    for key in ("median_s", "p90_s", "mean_s"):
        if all(key in r for r in timed):
            out[key] = statistics.median(r[key] for r in timed)
    if "iters" in out and isinstance(out["iters"], list):
        out["iters"] = [i for r in timed for i in r["iters"]]
    if "samples_s" in out:
        out["samples_s"] = [x for r in timed for x in r["samples_s"]]
    failed = len(recs) - len(timed)
    if failed:
        out["failed_reps"] = failed
    return out


def rep_times(rec: dict) -> Dict[int, float]:
    """Repetition -> median time of one combined (or single) record."""
    return rec.get("rep_medians_s") or {int(rec.get("rep", 0)): rec["median_s"]}


def paired_ratio(ours: dict, peer: dict) -> Optional[Tuple[float, float, float]]:
    """peer's time ÷ ours within each repetition both were timed in: (median, min, max); None without one."""
    a, b = rep_times(ours), rep_times(peer)
    ratios = [b[k] / a[k] for k in sorted(set(a) & set(b)) if a[k] > 0]
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


def fmt_ratio(r: Optional[Tuple[float, float, float]]) -> str:
    """``1.27× (0.54–1.97)``; one repetition: ``1.27×``; ``–`` for none."""
    if r is None:
        return "–"
    med, lo, hi = r
    return f"{med:.2f}×" + (f" ({lo:.2f}–{hi:.2f})" if hi > lo else "")
