"""The jobs of ``collectives.py --hosts N``: N hosts (network namespaces on this machine, one rank each, tcp),
every library launched across them as its users launch it across nodes.

* this project: ``horovodrun -np N -H hostA:1,...`` from the driver's namespace, its own ssh launcher (``--gloo``;
  with mpirun installed horovodrun would otherwise hand a multi-host job to mpirun), ``HOROVOD_TRANSPORT=tcp``;
  the engine and the raw tcp transport beside it, as in the single-host sweep;
* torch.distributed's Gloo: ``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint
  hostA:PORT`` started on every host over ssh (a fresh login's environment: no ``OMP_NUM_THREADS``, no
  ``HOROVOD_*``, nothing bound), the same worker as the single-host Gloo job;
* Open MPI: mpi4py under ``mpirun -np N -H hostA:1,... --bind-to none``, its ssh launcher pointed at the cluster's
  ssh wrapper (``--mca plm_rsh_agent``).

Every job runs under the run's job timeout; what a job leaves on the hosts is killed after it.
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import Dict, List

from benchmarks._collectives.jobs import Runner
from benchmarks._lib import launch, netns

RDZV_PORT = 29400   # torchrun's default c10d port; + the job's number, so no job waits on another's TIME_WAIT


class HostsRunner(Runner):
    """:class:`Runner` whose jobs span the hosts of ``fake`` (a ``NetnsCluster`` up with one rank per host)."""

    def __init__(self, args, tmp: str, script: str, fake):
        super().__init__(args, tmp, script)
        self.fake = fake
        self.names: List[str] = list(fake.hosts)
        self.host_list = ",".join(f"{h}:1" for h in self.names)

    # ------------------------------------------------------------------------------------------------ header
    def header(self) -> Dict[str, str]:
        """The run header's lines about the hosts."""
        f = self.fake
        hosts = ", ".join(f"{h.name} {h.addr}" for h in f.hosts.values())
        return {"hosts": (f"{len(self.names)} hosts, one rank each: network namespaces on this machine ({hosts}), "
                          f"each with its own host name and sshd, on a bridge with the driver's namespace "
                          f"({f.driver_addr}), where every launcher runs; the hosts share this machine's "
                          f"{os.cpu_count()} cores and memory, the data goes over veth pairs (tcp)")}

    def engine_transports(self) -> str:
        """What ``hvd.init`` chose in each job (its ``engine_transport_<job>`` records)."""
        seen = sorted({v for r in self.records if r.get("kind") == "meta"
                       for k, v in r.items() if k.startswith("engine_transport_")})
        return ", ".join(seen) or "not recorded"

    def _note(self, what: str, cmd: List[str], note: str) -> None:
        """Remember how ``what`` was launched, as its user types it: the spec file as SPEC, the cluster's directory
        (its key, its ssh wrapper) as CLUSTER (the launchers run in the driver's namespace: ``note`` says so)."""
        if what not in self.launches:
            where = str(self.fake.dir)
            shown = ["SPEC" if a.startswith(self.tmp) else os.path.relpath(a) if a == self.script
                     else a.replace(where, "CLUSTER") for a in cmd]
            self.launches[what] = f"`{shlex.join(shown)}` ({note})"

    def _run_cleaning(self, label: str, cmd: List[str], env: Dict[str, str], out: str, marker: str,
                      start=None) -> bool:
        try:
            return self.run(label, cmd, env, out, self.args.job_timeout, start)
        finally:
            killed = netns.kill_leftovers(self.fake, marker)
            if killed:
                self.log(f"{label}: killed {len(killed)} process(es) it left on the hosts")

    # -------------------------------------------------------------------------------------------------- jobs
    def hvd_job(self, np_: int, transport: str, phases: List[str], rep: int = 0, torch: bool = False) -> None:
        label = f"{np_} hosts horovodrun {transport} rep {rep}"
        path, out = self._spec(kind="hvd", job=label, transport=transport, torch=torch, phases=phases, rep=rep,
                               **self.common())
        cmd = launch.horovodrun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                    ["-H", self.host_list, "--gloo", *self.fake.ssh_flags(), "--disable-cache",
                                     "--start-timeout", "120"])
        self._note(f"this project, {transport}", cmd,
                   f"HOROVOD_TRANSPORT={transport}; from the driver's namespace, ssh to each host; --gloo: "
                   f"horovodrun's own launcher, not mpirun")
        env = self.fake.env(launch.repo_env({"HOROVOD_TRANSPORT": transport}))
        self._run_cleaning(label, self.fake.in_driver(cmd), env, out, path)

    def gloo_job(self, np_: int, phases: List[str], rep: int = 0) -> None:
        label = f"{np_} hosts torchrun gloo rep {rep}"
        path, out = self._spec(kind="gloo", job=label, phases=phases, rep=rep, **self.common())
        per_host = self.gloo_cmd(np_, path)
        # a fresh login's environment on each host, plus the checkout on the path (as torchrun_env gives)
        extra = {"PYTHONPATH": launch.REPO, "PYTHONUNBUFFERED": "1"}
        cmds = [netns.ssh_argv(self.fake, host, per_host, extra) for host in self.names[:np_]]
        self._note("torch Gloo", per_host,
                   f"on every host, over ssh from the driver's namespace, in a fresh login's environment "
                   f"+ {' '.join(f'{k}={v}' for k, v in extra.items())}: no OMP_NUM_THREADS, no HOROVOD_*, "
                   f"no binding")
        env = self.fake.env(dict(os.environ))   # the local ssh clients' only
        timeout = self.args.job_timeout
        self._run_cleaning(label, cmds[0], env, out, path,
                           start=lambda: launch.run_commands(cmds, [env] * len(cmds), timeout))

    def gloo_cmd(self, np_: int, spec_path: str) -> List[str]:
        """The command every host runs for the Gloo peer's job (hostA holds the c10d rendezvous)."""
        return launch.torchrun_nodes_cmd(np_, f"{self.names[0]}:{RDZV_PORT + self.seq}", f"bench{self.seq}",
                                         [self.script, "--worker", spec_path])

    def openmpi_job(self, np_: int, phases: List[str], rep: int = 0) -> None:
        label = f"{np_} hosts mpirun openmpi rep {rep}"
        path, out = self._spec(kind="openmpi", job=label, phases=phases, rep=rep, **self.common())
        agent = " ".join([str(self.fake.bin / "ssh"), *netns.ssh_options(self.fake)])
        cmd = launch.mpirun_cmd(np_, [sys.executable, self.script, "--worker", path],
                                ["-H", self.host_list, *shlex.split(self.args.mpirun_args),
                                 "--mca", "plm_rsh_agent", agent])
        cmd = [a for a in cmd if a != "--oversubscribe"]   # one slot per host: never oversubscribed
        self._note("Open MPI (mpi4py)", cmd, "from the driver's namespace")
        self._run_cleaning(label, self.fake.in_driver(cmd), self.fake.env(launch.mpi_env()), out, path)
