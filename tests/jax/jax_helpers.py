"""Shared pieces of the horovod.jax test suite (a helper module, not a test).

Worker functions run inside ``tests/multiproc.run_ranks`` children; this module is shipped to them by value.
Inputs are built from ``(tag, rank)`` so every rank can rebuild what the others held and compute the expected
result with numpy; workers collect mismatches in a :class:`checks.Checks` instead of stopping at the first.

``tests/jax`` must stay without ``__init__.py``, and :func:`require_jax` is how a test module asks for JAX: with
``tests/`` on ``sys.path`` a missing JAX would otherwise import as an empty namespace package named ``jax``.
"""
from __future__ import annotations

import importlib
import os
import sys
import zlib
from typing import Any

import cloudpickle
import pytest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS_DIR)
if TESTS_DIR not in sys.path:
    sys.path.append(TESTS_DIR)

from multiproc import suite_runner  # noqa: E402  (tests/ is not a package)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# One compute thread per rank (np = 4 on 2 cores would otherwise thrash), CPU only, 64-bit types available.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "JAX_ENABLE_X64": "1",
              "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
SIZES = (1, 2, 3, 4)


def require_jax():
    """Skip the calling test module unless real JAX and optax are installed; returns the jax module."""
    try:
        jax = importlib.import_module("jax")
        jax.Array  # noqa: B018  (a folder or stub named jax has no Array: AttributeError skips, as wanted)
        importlib.import_module("optax")
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"horovod.jax needs jax and optax (pip install 'horovod-next[jax]'): {exc}",
                    allow_module_level=True)
    return jax


#: ``run_ranks`` with the suite's worker environment (JAX's imports and first traces want the longer timeout).
run = suite_runner(WORKER_ENV, timeout=180.0)


def seed_of(*parts: Any) -> int:
    """A stable 32-bit seed from any printable parts."""
    return zlib.crc32(repr(parts).encode())


def values(tag: Any, rank: int, shape, dtype: str = "float32"):
    """Small integers (exact sums in every dtype, bfloat16 included) as a numpy array of ``dtype``."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    import numpy as np

    rng = np.random.default_rng(seed_of(tag, rank, tuple(shape), dtype))
    unsigned = dtype.startswith("uint")
    raw = rng.integers(0 if unsigned else -4, 5, size=shape)
    return np.asarray(raw).astype(np.dtype(dtype))
