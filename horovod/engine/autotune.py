"""Autotune: Bayesian optimisation of the fusion threshold and the cycle time, on the coordinator.

Only the coordinator plans fusion and holds ready tensors, so it is where both knobs act; it decides and the new
values travel to every rank with the next responses.  The score of a setting is bytes reduced per microsecond
over ``steps_per_sample`` dispatches.  The first ``warmup_samples`` samples are discarded; then a Gaussian process
(RBF kernel, noise ``gaussian_process_noise``) fitted to the scores so far proposes the next setting by expected
improvement, for at most ``bayes_opt_max_samples`` samples, after which the best setting is kept.  Knobs the user
set explicitly are never changed.  Every sample is logged to ``HOROVOD_AUTOTUNE_LOG`` as CSV.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine.config import MIB

logger = logging.getLogger(__name__)

LOG_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
              "tensor_fusion_threshold,score")
# Search box: fusion threshold in MiB, cycle time in ms (a hold window here, so short ones matter most).
BOUNDS = np.array([[0.0, 64.0], [0.0, 10.0]])
SEEDS = [(4.0, 0.5), (32.0, 5.0), (16.0, 2.5), (8.0, 1.0)]


class GaussianProcess:
    """Zero-mean GP regression with an RBF kernel on inputs scaled to [0, 1]."""

    def __init__(self, noise: float, length_scale: float = 0.3):
        self.noise = max(float(noise), 1e-6)
        self.length_scale = length_scale

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-0.5 * d2 / self.length_scale ** 2)

    def fit(self, x: np.ndarray, y: np.ndarray) -> "GaussianProcess":
        self.x = x
        self.mean, self.scale = float(y.mean()), float(y.std() or 1.0)
        yn = (y - self.mean) / self.scale
        k = self._kernel(x, x) + self.noise * np.eye(len(x))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, yn))
        return self

    def predict(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        ks = self._kernel(x, self.x)
        mu = ks @ self.alpha
        v = np.linalg.solve(self.chol, ks.T)
        var = np.clip(1.0 - (v ** 2).sum(0), 1e-12, None)
        return mu * self.scale + self.mean, np.sqrt(var) * self.scale


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float, xi: float = 0.01) -> np.ndarray:
    z = (mu - best - xi) / sigma
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z ** 2) / math.sqrt(2.0 * math.pi)
    return (mu - best - xi) * cdf + sigma * pdf


def propose(samples: Sequence[Tuple[Sequence[float], float]], noise: float, rng: np.random.Generator,
            candidates: int = 512) -> Tuple[float, float]:
    """The next (fusion MiB, cycle ms) to try, given ``(point, score)`` samples (pure)."""
    lo, hi = BOUNDS[:, 0], BOUNDS[:, 1]
    x = (np.array([p for p, _ in samples]) - lo) / (hi - lo)
    y = np.array([s for _, s in samples], dtype=float)
    gp = GaussianProcess(noise).fit(x, y)
    cand = rng.random((candidates, len(lo)))
    mu, sigma = gp.predict(cand)
    best = cand[int(np.argmax(expected_improvement(mu, sigma, float(y.max()))))]
    point = lo + best * (hi - lo)
    return float(point[0]), float(point[1])


class Autotuner:
    """Samples settings while training runs and settles on the best one.

    Args:
        config: the engine config (reads the autotune knobs and which knobs are fixed).
        log_path: CSV file for every sample ("" for none).
    """

    def __init__(self, config, log_path: str = ""):
        self.tune_fusion = "fusion_threshold" not in config.fixed
        self.tune_cycle = "cycle_time_ms" not in config.fixed
        self.steps_per_sample = max(1, int(config.autotune_steps_per_sample))
        self.warmup = max(0, int(config.autotune_warmup_samples))
        self.max_samples = max(1, int(config.autotune_bayes_opt_max_samples))
        self.noise = float(config.autotune_gaussian_process_noise)
        self.current = self._configured = (config.fusion_threshold / MIB, float(config.cycle_time_ms))
        self.samples: List[Tuple[Tuple[float, float], float]] = []
        self.done = not (self.tune_fusion or self.tune_cycle)
        self._rng = np.random.default_rng(0)
        self._queue = list(SEEDS)
        self._steps = 0
        self._bytes = 0
        self._start: Optional[float] = None
        self._warmups_left = self.warmup
        # The log keeps the original's columns; the categorical ones are not tuned here, so each row records the
        # job's setting of them.
        self._categorical = ",".join(str(int(bool(v))) for v in (
            config.hierarchical_allreduce, config.hierarchical_allgather, config.torus_allreduce,
            config.cache_capacity > 0))
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None
        if self._log:
            self._log.write(LOG_HEADER + "\n")
            self._log.flush()

    def _values(self, point: Tuple[float, float]) -> Dict[str, object]:
        fusion_mib, cycle_ms = point
        out: Dict[str, object] = {}
        if self.tune_fusion:
            out["fusion_threshold"] = int(round(fusion_mib * MIB))
        if self.tune_cycle:
            out["cycle_time_ms"] = round(cycle_ms, 3)
        return out

    def _write(self, point: Tuple[float, float], score: float) -> None:
        if self._log:
            # What the job ran with: a fixed knob keeps the value it was given, whatever point was proposed.
            fusion_mib = point[0] if self.tune_fusion else self._configured[0]
            cycle_ms = point[1] if self.tune_cycle else self._configured[1]
            self._log.write(f"{self._categorical},{cycle_ms:.3f},{int(round(fusion_mib * MIB))},{score:.6f}\n")
            self._log.flush()

    def record(self, nbytes: int, now: float) -> Optional[Dict[str, object]]:
        """Account one dispatch of ``nbytes``; returns new knob values when the setting changes."""
        if self.done:
            return None
        if self._start is None:
            self._start = now
        self._bytes += nbytes
        self._steps += 1
        if self._steps < self.steps_per_sample:
            return None
        elapsed_us = max((now - self._start) * 1e6, 1.0)
        score = self._bytes / elapsed_us
        self._steps, self._bytes, self._start = 0, 0, None
        if self._warmups_left > 0:
            self._warmups_left -= 1
            return None
        self.samples.append((self.current, score))
        self._write(self.current, score)
        if len(self.samples) >= self.max_samples:
            self.done = True
            best, best_score = max(self.samples, key=lambda s: s[1])
            logger.info("autotune: settled on fusion %.1f MiB, cycle %.2f ms (%.1f bytes/us)", best[0], best[1],
                        best_score)
            self._write(best, best_score)
            if self._log:
                self._log.close()
            self.current = best
            return self._values(best)
        if self._queue:
            self.current = self._queue.pop(0)
        else:
            self.current = propose(self.samples, self.noise, self._rng)
        return self._values(self.current)

    def close(self) -> None:
        if self._log and not self._log.closed:
            self._log.close()
