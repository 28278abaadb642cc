"""horovod.jax inside jax.jit (ordered host callbacks) on np = 1..4 real ranks, against numpy.

One job per world size traces and runs every collective under ``jax.jit`` (bfloat16 and 64-bit types included),
the grouped and pytree forms (with buckets), the gradient of allreduce, collectives inside ``lax.cond``,
``lax.scan`` and ``fori_loop``, several unnamed collectives in one program, a process set, and what is refused
and how: ragged allgather, alltoall with splits, async handles, ``jax.checkpoint``; and ``vmap`` of every
collective, each example getting what it would get alone.
"""
from __future__ import annotations

import os

import pytest

from jax_helpers import SIZES, require_jax, run, values

require_jax()
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # ranks start after JAX loaded here

from checks import Checks, assert_no_failures  # noqa: E402


def jit_worker() -> dict:  # noqa: C901  (one flat script on purpose: one job checks everything)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd

    vals = values
    n_all = int(os.environ["HOROVOD_SIZE"])
    evens = hvd.ProcessSet(range(0, n_all, 2))
    hvd.init(process_sets=[evens])
    r, n = hvd.rank(), hvd.size()
    c = Checks(r)

    def every(tag, shape, dtype):
        return [vals(tag, q, shape, dtype) for q in range(n)]

    def want(array):
        return jnp.asarray(array)

    # -- allreduce for each op and a spread of dtypes ------------------------------------------------------------
    reducers = {hvd.Sum: lambda s: s.sum(0), hvd.Min: lambda s: s.min(0), hvd.Max: lambda s: s.max(0)}
    for dtype in ("float32", "bfloat16", "float64", "int32", "int64", "uint8", "float16"):
        for op, reduce in reducers.items():
            tag = ("ar", dtype, op)
            f = jax.jit(lambda x, op=op: hvd.allreduce(x, op=op))
            got = c.run(f"jit allreduce {dtype} op {op}", lambda: f(jnp.asarray(vals(tag, r, (3, 4), dtype))))
            ref = reduce(np.stack([a.astype(np.float64) for a in every(tag, (3, 4), dtype)])).astype(dtype)
            if got is not None:
                c.equal(got, want(ref), f"jit allreduce {dtype} op {op}")
    avg = jax.jit(lambda x: hvd.allreduce(x))(jnp.asarray(vals("avg", r, (5,), "float32")))
    c.close(avg, want(np.mean(np.stack(every("avg", (5,), "float32")), 0).astype(np.float32)), "jit average",
            rtol=1e-6)
    scaled = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0))(
        jnp.asarray(vals("sc", r, (4,), "float64")))
    c.equal(scaled, want(2.0 * np.sum(every("sc", (4,), "float64"), 0)), "jit allreduce scale factors")

    # -- allgather, broadcast, reducescatter, alltoall ---------------------------------------------------------------
    for dtype in ("float32", "bfloat16", "int64"):
        x = jnp.asarray(vals(("ag", dtype), r, (2, 3), dtype))
        c.equal(jax.jit(hvd.allgather)(x), want(np.concatenate(every(("ag", dtype), (2, 3), dtype))),
                f"jit allgather {dtype}")
        root = n - 1
        c.equal(jax.jit(lambda v: hvd.broadcast(v, root))(x), want(vals(("ag", dtype), root, (2, 3), dtype)),
                f"jit broadcast {dtype}")
    rows = 2 * n + 1                                            # uneven: the first rank gets one row more
    x = jnp.asarray(vals("rs", r, (rows, 2), "float32"))
    total = np.sum(every("rs", (rows, 2), "float32"), 0)
    first = [q * (rows // n) + min(q, rows % n) for q in range(n + 1)]
    c.equal(jax.jit(lambda v: hvd.reducescatter(v, op=hvd.Sum))(x), want(total[first[r]:first[r + 1]]),
            "jit reducescatter uneven rows")
    x = jnp.asarray(vals("a2a", r, (2 * n, 3), "int32"))
    received = np.concatenate([vals("a2a", q, (2 * n, 3), "int32")[2 * r:2 * r + 2] for q in range(n)])
    c.equal(jax.jit(hvd.alltoall)(x), want(received), "jit alltoall equal splits")

    # -- grouped forms and pytrees (tiny buckets: HOROVOD_GRADIENT_BUCKET_BYTES in the job's environment) ----------
    xs = [jnp.asarray(vals(("g", i), r, (i + 1, 2), "float32")) for i in range(3)]
    sums = [np.sum(every(("g", i), (i + 1, 2), "float32"), 0) for i in range(3)]
    got = jax.jit(lambda v: hvd.grouped_allreduce(v, op=hvd.Sum))(xs)
    for i in range(3):
        c.equal(got[i], want(sums[i]), f"jit grouped_allreduce member {i}")
    got = jax.jit(hvd.grouped_allgather)(xs)
    for i in range(3):
        c.equal(got[i], want(np.concatenate(every(("g", i), (i + 1, 2), "float32"))), f"jit grouped_allgather {i}")
    tree = {"w": jnp.asarray(vals("tw", r, (3, 2), "float32")), "b": jnp.asarray(vals("tb", r, (2,), "float32")),
            "layers": [jnp.asarray(vals(("tl", i), r, (4,), "float32")) for i in range(4)],
            "count": jnp.asarray(vals("tc", r, (), "int32")), "half": jnp.asarray(vals("th", r, (3,), "bfloat16"))}
    reduced = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))(tree)
    flat_in = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), out in zip(flat_in, jax.tree_util.tree_leaves(reduced)):
        tag = {"'w'": "tw", "'b'": "tb", "'count'": "tc", "'half'": "th"}.get(jax.tree_util.keystr(path)[1:-1])
        if tag is None:   # ['layers'][i]
            i = int(jax.tree_util.keystr(path).split("[")[-1].rstrip("]"))
            tag = ("tl", i)
        dtype = str(leaf.dtype)
        ref = np.sum(np.stack([v.astype(np.float64) for v in every(tag, leaf.shape, dtype)]), 0).astype(dtype)
        c.equal(out, want(ref), f"jit pytree allreduce {jax.tree_util.keystr(path)}")
    c.true(jax.tree_util.tree_structure(reduced) == jax.tree_util.tree_structure(tree), "pytree structure kept")
    bcast = jax.jit(lambda t: hvd.broadcast_parameters(t, root_rank=n - 1))(tree)
    for (path, _), out in zip(flat_in, jax.tree_util.tree_leaves(bcast)):
        c.true(out.dtype == _.dtype, f"jit broadcast_parameters dtype {jax.tree_util.keystr(path)}")
    c.equal(bcast["w"], want(vals("tw", n - 1, (3, 2), "float32")), "jit broadcast_parameters w")
    c.equal(bcast["layers"][3], want(vals(("tl", 3), n - 1, (4,), "float32")), "jit broadcast_parameters layer")

    # -- gradients: d/dx_r of sum(allreduce(x) * w_r) is the same reduction of every rank's w ------------------------
    w = jnp.asarray(vals("gw", r, (3,), "float32"))
    x = jnp.asarray(vals("gx", r, (3,), "float32"))
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        grad = jax.jit(jax.grad(lambda v, op=op: jnp.sum(hvd.allreduce(v, op=op) * w)))(x)
        c.close(grad, want(scale * np.sum(every("gw", (3,), "float32"), 0)), f"jit grad of allreduce op {op}",
                rtol=1e-6)
    tgrad = jax.jit(jax.grad(lambda t: jnp.sum(hvd.allreduce(t, op=hvd.Sum)["a"] * w)))({"a": x, "b": x})
    c.equal(tgrad["a"], want(np.sum(every("gw", (3,), "float32"), 0)), "jit grad of pytree allreduce")
    c.equal(tgrad["b"], jnp.zeros(3, jnp.float32), "jit grad of an unused pytree leaf")

    # -- control flow and order: a collective in lax.cond; several unnamed collectives in one program ------------------
    cond = jax.jit(lambda v, k: jax.lax.cond(k > 0, lambda u: hvd.allreduce(u, op=hvd.Sum), lambda u: u * 0, v))
    x = jnp.asarray(vals("cond", r, (2,), "float32"))
    c.equal(cond(x, 1), want(np.sum(every("cond", (2,), "float32"), 0)), "jit allreduce in lax.cond (taken)")
    c.equal(cond(x, 0), jnp.zeros(2, jnp.float32), "jit lax.cond (not taken)")

    # loops: ordered callbacks are threaded through scan and while_loop, one collective per iteration
    steps = jnp.asarray(np.stack([vals(("scan", i), r, (2,), "float32") for i in range(3)]))
    scanned = jax.jit(lambda xs: jax.lax.scan(lambda acc, v: (acc + hvd.allreduce(v, op=hvd.Sum), None),
                                              jnp.zeros(2, jnp.float32), xs)[0])(steps)
    c.equal(scanned, want(sum(np.sum(every(("scan", i), (2,), "float32"), 0) for i in range(3))),
            "allreduce in every iteration of lax.scan")
    looped = jax.jit(lambda v: jax.lax.fori_loop(0, 3, lambda i, acc: acc + hvd.allreduce(v, op=hvd.Max),
                                                 jnp.zeros(2, jnp.float32)))(steps[0])
    c.equal(looped, want(3 * np.max(every(("scan", 0), (2,), "float32"), 0)), "allreduce in lax.fori_loop")

    def many(a, b):
        s = hvd.allreduce(a, op=hvd.Sum)
        m = hvd.allreduce(b, op=hvd.Max)
        return hvd.allgather(s + m), hvd.broadcast(s - m, 0)
    a, b = jnp.asarray(vals("ma", r, (2,), "float32")), jnp.asarray(vals("mb", r, (2,), "float32"))
    s_ref = np.sum(every("ma", (2,), "float32"), 0)
    m_ref = np.max(every("mb", (2,), "float32"), 0)
    for attempt in range(2):   # the second call runs the cached program
        gathered, sent = jax.jit(many)(a, b)
        c.equal(gathered, want(np.tile(s_ref + m_ref, n)), f"several unnamed collectives in one program ({attempt})")
        c.equal(sent, want(s_ref - m_ref), f"broadcast after them ({attempt})")
    named = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, name="named.in.jit"))(a)
    c.equal(named, want(s_ref), "named allreduce in jit")

    # -- vmap: every example gets what it would get alone (one callback for the whole batch) -----------------------
    batch = 3
    xb = jnp.asarray(vals("vm", r, (batch, 2 * n, 2), "float32"))
    per_rank = every("vm", (batch, 2 * n, 2), "float32")
    c.equal(jax.jit(jax.vmap(lambda v: hvd.allreduce(v, op=hvd.Sum)))(xb), want(np.sum(per_rank, 0)),
            "vmap allreduce")
    c.equal(jax.vmap(lambda v: hvd.broadcast(v, n - 1))(xb), want(per_rank[n - 1]), "vmap broadcast")
    c.equal(jax.jit(jax.vmap(hvd.allgather))(xb), want(np.concatenate(per_rank, axis=1)), "vmap allgather")
    c.equal(jax.vmap(lambda v: hvd.reducescatter(v, op=hvd.Sum))(xb),
            want(np.sum(per_rank, 0)[:, 2 * r:2 * r + 2]), "vmap reducescatter")
    c.equal(jax.jit(jax.vmap(hvd.alltoall))(xb), want(np.concatenate([p[:, 2 * r:2 * r + 2] for p in per_rank],
                                                                     axis=1)), "vmap alltoall")
    per_example = jax.vmap(jax.grad(lambda v: jnp.sum(hvd.allreduce(v, op=hvd.Sum) * w[0])))(xb)
    c.equal(per_example, want(np.broadcast_to(np.sum(every("gw", (3,), "float32"), 0)[0], xb.shape)),
            "vmap of the gradient of allreduce")

    # -- a process set inside jit --------------------------------------------------------------------------------
    if r % 2 == 0:
        members = list(range(0, n, 2))
        got = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, process_set=evens))(a)
        c.equal(got, want(np.sum([vals("ma", q, (2,), "float32") for q in members], 0)), "jit process-set allreduce")
        got = jax.jit(lambda v: hvd.allgather(v, process_set=evens))(a)
        c.equal(got, want(np.concatenate([vals("ma", q, (2,), "float32") for q in members])),
                "jit process-set allgather")

    # -- refused, with the reason ----------------------------------------------------------------------------------
    if n > 1:
        ragged = jnp.ones((1 if r == 0 else 2, 2), jnp.float32)   # 2n - 1 rows in all: no rank expects that
        c.raises("ragged allgather in jit", Exception, lambda: jax.jit(hvd.allgather)(ragged).block_until_ready(),
                 match="traced program was built for")
    c.raises("alltoall splits in jit", TypeError,
             lambda: jax.jit(lambda v: hvd.alltoall(v, splits=[2] * n))(jnp.ones((2 * n,))), match="splits=None")
    c.raises("async handle in jit", TypeError, lambda: jax.jit(lambda v: hvd.allreduce_async(v))(a),
             match="outside jit")
    c.raises("remat of a collective", NotImplementedError,
             lambda: jax.grad(jax.checkpoint(lambda v: jnp.sum(hvd.allreduce(v, op=hvd.Sum))))(a), match="Effects")
    c.raises("gradient of Max", TypeError,
             lambda: jax.grad(lambda v: jnp.sum(hvd.allreduce(v, op=hvd.Max)))(a), match="Sum and Average")
    # The job is still healthy after the refusals.
    c.equal(jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum))(a), want(s_ref), "allreduce after the refusals")
    hvd.shutdown()
    return c.report()


@pytest.mark.parametrize("np_", SIZES)
def test_collectives_inside_jit(np_):
    assert_no_failures(run(jit_worker, np_, env={"HOROVOD_GRADIENT_BUCKET_BYTES": "40"}),
                       minimum_checks=60)
