"""Reading a dump directory: the ranks' JSON dumps (see :mod:`horovod.engine.flight_dump`) and the launcher's view.

A directory may hold several jobs (outside horovodrun every job shares ``<tmp>/horovod-flight-recorder``) and, in
elastic jobs, several generations; :func:`load` picks the newest generation of the newest job (or the generation
asked for).  A rank may have
dumped more than once (the stall warning, then the stall error or the failure); its *first* dump of that
generation is the one read, because it caught the hang as it began, before errors unwound the stacks.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

#: Written by the launcher next to the ranks' dumps: ``{"ranks": {rank: {host, pid, state, returncode}}}`` (and
#: ``"generation"`` when the collector knew it: its view of the ranks is of that generation only).
LAUNCHER_FILE = "launcher.json"


class DumpDirectoryError(ValueError):
    """The directory holds no readable dump."""


@dataclass
class Job:
    """One job generation's dumps.

    Attributes:
        size: ranks in the job.
        ranks: rank → its dump (a dict as written by the engine).
        children: rank → dumps of processes it forked (data-loader workers) that answered the signal.
        launcher: rank → what the launcher knows (host, pid, state: running / stopped / exited, returncode).
        generation: elastic generation (or init count) of these dumps.
    """

    size: int
    ranks: Dict[int, Dict[str, Any]]
    children: Dict[int, List[Dict[str, Any]]] = field(default_factory=dict)
    launcher: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    generation: int = 0


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "rank" in data and "threads" in data else None


def load(directory: str, latest: bool = False, generation: Optional[int] = None) -> Job:
    """The newest job generation in ``directory``.

    Args:
        latest: read each rank's last dump instead of its first.
        generation: read this generation (an elastic job's earlier epoch) of the newest job that has it.

    Raises:
        DumpDirectoryError: no dump there (of ``generation``, when given).
    """
    if not os.path.isdir(directory):
        raise DumpDirectoryError(f"{directory!r} is not a directory (pass the dump directory horovodrun printed, "
                                 f"or HOROVOD_FLIGHT_RECORDER_DIR)")
    dumps = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json") and name != LAUNCHER_FILE and not name.startswith(".partial-"):
            data = _read(os.path.join(directory, name))
            if data is not None:
                dumps.append(data)
    if not dumps:
        raise DumpDirectoryError(f"no Horovod flight recorder dumps in {directory!r}: ranks write them on a stall "
                                 f"warning, a stall or peer failure, SIGUSR1 or hvd.dump_flight_recorder()")
    if generation is not None:
        dumps = [d for d in dumps if d.get("generation") == generation]
        if not dumps:
            raise DumpDirectoryError(f"no dumps of generation {generation} in {directory!r} (each dump's file name "
                                     f"starts with g<generation>-)")
    newest = max(dumps, key=lambda d: d.get("wall_time", 0))
    key = (newest.get("job"), newest.get("generation"))
    chosen = sorted((d for d in dumps if (d.get("job"), d.get("generation")) == key),
                    key=lambda d: d.get("wall_time", 0), reverse=latest)
    ranks: Dict[int, Dict[str, Any]] = {}
    children: Dict[int, List[Dict[str, Any]]] = {}
    for d in chosen:
        if d.get("role") == "child":
            kids = children.setdefault(int(d["rank"]), [])
            if all(k.get("pid") != d.get("pid") for k in kids):   # a child's first dump, like a rank's
                kids.append(d)
        else:
            ranks.setdefault(int(d["rank"]), d)
    launcher = {}
    try:
        with open(os.path.join(directory, LAUNCHER_FILE)) as handle:
            view = json.load(handle)
        if view.get("generation") in (None, key[1]):   # another epoch's view names other processes
            launcher = {int(r): info for r, info in view.get("ranks", {}).items()}
    except (OSError, ValueError, AttributeError):
        pass
    size = max([int(newest.get("size", 0))] + [r + 1 for r in launcher])
    return Job(size=size, ranks=ranks, children=children, launcher=launcher, generation=key[1] or 0)
