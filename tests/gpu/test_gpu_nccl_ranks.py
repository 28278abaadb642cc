"""NCCL between ranks on a GPU (issue 36's device run): two ranks share the one GPU through NCCL >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (tests/gpu/device_check.sh loads ../shared/gpu's NCCL 2.30.7).  Skipped, with the
reason, without a GPU or without such an NCCL; the same scenarios run on the CPU with the stand-in NCCL in
tests/gpu/test_nccl_standin.py.
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the GPU tests run on a GPU machine (tests/gpu/device_check.sh)",
                allow_module_level=True)

from multiproc import run_ranks  # noqa: E402

from horovod.common.basics import nccl_built  # noqa: E402
from tests.gpu import gpu_round2_workers as workers  # noqa: E402

if nccl_built() < 23000:
    pytest.skip(f"NCCL {nccl_built()} < 2.30 cannot put two ranks on one GPU (set HOROVOD_NCCL_SO_PATH to NCCL "
                f"2.30+, e.g. ../shared/gpu: tests/gpu/device_check.sh does)", allow_module_level=True)

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "HOROVOD_NCCL_SO_PATH": os.environ.get("HOROVOD_NCCL_SO_PATH", "")}


def test_process_sets_on_two_streams():
    results = run_ranks(workers.process_sets_two_streams, 2, env={**ENV, "HOROVOD_NUM_NCCL_STREAMS": "2"},
                        timeout=300)
    for rank, r in enumerate(results):
        assert not r["wrong"], (rank, r["wrong"])
        assert r["modes"] == ["NCCL", "NCCL"], (rank, r["modes"])


def test_a_killed_peer_fails_the_survivor_and_frees_its_gpu():
    env = {**ENV, "HOROVOD_GLOO_TIMEOUT_SECONDS": "15", "HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS": "30"}
    outcomes = run_ranks(workers.killed_peer, 2, env=env, timeout=300, expect_failure=True)
    assert outcomes[1].status == "died", outcomes[1]
    status, survivor = outcomes[0]
    assert status == "ok", outcomes[0]
    assert survivor["error"] != "no error", survivor
    assert survivor["gpu_released"], survivor


def test_a_new_engine_rebuilds_its_communicators():
    for rank, r in enumerate(run_ranks(workers.rebuilt_communicators, 2, env=ENV, timeout=300)):
        assert not r["wrong"] and r["modes"] == ["NCCL"] * 3, (rank, r)


def test_hierarchical_allreduce_inside_and_across_emulated_hosts():
    """Issue 36's composition on real NCCL: a set of two hosts of two ranks (one GPU) allreduces on 2-rank
    communicators inside each host and on the CPU transport across them (the stand-in's version of this runs on the
    CPU: tests/gpu/test_device_hierarchical.py)."""
    results = run_ranks(workers.hierarchical_allreduce, 4, env={**ENV, "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
                        hosts=["a", "a", "b", "b"], timeout=300)
    for rank, r in enumerate(results):
        assert not r["wrong"] and r["mode"] == "NCCL", (rank, r)
        assert r["shape"] == {"local": [2], "cross": 2}, (rank, r)
