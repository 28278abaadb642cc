"""Elastic membership: how a worker learns its rank in the current epoch of an elastic job.

The elastic driver (``horovod.runner.elastic``) and the workers share the rendezvous store, scope ``elastic``:

- ``ready/<worker id>``: a worker that calls ``init()`` writes the last epoch it took part in (``-1`` if none).
- ``assignment``: the driver publishes ``{"epoch": e, "hosts_version": v, "workers": {id: [rank, size,
  local_rank, local_size, cross_rank, cross_size, hostname]}, "removed": [ids]}`` once every worker it wants in
  epoch ``e`` is ready for it (``v``: the ``hosts`` version the epoch already accounts for).
- ``hosts``: ``{"version": v, "removal_only": bool}``, bumped when discovery adds or removes hosts; workers check
  it in ``state.commit()`` / ``check_host_updates()`` and reset together.

Every epoch has its own rendezvous scope, so a re-initialised engine never meets stale addresses.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

SCOPE = "elastic"


class RemovedFromJob(RuntimeError):
    """The driver's newest assignment no longer contains this worker (its host was removed)."""


class AssignmentTimeout(TimeoutError):
    """No new epoch placed this worker within the elastic timeout (the driver is waiting for slots, or gone)."""


@dataclass(frozen=True)
class Assignment:
    epoch: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    hosts_version: int = 0


def announce_ready(store, worker_id: str, last_epoch: int) -> None:
    store.put(SCOPE, f"ready/{worker_id}", str(last_epoch).encode())


def wait_for_assignment(store, worker_id: str, last_epoch: int, timeout: float,
                        poll_interval: float = 0.05) -> Assignment:
    """Announce readiness and block until an epoch newer than ``last_epoch`` assigns this worker a rank.

    Raises:
        RemovedFromJob: a newer epoch exists that leaves this worker out.
        AssignmentTimeout: no new epoch within ``timeout`` seconds (the message says what the driver last
            published).
    """
    announce_ready(store, worker_id, last_epoch)
    deadline = time.monotonic() + timeout
    seen: Optional[dict] = None
    while True:
        raw = store.try_get(SCOPE, "assignment")
        if raw is not None:
            seen = json.loads(raw.decode())
            if seen["epoch"] > last_epoch:
                slot = seen["workers"].get(worker_id)
                if slot is None:
                    if seen.get("final", False) or worker_id in seen.get("removed", []):
                        raise RemovedFromJob(f"worker {worker_id} has been removed from elastic job "
                                             f"(epoch {seen['epoch']})")
                else:
                    rank, size, local_rank, local_size, cross_rank, cross_size, hostname = slot
                    return Assignment(seen["epoch"], rank, size, local_rank, local_size, cross_rank, cross_size,
                                      hostname, int(seen.get("hosts_version", 0)))
        if time.monotonic() > deadline:
            last = f"epoch {seen['epoch']} with workers {sorted(seen['workers'])}" if seen else "nothing"
            raise AssignmentTimeout(
                f"elastic worker {worker_id} waited {timeout:.0f} s for a new assignment after epoch {last_epoch}; "
                f"the driver last published {last}. Too few slots may be available (see --min-np and "
                f"--elastic-timeout).")
        time.sleep(poll_interval)


def hosts_version(store) -> dict:
    """The driver's host-change counter: ``{"version": int, "removal_only": bool}``."""
    raw = store.try_get(SCOPE, "hosts")
    if raw is None:
        return {"version": 0, "removal_only": False}
    return json.loads(raw.decode())
