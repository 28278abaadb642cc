"""The one protocol by which a binding's tensors cross into the engine, and how a failed collective surfaces.

The engine works on C-contiguous numpy arrays only.  Every binding (numpy, torch, tensorflow/keras, mxnet)
implements :class:`TensorAdapter` with a thin class of its own; the collectives themselves are written once, on
top of the protocol, in :mod:`horovod.common.binding_ops`.

The protocol in brief:

- ``view(tensor) -> View``: validate the tensor and give the engine a numpy array over its memory (zero-copy) or,
  when the engine cannot read that memory directly, over a private host copy (``View.staged``).
- bfloat16 has no numpy dtype: it travels as its 16-bit pattern (``uint16`` storage) with the engine dtype
  ``"bfloat16"`` (``View.dtype``), whatever the framework (:func:`storage_view` for numpy-side arrays).
- ``result(array, view)``: the framework's result built from an engine output (new-result collectives).
- ``write_back(tensor, array)``: copy an in-place result into a tensor that had to be staged (zero-copy views
  need nothing: the engine wrote into the tensor's own memory).
- a failed collective raises :class:`HorovodInternalError` in every binding (:func:`collective_error`).
"""
from __future__ import annotations

from typing import Any, Generic, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import ops, result_pool
from horovod.engine.device import ArrayT, HostOrDevice
from horovod.engine.errors import HorovodInternalError

BFLOAT16 = ops.BFLOAT16
_BITS = np.dtype(np.uint16)


class View(Generic[ArrayT]):
    """One tensor as the engine sees it.

    Attributes:
        tensor: the caller's tensor.
        array: C-contiguous numpy array the engine reads (and, for in-place collectives, writes); a
            :class:`~horovod.engine.device.DeviceArray` for a tensor in GPU memory (``horovod.torch``).
        dtype: the engine dtype override: ``"bfloat16"`` when ``array`` holds bfloat16 bits, else ``None``.
        staged: True when ``array`` is a private copy, so an in-place result must be written back to ``tensor``
            (and a new result may reuse the copy's memory).
    """

    __slots__ = ("tensor", "array", "dtype", "staged")

    def __init__(self, tensor: Any, array: ArrayT, dtype: Optional[str], staged: bool):
        self.tensor = tensor
        self.array = array
        self.dtype = dtype
        self.staged = staged


class TensorAdapter(Generic[ArrayT]):
    """How one framework's tensors become engine arrays and results become tensors again.

    Subclasses implement :meth:`view`, :meth:`result` and :meth:`write_back`; the rest has defaults that fit
    every binding so far.
    """

    def view(self, tensor: Any) -> View[ArrayT]:
        """Validate ``tensor`` and return the engine's view of it (zero-copy where the memory allows)."""
        raise NotImplementedError

    def inplace_view(self, tensor: Any) -> View[ArrayT]:
        """The view for an in-place collective (a binding that cannot write back refuses staged tensors here)."""
        return self.view(tensor)

    def result(self, array: ArrayT, view: View[ArrayT]) -> Any:
        """The framework's result for ``view.tensor`` holding the engine output ``array`` (storage form)."""
        raise NotImplementedError

    def write_back(self, tensor: Any, array: ArrayT) -> Any:
        """Copy ``array`` (storage form, ``tensor``'s shape) into ``tensor``; return ``tensor``."""
        raise NotImplementedError

    def splits(self, splits: Any) -> Optional[List[int]]:
        """Alltoall ``splits`` (``None``, a sequence, or the framework's int tensor) as a list of ints."""
        if splits is None:
            return None
        return [int(s) for s in np.asarray(splits).reshape(-1)]

    def received_splits(self, received: np.ndarray) -> Any:
        """The framework's form of alltoall's received splits."""
        return received

    # -- used by the shared collectives ---------------------------------------------------------------------
    def fresh_output(self, view: View[ArrayT]) -> HostOrDevice:
        """Where a new-result reduction or broadcast writes: the staged copy (already private), or a block from
        the engine's result pool (memory already faulted in; a large fresh allocation costs more than the copy)."""
        array = view.array
        if view.staged:
            return array
        if array.nbytes < result_pool.MIN_BYTES:   # what the pool gives a small result, without its checks
            return np.empty(array.shape, array.dtype)
        return result_pool.empty(array.shape, array.dtype)

    def finish_inplace(self, view: View[ArrayT]) -> Any:
        """After an in-place collective: write a staged result back; return the caller's tensor."""
        if view.staged:
            return self.write_back(view.tensor, view.array)
        return view.tensor


def overrides(views: Sequence[View]) -> Optional[List[Optional[str]]]:
    """``dtypes=`` for the engine (``None`` when no tensor needs an override, the common case)."""
    for v in views:
        if v.dtype is not None:
            return [w.dtype for w in views]
    return None


# -- numpy-side storage (arrays of the numpy binding, TensorFlow kernels) -------------------------------------
def c_order(array: Any) -> Tuple[np.ndarray, bool]:
    """``(C-contiguous array, copied)``; 0-d values stay 0-d (``np.ascontiguousarray`` would make them 1-d)."""
    a = np.asarray(array)
    if a.flags.c_contiguous:
        return a, False
    return a.copy(order="C"), True


def storage_view(array: np.ndarray) -> Tuple[np.ndarray, Optional[str]]:
    """``(engine storage, dtype override)`` of a C-contiguous array: bfloat16 (``ml_dtypes``) as its uint16 bits."""
    # ``dtype.name`` is computed in Python on every access (microseconds); ``kind`` is a field, and ml_dtypes'
    # types are the only void-kind ("V") arrays a collective accepts.
    dtype = array.dtype
    if dtype.kind == "V" and dtype.name == BFLOAT16:
        return array.view(_BITS), BFLOAT16
    return array, None


def from_storage(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Undo :func:`storage_view` on a result: the engine's storage back in ``dtype`` (bfloat16 bits → bfloat16)."""
    return array if array.dtype == dtype else array.view(dtype)


class ArrayAdapter(TensorAdapter[np.ndarray]):
    """numpy arrays (and anything ``np.asarray`` accepts): ``horovod.numpy`` and TensorFlow's kernels."""

    def view(self, tensor: Any) -> View[np.ndarray]:
        if type(tensor) is np.ndarray and tensor.flags.c_contiguous and tensor.dtype.kind != "V":
            return View(tensor, tensor, None, False)   # the common case, in one step
        array, copied = c_order(tensor)
        storage, dtype = storage_view(array)
        return View(tensor, storage, dtype, copied)

    def inplace_view(self, tensor: Any) -> View[np.ndarray]:
        if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous or not tensor.flags.writeable:
            raise ValueError("in-place collectives need a writeable, C-contiguous numpy array")
        storage, dtype = storage_view(tensor)
        return View(tensor, storage, dtype, False)

    def result(self, array: np.ndarray, view: View[np.ndarray]) -> np.ndarray:
        if view.dtype is None:
            return array
        return array.view(view.tensor.dtype)   # bfloat16 bits back to the caller's (ml_dtypes) bfloat16

    def write_back(self, tensor: np.ndarray, array: np.ndarray) -> np.ndarray:
        np.copyto(tensor, from_storage(array, tensor.dtype), casting="no")
        return tensor


# -- how a failed collective surfaces ------------------------------------------------------------------------
def collective_error(exc: BaseException) -> BaseException:
    """The exception a binding raises when waiting for a collective failed.

    Engine failures stay what they are (``MismatchError``, ``PeerFailureError`` ... are ``HorovodInternalError``s);
    any other ``RuntimeError`` (e.g. an argument error only the coordinator could see) or ``OSError`` (a transport
    failure in the waiting thread) becomes a ``HorovodInternalError`` with the same text, the original exception
    as its ``__cause__``: the original's ``synchronize`` contract, and what elastic training catches to reset.
    Anything else (``KeyboardInterrupt`` ...) is returned unchanged.
    """
    if isinstance(exc, HorovodInternalError) or not isinstance(exc, (RuntimeError, OSError)):
        return exc
    return HorovodInternalError(str(exc))


def raise_collective_error(exc: BaseException) -> NoReturn:
    """Raise ``exc`` as :func:`collective_error` says (re-raised as it is when it needs no wrapping)."""
    error = collective_error(exc)
    if error is exc:
        raise exc
    raise error from exc


def wait(handle) -> Any:
    """Wait for an engine handle, raising a failure as :func:`collective_error` says."""
    try:
        return handle.wait()
    except (RuntimeError, OSError) as exc:
        raise_collective_error(exc)
