"""One Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev) of every rank's recent collectives.

One track per rank; each collective is a slice from when it was enqueued to when it finished (or to the dump,
when it never did), with its wait for the other ranks (enqueued → negotiated) and its run (started → finished)
as nested slices.  Times are wall-clock microseconds, converted from each rank's monotonic clock with the pair
of clocks its dump carries, so ranks on different hosts line up as well as their clocks agree.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

from horovod.doctor.dumps import Job


def _wall(dump: Dict[str, Any], t: float) -> float:
    return (dump["wall_time"] - (dump["monotonic"] - t)) * 1e6


def events(job: Job) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for rank, dump in sorted(job.ranks.items()):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} ({dump.get('host')}, pid {dump.get('pid')})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        end_of_dump = dump["monotonic"]
        for rec in dump.get("collectives", []):
            begin = rec["enqueued"]
            end = rec.get("finished") or end_of_dump
            args = {k: rec.get(k) for k in ("seq", "kind", "process_set", "dtype", "shape", "bytes", "device",
                                            "state")}
            label = f"{rec['kind']} {rec['name']}"
            out.append({"ph": "X", "name": label, "cat": rec["state"], "pid": rank, "tid": rec["process_set"],
                        "ts": _wall(dump, begin), "dur": max(0.0, (end - begin) * 1e6), "args": args})
            negotiated = rec.get("negotiated")
            if negotiated:
                out.append({"ph": "X", "name": "wait for ranks", "pid": rank, "tid": rec["process_set"],
                            "ts": _wall(dump, begin), "dur": max(0.0, (negotiated - begin) * 1e6)})
            started = rec.get("started")
            if started:
                out.append({"ph": "X", "name": "run", "pid": rank, "tid": rec["process_set"],
                            "ts": _wall(dump, started), "dur": max(0.0, (end - started) * 1e6)})
        out.append({"ph": "i", "name": f"dump: {dump.get('reason')}", "s": "p", "pid": rank, "tid": 0,
                    "ts": dump["wall_time"] * 1e6})
    return out


def write(job: Job, path: str) -> str:
    with open(path, "w") as handle:
        json.dump({"traceEvents": events(job), "displayTimeUnit": "ms"}, handle)
    return path
