"""Autotune: the Bayesian optimiser's pure parts, and a real job that tunes and logs."""
from __future__ import annotations

import csv

import numpy as np

from horovod.engine import autotune, config
from multiproc import run_ranks


def test_gaussian_process_interpolates_and_proposes_near_the_optimum():
    rng = np.random.default_rng(1)
    # Score peaks at 20 MiB / 2 ms; after a handful of samples the proposal should move towards it.
    def score(p):
        return 100 - (p[0] - 20) ** 2 / 10 - (p[1] - 2) ** 2 * 5

    samples = [(p, score(p)) for p in autotune.SEEDS]
    for _ in range(8):
        p = autotune.propose(samples, noise=0.01, rng=rng)
        assert 0 <= p[0] <= 64 and 0 <= p[1] <= 10
        samples.append((p, score(p)))
    best = max(samples, key=lambda s: s[1])[0]
    assert abs(best[0] - 20) < 12 and abs(best[1] - 2) < 3, samples


def test_fixed_knobs_are_never_tuned(tmp_path):
    cfg = config.load({"HOROVOD_AUTOTUNE": "1", "HOROVOD_FUSION_THRESHOLD": "1048576",
                       "HOROVOD_HIERARCHICAL_ALLGATHER": "1", "HOROVOD_CACHE_CAPACITY": "0",
                       "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                       "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6"})
    tuner = autotune.Autotuner(cfg, str(tmp_path / "log.csv"))
    changes = [tuner.record(1000, t) for t in np.arange(0.0, 1.0, 0.01)]
    seen = [c for c in changes if c]
    assert seen and all("fusion_threshold" not in c for c in seen)
    assert tuner.done
    rows = list(csv.reader(open(tmp_path / "log.csv")))
    assert rows[0] == autotune.LOG_HEADER.split(",")
    assert len(rows) == 1 + 6 + 1  # header, every sample, the final choice
    # The categorical columns record the job's own settings (hierarchical allgather on, cache off).
    assert all(row[:4] == ["0", "1", "0", "0"] for row in rows[1:])
    assert all(int(row[5]) == 1048576 for row in rows[1:])  # the fixed fusion threshold


def _tuning_job():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    xs = [np.full(20000, hvd.rank() + 1.0, np.float32) for _ in range(8)]
    for _ in range(60):
        handles = [hvd.allreduce_async(x, name=f"g{i}", op=hvd.Sum) for i, x in enumerate(xs)]
        results = [hvd.synchronize(h) for h in handles]
        assert all(np.all(r == sum(range(1, hvd.size() + 1))) for r in results)
    rt = basics.runtime()
    return rt.config.fusion_threshold, rt.config.cycle_time_ms, rt.autotuner is not None and rt.autotuner.done


def test_autotune_settles_and_every_rank_applies_the_choice(tmp_path):
    log = tmp_path / "autotune.csv"
    results = run_ranks(_tuning_job, 2, timeout=120, env={
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log), "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6"})
    assert results[0][2], "rank 0's tuner did not finish"
    assert results[0][:2] == results[1][:2], results  # the workers applied what the coordinator chose
    rows = list(csv.DictReader(open(log)))
    assert len(rows) == 7 and all(float(r["score"]) > 0 for r in rows)
