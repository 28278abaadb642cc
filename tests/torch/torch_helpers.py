"""Shared pieces of the horovod.torch test suite (a helper module, not a test).

Worker functions run inside ``tests/multiproc.run_ranks`` children; this module is shipped to them by value.
Inputs are generated from ``(seed, rank)`` so that every rank can rebuild what the others held and compute the
expected result itself; workers collect mismatches in a :class:`checks.Checks` instead of stopping at the first,
so one job (one process start per rank) checks hundreds of cases.

``tests/torch`` must stay without ``__init__.py``: with ``tests/`` on ``sys.path`` a package named ``torch``
here would shadow PyTorch.
"""
from __future__ import annotations

import os
import sys
import zlib
from typing import Any, Dict

import cloudpickle

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from multiproc import suite_runner  # noqa: E402  (tests/ is not a package)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# One intra-op thread per rank: np = 4 on 2 cores would otherwise thrash (and startup is faster).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SIZES = (1, 2, 3, 4)


#: ``run_ranks`` with the suite's worker environment.
run = suite_runner(WORKER_ENV, timeout=120.0)


def seed_of(*parts: Any) -> int:
    """A stable 32-bit seed from any printable parts."""
    return zlib.crc32(repr(parts).encode())


def int_values(shape, dtype, seed: int, kind: str = "small"):
    """A tensor of small integers (exact in every dtype, bfloat16 included) of ``dtype``.

    ``kind``: ``small`` (sums stay small), ``prod`` (values whose products stay small), ``bool``.
    """
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(np.asarray(rng.random(shape) < 0.5))
    unsigned = dtype in (torch.uint8,) or str(dtype) == "torch.uint16"
    if kind == "prod":
        choices = np.array([1, 2] if unsigned else [-2, -1, 1, 2])
        raw = rng.choice(choices, size=shape)
    else:
        raw = rng.integers(0 if unsigned else -4, 5, size=shape)
    raw = np.asarray(raw, dtype=np.int64).reshape(shape)
    if str(dtype) == "torch.uint16":
        return torch.from_numpy(raw.astype(np.uint16))
    return torch.from_numpy(raw).to(dtype)


# -- a small model and deterministic data shared by workers and the single-process references ------------
def make_model(seed: int = 0, dtype=None):
    """A small float64 MLP with one parameter that never gets a gradient (exercises the zero-fill path)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 8)
            self.fc2 = torch.nn.Linear(8, 3)
            self.unused = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(seed)
    return Net().to(dtype or torch.float64)


def batch(step: int, rank: int, rows: int = 6, dtype=None):
    """Rank ``rank``'s batch for ``step``: inputs (rows, 4) and regression targets (rows, 3)."""
    import torch

    g = torch.Generator().manual_seed(seed_of("batch", step, rank))
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    return x.to(dtype or torch.float64), y.to(dtype or torch.float64)


def params_of(model) -> Dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
