"""Training with horovod.tensorflow across real processes: DistributedGradientTape (its options and the partial
variant) and SyncBatchNormalization against single-process training on the combined batch, and the TF1 session
path (DistributedOptimizer over tf.compat.v1 optimizers, BroadcastGlobalVariablesHook, global-variable
broadcast, local gradient aggregation)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tf_helpers import run_tf, sharded_indices

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed")

BATCH = 4


# -- DistributedGradientTape --------------------------------------------------------------------------------
def _tape_worker(batch, sharded_indices):
    import keras
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(0)
    X = rng.randn(8 * batch * n, 6).astype(np.float32)
    Y = rng.randn(8 * batch * n, 1).astype(np.float32)
    ids = rng.randint(0, 10, size=(8 * batch * n, 2)).astype(np.int32)
    mine = sharded_indices(len(X), batch, r, n)

    def dense_model(seed, sync_bn=None):
        """Dense-tanh-Dense; with ``sync_bn`` True/False a (Sync)BatchNormalization after the first layer."""
        keras.utils.set_random_seed(seed)
        layers = [keras.layers.Input((6,)), keras.layers.Dense(8, activation="tanh")]
        if sync_bn is not None:
            bn = hvd.SyncBatchNormalization if sync_bn else keras.layers.BatchNormalization
            layers.append(bn(momentum=0.5))
        return keras.Sequential(layers + [keras.layers.Dense(1)])

    def embed_model(seed):
        keras.utils.set_random_seed(seed)
        inp = keras.layers.Input((2,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(10, 3)(inp))
        return keras.Model(inp, keras.layers.Dense(1)(h))

    def train(model, inputs, targets, wrap, steps, per_step):
        opt = keras.optimizers.SGD(0.1)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            tape = wrap(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for i in range(steps):
            step(inputs[i * per_step:(i + 1) * per_step], targets[i * per_step:(i + 1) * per_step])
        return [v.numpy() for v in model.weights]

    def plain(tape):
        return tape

    out = {"rank": r}
    # Different initial weights on every rank; broadcasting from rank 0 (the usual first-step pattern) fixes it.
    model = dense_model(seed=10 + r)
    hvd.broadcast_variables(model.variables, root_rank=0)
    out["default"] = train(model, X[mine], Y[mine], hvd.DistributedGradientTape, 4, batch)
    variants = {
        "groups_predivide": lambda t: hvd.DistributedGradientTape(t, groups=2, gradient_predivide_factor=2.0),
        "fp16": lambda t: hvd.DistributedGradientTape(t, compression=hvd.Compression.fp16),
        "sum_over_ranks": lambda t: hvd.DistributedGradientTape(t, op=hvd.Sum),
    }
    for name, wrap in variants.items():
        out[name] = train(dense_model(10), X[mine], Y[mine], wrap, 2, batch)
    out["sparse"] = train(embed_model(3), ids[mine], Y[mine], hvd.DistributedGradientTape, 3, batch)
    out["sparse_as_dense"] = train(embed_model(3), ids[mine], Y[mine],
                                   lambda t: hvd.DistributedGradientTape(t, sparse_as_dense=True), 3, batch)
    out["sync_bn"] = train(dense_model(5, sync_bn=True), X[mine], Y[mine], hvd.DistributedGradientTape, 3, batch)

    # Partial tape: the first Dense layer stays local.
    model = dense_model(7)
    x, y = tf.constant(X[mine][:batch]), tf.constant(Y[mine][:batch])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    local = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    out["partial"] = [g.numpy() for g in partial.gradient(loss, model.trainable_variables)]
    out["local"] = local

    if r == 0:   # single-process reference on the combined batches, with rank 0's initial weights
        out["ref_default"] = train(dense_model(10), X, Y, plain, 4, batch * n)
        out["ref_2"] = train(dense_model(10), X, Y, plain, 2, batch * n)
        out["ref_sparse"] = train(embed_model(3), ids, Y, plain, 3, batch * n)
        out["ref_bn"] = train(dense_model(5, sync_bn=False), X, Y, plain, 3, batch * n)
        sum_model = dense_model(10)
        out["ref_sum"] = train(sum_model, X, Y, lambda t: _ScaledTape(t, n), 2, batch * n)
    return out


class _ScaledTape:
    """A tape whose gradients are multiplied by ``factor`` (the Sum reference: n times the averaged gradient)."""

    def __init__(self, tape, factor):
        self.tape, self.factor = tape, factor

    def gradient(self, loss, variables):
        return [g * self.factor for g in self.tape.gradient(loss, variables)]


def _assert_weights(got, want, atol, label):
    assert len(got) == len(want), label
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, atol=atol, rtol=atol, err_msg=f"{label}: weight {i}")


def test_gradient_tape_training_matches_single_process():
    results = run_tf(_tape_worker, 2, args=(BATCH, sharded_indices))
    ref = results[0]
    n = len(results)
    for res in results:
        _assert_weights(res["default"], ref["ref_default"], 1e-5, "default tape")
        _assert_weights(res["groups_predivide"], ref["ref_2"], 1e-5, "groups + predivide")
        _assert_weights(res["fp16"], ref["ref_2"], 2e-3, "fp16 compression")
        _assert_weights(res["sum_over_ranks"], ref["ref_sum"], 1e-5, "op=Sum")
        _assert_weights(res["sparse"], ref["ref_sparse"], 1e-5, "IndexedSlices gradients")
        _assert_weights(res["sparse_as_dense"], ref["ref_sparse"], 1e-5, "sparse_as_dense")
        _assert_weights(res["sync_bn"], ref["ref_bn"], 1e-4, "SyncBatchNormalization")
    # Partial tape: local layer (kernel, bias) = own gradient / size; shared layer = average over ranks.
    for res in results:
        for i in (0, 1):
            np.testing.assert_allclose(res["partial"][i], res["local"][i] / n, atol=1e-6)
        for i in (2, 3):
            np.testing.assert_allclose(res["partial"][i], np.mean([x["local"][i] for x in results], axis=0),
                                       atol=1e-6)


# -- the TF1 session path -----------------------------------------------------------------------------------
def _tf1_worker():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r}
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError as exc:
        out["eager_error"] = str(exc)

    rng = np.random.RandomState(0)
    X = rng.randn(40, 3).astype(np.float32)
    Y = X @ np.array([[1.0], [2.0], [3.0]], np.float32)

    def build(optimizer_fn, seed):
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("w", [3, 1], initializer=tf.compat.v1.random_normal_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        train = optimizer_fn().minimize(loss, global_step=step)
        with tf.control_dependencies([train]):
            w_after = tf.identity(w)   # read after the update (a separate fetch of w could race with it)
        return x, y, w_after, train, step

    # The canonical TF1 script: Adagrad scaled by size, MonitoredTrainingSession with the broadcast hook.
    with tf.Graph().as_default():
        x, y, w, train, _ = build(lambda: hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01 * n)),
                                  seed=r + 1)
        config = tf.compat.v1.ConfigProto()
        config.gpu_options.visible_device_list = str(hvd.local_rank())
        hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(last_step=5)]
        weights = []
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks, config=config) as sess:
            i = 0
            while not sess.should_stop():
                rows = slice(8 * i + 4 * r, 8 * i + 4 * r + 4)
                weights.append(sess.run(w, feed_dict={x: X[rows], y: Y[rows]}))
                i += 1
        out["mts_weights"] = weights
    if r == 0:   # reference: one process, rank 0's initial weights, combined batches
        with tf.Graph().as_default():
            x, y, w, train, _ = build(lambda: tf.compat.v1.train.AdagradOptimizer(0.01 * n), seed=1)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                out["ref_weights"] = [sess.run(w, feed_dict={x: X[8 * i:8 * i + 8], y: Y[8 * i:8 * i + 8]})
                                      for i in range(5)]

    # broadcast_global_variables in graph mode, and graph-mode collectives in a plain Session.
    with tf.Graph().as_default():
        v = tf.Variable(tf.ones([2]) * (r + 1))
        bcast = hvd.broadcast_global_variables(1)
        total = hvd.allreduce(v, op=hvd.Sum)
        gathered = hvd.allgather(tf.reshape(v, [1, 2]))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = sess.run(total)
            sess.run(bcast)
            out["graph"] = {"before": before, "after": sess.run(total), "v": sess.run(v),
                            "gathered": sess.run(gathered)}

    # Local gradient aggregation: apply every second step, global_step still counts every step.
    with tf.Graph().as_default():
        w = tf.Variable(tf.zeros([2]))
        loss = tf.reduce_sum(w * tf.constant([1.0, 2.0]) * float(r + 1))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=2,
                                       average_aggregated_gradients=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss, global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            out["bpps"] = []
            for _ in range(4):
                sess.run(train)
                out["bpps"].append(sess.run([w, step]))
    return out


def test_tf1_session_path():
    results = run_tf(_tf1_worker, 2)
    n = len(results)
    ref = results[0]["ref_weights"]
    for res in results:
        assert "does not support eager execution" in res["eager_error"]
        assert len(res["mts_weights"]) == 5
        for got, want in zip(res["mts_weights"], ref):
            np.testing.assert_allclose(got, want, atol=1e-5)
        g = res["graph"]
        np.testing.assert_allclose(g["before"], np.full(2, sum(p + 1 for p in range(n))))
        np.testing.assert_allclose(g["after"], np.full(2, 2.0 * n))
        np.testing.assert_allclose(g["v"], [2.0, 2.0])
        np.testing.assert_allclose(g["gathered"], np.full([n, 2], 2.0))
        mean_scale = np.mean([p + 1 for p in range(n)])
        expected = [(np.zeros(2), 1), (-mean_scale * np.array([1.0, 2.0]), 2),
                    (-mean_scale * np.array([1.0, 2.0]), 3), (-2 * mean_scale * np.array([1.0, 2.0]), 4)]
        for (w, step), (want_w, want_step) in zip(res["bpps"], expected):
            np.testing.assert_allclose(w, want_w, atol=1e-6)
            assert step == want_step


# -- elastic states -----------------------------------------------------------------------------------------
def _elastic_worker():
    import keras
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    hvd.init()
    r = hvd.rank()
    out = {}
    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.layers.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(r)
        # run() synchronised the state from rank 0 before calling us
        out["synced_kernel"] = model.weights[0].numpy()
        callbacks = [hvd_keras.elastic.UpdateBatchStateCallback(state),
                     hvd_keras.elastic.UpdateEpochStateCallback(state),
                     hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2)]
        model.fit(np.ones([8, 2], np.float32), np.ones([8, 1], np.float32), batch_size=2, epochs=2,
                  initial_epoch=state.epoch, verbose=0, callbacks=callbacks)
        return "done"

    out["result"] = train(state)
    out["calls"] = len(calls)
    out["epoch"], out["batch"] = state.epoch, state.batch
    committed = [v.numpy() for v in model.weights]
    model.weights[0].assign(tf.zeros_like(model.weights[0]))
    state.epoch = 99
    state.restore()
    out["restored_equal"] = all(np.allclose(a, b.numpy()) for a, b in zip(committed, model.weights))
    out["restored_epoch"] = state.epoch
    out["committed"] = committed

    # TensorFlowState over plain variables; an engine failure inside tf.function is seen as HorovodInternalError.
    v = tf.Variable([float(r), 1.0])
    tf_state = hvd.elastic.TensorFlowState([v], step=r)
    tf_state.sync()
    out["tf_state"] = (v.numpy(), tf_state.step)
    failed = tf.function(lambda: hvd.allreduce(tf.ones([1 + r])), autograph=False)
    try:   # (run() itself would restore and re-join the job, which needs the elastic driver)
        hvd.elastic.translate_errors(failed)()
    except Exception as exc:  # noqa: BLE001 — the test inspects what surfaced
        out["failure"] = [type(exc).__name__, type(exc.__cause__).__name__]
    return out


def test_elastic_states():
    results = run_tf(_elastic_worker, 2)
    for res in results:
        assert res["result"] == "done" and res["calls"] == 1
        np.testing.assert_allclose(res["synced_kernel"], results[0]["synced_kernel"])
        assert (res["epoch"], res["batch"]) == (2, 0)
        assert res["restored_equal"] and res["restored_epoch"] == 2
        for a, b in zip(res["committed"], results[0]["committed"]):
            np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(res["tf_state"][0], [0.0, 1.0])
        assert res["tf_state"][1] == 0
        assert res["failure"] == ["HorovodInternalError", "FailedPreconditionError"]


# -- gradient buckets ---------------------------------------------------------------------------------------
def test_bucket_plan_packs_consecutive_small_items_of_one_dtype():
    from horovod.common.buckets import plan_buckets

    f4, f8 = "float32", "float64"
    sizes = [40, 40, 40, 200, 8, 8, 8, 8, None, 16, 16]
    dtypes = [f4, f4, f4, f4, f4, f8, f8, f4, f4, f4, f4]
    # 120 bytes fill the first bucket; 200 > cap stays alone; a dtype change closes a bucket (a bucket of one is
    # no bucket); an unknown size stays out and splits its neighbours.
    assert plan_buckets(sizes, dtypes, cap=120) == [[0, 1, 2], [5, 6], [9, 10]]
    assert plan_buckets(sizes, dtypes, cap=0) == []
    assert plan_buckets([8, 8], [f4, f4], cap=15) == []


def _bucket_worker(cap):
    import json
    import os

    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod.common.buckets import plan_buckets

    hvd.init()
    r = hvd.rank()
    keras = tf.keras
    keras.utils.set_random_seed(1)
    # 11 small variables (≤ 400 bytes each), one of 5 KiB and one of 64 KiB: with a 1 KiB cap that is a few
    # buckets plus the two big ones alone.
    model = keras.Sequential([keras.layers.Input((128,)), keras.layers.Dense(128, use_bias=False)]
                             + [keras.layers.Dense(10) for _ in range(5)] + [keras.layers.Dense(1)])
    rng = np.random.RandomState(r)
    x, y = rng.randn(4, 128).astype(np.float32), rng.randn(4, 1).astype(np.float32)

    def local_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, model.trainable_variables)

    def reduced_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    out = {"rank": r}
    mine = [g.numpy() for g in local_grads()]
    everyone = [hvd.allgather(g[None]).numpy() for g in mine]        # per-rank gradients, for the reference
    out["want"] = [a.mean(axis=0) for a in everyone]
    out["eager"] = [g.numpy() for g in reduced_grads()]
    out["graph"] = [g.numpy() for g in tf.function(reduced_grads)()]
    grads = local_grads()
    out["plan"] = plan_buckets([int(np.prod(g.shape)) * 4 for g in grads], [g.dtype for g in grads], cap)
    out["num_grads"] = len(grads)
    # The Keras optimizer packs the same way: one step of fit on every rank.
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0))
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    out["keras_step"] = [b - v.numpy() for b, v in zip(before, model.trainable_variables)]
    model_grads_want = out["want"]
    out["keras_ok"] = all(np.allclose(a, b, atol=1e-5) for a, b in zip(out["keras_step"], model_grads_want))
    hvd.shutdown()
    if r == 0:
        with open(os.environ["HOROVOD_TIMELINE"], encoding="utf-8") as f:
            text = f.read().rstrip().rstrip(",")
        events = json.loads(text if text.endswith("]") else text + "]")
        out["tensor_names"] = sorted({e["args"]["name"] for e in events if e.get("name") == "process_name"
                                      and e.get("pid", 0) > 0})
    return out


@pytest.mark.parametrize("cap", [1024, 0])
def test_gradients_travel_in_buckets(tmp_path, cap):
    """DistributedGradientTape and the Keras DistributedOptimizer reduce one flat tensor per bucket
    (HOROVOD_GRADIENT_BUCKET_BYTES); results equal the average of every rank's gradients either way."""
    timeline = str(tmp_path / "timeline.json")
    results = run_tf(_bucket_worker, 2, args=(cap,),
                     env={"HOROVOD_GRADIENT_BUCKET_BYTES": str(cap), "HOROVOD_TIMELINE": timeline})
    for res in results:
        for label in ("eager", "graph"):
            for got, want in zip(res[label], res["want"]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {res['rank']} {label}")
        assert res["keras_ok"], f"rank {res['rank']}: the Keras step did not apply the averaged gradients"
    root = results[0]
    plan = root["plan"]
    if cap:
        # the 64 KiB and the 5 KiB kernels travel alone, the 11 small variables in buckets of at most 1 KiB
        assert len(plan) >= 2 and sorted(i for b in plan for i in b) == list(range(2, root["num_grads"])), plan
    else:
        assert plan == []
    # One allreduce request per bucket plus one per gradient in no bucket, for each of the three reductions
    # (eager tape, tape in tf.function, Keras fit); the allgathers of the reference are the rest.
    per_reduction = len(plan) + root["num_grads"] - sum(len(b) for b in plan)
    allreduces = [name for name in root["tensor_names"] if "allgather" not in name.lower()]
    assert len(allreduces) == 3 * per_reduction, root["tensor_names"]
