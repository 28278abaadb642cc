"""The markdown report of a collectives run: bandwidth tables, latency, fusion, memory, details and notes."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks._collectives.cases import LABELS, LATENCY_PATTERNS, ORDER
from benchmarks._collectives.results import Results, fmt_ratio, rep_times
from benchmarks._collectives.verdicts import evaluate
from benchmarks._lib.measure import MIB, bus_factor, fmt_bw, fmt_time, format_size
from benchmarks._lib.report import table
from benchmarks.targets import Target

TITLE = "Collectives: this project vs torch.distributed (Gloo) and Open MPI"
# The peers every ratio is taken against: each measured in jobs of its own, launched as its users launch it
# (Gloo by torchrun, Open MPI by mpirun; benchmarks/_collectives/jobs.py).
PEERS = ("gloo", "openmpi")


def render(ops: List[str], res: Results, memcpy: Dict[int, float], info: Dict[str, str], failures: List[str],
           primary: str, title: str = TITLE, with_targets: bool = True,
           targets: Optional[Sequence[Target]] = None) -> str:
    """The whole report; ``with_targets``: end with the rows of benchmarks/targets.py (``targets``: those, default
    the single-host run's)."""
    lines: List[str] = []
    add = lines.append
    add(f"# {title}")
    add("")
    for k, v in info.items():
        add(f"- **{k}**: {v}")
    add("")
    add("Method: float32, sum (allreduce-avg: the average; Gloo and Open MPI sum, then divide in place; "
        "allreduce-async: started asynchronously and waited for at once: `allreduce_async_` + `synchronize`, Gloo's "
        "`async_op=True` + `wait()`, Open MPI's `Iallreduce` + `Wait`). Size = "
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
    for op in ops:
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
                        row.append(fmt_bw(res.busbw(op, np_, nbytes, impl)))
                if memcpy:
                    row.append(f"{nbytes / memcpy[nbytes] / 1e9:.2f}" if nbytes in memcpy else "–")
                rows.append(row)
            lines += table(["size"] + [LABELS[i] for i in present] + (["np.copyto GB/s"] if memcpy else []), rows)

    lines += _against_peers(ops, res, nps, primary)

    # -- latency
    lat = res.kinds("latency")
    if lat:
        add("")
        add("## Latency: one 8-byte float32 allreduce")
        add("")
        add("Patterns: *back to back* (a tight loop); *barrier before each* (ranks line up first); *1 ms compute "
            "before each* (every rank sleeps 1 ms before each call, as a training step computes between "
            "collectives). Only the call is timed; median, p90 and mean are medians over repetitions. The "
            "*wake-up probe* row is the machine's floor for the last pattern at np = 2: two processes ping-pong one "
            "byte over a Unix socket after the same 1 ms sleep.")
        add("")
        rows = []
        for np_ in sorted({r["np"] for r in lat}):
            for pattern in LATENCY_PATTERNS:
                for impl in present + [i for i in ORDER if i not in present]:
                    comb = res.latency(impl, np_, pattern)  # the median over repetitions
                    if comb is not None:
                        reps = list(rep_times(comb).values())
                        calls = comb["iters"] * len(reps) if isinstance(comb["iters"], int) else comb["iters"]
                        rows.append([str(np_), pattern, LABELS[impl], fmt_time(comb["median_s"]),
                                     f"{fmt_time(min(reps))}–{fmt_time(max(reps))}" if len(reps) > 1 else "–",
                                     fmt_time(comb["p90_s"]), fmt_time(comb["mean_s"]), str(calls)])
                        continue
                    for r in lat:  # never timed: its error, once
                        if (r["impl"] == impl and r["np"] == np_ and "median_s" not in r
                                and r.get("pattern", LATENCY_PATTERNS[0]) == pattern):
                            rows.append([str(np_), pattern, LABELS[impl], "WRONG" if r.get("wrong") else "error",
                                         "", r.get("error", "")[:80], "", ""])
                            break
                if pattern == LATENCY_PATTERNS[2]:
                    rows += [[str(np_), pattern, "wake-up probe (floor)", fmt_time(r["median_s"]), "–",
                              fmt_time(r["p90_s"]), fmt_time(r["mean_s"]), str(r["iters"])]
                             for r in res.kinds("wakeup") if r["np"] == np_]
        lines += table(["np", "pattern", "implementation", "median", "range over reps", "p90", "mean", "calls"],
                        rows)

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
                 str(cfg.get(label, {}).get("inline_bytes", "?")), fmt_time(t), fmt_time(t / f["count"]),
                 str(len(f["samples_s"][label]))] for label, t in med.items()]
        lines += table(["fusion threshold", "engine's fusion_threshold (bytes)", "inline_bytes", "time for all",
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
        lines += table(["implementation", "RSS before (MiB, per rank)", "overhead (MiB, per rank)",
                         "max overhead (MiB)", "result"], rows)

    # -- details
    add("")
    add("## Details: median time, algbw and busbw")
    for op in ops:
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
                bus = algbw * bus_factor(op, np_)
                lo, hi = min(r["iters"]), max(r["iters"])
                reps = list(rep_times(r).values())
                spread = f"{fmt_time(min(reps))}–{fmt_time(max(reps))}" if len(reps) > 1 else "–"
                rows.append([format_size(nbytes), LABELS[impl], fmt_time(r["median_s"]), spread, f"{algbw:.3f}",
                             f"{bus:.3f}",
                             *[fmt_ratio(res.ratio(op, np_, nbytes, impl, peer)) if impl not in PEERS else "–"
                               for peer in PEERS],
                             f"{r['rounds']} × {lo}" + (f"–{hi}" if hi != lo else "")])
            lines += table(["size", "implementation", "median time", "range over reps", "algbw GB/s",
                             "busbw GB/s", "× Gloo", "× Open MPI", "rounds×calls"], rows, "llrrrrrrr")
    if memcpy:
        add("")
        add("### numpy copy ceiling (np.copyto, one core)")
        add("")
        lines += table(["size", "time", "GB/s"],
                        [[format_size(s), fmt_time(t), f"{s / t / 1e9:.2f}"] for s, t in sorted(memcpy.items())])

    # -- notes
    notes = _notes(res, failures)
    if notes:
        add("")
        add("## Notes")
        add("")
        lines += [f"- {n}" for n in notes]

    if with_targets:
        add("")
        add("## Targets")
        add("")
        rows = evaluate(res, primary, targets)
        if rows:
            lines += table(["target", "measured", "required", "result"], rows, "llll")
        else:
            add("None for this kind of run (benchmarks/targets.py).")
    return "\n".join(lines) + "\n"


def _against_peers(ops: List[str], res: Results, nps: List[int], primary: str) -> List[str]:
    """This project's engine (primary transport) against each peer, size by size: the speed ratio within each
    repetition, median (min–max)."""
    ours = f"engine-{primary}"
    peers = [p for p in PEERS if any(k[3] == p for k in res.sweep)]
    if not peers or not any(k[3] == ours for k in res.sweep):
        return []
    out = ["", f"## {LABELS[ours]} against its peers, each launched as its users launch it", "",
           "× = the peer's time ÷ ours at the same size (above 1: we are faster), within each repetition; median "
           "(min–max) over repetitions. Gloo ran under torchrun and Open MPI under mpirun, each in jobs of its own "
           "(the header gives the command lines and the CPUs their ranks were allowed)."]
    for np_ in nps:
        rows = []
        for op in ops:
            for nbytes in sorted({k[2] for k in res.sweep if k[0] == op and k[1] == np_}):
                ratios = [fmt_ratio(res.ratio(op, np_, nbytes, ours, p)) for p in peers]
                if any(x != "–" for x in ratios):
                    rows.append([op, format_size(nbytes), *ratios])
        if rows:
            out += ["", f"### np = {np_}", ""]
            out += table(["collective", "size", *[f"× {LABELS[p]}" for p in peers]], rows, "ll" + "r" * len(peers))
    return out


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
                f"{format_size(nbytes)} {r['median_s'] / raw['median_s']:.1f}× ({fmt_time(r['median_s'])} vs "
                f"{fmt_time(raw['median_s'])})")
    for (impl, np_), added in sorted(small.items()):
        notes.append(f"{LABELS[impl]} np={np_}, messages below 1 MiB: the engine adds {fmt_time(min(added))} .. "
                     f"{fmt_time(max(added))} per call over the raw {impl.split('-', 1)[1]} transport "
                     f"(median {fmt_time(statistics.median(added))}, all collectives)")
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
                         f"{fmt_time(m['default'] / fus[0]['count'])} per tensor even when fused, so the "
                         f"per-tensor cost (request, negotiation, completion) dominates, not the data plane")
    return notes


