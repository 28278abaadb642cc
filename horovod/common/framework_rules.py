"""Rules every framework binding follows where Horovod's result is computed in the framework, not in the engine.

The engine (:mod:`horovod.engine.ops`) applies Average's division and the pre/postscale factors to the values it
reduces, for every binding alike.  A few results are finished by the binding itself, in the framework's own
arithmetic; their rules are written here once, so that torch, TensorFlow/Keras and MXNet agree with each other and
with Horovod 0.28.1:

* the gradient of ``reducescatter`` (:func:`reducescatter_grad_scale`);
* allreduce of sparse values (``tf.IndexedSlices``, torch sparse COO tensors), which travel as allgathers
  (:func:`check_sparse_allreduce`, :func:`sparse_average_divisor`);
* scaling of half-precision values (:func:`scaling_dtype`): float16 and bfloat16 values are multiplied in
  float32 and rounded once, whatever NumPy version decides about mixed-precision operands; the engine's own
  scaling (``engine.ops.scale_inplace``) follows the same rule.
"""
from __future__ import annotations

from typing import Optional

from horovod.engine.ops import OP_NAMES, Average, Sum

#: dtypes whose values are scaled in a wider type (and rounded back once).
_WIDENED = {"float16": "float32", "bfloat16": "float32"}


def reducescatter_grad_scale(op: int, prescale_factor: float, postscale_factor: float, set_size: int) -> float:
    """The factor applied to the allgathered output gradients to give the input gradient of a reducescatter.

    Horovod 0.28.1's gradient: the allgather of the output gradients times the set size for ``Sum`` (times 1
    for ``Average``), times the forward's scale factors.  (The exact adjoint of a Sum would be the allgather
    alone; the original's factor is kept so that training dynamics do not change when a script moves here.)
    """
    scale = float(prescale_factor) * float(postscale_factor)
    if op != Average:
        scale *= set_size
    return scale


def check_sparse_allreduce(op: int, prescale_factor: float, postscale_factor: float) -> None:
    """Refuse what an allreduce of sparse values cannot do (call it before any collective starts).

    Raises:
        NotImplementedError: ``op`` is not Sum or Average, or a pre/postscale factor is given (the original's
            TensorFlow binding refused both for ``tf.IndexedSlices``).
    """
    if op not in (Sum, Average):
        raise NotImplementedError(f"Only Sum and Average ops are supported with sparse tensors (tf.IndexedSlices), "
                                  f"got {OP_NAMES.get(op, op)}; pass sparse_as_dense=True or densify the tensor "
                                  f"first.")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with sparse tensors (tf.IndexedSlices); "
                                  "scale the values yourself or densify the tensor first.")


def sparse_average_divisor(op: int, set_size: int) -> Optional[int]:
    """What the allgathered values of a sparse allreduce are divided by: the set size for ``Average``, nothing
    (``None``) otherwise.

    Sparse values are allgathered with their indices, not reduced.  The division is the framework's *true*
    division (``values / size``): integer values become floating point, in every binding.
    """
    return set_size if op == Average else None


def scaling_dtype(dtype_name: str) -> str:
    """The dtype a value of ``dtype_name`` is multiplied by a scale factor in: float32 for float16 and bfloat16
    (one rounding back to half precision at the end), the dtype itself otherwise."""
    return _WIDENED.get(dtype_name, dtype_name)
