"""Run engine collectives on TensorFlow tensors: eagerly, or as a graph op inside ``tf.function`` / a v1 graph.

Every collective of ``horovod.tensorflow`` is a *kernel*: a Python function from numpy arrays to numpy arrays that
calls :mod:`horovod.engine.collectives` and waits for the handle.  :func:`run` executes a kernel directly when TF
executes eagerly; in a graph it becomes one stateful node that TF calls each time the graph runs.

Ordering.  Graph ops are named when the graph is built (see :func:`base_name`): a deterministic per-graph name,
so collectives pair up by name across ranks whatever order each rank's executor starts them in.  Inside
``tf.function`` the node is a ``tf.numpy_function``: TF's automatic control dependencies chain stateful ops in
program order, so every rank runs the function's collectives one after the other in the order they were
written.  In a TF1 graph nothing orders them, and a TF1 session runs independent nodes concurrently on a small
thread pool; there the node waits on a thread of its own (:mod:`horovod.tensorflow.graph_ops`), so any number of
independent collectives in one ``session.run`` complete whatever the pool size.

Errors.  In eager mode an engine failure (mismatch across ranks, peer failure, shutdown) is raised as
:class:`HorovodFailedPreconditionError`, which is both a ``tf.errors.FailedPreconditionError`` (what the original
raised) and a :class:`~horovod.common.exceptions.HorovodInternalError` (what elastic training catches); invalid
arguments are raised as :class:`HorovodInvalidArgumentError` (a ``tf.errors.InvalidArgumentError`` and a
``ValueError``).  Inside a graph (``tf.function`` or a TF1 session) the same failures are
``tf.errors.FailedPreconditionError`` and ``tf.errors.InvalidArgumentError``, as the original's C++ kernels
reported them; the message carries the engine's text, e.g. ``MismatchError: Mismatched ALLREDUCE tensor shapes:
…``.  How: TF turns any exception raised by a Python node (``numpy_function``) into an ``UnknownError`` except
``ValueError``/``TypeError`` (``InvalidArgumentError``), and no TF op fails with a chosen code and message.  So a
graph kernel catches engine failures and returns the message as one more output, and :func:`_fail_on_error`
reads the file ``/dev/null`` + ``"/" + message`` after it: on success that is ``/dev/null`` (empty); on failure the
path goes through a file, which the OS answers with ``ENOTDIR`` and TensorFlow with a
``FailedPreconditionError`` whose message is ``/dev/null/<engine message>; Not a directory``.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from horovod.common import adapter
from horovod.common.basics import NOT_INITIALIZED
from horovod.common.exceptions import HorovodInternalError
from horovod.engine import ops as engine_ops
from horovod.tensorflow import graph_ops

# Per-graph counters of automatic op names (graphs do not take new attributes, hence the side table).
_graph_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# Horovod's functions are plain Python that builds ops; AutoGraph must call them as they are, not rewrite them.
not_converted = tf.autograph.experimental.do_not_convert

Kernel = Callable[..., Sequence[np.ndarray]]


class HorovodFailedPreconditionError(tf.errors.FailedPreconditionError, HorovodInternalError):
    """A collective failed across ranks (eager mode).

    Catchable as ``tf.errors.FailedPreconditionError`` and as ``hvd.HorovodInternalError``.  The engine's own
    exception (``MismatchError``, ``PeerFailureError``, ``ShutdownError`` …) is ``horovod_error`` and
    ``__cause__``.
    """

    def __init__(self, message: str, horovod_error: Optional[BaseException] = None):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.horovod_error = horovod_error

    def __reduce__(self):
        return type(self), (self.message,)


class HorovodInvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective was called with invalid arguments (eager mode); also a ``ValueError``."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


class HorovodNotInitializedError(tf.errors.FailedPreconditionError, ValueError):
    """A collective was called before ``hvd.init()`` (eager mode); also a ``ValueError`` like ``hvd.rank()``'s."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


def translate_error(exc: BaseException) -> BaseException:
    """The TF-typed equivalent of an engine or argument error (others are returned unchanged)."""
    if isinstance(exc, tf.errors.OpError):
        return exc
    if isinstance(exc, HorovodInternalError):
        return HorovodFailedPreconditionError(f"{type(exc).__name__}: {exc}", exc)
    if isinstance(exc, ValueError):
        if str(exc) == NOT_INITIALIZED:
            return HorovodNotInitializedError(str(exc))
        return HorovodInvalidArgumentError(str(exc))
    return exc


def executing_eagerly() -> bool:
    """True outside ``tf.function`` and outside TF1 graphs."""
    return tf.executing_eagerly()


def base_name(op_type: str, name: Optional[str], ignore_name_scope: bool = False) -> Optional[str]:
    """The name an op is negotiated under, minus the kind prefix (``allreduce.`` …).

    Eagerly, the user's name (or ``None``: the engine then numbers unnamed ops in issue order).  In a graph, a
    name fixed when the graph is built: the current name scope (unless ``ignore_name_scope``) plus ``name`` or
    ``op_type``, made unique within the graph by a per-graph counter, as TF names its nodes.  It depends only on
    the program, not on how often or in what order other graphs were traced, so it agrees across ranks.
    """
    if executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    scope = "" if ignore_name_scope else graph.get_name_scope()
    stem = name if name is not None else op_type
    full = f"{scope}/{stem}" if scope else stem
    counts = _graph_names.setdefault(graph, {})
    n = counts.get(full, 0)
    counts[full] = n + 1
    return full if n == 0 else f"{full}_{n}"


def to_numpy(value) -> np.ndarray:
    """The numpy value of an eager tensor or variable."""
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


def run(kernel: Kernel, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType], op_type: str,
        out_shapes: Optional[Sequence[Optional[tf.TensorShape]]] = None) -> List[tf.Tensor]:
    """Execute ``kernel`` on ``inputs`` now (eager) or as one graph node (graph), returning TF tensors.

    Args:
        kernel: numpy arrays in, a sequence of numpy arrays (one per output) out.
        inputs: tensors (already converted).
        out_dtypes: the TF dtype of each output.
        op_type: node name in graphs (``HorovodAllreduce`` …); it appears in TF's error messages.
        out_shapes: static shapes to set on graph outputs, where known.
    """
    if executing_eagerly():
        arrays = [to_numpy(t) for t in inputs]
        try:
            results = kernel(*arrays)
        except (HorovodInternalError, ValueError) as exc:
            raise translate_error(exc) from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, out_dtypes)]
    graph_kernel = _graph_kernel(kernel, out_dtypes)
    kernel_dtypes = list(out_dtypes) + [tf.string]
    in_function = graph_ops.orders_stateful_ops(tf.compat.v1.get_default_graph())
    if in_function:
        # tf.function: automatic control dependencies run the collectives in program order on every rank.
        outputs = list(tf.numpy_function(graph_kernel, list(inputs), kernel_dtypes, stateful=True, name=op_type))
    else:
        # TF1 graph: independent collectives run concurrently; each waits on a thread of its own.
        outputs = graph_ops.off_pool_call(graph_kernel, inputs, kernel_dtypes, op_type)
    outputs = _fail_on_error(outputs[:-1], outputs[-1], op_type)
    for out, shape in zip(outputs, out_shapes or []):
        if shape is not None:
            out.set_shape(shape)
    return outputs


# The longest engine message carried into a graph error (the whole path must stay below PATH_MAX).
_MAX_MESSAGE_BYTES = 3000


def _graph_error_message(exc: BaseException) -> bytes:
    """``b"/" + message`` for :func:`_fail_on_error` (no NUL, bounded length)."""
    text = f"{type(exc).__name__}: {exc}".replace("\x00", " ")
    raw = text.encode("utf-8")
    if len(raw) > _MAX_MESSAGE_BYTES:
        raw = raw[:_MAX_MESSAGE_BYTES].decode("utf-8", "ignore").encode("utf-8") + b" ..."
    return b"/" + raw


def _is_precondition_failure(exc: BaseException) -> bool:
    """Errors the original's kernels reported as FailedPrecondition: engine failures and a missing ``init()``."""
    return isinstance(exc, HorovodInternalError) or (isinstance(exc, ValueError) and str(exc) == NOT_INITIALIZED)


def _graph_kernel(kernel: Kernel, out_dtypes: Sequence[tf.DType]) -> Kernel:
    numpy_dtypes = [d.as_numpy_dtype for d in out_dtypes]

    def call(*arrays):
        try:
            results = kernel(*arrays)
        except (HorovodInternalError, ValueError) as exc:
            if not _is_precondition_failure(exc):
                raise   # TF reports a ValueError as InvalidArgumentError, as the original did
            # Placeholder outputs: _fail_on_error stops everything that would read them.
            return [np.zeros((0,), dtype=dt) for dt in numpy_dtypes] + [np.bytes_(_graph_error_message(exc))]
        # numpy_function insists on exact dtypes and ndarray (not numpy scalar) results.
        return [np.asarray(r, dtype=dt) for r, dt in zip(results, numpy_dtypes)] + [np.bytes_(b"")]

    return call


def _fail_on_error(outputs: List[tf.Tensor], error: tf.Tensor, op_type: str) -> List[tf.Tensor]:
    """The kernel's outputs, gated on a node that fails with ``FailedPreconditionError`` when ``error`` is not empty
    (see the module docstring)."""
    with tf.name_scope(f"{op_type}_status"):
        check = tf.io.read_file(tf.strings.join(["/dev/null", error]))
        # A stateful node that reads the check (always true): tf.function runs it even when nothing uses the
        # outputs, and graph optimisation keeps a control dependency on it (one on the stateless read alone is
        # pruned in TF1 sessions).
        anchor = tf.debugging.Assert(tf.equal(tf.strings.length(check), 0), [check])
        with tf.control_dependencies([anchor]):
            return [tf.identity(o) for o in outputs]


def wait(handle):
    """Wait for an engine handle inside a kernel (the kernel's thread drives the engine meanwhile).

    A failure surfaces as in every binding (:func:`horovod.common.adapter.collective_error`): a
    ``HorovodInternalError``, which :func:`translate_error` turns into TF's error types.
    """
    return adapter.wait(handle)


# -- dtype handling inside kernels ---------------------------------------------------------------------------
#: Kernels see numpy arrays (bfloat16 ones from ml_dtypes): for collectives that reduce, the numpy binding's
#: adapter is TensorFlow's too, and the kernels call the collectives every binding shares
#: (:mod:`horovod.common.binding_ops`).
ARRAYS = adapter.ArrayAdapter()


class MovableArrays(adapter.ArrayAdapter):
    """The adapter of collectives that only move data (allgather, broadcast, alltoall): dtypes the engine cannot
    reduce yet can move (uint32, complex …) travel as rows of bytes, and come back in their dtype and shape."""

    def view(self, tensor: Any) -> adapter.View[np.ndarray]:
        array, copied = adapter.c_order(tensor)
        storage, override = adapter.storage_view(array)
        if override is not None or array.dtype.name in engine_ops.SUPPORTED_DTYPES:
            return adapter.View(array, storage, override, copied)
        if array.dtype.kind not in "biufc" or array.dtype.hasobject:
            raise ValueError(f"Tensor type {array.dtype.name} is not supported. Supported types: "
                             f"{', '.join(engine_ops.SUPPORTED_DTYPES)} (and other fixed-size numeric types for "
                             f"allgather, broadcast and alltoall).")
        rows = array.shape[0] if array.ndim else 1
        as_bytes = array.reshape((rows, -1)).view(np.uint8) if array.size else np.zeros((rows, 0), np.uint8)
        return adapter.View(array, as_bytes, None, copied)

    def result(self, array: np.ndarray, view: adapter.View[np.ndarray]) -> np.ndarray:
        original = view.tensor
        if view.dtype is not None or array.dtype == original.dtype:
            return super().result(array, view)
        out = adapter.c_order(array)[0].view(original.dtype).reshape((array.shape[0],) + original.shape[1:])
        return out.reshape(()) if original.ndim == 0 else out


MOVABLE = MovableArrays()
