"""Graph mode with many independent Horovod ops: no deadlock, whatever the size of TF's inter-op thread pool.

A TF1 session runs the independent nodes of one ``session.run`` concurrently on ``inter_op_parallelism_threads``
threads, in an order that differs between ranks.  These tests build one graph with more than 100 independent
Horovod ops (every collective, grouped ones, and their gradients), evaluate it in one ``session.run`` with pools
of one and two threads at np = 2 and 3 (in a plain ``Session``, twice, and in a ``MonitoredTrainingSession``),
and check every value against numpy; then the same ops under ``tf.function``.  A deadlock fails through the
harness's timeout (``TIMEOUT`` in tf_helpers).
"""
from __future__ import annotations

import numpy as np
import pytest

from tf_helpers import run_tf

ROUNDS = 5              # each round adds OPS_PER_ROUND Horovod ops to the graph
OPS_PER_ROUND = 22
GATHER_DTYPES = ["float32", "int64", "float16", "float64", "int32", "uint8"]
REDUCE_DTYPES = ["float32", "float64", "int32", "int64", "float16"]
TAILS = [(), (2,), (2, 3)]   # with the first dimension: tensors of rank 1 to 3


# -- inputs (the same function builds them in the ranks and the expectations in the test) --------------------
def _scatter_rows(rows, n, r):
    return rows // n + (1 if r < rows % n else 0)


def _a2a_splits(p, n, i):
    return [(p + q + i) % 3 for q in range(n)]


def _inputs(p, n, i):
    """Rank p's inputs for round i: name -> numpy array (plus ``splits`` for alltoall)."""
    tail = TAILS[i % 3]
    rdt = REDUCE_DTYPES[i % len(REDUCE_DTYPES)]
    gdt = GATHER_DTYPES[i % len(GATHER_DTYPES)]
    shape = (3,) + tail

    def ramp(shape_, dtype, scale, offset):
        return ((np.arange(int(np.prod(shape_))).reshape(shape_) % 7 + offset) * scale).astype(dtype)

    a2a_rows = sum(_a2a_splits(p, n, i))
    rs_rows = 2 * n + i % 2
    return {
        "ar": ramp(shape, rdt, p + 1, i),
        "avg": ramp(shape, ["float32", "float64"][i % 2], p + 1, i),
        "ag": ramp((p + 1 + i % 2,) + tail, gdt, 1, 10 * p + i),
        "bc": np.full(shape, p + 10 * i, dtype=gdt),
        "a2a": ramp((a2a_rows,) + tail, gdt, 1, 20 * p + i),
        "rs": ramp((rs_rows, 3), "float32", p + 1, i),
        "gar": [ramp((2 + k,), "float32", p + k + 1, i) for k in range(3)],
        "gag": [ramp((p + 1, k + 1), "float64", 1, 5 * p + k) for k in range(2)],
        "grs": [ramp((n + k, 2), "float64", p + 1, k + i) for k in range(2)],
        # gradients (float64: exact)
        "g_ar": ramp((3,), "float64", p + 1, i), "g_ar_c": np.arange(3.0) + i,
        "g_ag": ramp((p + 1, 2), "float64", 1, p), "g_ag_c": np.arange(n * (n + 1) + 0.0).reshape(-1, 2) + i,
        "g_bc": ramp((4,), "float64", p + 1, i), "g_bc_c": (p + 1) * (np.arange(4.0) + 1),
        "g_a2a": ramp((a2a_rows, 2), "float64", 1, p + i), "g_a2a_c": np.float64(p + 1),
        "g_rs": ramp((rs_rows, 3), "float64", 1, i), "g_rs_c": np.float64(p + 1),
        "g_gar": [ramp((2,), "float64", 1, p + i), ramp((3,), "float64", 1, p)],
        "g_gar_c": [np.arange(2.0) + 1, np.arange(3.0) - 1],
    }


def _expected(r, n, i):
    ins = [_inputs(p, n, i) for p in range(n)]
    mine = ins[r]

    def total(key, k=None):
        vals = [x[key] if k is None else x[key][k] for x in ins]
        return np.sum(np.stack(vals).astype(np.float64), axis=0).astype(vals[0].dtype)

    def block(array, rank):
        rows = array.shape[0]
        start = sum(_scatter_rows(rows, n, q) for q in range(rank))
        return array[start:start + _scatter_rows(rows, n, rank)]

    root, g_root = i % n, (i + 1) % n
    splits = [_a2a_splits(p, n, i) for p in range(n)]
    a2a = np.concatenate([x["a2a"][sum(splits[p][:r]):sum(splits[p][:r + 1])] for p, x in enumerate(ins)])
    ag_offset = sum(p + 1 for p in range(r))
    my_splits = splits[r]
    return {
        "ar": total("ar"),
        "avg": (np.mean(np.stack([x["avg"] for x in ins]).astype(np.float64), axis=0)).astype(mine["avg"].dtype),
        "ag": np.concatenate([x["ag"] for x in ins]),
        "bc": ins[root]["bc"],
        "a2a": a2a, "a2a_splits": np.array([splits[p][r] for p in range(n)], np.int32),
        "rs": block(total("rs"), r),
        "gar": [total("gar", k) for k in range(3)],
        "gag": [np.concatenate([x["gag"][k] for x in ins]) for k in range(2)],
        "grs": [block(total("grs", k), r) for k in range(2)],
        "g_ar": n * mine["g_ar_c"],
        "g_ag": mine["g_ag_c"][ag_offset:ag_offset + r + 1],
        "g_bc": (np.mean([x["g_bc_c"] for x in ins], axis=0) if r == g_root else np.zeros(4)),
        "g_a2a": np.concatenate([np.full((my_splits[q], 2), float(q + 1)) for q in range(n)]),
        # reducescatter(Sum)'s gradient: the allgathered upstream times the set size (Horovod 0.28.1's rule)
        "g_rs": n * np.concatenate([np.full((_scatter_rows(2 * n + i % 2, n, q), 3), float(q + 1))
                                    for q in range(n)]),
        "g_gar": [n * c for c in mine["g_gar_c"]],
    }


# -- the graph ------------------------------------------------------------------------------------------------
def _build(hvd, tf, r, n):
    """Every round's ops, none depending on another: name -> tensor (or list of tensors)."""
    out = {}
    for i in range(ROUNDS):
        x = {k: ([tf.constant(a) for a in v] if isinstance(v, list) else tf.constant(v))
             for k, v in _inputs(r, n, i).items()}
        res = {
            "ar": hvd.allreduce(x["ar"], op=hvd.Sum),
            "avg": hvd.allreduce(x["avg"], op=hvd.Average),
            "ag": hvd.allgather(x["ag"]),
            "bc": hvd.broadcast(x["bc"], root_rank=i % n),
            "rs": hvd.reducescatter(x["rs"], op=hvd.Sum),
            "gar": hvd.grouped_allreduce(x["gar"], op=hvd.Sum),
            "gag": hvd.grouped_allgather(x["gag"]),
            "grs": hvd.grouped_reducescatter(x["grs"], op=hvd.Sum),
        }
        res["a2a"], res["a2a_splits"] = hvd.alltoall(x["a2a"], splits=_a2a_splits(r, n, i))

        y = hvd.allreduce(x["g_ar"], op=hvd.Sum)
        res["g_ar"] = tf.gradients(tf.reduce_sum(y * x["g_ar_c"]), x["g_ar"])[0]
        y = hvd.allgather(x["g_ag"])
        res["g_ag"] = tf.gradients(tf.reduce_sum(y * x["g_ag_c"]), x["g_ag"])[0]
        y = hvd.broadcast(x["g_bc"], root_rank=(i + 1) % n)
        res["g_bc"] = tf.gradients(tf.reduce_sum(y * x["g_bc_c"]), x["g_bc"])[0]
        y, _ = hvd.alltoall(x["g_a2a"], splits=_a2a_splits(r, n, i))
        res["g_a2a"] = tf.gradients(tf.reduce_sum(y * x["g_a2a_c"]), x["g_a2a"])[0]
        y = hvd.reducescatter(x["g_rs"], op=hvd.Sum)
        res["g_rs"] = tf.gradients(tf.reduce_sum(y * x["g_rs_c"]), x["g_rs"])[0]
        ys = hvd.grouped_allreduce(x["g_gar"], op=hvd.Sum)
        loss = tf.add_n([tf.reduce_sum(a * c) for a, c in zip(ys, x["g_gar_c"])])
        res["g_gar"] = tf.gradients(loss, x["g_gar"])
        for key, value in res.items():
            out[f"{key}{i}"] = value
    return out


def _graph_worker(threads):
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(threads)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    result = {}

    with tf.Graph().as_default() as graph:
        fetches = _build(hvd, tf, r, n)
        result["graph_ops"] = sum(1 for op in graph.get_operations() if op.type == "DatasetToSingleElement")
        # Per-session threads: the pool really has `threads` threads (the global pool is sized once per process).
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1,
                                          use_per_session_threads=True)
        with tf.compat.v1.Session(config=config) as sess:
            result["graph"] = sess.run(fetches)
            result["graph_again"] = sess.run(fetches)   # the same nodes (the same names) once more
        with tf.compat.v1.train.MonitoredTrainingSession(config=config) as sess:
            result["monitored"] = sess.run(fetches)

    function = tf.function(lambda: _build(hvd, tf, r, n), autograph=False)
    concrete = function.get_concrete_function()
    result["function_ops"] = sum(1 for op in concrete.graph.get_operations()
                                 if op.type in ("PyFunc", "EagerPyFunc"))
    values = function()
    result["function"] = {k: ([t.numpy() for t in v] if isinstance(v, list) else v.numpy())
                          for k, v in values.items()}
    return result


def _assert_matches(got, want, label):
    if isinstance(want, list):
        assert len(got) == len(want), label
        for k, (g, w) in enumerate(zip(got, want)):
            _assert_matches(g, w, f"{label}[{k}]")
        return
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{label}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6, err_msg=label)


# One and two inter-op threads, np = 2 and 3 (each pairing once: the four pairings cost ~70 s more of CI).
@pytest.mark.parametrize("np_,threads", [(2, 2), (3, 1)])
def test_many_independent_ops_in_one_run(np_, threads):
    results = run_tf(_graph_worker, np_, args=(threads,))
    for r, res in enumerate(results):
        assert res["graph_ops"] >= 100, res["graph_ops"]
        assert res["function_ops"] >= 100, res["function_ops"]
        for i in range(ROUNDS):
            for key, want in _expected(r, np_, i).items():
                for mode in ("graph", "graph_again", "monitored", "function"):
                    _assert_matches(res[mode][f"{key}{i}"], want, f"rank {r} {mode} {key}{i}")


# -- the mechanism on its own -----------------------------------------------------------------------------------
def _pool_probe_worker():
    """Nodes that can only finish together (a barrier of all of them) in a session with one inter-op thread."""
    import threading

    import tensorflow as tf

    from horovod.tensorflow import graph_ops

    parties = 6
    out = {}
    for mode in ("numpy_function", "off_pool_call"):
        barrier = threading.Barrier(parties, timeout=5)

        def meet(x):
            barrier.wait()
            return x + 1

        with tf.Graph().as_default():
            if mode == "numpy_function":
                nodes = [tf.numpy_function(meet, [tf.constant(float(k))], tf.float32, stateful=True)
                         for k in range(parties)]
            else:
                nodes = [graph_ops.off_pool_call(lambda x: [meet(x)], [tf.constant(float(k))], [tf.float32],
                                                 "Probe")[0] for k in range(parties)]
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
            with tf.compat.v1.Session(config=config) as sess:
                try:
                    out[mode] = sess.run(nodes)
                except tf.errors.OpError as exc:
                    out[mode] = f"{type(exc).__name__}: {exc}"
    return out


def test_off_pool_nodes_wait_without_holding_inter_op_threads():
    (res,) = run_tf(_pool_probe_worker, 1)
    # The control: waiting numpy_functions starve a one-thread pool (this is what deadlocked across ranks).
    assert isinstance(res["numpy_function"], str) and "BrokenBarrierError" in res["numpy_function"], res
    np.testing.assert_array_equal(res["off_pool_call"], np.arange(6.0) + 1)


# -- errors in TF1 graphs -----------------------------------------------------------------------------------------
def _graph_errors_worker():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    def capture(key, build):
        with tf.Graph().as_default():
            fetch = build()
            with tf.compat.v1.Session() as sess:
                try:
                    out[key] = sess.run(fetch)
                except tf.errors.OpError as exc:
                    out[key] = {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}

    capture("shape", lambda: hvd.allreduce(tf.ones([2 + r]), name="mismatch"))
    capture("bad_splits", lambda: hvd.alltoall(tf.ones([4]), splits=[3, 3]))
    capture("after", lambda: hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum))
    return out


def test_graph_errors_surface_and_the_engine_keeps_working():
    for res in run_tf(_graph_errors_worker, 2):
        shape = res["shape"]
        assert "FailedPreconditionError" in shape["types"], shape
        assert "Mismatched ALLREDUCE tensor shapes" in shape["message"] and "HorovodAllreduce" in shape["message"]
        bad = res["bad_splits"]
        assert "InvalidArgumentError" in bad["types"], bad
        assert "splits sum to 6" in bad["message"], bad
        np.testing.assert_array_equal(res["after"], [1.0])
