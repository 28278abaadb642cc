"""The test suite's own machinery: the result collector (tests/checks.py), the multi-process harness
(tests/multiproc.py) under each launcher, and selecting conformance cases by name."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from checks import Checks, assert_no_failures
from multiproc import REPO, RankFailed, rank_and_size, report, run_ranks

HAVE_MPI = shutil.which("mpirun") is not None


# -- the collector -------------------------------------------------------------------------------------------------
def test_assert_no_failures_fails_when_a_rank_checked_nothing():
    busy, idle = Checks(0), Checks(1)
    busy.true(True, "something")
    with pytest.raises(AssertionError, match=r"\(1, 0\)"):
        assert_no_failures([busy.report(), idle.report()])
    with pytest.raises(AssertionError, match="no rank reported"):
        assert_no_failures([])
    idle.true(True, "now it checked")
    assert_no_failures([busy.report(), idle.report()])
    with pytest.raises(AssertionError, match="too few checks"):
        assert_no_failures([busy.report()], minimum_checks=2)


def test_checks_record_every_failure_with_its_rank():
    c = Checks(3)
    c.equal(np.arange(3), np.arange(3), "same")
    c.equal(np.arange(3, dtype=np.int32), np.arange(3), "dtype")
    c.equal(np.zeros((2, 2)), np.zeros(4), "shape")
    c.equal(np.array([1.0, 2.0]), np.array([1.0, 2.5]), "values")
    c.close(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]), "within tolerance", rtol=1e-6)
    c.raises("raises", ValueError, int, "x", match="invalid literal")
    c.raises("does not raise", ValueError, int, "3")
    c.raises("wrong type", KeyError, int, "x")
    c.run("crash", lambda: 1 / 0)
    rep = c.report()
    assert (rep["rank"], rep["checked"], rep["failed"]) == (3, 9, 6), rep
    text = "\n".join(rep["items"])
    for fragment in ("rank 3: dtype: dtype int32, expected int64", "shape: shape (2, 2), expected (4,)",
                     "values: values differ (1 of 2", "does not raise: did not raise ValueError",
                     "wrong type: raised ValueError", "crash raised", "ZeroDivisionError"):
        assert fragment in text, (fragment, text)
    with pytest.raises(AssertionError, match="6 of 9 checks failed"):
        assert_no_failures([rep])


def test_checks_compare_framework_tensors():
    torch = pytest.importorskip("torch")
    c = Checks(0)
    c.equal(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16), "bf16")
    c.equal(torch.ones(2), torch.ones(2, dtype=torch.float64), "dtype")
    c.equal(np.ones(2, dtype=np.float32), torch.ones(2), "a numpy result where a tensor was expected")
    rep = c.report()
    assert rep["failed"] == 2 and "expected a torch.Tensor" in rep["items"][1], rep
    loose = Checks(0, strict_dtype=False, rtol=1e-6)
    loose.close(torch.ones(2), np.ones(2), "values only")
    assert loose.report()["failed"] == 0


# -- the harness ---------------------------------------------------------------------------------------------------
def _whoami(offset):
    rank, size = rank_and_size()
    return rank + offset, size


def _fails_on_one(victim):
    rank, _ = rank_and_size()
    if rank == victim:
        raise ValueError(f"rank {rank} fails on purpose")
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()   # waits for the failed rank forever unless the job is ended
    return rank


LAUNCHERS = ["subprocess", "fork", pytest.param("mpirun", marks=pytest.mark.skipif(not HAVE_MPI,
                                                                                   reason="mpirun is not on PATH"))]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_returns_results_by_rank(launcher):
    assert run_ranks(_whoami, 3, args=(10,), launcher=launcher, timeout=120) == [(10, 3), (11, 3), (12, 3)]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_test_with_its_traceback(launcher):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="(?s)rank 1 failed.*ValueError: rank 1 fails on purpose"):
        run_ranks(_fails_on_one, 3, args=(1,), launcher=launcher, timeout=120)
    assert time.monotonic() - start < 100, "the other ranks were not ended: the job ran into its timeout"


def _sleeps():
    time.sleep(300)


@pytest.mark.parametrize("launcher", ["subprocess", "fork"])
def test_a_hang_fails_within_the_timeout_and_kills_the_ranks(launcher):
    pids = []

    def note(job):
        pids.extend(p.pid for p in job.procs.values())

    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 3 s"):
        run_ranks(_sleeps, 2, launcher=launcher, timeout=3, on_start=note)
    assert time.monotonic() - start < 60
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"rank process {pid} survived"


def _reports_then_waits():
    rank, _ = rank_and_size()
    report(("started", rank))
    time.sleep(300 if rank == 1 else 0)
    return rank


def test_messages_kill_and_outcomes():
    def kill_rank_1(job):
        got = sorted(job.messages(2, timeout=60))
        assert got == [(0, ("started", 0)), (1, ("started", 1))], got
        job.kill(1)

    out = run_ranks(_reports_then_waits, 2, launcher="fork", on_start=kill_rank_1, expect_failure=True, timeout=60)
    assert [(o.rank, o.status) for o in out] == [(0, "ok"), (1, "died")], out
    status, value = out[0]
    assert (status, value) == ("ok", 0)


# -- selecting conformance cases by name ------------------------------------------------------------------------------
def test_conformance_cases_are_selected_by_name():
    """``-k allreduce_f32`` runs that case alone; the job of its combination runs only what was selected."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300",
                           "tests/conformance/test_collective_conformance.py", "-k", "allreduce_f32 and numpy-tcp",
                           "-rA"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout and "PASSED tests/conformance/test_collective_conformance.py::" \
        "test_allreduce_f32[numpy-tcp-np2]" in proc.stdout, proc.stdout[-3000:]


# -- warm ranks (tests/rank_pool.py) and the test folders ----------------------------------------------------------
def _rank_state(tag):
    import os

    import horovod.numpy as hvd

    was_initialized = hvd.is_initialized()
    hvd.init()
    total = float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
    return {"pid": os.getpid(), "was_initialized": was_initialized, "tag": os.environ.get("HVD_TEST_TAG"),
            "total": total, "tag_arg": tag}


def _fail_on_rank_1():
    import os

    if int(os.environ["HOROVOD_RANK"]) == 1:
        raise RuntimeError("planted")
    return os.getpid()


def test_warm_ranks_serve_the_next_call_as_fresh_ones_would():
    first = run_ranks(_rank_state, 2, args=("a",), env={"HOROVOD_CYCLE_TIME": "0", "HVD_TEST_TAG": "one"})
    second = run_ranks(_rank_state, 2, args=("b",), env={"HOROVOD_CYCLE_TIME": "0", "HVD_TEST_TAG": "two"})
    # The same processes (warm), each call with its own environment, Horovod shut down in between.
    assert [r["pid"] for r in first] == [r["pid"] for r in second], (first, second)
    assert [(r["was_initialized"], r["tag"], r["total"]) for r in second] == [(False, "two", 2.0)] * 2, second
    # A call in which a rank failed leaves no warm ranks behind: the next call starts fresh processes.
    with pytest.raises(RankFailed, match="planted"):
        run_ranks(_fail_on_rank_1, 2)
    third = run_ranks(_rank_state, 2, args=("c",), env={"HOROVOD_CYCLE_TIME": "0"})
    assert not {r["pid"] for r in third} & {r["pid"] for r in second}, (second, third)


def _folders_seen_from_a_rank(names):
    import importlib.util

    return {name: importlib.util.find_spec(name) is not None for name in names}


def test_test_folders_never_stand_in_for_packages_in_a_rank():
    """tests/ is on every rank's path: a test folder (no __init__.py) must not import as a namespace package there,
    or a missing framework (tests/jax without JAX) reads as installed and libraries probing for it fail."""
    tests_dir = os.path.join(REPO, "tests")
    folders = sorted(d for d in os.listdir(tests_dir) if os.path.isdir(os.path.join(tests_dir, d))
                     and not os.path.exists(os.path.join(tests_dir, d, "__init__.py")) and d != "__pycache__")
    assert "engine" in folders and "jax" in folders
    import importlib.util

    here = {name: importlib.util.find_spec(name) is not None for name in folders}   # hidden by conftest here
    for launcher in ("subprocess", "fork"):
        (seen,) = run_ranks(_folders_seen_from_a_rank, 1, args=(folders,), launcher=launcher)
        assert seen == here, (launcher, seen, here)
    assert here["engine"] is False and here["doctor"] is False   # never installed: a folder alone would say True
