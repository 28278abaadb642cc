"""Elastic jobs across real hosts over ssh: network namespaces with their own address, host name and sshd
(``tests/runner/netns/cluster.py``), the launcher in a namespace of its own, as the static ssh tests do.

The job starts on two hosts, grows to a third that discovery reports later, loses the first one's worker
(kill -9), and shrinks when discovery drops the second.  After every change training resumes at the newest
commit, and at the end the model is identical on every rank and equals the one recomputed from the committed
steps (:func:`check_training`).  Skipped, with the reason, where namespaces are not permitted.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastic_helpers import check_training, joined

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runner" / "netns"))
from cluster import cluster_or_skip  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # hostC has no sshd by default; here it is the host added later.
    yield from cluster_or_skip(tmp_path_factory.mktemp("cluster"), sshd_hosts=["hostC"])


@pytest.fixture
def remote_job(elastic_job, cluster, tmp_path):
    """``elastic_job`` with the launcher in the driver's namespace, reaching the hosts over ssh."""
    home = tmp_path / "home"   # the ssh check cache starts empty; the user's ~/.horovod is not touched
    home.mkdir()

    def start(hosts, args, env_extra=None, **kwargs):
        env = cluster.env({"HOME": str(home), "PATH": os.environ.get("PATH", ""), **(env_extra or {})})
        return elastic_job(hosts, [*args, *cluster.ssh_flags()], wrap=cluster.in_driver([]), env=env, **kwargs)

    return start


def _where(job, wid: str) -> str:
    """The host name the newest process of worker ``wid`` saw (its own UTS namespace: the host it ran on)."""
    starts = [e for e in job.events("start") if e["id"] == wid]
    assert starts, f"worker {wid} never started\n{job.diagnose()}"
    return starts[-1]["uname"]


def test_grow_lose_and_shrink_across_hosts_over_ssh(remote_job, cluster):
    job = remote_job(["hostA:1", "hostB:1"], ["-np", "2", "--min-np", "1", "--start-timeout", "20"])
    job.wait_for_commits(3, size=2)
    assert (_where(job, "hostA:0"), _where(job, "hostB:0")) == ("hostA", "hostB")
    # The store listens where hosts discovered later can reach it: the bridge address, not loopback.
    assert "rendezvous store at 10.200.0.1:" in job.stderr(), job.diagnose()

    job.set_hosts(["hostA:1", "hostB:1", "hostC:1"])          # a third host appears
    job.wait_for("the job grows to three hosts", joined(3, epoch_at_least=1))
    job.wait_for_commits(3, size=3, min_epoch=1)
    assert _where(job, "hostC:0") == "hostC"

    job.kill("hostA:0")                                       # its worker dies (kill -9 on that host)
    job.wait_for("the job continues on the other two", joined(2, epoch_at_least=2))
    job.wait_for_commits(3, size=2, min_epoch=2)

    job.set_hosts(["hostA:1", "hostC:1"])                     # hostB is taken away (hostA is blacklisted)
    job.wait_for("the job shrinks to hostC", joined(1, epoch_at_least=3))
    job.wait_for_commits(3, size=1, min_epoch=3)

    assert job.finish() == 0, job.diagnose()
    eps = check_training(job.events(), sizes=[2, 3, 2, 1], resets=3)
    assert set(eps[2].ranks) == {"hostB:0", "hostC:0"} and set(eps[3].ranks) == {"hostC:0"}
    err = job.stderr()
    assert "blacklisting host hostA" in err, err[-3000:]
    assert "stopping worker hostB:0" in err, err[-3000:]
    # The worker stopped on hostB is gone from that host too (ssh carried the stop over).
    leftovers = cluster.host_pids_running("hostB", "elastic_worker")
    assert not leftovers, f"workers left running on hostB: {leftovers}"


def test_a_machine_that_dies_is_blacklisted_and_the_others_continue(remote_job, cluster):
    job = remote_job(["hostA:1", "hostB:1", "hostC:1"], ["-np", "3", "--min-np", "1", "--start-timeout", "20"])
    job.wait_for_commits(3, size=3)
    try:
        cluster.kill_host("hostB")                            # sshd, the ssh session and the worker, at once
        job.wait_for("the job continues on hostA and hostC", joined(2, epoch_at_least=1))
        job.wait_for_commits(3, size=2, min_epoch=1)
        assert job.finish() == 0, job.diagnose()
    finally:
        cluster.start_sshd("hostB")                           # for the tests after this one
    eps = check_training(job.events(), sizes=[3, 2], resets=1)
    assert set(eps[1].ranks) == {"hostA:0", "hostC:0"}
    assert "blacklisting host hostB" in job.stderr(), job.diagnose()


def test_a_host_that_cannot_be_reached_is_left_out_and_the_job_runs_on(remote_job):
    # hostZ answers nothing; the job starts on hostA alone and says why hostZ is not used.
    job = remote_job(["hostA:1", "hostZ:1"], ["-np", "1", "--min-np", "1", "--start-timeout", "3"])
    job.wait_for_commits(3, size=1)
    assert "leaving out host hostZ" in job.stderr(), job.diagnose()
    assert job.finish() == 0, job.diagnose()
    check_training(job.events(), sizes=[1], resets=0)


def test_a_worker_dying_inside_a_reset_does_not_stall_the_job(remote_job):
    """Issue 38 E1 across real hosts: hostC arrives, every worker resets into epoch 1, and hostB's worker dies the
    moment it holds its rank there.  The others stop waiting for it (not after the 120 s init timeout), hostC's
    first worker joins the next epoch instead of failing its first init(), and no healthy host is blacklisted."""
    import json

    job = remote_job(["hostA:1", "hostB:1"], ["-np", "2", "--min-np", "1", "--max-np", "3", "--start-timeout", "20"],
                     env_extra={"ELASTIC_TEST_DIE_AFTER_ASSIGNMENT": json.dumps({"id": "hostB:0", "epoch": 1}),
                                "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"})
    job.wait_for_commits(3, size=2)
    job.set_hosts(["hostA:1", "hostB:1", "hostC:1"])
    job.wait_for("hostB's worker dies holding its rank in epoch 1",
                 lambda evs: any(e["ev"] == "dies_after_assignment" and e["id"] == "hostB:0" for e in evs))
    job.wait_for("the job goes on with hostA and hostC", joined(2, epoch_at_least=2), timeout=45)
    job.wait_for_commits(3, size=2, min_epoch=2)
    assert job.finish() == 0, job.diagnose()
    eps = check_training(job.events(), sizes=[2, 2], resets=2)
    assert set(eps[-1].ranks) == {"hostA:0", "hostC:0"}, eps
    err = job.stderr()
    assert "epoch 1 abandoned: worker hostB:0" in err, job.diagnose()
    assert "blacklisting host hostA" not in err and "blacklisting host hostC" not in err, job.diagnose()
    assert [e["id"] for e in job.events("start")].count("hostC:0") == 1, job.diagnose()
