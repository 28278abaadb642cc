"""horovod.jax against JAX's own multi-process CPU collectives, in the same processes.

    python benchmarks/jax_collectives.py                 # np = 2, 4 KiB .. 64 MiB, and a gradient pytree
    python benchmarks/jax_collectives.py --np 4 --max-size 16M --blocks 5

One ``horovodrun`` job; every rank starts Horovod *and* ``jax.distributed.initialize`` (CPU collectives over
Gloo, the coordinator on a port rank 0 picks and broadcasts), then times, for each message size, three ways of
summing a float32 array across the ranks:

- ``hvd``: ``hvd.allreduce(x, op=Sum)`` on a concrete ``jax.Array`` (the engine reads the CPU buffer in place);
- ``hvd-jit``: the same call inside ``jax.jit`` (an ordered host callback hands XLA's buffer to the engine);
- ``psum``: ``jax.lax.psum`` in a jitted ``shard_map`` over the global mesh of all processes' CPU devices, i.e.
  JAX's own cross-process collective, compiled into the XLA program.

and a gradient-shaped pytree (``--tree``: 66 tensors of 64 KiB, a deep MLP's gradients) reduced by
``hvd.allreduce(tree)`` (one bucketed callback) against ``psum`` of the tree.  Blocks of iterations alternate
between the contenders (hvd, hvd-jit, psum, psum, hvd-jit, hvd, ...) so machine noise hits all alike; each block
is timed between barriers and the table shows the median time per operation and the bus bandwidth
(nccl-tests' convention).  Prints tables; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch as _launch  # noqa: E402
from benchmarks._lib import measure as units  # noqa: E402  (the worker has a function named measure)

RESULT_TAG = "BENCH_RESULT "
CONTENDERS = ("hvd", "hvd-jit", "psum")


def worker(args) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import horovod.jax as hvd

    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(_launch.free_port() if rank == 0 else None, root_rank=0, name="coordinator")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("p",))
    local_device = jax.local_devices()[0]
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:   # older JAX
        from jax.experimental.shard_map import shard_map

    def global_array(local):
        """This process's array as its row of a (world, ...) array sharded over the processes."""
        return jax.make_array_from_single_device_arrays(
            (world,) + local.shape, NamedSharding(mesh, PartitionSpec("p")),
            [jax.device_put(local[None], local_device)])

    psum = jax.jit(shard_map(lambda t: jax.lax.psum(t, "p"), mesh=mesh, in_specs=PartitionSpec("p"),
                             out_specs=PartitionSpec("p")))
    hvd_jit = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))

    def contenders(local):
        glob = jax.tree_util.tree_map(global_array, local)
        return {"hvd": lambda: hvd.allreduce(local, op=hvd.Sum),
                "hvd-jit": lambda: hvd_jit(local),
                "psum": lambda: psum(glob)}

    def timed(fn, iters):
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        hvd.barrier()
        return (time.perf_counter() - start) / iters

    def measure(label, local, nbytes):
        fns = contenders(local)
        # One warm-up each (compiles the jitted programs), and a check that all three agree.
        results = {name: fn() for name, fn in fns.items()}
        want = np.asarray(jax.tree_util.tree_leaves(results["hvd"])[0])
        for name in ("hvd-jit", "psum"):
            got = jax.tree_util.tree_leaves(results[name])[0]
            got = np.asarray(got.addressable_shards[0].data[0] if name == "psum" else got)
            if not np.allclose(got, want):
                raise AssertionError(f"{name} disagrees with hvd on {label}")
        iters = max(1, min(200, int(args.target_bytes // max(nbytes, 1))))
        times = {name: [] for name in fns}
        order = list(CONTENDERS)
        for block in range(args.blocks):
            for name in (order if block % 2 == 0 else order[::-1]):
                times[name].append(timed(fns[name], iters))
        return {name: statistics.median(ts) for name, ts in times.items()}

    rows = []
    for nbytes in units.size_ladder(args.min_size, args.max_size, 4):
        local = jnp.full((nbytes // 4,), float(rank + 1), jnp.float32)
        rows.append({"what": units.format_size(nbytes), "bytes": nbytes, **measure(nbytes, local, nbytes)})
    if args.tree:
        tree = [jnp.full((128, 128), float(rank + i), jnp.float32) for i in range(66)]
        nbytes = sum(t.nbytes for t in tree)
        rows.append({"what": "pytree 66 x 64 KiB", "bytes": nbytes, **measure("tree", tree, nbytes)})
    if rank == 0:
        print(RESULT_TAG + json.dumps({"np": world, "rows": rows, "jax": jax.__version__}), flush=True)
    jax.distributed.shutdown()
    hvd.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--min-size", type=units.parse_size, default=4 * units.KIB)
    parser.add_argument("--max-size", type=units.parse_size, default=64 * units.MIB)
    parser.add_argument("--no-tree", dest="tree", action="store_false", help="skip the gradient pytree row")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per contender and size")
    parser.add_argument("--target-bytes", type=units.parse_size, default=256 * units.MIB,
                        help="bytes reduced per block (sets the iterations per block)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--chart", default=None, metavar="FILE.png",
                        help="draw bus bandwidth against size for each contender into FILE.png (needs matplotlib)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    argv_worker = [sys.executable, os.path.abspath(__file__), "--worker", "--min-size", str(args.min_size),
                   "--max-size", str(args.max_size), "--blocks", str(args.blocks), "--target-bytes",
                   str(args.target_bytes)] + ([] if args.tree else ["--no-tree"])
    env = _launch.repo_env({"JAX_PLATFORMS": "cpu"}, drop_prefixes=("HOROVOD_",))
    result = _launch.run_job(_launch.horovodrun_cmd(args.np, argv_worker), env, args.timeout)
    lines = [line for line in result.stdout.splitlines() if RESULT_TAG in line]
    if not result.ok or not lines:
        raise SystemExit(f"the benchmark job failed:\n{result.describe()}")
    data = json.loads(lines[-1].split(RESULT_TAG, 1)[1])
    factor = units.bus_factor("allreduce", data["np"])
    print(f"allreduce (sum, float32) at np = {data['np']}, jax {data['jax']}: median time per operation and bus "
          f"bandwidth")
    print(f"{'size':>20} | " + " | ".join(f"{name:>20}" for name in CONTENDERS) + " | hvd-jit / psum")
    for row in data["rows"]:
        cells = []
        for name in CONTENDERS:
            seconds = row[name]
            cells.append(f"{seconds * 1e3:9.3f} ms {factor * row['bytes'] / seconds / 1e9:5.2f} GB/s")
        print(f"{row['what']:>20} | " + " | ".join(f"{c:>20}" for c in cells) +
              f" | {row['hvd-jit'] / row['psum']:.2f}x")
    if args.chart:
        from benchmarks import charts
        from benchmarks._lib.report import chart_note

        series = {name: [(row["bytes"], factor * row["bytes"] / row[name] / 1e9) for row in data["rows"]
                         if not row["what"].startswith("pytree")] for name in CONTENDERS}
        charts.bandwidth({f"allreduce, np = {data['np']}": series}, args.chart, note=chart_note(),
                         title=f"horovod.jax against jax.lax.psum (jax {data['jax']})")


if __name__ == "__main__":
    main()
