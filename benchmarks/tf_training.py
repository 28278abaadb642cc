"""Training throughput: horovod.tensorflow.keras DistributedOptimizer vs tf.distribute.MultiWorkerMirroredStrategy.

    python benchmarks/tf_training.py                          # np = 2, models mlp and deepmlp, tf_keras
    python benchmarks/tf_training.py --keras 3 --blocks 6 --block-steps 20 --models deepmlp

``--keras tf_keras`` (the default) runs the ranks with ``TF_USE_LEGACY_KERAS=1``: Keras 2 is what
MultiWorkerMirroredStrategy's ``model.fit`` path is built for.  With Keras 3 (``--keras 3``) its ``model.fit`` on a
multi-worker strategy fails here (TF 2.21, Keras 3.15: "Attempt to convert a value (PerReplica...) to a Tensor");
the table then says so and shows the Horovod sides only.

One ``horovodrun`` job runs every contender in the same processes: each rank joins a MultiWorkerMirroredStrategy
cluster (``TF_CONFIG`` with one worker per rank on 127.0.0.1, collectives over gRPC; it must exist before any
other TF op) and starts Horovod, builds identical copies of the Keras model — one under the strategy's scope, one
compiled with ``hvd.DistributedOptimizer`` with gradient buckets (the default) and one without
(``HOROVOD_GRADIENT_BUCKET_BYTES=0``: one request per gradient, as before buckets) — and alternates blocks of
``model.fit`` steps between them (rotating the order every block).  Same data (each rank trains on its own batch
of ``--batch-size`` samples; each strategy replica computes on as many), same optimizer, threads
and processes; a busy machine slows every side alike.  Each block is timed between Horovod barriers; the table
reports the median samples/s of each side and rank 0's CPU time per step (all threads).  Prints a table; asserts
nothing.
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

RESULT_TAG = "BENCH_RESULT "
SIDES = ("horovod", "horovod-nobucket", "mwms")


def build(keras, model_name: str):
    """The same model on every side (seeded)."""
    keras.utils.set_random_seed(0)
    inputs = [keras.layers.Input((32, 32, 3)), keras.layers.Flatten()]
    if model_name == "mlp":        # ~4.2 M parameters (17 MB of gradients per step): communication-bound
        layers = [keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1024, activation="relu")]
    elif model_name == "deepmlp":  # 66 variables of ≤ 64 KB: bound by the cost of each gradient's reduction
        layers = [keras.layers.Dense(128, activation="relu") for _ in range(32)]
    else:
        raise ValueError(f"unknown model {model_name!r}; expected mlp or deepmlp")
    return keras.Sequential(inputs + layers + [keras.layers.Dense(10)])


def worker(args) -> None:
    rank = int(os.environ["HOROVOD_RANK"])
    ports = [int(p) for p in args.ports.split(",")]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()   # before any other TF op

    import horovod.tensorflow.keras as hvd

    hvd.init()
    world = hvd.size()
    keras = tf.keras
    rng = np.random.RandomState(rank)
    x = rng.randn(args.batch_size, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, size=(args.batch_size,)).astype(np.int32)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

    def local_dataset(copies: int = 1):
        return tf.data.Dataset.from_tensors((np.concatenate([x] * copies), np.concatenate([y] * copies))) \
            .repeat().with_options(options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    results = {}
    for model_name in args.models.split(","):
        models = {}
        for side, bucket in (("horovod", None), ("horovod-nobucket", "0")):
            if bucket is None:
                os.environ.pop("HOROVOD_GRADIENT_BUCKET_BYTES", None)
            else:
                os.environ["HOROVOD_GRADIENT_BUCKET_BYTES"] = bucket   # read when the optimizer is built
            model = build(keras, model_name)
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                          loss=loss)
            models[side] = (model, local_dataset())
        os.environ.pop("HOROVOD_GRADIENT_BUCKET_BYTES", None)
        with strategy.scope():
            model = build(keras, model_name)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        # Keras distributes the dataset itself: each batch is the global batch, split over the replicas of all
        # workers (auto-sharding off), so every replica computes on --batch-size samples, as a Horovod rank does.
        models["mwms"] = (model, local_dataset(world))

        def run_steps(side: str, steps: int) -> None:
            model, data = models[side]
            model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)

        failed = {}
        for side in SIDES:
            try:
                run_steps(side, args.warmup)
            except Exception as exc:  # noqa: BLE001 — reported in the table instead of a number
                failed[side] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if not failed.keys().isdisjoint(("horovod", "horovod-nobucket")):
            raise RuntimeError(f"a Horovod side failed: {failed}")
        sides = [side for side in SIDES if side not in failed]
        rates = {side: [] for side in sides}
        cpu = {side: 0.0 for side in sides}
        for block in range(args.blocks):
            order = sides[block % len(sides):] + sides[:block % len(sides)]
            for side in order:
                hvd.allreduce(np.zeros(1), name="barrier.before")
                wall, proc = time.perf_counter(), time.process_time()
                run_steps(side, args.block_steps)
                cpu[side] += time.process_time() - proc
                hvd.allreduce(np.zeros(1), name="barrier.after")
                rates[side].append(args.block_steps * args.batch_size * world / (time.perf_counter() - wall))
        steps = args.blocks * args.block_steps
        results[model_name] = {side: {"samples_per_sec": statistics.median(rates[side]), "blocks": rates[side],
                                      "cpu_ms_per_step": 1000.0 * cpu[side] / steps} for side in sides}
        results[model_name].update({side: {"failed": why} for side, why in failed.items()})
    if rank == 0:
        print(RESULT_TAG + json.dumps(results), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _launch.add_training_args(parser, models="mlp,deepmlp", blocks=6, block_steps=20, timeout=1800,
                              framework="TF", order="rotating order")
    parser.add_argument("--keras", choices=["tf_keras", "3"], default="tf_keras",
                        help="tf_keras: TF_USE_LEGACY_KERAS=1 in the ranks (default); 3: Keras 3")
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _launch.resolve_threads(args)
    if args.worker:
        return worker(args)

    ports = ",".join(str(_launch.free_port()) for _ in range(args.np))
    env = _launch.repo_env({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "KERAS_BACKEND": "tensorflow",
                            "TF_USE_LEGACY_KERAS": "1" if args.keras == "tf_keras" else "0"})
    cmd = _launch.horovodrun_cmd(args.np, [
        sys.executable, os.path.abspath(__file__), "--worker", "--models", args.models, "--batch-size",
        str(args.batch_size), "--blocks", str(args.blocks), "--block-steps", str(args.block_steps), "--warmup",
        str(args.warmup), "--threads", str(args.threads), "--ports", ports])
    # run_job kills the whole job (launcher and ranks) on timeout
    proc = _launch.run_job(cmd, env, args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if RESULT_TAG in ln), None)
    if not proc.ok or line is None:
        raise SystemExit(f"benchmark job failed: {proc.describe()}")
    results = json.loads(line.split(RESULT_TAG, 1)[1])

    keras_flavour = "tf_keras (TF_USE_LEGACY_KERAS=1)" if args.keras == "tf_keras" else "Keras 3"
    print(f"\nnp={args.np}, {keras_flavour}, batch {args.batch_size}/rank, {args.blocks} rotating blocks of "
          f"{args.block_steps} steps per side (+{args.warmup} warm-up), {args.threads} TF thread(s)/rank, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| model   | horovod samples/s | horovod, no buckets | MWMS samples/s | ratio hvd/MWMS | "
          "hvd CPU ms/step | no-bucket CPU ms/step | MWMS CPU ms/step |")
    print("|---------|------------------:|--------------------:|---------------:|---------------:|"
          "----------------:|----------------------:|-----------------:|")
    for model, res in results.items():
        h, nb, m = res["horovod"], res["horovod-nobucket"], res["mwms"]
        m_rate, ratio, m_cpu = ((f"{m['samples_per_sec']:.1f}", f"{h['samples_per_sec'] / m['samples_per_sec']:.2f}",
                                 f"{m['cpu_ms_per_step']:.1f}") if "failed" not in m else ("failed", "-", "-"))
        print(f"| {model:<7} | {h['samples_per_sec']:>17.1f} | {nb['samples_per_sec']:>19.1f} | {m_rate:>14} | "
              f"{ratio:>14} | {h['cpu_ms_per_step']:>15.1f} | {nb['cpu_ms_per_step']:>21.1f} | {m_cpu:>16} |")
    for model, res in results.items():
        for side, r in res.items():
            if "failed" in r:
                print(f"\n{model}, {side}: {r['failed']}")
    print("\nper-block samples/s: " + json.dumps({m: {s: [round(v) for v in r[s]["blocks"]] for s in r
                                                      if "blocks" in r[s]} for m, r in results.items()}))
    if args.chart:
        from benchmarks import charts
        from benchmarks._lib.report import chart_note

        charts.throughput(results, {"horovod": "horovod", "horovod-nobucket": "horovod, no buckets",
                                    "mwms": "MultiWorkerMirrored"}, args.chart,
                          title=f"Keras training ({keras_flavour.split(' ')[0]}), np = {args.np}",
                          note=chart_note(f"{args.blocks} blocks of {args.block_steps} steps per side"))


if __name__ == "__main__":
    main()
