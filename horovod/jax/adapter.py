"""How ``jax.Array`` values cross into the engine (:class:`JaxAdapter`) and how results become JAX arrays again.

A JAX array on the CPU is a host buffer that numpy can read in place: ``np.asarray`` of it is a read-only,
C-contiguous view (zero-copy), which is all the engine needs for the new-result collectives.  Arrays on another
device (a GPU) are copied to the host first (``View.staged``) and their results are put back on that device.

Results go the other way through ``jax.device_put``, which on the CPU adopts the numpy buffer without a copy: the
engine hands over a result nobody else holds (a fresh or pooled block, or the staged copy), so JAX's assumption
that a buffer never changes holds, and the block stays leased for as long as the JAX array lives.

JAX arrays are immutable, so there are no in-place collectives: :meth:`JaxAdapter.inplace_view` refuses with what
to call instead.  Traced values (inside ``jax.jit``) never reach this adapter; :mod:`horovod.jax.jit_ops` carries
them through host callbacks.
"""
from __future__ import annotations

import numbers
from typing import Any, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from horovod.common.adapter import TensorAdapter, View, storage_view


def after_jitted_collectives() -> None:
    """Wait until the host callbacks of already dispatched jitted programs have run.

    Unnamed collectives are matched across ranks by the order they are issued in.  A jitted program's collectives
    are issued by XLA when the program runs, which JAX may do after the Python call returned (asynchronous
    dispatch); an eager collective issued meanwhile would then take their place in the order on some ranks and not
    on others.  Every concrete collective of ``horovod.jax`` calls this first (~1 µs when nothing is pending).
    """
    jax.effects_barrier()


def is_traced(value: Any) -> bool:
    """True for an abstract value of a JAX transformation (``jit``, ``vmap``, ``grad`` ...): it has no data yet."""
    return isinstance(value, jax.core.Tracer)


def as_jax(value: Any, what: str) -> jax.Array:
    """``value`` as a ``jax.Array``: JAX arrays as they are, numpy arrays and Python/numpy scalars through
    ``jnp.asarray`` (JAX's dtype rules apply: 64-bit values become 32-bit unless ``jax_enable_x64`` is on)."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        return jnp.asarray(value)
    raise TypeError(f"horovod.jax.{what} expects a jax.Array (or a numpy array / number, converted with "
                    f"jnp.asarray), got {type(value).__module__}.{type(value).__name__}; convert it with "
                    f"jnp.asarray(...) first.")


def _device(array: jax.Array):
    devices = array.devices()
    if len(devices) != 1:
        raise ValueError(f"horovod.jax collectives take arrays that live on one device, got one sharded over "
                         f"{len(devices)} devices ({sorted(str(d) for d in devices)}); horovod.jax runs one "
                         f"process per device: gather it first (jax.device_get) or run with one local device.")
    return next(iter(devices))


class JaxAdapter(TensorAdapter):
    """``jax.Array`` values: CPU buffers are viewed in place, other devices staged through host memory."""

    def view(self, tensor: Any) -> View:
        if is_traced(tensor):
            raise TypeError("this horovod.jax function needs concrete values, but it was given a traced value "
                            "(inside jax.jit, vmap or grad); inside jit call the blocking collectives "
                            "(hvd.allreduce, hvd.allgather ...), which run as ordered host callbacks; the "
                            "*_async forms and their handles work outside jit only.")
        array = as_jax(tensor, "collective")
        after_jitted_collectives()
        device = _device(array)
        host = np.asarray(array)          # CPU: read-only view of the buffer; elsewhere: a host copy
        staged = device.platform != "cpu"
        if not host.flags.c_contiguous:   # defensive: JAX's default layouts are row-major
            host, staged = np.ascontiguousarray(host), True
        storage, dtype = storage_view(host)
        return View(array, storage, dtype, staged)

    def inplace_view(self, tensor: Any) -> View:
        raise TypeError("JAX arrays are immutable, so horovod.jax has no in-place collectives; use the forms that "
                        "return a new array (hvd.allreduce, hvd.broadcast, hvd.grouped_allreduce, *_async ...).")

    def result(self, array: np.ndarray, view: View) -> jax.Array:
        dtype = view.tensor.dtype
        if array.dtype != dtype:
            array = array.view(dtype)     # bfloat16 bits back to (ml_dtypes) bfloat16
        return jax.device_put(array, _device(view.tensor))

    def write_back(self, tensor: Any, array: np.ndarray) -> Any:
        raise TypeError("JAX arrays are immutable: nothing can be written back into one")

    def splits(self, splits: Any) -> Optional[List[int]]:
        if splits is None:
            return None
        if is_traced(splits):
            raise TypeError("alltoall splits must be concrete (known when the call is made), got a traced value")
        return [int(s) for s in np.asarray(splits).reshape(-1)]

    def received_splits(self, received: np.ndarray) -> jax.Array:
        return jnp.asarray(received)


def from_host(array: np.ndarray, like_dtype: Any) -> jax.Array:
    """A JAX array holding the host result ``array`` (storage form) in ``like_dtype`` (bfloat16 bits undone)."""
    dtype = np.dtype(like_dtype)
    if array.dtype != dtype:
        array = array.view(dtype)
    return jax.device_put(array)
