"""horovod.tensorflow collectives across real processes: every op eagerly and inside tf.function, gradients,
process sets, the in-graph queries, object helpers and how errors surface."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tf_helpers import run_tf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed")


# -- the op suite (runs in every rank) ----------------------------------------------------------------------
def _op_suite(hvd, tf, v):
    """Every collective once; returns a dict of tensors (works eagerly and inside tf.function)."""
    r, n = hvd.rank(), hvd.size()
    a = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]) + float(r)
    out = {}
    out["avg"] = hvd.allreduce(a)
    out["sum"] = hvd.allreduce(a, op=hvd.Sum)
    out["min"] = hvd.allreduce(a, op=hvd.Min)
    out["max"] = hvd.allreduce(a, op=hvd.Max)
    out["prod"] = hvd.allreduce(a + 1.0, op=hvd.Product)
    out["scaled"] = hvd.allreduce(a, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    out["legacy_average_false"] = hvd.allreduce(a, average=False)
    out["int_avg"] = hvd.allreduce(tf.constant([r + 1, 2 * (r + 1), 7], tf.int32))
    for dtype in (tf.float16, tf.float64, tf.int64, tf.bfloat16, tf.uint8):
        out[f"sum_{dtype.name}"] = hvd.allreduce(tf.cast(a, dtype), op=hvd.Sum)
    out["variable"] = hvd.allreduce(v, op=hvd.Sum)
    out["fp16"] = hvd.allreduce(a, op=hvd.Sum, compression=hvd.Compression.fp16)
    out["named"] = hvd.allreduce(a, op=hvd.Sum, name="my_tensor")
    g = hvd.grouped_allreduce([a, tf.constant([r, 10], tf.int64), tf.constant(1.5 * r, tf.float64)], op=hvd.Sum)
    out["grouped_0"], out["grouped_1"], out["grouped_2"] = g
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r], tf.int64), tf.constant([3, 2], tf.int64))
    summed = hvd.allreduce(slices, op=hvd.Sum)
    out["sparse_values"], out["sparse_indices"] = summed.values, summed.indices
    out["sparse_avg_values"] = hvd.allreduce(slices).values
    out["gather"] = hvd.allgather(tf.fill([r + 1, 2], float(r)))
    out["gather_u32"] = hvd.allgather(tf.cast(tf.reshape(tf.range(3 * (r + 1)), [r + 1, 3]) + 100 * r, tf.uint32))
    out["gather_bf16"] = hvd.allgather(tf.cast(tf.fill([1, 2], 0.5 + r), tf.bfloat16))
    gg = hvd.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], 2.0 * r)])
    out["ggather_0"], out["ggather_1"] = gg
    out["bcast"] = hvd.broadcast(a, root_rank=n - 1)
    out["bcast_u32_scalar"] = hvd.broadcast(tf.constant(7 + r, tf.uint32), root_rank=0)
    splits = [(r + p) % 3 for p in range(n)]
    a2a, received = hvd.alltoall(tf.range(sum(splits)) + 100 * r, splits=splits)
    out["alltoall"], out["alltoall_splits"] = a2a, received
    # Without splits: only the output (the original's return form); with them: (output, received splits).
    out["alltoall_even"] = hvd.alltoall(tf.reshape(tf.range(2 * n * 2) + 10 * r, [2 * n, 2]))
    rows = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2]) * float(r + 1)
    out["rs_sum"] = hvd.reducescatter(rows, op=hvd.Sum)
    out["rs_avg"] = hvd.reducescatter(rows)
    grs = hvd.grouped_reducescatter([rows, tf.ones([n, 3], tf.int32) * (r + 1)], op=hvd.Sum)
    out["grs_0"], out["grs_1"] = grs
    out["size_op"] = hvd.size_op()
    out["rank_op"] = hvd.rank_op()
    out["local_size_op"] = hvd.local_size_op()
    out["local_rank_op"] = hvd.local_rank_op()
    out["included_op"] = hvd.process_set_included_op()
    return out


def _collectives_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    v = tf.Variable(tf.fill([2], float(r + 1)))
    eager = {k: t.numpy() for k, t in _op_suite(hvd, tf, v).items()}
    fn = tf.function(lambda: _op_suite(hvd, tf, v))
    first = {k: t.numpy() for k, t in fn().items()}
    second = {k: t.numpy() for k, t in fn().items()}   # the same graph again: names are reused in order
    # in-place broadcast on variables, eagerly and in a function
    w = tf.Variable([float(r), float(10 * r)])
    hvd.broadcast_(w, root_rank=1)
    bw = w.numpy()
    u = tf.Variable([float(r)] * 3)
    tf.function(lambda: hvd.broadcast_([u], root_rank=0), autograph=False)()
    # broadcast_variables and objects
    vs = [tf.Variable(tf.fill([2, 2], float(r))), tf.Variable(r, dtype=tf.int64)]
    hvd.broadcast_variables(vs, root_rank=1)
    objects = {
        "bcast_obj": hvd.broadcast_object({"rank": r, "payload": [r] * 3}, root_rank=1),
        "bcast_fn": hvd.broadcast_object_fn(root_rank=0)(("from", r)),
        "gather_obj": hvd.allgather_object({"r": r}),
    }
    return {"eager": eager, "first": first, "second": second, "broadcast_": bw, "broadcast_fn_var": u.numpy(),
            "bvars": [x.numpy() for x in vs], "objects": objects, "rank": r, "size": hvd.size(),
            "types": {"sparse": type(hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]),
                                                                       tf.constant([2, 2])))).__name__}}


def _expected(r: int, n: int) -> dict:
    a = [np.arange(6, dtype=np.float32).reshape(2, 3) + p for p in range(n)]
    exp = {
        "avg": sum(a) / n, "sum": sum(a), "min": np.minimum.reduce(a), "max": np.maximum.reduce(a),
        "prod": np.prod([x + 1 for x in a], axis=0), "scaled": sum(a), "legacy_average_false": sum(a),
        "int_avg": np.array([sum(p + 1 for p in range(n)) // n, sum(2 * (p + 1) for p in range(n)) // n, 7]),
        "variable": np.full(2, sum(p + 1 for p in range(n)), np.float32),
        "fp16": sum(a), "named": sum(a),
        "grouped_0": sum(a), "grouped_1": np.array([sum(range(n)), 10 * n]), "grouped_2": 1.5 * sum(range(n)),
        "sparse_values": np.concatenate([np.full([1, 2], p + 1.0) for p in range(n)]),
        "sparse_indices": np.arange(n),
        "sparse_avg_values": np.concatenate([np.full([1, 2], (p + 1.0) / n) for p in range(n)]),
        "gather": np.concatenate([np.full([p + 1, 2], float(p)) for p in range(n)]),
        "gather_u32": np.concatenate([np.arange(3 * (p + 1)).reshape(p + 1, 3) + 100 * p for p in range(n)]),
        "gather_bf16": np.concatenate([np.full([1, 2], 0.5 + p) for p in range(n)]),
        "ggather_0": np.concatenate([np.full([p + 1], p) for p in range(n)]),
        "ggather_1": np.concatenate([np.full([1, 2], 2.0 * p) for p in range(n)]),
        "bcast": a[n - 1], "bcast_u32_scalar": np.array(7),
        "size_op": n, "rank_op": r, "local_size_op": n, "local_rank_op": r, "included_op": 1,
    }
    for name in ("float16", "float64", "int64", "bfloat16", "uint8"):
        exp[f"sum_{name}"] = sum(a)
    # alltoall: rank p sends splits_p[q] rows (of arange + 100 p) to rank q
    splits = {p: [(p + q) % 3 for q in range(n)] for p in range(n)}
    recv, rsplits = [], []
    for p in range(n):
        start = sum(splits[p][:r])
        recv.append(np.arange(start, start + splits[p][r]) + 100 * p)
        rsplits.append(splits[p][r])
    exp["alltoall"], exp["alltoall_splits"] = np.concatenate(recv), np.array(rsplits)
    exp["alltoall_even"] = np.concatenate([(np.arange(4 * n).reshape(2 * n, 2) + 10 * p)[2 * r:2 * r + 2]
                                           for p in range(n)])
    rows = sum(np.arange(10, dtype=np.float32).reshape(5, 2) * (p + 1) for p in range(n))
    counts = [5 // n + (1 if p < 5 % n else 0) for p in range(n)]
    mine = rows[sum(counts[:r]):sum(counts[:r + 1])]
    exp["rs_sum"], exp["rs_avg"], exp["grs_0"] = mine, mine / n, mine
    exp["grs_1"] = np.full([1, 3], sum(p + 1 for p in range(n)))
    return exp


def _check_suite(result: dict, r: int, n: int, label: str) -> None:
    exp = _expected(r, n)
    assert set(exp) <= set(result), f"{label}: missing {set(exp) - set(result)}"
    for key, want in exp.items():
        got = np.asarray(result[key]).astype(np.float64)
        tol = 1e-2 if ("float16" in key or "bfloat16" in key or key in ("fp16", "gather_bf16")) else 1e-5
        np.testing.assert_allclose(got, np.asarray(want, np.float64), rtol=tol, atol=tol,
                                   err_msg=f"{label}: {key} on rank {r}")


def test_collectives_eagerly_and_in_tf_function():
    results = run_tf(_collectives_worker, 2)
    for res in results:
        r, n = res["rank"], res["size"]
        for label in ("eager", "first", "second"):
            _check_suite(res[label], r, n, label)
        # dtypes are preserved (fp16 compression decompresses back to float32)
        assert res["eager"]["fp16"].dtype == np.float32
        assert res["eager"]["sum_bfloat16"].dtype.name == "bfloat16"
        assert res["eager"]["gather_u32"].dtype == np.uint32
        assert res["types"]["sparse"] == "IndexedSlices"
        np.testing.assert_array_equal(res["broadcast_"], [1.0, 10.0])
        np.testing.assert_array_equal(res["broadcast_fn_var"], [0.0, 0.0, 0.0])
        np.testing.assert_array_equal(res["bvars"][0], np.full([2, 2], 1.0))
        assert res["bvars"][1] == 1
        assert res["objects"]["bcast_obj"] == {"rank": 1, "payload": [1, 1, 1]}
        assert res["objects"]["bcast_fn"] == ("from", 0)
        assert res["objects"]["gather_obj"] == [{"r": p} for p in range(n)]


# -- gradients ----------------------------------------------------------------------------------------------
def _gradient_suite(hvd, tf, x):
    """Gradients of sum(weights * op(x)) through each collective."""
    r, n = hvd.rank(), hvd.size()
    out = {}

    def grad_of(f, weights):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
            loss = tf.reduce_sum(y * weights)
        return tape.gradient(loss, x)

    w2 = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out["sum"] = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), w2)
    out["avg"] = grad_of(lambda t: hvd.allreduce(t), w2)
    out["scaled"] = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=3.0), w2)
    out["max"] = grad_of(lambda t: hvd.allreduce(t * float(r + 1), op=hvd.Max), w2)
    out["grouped"] = grad_of(lambda t: hvd.grouped_allreduce([t, 2.0 * t], op=hvd.Sum)[1], w2)
    out["fp16"] = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), w2)
    out["gather"] = grad_of(lambda t: hvd.allgather(t[: r + 1]), tf.reshape(tf.range(3.0 * sum(range(1, n + 1))),
                                                                          [-1, 3]))
    out["bcast"] = grad_of(lambda t: hvd.broadcast(t, root_rank=0), w2 * float(r + 1))
    out["alltoall"] = grad_of(lambda t: hvd.alltoall(tf.reshape(t, [6, 1])[: 2 * n], splits=[2] * n)[0],
                              tf.reshape(tf.range(2.0 * n), [-1, 1]) + 10.0 * r)
    out["reducescatter"] = grad_of(lambda t: hvd.reducescatter(tf.concat([t, t], axis=0)[:n + 1], op=hvd.Sum),
                                   tf.ones([1, 3]) * float(r + 1))
    return out


def _gradients_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    x = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]) + 1.0
    eager = {k: t.numpy() for k, t in _gradient_suite(hvd, tf, x).items()}
    graph = {k: t.numpy() for k, t in tf.function(lambda: _gradient_suite(hvd, tf, x), autograph=False)().items()}
    return {"eager": eager, "function": graph, "rank": hvd.rank(), "size": hvd.size()}


def _expected_grads(r: int, n: int) -> dict:
    w2 = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    x = np.arange(6.0).reshape(2, 3) + 1.0
    exp = {"sum": n * w2, "avg": w2, "scaled": 3.0 * n * w2, "grouped": 2.0 * n * w2, "fp16": n * w2}
    # Max of x * (p + 1): the last rank holds the maximum everywhere; its gradient is the summed upstream * scale
    exp["max"] = (n * w2 * (r + 1)) if r == n - 1 else np.zeros_like(w2)
    gathered_w = np.arange(3.0 * sum(range(1, n + 1))).reshape(-1, 3)
    start = sum(range(1, r + 1))
    g = np.zeros_like(x)
    g[: r + 1] = gathered_w[start:start + r + 1]     # average of identical upstreams = the upstream
    exp["gather"] = g
    exp["bcast"] = np.mean([w2 * (p + 1) for p in range(n)], axis=0) if r == 0 else np.zeros_like(w2)
    # alltoall of equal splits of 2: the gradient routes each rank's upstream block back to its sender
    up = {p: np.arange(2.0 * n).reshape(-1, 1) + 10.0 * p for p in range(n)}
    back = np.concatenate([up[q][2 * r:2 * r + 2] for q in range(n)]).reshape(-1)
    ga = np.zeros(6)
    ga[: 2 * n] = back
    exp["alltoall"] = ga.reshape(2, 3)
    # reducescatter of the n+1 rows [x; x][:n+1]: rank p keeps rows of its block; upstream ones * (p+1)
    counts = [(n + 1) // n + (1 if p < (n + 1) % n else 0) for p in range(n)]
    upstream = np.concatenate([np.ones([counts[p], 3]) * (p + 1) for p in range(n)])
    stacked = np.zeros([2 * 2, 3])
    stacked[: n + 1] = upstream
    # Horovod 0.28.1's rule (framework_rules.reducescatter_grad_scale): the allgathered upstream times the set
    # size for Sum.
    exp["reducescatter"] = n * (stacked[:2] + stacked[2:])
    return exp


def test_gradients_through_collectives():
    for res in run_tf(_gradients_worker, 2):
        exp = _expected_grads(res["rank"], res["size"])
        for label in ("eager", "function"):
            for key, want in exp.items():
                np.testing.assert_allclose(res[label][key], want, rtol=1e-3, atol=1e-3,
                                           err_msg=f"{label} gradient of {key} on rank {res['rank']}")


# -- three ranks: uneven splits, process sets, join ---------------------------------------------------------
def _three_rank_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    out = {"rank": r}
    out["suite"] = {k: t.numpy() for k, t in _op_suite(hvd, tf, tf.Variable(tf.fill([2], float(r + 1)))).items()}
    out["suite_fn"] = {k: t.numpy() for k, t in tf.function(
        lambda: _op_suite(hvd, tf, tf.constant([float(r + 1)] * 2)), autograph=False)().items()}
    if evens.included():
        # Named: unnamed ops are numbered in issue order on every rank, and rank 1 does not issue these.
        out["set_sum"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum, process_set=evens, name="s").numpy()
        out["set_gather"] = tf.function(lambda: hvd.allgather(tf.fill([r + 1], r), process_set=evens),
                                        autograph=False)().numpy()
        out["set_rs"] = hvd.reducescatter(tf.ones([3, 1]) * float(r), op=hvd.Sum, process_set=evens,
                                          name="rs").numpy()
        out["set_size_op"] = hvd.size_op(process_set_id=evens.process_set_id).numpy()
        out["set_bcast"] = hvd.broadcast(tf.constant(float(r)), root_rank=2, process_set=evens, name="b").numpy()
    out["included"] = hvd.process_set_included_op(process_set_id=evens.process_set_id).numpy()
    # join: rank 0 has no more data; the others still reduce (rank 0 contributes zeros)
    if r == 0:
        out["join"] = int(hvd.join().numpy())
    else:
        out["after_join"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum).numpy()
        out["join"] = int(tf.function(lambda: hvd.join(), autograph=False)().numpy())
    return out


def test_three_ranks_process_sets_and_join():
    results = run_tf(_three_rank_worker, 3)
    n = 3
    for res in results:
        r = res["rank"]
        _check_suite(res["suite"], r, n, "np=3 eager")
        suite_fn = dict(res["suite_fn"])
        _check_suite({**suite_fn, "variable": np.full(2, 6.0)}, r, n, "np=3 function")
        assert res["included"] == (1 if r in (0, 2) else 0)
        if r in (0, 2):
            np.testing.assert_array_equal(res["set_sum"], [2.0])
            np.testing.assert_array_equal(res["set_gather"], [0, 2, 2, 2])
            np.testing.assert_array_equal(res["set_rs"], np.full([2 if r == 0 else 1, 1], 2.0))
            assert res["set_size_op"] == 2
            assert res["set_bcast"] == 2.0
        else:
            np.testing.assert_array_equal(res["after_join"], [3.0])
        assert res["join"] in (1, 2)
    assert len({res["join"] for res in results}) == 1


# -- one rank -----------------------------------------------------------------------------------------------
def _one_rank_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    suite = {k: t.numpy() for k, t in _op_suite(hvd, tf, tf.Variable([1.0, 1.0])).items()}
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * x)
    grads = hvd.DistributedGradientTape(tape).gradient(loss, [x])
    return {"suite": suite, "grad": grads[0].numpy(), "join": int(hvd.join().numpy())}


def test_one_rank():
    (res,) = run_tf(_one_rank_worker, 1)
    _check_suite(res["suite"], 0, 1, "np=1")
    np.testing.assert_array_equal(res["grad"], [2.0, 4.0])
    assert res["join"] == 0


# -- errors -------------------------------------------------------------------------------------------------
def _errors_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    def capture(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as exc:  # noqa: BLE001 — the test inspects what surfaced
            out[key] = {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}

    capture("eager_shape", lambda: hvd.allreduce(tf.ones([2 + r]), name="mismatch"))
    capture("eager_dtype", lambda: hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64)))
    capture("function_shape", lambda: tf.function(lambda: hvd.allreduce(tf.ones([3, 1 + r])), autograph=False)())
    capture("eager_bad_splits", lambda: hvd.alltoall(tf.ones([4]), splits=[1, 1]))
    capture("function_bad_splits",
            lambda: tf.function(lambda: hvd.alltoall(tf.ones([4]), splits=[3, 3]), autograph=False)())
    capture("scalar_allgather", lambda: hvd.allgather(tf.constant(1.0)))
    capture("reducescatter_max", lambda: hvd.reducescatter(tf.ones([2]), op=hvd.Max))
    capture("sparse_min", lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1]), tf.constant([0])), op=hvd.Min))
    capture("eager_broadcast_global", lambda: hvd.broadcast_global_variables(0))
    # the engine keeps working after the errors
    out["after"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum).numpy()
    return out


def test_errors_surface_with_tf_error_types():
    for res in run_tf(_errors_worker, 2):
        shape = res["eager_shape"]
        assert "FailedPreconditionError" in shape["types"] and "HorovodInternalError" in shape["types"]
        assert "Mismatched ALLREDUCE tensor shapes" in shape["message"]
        dtype = res["eager_dtype"]
        assert "FailedPreconditionError" in dtype["types"] and "Mismatched data types" in dtype["message"]
        func = res["function_shape"]
        assert "FailedPreconditionError" in func["types"], func
        assert "Mismatched ALLREDUCE tensor shapes" in func["message"] and "HorovodAllreduce" in func["message"]
        bad = res["eager_bad_splits"]
        assert "InvalidArgumentError" in bad["types"] and "ValueError" in bad["types"]
        assert "splits sum to 2" in bad["message"]
        assert "InvalidArgumentError" in res["function_bad_splits"]["types"]
        assert "ValueError" in res["scalar_allgather"]["types"]
        assert "ValueError" in res["reducescatter_max"]["types"]
        assert "NotImplementedError" in res["sparse_min"]["types"]
        assert "RuntimeError" in res["eager_broadcast_global"]["types"]
        np.testing.assert_array_equal(res["after"], [1.0])
