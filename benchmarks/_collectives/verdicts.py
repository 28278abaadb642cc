"""The targets of ``benchmarks/targets.py`` held against a run's results: one table row each."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from benchmarks._collectives.cases import LABELS
from benchmarks._collectives.results import Results, fmt_ratio, paired_ratio
from benchmarks._lib.measure import fmt_time, format_size
from benchmarks.targets import Target, for_run

Row = List[str]


def _busbw_ratio(t: Target, res: Results, primary: str) -> List[Row]:
    ours, peer = f"{t.impl}-{primary}", t.peer or ""
    need = t.at_least or 0.0
    bar = f"≥ {need:.2f}×" if need < 1 else f"≥ {need:g}×"
    what = f"allreduce {format_size(t.nbytes)} np={t.np} busbw, {LABELS[ours]} vs {LABELS.get(peer, peer)}"
    a, b = res.busbw("allreduce", t.np, t.nbytes, ours), res.busbw("allreduce", t.np, t.nbytes, peer)
    ratio = res.ratio("allreduce", t.np, t.nbytes, ours, peer)  # within each repetition: median (min–max)
    if a is None or b is None or ratio is None:
        return [[what, "not measured", bar, "n/a"]]
    return [[what, f"{a:.2f} vs {b:.2f} GB/s = {fmt_ratio(ratio)}", bar, "PASS" if ratio[0] >= need else "FAIL"]]


def _latency(t: Target, res: Results, primary: str) -> List[Row]:
    ours, limit, pattern = f"{t.impl}-{primary}", t.at_most_s or 0.0, t.pattern or ""
    floor = [r for r in res.kinds("wakeup") if r["np"] == t.np]
    need = f"≤ {limit * 1e6:.0f} µs" + (f" and ≥ {t.times_faster:g}× faster than Gloo" if t.times_faster else "")
    if t.floor_factor and floor:
        need += f" (or ≤ {t.floor_factor:g}× the wake-up floor, {fmt_time(floor[0]['median_s'])})"
    what = f"8-byte allreduce np={t.np}, {pattern}, {LABELS[ours]}"
    lat, gloo = res.latency(ours, t.np, pattern), res.latency("gloo", t.np, pattern)
    if not lat:
        return [[what, "not measured", need, "n/a"]]
    ok = lat["median_s"] <= limit or bool(t.floor_factor and floor
                                          and lat["median_s"] <= t.floor_factor * floor[0]["median_s"])
    # Gloo's time ÷ ours within each repetition (both launched as their users launch them): median (min–max)
    faster = paired_ratio(lat, gloo) if gloo else None
    if t.times_faster:
        ok = ok and (faster is None or faster[0] >= t.times_faster)
    measured = fmt_time(lat["median_s"]) + (f" vs Gloo {fmt_time(gloo['median_s'])} = {fmt_ratio(faster)}"
                                            if gloo and faster else "")
    return [[what, measured, need, "PASS" if ok else "FAIL"]]


def _new_result(t: Target, res: Results, primary: str) -> List[Row]:
    impl, ours, size = f"{t.impl}-{primary}", f"engine-{primary}", t.nbytes
    need = t.at_least or 0.0
    new, inplace = res.busbw("allreduce-new", t.np, size, impl), res.busbw("allreduce", t.np, size, ours)
    rows = [[f"allreduce {format_size(size)} np={t.np}, new result ({LABELS.get(impl, impl)}) ÷ in place "
             f"({LABELS[ours]})",
             f"{new:.2f} ÷ {inplace:.2f} GB/s = {new / inplace:.0%}" if new and inplace else "not measured",
             f"≥ {need:.0%}".replace("%", " %"),
             ("PASS" if new >= need * inplace else "FAIL") if new and inplace else "n/a"]]
    cold = [r for r in res.kinds("coldwrite") if r["bytes"] == size]
    if new and inplace and cold:
        # The machine's bound: the in-place time plus writing the result into memory that is not in cache.
        bound_s = size / (inplace * 1e9) + cold[0]["extra_s"]
        new_s = size / (new * 1e9)
        rows.append([f"  the same, against this machine's bound for a new result (in place + "
                     f"{fmt_time(cold[0]['extra_s'])} to write {format_size(size)} into memory not in cache)",
                     f"{fmt_time(new_s)} vs bound {fmt_time(bound_s)} = {bound_s / new_s:.0%} of the bound",
                     "(reported)", "n/a"])
    return rows


def _fusion_gain(t: Target, res: Results, primary: str) -> List[Row]:
    need = t.at_least or 0.0
    fus = res.kinds("fusion")
    if not (fus and "default" in fus[0]["median_s"] and "off" in fus[0]["median_s"]):
        return [["fusion gain, 1,000 × 4 KiB allreduce", "not measured", f"≥ {need:g}×", "n/a"]]
    m = fus[0]["median_s"]
    gain = m["off"] / m["default"]
    ok = gain >= need and not fus[0].get("error")
    return [["fusion gain, 1,000 × 4 KiB allreduce (threshold 0 ÷ default)",
             f"{fmt_time(m['off'])} ÷ {fmt_time(m['default'])} = {gain:.2f}×", f"≥ {need:g}×",
             "PASS" if ok else "FAIL"]]


def _peer_sweep(t: Target, res: Results, primary: str) -> List[Row]:
    """One row per collective: ours ÷ the peer's speed at every size measured from ``t.min_bytes`` up (within each
    repetition, median), the slowest size named."""
    ours, peer, need = f"{t.impl}-{primary}", t.peer or "", t.at_least or 0.0
    rows: List[Row] = []
    for op in t.ops:
        ratios = []  # (median ratio, size, formatted)
        for nbytes in sorted({k[2] for k in res.sweep if k[0] == op and k[1] == t.np and k[3] == ours}):
            r = res.ratio(op, t.np, nbytes, ours, peer) if nbytes >= t.min_bytes else None
            if r:
                ratios.append((r[0], nbytes, fmt_ratio(r)))
        if op == "allreduce" and t.min_bytes <= 8:  # 8 B: the latency phase, back to back
            a, b = res.latency(ours, t.np), res.latency(peer, t.np)
            r = paired_ratio(a, b) if a and b else None
            if r:
                ratios.append((r[0], 8, fmt_ratio(r)))
        where = f" across {t.hosts} hosts" if t.hosts else ""
        what = (f"{op} np={t.np}{where}, every size from {format_size(t.min_bytes)}: {LABELS[ours]} ÷ "
                f"{LABELS.get(peer, peer)} speed")
        bar = f"≥ {need:g}× at every size"
        if not ratios:
            rows.append([what, "not measured", bar, "n/a"])
            continue
        worst = min(ratios)
        rows.append([what, f"slowest {worst[2]} at {format_size(worst[1])} ({len(ratios)} sizes)", bar,
                     "PASS" if worst[0] >= need else "FAIL"])
    return rows


EVALUATORS: Dict[str, Callable[[Target, Results, str], List[Row]]] = {
    "busbw_ratio": _busbw_ratio, "latency": _latency, "new_result": _new_result, "fusion_gain": _fusion_gain,
    "peer_sweep": _peer_sweep}


def evaluate(res: Results, primary: str, targets: Optional[Sequence[Target]] = None) -> List[Row]:
    """``[target, measured, required, PASS/FAIL/n/a]`` for every target, in the order of ``targets`` (default: the
    single-host run's, :func:`benchmarks.targets.for_run`)."""
    rows: List[Row] = []
    for t in for_run() if targets is None else targets:
        rows += EVALUATORS[t.kind](t, res, primary)
    return rows
