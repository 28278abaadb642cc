"""Remember successful host checks (ssh reachability, the launcher's address) for an hour.

Stored as JSON in ``~/.horovod/launcher-checks.json``.  Only successes are cached: a failed check is always
repeated, so fixing a host takes effect at once.  ``--disable-cache`` neither reads nor writes the file.  A
corrupt or unreadable file is treated as empty; writes go through a temporary file and a rename so concurrent
launchers never see half a file.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

#: How long a successful check stays valid (the original's 60 minutes).
STALENESS_SECONDS = 60 * 60
FILE_NAME = "launcher-checks.json"


def default_directory() -> str:
    """``~/.horovod``."""
    return os.path.join(os.path.expanduser("~"), ".horovod")


def make_key(*parts: Any) -> str:
    """A stable key from the parameters a check depends on (host, port, identity file, ...)."""
    return json.dumps(list(parts), default=str)


class CheckCache:
    """A small persistent map of ``key → value`` whose entries expire.

    Args:
        directory: where the file lives (``~/.horovod`` by default).
        enabled: False turns every method into a no-op (``--disable-cache``).
        staleness: seconds an entry stays valid.
        clock: wall-clock source (tests pass a fake one).
    """

    def __init__(self, directory: Optional[str] = None, enabled: bool = True,
                 staleness: float = STALENESS_SECONDS, clock: Callable[[], float] = time.time):
        self.directory = directory or default_directory()
        self.path = os.path.join(self.directory, FILE_NAME)
        self.enabled = enabled
        self.staleness = staleness
        self.clock = clock

    def _load(self) -> Dict[str, Dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> Any:
        """The value stored under ``key`` if it is younger than the staleness limit, else None."""
        if not self.enabled:
            return None
        entry = self._load().get(key)
        if not isinstance(entry, dict) or "time" not in entry:
            return None
        age = self.clock() - float(entry["time"])
        if age < 0 or age > self.staleness:
            return None
        return entry.get("value")

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key`` with the current time (best effort: failures are only logged)."""
        self.put_many({key: value})

    def put_many(self, items: Dict[str, Any]) -> None:
        if not self.enabled or not items:
            return
        now = self.clock()
        data = self._load()
        # Drop expired entries so the file does not grow without bound.
        data = {k: v for k, v in data.items()
                if isinstance(v, dict) and 0 <= now - float(v.get("time", 0)) <= self.staleness}
        for key, value in items.items():
            data[key] = {"time": now, "value": value}
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".checks-", dir=self.directory)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.info("cannot write the host check cache %s: %s", self.path, exc)

    def forget(self, keys: Sequence[str]) -> None:
        """Remove entries (e.g. a cached address that no longer exists)."""
        if not self.enabled:
            return
        data = self._load()
        if any(k in data for k in keys):
            for key in keys:
                data.pop(key, None)
            try:
                with open(self.path, "w", encoding="utf-8") as handle:
                    json.dump(data, handle)
            except OSError:
                pass


__all__ = ["CheckCache", "make_key", "STALENESS_SECONDS", "default_directory"]
