"""Elastic Horovod on a real Ray cluster (conftest.py): a killed actor, a removed node, an added node.

Every job trains the toy model of ray_elastic_worker.py (ray_elastic_helpers.py runs it); the test then checks
that the steps form one unbroken sequence (training continued from the last commit: nothing skipped, nothing
counted twice) and recomputes the model bit for bit from the ``(step, size)`` history.
"""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from horovod.ray import ElasticRayExecutor  # noqa: E402
from ray_elastic_helpers import Job, check_continuity, check_no_workers_left, kill_an_actor_mid_training  # noqa: E402
from ray_elastic_worker import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("cluster")


def test_killed_actor_is_replaced_and_training_continues(tmp_path):
    # The dead worker's node still runs a healthy one: a new actor takes its slot, the job keeps 4 ranks.
    kill_an_actor_mid_training(tmp_path, train, min_workers=2, max_workers=4)


def test_removed_node_then_added_node(cluster, tmp_path):
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3, elastic_timeout=120,
                                                  timeout_s=60)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    head_id = ray.get_runtime_context().get_node_id()
    job = Job(executor, tmp_path, train).start()
    try:
        first = job.wait_for_commits(size=3)   # max 3: both head slots and one on the second node
        other = [n for n in cluster.list_all_nodes() if n.node_id != head_id]
        assert len(other) == 1
        cluster.remove_node(other[0])
        shrunk = job.wait_for_commits(size=2, after_epoch=first)
        members = executor.driver.current_members()
        assert all(m.startswith(head_id) for m in members), members
        # New capacity: the job grows back, up to max_num_proc (the new node has 2 CPUs, 1 is taken).
        cluster.add_node(num_cpus=2)
        job.wait_for_commits(size=3, after_epoch=shrunk)
        results = job.finish()
    finally:
        executor.shutdown()
    assert len(results) == 3
    check_continuity(job, results)
    sizes = [e["size"] for e in job.events("join") if e["rank"] == 0]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert {entry["size"] for entry in job.logged} == {2, 3}, job.logged[-3:]
    check_no_workers_left(job)
