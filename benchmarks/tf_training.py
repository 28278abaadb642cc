"""Training throughput: horovod.tensorflow.keras DistributedOptimizer under horovodrun vs
tf.distribute.MultiWorkerMirroredStrategy (MWMS) in plain processes, one per worker.

    python benchmarks/tf_training.py                          # np = 2, models mlp and deepmlp, tf_keras, 3 reps
    python benchmarks/tf_training.py --keras 3 --blocks 6 --block-steps 20 --models deepmlp
    python benchmarks/tf_training.py --np 2 --models deepmlp --blocks 2 --block-steps 2 --warmup 1 --reps 1

Each library is launched as its users launch it, in jobs of its own:

* Horovod: ``horovodrun -np N`` (``python -m horovod.runner``, which sets ``OMP_NUM_THREADS`` to cores / ranks and
  has each rank bind itself to its share of the cores at ``hvd.init()``).  Its job trains two sides in the same
  processes, alternating blocks of ``model.fit`` steps (order swapped every block): ``hvd.DistributedOptimizer``
  with gradient buckets (the default) and without (``HOROVOD_GRADIENT_BUCKET_BYTES=0``: one request per gradient,
  as before buckets).
* MWMS: N plain ``python`` processes started by this driver (no launcher), each with ``TF_CONFIG`` naming the
  cluster (one worker per free port on 127.0.0.1) and its own index; collectives over gRPC.  No core binding, and
  ``OMP_NUM_THREADS``, ``HOROVOD_*`` and the driver's ``TF_CONFIG`` unset in their environment, as in a fresh
  shell; nothing of this project is imported there.  (Until 2026-11 MWMS ran inside the horovodrun job, core-bound:
  those "× MWMS" figures are withdrawn.)

Same model, data (each rank trains on its own batch of ``--batch-size`` samples; Keras splits MWMS's global batch
of N × ``--batch-size`` over the workers, auto-sharding off, so each replica computes on as many; tf.data's
autotuner off on both sides, see ``worker``), SGD optimizer,
warm-up, blocks and steps in both jobs.  Each block is timed on rank 0 between two synchronisations of every rank,
so a block lasts as long as its slowest rank: ``hvd.allreduce`` of one scalar in the Horovod job; in the MWMS job
MWMS's own collective, ``strategy.reduce(SUM, strategy.run(...))`` of one scalar inside a ``tf.function`` (an
all-reduce across the workers).  The CPU time per step is rank 0's (all its threads).  With ``--threads 0`` (the
default) neither job sets TF's thread pools: each runs with what its launcher gives (TF sizes them from the CPUs
the process may use); ``--threads T`` sets the intra- and inter-op threads to T in both.

``--reps`` repetitions of the pair of jobs run one after another, the order swapped each repetition, so machine
drift hits both alike; the table gives each side's median over repetitions (of its median block) and "× MWMS" as
the median (min–max) of the ratios taken within each repetition.  The header records each job's command line, the
CPU, and where every rank was allowed to run (CPUs, ``OMP_NUM_THREADS``).  Every job runs under ``--timeout``
(its processes killed then); a job that fails is reported in the table, and the other job's numbers still print.

``--keras tf_keras`` (the default) runs the ranks with ``TF_USE_LEGACY_KERAS=1``: Keras 2 is what MWMS's
``model.fit`` path is built for.  With Keras 3 (``--keras 3``) its ``model.fit`` on a multi-worker strategy fails
here (TF 2.21, Keras 3.15: "Attempt to convert a value (PerReplica...) to a Tensor"); the table then says so and
shows the Horovod sides only.  Prints tables; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # run as a script: make the checkout (``benchmarks`` and ``horovod``) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._lib import launch as _launch  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
PLACEMENT_TAG = "BENCH_PLACEMENT "
JOBS = ("horovod", "mwms")                       # one job each per repetition
SIDES = ("horovod", "horovod-nobucket", "mwms")  # what the table compares
JOB_OF = {"horovod": "horovod", "horovod-nobucket": "horovod", "mwms": "mwms"}
LABELS = {"horovod": "horovod.tensorflow.keras (horovodrun)", "mwms": "MultiWorkerMirroredStrategy (plain processes)"}


# -- the workload, identical in both jobs ----------------------------------------------------------------
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
    """One rank of one job: ``--side horovod`` under horovodrun (both Horovod sides), ``--side mwms`` as a plain
    process with its ``TF_CONFIG``."""
    import numpy as np
    import tensorflow as tf

    if args.threads > 0:   # before any TF op
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.side == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()   # reads TF_CONFIG; before any other TF op
        rank, world = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
        one = tf.constant(1.0)

        @tf.function
        def all_reduce_one():
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.identity(one)), axis=None)

        def barrier() -> None:   # MWMS's own collective across the workers
            all_reduce_one().numpy()
        total = float(all_reduce_one())   # a check that the barrier is a collective of every worker
        if total != world:
            raise RuntimeError(f"MWMS all-reduce of 1 over {world} workers gave {total}")
        sides: Tuple[str, ...] = ("mwms",)
    else:
        import horovod.tensorflow.keras as hvd

        hvd.init()   # under horovodrun this binds the rank to its cores, as for any user of horovodrun
        rank, world = hvd.rank(), hvd.size()

        def barrier() -> None:
            hvd.allreduce(np.zeros(1), name="bench.barrier")
        sides = ("horovod", "horovod-nobucket")
    placement = {**_launch.worker_placement(), "rank": rank, "tf_threads": args.threads or "TF's default"}
    placement["OMP_NUM_THREADS"] = placement["OMP_NUM_THREADS"] or "unset"
    print(PLACEMENT_TAG + json.dumps(placement), flush=True)
    keras = tf.keras
    rng = np.random.RandomState(rank)
    x = rng.randn(args.batch_size, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, size=(args.batch_size,)).astype(np.int32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # tf.data's autotuner has nothing to tune in one repeated tensor, but its thread makes every `model.fit` wait
    # for it as the fit ends (the iterator's teardown): up to ~0.6 s, at random, on either side. A block is one
    # `model.fit` of a few steps, so that wait, not the training, set the rates seen until 2026-12-03.
    options.autotune.enabled = False

    def dataset(copies: int = 1):
        return tf.data.Dataset.from_tensors((np.concatenate([x] * copies), np.concatenate([y] * copies))) \
            .repeat().with_options(options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    results: Dict[str, Dict[str, Any]] = {}
    for model_name in args.models.split(","):
        models = {}
        if args.side == "mwms":
            with strategy.scope():
                model = build(keras, model_name)
                model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
            # Keras distributes the dataset itself: each batch is the global batch, split over the replicas of
            # all workers (auto-sharding off), so every replica computes on --batch-size samples, as a rank does.
            models["mwms"] = (model, dataset(world))
        else:
            for side, bucket in (("horovod", None), ("horovod-nobucket", "0")):
                if bucket is None:
                    os.environ.pop("HOROVOD_GRADIENT_BUCKET_BYTES", None)
                else:
                    os.environ["HOROVOD_GRADIENT_BUCKET_BYTES"] = bucket   # read when the optimizer is built
                model = build(keras, model_name)
                model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                              loss=loss)
                models[side] = (model, dataset())
            os.environ.pop("HOROVOD_GRADIENT_BUCKET_BYTES", None)

        def run_steps(side: str, steps: int) -> None:
            m, data = models[side]
            m.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)

        failed = {}
        for side in sides:
            try:
                run_steps(side, args.warmup)
            except Exception as exc:  # noqa: BLE001 — MWMS under Keras 3: reported in the table instead of a number
                if args.side != "mwms":
                    raise
                failed[side] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
        live = [side for side in sides if side not in failed]
        rates: Dict[str, List[float]] = {side: [] for side in live}
        cpu = {side: 0.0 for side in live}
        for block in range(args.blocks):
            for side in (live if block % 2 == 0 else live[::-1]):
                barrier()
                wall, proc = time.perf_counter(), time.process_time()
                run_steps(side, args.block_steps)
                cpu[side] += time.process_time() - proc
                barrier()
                rates[side].append(args.block_steps * args.batch_size * world / (time.perf_counter() - wall))
        steps = args.blocks * args.block_steps
        results[model_name] = {side: {"samples_per_sec": statistics.median(rates[side]), "blocks": rates[side],
                                      "cpu_ms_per_step": 1000.0 * cpu[side] / steps} for side in live}
        results[model_name].update({side: {"failed": why} for side, why in failed.items()})
    if rank == 0:
        print(RESULT_TAG + json.dumps({"models": results}), flush=True)


# -- the driver ------------------------------------------------------------------------------------------
def job_cmd(args, job: str) -> List[str]:
    """The command line of one job: horovodrun for Horovod; for MWMS the one every worker process runs."""
    script = [os.path.abspath(__file__), "--worker", "--side", job, "--models", args.models, "--batch-size",
              str(args.batch_size), "--blocks", str(args.blocks), "--block-steps", str(args.block_steps),
              "--warmup", str(args.warmup), "--threads", str(args.threads), "--keras", args.keras]
    if job == "horovod":
        return _launch.horovodrun_cmd(args.np, [sys.executable, *script])
    return [sys.executable, *script]


def job_envs(args, job: str) -> List[Dict[str, str]]:
    """The environment of the horovodrun job, or of each MWMS worker (its ``TF_CONFIG``: fresh free ports)."""
    tf_env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "KERAS_BACKEND": "tensorflow",
              "TF_USE_LEGACY_KERAS": "1" if args.keras == "tf_keras" else "0"}
    if job == "horovod":
        return [_launch.repo_env(tf_env, drop_prefixes=("TF_CONFIG",))]
    ports = [_launch.free_port() for _ in range(args.np)]
    return [_launch.plain_env({**tf_env, "TF_CONFIG": _launch.tf_config(ports, i)}, drop=("TF_CONFIG",))
            for i in range(args.np)]


def failure(proc: _launch.JobResult, timeout: float) -> str:
    """One line for the table's notes: how the job ended and its last error line."""
    how = f"timed out after {timeout:g} s and was killed" if proc.timed_out else f"exited with {proc.returncode}"
    errors = [ln.strip() for ln in proc.stderr.splitlines() if re.search(r"\w(Error|Exception)\b", ln)]
    return how + (f"; last error: {errors[-1][:160]}" if errors else "")


def run_job(args, job: str) -> dict:
    """One job of ``--np`` ranks, every model: ``models`` (rank 0's results) and every rank's ``placement``, or
    ``failed`` (why)."""
    cmd, envs = job_cmd(args, job), job_envs(args, job)
    print(f"{job}, np={args.np}: {shlex.join(cmd)}" + (f" (× {args.np} processes)" if job == "mwms" else ""),
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    if job == "horovod":
        proc = _launch.run_job(cmd, envs[0], args.timeout)   # kills the whole job on timeout
    else:
        proc = _launch.run_workers(cmd, envs, args.timeout)  # kills every worker on timeout or after a failure
    lines = proc.stdout.splitlines()
    result = next((ln.split(RESULT_TAG, 1)[1] for ln in lines if RESULT_TAG in ln), None)
    if not proc.ok or result is None:
        print(f"  FAILED after {time.monotonic() - t0:.0f} s: {proc.describe()}", file=sys.stderr, flush=True)
        return {"failed": failure(proc, args.timeout) if not proc.ok else "no result printed"}
    print(f"  done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return {**json.loads(result), "placement": [json.loads(ln.split(PLACEMENT_TAG, 1)[1]) for ln in lines
                                                if PLACEMENT_TAG in ln]}


def interleaved(args) -> Dict[str, List[dict]]:
    """``--reps`` repetitions of both jobs, the order swapped each repetition: job -> runs by rep."""
    runs: Dict[str, List[dict]] = {job: [] for job in JOBS}
    for rep in range(args.reps):
        for job in (JOBS if rep % 2 == 0 else JOBS[::-1]):
            print(f"[rep {rep}]", end=" ", file=sys.stderr, flush=True)
            runs[job].append(run_job(args, job))
    return runs


Ratio = Tuple[float, float, float]


def summarize(args, runs: Dict[str, List[dict]]) -> Dict[str, dict]:
    """model -> side -> medians over repetitions (samples/s, CPU) or why it failed; and per Horovod side the
    ratio side ÷ MWMS taken within each repetition (median, min, max)."""
    out: Dict[str, dict] = {}
    for model in args.models.split(","):
        entry: Dict[str, Any] = {}
        for side in SIDES:
            reps: List[Dict[str, Any]] = [{"failed": f"job {run['failed']}"} if "failed" in run
                                          else run["models"][model][side] for run in runs[JOB_OF[side]]]
            rates = [r.get("samples_per_sec") for r in reps]
            ok = [r for r in reps if "samples_per_sec" in r]
            entry[side] = {"reps": rates, "failed": sorted({r["failed"] for r in reps if "failed" in r})}
            if ok:
                entry[side].update(samples_per_sec=statistics.median(r["samples_per_sec"] for r in ok),
                                   cpu_ms_per_step=statistics.median(r["cpu_ms_per_step"] for r in ok))
        ratios: Dict[str, Optional[Ratio]] = {}
        for side in ("horovod", "horovod-nobucket"):
            within = [h / m for h, m in zip(entry[side]["reps"], entry["mwms"]["reps"]) if h and m]
            ratios[side] = (statistics.median(within), min(within), max(within)) if within else None
        entry["ratio"] = ratios
        out[model] = entry
    return out


def fmt_ratio(r: Optional[Ratio]) -> str:
    if r is None:
        return "-"
    med, lo, hi = r
    return f"{med:.2f}×" + (f" ({lo:.2f}–{hi:.2f})" if hi > lo else "")


def shown_cmd(args, job: str) -> str:
    cmd = [os.path.relpath(a) if a == os.path.abspath(__file__) else a for a in job_cmd(args, job)]
    return f"`{shlex.join(cmd)}`"


def print_header(args, runs: Dict[str, List[dict]], load_start: float) -> None:
    from benchmarks._lib.report import print_run_lines

    print_run_lines(__file__, load_start)
    print(f"- **Keras**: {'tf_keras (TF_USE_LEGACY_KERAS=1)' if args.keras == 'tf_keras' else 'Keras 3'}; "
          f"TF threads per rank: {args.threads or 'not set (what each launcher gives)'}")
    print(f"- **{LABELS['horovod']} launched as**: {shown_cmd(args, 'horovod')}")
    print(f"- **{LABELS['mwms']} launched as**: {args.np} × {shown_cmd(args, 'mwms')}, started by the driver, "
          f"worker i with TF_CONFIG={{\"cluster\": {{\"worker\": [\"127.0.0.1:PORT_0\", ...]}}, \"task\": "
          f"{{\"type\": \"worker\", \"index\": i}}}} (free ports, new each job); OMP_NUM_THREADS, HOROVOD_* and "
          f"the driver's TF_CONFIG unset in their environment")
    for job in JOBS:
        placement: List[dict] = next((run["placement"] for run in runs[job] if run.get("placement")), [])
        print(f"- **{LABELS[job]} ranks' placement**: {_launch.describe_placement(placement)}")
    print(f"- **repetitions**: {args.reps}, each a horovodrun job and an MWMS job one after the other (order "
          f"swapped each repetition); {args.blocks} blocks of {args.block_steps} steps per side and job "
          f"(+{args.warmup} warm-up), batch {args.batch_size}/rank; each block timed on rank 0 between "
          f"synchronisations of every rank (hvd.allreduce; MWMS: strategy.reduce of a scalar)")


def print_table(summary: Dict[str, dict]) -> None:
    def cell(e: dict, key: str, fmt: str) -> str:
        return format(e[key], fmt) if key in e else "failed"

    print("\n| model | horovod samples/s | horovod, no buckets samples/s | MWMS samples/s | "
          "hvd × MWMS (within each rep) | no-bucket × MWMS | hvd CPU ms/step | no-bucket CPU ms/step | "
          "MWMS CPU ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, e in summary.items():
        h, nb, m = e["horovod"], e["horovod-nobucket"], e["mwms"]
        print(f"| {model} | {cell(h, 'samples_per_sec', '.1f')} | {cell(nb, 'samples_per_sec', '.1f')} | "
              f"{cell(m, 'samples_per_sec', '.1f')} | {fmt_ratio(e['ratio']['horovod'])} | "
              f"{fmt_ratio(e['ratio']['horovod-nobucket'])} | {cell(h, 'cpu_ms_per_step', '.1f')} | "
              f"{cell(nb, 'cpu_ms_per_step', '.1f')} | {cell(m, 'cpu_ms_per_step', '.1f')} |")
    for model, e in summary.items():
        for side in SIDES:
            for why in e[side]["failed"]:
                print(f"\n{model}, {side} failed: {why}")


def build_args(argv=None) -> argparse.Namespace:
    """The command line, parsed (the driver's and the workers' flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _launch.add_training_args(parser, models="mlp,deepmlp", blocks=6, block_steps=20, timeout=900,
                              framework="TF", order="alternating, order swapped every block",
                              threads_help="0: what each launcher gives, in both jobs")
    parser.add_argument("--keras", choices=["tf_keras", "3"], default="tf_keras",
                        help="tf_keras: TF_USE_LEGACY_KERAS=1 in the ranks (default); 3: Keras 3")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the pair of jobs (medians over them)")
    parser.add_argument("--side", choices=JOBS, default="horovod", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.reps = max(1, args.reps)
    return args


def main(argv=None) -> None:
    args = build_args(argv)
    if args.worker:
        return worker(args)
    load_start = os.getloadavg()[0]
    runs = interleaved(args)
    summary = summarize(args, runs)
    print(f"# TF/Keras training, np={args.np}: horovod.tensorflow.keras under horovodrun vs "
          f"MultiWorkerMirroredStrategy in plain processes\n")
    print_header(args, runs, load_start)
    print_table(summary)
    print("\nsamples/s per repetition: " + json.dumps({m: {s: [v and round(v) for v in e[s]["reps"]] for s in SIDES}
                                                        for m, e in summary.items()}))
    if args.chart:
        from benchmarks import charts
        from benchmarks._lib.report import chart_note

        charts.throughput(summary, {"horovod": "horovod", "horovod-nobucket": "horovod, no buckets",
                                    "mwms": "MultiWorkerMirrored"}, args.chart,
                          title=f"Keras training ({args.keras}), np = {args.np}",
                          note=chart_note(f"median of {args.reps} reps of {args.blocks} blocks × "
                                          f"{args.block_steps} steps"))


if __name__ == "__main__":
    main()
