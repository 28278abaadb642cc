"""How many CPU threads each worker's math libraries may use when the user did not say.

Several workers on one host each start OpenMP/MKL/torch pools sized for the whole machine, and then fight over
the cores: on 2 cores, two ranks of the original PyTorch synthetic benchmark ran about 2.7x faster with
``OMP_NUM_THREADS=1`` than with torch's default. Like ``torchrun``, the launcher therefore sets
``OMP_NUM_THREADS`` (which torch's intra-op pool follows) to the host's cores divided among its workers, unless the
user set it, and says so once. Remote hosts are assumed to have as many cores as the launcher's.

For the same reason it asks each worker to bind itself to its share of the cores (HOROVOD_BIND_CORES, see
:mod:`horovod.transport.cpus`) unless the user said otherwise; a worker works its share out on its own host.
"""
from __future__ import annotations

import logging
from typing import MutableMapping

from horovod.transport.cpus import usable_cpus

logger = logging.getLogger(__name__)

_announced = False


def default_omp_threads(local_size: int) -> int:
    """Cores per worker when ``local_size`` workers share a host (at least 1)."""
    return max(1, usable_cpus() // max(1, local_size))


def set_worker_threads(env: MutableMapping[str, str], local_size: int) -> None:
    """Set ``OMP_NUM_THREADS`` and ``HOROVOD_BIND_CORES`` in a worker's environment unless they are already
    there (then the user's values win).

    Binding is asked for only when the worker's threads fit its share: a user who set more OMP threads than
    ``cores // local_size`` keeps every core."""
    global _announced
    share = default_omp_threads(local_size)
    if "HOROVOD_BIND_CORES" not in env:
        try:
            fits = int(env.get("OMP_NUM_THREADS", share)) <= share
        except ValueError:
            fits = False
        env["HOROVOD_BIND_CORES"] = "1" if fits else "0"
    if "OMP_NUM_THREADS" in env:
        return
    env["OMP_NUM_THREADS"] = str(share)
    if not _announced:
        _announced = True
        logger.warning("Setting OMP_NUM_THREADS=%d for each process (%d cores / %d processes per host) to keep "
                       "their thread pools from competing for the cores; set OMP_NUM_THREADS yourself to choose "
                       "another value.", share, usable_cpus(), max(1, local_size))
