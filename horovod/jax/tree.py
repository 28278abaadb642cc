"""Pytrees of arrays (parameters, gradients, optimizer states) across ranks.

JAX keeps a model's parameters and an optax optimizer's state as pytrees of immutable arrays, so these functions
*return* the synchronised tree (``params = hvd.broadcast_parameters(params, root_rank=0)``) instead of writing
into it.  All leaves of a tree travel in one call (packed into buckets by :mod:`horovod.jax.host`); inside
``jax.jit`` that is one ordered host callback per tree.
"""
from __future__ import annotations

from typing import Any, List, Optional

import jax
import numpy as np

from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.jax import host, jit_ops
from horovod.jax.adapter import after_jitted_collectives, as_jax, is_traced
from horovod.jax.compression import Compression


def _leaves(tree: Any, what: str):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, leaf in enumerate(leaves):
        try:
            out.append(leaf if is_traced(leaf) else as_jax(leaf, what))
        except TypeError as exc:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
            if not path:   # not a tree at all: as_jax's message says what is expected
                raise
            raise TypeError(f"horovod.jax.{what}: the leaf at {path} is a {type(leaf).__name__}, not an "
                            f"array; move such values out of the tree (hvd.broadcast_object carries any picklable "
                            f"value).") from exc
    return out, treedef


def _results(arrays: List[np.ndarray], like: List[jax.Array]) -> List[jax.Array]:
    """Host results as JAX arrays on their inputs' devices, in their dtypes (bfloat16 bits undone)."""
    out = []
    for array, leaf in zip(arrays, like):
        if array.dtype != leaf.dtype:
            array = array.view(leaf.dtype)
        out.append(jax.device_put(array, next(iter(leaf.devices()))))
    return out


def allreduce_tree(tree: Any, op: int = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                   compression=Compression.none) -> Any:
    """Reduce every leaf of ``tree`` across the process set; returns a tree of the same structure.

    The leaves form one atomic group; consecutive small leaves of one dtype are packed into flat buckets of up to
    ``HOROVOD_GRADIENT_BUCKET_BYTES`` (one request per bucket).  Works on concrete trees and inside ``jax.jit``.
    """
    leaves, treedef = _leaves(tree, "allreduce")
    compressed = [compression.compress(leaf) for leaf in leaves]
    values = [c for c, _ in compressed]
    if any(is_traced(v) for v in values):
        reduced = jit_ops.allreduce_leaves(values, op, prescale_factor, postscale_factor, process_set, name)
    else:
        after_jitted_collectives()
        reduced = _results(host.allreduce_leaves(host.host_arrays(values), op, prescale_factor, postscale_factor,
                                                 process_set, name), values)
    out = [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_tree(tree: Any, root_rank: int, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``tree`` on every rank (every rank passes a tree of the same structure, shapes and dtypes)."""
    leaves, treedef = _leaves(tree, "broadcast")
    if any(is_traced(v) for v in leaves):
        out = jit_ops.broadcast_leaves(leaves, root_rank, process_set, name)
    else:
        after_jitted_collectives()
        out = _results(host.broadcast_leaves(host.host_arrays(leaves), root_rank, process_set, name), leaves)
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_parameters(params: Any, root_rank: int = 0, process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s parameters on every rank: ``params = hvd.broadcast_parameters(params, root_rank=0)``.

    ``params`` is any pytree of arrays (a flax ``params`` dict, a list of weights ...); JAX arrays are immutable,
    so the broadcast values come back as a new tree of the same structure.
    """
    return broadcast_tree(params, root_rank, name=None, process_set=process_set)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s optax optimizer state on every rank (a pytree, like the parameters)."""
    return broadcast_tree(opt_state, root_rank, name=None, process_set=process_set)
