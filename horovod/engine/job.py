"""What ties one engine to its job: the job's services, this rank's view of a process set, and the one error a
forked child gets."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from horovod.engine.errors import HorovodInternalError
from horovod.transport.base import Transport


def forked_error() -> HorovodInternalError:
    return HorovodInternalError(
        f"Horovod was initialized in the parent process (pid {os.getppid()}) before this process (pid "
        f"{os.getpid()}) was forked; a forked child cannot use the parent's engine, and using it would break the "
        f"parent's job. Run collectives in the process that called hvd.init(), or start worker processes before "
        f"hvd.init() (or with the 'spawn' start method) and let each call hvd.init() as a rank of its own job.")


@dataclass(frozen=True)
class JobLinks:
    """What ties an engine to the job that started it; each is optional (a job of one process has none)."""

    store: Any = None               # the rendezvous store: culprit reports, elastic host-update checks
    epoch: Any = None               # the elastic epoch this engine belongs to
    rendezvous_server: Any = None   # served by rank 0 itself under mpirun; stopped with the engine
    mpi_comm: Any = None            # the communicator under mpirun


class ProcessSetInfo:
    """A registered process set as this rank sees it."""

    def __init__(self, set_id: int, ranks: Sequence[int], transport: Optional[Transport]):
        self.id = set_id
        self.ranks = tuple(sorted(ranks))
        self.transport = transport

    def included(self, rank: int) -> bool:
        return rank in self.ranks


#: The links of an engine that no launcher started (a job of one process).
NO_JOB = JobLinks()
