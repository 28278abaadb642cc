"""hvd.DistributedOptimizer (an optax GradientTransformation) on np = 1..4 real ranks: n ranks on 1/n of each
batch must train exactly like one process on the whole batch.

Each job trains the same small MLP under many configurations (eager and jitted steps, a stateful inner optimizer,
backward_passes_per_step, predivide, fp16 compression, Sum, tiny and disabled buckets) and returns every rank's
parameters; the test trains each configuration in this process on the whole batch with plain optax and compares.
Every rank starts from different parameters, so ``broadcast_parameters`` must make them equal first.
"""
from __future__ import annotations

import pytest

from jax_helpers import SIZES, require_jax, run

require_jax()
# subprocess (fork + exec) starting the ranks after JAX was imported here: harmless, JAX warns anyway.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

from checks import Checks, assert_no_failures  # noqa: E402

STEPS = 3
ROWS = 24   # divisible by every world size tested

CONFIGS = {
    # name: (DistributedOptimizer kwargs, inner optimizer, jit, backward passes, gradient scale, bucket cap, rtol)
    "eager_sgd": ({}, "sgd", False, 1, 1.0, None, 1e-5),
    "jit_adam": ({}, "adam", True, 1, 1.0, None, 1e-4),
    "jit_momentum_bpps2": ({"backward_passes_per_step": 2}, "momentum", True, 2, 1.0, None, 1e-5),
    "eager_bpps2_averaged": ({"backward_passes_per_step": 2, "average_aggregated_gradients": True}, "sgd", False,
                             2, 0.5, None, 1e-5),
    "jit_predivide": ({"gradient_predivide_factor": 2.0}, "sgd", True, 1, 1.0, None, 1e-5),
    "jit_fp16": ({"compression": "fp16"}, "sgd", True, 1, 1.0, None, 2e-3),
    "jit_sum": ({"op": "Sum"}, "sgd", True, 1, None, None, 1e-5),   # None: scaled by the world size
    "tiny_buckets": ({}, "momentum", True, 1, 1.0, "40", 1e-5),
    "no_buckets": ({}, "momentum", False, 1, 1.0, "0", 1e-5),
}


def _inner(kind: str):
    import optax

    return {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9),
            "adam": lambda: optax.adam(0.01)}[kind]()


def _init(seed: int):
    import jax

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"hidden": {"w": jax.random.normal(k1, (6, 8)) * 0.5, "b": jax.random.normal(k2, (8,)) * 0.1},
            "out": {"w": jax.random.normal(k3, (8, 3)) * 0.5, "b": jax.numpy.zeros(3)}}


def _loss(params, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def _batch(step: int, micro: int):
    import numpy as np

    rng = np.random.default_rng(1000 * step + micro)
    return (rng.normal(size=(ROWS, 6)).astype(np.float32), rng.normal(size=(ROWS, 3)).astype(np.float32))


def optimizer_worker(names) -> dict:
    import jax
    import numpy as np
    import optax

    import horovod.jax as hvd
    from horovod.engine import config

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for name in names:
        kwargs, inner, jit, passes, _scale, cap, _rtol = CONFIGS[name]
        config.set_environ("HOROVOD_GRADIENT_BUCKET_BYTES", cap)
        kwargs = dict(kwargs)
        if "compression" in kwargs:
            kwargs["compression"] = getattr(hvd.Compression, kwargs["compression"])
        if "op" in kwargs:
            kwargs["op"] = getattr(hvd, kwargs["op"])
        tx = hvd.DistributedOptimizer(_inner(inner), **kwargs)
        params = hvd.broadcast_parameters(_init(seed=100 + r), root_rank=0)
        opt_state = tx.init(params)

        def step(params, opt_state, x, y):
            grads = jax.grad(_loss)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        step = jax.jit(step) if jit else step
        per = ROWS // n
        for s in range(STEPS):
            for m in range(passes):
                x, y = _batch(s, m)
                params, opt_state = step(params, opt_state, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
        out[name] = jax.tree_util.tree_map(np.asarray, params)
    config.set_environ("HOROVOD_GRADIENT_BUCKET_BYTES", None)
    hvd.shutdown()
    return out


def _reference(name: str, size: int):
    """The same training in this process, on the whole batch, with plain optax."""
    import jax
    import optax

    _kwargs, inner, _jit, passes, scale, _cap, _rtol = CONFIGS[name]
    scale = float(size) if scale is None else scale
    tx = _inner(inner)
    params = _init(seed=100)
    opt_state = tx.init(params)
    for s in range(STEPS):
        grads = None
        for m in range(passes):
            g = jax.grad(_loss)(params, *_batch(s, m))
            grads = g if grads is None else jax.tree_util.tree_map(lambda a, b: a + b, grads, g)
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


#: np = 2 runs every configuration; the other sizes the ones whose arithmetic depends on the size.
QUICK = ("eager_sgd", "jit_momentum_bpps2", "jit_sum", "tiny_buckets")


@pytest.mark.parametrize("np_", SIZES)
def test_ranks_on_shards_train_like_one_process_on_the_batch(np_):
    import jax
    import numpy as np

    names = list(CONFIGS) if np_ == 2 else list(QUICK)
    results = run(optimizer_worker, np_, args=(names,), env={"JAX_ENABLE_X64": "0"})   # float32, as here
    reports = []
    for rank, by_name in enumerate(results):
        c = Checks(rank, strict_dtype=False)
        for name, params in by_name.items():
            want = _reference(name, np_)
            rtol = CONFIGS[name][-1]
            for (path, got), ref in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                        jax.tree_util.tree_leaves(want)):
                c.close(got, np.asarray(ref), f"{name} np={np_} {jax.tree_util.keystr(path)}", rtol=rtol,
                        atol=rtol / 10)
            # A check that the configuration trained at all: the parameters moved away from the start.
            start = jax.tree_util.tree_leaves(_init(seed=100))[0]
            c.true(not np.allclose(jax.tree_util.tree_leaves(params)[0], np.asarray(start)), f"{name} trained")
        reports.append(c.report())
    assert_no_failures(reports, minimum_checks=len(names) * 5)


def test_argument_errors():
    import optax

    import horovod.jax as hvd

    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive integer"):
        hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="only supported with op=Average"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        hvd.DistributedOptimizer(lambda g: g)
