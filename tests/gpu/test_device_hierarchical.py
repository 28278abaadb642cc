"""Hierarchical allreduce on device memory as a composition (``HierarchicalPlane``, horovod/engine/device_nccl.py),
on the CPU: the stand-in NCCL inside each emulated host, the tcp transport across hosts, device arrays of the
NCCL-capable host-memory backend, and the shared algorithms around it.  Four ranks as two hosts of two.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np

from multiproc import open_transport, run_ranks
from tests.gpu import standin

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
import emulated_device  # noqa: E402  (tests/conformance)

cloudpickle.register_pickle_by_value(emulated_device)   # the ranks get it with the job

SUM, AVERAGE = 1, 0   # horovod.engine.ops
CASES = [("float32", [(7,)], SUM), ("float32", [(3, 2), (5,)], AVERAGE), ("int32", [(9,)], AVERAGE),
         ("bfloat16", [(6,)], SUM)]


# The ranks install an emulated device backend into horovod.numpy (process-wide): fresh ranks for every test,
# not warm ones (tests/rank_pool.py), so no test inherits another's backend.
WARM_RANKS = False


def _comm(lib, transport, size, rank):
    from horovod.transport import nccl

    ids = np.zeros(128, np.uint8)
    if transport.rank == 0:
        ids[:] = np.frombuffer(nccl.unique_id(lib), np.uint8)
    transport.broadcast(ids, 0)
    return nccl.NcclComm(lib, ids.tobytes(), size, rank)


def _job():
    from horovod.engine import algorithms, ops
    from horovod.engine.device_nccl import HierarchicalPlane, NcclPlane
    from horovod.engine.handles import Entry
    from horovod.engine.memory import DeviceMemory, PinnedStage
    from horovod.engine.messages import Response
    from horovod.transport import nccl_lib

    world = open_transport("tcp")
    rank, host, local_rank = world.rank, world.rank // 2, world.rank % 2
    local = world.subgroup([2 * host, 2 * host + 1])
    cross = world.subgroup([local_rank, local_rank + 2])
    lib = nccl_lib.load(os.environ["HOROVOD_NCCL_SO_PATH"])
    flat_comm = _comm(lib, world, 4, rank)
    local_comm = _comm(lib, local, 2, local_rank)
    backend = emulated_device.NcclHostBackend(os.environ["HOROVOD_NCCL_SO_PATH"])
    stage = PinnedStage()
    out = []
    for dtype, shapes, op in CASES:
        memory = DeviceMemory(backend, 0, None, dtype, lambda n: backend.empty((n,), "uint8", 0, None))
        plane = HierarchicalPlane(flat_comm, 0, dtype, NcclPlane(local_comm, 0, dtype), cross, memory, stage)
        entries = []
        for i, shape in enumerate(shapes):
            values = (np.arange(np.prod(shape)) + 10 * rank + i).reshape(shape).astype(np.float32)
            bits = values.view(np.uint32) >> 16 if dtype == "bfloat16" else values
            array = backend.empty(shape, dtype, 0, None)
            array.owner[...] = bits.astype(array.dtype)
            entries.append(Entry(None, array, None, None, i))
        resp = Response(ops.ALLREDUCE, [f"t{i}" for i in range(len(shapes))], dtype=dtype, op=op, shapes=shapes)
        finish = memory.finisher(op, 1.0, plane.size)
        results = algorithms.allreduce(memory, plane, resp, entries, ops.TRANSPORT_OP[op], finish)
        out.append([np.array(r.owner) for r in results])
    world.close()
    return out


def test_hierarchical_allreduce_on_device_memory_composes_the_planes(tmp_path):
    results = run_ranks(_job, 4, env=standin.env(tmp_path), timeout=240)
    for c, (dtype, shapes, op) in enumerate(CASES):
        for i, shape in enumerate(shapes):
            inputs = [(np.arange(np.prod(shape)) + 10 * r + i).reshape(shape).astype(np.float32) for r in range(4)]
            if dtype == "bfloat16":   # small integers: exact in bfloat16
                expected = np.sum(inputs, axis=0)
                got = [(res[c][i].astype(np.uint32) << 16).view(np.float32) for res in results]
            else:
                total = np.sum(np.array(inputs, dtype=dtype), axis=0)
                expected = total if op == SUM else total // 4 if dtype == "int32" else total / 4
                got = [res[c][i] for res in results]
            for r in range(4):
                np.testing.assert_array_equal(got[r], expected, err_msg=f"{dtype} {shapes} rank {r}")
    for rank in range(4):
        seqs = standin.sequences(tmp_path, rank)
        called = " ".join(" ".join(s) for s in seqs.values())
        # Inside the host: uneven shards are grouped reduces, even ones one reduce-scatter; never a flat allreduce.
        assert "ncclAllReduce" not in called, seqs
        assert "ncclReduceScatter" in called and "ncclReduce " in called and "ncclAllGather" in called, seqs


def _engine_job():
    import horovod.numpy as hvd

    emulated_device.install_nccl(hvd, os.environ["HOROVOD_NCCL_SO_PATH"])
    hvd.init()
    r = hvd.rank()
    out = [hvd.allreduce(np.arange(7, dtype=np.float32) + r, name="one", op=hvd.Sum),
           hvd.allreduce(np.full((3, 3), 4.0 * (r + 1)), name="avg", op=hvd.Average)]
    handles = [hvd.allreduce_async(np.arange(5, dtype=np.int64) * (r + 1), name=f"fused.{i}", op=hvd.Sum)
               for i in range(3)]
    out += [hvd.synchronize(h) for h in handles]
    out.append(hvd.broadcast(np.arange(4, dtype=np.float32) + r, root_rank=2, name="bcast"))
    hvd.shutdown()
    return out


def test_the_engine_runs_a_set_across_hosts_hierarchically_when_asked(tmp_path):
    """HOROVOD_HIERARCHICAL_ALLREDUCE=1 on a set spanning two hosts of two: allreduces (single, fused, Average)
    run inside the hosts on 2-rank communicators and across them on the CPU transport; a broadcast stays flat."""
    env = standin.env(tmp_path, HOROVOD_HIERARCHICAL_ALLREDUCE="1")
    results = run_ranks(_engine_job, 4, env=env, hosts=["a", "a", "b", "b"], timeout=240)
    for res in results:
        np.testing.assert_array_equal(res[0], 4 * np.arange(7) + 6)
        np.testing.assert_array_equal(res[1], np.full((3, 3), 10.0))
        for fused in res[2:5]:
            np.testing.assert_array_equal(fused, np.arange(5) * 10)
        np.testing.assert_array_equal(res[5], np.arange(4) + 2)
    for rank in range(4):
        seqs = standin.sequences(tmp_path, rank)
        flat = [c for c, seq in seqs.items() if seq == ["ncclBroadcast 16 1 0"]]   # the broadcast alone
        local = [seq for c, seq in seqs.items() if c not in flat]
        assert len(flat) == 1 and len(local) == 1, seqs
        # Inside the host: reduce-scatter in (uneven shards: grouped reduces), allgather out (ragged: grouped
        # broadcasts); how the three async tensors fuse varies, an allreduce on one communicator never happens.
        calls = {s.split()[0] for s in local[0]}
        assert "ncclReduce" in calls and calls <= {"ncclReduce", "ncclReduceScatter", "ncclBroadcast",
                                                   "ncclAllGather"}, local
