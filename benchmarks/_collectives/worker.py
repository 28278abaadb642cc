"""A rank of a collectives job: reads its spec, builds the implementations, runs the phases it names."""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from benchmarks._collectives.cases import F32
from benchmarks._collectives.impls import (EngineImpl, Emitter, GlooImpl, MpiImpl, MpiSync, RawImpl, Sync,
                                           TorchEngineImpl, TorchSync)
from benchmarks._collectives.phases import fusion, latency, sweep
from benchmarks._lib.launch import worker_placement
from benchmarks._lib.measure import KIB


def _proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * KIB
    return out


def memory(spec: dict, emit: Emitter, rank: int, size: int) -> None:
    """Peak RSS of a 64 MiB allreduce in a fresh process, above the RSS just before it (tensor allocated)."""
    impl = spec["rss_impl"]
    nbytes = spec["rss_bytes"]
    x = None
    if impl.startswith("engine"):
        import horovod.numpy as hvd

        hvd.init()
        warm = hvd.allreduce(np.zeros(2, F32), op=hvd.Sum, name="rss.warm")  # connections up, lazily built parts
        if impl == "engine-inplace":
            call = lambda: hvd.allreduce_(x, op=hvd.Sum, name="rss")  # noqa: E731
        else:
            call = lambda: hvd.allreduce(x, op=hvd.Sum, name="rss")  # noqa: E731
        done = lambda: hvd.allreduce(np.zeros(1, F32), op=hvd.Sum, name="rss.sync")  # noqa: E731
    elif impl == "gloo":
        import datetime as _dt

        import torch
        import torch.distributed as dist

        # under torchrun (env:// rendezvous), with the threads torchrun gives it
        dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=spec["timeout"]))
        warm = dist.all_reduce(torch.zeros(2))
        call = lambda: (dist.all_reduce(torch.from_numpy(x)), x)[1]  # noqa: E731
        done = lambda: dist.barrier()  # noqa: E731
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        warm = comm.allreduce(1)
        call = lambda: (comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), x)[1]  # noqa: E731
        done = comm.Barrier
    del warm
    x = np.empty(nbytes // 4, F32)
    x.fill(1.0)
    done()
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    before = _proc_status()["VmRSS"]
    out = call()
    extra = out.nbytes if out is not x else 0
    # min/max are reductions: checking the result must not allocate (a bool temporary would count as peak)
    ok = out.size == x.size and float(out.min()) == float(size) == float(out.max())
    del out
    for _ in range(2):
        out = call()
        del out
    done()
    status = _proc_status()
    emit({"kind": "memory", "impl": impl, "bytes": x.nbytes, "rss_before": before, "hwm": status["VmHWM"],
          "result_bytes": extra, "overhead": status["VmHWM"] - before - extra,
          "error": None if ok else f"rank {rank}: 64 MiB allreduce result differs from numpy"}, every_rank=True)
    emit({"kind": "done"})
    if impl.startswith("engine"):
        hvd.shutdown()
    elif impl == "gloo":
        dist.destroy_process_group()


def _raw_transport(name: str, cfg, rank: int, size: int, timeout: float, options: Optional[dict] = None):
    """A transport of the given kind on the job's rendezvous, in its own scope (beside the engine's, or alone)."""
    from horovod.transport.base import Bootstrap
    from horovod.transport.rendezvous import RendezvousClient
    from horovod.transport.sockets import local_address_for

    if name == "mpi":
        from mpi4py import MPI

        from horovod.transport.mpi import create_mpi

        return create_mpi(Bootstrap(rank, size, options={"mpi_comm": MPI.COMM_WORLD, **(options or {})}))
    topo = cfg.topology
    if name == "tcp":
        from horovod.transport.tcp import create_tcp as factory
    else:
        from horovod.transport.shm import create_shm as factory
    store = RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret, timeout=timeout)
    boot = Bootstrap(rank, size, local_rank=topo.local_rank, local_size=topo.local_size, hostname=topo.hostname,
                     # the engine's rule: loopback on one host, else the address that routes to the rendezvous
                     store=store, secret=topo.secret, bind_addr=local_address_for(topo.rendezvous_addr or ""),
                     timeout=timeout,
                     scope=f"bench-raw-{name}",
                     # the options the engine gives its own transport, so raw and engine run the same algorithms
                     options={"small_message_bytes": cfg.small_message_bytes, **(options or {})})
    return factory(boot)


def _env_rank_size() -> Tuple[int, int]:
    """This rank and the world size from the launcher's environment (horovodrun, mpirun or torchrun)."""
    env = os.environ
    rank = int(env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("RANK", "0"))))
    size = int(env.get("HOROVOD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))
    return rank, size


def _base(spec: dict, size: int) -> dict:
    """What every record of a job carries: the world size, the job's label and its repetition."""
    return {"np": size, "job": spec["job"], "rep": spec.get("rep", 0)}


def _placement(emit: Emitter, launcher: str, **extra) -> None:
    """Every rank records where its launcher let it run (the run header prints it per job)."""
    emit({"kind": "placement", "launcher": launcher, **worker_placement(), **extra}, every_rank=True)


def gloo_worker(spec: dict) -> None:
    """A rank of the Gloo peer's own job, started by ``torchrun`` as its users start it: ``torch.distributed``
    with the env:// rendezvous torchrun provides, torch's threads as torchrun leaves them, nothing of this
    project imported (no engine, no core binding)."""
    import datetime as _dt

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=spec["timeout"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    emit = Emitter(spec["out"], rank, _base(spec, size))
    _placement(emit, "torchrun", torch_threads=torch.get_num_threads())
    try:
        _run_phases(spec, [GlooImpl(torch, dist)], TorchSync(torch, dist), emit, rank, size)
    finally:
        dist.destroy_process_group()


def openmpi_worker(spec: dict) -> None:
    """A rank of the Open MPI peer's own job, started by ``mpirun``: mpi4py on a duplicate of ``COMM_WORLD``,
    nothing of this project imported."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    emit = Emitter(spec["out"], rank, _base(spec, size))
    _placement(emit, "mpirun")
    library = MPI.Get_library_version().replace("\x00", "")   # Open MPI's string ends with a NUL
    emit({"kind": "meta", "mpi_library": library.strip().splitlines()[0],
          "mpi_thread_level": MPI.Query_thread(), "mpi_vendor": list(map(str, MPI.get_vendor()))})
    comm = MPI.COMM_WORLD.Dup()
    try:
        _run_phases(spec, [MpiImpl(MPI, comm)], MpiSync(MPI, MPI.COMM_WORLD), emit, rank, size)
    finally:
        comm.Free()


def _run_phases(spec: dict, impls: list, sync, emit: Emitter, rank: int, size: int, hvd=None) -> None:
    phases = spec["phases"]
    t0 = time.monotonic()
    if "latency" in phases:
        latency(spec, impls, sync, emit, rank, size)
        emit({"kind": "phase", "phase": "latency", "seconds": time.monotonic() - t0})
    if "sweep" in phases:
        sweep(spec, impls, sync, emit, rank, size)
    if "fusion" in phases and hvd is not None:
        fusion(spec, hvd, sync, emit, rank, size)
    sync.barrier()
    emit({"kind": "done", "seconds": time.monotonic() - t0})


def raw_worker(spec: dict) -> None:
    """A transport alone (no engine): ``benchmarks/transports.py``, with the transport options it was given."""
    from horovod.engine import config as hvd_config

    rank, size = _env_rank_size()
    name = spec["transport"]
    raw = _raw_transport(name, hvd_config.load(), rank, size, spec["timeout"], spec.get("options"))
    emit = Emitter(spec["out"], rank, _base(spec, size))
    try:
        _run_phases(spec, [RawImpl(f"raw-{name}", raw)], Sync(raw), emit, rank, size)
    finally:
        raw.close()


def worker(spec_path: str) -> None:
    """One rank of a job: what it measures is in the JSON spec the driver wrote (``kind``: hvd, mpi, raw, memory,
    and the peers' own jobs: gloo, openmpi)."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    kind = spec["kind"]
    if kind == "memory":
        rank, size = _env_rank_size()
        memory(spec, Emitter(spec["out"], rank, {"np": size}), rank, size)
        return
    if kind == "raw":
        raw_worker(spec)
        return
    if kind in ("gloo", "openmpi"):
        (gloo_worker if kind == "gloo" else openmpi_worker)(spec)
        return

    import horovod.numpy as hvd

    hvd.init()  # first: under mpirun it sets the MPI thread level before mpi4py initialises MPI
    rank, size = hvd.rank(), hvd.size()
    emit = Emitter(spec["out"], rank, _base(spec, size))
    _placement(emit, "horovodrun" if kind == "hvd" else "mpirun")  # after hvd.init, which binds under horovodrun
    cleanup: List[Callable[[], None]] = []
    from horovod.engine import config as hvd_config

    transport = spec["transport"] if kind == "hvd" else "mpi"
    raw = _raw_transport(transport, hvd_config.load(), rank, size, spec["timeout"])
    cleanup.append(raw.close)
    impls: list = [RawImpl(f"raw-{transport}", raw), EngineImpl(f"engine-{transport}", hvd)]
    if kind == "hvd" and spec.get("torch"):
        import torch

        import horovod.torch as hvd_torch  # the same engine, through the torch binding's result allocation

        impls.append(TorchEngineImpl(f"torch-{transport}", torch, hvd_torch))
    from horovod.common import basics as hvd_basics

    emit({"kind": "meta", f"engine_transport_{spec['job']}": hvd_basics.runtime().transport_name})
    _run_phases(spec, impls, Sync(raw), emit, rank, size, hvd)
    for fn in cleanup:
        fn()
    hvd.shutdown()
