"""Data-plane speed: this project's collectives next to torch.distributed (Gloo) and Open MPI, in one command.

Usage::

    python benchmarks/collectives.py                  # np = 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/collectives.py --quick          # smoke run: 5 sizes, 3 rounds, 500 latency calls
    python benchmarks/collectives.py --max 256M       # the ladder up to 256 MiB (the numbers for the record)
    python benchmarks/collectives.py --out results.md --json results.json
    python benchmarks/collectives.py --np 2 --ops allreduce --sizes 1M,64M --skip memory,fusion
    python benchmarks/collectives.py --quick --chart docs/images/collectives.png   # + collectives-latency.png
    python benchmarks/collectives.py --hosts 4        # across 4 network-namespace hosts, one rank each (root)

Duration on the 2-core development machine (measured before the peers got jobs of their own and ``--reps``; a
run now takes about ``--reps`` times as long): ``--quick`` about 1 minute when it is quiet and 2.5 minutes at load
5; the default about 5.5 minutes at load 5; ``--max 256M`` about 15 minutes at load 6-10.  Open MPI's busy polling
is what a loaded machine slows down most (at load 5, an np = 2 ``Allgather`` took exactly 8 ms per call at every
size), so take the numbers for the record on a quiet machine and keep the load average line of the header.

What is measured (float32, sum where there is a reduction):

* allreduce, allgather, broadcast, alltoall and reducescatter at sizes 4 KiB .. ``--max``, at np = 2 and 4, for
  this project's transports called directly (``tcp``, ``shm``, and ``mpi`` under ``mpirun``), for the full engine
  (``horovod.numpy`` collectives: negotiation, fusion buffer and background thread included) over each of them,
  for ``torch.distributed`` with the Gloo backend, and for mpi4py on Open MPI (each peer in jobs of its own).
  The size is the nccl-tests size: the whole buffer (allgather: the gathered output, reducescatter: the input,
  alltoall: one rank's send buffer).
  Reported: median time per call (each sample is the slowest rank's mean over a batch of calls timed between
  barriers), algbw = size / time, busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (allgather, reducescatter,
  alltoall) or 1 (broadcast).  Implementations that share a job (this project's engine and raw transport) are
  measured in alternating order, one batch each per round, so machine noise hits them alike.  Every
  implementation's result is checked once against numpy at every size before it is timed; a wrong result is
  reported as WRONG, never as a speed.
* the numpy copy ceiling: ``np.copyto`` on one core at the same sizes.
* latency of one 8-byte allreduce at every world size (median and p90 per call, engine negotiation included).
* tensor fusion: 1,000 allreduces of 4 KiB issued asynchronously then synchronized, with the default
  ``HOROVOD_FUSION_THRESHOLD`` and with 0 (alternating re-initialisations of the engine inside one job).
* memory: peak RSS per rank during a 64 MiB allreduce, minus the RSS before it (the tensor is already
  allocated then) and minus a result array the call allocates, in fresh processes.

Jobs: every library is launched as its own users launch it, in jobs of its own. This project: ``horovodrun -np
N`` with ``HOROVOD_TRANSPORT=shm`` (the engine, a second independent shm transport beside it, and horovod.torch's
allocation of new results), ``horovodrun`` with ``HOROVOD_TRANSPORT=tcp``, and ``mpirun -np N --bind-to none``
on its mpi transport. torch.distributed's Gloo: ``torchrun --standalone --nproc-per-node N`` (no core binding;
torchrun's own ``OMP_NUM_THREADS=1``; nothing of this project imported). Open MPI: mpi4py under ``mpirun -np N
--bind-to none`` (``--oversubscribe`` above the core count), nothing of this project imported. (Until issue 35
Gloo ran inside this project's horovodrun job, whose core binding made it 13–22× slower at 4 KiB than under
torchrun: every "× Gloo" of that time is withdrawn.) Per world size, ``--reps`` repetitions (3; quick 2) of every
job run one after another, the order rotated each repetition so machine drift hits every library alike; the
tables give medians over repetitions, and each ratio against a peer is the median (min–max) of the ratios within
one repetition. The run header records each launcher's command line, the CPU, and the CPUs and threads every
job's ranks were given. Memory in fresh two-rank jobs at the end. Every job runs under a timeout that kills its
whole process group; a failed job is named in the notes and the other jobs' numbers are still printed. The
targets (``benchmarks/targets.py``) compare the engine on the single-host default transport (shm). The parts:
``benchmarks/_collectives/`` (cases, implementations, phases, jobs, report).

Across hosts, ``--hosts N`` (2..8): N real hosts on this machine, one rank each, brought up for the run and always
torn down: the multi-host tests' network namespaces (``tests/runner/netns/cluster.py``, loaded by
``benchmarks/_lib/netns.py``: own address 10.200.0.x, host name and sshd per host on a bridge; the launchers run in
a driver namespace of their own). Needs root, ``ip`` and ``sshd``; elsewhere it exits with status 2 and the reason.
np = N; the sweep, latency (and at N = 2 fusion) phases as above; no shm, no memory jobs, no wake-up probe, no
mpi-transport job. The jobs (``benchmarks/_collectives/hosts.py``), one per library per repetition, rotated:
``horovodrun -np N -H hostA:1,... --gloo -p 2222 -i KEY`` with ``HOROVOD_TRANSPORT=tcp`` (the engine and the raw
tcp transport; ``--gloo`` is horovodrun's own ssh launcher, which it would otherwise trade for mpirun across
hosts; the transport ``hvd.init`` chose is recorded); ``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d
--rdzv-endpoint hostA:PORT`` started on every host over ssh in a fresh login's environment (no OMP_NUM_THREADS, no
HOROVOD_*, no binding); mpi4py under ``mpirun -np N -H hostA:1,... --bind-to none --mca plm_rsh_agent '<ssh
wrapper> ...'``. What a job leaves on the hosts is killed after it. The report names the hosts, each launcher's
command line and every rank's host; its targets are those for ``hosts=N`` in ``benchmarks/targets.py``. The hosts
share this machine's cores and memory and the data crosses veth pairs: the tcp paths and launchers across hosts
are measured, not a real network.
"""
from __future__ import annotations

import os
import shutil
import sys
import functools
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._collectives import cli, probes  # noqa: E402
from benchmarks._collectives.cases import OPS  # noqa: E402
from benchmarks._collectives.jobs import Runner  # noqa: E402
from benchmarks._collectives.phases import rotate  # noqa: E402
from benchmarks._collectives.render import TITLE, render  # noqa: E402
from benchmarks._collectives.results import Results  # noqa: E402
from benchmarks._lib.launch import describe_placement  # noqa: E402
from benchmarks._lib.measure import MIB  # noqa: E402
from benchmarks._lib.report import header, version  # noqa: E402
from benchmarks.targets import for_run  # noqa: E402

SCRIPT = os.path.abspath(__file__)
PARTS = "sweep,latency,fusion,memory,memcpy,gloo,mpi,tcp,shm"


def main(argv: Optional[Sequence[str]] = None) -> int:
    if cli.rank_entry(argv):
        return 0
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_sweep_args(ap, ",".join(OPS))
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip: {PARTS}")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions of every job, interleaved (3; quick 2): medians and spread over them")
    ap.add_argument("--hosts", type=int, default=0, metavar="N",
                    help="across N hosts (2..8): network namespaces on this machine, one rank each, tcp; this "
                         "project under horovodrun -H, Gloo under torchrun --nnodes N on every host, Open MPI under "
                         "mpirun -H (needs root, ip and sshd; see the docstring)")
    args = ap.parse_args(argv)
    if args.hosts:
        if not 2 <= args.hosts <= 8:
            ap.error("--hosts: 2 to 8")
        if args.np and args.np != [args.hosts]:
            ap.error("--hosts N runs np = N (one rank per host); leave --np out")
        args.np = [args.hosts]
    cli.resolve_sweep_args(ap, args)
    args.reps = max(1, args.reps or (2 if args.quick else 3))
    if args.chart_from:
        return cli.redraw(args, TITLE)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(PARTS.split(","))
    if unknown:
        ap.error(f"--skip: unknown part(s) {sorted(unknown)}; choose from {PARTS}")

    if args.hosts:  # tcp across hosts: no shared memory, no memory jobs (single-host np = 2)
        skip |= {"shm", "memory"}
    transports = [t for t in ("shm", "tcp") if t not in skip and (t != "shm" or probes.shm_available())]
    primary = transports[0] if transports else "shm"
    mpi_missing = probes.mpi_available() if "mpi" not in skip else "skipped (--skip mpi)"
    gloo = "gloo" not in skip and version("torch") is not None
    info = header(argv)
    tmp = tempfile.mkdtemp(prefix="hvd-bench-")  # job specs and their JSON-lines results
    try:
        if args.hosts:
            return _drive_hosts(args, tmp, info, transports, primary, mpi_missing, gloo, skip)
        return _drive(args, tmp, info, transports, primary, mpi_missing, gloo, skip)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drive_hosts(args, tmp: str, info: Dict[str, str], transports: List[str], primary: str,
                 mpi_missing: Optional[str], gloo: bool, skip: set) -> int:
    """``--hosts N``: the namespace hosts up (always torn down after), then :func:`_drive` with their runner."""
    from benchmarks._collectives.hosts import HostsRunner
    from benchmarks._lib import netns

    if not transports:
        print("--hosts measures this project on tcp: do not --skip tcp", file=sys.stderr)
        return 2
    try:
        unavailable = netns.fixture().ClusterUnavailable
    except FileNotFoundError as exc:
        print(f"--hosts: {exc}", file=sys.stderr)
        return 2
    try:
        with netns.cluster(args.hosts) as fake:
            runner = HostsRunner(args, tmp, SCRIPT, fake)
            info.update(runner.header())
            return _drive(args, tmp, info, transports, primary, mpi_missing, gloo, skip, runner)
    except unavailable as exc:
        print(f"--hosts: no network-namespace hosts on this machine: {exc}", file=sys.stderr)
        return 2


def _drive(args, tmp: str, info: Dict[str, str], transports: List[str], primary: str,
           mpi_missing: Optional[str], gloo: bool, skip: set, runner: Optional[Runner] = None) -> int:
    """Run every job, then print (and write) the report; 1 when a job failed. ``runner``: the jobs' (default: on
    this host; ``--hosts``: across the namespace hosts)."""
    q = args.quick
    runner = runner or Runner(args, tmp, SCRIPT)
    hosts = getattr(runner, "fake", None) is not None
    memcpy = {} if "memcpy" in skip else probes.memcpy_ceiling(args.sizes, args.rounds, args.sample_ms / 1000.0)
    if "latency" not in skip and 2 in args.np and not hosts:  # the floor of one machine's processes
        runner.records.append(probes.wakeup_probe(max(50, args.lat_iters // 4)))
    if "memcpy" not in skip and 64 * MIB in args.sizes:
        runner.records.append(probes.cold_write_probe(64 * MIB, args.rounds))
    for np_ in args.np:
        for rep in range(args.reps):
            for job in rotate(plan_jobs(runner, np_, rep, transports, mpi_missing, gloo, skip, not hosts), rep):
                job()
    if "memory" not in skip:
        for transport in transports if not q else transports[:1]:
            runner.memory_job("engine-inplace", transport)
            runner.memory_job("engine-outofplace", transport)
        if not q:
            if gloo:
                runner.memory_job("gloo", None)
            if not mpi_missing:
                runner.memory_job("openmpi", None)

    res = Results(runner.records)
    meta = {k: v for r in runner.records if r.get("kind") == "meta" for k, v in r.items()}
    versions = [f"torch {version('torch')} (Gloo)" if gloo else "torch: not used",
                f"mpi4py {version('mpi4py')}, {meta.get('mpi_library', 'Open MPI: not run')}"
                if not mpi_missing else f"MPI: not used ({mpi_missing})"]
    cli.complete_header(info, versions, time.monotonic() - runner.t_start)
    info.update(launch_header(runner, args.reps, hosts))
    if hosts:
        info["engine transport (what hvd.init chose)"] = runner.engine_transports()  # type: ignore[attr-defined]
    title = f"{TITLE}, across {args.hosts} hosts" if hosts else TITLE
    text = render(args.ops, res, memcpy, info, runner.failures, primary, title=title,
                  targets=for_run(args.hosts if hosts else 0))
    cli.write_outputs(args, text, info, res, memcpy, TITLE)
    return 1 if runner.failures else 0


def plan_jobs(runner: Runner, np_: int, rep: int, transports: List[str], mpi_missing: Optional[str], gloo: bool,
              skip: set, own_mpi: bool = True) -> List[Callable[[], None]]:
    """The jobs of one repetition at one world size, in their base order: this project on its primary transport,
    Gloo (torchrun), Open MPI (mpirun), then this project on its other launchers (``own_mpi``: its mpi transport
    under mpirun too). The caller rotates the order by repetition, so machine drift hits every library alike."""
    phases = [p for p in ("sweep", "latency", "fusion") if p not in skip and (np_ == 2 or p != "fusion")]
    peer_phases = [p for p in phases if p != "fusion"]
    jobs: List[Callable[[], None]] = []
    for i, transport in enumerate(transports):
        # fusion: the project's own comparison, once (first repetition, primary transport)
        job_phases = [p for p in phases if p != "fusion" or (i == 0 and rep == 0)]
        if job_phases:
            jobs.append(functools.partial(runner.hvd_job, np_, transport, job_phases, rep, gloo and i == 0))
    if not peer_phases:
        return jobs
    peers: List[Callable[[], None]] = []
    if gloo:
        peers.append(functools.partial(runner.gloo_job, np_, peer_phases, rep))
    if not mpi_missing:
        peers.append(functools.partial(runner.openmpi_job, np_, peer_phases, rep))
    jobs[1:1] = peers
    if not mpi_missing and own_mpi:
        jobs.append(functools.partial(runner.mpi_job, np_, peer_phases, rep))
    return jobs


def launch_header(runner: Runner, reps: int, hosts: bool = False) -> Dict[str, str]:
    """The header lines that say how every library was launched and where its ranks were allowed to run."""
    lines = {"launchers (each library in jobs of its own)": "; ".join(f"{what}: {cmd}"
                                                                      for what, cmd in runner.launches.items()),
             "torchrun's threads": ("torchrun sets OMP_NUM_THREADS=1 for each worker when --nproc-per-node > 1 and "
                                    "the variable is unset (torch/distributed/run.py); the driver unsets it for "
                                    "the Gloo jobs, as in a fresh shell") if not hosts else
                                   ("one worker per node: torchrun leaves OMP_NUM_THREADS alone (unset in the ssh "
                                    "session), so torch uses its default threads"),
             "repetitions": f"{reps} per world size; the jobs of a repetition run one after another, their order "
                            f"rotated by one each repetition; tables give the median over repetitions, ratios "
                            f"the median (min–max) of the ratios within each repetition"}
    seen: Dict[str, List[dict]] = {}
    for r in runner.records:
        if r.get("kind") == "placement" and r.get("rep", 0) == 0:
            seen.setdefault(f"placement, {r['job'].rsplit(' rep ', 1)[0]}", []).append(r)
    for what, recs in seen.items():
        lines[what] = describe_placement(recs)
    return lines


if __name__ == "__main__":
    sys.exit(main())
