"""Hang dumps: one JSON file per rank (and per forked child that is asked) with the flight recorder, the stacks of
every Python thread, and — on rank 0 — the coordinator's table of collectives still waiting for ranks.

Written when something looks hung (the stall inspector's warning, a stall error, a peer failure or timeout), on
``SIGUSR1`` and on request (``hvd.dump_flight_recorder()``); read by :mod:`horovod.doctor`.  Each dump is a new
file (``g<generation>-rank<r>-<pid>-<ms>.json``; ``…-rank<r>-child-…`` from a forked child), written to a
temporary name and renamed, so a reader never sees half a file.  Everything here runs rarely and off the hot
path; failures to write are logged, never raised into the engine (a dump must not turn a hang into a crash).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

logger = logging.getLogger("horovod.engine.runtime")

FORMAT = 1
#: Rendezvous scope the launcher watches: ``pid.<rank>`` = ``host|pid`` announcements, ``request`` = dump now.
STORE_SCOPE = "doctor"
DEFAULT_DIR_NAME = "horovod-flight-recorder"
#: The function name of the SIGUSR1 handler (horovod.common.basics), cut from recorded stacks.
SIGNAL_HANDLER_NAME = "_on_dump_signal"


def directory(config: Any) -> str:
    return getattr(config, "flight_recorder_dir", "") or os.path.join(tempfile.gettempdir(), DEFAULT_DIR_NAME)


def _library_dirs() -> tuple:
    """Where library code lives (Horovod itself, the standard library, installed packages): frames there are not
    the user's source line."""
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the horovod package
    dirs = {here, paths.get("stdlib"), paths.get("platstdlib"), paths.get("purelib"), paths.get("platlib")}
    return tuple(os.path.join(d, "") for d in dirs if d)


def thread_stacks() -> List[Dict[str, Any]]:
    """Every Python thread's stack, innermost frame last: ``[{name, ident, main, daemon, frames: [[file, line,
    function, code, library], ...]}]`` (``library``: the frame is Horovod's, the standard library's or an installed
    package's, not the user's)."""
    lib = _library_dirs()
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        frames = [[f.filename, f.lineno, f.name, (f.line or "").strip(),
                   f.filename.startswith(lib) or f.filename.startswith("<frozen")]
                  for f in traceback.extract_stack(frame)]
        # The dump signal's handler may still be on the main thread (starting the dumping thread): cut it off,
        # so the stack ends where the signal found the thread.
        cut = next((i for i, f in enumerate(frames) if f[2] == SIGNAL_HANDLER_NAME), None)
        if cut is not None:
            frames = frames[:cut]
        out.append({"name": thread.name if thread else f"thread-{ident}", "ident": ident,
                    "main": thread is threading.main_thread() if thread else False,
                    "daemon": bool(thread.daemon) if thread else True, "dumping": ident == me, "frames": frames})
    return out


def _coordinator_view(runtime: Any) -> Optional[List[Dict[str, Any]]]:
    """Rank 0: what the coordinator waits for, per process set (who submitted what, who is missing)."""
    coord = getattr(runtime, "coordinator", None)
    if coord is None:
        return None
    for _ in range(3):   # the driving thread may change the tables while we read them: retry a torn read
        try:
            view = []
            for pset in list(coord.sets.values()):
                for name, pending in list(pset.pending.items()):
                    submitted = {str(r): {"kind": req.kind, "process_set": req.process_set}
                                 for r, req in list(pending.requests.items())}
                    view.append({"process_set": pset.id, "set_ranks": list(pset.ranks), "name": name,
                                 "first_seen": pending.first_seen, "submitted": submitted,
                                 "missing": sorted(set(pset.ranks) - set(pset.joined) - set(pending.requests))})
            return view
        except RuntimeError:
            continue
    return None


def _job_id(config: Any) -> str:
    topo = getattr(config, "topology", None)
    addr = getattr(topo, "rendezvous_addr", None)
    port = getattr(topo, "rendezvous_port", None)
    return f"{addr}:{port}" if addr else getattr(topo, "launched_by", None) or "local"


def _write(record: Dict[str, Any], where: str, generation: int, rank: int) -> str:
    os.makedirs(where, exist_ok=True)
    role = "-child" if record["role"] == "child" else ""
    name = f"g{generation}-rank{rank}{role}-{os.getpid()}-{int(time.time() * 1000)}.json"
    path = os.path.join(where, name)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=where)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, default=str)
    os.replace(tmp, path)
    return path


def dump(runtime: Any, reason: str) -> Optional[str]:
    """Write this rank's dump; returns its path (``None`` when writing failed: logged)."""
    try:
        recorder = runtime.recorder
        config = runtime.config
        child = os.getpid() != getattr(runtime, "_pid", os.getpid())
        record = {
            "format": FORMAT, "reason": reason, "job": _job_id(config),
            "generation": getattr(runtime, "flight_generation", 0),
            "rank": runtime.rank, "size": runtime.size, "host": socket.gethostname(), "pid": os.getpid(),
            "parent_pid": os.getppid(), "role": "child" if child else "rank",
            "transport": getattr(runtime, "transport_name", ""),
            "wall_time": time.time(), "monotonic": time.monotonic(),
            "process_sets": {str(i): list(s.ranks) for i, s in list(runtime.sets.items())},
            "collectives_enqueued": recorder.count, "recorder_capacity": recorder.capacity,
            "collectives": [] if child else recorder.snapshot(),
            "coordinator": None if child else _coordinator_view(runtime),
            "dead": None if runtime._dead is None else str(runtime._dead),
            "threads": thread_stacks(),
        }
        path = _write(record, directory(config), record["generation"], runtime.rank)
        # A signalled dump is the launcher's (it prints the verdict) or the user's own request: no warning per rank.
        logger.log(logging.INFO if reason == "SIGUSR1" else logging.WARNING,
                   "Horovod flight recorder dump (%s) written to %s; diagnose with: python -m horovod.doctor %s",
                   reason, path, os.path.dirname(path))
        return path
    except Exception:   # a dump must never break the engine or the user's signal handling
        logger.warning("could not write the Horovod flight recorder dump", exc_info=True)
        return None


def dump_once(runtime: Any, reason: str, key: str) -> Optional[str]:
    """:func:`dump` unless this engine already dumped for ``key`` (a stall is dumped once, not every check)."""
    done = runtime.__dict__.setdefault("_flight_dumped", set())
    if key in done:
        return None
    done.add(key)
    return dump(runtime, reason)


def on_stall_warning(runtime: Any) -> None:
    """The stall inspector (the coordinator's, or the fast lane's on a waiting rank) warned: dump here once, and
    ask the launcher to have every rank dump (it signals them, so ranks stuck outside Horovod dump too)."""
    if dump_once(runtime, "stall warning", "stall-warning"):
        request_all(runtime, "stall warning")


def request_all(runtime: Any, reason: str) -> None:
    """Ask the launcher (through the rendezvous store) to have every rank dump: it signals them, so ranks stuck
    outside Horovod dump too.  Best effort, off the calling thread."""
    store = getattr(runtime, "store", None)
    if store is None or not hasattr(store, "put"):
        return
    value = f"{time.time():.3f}|{runtime.rank}|{reason}".encode()

    def send() -> None:
        try:
            store.put(STORE_SCOPE, "request", value)
        except (OSError, ValueError):
            pass   # no launcher listening (or it is gone): this rank's own dump still stands

    threading.Thread(target=send, name="horovod-dump-request", daemon=True).start()


def announce(runtime: Any, handles_signal: bool) -> None:
    """Tell the launcher where this rank runs (host and pid), so it can watch it, and whether SIGUSR1 makes it dump
    (when the user's program handles SIGUSR1 itself, the launcher must not send it)."""
    store = getattr(runtime, "store", None)
    if store is None or not hasattr(store, "put"):
        return
    value = f"{socket.gethostname()}|{os.getpid()}|{int(handles_signal)}".encode()

    def send() -> None:
        try:
            store.put(STORE_SCOPE, f"pid.{runtime.rank}", value)
        except (OSError, ValueError):
            pass

    threading.Thread(target=send, name="horovod-announce", daemon=True).start()


def signal_children(signum: int) -> None:
    """Pass a dump signal on to this process's children that handle it (forked data-loader workers inherit the
    handler); a child that would die of it (an exec'd program) is left alone."""
    pids = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as handle:
                pids += [int(p) for p in handle.read().split()]
    except OSError:
        return   # not Linux, or no /proc: only this process dumps
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as handle:
                caught = next((int(line.split()[1], 16) for line in handle if line.startswith("SigCgt:")), 0)
            if caught & (1 << (signum - 1)):
                os.kill(pid, signum)
        except (OSError, ValueError):
            continue
