"""Shared pieces of the horovod.mxnet test suite (a helper module, not a test).

MXNet 1.9.1 needs ``numpy<1.24``, so these tests run in a venv of their own (``.ci/run`` builds it as
``.venv-mxnet``); in any interpreter where ``import mxnet`` fails, every test here is skipped with the reason.

``tests/mxnet`` must stay without ``__init__.py`` and without a module named ``mxnet``: ``tests/`` is on the
workers' ``sys.path``.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import cloudpickle

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS_DIR)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from multiproc import suite_runner  # noqa: E402  (tests/ is not a package)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# One compute thread per rank: np = 3 on 2 cores would otherwise thrash.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
              "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice"}


def mxnet_unavailable() -> Optional[str]:
    """Why ``import mxnet`` fails in this interpreter, or ``None`` when it works."""
    import importlib.util

    # With tests/ on sys.path, this very directory would import as an empty namespace package named mxnet.
    spec = importlib.util.find_spec("mxnet") if "mxnet" not in sys.modules else None
    if "mxnet" not in sys.modules and (spec is None or spec.origin in (None, "namespace")):
        return (f"mxnet is not installed for {sys.executable}; run these tests with the MXNet venv: "
                f".venv-mxnet/bin/python -m pytest tests/mxnet (see .ci/run)")
    try:
        import mxnet

        mxnet.nd.NDArray  # noqa: B018  (a namespace package or a broken install has no nd)
    except Exception as exc:   # ImportError, or numpy>=1.24 removed aliases (AttributeError), or a missing .so
        return (f"mxnet is not importable in {sys.executable} ({type(exc).__name__}: {exc}); run these tests with "
                f"the MXNet venv: .venv-mxnet/bin/python -m pytest tests/mxnet (see .ci/run)")
    return None


#: ``run_ranks`` in this interpreter (the MXNet venv) with the suite's worker environment.
run = suite_runner(WORKER_ENV, timeout=120.0, python=sys.executable)
