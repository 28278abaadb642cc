"""The local stand-in of one elastic worker that runs in a Spark task: ``python -m horovod.spark.elastic_proxy ARGV``.

The elastic driver (:class:`horovod.runner.elastic.driver.ElasticDriver`) starts, watches and stops local
processes. For a worker that lives in a Spark task, the ``spark`` starter (:mod:`horovod.spark.elastic`) starts
this proxy instead, with the worker's command line and environment. It runs them in the task named by
``HOROVOD_HOSTNAME`` through a :class:`~horovod.spark.task_proxy.TaskProxy`: output, exit status, SIGTERM and
the loss of the task behave as for a local worker.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import horovod.spark.task_protocol as proto
from horovod.engine import config
from horovod.spark.task_proxy import LOST_EXIT, TaskProxy
from horovod.transport.rendezvous import RendezvousClient


def main(argv: Optional[Sequence[str]] = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m horovod.spark.elastic_proxy <worker command...> (started by the elastic driver)",
              file=sys.stderr)
        return 2
    env = dict(config.environ())
    topo = config.topology_from_env(env)
    key = env.get("HOROVOD_HOSTNAME", "")
    if (topo.secret is None or not topo.rendezvous_addr or topo.rendezvous_port is None
            or not key.startswith(proto.ELASTIC_HOST_PREFIX)):
        print("horovod.spark.elastic_proxy: started without the job's environment (secret, rendezvous address, "
              "a Spark task's HOROVOD_HOSTNAME); the elastic driver of horovod.spark.run_elastic starts it",
              file=sys.stderr)
        return 2
    proxy = TaskProxy(RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret), key)
    proxy.install_signal_handlers()
    try:
        return proxy.run(command, env)
    except (OSError, PermissionError) as exc:
        print(f"horovod.spark.elastic_proxy: lost the driver's store: {exc}", file=sys.stderr)
        return LOST_EXIT


if __name__ == "__main__":
    sys.exit(main())
