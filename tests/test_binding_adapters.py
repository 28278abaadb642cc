"""One behaviour suite over every binding's adapter (horovod/common/adapter.py) and its handle semantics.

Each test runs the same worker in two real ranks for one binding (numpy, torch, tensorflow, mxnet, jax).  Inside each
rank the worker checks, for every dtype the binding carries (bfloat16 included):

- the protocol itself: a contiguous tensor is viewed without a copy (the engine's array shares its memory),
  a non-contiguous one is staged into a C-contiguous copy, bfloat16 travels as uint16 bits with the engine dtype
  override ``"bfloat16"``, ``result`` rebuilds the framework's tensor, ``write_back`` fills a staged tensor;
- the collectives through the binding's public API against numpy: allreduce into a new tensor and in place, on
  contiguous and non-contiguous inputs (in place must land in the caller's memory);
- the handle semantics: a collective failing across ranks and a transport failure (``OSError``) both surface as
  ``HorovodInternalError``; ``init()``/``shutdown()`` forget every binding's handles; an unknown handle gives
  ``None`` from ``synchronize`` and the same ``ValueError`` from ``poll``.

MXNet runs only in its venv: ``.venv-mxnet/bin/python -m pytest tests/test_binding_adapters.py -k mxnet``.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from checks import assert_no_failures
from multiproc import run_ranks

DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "bool")
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
              "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def _mxnet_unavailable():
    if "mxnet" in sys.modules:
        return None
    spec = importlib.util.find_spec("mxnet")
    if spec is None or spec.origin in (None, "namespace"):
        return (f"mxnet is not installed for {sys.executable}; run .venv-mxnet/bin/python -m pytest "
                f"tests/test_binding_adapters.py -k mxnet")
    try:
        import mxnet

        mxnet.nd.NDArray  # noqa: B018
    except Exception as exc:  # noqa: BLE001  (numpy >= 1.24 breaks mxnet 1.9 at import)
        return f"mxnet is not importable here ({type(exc).__name__}: {exc}); use .venv-mxnet"
    return None


def _skip_reason(binding):
    if binding == "mxnet":
        return _mxnet_unavailable()
    if binding == "jax" and "jax" not in sys.modules:   # tests/jax alone would be found as a namespace package
        spec = importlib.util.find_spec("jax")
        if spec is None or spec.origin in (None, "namespace") or importlib.util.find_spec("optax") is None:
            return f"jax and optax are not installed for {sys.executable} (pip install 'horovod-next[jax]')"
    if importlib.util.find_spec(binding) is None:
        return f"{binding} is not installed for {sys.executable}"
    return None


# -- what the suite needs to know about each binding (runs inside the ranks) -------------------------------------
class Probe:
    """One binding seen by the suite: its adapter, how to make its tensors from numpy, its public collectives."""

    dtypes = DTYPES
    noncontiguous = True      # the framework has non-contiguous tensors the engine cannot view directly
    zero_copy = True          # contiguous tensors are viewed, not copied
    int_handles = True        # poll / synchronize / *_async
    inplace = True            # the tensors can be written into (allreduce_, write_back)

    def storage(self, t):
        """The tensor's values in the engine's storage form (bfloat16 as uint16 bits)."""
        raise NotImplementedError

    def make(self, storage, dtype: str, contiguous: bool = True):
        raise NotImplementedError

    def shares_memory(self, view, t) -> bool:
        raise NotImplementedError


def _bits(x):
    """float32 values that are exact in bfloat16 → their bfloat16 bit patterns."""
    import numpy as np

    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _floats(bits):
    import numpy as np

    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


class NumpyProbe(Probe):
    def __init__(self):
        import numpy as np

        import horovod.numpy as hvd

        self.np, self.hvd = np, hvd
        self.collectives = hvd._collectives
        self.adapter = self.collectives.adapter

    def make(self, storage, dtype, contiguous=True):
        np = self.np
        import ml_dtypes

        values = storage.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else storage
        if contiguous:
            return np.array(values, copy=True)
        wide = np.repeat(values[..., None], 2, axis=-1)   # every value twice; [..., 0] is a strided view
        return wide[..., 0]

    def storage(self, t):
        t = self.np.asarray(t)
        return t.view(self.np.uint16) if t.dtype.name == "bfloat16" else t

    def shares_memory(self, view, t):
        return self.np.shares_memory(view.array, t)


class TorchProbe(Probe):
    def __init__(self):
        import numpy as np
        import torch

        import horovod.torch as hvd
        from horovod.torch import engine_ops

        self.np, self.torch, self.hvd = np, torch, hvd
        self.collectives = engine_ops._collectives
        self.adapter = self.collectives.adapter

    def make(self, storage, dtype, contiguous=True):
        torch = self.torch
        if dtype == "bfloat16":
            t = torch.from_numpy(_floats(storage).copy()).to(torch.bfloat16)
        else:
            t = torch.from_numpy(self.np.array(storage, copy=True))
        if contiguous:
            return t
        return t.unsqueeze(-1).repeat_interleave(2, dim=-1)[..., 0]

    def storage(self, t):
        t = t.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(self.np.uint16)
        return t.numpy()

    def shares_memory(self, view, t):
        return view.array.ctypes.data == t.data_ptr()


class TensorflowProbe(NumpyProbe):
    """TensorFlow's kernels see numpy arrays (bfloat16 from ml_dtypes): its adapter is the array adapter behind
    ``bridge.ARRAYS`` (moves use ``bridge.MOVABLE``); its public collectives take tf tensors."""

    noncontiguous = True
    int_handles = False

    def __init__(self):
        super().__init__()
        import tensorflow as tf

        import horovod.tensorflow as hvd
        from horovod.tensorflow import bridge

        self.tf, self.hvd, self.bridge = tf, hvd, bridge
        self.adapter = bridge.ARRAYS

    def tf_tensor(self, storage, dtype):
        tf = self.tf
        if dtype == "bfloat16":
            return tf.cast(tf.constant(_floats(storage)), tf.bfloat16)
        return tf.constant(storage)

    def tf_storage(self, t):
        tf = self.tf
        if t.dtype == tf.bfloat16:
            return _bits(tf.cast(t, tf.float32).numpy())
        return t.numpy()


class MxnetProbe(Probe):
    dtypes = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64")
    noncontiguous = False     # NDArrays are always dense; every view is a host copy (asnumpy)
    zero_copy = False
    int_handles = False

    def __init__(self):
        import mxnet as mx
        import numpy as np

        import horovod.mxnet as hvd
        from horovod.mxnet import mpi_ops

        self.mx, self.np, self.hvd = mx, np, hvd
        self.adapter = mpi_ops._ADAPTER

    def make(self, storage, dtype, contiguous=True):
        return self.mx.nd.array(storage, dtype=storage.dtype)

    def storage(self, t):
        return t.asnumpy()

    def shares_memory(self, view, t):
        return False


class JaxProbe(Probe):
    """JAX arrays on the CPU: viewed in place (read-only), never written into (immutable: no in-place forms)."""

    noncontiguous = False     # jax.Array has no strided views: every array is row-major
    inplace = False

    def __init__(self):
        import jax

        jax.config.update("jax_enable_x64", True)   # int64 / float64 arrays exist in JAX's 64-bit mode only
        import jax.numpy as jnp
        import numpy as np

        import horovod.jax as hvd
        from horovod.jax import mpi_ops

        self.jnp, self.np, self.hvd = jnp, np, hvd
        self.collectives = mpi_ops._collectives
        self.adapter = self.collectives.adapter

    def make(self, storage, dtype, contiguous=True):
        values = storage.view(self.jnp.bfloat16) if dtype == "bfloat16" else storage
        return self.jnp.asarray(values)

    def storage(self, t):
        t = self.np.asarray(t)
        return t.view(self.np.uint16) if t.dtype.name == "bfloat16" else t

    def shares_memory(self, view, t):
        return view.array.ctypes.data == t.unsafe_buffer_pointer()


PROBES = {"numpy": NumpyProbe, "torch": TorchProbe, "tensorflow": TensorflowProbe, "mxnet": MxnetProbe,
          "jax": JaxProbe}


def _values(dtype: str, rank: int, shape=(3, 4)):
    """Small integers (exact in every dtype, bfloat16 and float16 included) differing per rank, as storage."""
    import numpy as np

    raw = (np.arange(int(np.prod(shape))).reshape(shape) % 7) + rank
    if dtype == "bool":
        return (raw % 2 == 0)
    if dtype == "bfloat16":
        return _bits(raw.astype(np.float32))
    return raw.astype(dtype)


def _sum(dtype: str, size: int, shape=(3, 4)):
    """numpy reference of a Sum allreduce of :func:`_values` over ``size`` ranks, as storage."""
    import numpy as np

    xs = [_values(dtype, r, shape) for r in range(size)]
    if dtype == "bool":
        return np.logical_or.reduce(xs)
    if dtype == "bfloat16":
        return _bits(np.sum([_floats(x) for x in xs], axis=0))
    return np.sum(np.stack(xs), axis=0).astype(dtype)


# -- the suite ---------------------------------------------------------------------------------------------------
def _protocol_checks(p: Probe, c, rank: int) -> None:
    """View / result / write-back of every dtype, in this rank, without the engine."""
    import numpy as np

    from horovod.engine import ops

    for dtype in p.dtypes:
        storage = _values(dtype, rank)
        for contiguous in (True, False) if p.noncontiguous else (True,):
            what = f"{dtype} {'contiguous' if contiguous else 'non-contiguous'}"
            t = p.make(storage, dtype, contiguous)
            view = p.adapter.view(t)
            c.true(view.array.flags.c_contiguous, f"{what}: engine array is not C-contiguous")
            c.true(view.array.dtype == ops.storage_dtype(dtype),
                   f"{what}: engine storage {view.array.dtype}, expected {ops.storage_dtype(dtype)}")
            c.true(view.dtype == ("bfloat16" if dtype == "bfloat16" else None),
                   f"{what}: dtype override {view.dtype!r}")
            c.equal(view.array, storage, f"{what}: engine array values")
            zero_copy = contiguous and p.zero_copy
            c.true(view.staged != zero_copy, f"{what}: staged={view.staged}, expected {not zero_copy}")
            c.true(p.shares_memory(view, t) == zero_copy,
                   f"{what}: engine array shares the tensor's memory: {p.shares_memory(view, t)}")
            # result(): the framework's tensor over an engine output, same dtype and values
            out = p.adapter.result(np.array(view.array, copy=True), view)
            c.equal(p.storage(out), storage, f"{what}: result() values")
            c.true(type(out) is type(t) or isinstance(out, type(t)), f"{what}: result() is a {type(out)}")
            # in place: the engine writes into view.array, finish_inplace leaves the result in the caller's tensor
            new = _values(dtype, rank + 3)
            if not p.inplace:   # immutable tensors: both ways of writing into one are refused, saying why
                c.raises(f"{what}: in-place view", TypeError, p.adapter.inplace_view, t, match="immutable")
                c.raises(f"{what}: write_back", TypeError, p.adapter.write_back, t, new, match="immutable")
                continue
            if isinstance(t, np.ndarray) and not contiguous:   # numpy refuses what it cannot write into
                c.raises(f"{what}: in-place view", ValueError, p.adapter.inplace_view, t, match="C-contiguous")
            else:
                view = p.adapter.inplace_view(t)
                c.true(view.staged != zero_copy, f"{what}: in-place view staged={view.staged}")
                np.copyto(view.array, new)
                c.true(p.adapter.finish_inplace(view) is t, f"{what}: finish_inplace returned another object")
                c.equal(p.storage(t), new, f"{what}: tensor after an in-place collective")
            # write_back on its own: any tensor of the binding takes an engine result of its shape
            t = p.make(storage, dtype, contiguous)
            c.true(p.adapter.write_back(t, new) is t, f"{what}: write_back returned another object")
            c.equal(p.storage(t), new, f"{what}: tensor after write_back")


def _collective_checks(p: Probe, c, rank: int, size: int) -> None:
    """allreduce through the public API, new result and in place, against numpy."""
    import numpy as np

    for dtype in p.dtypes:
        want = _sum(dtype, size)
        for contiguous in (True, False) if p.noncontiguous and p.int_handles else (True,):
            what = f"allreduce {dtype} {'contiguous' if contiguous else 'non-contiguous'}"
            name = f"{dtype}_{'c' if contiguous else 'nc'}"
            t = p.make(_values(dtype, rank), dtype, contiguous)
            out = p.hvd.allreduce(t, op=p.hvd.Sum, name=f"new_{name}")
            c.equal(p.storage(out), want, f"{what}: new result")
            c.equal(p.storage(t), _values(dtype, rank), f"{what}: input unchanged")
            if not p.inplace:
                continue
            if isinstance(t, np.ndarray) and not contiguous:
                c.raises(f"{what}: in place on a non-contiguous numpy array", ValueError, p.hvd.allreduce_, t,
                         op=p.hvd.Sum, name=f"in_{name}", match="C-contiguous")
                continue
            res = p.hvd.allreduce_(t, op=p.hvd.Sum, name=f"in_{name}")
            c.true(res is t, f"{what}: in place returned another object")
            c.equal(p.storage(t), want, f"{what}: in place result in the caller's tensor")
        if p.int_handles and p.zero_copy and p.inplace:
            # the zero-copy path really writes into the caller's memory: watch it through a second view
            t = p.make(_values(dtype, rank), dtype)
            alias = p.adapter.view(t).array
            p.hvd.synchronize(p.hvd.allreduce_async_(t, op=p.hvd.Sum, name=f"alias_{dtype}"))
            c.equal(alias, want, f"allreduce_async_ {dtype}: result seen through the caller's memory")


def _tensorflow_collectives(p: TensorflowProbe, c, rank: int, size: int) -> None:
    for dtype in p.dtypes:
        out = p.hvd.allreduce(p.tf_tensor(_values(dtype, rank), dtype), op=p.hvd.Sum, name=f"tf_{dtype}")
        c.true(out.dtype.name == dtype, f"tf allreduce {dtype}: result dtype {out.dtype.name}")
        c.equal(p.tf_storage(out), _sum(dtype, size), f"tf allreduce {dtype}")


def _failed_handle(error):
    from horovod.engine.handles import Handle

    handle = Handle(1, ["failed_on_purpose"])
    handle.fail(error)
    return handle


def _wait_as_binding(p: Probe, handle):
    """Wait for an engine handle the way the binding's own functions do."""
    if p.int_handles:
        return p.hvd.synchronize(p.collectives.handles.add(handle))
    if isinstance(p, TensorflowProbe):
        return p.bridge.wait(handle)
    from horovod.common import binding_ops

    return binding_ops.complete((handle, lambda raw: raw))


def _handle_checks(p: Probe, c, rank: int, size: int) -> None:
    from horovod.common.exceptions import HorovodInternalError, MismatchError, ShutdownError

    # a transport failure in the waiting thread (OSError) and an error only the coordinator could see (a plain
    # RuntimeError) become HorovodInternalError with the same text; engine failures keep their own type
    for error, kind in ((ConnectionResetError("peer reset the connection"), ConnectionResetError),
                        (RuntimeError("coordinator said no"), RuntimeError),
                        (ShutdownError("engine shut down"), ShutdownError)):
        try:
            _wait_as_binding(p, _failed_handle(error))
            c.add(f"waiting for a handle failed with {kind.__name__} did not raise")
        except HorovodInternalError as exc:
            c.true(str(exc) == str(error), f"{kind.__name__} wrapped with text {str(exc)!r}")
            if isinstance(error, HorovodInternalError):
                c.true(exc is error, f"{kind.__name__} was re-wrapped as {type(exc).__name__}")
            else:
                c.true(type(exc) is HorovodInternalError and isinstance(exc.__cause__, kind),
                       f"{kind.__name__} surfaced as {type(exc).__name__} caused by {exc.__cause__!r}")
        except BaseException as exc:  # noqa: BLE001
            c.add(f"waiting for a handle failed with {kind.__name__} raised {type(exc).__name__}: {exc}")

    # ranks disagreeing on a shape: every rank gets the engine's MismatchError (a HorovodInternalError)
    if isinstance(p, TensorflowProbe):
        t = p.tf.ones([2 + rank])
        c.raises("tf shape mismatch (FailedPreconditionError and HorovodInternalError)", HorovodInternalError,
                 p.hvd.allreduce, t, name="mismatch", match="Mismatched ALLREDUCE tensor shapes")
    else:
        import numpy as np

        t = p.make(np.ones(2 + rank, np.float32), "float32")
        if p.int_handles:
            h = p.hvd.allreduce_async(t, name="mismatch")
            c.raises("shape mismatch at synchronize", MismatchError, p.hvd.synchronize, h,
                     match="Mismatched ALLREDUCE tensor shapes")
        else:
            c.raises("shape mismatch", MismatchError, p.hvd.allreduce, t, name="mismatch",
                     match="Mismatched ALLREDUCE tensor shapes")

    if not p.int_handles:
        return
    import numpy as np

    hvd = p.hvd
    if hvd.__name__ in ("horovod.numpy", "horovod.torch"):   # their blocking forms take the shared run()
        # blocking forms return their result directly: no integer handle is issued for them, and a failure
        # surfaces as from synchronize
        issued = p.collectives.handles._next
        x = p.make(np.ones(3, np.float32), "float32")
        c.equal(p.storage(hvd.allreduce(x, op=hvd.Sum, name="direct")), np.full(3, size, np.float32), "allreduce")
        c.equal(p.storage(hvd.allreduce_(x, op=hvd.Sum, name="direct_")), np.full(3, size, np.float32),
                "allreduce_")
        c.equal(p.storage(hvd.broadcast_(x, 0, name="direct_bcast")), np.full(3, size, np.float32), "broadcast_")
        c.true(p.collectives.handles._next == issued, "a blocking collective issued an integer handle")
        c.raises("shape mismatch, blocking", MismatchError, hvd.allreduce, p.make(np.ones(2 + rank, np.float32),
                 "float32"), name="mismatch_blocking", match="Mismatched ALLREDUCE tensor shapes")
    for error in (ConnectionResetError("peer reset"), RuntimeError("coordinator said no")):
        c.raises(f"run() of a handle failed with {type(error).__name__}", HorovodInternalError,
                 p.collectives.run, (_failed_handle(error), lambda raw: raw), match=str(error))
    # unknown handles
    unknown = 10 ** 9
    c.true(hvd.synchronize(unknown) is None, "synchronize(unknown handle) is not None")
    c.raises("poll(unknown handle)", ValueError, hvd.poll, unknown,
             match=f"Handle {unknown} was not created or has been cleared.")
    # init()/shutdown() forget every binding's handles (this one's and numpy's alike)
    import horovod.numpy as hnp

    import time

    mine = hvd.allreduce_async(p.make(np.ones(3, np.float32), "float32"), name="before_reinit")
    theirs = hnp.allreduce_async(np.ones(3, np.float32), name="numpy_before_reinit")
    deadline = time.monotonic() + 60
    while not (hvd.poll(mine) and hnp.poll(theirs)) and time.monotonic() < deadline:
        time.sleep(0.01)   # the background thread completes them; both ranks then shut down in the same state
    c.true(hvd.poll(mine) and hnp.poll(theirs), "the collectives before re-init did not complete within 60 s")
    hvd.shutdown()
    hvd.init()
    for label, module, h in (("own", hvd, mine), ("numpy's", hnp, theirs)):
        c.true(module.synchronize(h) is None, f"synchronize({label} handle from before re-init) is not None")
        c.raises(f"poll({label} handle from before re-init)", ValueError, module.poll, h,
                 match=f"Handle {h} was not created or has been cleared.")
    out = hvd.synchronize(hvd.allreduce_async(p.make(np.ones(2, np.float32), "float32"), op=hvd.Sum,
                                              name="after_reinit"))
    c.equal(p.storage(out), np.full(2, size, np.float32), "allreduce after re-init")


def adapter_suite(binding: str) -> dict:
    import os

    from checks import Checks

    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    c = Checks(rank)
    p = PROBES[binding]()
    p.hvd.init()
    c.run("protocol", lambda: _protocol_checks(p, c, rank))
    if isinstance(p, TensorflowProbe):
        c.run("collectives", lambda: _tensorflow_collectives(p, c, rank, size))
    else:
        c.run("collectives", lambda: _collective_checks(p, c, rank, size))
    c.run("handles", lambda: _handle_checks(p, c, rank, size))
    p.hvd.shutdown()
    return c.report()


@pytest.mark.parametrize("binding", ["numpy", "torch", "tensorflow", "mxnet", "jax"])
def test_adapter_behaviour(binding):
    reason = _skip_reason(binding)
    if reason:
        pytest.skip(reason)
    reports = run_ranks(adapter_suite, 2, args=(binding,), env=WORKER_ENV, timeout=300)
    # every dtype's protocol and collective checks plus the handle checks ran on every rank
    assert_no_failures(reports, minimum_checks=50)


def test_collective_error_rule():
    """The one rule every binding applies when waiting fails (no engine needed)."""
    from horovod.common.adapter import collective_error
    from horovod.common.exceptions import HorovodInternalError, InvalidArgumentError, PeerFailureError

    peer = PeerFailureError("rank 1 went away")
    assert collective_error(peer) is peer
    for exc in (OSError("broken pipe"), RuntimeError("no"), InvalidArgumentError("usage")):
        wrapped = collective_error(exc)
        assert type(wrapped) is HorovodInternalError and str(wrapped) == str(exc), (exc, wrapped)
    for exc in (KeyboardInterrupt(), ValueError("bad argument at enqueue"), TypeError("t")):
        assert collective_error(exc) is exc


if __name__ == "__main__":   # pragma: no cover
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
