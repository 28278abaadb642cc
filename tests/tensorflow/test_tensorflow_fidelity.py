"""horovod.tensorflow behaves as Horovod 0.28.1 where scripts can tell: error types in graphs, the in-graph
queries in TF1 graphs, alltoall's return form, IndexedSlices averaging, the reducescatter gradient, ranks outside a
process set, and ``DistributedGradientTape.get_local_and_global_gradients``.

Each behaviour is checked eagerly, inside ``tf.function`` and in a TF1 session where it can differ between them.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tf_helpers import FLAVOURS, flavour_params, run_tf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed")


def _types(exc) -> dict:
    return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}


# -- two ranks: errors, queries, alltoall, IndexedSlices, reducescatter gradient, local/global gradients -------
def _two_rank_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    single = hvd.ProcessSet([0])
    hvd.init(process_sets=[single])
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r}

    def capture(key, fn):
        try:
            value = fn()
            out[key] = {"value": value}
        except Exception as exc:  # noqa: BLE001 — the test inspects what surfaced
            out[key] = _types(exc)

    def in_session(build):
        with tf.Graph().as_default():
            fetch = build()
            with tf.compat.v1.Session() as sess:
                return sess.run(fetch)

    def in_function(build):
        result = tf.function(build, autograph=False)()
        return tf.nest.map_structure(lambda t: t.numpy(), result)

    # 1. a mismatch across ranks is a FailedPreconditionError in every mode; the engine keeps working after it
    mismatch = lambda: hvd.allreduce(tf.ones([17 + r] * 3))  # noqa: E731
    capture("mismatch_eager", lambda: mismatch().numpy())
    capture("mismatch_function", lambda: in_function(mismatch))
    capture("mismatch_session", lambda: in_session(mismatch))

    def unused():   # a failed collective whose result nothing reads still fails the function
        hvd.allreduce(tf.ones([3 + r]), name="unused")
        return tf.constant(1)

    capture("mismatch_unused_output", lambda: in_function(unused))
    # ... and a bad process-set id is a ValueError in every mode (raised when the op is built)
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10
    bad_set = lambda: hvd.allreduce(tf.ones([4]), process_set=fake)  # noqa: E731
    capture("bad_set_eager", lambda: bad_set().numpy())
    capture("bad_set_function", lambda: in_function(bad_set))
    capture("bad_set_session", lambda: in_session(bad_set))
    # a rank outside the set calling a collective of the set: InvalidArgumentError in every mode
    if r == 1:
        outsider = lambda: hvd.allreduce(tf.ones([4]), process_set=single)  # noqa: E731
        capture("outsider_eager", lambda: outsider().numpy())
        capture("outsider_session", lambda: in_session(outsider))
    out["after_errors"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum).numpy()

    # 2. the in-graph queries in a TF1 graph (and inside tf.function)
    def queries():
        return [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                hvd.process_set_included_op(), hvd.size_op(process_set_id=single.process_set_id),
                hvd.process_set_included_op(process_set_id=single.process_set_id)]

    capture("queries_session", lambda: [int(v) for v in in_session(queries)])
    capture("queries_function", lambda: [int(v) for v in in_function(queries)])
    capture("join_session", lambda: int(in_session(hvd.join)))

    # 3. alltoall: only the output without splits, (output, received splits) with them
    rows = lambda: tf.reshape(tf.range(4 * n) + 100 * r, [2 * n, 2])  # noqa: E731
    for mode, runner in (("eager", lambda f: f()), ("function", in_function), ("session", in_session)):
        plain = runner(lambda: hvd.alltoall(rows()))
        pair = runner(lambda: hvd.alltoall(rows(), splits=[2] * n))
        out[f"a2a_{mode}"] = {"plain_is_tuple": isinstance(plain, (tuple, list)), "plain": np.asarray(plain),
                              "pair": [np.asarray(p) for p in pair]}

    # 4. IndexedSlices: Average divides integers into floats; scale factors are refused before any collective
    def int_slices():
        return tf.IndexedSlices(tf.constant([[r + 1, 3]], tf.int32), tf.constant([r], tf.int64),
                                tf.constant([2, 2], tf.int64))

    for mode, runner in (("eager", lambda f: f()), ("function", in_function), ("session", in_session)):
        avg = runner(lambda: hvd.allreduce(int_slices(), op=hvd.Average).values)
        out[f"slices_avg_{mode}"] = np.asarray(avg)
    capture("slices_prescale", lambda: hvd.allreduce(int_slices(), op=hvd.Sum, prescale_factor=2.0))
    capture("slices_postscale_grouped",
            lambda: hvd.grouped_allreduce([tf.ones([2]), int_slices()], op=hvd.Sum, postscale_factor=0.5))
    out["after_slices"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()

    # 5. the reducescatter gradient: the allgathered upstream x set size for Sum, x 1 for Average
    def rs_grad(op, grouped=False, prescale=1.0):
        x = tf.ones([2 * n, 3])
        with tf.GradientTape() as tape:
            tape.watch(x)
            if grouped:
                y = hvd.grouped_reducescatter([x, 2.0 * x], op=op, prescale_factor=prescale)
                y = tf.add_n([tf.reduce_sum(t) for t in y])
            else:
                y = tf.reduce_sum(hvd.reducescatter(x, op=op, prescale_factor=prescale))
        return tape.gradient(y, x)

    for name, args in (("sum", (hvd.Sum,)), ("average", (hvd.Average,)), ("grouped_sum", (hvd.Sum, True)),
                       ("sum_prescale", (hvd.Sum, False, 0.5))):
        out[f"rs_{name}_eager"] = rs_grad(*args).numpy()
        out[f"rs_{name}_function"] = in_function(lambda args=args: rs_grad(*args))

    # 8. get_local_and_global_gradients: (local pairs, global pairs) in source order
    w_global = tf.Variable([1.0, 2.0])
    w_local = tf.Variable([3.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w_global * float(r + 1)) + tf.reduce_sum(w_local * float(r + 1))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(w_local)
    local, shared = tape.get_local_and_global_gradients(loss, [w_global, w_local])
    out["local_global"] = {"local": [(v is w_local, g.numpy()) for v, g in local],
                           "global": [(v is w_global, g.numpy()) for v, g in shared]}
    return out


def _expect_error(res, key, type_name, text=None):
    got = res[key]
    assert "types" in got, f"{key}: no error, got {got}"
    assert type_name in got["types"], f"{key}: {got['types']}: {got['message'][:500]}"
    if text is not None:
        assert text in got["message"], f"{key}: {got['message'][:500]}"


def test_two_ranks_behave_like_the_original():
    results = run_tf(_two_rank_worker, 2)
    n = 2
    for res in results:
        r = res["rank"]
        for mode in ("eager", "function", "session"):
            _expect_error(res, f"mismatch_{mode}", "FailedPreconditionError", "Mismatched ALLREDUCE tensor shapes")
            _expect_error(res, f"bad_set_{mode}", "ValueError", "Process set id 10")
        _expect_error(res, "mismatch_unused_output", "FailedPreconditionError", "Mismatched ALLREDUCE")
        assert "HorovodInternalError" in res["mismatch_eager"]["types"]
        if r == 1:
            _expect_error(res, "outsider_eager", "InvalidArgumentError")
            _expect_error(res, "outsider_session", "InvalidArgumentError")
        np.testing.assert_array_equal(res["after_errors"], [1.0])

        want = [r, r, n, n, 1, 1, 1 if r == 0 else 0]
        assert res["queries_session"]["value"] == want, res["queries_session"]
        assert res["queries_function"]["value"] == want, res["queries_function"]
        assert res["join_session"]["value"] in (0, 1), res["join_session"]

        expected_a2a = np.concatenate([(np.arange(4 * n) + 100 * p).reshape(2 * n, 2)[2 * r:2 * r + 2]
                                       for p in range(n)])
        for mode in ("eager", "function", "session"):
            a2a = res[f"a2a_{mode}"]
            assert not a2a["plain_is_tuple"], f"{mode}: alltoall without splits returned a tuple"
            np.testing.assert_array_equal(a2a["plain"], expected_a2a)
            np.testing.assert_array_equal(a2a["pair"][0], expected_a2a)
            np.testing.assert_array_equal(a2a["pair"][1], [2] * n)

        gathered = np.array([[p + 1, 3] for p in range(n)], dtype=np.float64)
        for mode in ("eager", "function", "session"):
            avg = res[f"slices_avg_{mode}"]
            assert avg.dtype.kind == "f", f"{mode}: {avg.dtype}"
            np.testing.assert_allclose(avg, gathered / n)
        _expect_error(res, "slices_prescale", "NotImplementedError", "Pre/postscale")
        _expect_error(res, "slices_postscale_grouped", "NotImplementedError", "Pre/postscale")
        np.testing.assert_array_equal(res["after_slices"], [2.0])

        for mode in ("eager", "function"):
            np.testing.assert_allclose(res[f"rs_sum_{mode}"], np.full([2 * n, 3], float(n)))
            np.testing.assert_allclose(res[f"rs_average_{mode}"], np.ones([2 * n, 3]))
            np.testing.assert_allclose(res[f"rs_grouped_sum_{mode}"], np.full([2 * n, 3], 3.0 * n))
            np.testing.assert_allclose(res[f"rs_sum_prescale_{mode}"], np.full([2 * n, 3], 0.5 * n))

        lg = res["local_global"]
        assert [is_var for is_var, _ in lg["local"]] == [True] and [is_var for is_var, _ in lg["global"]] == [True]
        np.testing.assert_allclose(lg["local"][0][1], [(r + 1) / n])          # local: scaled by 1 / set size
        np.testing.assert_allclose(lg["global"][0][1], [1.5, 1.5])             # global: averaged


# -- three ranks: the reducescatter gradient on a process set; ranks outside a process set ------------------
def _process_set_worker(flavour):
    import tensorflow as tf

    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod._keras.flavour import keras

    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    r = hvd.rank()
    member = ps.included()
    out = {"rank": r, "member": member}

    if member:
        x = tf.ones([4, 2])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, process_set=ps, name="ps_rs"))
        out["rs_grad"] = tape.gradient(y, x).numpy()

    # DistributedGradientTape on a process set: members average, the outsider keeps its own gradient
    w = tf.Variable([1.0, 1.0])

    def tape_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(r + 1))
        return hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0]

    out["tape_eager"] = tape_grads().numpy()
    out["tape_function"] = tf.function(tape_grads, autograph=False)().numpy()

    # the TF1 DistributedOptimizer (legacy) in a session
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 1.0]))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), process_set=ps)
        grads = opt.compute_gradients(tf.reduce_sum(v * float(r + 1)), [v])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            out["legacy"] = sess.run(grads[0][0])

    # the Keras DistributedOptimizer of the active Keras, through apply_gradients in a custom step
    kv = tf.Variable([1.0, 1.0])
    kopt = hvd_keras.DistributedOptimizer(keras().optimizers.SGD(learning_rate=1.0), process_set=ps)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(kv * float(r + 1))
    kopt.apply_gradients(zip(tape.gradient(loss, [kv]), [kv]))
    out["keras"] = kv.numpy()
    out["flavour"] = type(kopt).__module__.split(".")[0]
    hvd.allreduce(tf.constant([0.0]), name="done")   # rank 1 ran no collective: keep it until the others finish
    return out


@flavour_params
def test_process_sets_three_ranks(flavour):
    results = run_tf(_process_set_worker, 3, args=(flavour,), env=FLAVOURS[flavour])
    members_mean = (1 + 3) / 2
    for res in results:
        r = res["rank"]
        assert res["flavour"] == ("tf_keras" if flavour == "tf_keras" else "keras"), res["flavour"]
        want = np.full(2, members_mean) if res["member"] else np.full(2, float(r + 1))
        for key in ("tape_eager", "tape_function", "legacy"):
            np.testing.assert_allclose(res[key], want, err_msg=f"{key} on rank {r}")
        np.testing.assert_allclose(res["keras"], 1.0 - want, err_msg=f"keras on rank {r}")
        if res["member"]:
            np.testing.assert_allclose(res["rs_grad"], np.full([4, 2], 2.0))   # x set size (2), not x 3
