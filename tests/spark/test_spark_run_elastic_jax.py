"""``horovod.spark.run_elastic`` with a JAX training function: ``horovod.jax.elastic.JaxState`` and a step whose
allreduce runs inside ``jax.jit``; a Spark task's Python worker is killed by pid mid-training and the survivor goes
on from its last commit (the failed collective surfaces inside the compiled step and must restore the state)."""
import io
import json
import os
import signal
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

pytest.importorskip("optax")
jax = pytest.importorskip("jax")
if not hasattr(jax, "Array"):   # tests/jax found as a namespace package: JAX is not installed
    pytest.skip("jax is not installed (pip install 'horovod-next[jax]')", allow_module_level=True)

import horovod.spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 24
KILL_AT = 6


def _train(log_dir):
    import jax
    import jax.numpy as jnp

    import horovod.jax as hvd

    def log(**event):
        event.update(pid=os.getpid())
        with open(os.path.join(log_dir, "events"), "a") as handle:
            handle.write(json.dumps(event) + "\n")

    hvd.init()
    state = hvd.elastic.JaxState(params={"w": jnp.zeros(2)}, step=0, sizes=[])

    @jax.jit
    def step(params):
        return {"w": params["w"] + hvd.allreduce(jnp.ones(2), op=hvd.Sum, name="grad")}

    @hvd.elastic.run
    def train(state):
        log(ev="join", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            if hvd.rank() == 1 and state.step == KILL_AT and not os.path.exists(os.path.join(log_dir, "victim")):
                with open(os.path.join(log_dir, "victim.tmp"), "w") as handle:
                    handle.write(f"{os.getppid()} {os.getpid()}")
                os.rename(os.path.join(log_dir, "victim.tmp"), os.path.join(log_dir, "victim"))
                time.sleep(120)
            state.params = step(state.params)
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
            time.sleep(0.1)

    train(state)
    return dict(step=state.step, w=np.asarray(state.params["w"]).tolist(), sizes=list(state.sizes),
                rank=hvd.rank(), pid=os.getpid())


def _kill_victim(log_dir, killed, timeout=240.0):
    path = os.path.join(log_dir, "victim")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            task_pid, worker_pid = map(int, open(path).read().split())
            os.kill(task_pid, signal.SIGKILL)   # the executor's Python worker running rank 1's task
            killed.extend([task_pid, worker_pid])
            return
        time.sleep(0.1)


def test_jax_worker_killed_mid_training_continues_from_last_commit(spark, tmp_path):
    killed = []
    killer = threading.Thread(target=_kill_victim, args=(str(tmp_path), killed), daemon=True)
    killer.start()
    results = horovod.spark.run_elastic(_train, args=(str(tmp_path),), num_proc=2, min_num_proc=1,
                                        max_num_proc=2, start_timeout=120, elastic_timeout=120, verbose=0,
                                        stdout=io.StringIO(), stderr=io.StringIO())
    killer.join(5)
    assert killed, "rank 1 never reached the step where its Spark task is killed"
    events = [json.loads(line) for line in (tmp_path / "events").read_text().splitlines()]
    joins = [e for e in events if e["ev"] == "join"]
    assert results and [r["rank"] for r in results] == list(range(len(results)))
    for r in results:
        assert r["step"] == STEPS and len(r["sizes"]) == STEPS
        np.testing.assert_allclose(r["w"], [sum(r["sizes"])] * 2)   # every step added the size it trained at
    assert results[0]["sizes"][:KILL_AT] == [2] * KILL_AT
    survivor = [e for e in joins if e["step"] == 0 and e["rank"] == 0][0]["pid"]
    resumed = [e for e in joins if e["pid"] == survivor and e["step"] > 0]
    assert resumed and resumed[0]["step"] == KILL_AT, joins
    assert killed[1] not in [r["pid"] for r in results]
