"""``horovod.spark.run`` on a real two-executor Spark cluster (the session fixture in conftest.py).

Every test runs a real Horovod job whose ranks are Spark tasks on the executors; results are checked
against numpy.
"""
import io
import os
import sys
import time

import cloudpickle
import numpy as np
import pytest

import horovod.spark
from horovod.runner.exec import LaunchNotAvailableError

# The executors cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _collectives(scale):
    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = np.arange(6, dtype=np.float32) * (rank + 1) * scale
    summed = hvd.allreduce(data, op=hvd.Sum)
    gathered = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int64))
    root = hvd.broadcast(np.array([rank * 10 + 1], dtype=np.int64), root_rank=size - 1)
    out = dict(rank=rank, size=size, local_rank=hvd.local_rank(), local_size=hvd.local_size(),
               summed=summed, gathered=gathered, root=int(root[0]), pid=os.getpid(),
               host=os.environ["HOROVOD_HOSTNAME"])
    hvd.shutdown()
    return out


@pytest.mark.parametrize("num_proc", [1, 2, 3])
def test_run_results_in_rank_order_and_collectives(spark, num_proc):
    results = horovod.spark.run(_collectives, args=(2.0,), num_proc=num_proc, verbose=0)
    assert [r["rank"] for r in results] == list(range(num_proc))
    expected_sum = np.arange(6, dtype=np.float32) * 2.0 * sum(range(1, num_proc + 1))
    expected_gather = np.concatenate([np.full((r + 1, 2), r, dtype=np.int64) for r in range(num_proc)])
    for r in results:
        assert r["size"] == num_proc
        np.testing.assert_allclose(r["summed"], expected_sum)
        np.testing.assert_array_equal(r["gathered"], expected_gather)
        assert r["root"] == (num_proc - 1) * 10 + 1
    # Every executor of local-cluster runs on this machine: one host, so local ranks follow the ranks.
    assert {r["host"] for r in results} == {results[0]["host"]}
    assert [r["local_rank"] for r in results] == list(range(num_proc))
    assert all(r["local_size"] == num_proc for r in results)
    assert len({r["pid"] for r in results}) == num_proc
    assert _wait_gone([r["pid"] for r in results]) == []


def _env_and_output(tag):
    import sys

    import horovod.numpy as hvd

    hvd.init()
    print(f"out {tag} from rank {hvd.rank()}", flush=True)
    print(f"err {tag} from rank {hvd.rank()}", file=sys.stderr, flush=True)
    env = {k: os.environ.get(k) for k in ("HVD_SPARK_TEST_VAR", "HVD_SPARK_DRIVER_VAR", "OMP_NUM_THREADS",
                                         "HOROVOD_RANK", "_HOROVOD_SECRET_KEY")}
    hvd.shutdown()
    return env


def test_env_and_output_forwarding(spark, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    results = horovod.spark.run(_env_and_output, args=("xyz",), num_proc=2, verbose=0, stdout=out, stderr=err,
                                env={"PATH": os.environ["PATH"], "HVD_SPARK_TEST_VAR": "given"})
    for rank, env in enumerate(results):
        assert env["HVD_SPARK_TEST_VAR"] == "given"
        assert env["HVD_SPARK_DRIVER_VAR"] is None          # env replaces the driver's environment
        assert env["HOROVOD_RANK"] == str(rank)
        assert env["OMP_NUM_THREADS"] is not None           # set like horovodrun does
        assert env["_HOROVOD_SECRET_KEY"]                    # the job secret reached the worker
        assert f"[{rank}]<stdout>:out xyz from rank {rank}\n" in out.getvalue()
        assert f"[{rank}]<stderr>:err xyz from rank {rank}\n" in err.getvalue()
    assert "<stderr>" not in out.getvalue() and "<stdout>" not in err.getvalue()

    # env=None: the driver's environment, as the original; timestamps before the tags when asked.
    monkeypatch.setenv("HVD_SPARK_DRIVER_VAR", "from-driver")
    out = io.StringIO()
    results = horovod.spark.run(_env_and_output, args=("ts",), num_proc=1, verbose=0, stdout=out,
                                stderr=io.StringIO(), prefix_output_with_timestamp=True)
    assert results[0]["HVD_SPARK_DRIVER_VAR"] == "from-driver"
    line = [ln for ln in out.getvalue().splitlines() if "out ts" in ln][0]
    assert line.endswith("[0]<stdout>:out ts from rank 0") and not line.startswith("[0]")


def _fail_on_rank_one(pid_dir):
    import horovod.numpy as hvd

    hvd.init()
    with open(os.path.join(pid_dir, f"pid.{hvd.rank()}"), "w") as handle:
        handle.write(str(os.getpid()))
    if hvd.rank() == 1:
        time.sleep(1.0)
        raise ValueError("boom on rank 1")
    time.sleep(600)   # rank 0 would wait for ever: the driver must stop it


def test_failing_rank_fails_the_job_with_rank_and_traceback(spark, tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_fail_on_rank_one, args=(str(tmp_path),), num_proc=2, verbose=0,
                          stdout=io.StringIO(), stderr=io.StringIO())
    message = str(info.value)
    assert "Rank: 1" in message
    assert "ValueError: boom on rank 1" in message
    assert "_fail_on_rank_one" in message                   # the task's traceback, not just its last line
    assert time.monotonic() - started < 300                 # failed fast, not after Spark's retries
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    assert _wait_gone(pids, timeout=10) == []                # no stray worker


def _stall_on_rank_one():
    import horovod.numpy as hvd

    hvd.init()
    hvd.allreduce(np.ones(512, dtype=np.float32), name="warm")
    if hvd.rank() == 1:
        time.sleep(600)  # RANK ONE SLEEPS HERE
    hvd.allreduce(np.ones(512, dtype=np.float32), name="grad")  # RANK ZERO WAITS HERE


def test_hang_doctor_verdict_in_the_failure_message(spark, tmp_path):
    """The stall inspector fails rank 0's allreduce; the driver collects both ranks' dumps (rank 1 sleeps) and
    the failure message names the sleeping rank, the tensor and both lines."""
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "4",
           "HOROVOD_FLIGHT_RECORDER_DIR": str(tmp_path / "dumps")}
    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_stall_on_rank_one, num_proc=2, verbose=0, env={**os.environ, **env},
                          stdout=io.StringIO(), stderr=io.StringIO())
    message = str(info.value)
    lines = {marker: next(i for i, text in enumerate(open(__file__).read().splitlines(), start=1)
                          if text.rstrip().endswith(marker)) for marker in ("# RANK ONE SLEEPS HERE",
                                                                            "# RANK ZERO WAITS HERE")}
    assert "Horovod doctor (2 of 2 ranks dumped" in message, message
    # The function travels by value (cloudpickle drops its file name): the verdict names it and its lines.
    assert (f"rank 1 never submitted allreduce 'grad' (its collective #2): it is in _stall_on_rank_one() at "
            f"<dynamic-code>:{lines['# RANK ONE SLEEPS HERE']}") in message, message
    assert (f"rank 0 waits in it (_stall_on_rank_one() at <dynamic-code>:{lines['# RANK ZERO WAITS HERE']})"
            in message), message


def test_start_timeout_when_too_few_slots(spark, monkeypatch):
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start\.") as info:
        horovod.spark.run(_collectives, args=(1.0,), num_proc=5, start_timeout=3, verbose=0)
    assert "start_timeout" in str(info.value)
    # HOROVOD_SPARK_START_TIMEOUT is the default, as in the original.
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start\."):
        horovod.spark.run(_collectives, args=(1.0,), num_proc=5, verbose=0)
    assert time.monotonic() - started < 120
    # The cluster is still usable afterwards (nothing was left pending).
    assert [r["rank"] for r in horovod.spark.run(_collectives, args=(1.0,), num_proc=2, verbose=0)] == [0, 1]


def test_bad_arguments(spark):
    with pytest.raises(ValueError, match="use_gloo or use_mpi"):
        horovod.spark.run(_collectives, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="num_proc"):
        horovod.spark.run(_collectives, num_proc=0)
    with pytest.raises(ValueError, match="HOROVOD_SPARK_START_TIMEOUT"):
        os.environ["HOROVOD_SPARK_START_TIMEOUT"] = "soon"
        try:
            horovod.spark.run(_collectives, num_proc=1)
        finally:
            del os.environ["HOROVOD_SPARK_START_TIMEOUT"]


def _lose_task_of_rank_one(pid_dir):
    import signal

    import horovod.numpy as hvd

    hvd.init()
    with open(os.path.join(pid_dir, f"pid.{hvd.rank()}"), "w") as handle:
        handle.write(str(os.getpid()))
    hvd.allreduce(np.ones(3), name="before")
    if hvd.rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)   # the executor's Python worker running this rank's task
        time.sleep(600)
    hvd.allreduce(np.ones(3), name="after")      # rank 0 waits here for a peer that is gone
    time.sleep(600)


def test_lost_task_fails_the_job_naming_the_rank(spark, tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_lose_task_of_rank_one, args=(str(tmp_path),), num_proc=2, verbose=0,
                          stdout=io.StringIO(), stderr=io.StringIO())
    message = str(info.value)
    assert "Rank: 1" in message or "Cause: rank 1" in message, message
    assert time.monotonic() - started < 300
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    assert _wait_gone(pids, timeout=10) == []
    # The cluster is usable at once: the barrier stage Spark resubmitted was cancelled.
    assert [r["rank"] for r in horovod.spark.run(_collectives, args=(1.0,), num_proc=2, verbose=0)] == [0, 1]


def test_layout_keeps_the_ranks_of_a_host_together():
    from horovod.spark.driver_static import layout

    # Tasks 0, 2, 3 run on host a, task 1 on host b: a's tasks get ranks 0-2 (task 0 is rank 0), b's rank 3.
    slots = layout(["a", "b", "a", "a"])
    assert [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size, index)
            for s, index in slots] == [(0, "a", 0, 3, 0, 2, 0), (1, "a", 1, 3, 0, 1, 2), (2, "a", 2, 3, 0, 1, 3),
                                       (3, "b", 0, 1, 1, 2, 1)]
    assert [index for _, index in layout(["b", "a", "b", "a"])] == [0, 2, 1, 3]


def _mpi_available():
    from horovod.spark.driver_mpi import check_mpi

    try:
        check_mpi()
        return True
    except LaunchNotAvailableError:
        return False


def _mpi_rank_info(fail_rank):
    import horovod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    if hvd.rank() == fail_rank:
        raise RuntimeError(f"mpi rank {hvd.rank()} fails")
    ancestors, pid = [], os.getpid()
    for _ in range(6):   # the rank's process ancestry: prted, started inside the Spark task's Python worker
        with open(f"/proc/{pid}/stat") as handle:
            pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            ancestors.append(handle.read().replace(b"\0", b" ").decode(errors="replace"))
    return dict(rank=hvd.rank(), size=hvd.size(), mpi=hvd.mpi_enabled(), total=float(total[0]),
                world_rank=os.environ.get("OMPI_COMM_WORLD_RANK"), ancestors=ancestors)


@pytest.mark.skipif(not _mpi_available(), reason="use_mpi needs Open MPI's mpirun and mpi4py")
def test_use_mpi_runs_the_ranks_under_mpirun_inside_the_tasks(spark):
    out = io.StringIO()
    results = horovod.spark.run(_mpi_rank_info, args=(-1,), num_proc=2, use_mpi=True, verbose=0, stdout=out,
                                stderr=io.StringIO())
    assert [(r["rank"], r["size"], r["mpi"], r["total"], r["world_rank"]) for r in results] == [
        (0, 2, True, 3.0, "0"), (1, 2, True, 3.0, "1")]
    for r in results:
        chain = " | ".join(r["ancestors"])
        assert "prted" in chain and "pyspark" in chain, chain   # mpirun's daemon ran in a Spark task

    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_mpi_rank_info, args=(1,), num_proc=2, use_mpi=True, verbose=0, stdout=io.StringIO(),
                          stderr=io.StringIO())
    assert "Rank: 1" in str(info.value) and "RuntimeError: mpi rank 1 fails" in str(info.value)
    # Still usable afterwards: every task was released.
    assert [r["rank"] for r in horovod.spark.run(_collectives, args=(1.0,), num_proc=2, verbose=0)] == [0, 1]


def test_use_mpi_without_mpirun_says_so():
    from horovod.spark.driver_mpi import check_mpi

    with pytest.raises(LaunchNotAvailableError, match="was not found on PATH.*leave use_mpi unset"):
        check_mpi("/nonexistent/mpirun")


def _topology_and_collectives(scale):
    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    summed = hvd.allreduce(np.arange(1000, dtype=np.float64) * (rank + 1) * scale, op=hvd.Sum)
    gathered = hvd.allgather(np.full((rank + 1,), rank, dtype=np.int32))
    out = dict(rank=rank, size=size, local_rank=hvd.local_rank(), local_size=hvd.local_size(),
               cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(), host=os.environ["HOROVOD_HOSTNAME"],
               transport=basics.runtime().transport_name, summed=summed, gathered=gathered)
    hvd.shutdown()
    return out


def test_executors_as_hosts_lay_ranks_out_by_host_and_go_hierarchical(spark):
    """Each executor counted as a host: the multi-host path (ranks of a host contiguous, shared memory inside a
    host, TCP between hosts) on one machine."""
    import cloudpickle as cp

    from horovod.spark import driver as sd
    from horovod.spark.driver_static import StaticSparkJob

    job = StaticSparkJob(spark.sparkContext, 3, 120.0, dict(os.environ), host_per_executor=True,
                         stdout=io.StringIO(), stderr=io.StringIO())
    results = job.run(cp.dumps(lambda: _topology_and_collectives(0.5)))
    assert [r["rank"] for r in results] == [0, 1, 2]
    hosts = [r["host"] for r in results]
    assert len(set(hosts)) == 2                               # 3 tasks on 2 executors of 2 cores: 2 + 1
    first = [r for r in results if r["host"] == hosts[0]]
    assert [r["rank"] for r in first] == list(range(len(first)))   # a host's ranks are consecutive, from 0
    for r in results:
        same = [o for o in results if o["host"] == r["host"]]
        assert r["local_size"] == len(same) and r["local_rank"] == same.index(r)
        assert r["transport"] == "hierarchical"
        np.testing.assert_allclose(r["summed"], np.arange(1000) * 0.5 * 6)
        np.testing.assert_array_equal(r["gathered"], [0, 1, 1, 2, 2, 2])
    assert sd.DEFAULT_START_TIMEOUT == 600
