"""horovod.jax's API beyond the collective x dtype matrix (tests/conformance): the public names, async handles,
alltoall splits, ragged allgather, process sets, join, barrier, objects, pytrees, input conversion, errors.

The multi-rank parts run one job per world size (np = 1..4); the argument checks run in this process.
"""
from __future__ import annotations

import pytest

from jax_helpers import SIZES, require_jax, run, values

require_jax()
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # ranks start after JAX loaded here

from checks import Checks, assert_no_failures  # noqa: E402


# -- the public surface ------------------------------------------------------------------------------------------
def test_every_name_of_the_other_bindings_is_there():
    import horovod.jax as hvd
    import horovod.numpy as hnp
    from horovod.jax.mpi_ops import INPLACE

    # horovod.numpy's public names, less the modules and implementation pieces it imports
    internal = {"np", "List", "annotations", "blocking", "ArrayAdapter", "HandleCollectives"}
    shared = {n for n in dir(hnp) if not n.startswith("_") and n not in internal}
    missing = sorted(n for n in shared - set(INPLACE) if not hasattr(hvd, n))
    assert not missing, f"horovod.jax lacks names horovod.numpy has: {missing}"
    for name in ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "Compression",
                 "elastic", "HorovodInternalError"):
        assert hasattr(hvd, name), name
    assert callable(hvd.elastic.run) and hvd.elastic.JaxState is not None


@pytest.mark.parametrize("name", ["allreduce_", "broadcast_", "allreduce_async_", "grouped_allreduce_"])
def test_in_place_forms_say_why_they_are_missing(name):
    import horovod.jax as hvd

    with pytest.raises(AttributeError, match="immutable") as info:
        getattr(hvd, name)
    assert f"hvd.{name.rstrip('_')}(" in str(info.value)


def test_argument_errors_in_one_process():
    import jax.numpy as jnp

    import horovod.jax as hvd

    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(jnp.ones(2))
    hvd.init()
    try:
        with pytest.raises(TypeError, match="expects a jax.Array"):
            hvd.allreduce("not an array")
        with pytest.raises(TypeError, match=r"the leaf at \['name'\] is a str"):
            hvd.broadcast_parameters({"w": jnp.ones(2), "name": "mlp"})
        with pytest.raises(TypeError, match="expects a list of arrays"):
            hvd.grouped_allreduce(jnp.ones(2))
        with pytest.raises(ValueError, match="at least one dimension"):
            hvd.allgather(jnp.ones(()))
        # numpy arrays and numbers are converted with jnp.asarray; pytrees keep their structure (lists too)
        out = hvd.allreduce(__import__("numpy").arange(3.0))
        assert type(out).__module__.startswith("jax") and out.dtype == jnp.float32
        tree = hvd.allreduce([jnp.ones(2), (jnp.zeros(1), {"k": 2.0})])
        assert isinstance(tree, list) and isinstance(tree[1], tuple) and float(tree[1][1]["k"]) == 2.0
        assert hvd.allreduce({}) == {}
    finally:
        hvd.shutdown()


# -- many ranks --------------------------------------------------------------------------------------------------
def api_worker() -> dict:  # noqa: C901  (one flat script on purpose: one job checks everything)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd
    from horovod.common.exceptions import HorovodInternalError

    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    c = Checks(r)

    def want(array):
        return jnp.asarray(array)

    def every(tag, shape, dtype="float32"):
        return [values(tag, q, shape, dtype) for q in range(n)]

    c.true(hvd.is_initialized() and 0 <= hvd.local_rank() < hvd.local_size(), "rank queries")

    # async handles issued together, synchronized in reverse order
    xs = [jnp.asarray(values(("h", i), r, (3,))) for i in range(4)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum) for x in xs] + [hvd.allgather_async(xs[0]),
                                                                   hvd.broadcast_async(xs[1], n - 1)]
    c.true(all(isinstance(h, int) for h in handles), "handles are ints")
    results = [hvd.synchronize(h) for h in reversed(handles)][::-1]
    for i in range(4):
        c.equal(results[i], want(np.sum(every(("h", i), (3,)), 0)), f"async allreduce {i}")
    c.equal(results[4], want(np.concatenate(every(("h", 0), (3,)))), "async allgather")
    c.equal(results[5], want(values(("h", 1), n - 1, (3,))), "async broadcast")
    h = hvd.grouped_allreduce_async(xs[:2], op=hvd.Max)
    while not hvd.poll(h):
        pass
    got = hvd.synchronize(h)
    c.equal(got[1], want(np.max(every(("h", 1), (3,)), 0)), "grouped async after poll")
    c.raises("poll of a synchronized handle", ValueError, hvd.poll, h)

    # ragged allgather and alltoall with splits (a jax array), outside jit
    mine = jnp.asarray(values("rag", r, (r + 1, 2)))
    c.equal(hvd.allgather(mine), want(np.concatenate([values("rag", q, (q + 1, 2)) for q in range(n)])),
            "ragged allgather")
    splits = jnp.asarray([(r + q) % 2 + 1 for q in range(n)], dtype=jnp.int32)
    rows = int(splits.sum())
    x = jnp.asarray(values("a2a", r, (rows, 3)))
    out, received = hvd.alltoall(x, splits=splits)
    sent_to_me = []
    for q in range(n):
        theirs = [(q + p) % 2 + 1 for p in range(n)]
        start = sum(theirs[:r])
        sent_to_me.append(values("a2a", q, (sum(theirs), 3))[start:start + theirs[r]])
    c.equal(out, want(np.concatenate(sent_to_me)), "alltoall with splits")
    c.equal(received.astype(jnp.int32), jnp.asarray([(q + r) % 2 + 1 for q in range(n)], dtype=jnp.int32),
            "alltoall received splits")
    c.true(type(received).__module__.startswith("jax"), "received splits are a jax array")

    # bfloat16 and a numpy input outside jit
    b = jnp.asarray(values("bf", r, (4,), "bfloat16"))
    c.equal(hvd.allreduce(b, op=hvd.Sum), want(np.sum(np.stack([v.astype(np.float32) for v in
                                                               every("bf", (4,), "bfloat16")]), 0)
                                               .astype(jnp.bfloat16)), "bfloat16 allreduce")
    c.equal(hvd.allreduce(values("np", r, (2,)), op=hvd.Sum), want(np.sum(every("np", (2,)), 0)), "numpy input")

    # pytrees: allreduce keeps the structure; broadcast_parameters / broadcast_optimizer_state return root's tree
    tree = {"a": jnp.asarray(values("ta", r, (2, 2))), "b": [jnp.asarray(values("tb", r, (3,), "int32"))]}
    red = hvd.allreduce(tree, op=hvd.Sum, name="tree")
    c.equal(red["a"], want(np.sum(every("ta", (2, 2)), 0)), "pytree allreduce a")
    c.equal(red["b"][0], want(np.sum(every("tb", (3,), "int32"), 0)), "pytree allreduce b")
    fp16 = hvd.allreduce(tree["a"], compression=hvd.Compression.fp16)
    c.true(fp16.dtype == jnp.float32, "compressed allreduce gives the input dtype back")
    c.close(fp16, want(np.mean(every("ta", (2, 2)), 0)), "fp16-compressed allreduce", rtol=1e-3, atol=1e-3)
    params = hvd.broadcast_parameters(tree, root_rank=n - 1)
    c.equal(params["b"][0], want(values("tb", n - 1, (3,), "int32")), "broadcast_parameters")
    import optax

    opt = optax.adam(0.1)
    state = opt.init(tree["a"] * (r + 1))
    state = jax.tree_util.tree_map(lambda v: v + r, state)
    synced = hvd.broadcast_optimizer_state(state, root_rank=0)
    for got, ref in zip(jax.tree_util.tree_leaves(synced), jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(lambda v: v - r, state))):
        c.equal(got, ref, "broadcast_optimizer_state leaf")

    # objects
    c.equal(np.asarray(hvd.broadcast_object({"r": r, "arr": jnp.arange(3) * r}, root_rank=n - 1)["arr"]),
            np.arange(3, dtype=np.int32) * (n - 1), "broadcast_object with a jax array inside")
    c.true(hvd.allgather_object(("rank", r)) == [("rank", q) for q in range(n)], "allgather_object")

    # process sets: a dynamic one of the even ranks (at np = 1 that would be the global set itself)
    if n > 1:
        evens = hvd.add_process_set(list(range(0, n, 2)))
        if r % 2 == 0:
            got = hvd.allreduce(xs[0], op=hvd.Sum, process_set=evens)
            c.equal(got, want(np.sum([values(("h", 0), q, (3,)) for q in range(0, n, 2)], 0)),
                    "process set allreduce")
            got = hvd.reducescatter(jnp.asarray(values("prs", r, (4, 1))), op=hvd.Sum, process_set=evens)
            c.true(got.shape[0] in (4 // evens.size(), 4 // evens.size() + 1), "process set reducescatter shape")
        hvd.barrier()
        hvd.remove_process_set(evens)

    # join: the last rank runs one more allreduce than the others, which contribute zeros to it
    steps = 2 if r == n - 1 else 1
    for s in range(steps):
        got = hvd.allreduce(jnp.ones(2) * (s + 1), op=hvd.Sum, name=f"join.{s}")
        if s == 1:
            c.equal(got, jnp.full(2, 2.0, jnp.float32), "allreduce while the others joined")
    c.true(hvd.join() == n - 1, "join returns the last rank to join")
    hvd.barrier()

    # a mismatch across ranks fails on every rank as HorovodInternalError (eagerly) ...
    if n > 1:
        c.raises("shape mismatch", HorovodInternalError, hvd.allreduce, jnp.ones(r + 1), name="mismatch")
        # ... and inside jit as JAX's runtime error, which horovod.jax.elastic turns into HorovodInternalError
        failing = hvd.elastic.translate_errors(
            lambda: jax.jit(lambda v: hvd.allreduce(v, name="mismatch.jit"))(jnp.ones(r + 1)).block_until_ready())
        c.raises("shape mismatch inside jit", HorovodInternalError, failing)
    c.equal(hvd.allreduce(jnp.ones(2), op=hvd.Sum), jnp.full(2, float(n), jnp.float32), "healthy after mismatches")
    hvd.shutdown()
    return c.report()


@pytest.mark.parametrize("np_", SIZES)
def test_api_on_ranks(np_):
    assert_no_failures(run(api_worker, np_, env={"JAX_ENABLE_X64": "0"}), minimum_checks=25)


def sharded_worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import horovod.jax as hvd

    hvd.init()
    c = Checks(hvd.rank())
    devices = jax.devices()
    c.true(len(devices) == 2, f"two CPU devices forced, got {devices}")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharded = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("d")))
    c.raises("an array sharded over two devices", ValueError, hvd.allreduce, sharded, match="one device")
    second = jax.device_put(jnp.arange(3.0), devices[1])
    out = hvd.allreduce(second, op=hvd.Sum)
    c.true(out.devices() == {devices[1]}, f"the result stays on the input's device, got {out.devices()}")
    c.equal(out, jnp.arange(3.0), "allreduce on the second device")
    tree = hvd.allreduce({"x": second}, op=hvd.Sum)
    c.true(tree["x"].devices() == {devices[1]}, "pytree results stay on their device")
    hvd.shutdown()
    return c.report()


def test_arrays_on_several_devices():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_ENABLE_X64": "0"}
    assert_no_failures(run(sharded_worker, 1, env=env), minimum_checks=5)



def test_pytree_leaves_are_packed_into_buckets():
    import ml_dtypes
    import numpy as np

    from horovod.common.buckets import configured_cap
    from horovod.engine import config
    from horovod.jax.host import pack

    leaves = [np.arange(4, dtype=np.float32), np.arange(6, dtype=np.float32).reshape(2, 3),
              np.arange(3, dtype=np.int32), np.ones(1000, np.float32), np.arange(2, dtype=np.float32),
              np.arange(2, dtype=np.float32) + 5, np.zeros((), np.float32), np.ones(4, ml_dtypes.bfloat16)]
    packed, unpack = pack(leaves, cap=64)
    # buckets first: [0, 1] (40 bytes of float32), [4, 5, 6] (20 bytes); then the leaves in none: the int32 one
    # between float32 neighbours, the one over the cap, the lone bfloat16
    assert [p.size for p in packed] == [10, 5, 3, 1000, 4]
    back = unpack([p.copy() for p in packed])
    for got, want in zip(back, leaves):
        assert got.shape == want.shape and got.dtype == want.dtype and (got == want).all()
    same, identity = pack(leaves, cap=0)
    assert same == leaves and identity(same) == leaves
    config.set_environ("HOROVOD_GRADIENT_BUCKET_BYTES", "1024")
    try:
        assert configured_cap() == 1024
    finally:
        config.set_environ("HOROVOD_GRADIENT_BUCKET_BYTES", None)
    assert configured_cap() == 4 << 20
