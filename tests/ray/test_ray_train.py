"""HorovodTrainer (Ray Train v2) on a real two-raylet Ray cluster (conftest.py), and the same function under horovodrun.

The model is logistic regression trained by full-batch gradient descent with ``horovod.numpy``: each rank sums the
gradients of its rows, ``allreduce(Sum)`` adds them up, and every rank divides by the total row count, so N ranks
compute exactly the step one process computes on the combined batch (up to the order of float additions).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train", reason="HorovodTrainer needs Ray Train: pip install 'ray[train]'",
                    exc_type=ImportError)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

N_ROWS, N_FEATURES, LR = 48, 5, 0.5


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N_ROWS, N_FEATURES))
    y = (x @ rng.normal(size=N_FEATURES) + 0.3 * rng.normal(size=N_ROWS) > 0).astype(np.float64)
    return x, y


def gradient_sum(w, x, y):
    """The sum over rows of the logistic loss's gradient."""
    return x.T @ (1.0 / (1.0 + np.exp(-(x @ w))) - y)


def reference_weights(epochs: int):
    """One process, the combined batch."""
    x, y = make_data()
    w = np.zeros(N_FEATURES)
    for _ in range(epochs):
        w = w - LR * gradient_sum(w, x, y) / N_ROWS
    return w


def train_fn(config):
    """The training function: HorovodTrainer's workers and horovodrun's processes run it unchanged."""
    import ray.train

    import horovod.numpy as hvd

    hvd.init()
    context = ray.train.get_context()
    rank, size = hvd.rank(), hvd.size()
    if config.get("dataset"):
        ids = []
        for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=8, batch_format="numpy"):
            ids.extend(int(i) for i in batch["id"])
        ids = sorted(ids)
    else:
        ids = list(range(rank, N_ROWS, size))
    x_all, y_all = make_data()
    x, y = x_all[ids], y_all[ids]

    resumed = ray.train.get_checkpoint()
    w, start = np.zeros(N_FEATURES), 0
    if resumed is not None:
        with resumed.as_directory() as directory:
            state = np.load(os.path.join(directory, "state.npz"))
            w, start = state["w"], int(state["epoch"]) + 1

    for epoch in range(start, config["epochs"]):
        if epoch == config.get("kill_at") and resumed is None and rank == 1:
            # First attempt only: once Ray Train holds every checkpoint reported so far, have this worker's actor
            # killed from outside (the other rank is then stuck in, or fails, its next allreduce).
            ray.train.get_all_reported_checkpoints(timeout_s=300)
            ray.get(config["killer"].kill.remote(ray.get_runtime_context().current_actor), timeout=300)
            time.sleep(300)
            raise RuntimeError("rank 1 asked to be killed at epoch %d but was still alive 300 s later" % epoch)
        total = hvd.allreduce(gradient_sum(w, x, y), op=hvd.Sum, name=f"grad.{epoch}")
        count = int(hvd.allreduce(np.array([len(ids)], dtype=np.int64), op=hvd.Sum, name=f"count.{epoch}")[0])
        w = w - LR * total / count
        metrics = {"epoch": epoch, "start_epoch": start, "rank": rank,
                   "fusion": os.environ.get("HOROVOD_FUSION_THRESHOLD"), "mark": os.environ.get("HVD_TEST_MARK")}
        if epoch == config["epochs"] - 1:
            layout = np.array([[rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
                                context.get_world_rank(), context.get_world_size()]], dtype=np.int64)
            metrics["layout"] = hvd.allgather(layout, name="layout").tolist()
            metrics["ids"] = hvd.allgather(np.array(ids, dtype=np.int64), name="ids").tolist()
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if rank == 0:
                np.savez(os.path.join(directory, "state.npz"), w=w, epoch=epoch)
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=checkpoint)
    return w.tolist()


def final_weights(result):
    assert result.checkpoint is not None, "rank 0 reported a checkpoint every epoch; the result has none"
    with result.checkpoint.as_directory() as directory:
        state = np.load(os.path.join(directory, "state.npz"))
        return state["w"], int(state["epoch"])


def check_layout(layout, size):
    """Horovod's ranks are Ray Train's world ranks; local/cross ranks describe the nodes."""
    assert [row[0] for row in layout] == list(range(size))
    for rank, hsize, local_rank, local_size, cross_rank, cross_size, world_rank, world_size in layout:
        assert (hsize, world_size) == (size, size)
        assert world_rank == rank, f"Horovod rank {rank} is Ray Train world rank {world_rank}"
        assert 0 <= local_rank < local_size and 0 <= cross_rank < cross_size


def test_worker_slots_number_the_workers_node_by_node():
    from horovod.ray.train_backend import worker_slots

    slots = worker_slots(["a", "a", "b", "b"])
    assert [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 2), ("b", 2, 0, 2, 1, 2), ("b", 3, 1, 2, 1, 2)]
    interleaved = worker_slots(["a", "b", "a"])   # a node's workers still get consecutive ranks
    assert [(s.hostname, s.rank, s.local_rank) for s in interleaved] == [("a", 0, 0), ("b", 2, 0), ("a", 1, 1)]


def test_config_carries_the_drivers_knobs_and_never_shows_the_key(monkeypatch):
    from horovod.ray import HorovodConfig, HorovodTrainer

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1234567")
    config = HorovodConfig(key="not-a-secret-to-show", nics={"eth1", "eth0"})
    assert config.knob_env["HOROVOD_FUSION_THRESHOLD"] == "1234567"
    assert config.nic_list == ["eth0", "eth1"]
    assert "not-a-secret-to-show" not in repr(config) + repr(config.to_dict())
    with pytest.raises(TypeError, match="horovod.ray.HorovodConfig"):
        HorovodTrainer(train_fn, horovod_config=object())
    with pytest.raises(ValueError, match="timeout_s"):
        HorovodConfig(timeout_s=0)


@pytest.mark.usefixtures("cluster")
def test_two_workers_on_two_nodes_equal_one_process_on_the_combined_batch(tmp_path, monkeypatch):
    """Dataset shards, report with checkpoints, one worker on each Ray node; the model equals the reference."""
    from ray.train import RunConfig, ScalingConfig

    from horovod.ray import HorovodConfig, HorovodTrainer

    epochs = 5
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "7654321")   # the driver's knobs reach the workers
    trainer = HorovodTrainer(
        train_fn, train_loop_config={"epochs": epochs, "dataset": True},
        horovod_config=HorovodConfig(timeout_s=120, env_vars={"HVD_TEST_MARK": "marked"}),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name="equal", storage_path=str(tmp_path)),
        datasets={"train": ray.data.from_items([{"id": i} for i in range(N_ROWS)])})
    result = trainer.fit()

    w, epoch = final_weights(result)
    assert epoch == epochs - 1
    np.testing.assert_allclose(w, reference_weights(epochs), rtol=1e-10, atol=1e-12)
    assert not np.allclose(w, reference_weights(epochs - 1)), "the reference must tell the epochs apart"
    metrics = result.metrics
    assert metrics["epoch"] == epochs - 1 and metrics["start_epoch"] == 0
    check_layout(metrics["layout"], 2)
    assert [row[5] for row in metrics["layout"]] == [2, 2], f"one worker on each of the two nodes: {metrics}"
    assert sorted(metrics["ids"]) == list(range(N_ROWS)), "the shards must cover every row exactly once"
    assert (metrics["fusion"], metrics["mark"]) == ("7654321", "marked")
    assert result.checkpoint.path.startswith(str(tmp_path)), result.checkpoint.path


@ray.remote(num_cpus=0)
class Killer:
    """Kills the actor it is given, once; counts the kills."""

    def __init__(self):
        self.kills = 0

    def kill(self, actor):
        self.kills += 1
        ray.kill(actor, no_restart=True)
        return self.kills

    def count(self):
        return self.kills


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_killed_worker_is_recovered_from_the_last_checkpoint(tmp_path):
    """FailureConfig(max_failures=1): the new worker group resumes from the checkpoint of the epoch before the kill."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from horovod.ray import HorovodConfig, HorovodTrainer

    epochs, kill_at = 6, 3
    killer = Killer.remote()
    trainer = HorovodTrainer(
        train_fn, train_loop_config={"epochs": epochs, "kill_at": kill_at, "killer": killer},
        horovod_config=HorovodConfig(timeout_s=120),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="recover", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()

    assert ray.get(killer.count.remote(), timeout=60) == 1, "the first attempt's rank 1 must have been killed"
    w, epoch = final_weights(result)
    assert epoch == epochs - 1
    assert result.metrics["start_epoch"] == kill_at, (
        f"the second attempt must resume after the last checkpoint (epoch {kill_at - 1}): {result.metrics}")
    np.testing.assert_allclose(w, reference_weights(epochs), rtol=1e-10, atol=1e-12)
    check_layout(result.metrics["layout"], 2)


HORVODRUN_SCRIPT = """
import sys, json
from ray.train import RunConfig
from horovod.ray import HorovodTrainer
import test_ray_train as t
result = HorovodTrainer(t.train_fn, train_loop_config={"epochs": 4},
                        run_config=RunConfig(name="hvdrun", storage_path=sys.argv[1])).fit()
w, epoch = t.final_weights(result) if result.checkpoint else (None, None)
print("RESULT " + json.dumps({"metrics": result.metrics, "w": None if w is None else w.tolist(), "epoch": epoch,
                              "return": result.return_value}), flush=True)
"""


def test_the_same_function_runs_under_horovodrun(tmp_path):
    """horovodrun -np 2 runs HorovodTrainer.fit() in each process: Horovod's ranks in ray.train's context."""
    import json

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "-np", "2", "--start-timeout", "120",
                           sys.executable, "-c", HORVODRUN_SCRIPT, str(tmp_path)],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert len(results) == 2, proc.stdout[-4000:]
    by_rank = {r["metrics"]["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1]
    expected = reference_weights(4)
    for r in results:   # every rank ends with the same model; rank 0's checkpoint holds it
        np.testing.assert_allclose(r["return"], expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(by_rank[0]["w"], expected, rtol=1e-10, atol=1e-12)
    assert by_rank[1]["w"] is None, "rank 1 reported no checkpoint"
    check_layout(by_rank[0]["metrics"]["layout"], 2)
    assert sorted(by_rank[0]["metrics"]["ids"]) == list(range(N_ROWS))
    assert os.path.isdir(os.path.join(tmp_path, "hvdrun", "rank_0")), os.listdir(tmp_path)


EXAMPLE = os.path.join("examples", "ray", "train_digits_trainer.py")
FINAL_LINE = r"^(?:\[0\]<stdout>:)?2 workers; final loss ([0-9.]+); test accuracy (0\.\d+); checkpoint (\S+)$"


def _check_example_output(out: str) -> str:
    import re

    match = re.search(FINAL_LINE, out, re.M)
    assert match, out[-4000:]
    loss, accuracy, checkpoint = float(match.group(1)), float(match.group(2)), match.group(3)
    assert loss < 0.5 and accuracy > 0.85, f"4 epochs must train the MLP: loss {loss}, accuracy {accuracy}"
    assert os.path.exists(os.path.join(checkpoint, "model.pt")), checkpoint
    return checkpoint


def _with_checkout_on_path(env):
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.mark.slow
def test_example_trains_on_ray(cluster, tmp_path):
    env = _with_checkout_on_path(dict(os.environ, RAY_ADDRESS=cluster.address))
    done = subprocess.run([sys.executable, EXAMPLE, "--epochs", "4", "--storage-path", str(tmp_path)], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    assert _check_example_output(done.stdout).startswith(str(tmp_path))


@pytest.mark.slow
def test_example_trains_under_horovodrun(tmp_path):
    done = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "-np", "2", sys.executable, EXAMPLE,
                           "--epochs", "4", "--storage-path", str(tmp_path)], cwd=ROOT,
                          env=_with_checkout_on_path(dict(os.environ)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    checkpoint = _check_example_output(done.stdout)
    assert checkpoint.startswith(str(tmp_path)) and os.sep + "rank_0" + os.sep in checkpoint, checkpoint
    assert len([line for line in done.stdout.splitlines() if line.startswith("[0]<stdout>:epoch ")]) == 4
