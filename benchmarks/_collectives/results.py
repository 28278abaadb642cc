"""The records of every job of a run, indexed for the tables, the targets and the charts."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from benchmarks._collectives.cases import LABELS, LATENCY_PATTERNS, ORDER
from benchmarks._lib.measure import bus_factor


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
