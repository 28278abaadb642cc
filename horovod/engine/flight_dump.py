"""Hang dumps: one JSON file per rank (and per forked child that is asked) with the flight recorder, the stacks of
every Python thread, and — on rank 0 — the coordinator's table of collectives still waiting for ranks.

Written when something looks hung (the stall inspector's warning, a stall error, a peer failure or timeout), on
``SIGUSR1`` and on request (``hvd.dump_flight_recorder()``); read by :mod:`horovod.doctor`.  Each dump is a new
file (``g<generation>-rank<r>-<pid>-<ms>.json``; ``…-rank<r>-child-…`` from a forked child), written to a
temporary name and renamed, so a reader never sees half a file.  Everything here runs rarely and off the hot
path; failures to write are logged, never raised into the engine (a dump must not turn a hang into a crash).

Collection (signal every rank on this host, wait for their dumps, record what is known of each process) lives here
too, below the launchers, because two kinds of caller need it: our launchers' watch
(:mod:`horovod.runner.doctor_watch`) and, under a plain ``mpirun`` where no launcher of ours runs, rank 0 itself
(it serves the job's store there, so it reads the ranks' announcements as a launcher would).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

if TYPE_CHECKING:   # the state's modules reach this one only through the parts that fail or stall
    from horovod.engine.engine_state import EngineState

logger = logging.getLogger("horovod.engine.runtime")

FORMAT = 1
#: Rendezvous scope the launcher watches: ``pid.<rank>`` = ``host|pid`` announcements, ``request`` = dump now.
STORE_SCOPE = "doctor"
DEFAULT_DIR_NAME = "horovod-flight-recorder"
#: The function name of the SIGUSR1 handler (horovod.common.basics), cut from recorded stacks.
SIGNAL_HANDLER_NAME = "_on_dump_signal"
#: The collector's record of each rank's process (the doctor reads it: ``horovod.doctor.dumps.LAUNCHER_FILE``).
LAUNCHER_FILE = "launcher.json"
#: How long a collection waits for the ranks' dumps after signalling them.
COLLECT_TIMEOUT_S = 5.0
_POLL_S = 0.1
#: How long no new dump may appear before a collection counts as complete (children dump after their rank).
_SETTLE_S = 0.5
#: Open MPI's job id, per version (5.x: the PMIx namespace; 4.x: the ess job id).
_MPIRUN_JOB_ENV = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


def _launched_by(config: Any) -> str:
    return getattr(getattr(config, "topology", None), "launched_by", "") or ""


def mpirun_job_id(env: Mapping[str, str] = os.environ) -> str:
    """Open MPI's id of this job, usable in a file name (every rank of the job agrees on it); ``""`` if unknown."""
    raw = next((env[name] for name in _MPIRUN_JOB_ENV if env.get(name)), "")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip("-")


class UnsafeDirectoryError(PermissionError):
    """The shared default dump directory exists but is not private to this user: another user could replace the
    dumps and so forge the doctor's verdict."""


def _unsafe(path: str) -> Optional[str]:
    """Why ``path`` (which exists) is not a private directory of this user; ``None`` when it is."""
    info = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        return "it is not a directory (or is a symbolic link)"
    uid = os.getuid()
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & 0o022:
        return f"it is writable by its group or by everyone (mode {info.st_mode & 0o777:o})"
    return None


def private_directory(path: str) -> str:
    """Create ``path`` with mode 0700 (when missing) and check that it is a directory of this user that no one else
    may write to; returns it.

    Raises:
        UnsafeDirectoryError: it exists, owned by another user, group/world-writable, or not a directory.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    why = _unsafe(path)
    if why is not None:
        raise UnsafeDirectoryError(f"the flight-recorder directory {path} is not private: {why}")
    return path


def directory(config: Any) -> str:
    """``HOROVOD_FLIGHT_RECORDER_DIR``; else ``<tmp>/horovod-flight-recorder``, with a sub-directory per job under
    ``mpirun`` (no launcher of ours chose one, and rank 0 diagnoses the job's directory).

    The shared default must be private to this user (created 0700; refused when another user owns it or may write
    to it, since the doctor's verdict rests on what it reads there): when it is not, ``…-<uid>`` next to it is used
    instead, checked the same way.  A directory the user chose is created 0700 when missing, and not checked.

    Raises:
        UnsafeDirectoryError: neither the default nor its per-user fallback is private; the message says what to
            do.
    """
    chosen = getattr(config, "flight_recorder_dir", "")
    if chosen:
        os.makedirs(chosen, mode=0o700, exist_ok=True)
        return chosen
    base = os.path.join(tempfile.gettempdir(), DEFAULT_DIR_NAME)
    try:
        private_directory(base)
    except UnsafeDirectoryError as first:
        fallback = f"{base}-{os.getuid()}"
        try:
            private_directory(fallback)
        except UnsafeDirectoryError as second:
            raise UnsafeDirectoryError(
                f"{first}; its fallback is not usable either ({second}). Set HOROVOD_FLIGHT_RECORDER_DIR (or "
                f"horovodrun --flight-recorder-dir) to a directory of your own, or remove those directories") from None
        logger.warning("%s; using %s instead", first, fallback)
        base = fallback
    job = mpirun_job_id() if _launched_by(config) == "mpirun" else ""
    if not job:
        return base
    where = os.path.join(base, f"mpirun-{job}")
    os.makedirs(where, mode=0o700, exist_ok=True)   # inside our private base: no one else can have made it
    return where


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


def _coordinator_view(runtime: "EngineState") -> Optional[List[Dict[str, Any]]]:
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
    os.makedirs(where, mode=0o700, exist_ok=True)
    role = "-child" if record["role"] == "child" else ""
    name = f"g{generation}-rank{rank}{role}-{os.getpid()}-{int(time.time() * 1000)}.json"
    path = os.path.join(where, name)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=where)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, default=str)
    os.replace(tmp, path)
    return path


def dump(runtime: "EngineState", reason: str) -> Optional[str]:
    """Write this rank's dump; returns its path (``None`` when writing failed: logged)."""
    try:
        recorder = runtime.recorder
        config = runtime.config
        child = os.getpid() != runtime.pid
        generation = runtime.flight_generation
        record: Dict[str, Any] = {
            "format": FORMAT, "reason": reason, "job": _job_id(config),
            "generation": generation,
            "rank": runtime.rank, "size": runtime.size, "host": socket.gethostname(), "pid": os.getpid(),
            "parent_pid": os.getppid(), "role": "child" if child else "rank",
            "transport": runtime.transport_name,
            "wall_time": time.time(), "monotonic": time.monotonic(),
            "process_sets": {str(i): list(s.ranks) for i, s in list(runtime.sets.items())},
            "collectives_enqueued": recorder.count, "recorder_capacity": recorder.capacity,
            "collectives": [] if child else recorder.snapshot(),
            "coordinator": None if child else _coordinator_view(runtime),
            "dead": None if runtime.dead is None else str(runtime.dead),
            "threads": thread_stacks(),
        }
        path = _write(record, directory(config), generation, runtime.rank)
        # A signalled dump is the launcher's (it prints the verdict) or the user's own request: no warning per rank.
        logger.log(logging.INFO if reason == "SIGUSR1" else logging.WARNING,
                   "Horovod flight recorder dump (%s) written to %s; diagnose with: python -m horovod.doctor %s",
                   reason, path, os.path.dirname(path))
        return path
    except Exception:   # a dump must never break the engine or the user's signal handling
        logger.warning("could not write the Horovod flight recorder dump", exc_info=True)
        return None


def dump_once(runtime: "EngineState", reason: str, key: str) -> Optional[str]:
    """:func:`dump` unless this engine already dumped for ``key`` (a stall is dumped once, not every check)."""
    done = runtime.__dict__.setdefault("_flight_dumped", set())
    if key in done:
        return None
    done.add(key)
    return dump(runtime, reason)


def on_stall_warning(runtime: "EngineState") -> None:
    """The stall inspector (the coordinator's, or the fast lane's on a waiting rank) warned: dump here once, and
    ask the launcher to have every rank dump (it signals them, so ranks stuck outside Horovod dump too)."""
    if dump_once(runtime, "stall warning", "stall-warning"):
        request_all(runtime, "stall warning")


def request_all(runtime: "EngineState", reason: str) -> None:
    """Ask the launcher (through the rendezvous store) to have every rank dump: it signals them, so ranks stuck
    outside Horovod dump too.  Under ``mpirun`` rank 0 is that launcher (:func:`collect_under_mpirun`).  Best
    effort, off the calling thread."""
    if _launched_by(getattr(runtime, "config", None)) == "mpirun":
        collect_under_mpirun(runtime, reason)
        return
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


def announce(runtime: "EngineState", handles_signal: bool) -> None:
    """Tell the launcher where this rank runs (host and pid), so it can watch it, and whether SIGUSR1 makes it dump
    (when the user's program handles SIGUSR1 itself, the launcher must not send it).

    Before ``init()`` returns, not from a thread: a rank that stops itself (SIGSTOP, a debugger) right after a few
    collectives must already be known to the launcher, or the doctor cannot tell it is stopped. One local request
    (about a millisecond)."""
    store = getattr(runtime, "store", None)
    if store is None or not hasattr(store, "put"):
        return
    value = f"{socket.gethostname()}|{os.getpid()}|{int(handles_signal)}".encode()
    try:
        store.put(STORE_SCOPE, f"pid.{runtime.rank}", value)
    except (OSError, ValueError):
        pass   # no launcher listening (mpirun without one, or it is gone): this rank's own dumps still stand


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


# -- collection (the launchers' watch, and rank 0 under mpirun) ----------------------------------------------------

def proc_state(pid: int) -> str:
    """``running``, ``stopped``, ``exited`` (gone or a zombie) from /proc; ``unknown`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError):
        return "unknown"
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(state, "running")


def announced(scope: Mapping[str, bytes]) -> Dict[int, Tuple[str, int, bool]]:
    """rank → (host, pid, whether SIGUSR1 makes it dump), from the store scope the ranks announce in."""
    out = {}
    for key, raw in scope.items():
        if key.startswith("pid."):
            host, pid, handles = (raw.decode(errors="replace").split("|") + ["", "", "0"])[:3]
            try:
                out[int(key[4:])] = (host, int(pid), handles == "1")
            except ValueError:
                continue
    return out


def _is_here(host: str) -> bool:
    return host in (socket.gethostname(), "localhost", "127.0.0.1")


def local_ranks(pids: Mapping[int, Tuple[str, int, bool]], is_local=_is_here) -> Dict[int, int]:
    """rank → pid of the announced ranks on this host that dump on SIGUSR1 (others must not get it)."""
    return {r: pid for r, (host, pid, ours) in pids.items() if ours and is_local(host)}


def _dump_names(where: str) -> List[str]:
    try:
        return [n for n in os.listdir(where) if n.endswith(".json") and n.startswith("g") and "-rank" in n]
    except OSError:
        return []


def dumped_ranks(where: str, since: float = 0.0, generation: Optional[int] = None) -> set:
    """Ranks with a dump of their own (not a child's) in ``where`` written at or after ``since`` (wall clock), of
    ``generation`` when given (``g<generation>-rank<r>-<pid>-<ms>.json``)."""
    ranks = set()
    for name in _dump_names(where):
        match = re.match(r"g(-?\d+)-rank(\d+)-(\d+)-(\d+)\.json$", name)
        if match is None or (generation is not None and int(match.group(1)) != generation):
            continue
        if int(match.group(4)) >= since * 1000:
            ranks.add(int(match.group(2)))
    return ranks


def gather(where: str, targets: Mapping[int, int], generation: Optional[int] = None,
           timeout: float = COLLECT_TIMEOUT_S) -> None:
    """Send ``SIGUSR1`` to the running processes of ``targets`` (rank → pid; this process is skipped: it dumped
    already) and wait, bounded by ``timeout``, until each live one wrote a new dump and no new dump appeared for a
    moment (a rank passes the signal on to its forked children, whose dumps land a little after the rank's)."""
    began = time.time()
    deadline = time.monotonic() + timeout
    for pid in targets.values():
        if pid != os.getpid() and proc_state(pid) == "running":
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
    while time.monotonic() < deadline:
        live = {r for r, pid in targets.items() if pid != os.getpid() and proc_state(pid) == "running"}
        if live <= dumped_ranks(where, began - 1.0, generation):
            break
        time.sleep(_POLL_S)
    count = len(_dump_names(where))
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_S)
        now = len(_dump_names(where))
        if now == count:
            break
        count = now


def process_view(pids: Mapping[int, Tuple[str, int, bool]], exits: Mapping[int, Optional[int]],
                 hosts: Mapping[int, str], is_local=_is_here) -> Dict[str, dict]:
    """rank → {host, pid, state (running / stopped / exited / unknown), returncode, signal}, as
    :data:`LAUNCHER_FILE` records it: ``exits`` (rank → exit status) from the launcher, states of local processes
    from /proc."""
    view = {}
    for rank in sorted(set(pids) | set(exits) | set(hosts)):
        host, pid, _ = pids.get(rank, (hosts.get(rank, ""), None, False))
        info: Dict[str, Any] = {"host": host or hosts.get(rank, ""), "pid": pid, "state": "unknown"}
        if rank in exits:
            code = exits[rank]
            info.update(state="exited", returncode=code)
            if code is not None and code < 0:
                try:
                    info["signal"] = signal.Signals(-code).name
                except ValueError:
                    pass
        elif pid is not None and is_local(host):
            info["state"] = proc_state(pid)
        view[str(rank)] = info
    return view


def write_process_view(where: str, reason: str, view: Mapping[str, dict], generation: Optional[int] = None) -> None:
    """Write :data:`LAUNCHER_FILE` (``generation``: the one the view is of, when the collector knows it)."""
    try:
        with open(os.path.join(where, LAUNCHER_FILE), "w") as handle:
            json.dump({"reason": reason, "ranks": view, "generation": generation}, handle)
    except OSError:
        pass


def collect_under_mpirun(runtime: "EngineState", reason: str) -> None:
    """Under ``mpirun``, rank 0 does what our launchers do: signal the ranks on its host (they announced their pids
    in the store rank 0 serves), wait for their dumps, and log the doctor's verdict on the job's directory.  The
    verdict comes from ``python -m horovod.doctor`` in a child process: the doctor sits above the engine.  Off
    the calling thread, one collection at a time; ranks on other hosts are not signalled (their own dumps on the
    stall error still land there when the directory is shared)."""
    server = getattr(runtime, "rendezvous_server", None)
    if runtime.rank != 0 or server is None:
        return
    try:
        where = directory(runtime.config)
    except OSError as exc:   # not private (UnsafeDirectoryError) or not creatable: no collection, never a crash
        logger.warning("Horovod doctor: no collection: %s", exc)
        return
    busy = runtime.__dict__.setdefault("_mpirun_collecting", threading.Lock())
    if not busy.acquire(blocking=False):
        return   # a collection is running: it covers this request too
    generation = getattr(runtime, "flight_generation", None)

    def run() -> None:
        began = time.monotonic()
        try:
            pids = announced(server.store.scope(STORE_SCOPE))
            gather(where, local_ranks(pids), generation)
            write_process_view(where, f"rank 0 reported a {reason} (mpirun)", process_view(pids, {}, {}),
                               generation)
            done = subprocess.run([sys.executable, "-m", "horovod.doctor", where], capture_output=True, text=True,
                                  timeout=60)
            text = (done.stdout or done.stderr).rstrip()
        except Exception as exc:   # a diagnosis must never break the engine
            text = f"Horovod doctor: no verdict ({exc!r})"
        finally:
            busy.release()
        logger.warning("%s\n  dumps: %s (collected in %.1f s after the %s); rerun: python -m horovod.doctor %s",
                       text, where, time.monotonic() - began, reason, where)

    threading.Thread(target=run, name="horovod-doctor-collect", daemon=True).start()
