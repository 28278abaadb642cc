"""Collective conformance for every binding over every transport, against numpy.

Each case (``conformance_cases.CASES``: a collective x dtype, grouped and in-place forms, large tensors) is a test
of its own, parametrised over (binding, transport, np): ``test_allreduce_bf16[torch-shm-np3]``, so
``-k allreduce_bf16`` or ``-k "torch and shm"`` selects what to run.  Starting ranks is what costs time, so the
first test of a (binding, transport, np) runs one job with every case selected for that combination and the
other tests read their case's reports from it.

Bindings whose framework is not installed here are skipped with the reason (MXNet lives in its own venv:
``.venv-mxnet/bin/python -m pytest tests/conformance -k mxnet``).
"""
from __future__ import annotations

import importlib.util
import shutil
from typing import List, Optional, Tuple

import pytest

from binding_adapters import skip_reason
from checks import JobPerCombination, assert_no_failures
from conformance_cases import CASES, conformance_job
from engine_helpers import run, transport_skip_reason

# (binding, transport, np): every binding over tcp at np = 2 and over shm at np = 3 (an odd world: uneven splits,
# remainders), and the mpi transport under mpirun once.  Each combination costs one job (a TF job ~20-30 s on a
# loaded 2-core machine), so more are added with care; the transports' own suites cover their algorithms.
COMBOS: List[Tuple[str, str, int]] = [(b, t, n) for b in ("numpy", "torch", "tensorflow", "mxnet")
                                      for t, n in (("tcp", 2), ("shm", 3))]
COMBOS.append(("numpy", "mpi", 2))
# The device path: emulated over host memory everywhere (staged, as a GPU job without NCCL), on CUDA where a GPU
# is (np = 1: NCCL; np >= 2 on one GPU: staged, unless NCCL >= 2.30 lets ranks share it).
# The NCCL path without a GPU: the stand-in NCCL over host memory (tests/gpu/standin_nccl).
COMBOS += [("device-nccl", "tcp", 2), ("device-nccl", "shm", 3)]
COMBOS += [("device", "tcp", 2), ("device", "shm", 3), ("device", "mpi", 2),
           ("torch-cuda", "tcp", 1), ("torch-cuda", "tcp", 2), ("torch-cuda", "shm", 3)]
# JAX: every transport, and the sizes the others do not take (1 and 4), once each. (Sessions 7-9 ran every
# transport at every size from 1 to 4, 15 jobs, ~6 min of CI: nothing JAX-specific ever failed at one size only;
# the engine's own matrix, tests/engine/test_engine_conformance.py, covers every transport at np = 1-4.)
COMBOS += [("jax", "tcp", 2), ("jax", "shm", 3), ("jax", "mpi", 2), ("jax", "hierarchical", 3), ("jax", "tcp", 1),
           ("jax", "shm", 4)]
# ... and inside jax.jit (ordered host callbacks) once: ~2 min, most of it compiling a program per case.
COMBOS.append(("jax-jit", "shm", 3))
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
              "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
JOB_TIMEOUT = 300.0



def _transport_skip_reason(transport: str) -> Optional[str]:
    if transport == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (install Open MPI)"
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py)"
        return None
    return transport_skip_reason(transport)


def _two_hosts(np_: int) -> List[str]:
    """The first half of the ranks on "localhost", the rest on "127.0.0.1" (the first host gets the odd rank)."""
    first = (np_ + 1) // 2
    return ["localhost"] * first + ["127.0.0.1"] * (np_ - first)


def _combo_id(combo: Tuple[str, str, int]) -> str:
    return f"{combo[0]}-{combo[1]}-np{combo[2]}"


_jobs = JobPerCombination(_combo_id)   # one job per combination; each test reads its case's reports


def _case_skip_reason(binding: str, case: str) -> Optional[str]:
    _fn, dtype, inplace = CASES[case]
    return skip_reason(binding, dtype, inplace)


def _selected_cases(session, combo) -> List[str]:
    """The cases of ``combo`` this pytest run selected and the binding can run, in catalogue order."""
    wanted = JobPerCombination.selected(session, combo)
    return [name for name in CASES if name in wanted and _case_skip_reason(combo[0], name) is None]


def _reports(request, combo, case: str) -> List[dict]:
    binding, transport, np_ = combo

    def start() -> List[dict]:
        names = _selected_cases(request.session, combo) or [case]
        # hierarchical (shared memory inside a host, TCP across hosts) needs two hosts: two names of this machine
        hosts = _two_hosts(np_) if transport == "hierarchical" else None
        return run(conformance_job, np_, transport, args=(binding, names), env=WORKER_ENV,
                   timeout=JOB_TIMEOUT * (2 if binding == "jax-jit" else 1),   # compiles per case
                   launcher="mpirun" if transport == "mpi" else "subprocess", hosts=hosts)
    return _jobs.reports(combo, case, start)


def _make_test(case: str):
    @pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
    def test(combo, request):
        binding, transport, _np = combo
        reason = _case_skip_reason(binding, case) or _transport_skip_reason(transport)
        if reason:
            pytest.skip(reason)
        assert_no_failures(_reports(request, combo, case))

    test.__name__ = test.__qualname__ = f"test_{case}"
    test.__doc__ = f"{case} through each binding's public API matches numpy."
    return test


for _case in CASES:
    globals()[f"test_{_case}"] = _make_test(_case)
