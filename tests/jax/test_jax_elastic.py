"""horovod.jax.elastic: JaxState commit / restore / sync, the run decorator (restore, keep, reset, re-trace), the
newest commit winning a sync across real ranks, and a real ``horovodrun`` elastic job that grows and loses a
worker while its step runs inside ``jax.jit``."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jax_helpers import require_jax, run

require_jax()
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # ranks start after JAX loaded here

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elastic"))

from checks import Checks, assert_no_failures  # noqa: E402
from elastic_helpers import ElasticJob, check_training, third_host  # noqa: E402


@pytest.fixture
def single():
    import horovod.jax as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def _trees(seed: float):
    import jax.numpy as jnp
    import optax

    params = {"w": jnp.full((2, 3), seed), "b": jnp.arange(3.0) + seed}
    opt = optax.adam(0.1)
    return params, opt, opt.init(params)


def test_public_surface():
    import horovod.jax as hvd
    from horovod.jax import elastic

    assert elastic.__all__ == ["JaxState", "run"] and hvd.elastic is elastic


def test_commit_and_restore(single):
    import jax
    import jax.numpy as jnp

    params, opt, opt_state = _trees(1.0)
    state = single.elastic.JaxState(params=params, opt_state=opt_state, epoch=0, seen=[1])
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, state.opt_state = opt.update(grads, state.opt_state, state.params)
    state.params = jax.tree_util.tree_map(lambda p, u: p + u, state.params, updates)
    state.epoch = 1
    state.seen.append(2)
    state.commit()
    committed = (state.params, state.opt_state)
    state.params = jax.tree_util.tree_map(lambda p: p * 0, state.params)
    state.opt_state = opt.init(state.params)
    state.epoch = 2
    state.seen.append(3)
    state.restore()
    assert state.params is committed[0] and state.opt_state is committed[1]
    assert state.epoch == 1 and state.seen == [1, 2]
    assert float(state.opt_state[0].count) == 1.0


def test_run_restores_keeps_resets_and_retraces(single):
    """A collective failing inside jit is translated to HorovodInternalError by tests/jax/test_jax_api.py's job
    (a real mismatch); here run() gets one directly, as the torch and TF states' tests do."""
    import jax
    import jax.numpy as jnp

    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    hvd = single
    params, _, _ = _trees(0.0)
    state = hvd.elastic.JaxState(params=params, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    traced = jax.jit(lambda v: v * hvd.size())
    traced(jnp.ones(2))
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append((state.step, float(state.params["b"][0]), traced._cache_size()))
        if len(calls) == 1:
            state.params = {"w": params["w"], "b": params["b"] + 5}
            state.step = 5
            state.commit()
            state.params = {"w": params["w"], "b": params["b"] + 6}   # not committed: rolled back
            state.step = 6
            raise HorovodInternalError("peer died")
        if len(calls) == 2:
            state.step = 7
            state.commit()
            raise HostsUpdatedInterrupt(False)                          # hosts changed: nothing rolled back
        return state.step

    assert train(state) == 7
    # the step and params of the last commit after the failure; the jit cache empty after every reset
    assert calls == [(0, 0.0, 1), (5, 5.0, 0), (7, 5.0, 0)] and resets == [1, 1]
    assert single.is_initialized()


def sync_worker() -> dict:
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd
    from horovod.common.elastic import _sync_from_newest

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    c = Checks(r)
    params, opt, opt_state = _trees(float(r))
    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, note=f"rank {r}")
    newest = n - 1                                   # the last rank committed most: its state must win
    for _ in range(2 if r == newest else 1):
        state.commit()
    _sync_from_newest(state)
    c.equal(state.params["w"], jnp.full((2, 3), float(newest)), "params from the rank with the newest commit")
    c.equal(state.opt_state[0].mu["b"], jnp.zeros(3), "optimizer state synced")
    c.true(state.note == f"rank {newest}", f"plain values synced, got {state.note!r}")
    state.params = {"w": state.params["w"] * 0, "b": state.params["b"]}
    state.restore()                                  # back to the synced values, not this rank's own
    c.equal(state.params["w"], jnp.full((2, 3), float(newest)), "restore after sync gives the synced values")
    c.true(np.asarray(state.params["b"]).dtype == np.float32, "dtypes kept")
    hvd.shutdown()
    return c.report()


@pytest.mark.parametrize("np_", [2, 3])
def test_sync_takes_the_newest_commit(np_):
    assert_no_failures(run(sync_worker, np_, env={"JAX_ENABLE_X64": "0"}), minimum_checks=5)


# -- a real elastic job ----------------------------------------------------------------------------------------
WORKER = Path(__file__).resolve().parent / "jax_elastic_worker.py"


@pytest.mark.slow
def test_jax_job_grows_and_survives_a_killed_worker(tmp_path):
    third = third_host()
    if third is None:
        pytest.skip("this machine's host name is localhost: no third local host name")
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1"], ["-np", "2", "--min-np", "1", "--max-np", "3"],
                     worker=WORKER, step_delay=0.05, min_steps=0)
    try:
        def joined(size, after_epoch):
            return lambda evs: any(e["ev"] == "join" and e["size"] == size and e["epoch"] > after_epoch
                                   for e in evs)

        job.wait_for_commits(3, size=2)
        job.set_hosts(["localhost:1", "127.0.0.1:1", f"{third}:1"])
        job.wait_for("a third worker joins", joined(3, 0))
        grown = max(e["epoch"] for e in job.events("join"))
        job.wait_for_commits(3, size=3, min_epoch=grown)
        job.kill("127.0.0.1:0")
        job.wait_for("the job goes on without the killed worker", joined(2, grown))
        job.wait_for_commits(3, size=2, min_epoch=grown + 1)
        assert job.finish() == 0, job.diagnose()
        events = job.events()
        check_training(events, sizes=[2, 3, 2], resets=2)     # includes: the final w replays bit for bit
        for epoch in {e["epoch"] for e in events if e["ev"] == "join"}:
            models = {tuple(e["w"]) for e in events if e["ev"] == "join" and e["epoch"] == epoch}
            assert len(models) == 1, f"ranks disagree on the model after the sync of epoch {epoch}: {models}"
    except BaseException:
        print(job.diagnose())
        raise
    finally:
        job.cleanup()
