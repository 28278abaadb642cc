"""Exceptions every binding shares; typed so that no caller has to branch on message text.

They live in the engine, the lowest layer that raises them; :mod:`horovod.common.exceptions` is their public
name (the original's import path).
"""
from __future__ import annotations

from typing import Optional

#: What a collective issued after the engine went down says (the original's text).
SHUTDOWN_MESSAGE = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt "
                    "to allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the "
                    "shutdown was caused by an exception, you should see the exception in the log before the first "
                    "shutdown message.")

#: The stall inspector's warning (the original's text; scripts and log monitors look for it), with one line per
#: waiting collective: the coordinator's and the fast lane's alike.
STALL_WARNING = ("One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and "
                 "are waiting for remainder of ranks for more than %d seconds. This may indicate that different "
                 "ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, "
                 "which will cause deadlock.\nMissing ranks:\n%s")


class HorovodInternalError(RuntimeError):
    """A collective failed on this or another rank (peer died, mismatch, shutdown).

    In elastic training this triggers a restore of the last committed state and a reset.
    """


class InvalidArgumentError(ValueError, RuntimeError):
    """A collective's arguments are invalid on this rank (unsupported op, bad shape, root or splits).

    Both a ``ValueError`` (what it is) and a ``RuntimeError`` (what Horovod 0.28.1's core raised for these), so
    ``except ValueError`` and ``except RuntimeError`` in user code both keep working.
    """


class NameInFlightError(ValueError):
    """This rank already has a collective of that name in progress (a ``ValueError``, as Horovod 0.28.1 raised).

    A blocking call that meets it waits for that collective and runs as the next one of the name
    (:mod:`horovod.engine.collectives`); an asynchronous call gets it.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; elastic training resets without restoring.

    Args:
        skip_sync: True when hosts were only removed, so surviving state needs no re-broadcast.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class MismatchError(HorovodInternalError):
    """Ranks disagreed about a collective (dtype, shape, op, root, scale factors, process set)."""


class ShutdownError(HorovodInternalError):
    """The engine was shut down while the collective was pending."""


class PeerFailureError(HorovodInternalError):
    """A peer process died, closed its connection or timed out during a collective.

    Attributes:
        culprit: the global rank that failed, when this rank saw it directly (None when relayed or unknown).
    """

    def __init__(self, message: str = "", culprit: Optional[int] = None):
        super().__init__(message)
        self.culprit = culprit


class StallError(HorovodInternalError):
    """A collective waited longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS for missing ranks."""


class HorovodVersionMismatchError(ImportError):
    """The framework installed differs from the one this package was checked against."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    return (f"Framework {name} installed with version {installed_version} but found version {version}. "
            f"This can result in unexpected behavior including runtime errors. "
            f"Reinstall the framework binding against the framework version in use.")
