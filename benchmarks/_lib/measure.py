"""Sizes, bus-bandwidth factors, summaries of timed samples, and how times and bandwidths are printed."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text: str) -> int:
    """``"4K"``, ``"4KiB"``, ``"64M"``, ``"1.5G"``, ``"4096"`` -> bytes (binary units)."""
    low = text.strip().lower().rstrip("b").rstrip("i")
    scale = {"k": KIB, "m": MIB, "g": GIB}.get(low[-1:], 1)
    number = low[:-1] if scale > 1 else low
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; expected e.g. 4096, 4K, 64M or 1G") from None


def parse_sizes(text: str) -> List[int]:
    """A comma-separated list of sizes (``"4K,1M,64M"``)."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(nbytes: int) -> str:
    """Bytes as the shortest exact binary unit: ``4 KiB``, ``64 MiB``, ``8 B``."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_ladder(lo: int, hi: int, factor: int = 4) -> List[int]:
    """``lo, lo*factor, ...`` up to ``hi``; ``hi`` itself is always the last entry."""
    out, size = [], lo
    while size < hi:
        out.append(size)
        size *= factor
    out.append(hi)
    return out


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw: the share of the message every rank must send over its slowest link."""
    if nranks <= 1:
        return 1.0
    if op in ("allreduce", "allreduce-avg", "allreduce-new", "allreduce-async"):  # averaged, new array, asynchronous
        return 2.0 * (nranks - 1) / nranks
    if op in ("allgather", "reducescatter", "alltoall"):
        return (nranks - 1) / nranks
    if op == "broadcast":
        return 1.0
    raise ValueError(f"no bus factor for collective {op!r}; expected allreduce, allgather, reducescatter, "
                     f"alltoall or broadcast")


def busbw_gbs(op: str, nranks: int, nbytes: int, seconds: float) -> float:
    """Bus bandwidth in GB/s (10^9 bytes) of one call of ``op`` on ``nbytes`` that took ``seconds``."""
    return nbytes / seconds / 1e9 * bus_factor(op, nranks)


def summarize(samples: Sequence[float]) -> Dict[str, float]:
    """Median, 90th percentile, mean, min and max of timed samples (seconds)."""
    if not samples:
        raise ValueError("no samples to summarize: the measurement produced none")
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median_s": statistics.median(ordered), "p90_s": p90, "mean_s": statistics.fmean(ordered),
            "min_s": ordered[0], "max_s": ordered[-1]}


def fmt_time(seconds: Optional[float]) -> str:
    """``12.3 µs``, ``4.56 ms``, ``1.23 s``; ``–`` for nothing measured."""
    if seconds is None:
        return "–"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bw(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}"
