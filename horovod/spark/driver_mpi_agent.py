"""mpirun's remote-shell agent for ``horovod.spark.run(use_mpi=True)``: ``python -m horovod.spark.driver_mpi_agent
HOST COMMAND``.

mpirun (Open MPI's ``plm_ssh_agent``) calls it the way it would call ``ssh``: to start its daemon on ``HOST``.
Here ``HOST`` is a Spark host id, and the daemon runs in the first Spark task on that host
(``HOROVOD_SPARK_MPI_TASKS`` maps host ids to task keys) through a :class:`~horovod.spark.task_proxy.TaskProxy`.
The daemon then starts that host's ranks as its children, inside the task, as the original did.
"""
from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from horovod.engine import config
from horovod.spark.task_proxy import LOST_EXIT, TaskProxy
from horovod.transport.rendezvous import RendezvousClient

TASKS_ENV = "HOROVOD_SPARK_MPI_TASKS"
#: mpirun's own variables: the daemon's command line exports what it needs, the rest describes the launcher.
_LAUNCHER_PREFIXES = ("PMIX_", "PRTE_", "OMPI_", "OPAL_", "HYDRA_", "PMI_")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(config.environ())
    topo = config.topology_from_env(env)
    if (len(args) < 2 or topo.secret is None or not topo.rendezvous_addr or topo.rendezvous_port is None
            or TASKS_ENV not in env):
        print("usage: python -m horovod.spark.driver_mpi_agent <host> <command> (mpirun's remote-shell agent "
              "for horovod.spark.run(use_mpi=True), which sets its environment)", file=sys.stderr)
        return 2
    host, command = args[0], " ".join(args[1:])
    key = json.loads(env[TASKS_ENV]).get(host)
    if key is None:
        print(f"horovod.spark.driver_mpi_agent: mpirun asked for host {host!r}, which runs no task of this job",
              file=sys.stderr)
        return LOST_EXIT
    task_env = {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES) and k != TASKS_ENV}
    proxy = TaskProxy(RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret), key)
    proxy.install_signal_handlers()
    try:
        return proxy.run(["/bin/sh", "-c", command], task_env)
    except (OSError, PermissionError) as exc:
        print(f"horovod.spark.driver_mpi_agent: lost the driver's store: {exc}", file=sys.stderr)
        return LOST_EXIT


if __name__ == "__main__":
    sys.exit(main())
