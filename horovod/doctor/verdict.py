"""The verdict: a pure function of one job's dumps (:class:`horovod.doctor.dumps.Job`) → a few sentences.

How it reasons, in order:

1. Find the collective the job is stuck on: among every rank's collectives still waiting (enqueued, negotiated or
   started and not finished, or failed by the stall inspector) and the coordinator's table of names waiting for
   ranks, the one waiting longest.
2. For each rank of its process set that never submitted it (the *missing* ranks), say why:
   - no dump from that rank: the launcher's view says it exited (with which code or signal) or is stopped; else
     it is not responding (stopped, killed, or stuck in native code that holds the GIL);
   - it waits in another collective on another process set with the same kind: a process-set mismatch;
   - it waits in another collective the others have not issued, one its own history shows coming right after the
     missing one: it skipped the missing one;
   - it waits in another collective the others have not issued otherwise: the ranks issue collectives in
     different orders (a skip and a swap read the same from inside; the history only tips the balance);
   - it is in no collective: it is in the user's code (its main thread's innermost frame outside Horovod, the
     standard library and installed packages), and, when it has forked workers that dumped, where they are.
3. Name the ranks that wait and the user's line where they wait.

Nothing here reads files or clocks: tests feed it dumps and compare sentences.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from horovod.doctor.dumps import Job

WAITING_STATES = ("enqueued", "negotiated", "started")
Key = Tuple[int, str]


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0 and 1`` / ``ranks 0–2, 5``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: List[List[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}–{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    if len(parts) == 1 and len(runs[0]) == 2:
        return f"ranks {runs[0][0]} and {runs[0][1]}"
    return "ranks " + ", ".join(parts)


def display_name(name: str) -> str:
    """The user's tensor name: ``allreduce.grad.fc1`` → ``grad.fc1``; unnamed ops keep their engine name."""
    kind, _, rest = name.partition(".")
    return name if not rest or rest.startswith("noname.") else rest


def _wait(ranks) -> str:
    return "waits" if len(set(ranks)) == 1 else "wait"


def waiting(record: Dict[str, Any]) -> bool:
    state = record.get("state")
    return state in WAITING_STATES or (state == "failed" and str(record.get("error", "")).startswith("stall"))


def user_frame(dump: Dict[str, Any], record: Optional[Dict[str, Any]] = None) -> Optional[Sequence[Any]]:
    """The innermost frame in the user's code (``[file, line, function, code, library]``) of the thread that issued
    ``record`` (a collective: its ``thread``), else of the main thread."""
    threads = dump.get("threads") or []
    ident = (record or {}).get("thread")
    issuer = next((t for t in threads if ident is not None and t.get("ident") == ident and t.get("frames")), None)
    main = issuer or next((t for t in threads if t.get("main")), None) or (threads[0] if threads else None)
    if not main or not main.get("frames"):
        return None
    frames = main["frames"]
    for frame in reversed(frames):
        if not frame[4]:
            return frame
    return frames[-1]


def where(dump: Dict[str, Any], record: Optional[Dict[str, Any]] = None) -> str:
    """``train.py:88 (`next(loader)`)``: where the thread that issued ``record`` is (the main thread without one)."""
    frame = user_frame(dump, record)
    if frame is None:
        return "an unknown place (no Python stack)"
    code = f" (`{frame[3]}`)" if frame[3] else ""
    if frame[0].startswith("<"):
        # Code without a file (a function shipped by horovod.run / Spark / Ray, `python -c`): name the function.
        return f"{frame[2]}() at {frame[0]}:{frame[1]}{code}"
    return f"{frame[0].rsplit('/', 1)[-1]}:{frame[1]}{code}"


def _first_waiting(dump: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    pending = [c for c in dump.get("collectives", []) if waiting(c)]
    return min(pending, key=lambda c: c["seq"]) if pending else None


def _describe(record: Dict[str, Any]) -> str:
    shown = display_name(record["name"])
    if shown == record["name"] and ".noname." in shown:
        return f"an unnamed {record['kind']} ('{shown}')"
    return f"{record['kind']} '{shown}'"


def _set_text(job_sets: Dict[str, List[int]], set_id: int) -> str:
    if set_id == 0:
        return "the global process set"
    ranks = job_sets.get(str(set_id))
    return f"process set {set_id}" + (f" (ranks {ranks})" if ranks is not None else "")


def _age(dump: Dict[str, Any], since: Optional[float]) -> str:
    if since is None:
        return ""
    return f" (no collective for {max(0.0, dump['monotonic'] - since):.0f} s)"


def _last_activity(dump: Dict[str, Any]) -> Optional[float]:
    times = [c.get("finished") or c.get("enqueued") for c in dump.get("collectives", [])]
    times = [t for t in times if t is not None]
    return max(times) if times else None


def _last_completed_with(job: Job, rank: int, sets: Dict[str, List[int]]) -> Optional[Dict[str, Any]]:
    """The newest collective the other ranks completed on a set that includes ``rank``: its last one too."""
    best = None
    for dump in job.ranks.values():
        for rec in dump.get("collectives", []):
            members = sets.get(str(rec["process_set"]), list(range(job.size)))
            if rec.get("state") == "done" and rank in members and (best is None or rec["seq"] > best["seq"]):
                best = rec
    return best


def _went_on_to(dump: Dict[str, Any], skipped: Key, then: Key) -> bool:
    """This rank's own history shows ``then`` issued right after ``skipped`` (on the same set): so issuing
    ``then`` now, without ``skipped``, most likely skipped it (a swap of the two reads the same from inside)."""
    history = [(c["process_set"], c["name"]) for c in dump.get("collectives", []) if c["process_set"] == skipped[0]]
    return any(a == skipped and b == then for a, b in zip(history, history[1:]))


def _stuck_collective(job: Job) -> Optional[Tuple[Key, Dict[str, Any], Dict[int, Dict[str, Any]]]]:
    """The collective waiting longest: its key, one record of it, and the waiting ranks' records."""
    by_key: Dict[Key, Dict[int, Dict[str, Any]]] = {}
    for rank, dump in job.ranks.items():
        rec = _first_waiting(dump)
        if rec is not None:
            by_key.setdefault((rec["process_set"], rec["name"]), {})[rank] = rec
    if not by_key:
        return None
    # Oldest by the wall clock (ranks on several hosts share no monotonic clock).
    def started(key: Key) -> float:
        return min(job.ranks[r]["wall_time"] - (job.ranks[r]["monotonic"] - rec["enqueued"])
                   for r, rec in by_key[key].items())
    # The collective most ranks wait in (the others are the odd ones out); among equals the one rank 0 (or the
    # lowest rank) waits in, so the same hang always reads the same; then the oldest.
    key = min(by_key, key=lambda k: (-len(by_key[k]), min(by_key[k]), started(k)))
    return key, next(iter(by_key[key].values())), by_key[key]


def _submitted_by_coordinator(job: Job, key: Key) -> List[int]:
    dump0 = job.ranks.get(0)
    for row in (dump0 or {}).get("coordinator") or []:
        if (row["process_set"], row["name"]) == key:
            return [int(r) for r in row["submitted"]]
    return []


def _absent_text(job: Job, rank: int, sets: Dict[str, List[int]]) -> str:
    info = job.launcher.get(rank, {})
    place = f"host {info['host']}, pid {info['pid']}" if info.get("host") and info.get("pid") else ""
    who = f"rank {rank}" + (f" ({place})" if place else "")
    state = info.get("state")
    if state == "exited":
        code = info.get("returncode")
        how = f"was killed by {info.get('signal') or f'signal {-code}'}" if isinstance(code, int) and code < 0 \
            else f"exited with code {code}"
        text = f"{who} {how}"
    elif state == "stopped":
        text = f"{who} is stopped (SIGSTOP or a debugger) and not responding"
    else:
        text = f"{who} is stopped/not responding (it wrote no dump: stopped, killed, or stuck in native code)"
    last = _last_completed_with(job, rank, sets)
    if last is not None:
        seen_on = next(r for r, d in job.ranks.items() if last in d.get("collectives", []))
        text += f"; its last completed collective was {_describe(last)} (#{last['seq']} on rank {seen_on})"
    return text


def diagnose(job: Job) -> List[str]:
    """The verdict, one sentence per finding, the most likely cause first."""
    sets: Dict[str, List[int]] = {}
    for dump in job.ranks.values():
        sets.update(dump.get("process_sets") or {})
    everyone = list(range(job.size))
    absent = [r for r in everyone if r not in job.ranks]
    stuck = _stuck_collective(job)
    findings: List[str] = []
    if stuck is None:
        for rank in absent:
            findings.append(_absent_text(job, rank, sets))
        if not findings:
            places = "; ".join(f"rank {r} in {where(d)}" for r, d in sorted(job.ranks.items()))
            findings.append(f"no collective is waiting on any rank (all completed): {places}")
        return findings
    key, record, waiters = stuck
    members = sets.get(str(key[0]), everyone)
    submitted = set(waiters) | set(_submitted_by_coordinator(job, key))
    for rank, dump in job.ranks.items():   # ranks that submitted it and wait behind an older one of their own
        if any((c["process_set"], c["name"]) == key and waiting(c) for c in dump.get("collectives", [])):
            submitted.add(rank)
    missing = [r for r in members if r not in submitted]
    wait_where = sorted({where(job.ranks[r], rec) for r, rec in waiters.items()})
    waiters_text = f"{ranks_text(waiters)} {_wait(waiters)} in it ({', '.join(wait_where)})"
    what = _describe(record)
    crossed: Dict[Key, List[int]] = {}   # missing ranks waiting in another collective, by that collective
    for rank in missing:
        if rank not in job.ranks:
            findings.append(f"{_absent_text(job, rank, sets)}; {ranks_text(waiters)} {_wait(waiters)} in {what} "
                            f"({', '.join(wait_where)})")
            continue
        dump = job.ranks[rank]
        own = _first_waiting(dump)
        same_place = next((c for c in dump.get("collectives", []) if c["seq"] == record["seq"]), None)
        if own is None and same_place is not None and same_place["process_set"] != key[0] \
                and same_place["kind"] == record["kind"]:
            findings.append(
                f"process-set mismatch: {ranks_text(waiters)} issued {what} (collective #{record['seq']}) on "
                f"{_set_text(sets, key[0])}, but rank {rank} issued its collective #{record['seq']}, "
                f"{_describe(same_place)}, on {_set_text(sets, same_place['process_set'])} instead; it is now in "
                f"{where(dump)}"
                f"{_age(dump, _last_activity(dump))}; {waiters_text}")
        elif own is None:
            text = (f"rank {rank} never submitted {what} (its collective #{dump['collectives_enqueued'] + 1}): it is "
                    f"in {where(dump)}{_age(dump, _last_activity(dump))}")
            for child in job.children.get(rank, []):
                text += f", waiting for its child process (pid {child['pid']}, a data loader worker?) in {where(child)}"
            findings.append(f"{text}; {waiters_text}")
        else:
            crossed.setdefault((own["process_set"], own["name"]), []).append(rank)
    for other_key, ranks in crossed.items():
        first = _first_waiting(job.ranks[ranks[0]])
        assert first is not None   # crossed holds only ranks waiting in something
        own = first
        other_where = ", ".join(sorted({where(job.ranks[r], _first_waiting(job.ranks[r])) for r in ranks}))
        if own["process_set"] != key[0] and own["kind"] == record["kind"]:
            findings.append(
                f"process-set mismatch: {ranks_text(waiters)} issued {what} (collective #{record['seq']}) on "
                f"{_set_text(sets, key[0])}, but {ranks_text(ranks)} issued {_describe(own)} (collective "
                f"#{own['seq']}) on {_set_text(sets, own['process_set'])} at {other_where}; "
                f"{ranks_text(waiters)} {_wait(waiters)} at {', '.join(wait_where)}")
        elif all(_went_on_to(job.ranks[r], key, other_key) for r in ranks):
            findings.append(
                f"{ranks_text(ranks)} skipped {what} (the others' collective #{record['seq']}) and went on to "
                f"{_describe(own)}, the collective that followed it in earlier steps, at {other_where}; "
                f"{waiters_text}")
        else:
            findings.append(
                f"{ranks_text(sorted(set(waiters) | set(ranks)))} issued {what} and {_describe(own)} in opposite "
                f"orders (or {ranks_text(ranks)} skipped {what}): {ranks_text(waiters)} {_wait(waiters)} in {what} "
                f"at {', '.join(wait_where)}, {ranks_text(ranks)} {_wait(ranks)} in "
                f"{_describe(own)} at {other_where}")
    if not missing:
        findings.append(f"every member of {_set_text(sets, key[0])} submitted {what}; it is still running "
                        f"(state {record['state']}) on {ranks_text(waiters)} in {', '.join(wait_where)}: the data "
                        f"plane is slow or a peer stopped mid-transfer")
    for rank in absent:
        if rank not in missing:
            findings.append(_absent_text(job, rank, sets))
    return findings
