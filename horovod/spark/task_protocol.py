"""What the Spark driver and its tasks say to each other through the job's rendezvous store.

Every Spark task of a Horovod job talks only to the driver's authenticated rendezvous store
(:mod:`horovod.transport.rendezvous`); the driver never connects to a task. Keys, by scope:

=================  ===========================  ================================================================
scope              key                          value
=================  ===========================  ================================================================
``spark_task``     task key                     JSON ``{"index", "host", "pid", "attempt"}``: the task started
``spark_beat``     task key                     a counter the task bumps every :data:`BEAT_INTERVAL` seconds
``spark_cmd``      task key                     JSON ``{"command": [...], "env": {...}}``: what the task runs
``spark_kill``     task key                     anything: stop the command (elastic: the driver removed it)
``spark_out``      ``<task key>/<stream>/<n>``  the n-th chunk of the command's stdout/stderr (n from 0)
``spark_exit``     task key                     the command's exit status (negative: killed by that signal)
``spark_abort``    ``job``                      why the driver stops the job; every task stops its command
``spark_attempt``  partition index              elastic: the ``spark_task`` record of the index's latest attempt
=================  ===========================  ================================================================

A static job's task key is its partition index; an elastic job's is its host id (one per task attempt).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, overload

TASK_SCOPE = "spark_task"
BEAT_SCOPE = "spark_beat"
CMD_SCOPE = "spark_cmd"
KILL_SCOPE = "spark_kill"
OUT_SCOPE = "spark_out"
EXIT_SCOPE = "spark_exit"
ABORT_SCOPE = "spark_abort"
ABORT_KEY = "job"
ATTEMPT_SCOPE = "spark_attempt"

#: Seconds between two heartbeats of a task.
BEAT_INTERVAL = 1.0
#: A task whose heartbeat has not changed for this long is taken for lost (its Python worker or executor died).
BEAT_TIMEOUT = 15.0

#: Stand-in for "the task's own Python interpreter" in a command (``executable=None``).
TASK_PYTHON = "{task_python}"

#: Prefix of the host ids of elastic tasks (each task attempt is a host of one slot, as in the original).
ELASTIC_HOST_PREFIX = "spark-task-"


def out_key(task_key: str, stream: str, seq: int) -> str:
    return f"{task_key}/{stream}/{seq}"


def dump(doc: Dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


@overload
def load(raw: bytes) -> Dict[str, Any]: ...
@overload
def load(raw: None) -> None: ...
@overload
def load(raw: Optional[bytes]) -> Optional[Dict[str, Any]]: ...


def load(raw: Optional[bytes]) -> Optional[Dict[str, Any]]:
    """A store document; ``None`` for a key that is not there."""
    return json.loads(raw.decode()) if raw is not None else None


def command_doc(command: List[str], env: Dict[str, str]) -> bytes:
    return dump({"command": list(command), "env": dict(env)})


class HeartbeatWatch:
    """The driver's view of the tasks' heartbeats: which task has been silent for longer than :data:`BEAT_TIMEOUT`."""

    def __init__(self) -> None:
        self._last: Dict[str, tuple] = {}   # task key -> (last counter seen, when it changed)

    def silent(self, store, key: str, now: float) -> bool:
        beat = store.get((BEAT_SCOPE, key))
        last = self._last.get(key)
        if last is None or last[0] != beat:
            self._last[key] = (beat, now)
            return False
        return now - last[1] > BEAT_TIMEOUT
