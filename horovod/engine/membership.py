"""Elastic membership: how a worker learns its rank in the current epoch of an elastic job.

The elastic driver (``horovod.runner.elastic``) and the workers share the rendezvous store, scope ``elastic``:

- ``ready/<worker id>``: a worker that calls ``init()`` writes the last epoch it took part in (``-1`` if none).
- ``assignment``: the driver publishes ``{"epoch": e, "hosts_version": v, "workers": {id: [rank, size,
  local_rank, local_size, cross_rank, cross_size, hostname]}, "removed": [ids]}`` once every worker it wants in
  epoch ``e`` is ready for it (``v``: the ``hosts`` version the epoch already accounts for).
- ``hosts``: ``{"version": v, "removal_only": bool}``, bumped when discovery adds or removes hosts; workers check
  it in ``state.commit()`` / ``check_host_updates()`` and reset together.
- ``abandoned``: ``{"epoch": e, "why": text}``, written when a member of epoch ``e`` exits.  Members still forming
  ``e`` (inside ``init()``, waiting for a peer that will never come) stop waiting (:class:`EpochStore`), announce
  that they left ``e``, and join the next epoch, which the driver publishes as soon as they have.

Every epoch has its own rendezvous scope, so a re-initialised engine never meets stale addresses.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Optional

SCOPE = "elastic"
ABANDONED_KEY = "abandoned"
#: How often a wait inside an epoch being formed looks whether the driver abandoned the epoch (seconds).
ABANDON_POLL_S = 0.25


class RemovedFromJob(RuntimeError):
    """The driver's newest assignment no longer contains this worker (its host was removed)."""


class AssignmentTimeout(TimeoutError):
    """No new epoch placed this worker within the elastic timeout (the driver is waiting for slots, or gone)."""


class EpochAbandoned(RuntimeError):
    """A member of the epoch this worker is joining exited before the epoch formed; the driver publishes the next
    epoch, and ``init()`` joins that one instead of waiting out its timeout."""


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


def abandon_value(epoch: int, why: str) -> bytes:
    """The driver's ``abandoned`` record for ``epoch``."""
    return json.dumps({"epoch": epoch, "why": why}).encode()


class EpochStore:
    """The rendezvous store as seen by a worker forming epoch ``epoch``: a wait for a key (a peer's address) also
    ends, with :class:`EpochAbandoned`, once the driver abandoned the epoch (a member exited: the key may never
    come).  Everything else goes to ``store`` unchanged.

    Args:
        store: the worker's rendezvous client.
        epoch: the epoch being formed.
    """

    def __init__(self, store: Any, epoch: int):
        self._store = store
        self.epoch = epoch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def check_abandoned(self) -> None:
        """Raise :class:`EpochAbandoned` if the driver abandoned this epoch (or a later one)."""
        raw = self._store.try_get(SCOPE, ABANDONED_KEY)
        if raw is None:
            return
        doc = json.loads(raw.decode())
        if int(doc.get("epoch", -1)) >= self.epoch:
            raise EpochAbandoned(f"epoch {self.epoch} of the elastic job was abandoned while it formed: "
                                 f"{doc.get('why', 'a member exited')}; joining the next epoch")

    def get(self, scope: str, key: str, timeout: Optional[float] = None) -> bytes:
        """Wait until ``scope/key`` exists and return it.

        Raises:
            TimeoutError: the key did not appear within ``timeout`` seconds.
            EpochAbandoned: the epoch was abandoned meanwhile.
        """
        timeout = float(getattr(self._store, "timeout", 30.0) if timeout is None else timeout)
        deadline = time.monotonic() + timeout
        checked = time.monotonic()
        delay = 0.002
        while True:
            value = self._store.try_get(scope, key)
            if value is not None:
                return value
            now = time.monotonic()
            if now - checked >= ABANDON_POLL_S or now > deadline:
                self.check_abandoned()
                checked = now
            if now > deadline:
                raise TimeoutError(
                    f"waited {timeout:.0f} s for '{scope}/{key}' at the rendezvous server; another rank of epoch "
                    f"{self.epoch} did not start or did not reach init() (raise --start-timeout if it is slow)")
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 1.5, 0.1)
