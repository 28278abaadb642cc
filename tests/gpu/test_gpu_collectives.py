"""GPU collectives on real CUDA tensors across real processes (skipped, with the reason, where no GPU is present).

One GPU is enough: at np = 1 the collectives run through NCCL; at np = 2 and 4 the ranks share the GPU, which
NCCL refuses before 2.30, so the engine stages them through host memory (with a notice) — unless NCCL >= 2.30 and
``NCCL_MULTI_RANK_GPU_ENABLE=1``, where np = 2 runs on NCCL too.
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the GPU tests run on a GPU machine (tests/gpu/device_check.sh)",
                allow_module_level=True)

from checks import assert_no_failures  # noqa: E402
from multiproc import run_ranks  # noqa: E402

from horovod.common.basics import nccl_built  # noqa: E402
from tests.gpu import gpu_workers  # noqa: E402

NCCL_VERSION = nccl_built()
MULTI_RANK = NCCL_VERSION >= 23000


# The ranks get no HOROVOD_* variable of this process (tests/multiproc.py), but must load the NCCL the device run
# chose (tests/gpu/device_check.sh: NCCL 2.30 for two ranks on one GPU).
NCCL_ENV = {k: os.environ[k] for k in ("HOROVOD_NCCL_SO_PATH",) if os.environ.get(k)}


def _run(fn, np_, env=None, args=()):
    return run_ranks(fn, np_, args=args, env={**NCCL_ENV, **(env or {})}, timeout=300)


@pytest.mark.skipif(not NCCL_VERSION, reason="NCCL cannot be loaded here")
def test_np1_every_collective_on_nccl():
    results = _run(gpu_workers.collectives, 1)
    assert_no_failures([r["report"] for r in results], minimum_checks=100)
    assert [r["mode"] for r in results] == ["NCCL"]


@pytest.mark.skipif(not NCCL_VERSION, reason="NCCL cannot be loaded here")
def test_np1_on_two_nccl_streams():
    results = _run(gpu_workers.collectives, 1, env={"HOROVOD_NUM_NCCL_STREAMS": "2"},
                   args=(("float32", "bfloat16", "int64"),))
    assert_no_failures([r["report"] for r in results], minimum_checks=30)
    assert [r["mode"] for r in results] == ["NCCL"]


@pytest.mark.parametrize("np_", [2, 4])
def test_shared_gpu_is_host_staged_with_a_notice(np_):
    results = _run(gpu_workers.collectives, np_)
    assert_no_failures([r["report"] for r in results], minimum_checks=100)
    assert {r["mode"] for r in results} == {"HOST"}
    assert any("staged through host memory" in n for n in results[0]["notices"]), results[0]["notices"]


def test_host_staging_on_request():
    results = _run(gpu_workers.collectives, 2, env={"HOROVOD_GPU_OPERATIONS": "HOST"},
                   args=(("float32", "bfloat16", "int64"),))
    assert_no_failures([r["report"] for r in results], minimum_checks=30)
    assert {r["mode"] for r in results} == {"HOST"}
    assert any("HOROVOD_GPU_OPERATIONS=HOST" in n for n in results[0]["notices"])


@pytest.mark.skipif(not MULTI_RANK, reason=f"NCCL {NCCL_VERSION} < 2.30: two ranks cannot share a GPU on NCCL")
def test_np2_on_nccl_sharing_the_gpu():
    results = _run(gpu_workers.collectives, 2, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert_no_failures([r["report"] for r in results], minimum_checks=100)
    assert {r["mode"] for r in results} == {"NCCL"}


@pytest.mark.parametrize("mode_env", [{}, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}] if MULTI_RANK else [{}])
def test_distributed_optimizer_matches_one_process(mode_env):
    results = _run(gpu_workers.optimizer, 2, env=mode_env)
    for r in results:
        assert r["max_diff"] < 1e-5, results
    assert {r["mode"] for r in results} == ({"NCCL"} if mode_env else {"HOST"})


def test_fp16_compression_on_gpu():
    for r in _run(gpu_workers.optimizer, 2, args=(4, True)):
        assert r["max_diff"] < 2e-3, r


def test_sync_batch_norm_on_gpu():
    for r in _run(gpu_workers.sync_batch_norm, 2):
        assert r["on_gpu"] == 1.0, r
        assert max(r["output"], r["grad"], r["running_mean"], r["running_var"]) < 1e-4, r


def test_cpu_and_gpu_tensors_under_one_name_fail_every_rank():
    results = _run(gpu_workers.mismatch, 2)
    for text in results:
        assert "Mismatched CPU/GPU device selection" in text, results


@pytest.mark.skipif(not NCCL_VERSION, reason="NCCL cannot be loaded here")
def test_timeline_names_gpu_activities(tmp_path):
    path = tmp_path / "timeline.json"
    assert _run(gpu_workers.timeline, 1, env={"HOROVOD_TIMELINE": str(path)}) == ["NCCL"]
    names = {e.get("name") for e in json.loads(path.read_text())}
    for want in ("NCCL_ALLREDUCE", "INIT_NCCL", "MEMCPY_IN_FUSION_BUFFER"):
        assert want in names, sorted(n for n in names if n)


def test_queries_tell_the_truth():
    assert nccl_built() > 0
    from horovod.common.basics import cuda_built

    assert cuda_built()
    from horovod.runner.launch import check_build_text

    assert "[X] NCCL" in check_build_text()
