"""One adapter per binding for the collective conformance suite (a helper module, not a test).

An adapter turns the suite's numpy inputs into the binding's tensors, calls the binding's public collectives and
turns the results back into numpy, so one set of cases (``conformance_cases.py``) checks every binding against
the same numpy reference.  Arrays cross the adapter in the engine's *storage* form: bfloat16 as its uint16 bit
pattern (numpy has no bfloat16), everything else as itself.

The class attributes (``module``, ``dtypes``, ``inplace``...) are read in the test process to skip what a binding
cannot do without importing its framework there; the methods run inside the ranks.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from typing import Any, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np

import emulated_device  # noqa: E402  (beside this file)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get it with the cases, by value
cloudpickle.register_pickle_by_value(emulated_device)

ALL_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
              "bool")


def _bits_to_f32(bits: np.ndarray) -> np.ndarray:
    b = np.asarray(bits, dtype=np.uint16)
    return np.array(b.astype(np.uint32) << 16, dtype=np.uint32).view(np.float32).reshape(b.shape)


def _f32_to_bits(x: np.ndarray) -> np.ndarray:
    """Exact for values that are bfloat16 already (all the suite produces), rounds to nearest even otherwise."""
    bits = np.array(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return np.array((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, dtype=np.uint16).reshape(np.shape(x))


def op_name(label: str) -> str:
    """A collective name every binding accepts (TensorFlow op names allow no spaces or brackets)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", label)


class Adapter:
    """The binding's collectives on numpy storage arrays.  Subclasses set ``module`` and convert tensors."""

    name = "?"
    module = "?"                  # the binding's import name
    framework = "?"               # what must be importable for the binding to run
    dtypes: Tuple[str, ...] = ALL_DTYPES
    inplace = True                # allreduce_ / broadcast_ work on this binding's tensors
    zero_size = True              # tensors with a zero dimension, and 0-d tensors
    why_not: dict = {}            # dtype -> why the binding cannot carry it

    @classmethod
    def unavailable(cls) -> Optional[str]:
        """Why this binding cannot run in this interpreter (``None`` when it can)."""
        if importlib.util.find_spec(cls.framework) is None:
            return f"{cls.framework} is not installed for {sys.executable}"
        return None

    def __init__(self) -> None:
        self.hvd = importlib.import_module(self.module)

    # -- conversions ---------------------------------------------------------------------------------------
    def tensor(self, storage: np.ndarray, dtype: str) -> Any:
        raise NotImplementedError

    def storage(self, t: Any, dtype: str) -> np.ndarray:
        raise NotImplementedError

    def same_object(self, result: Any, t: Any) -> bool:
        """In-place ops return their input."""
        return result is t

    # -- collectives (inputs and outputs in storage form) ------------------------------------------------------
    def allreduce(self, x, dtype, op, name, prescale=1.0, postscale=1.0):
        return self.hvd.allreduce(x, op=op, name=op_name(name), prescale_factor=prescale,
                                  postscale_factor=postscale)

    def allreduce_(self, x, dtype, op, name):
        return self.hvd.allreduce_(x, op=op, name=op_name(name))

    def grouped_allreduce(self, xs, op, name):
        return self.hvd.grouped_allreduce(xs, op=op, name=op_name(name))

    def allgather(self, x, name):
        return self.hvd.allgather(x, name=op_name(name))

    def grouped_allgather(self, xs, name):
        return self.hvd.grouped_allgather(xs, name=op_name(name))

    def broadcast(self, x, root, name):
        return self.hvd.broadcast(x, root, name=op_name(name))

    def broadcast_(self, x, root, name):
        return self.hvd.broadcast_(x, root, name=op_name(name))

    def alltoall(self, x, splits: Optional[List[int]], name) -> Tuple[Any, Optional[Any]]:
        """``(output, received_splits)``; ``received_splits`` is ``None`` when the binding returns none."""
        out = self.hvd.alltoall(x, splits=splits, name=op_name(name))
        return out if isinstance(out, (tuple, list)) else (out, None)

    def reducescatter(self, x, op, name, prescale=1.0, postscale=1.0):
        return self.hvd.reducescatter(x, op=op, name=op_name(name), prescale_factor=prescale,
                                      postscale_factor=postscale)

    def grouped_reducescatter(self, xs, op, name):
        return self.hvd.grouped_reducescatter(xs, op=op, name=op_name(name))


class NumpyAdapter(Adapter):
    name, module, framework = "numpy", "horovod.numpy", "numpy"
    dtypes = tuple(d for d in ALL_DTYPES if d != "bfloat16")
    why_not = {"bfloat16": "numpy has no bfloat16 dtype, so horovod.numpy cannot name it (the engine-level "
                           "bfloat16 checks are in tests/engine/test_engine_conformance.py)"}

    def tensor(self, storage, dtype):
        return np.array(storage, copy=True)

    def storage(self, t, dtype):
        return t


class DeviceAdapter(NumpyAdapter):
    """The engine's device path on every transport without a GPU: horovod.numpy's arrays handed over as device
    arrays of a host-memory backend (tests/conformance/emulated_device.py), so they are negotiated as GPU tensors
    and staged through host memory by the device executor."""

    name = "device"

    def __init__(self) -> None:
        super().__init__()
        emulated_device.install(self.hvd)


class DeviceNcclAdapter(NumpyAdapter):
    """The engine's NCCL path without a GPU: device arrays of an NCCL-capable host-memory backend and the stand-in
    NCCL (tests/gpu/standin_nccl, built with cc), so every case runs through horovod/engine/device_nccl.py."""

    name = "device-nccl"

    @classmethod
    def unavailable(cls) -> Optional[str]:
        import shutil

        return None if shutil.which("cc") else "no C compiler (cc) to build the stand-in NCCL"

    def __init__(self) -> None:
        import os

        from tests.gpu import standin

        super().__init__()
        path = standin.library()
        os.environ.update({"HOROVOD_NCCL_SO_PATH": path, "STANDIN_NCCL_DIR": os.environ["HVD_TEST_JOB_DIR"],
                           "HOROVOD_GPU_OPERATIONS": "NCCL"})   # NCCL or an error, never staged quietly
        emulated_device.install_nccl(self.hvd, path)


class TorchAdapter(Adapter):
    name, module, framework = "torch", "horovod.torch", "torch"

    def __init__(self) -> None:
        super().__init__()
        import torch

        self.torch = torch

    def tensor(self, storage, dtype):
        torch = self.torch
        if dtype == "bfloat16":
            return torch.from_numpy(_bits_to_f32(storage)).to(torch.bfloat16)
        return torch.from_numpy(np.array(storage, copy=True))

    def storage(self, t, dtype):
        if dtype == "bfloat16":
            return _f32_to_bits(t.detach().float().numpy())
        return t.detach().numpy()


class TorchCudaAdapter(TorchAdapter):
    """horovod.torch on CUDA tensors (a GPU machine: tests/gpu/device_check.sh runs it)."""

    name = "torch-cuda"

    @classmethod
    def unavailable(cls) -> Optional[str]:
        reason = super().unavailable()
        if reason is None:
            import torch

            if not torch.cuda.is_available():
                return "no CUDA device here (the GPU machine runs these: tests/gpu/device_check.sh)"
        return reason

    def tensor(self, storage, dtype):
        cuda = self.torch.cuda
        cuda.set_device(self.hvd.local_rank() % cuda.device_count())   # one GPU per local rank, where there are
        return super().tensor(storage, dtype).cuda()

    def storage(self, t, dtype):
        assert t.is_cuda, f"a torch-cuda result came back on {t.device}"
        return super().storage(t.cpu(), dtype)

    def same_object(self, result, t):
        return result is t

    def alltoall(self, x, splits, name):
        out, received = super().alltoall(x, splits, name)
        assert received is None or not received.is_cuda, "received splits are a host tensor, as the original's"
        return out, None if received is None else received.cuda()


class TensorflowAdapter(Adapter):
    """Eager TensorFlow through ``horovod.tensorflow``'s public functions."""

    name, module, framework = "tensorflow", "horovod.tensorflow", "tensorflow"
    inplace = False   # tf.Tensor is immutable; broadcast_ takes variables (tests/tensorflow covers it)

    def __init__(self) -> None:
        super().__init__()
        import tensorflow as tf

        self.tf = tf

    def tensor(self, storage, dtype):
        tf = self.tf
        if dtype == "bfloat16":
            return tf.cast(tf.constant(_bits_to_f32(storage)), tf.bfloat16)
        return tf.constant(storage)

    def storage(self, t, dtype):
        if dtype == "bfloat16":
            return _f32_to_bits(self.tf.cast(t, self.tf.float32).numpy())
        return np.asarray(t.numpy())


class MxnetAdapter(Adapter):
    name, module, framework = "mxnet", "horovod.mxnet", "mxnet"
    dtypes = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64")
    zero_size = False   # legacy NDArrays read a 0 in a shape as "unknown", and have no 0-d form
    why_not = {d: f"mxnet.nd has no {d} arrays that horovod.mxnet can reduce"
               for d in ("uint16", "int16", "bfloat16", "bool")}

    @classmethod
    def unavailable(cls) -> Optional[str]:
        # With tests/ on sys.path, tests/mxnet would import as an empty namespace package named mxnet.
        spec = importlib.util.find_spec("mxnet") if "mxnet" not in sys.modules else None
        if "mxnet" not in sys.modules and (spec is None or spec.origin in (None, "namespace")):
            return (f"mxnet is not installed for {sys.executable}; run the mxnet conformance with the MXNet venv: "
                    f".venv-mxnet/bin/python -m pytest tests/conformance -k mxnet")
        try:
            import mxnet

            mxnet.nd.NDArray  # noqa: B018  (a namespace package or a broken install has no nd)
        except Exception as exc:  # noqa: BLE001  (ImportError, or numpy >= 1.24 removed aliases it uses)
            return (f"mxnet is not importable in {sys.executable} ({type(exc).__name__}: {exc}); run the mxnet "
                    f"conformance with the MXNet venv: .venv-mxnet/bin/python -m pytest "
                    f"tests/conformance -k mxnet")
        return None

    def __init__(self) -> None:
        super().__init__()
        import mxnet

        self.mx = mxnet

    def tensor(self, storage, dtype):
        return self.mx.nd.array(storage, dtype=storage.dtype)

    def storage(self, t, dtype):
        return t.asnumpy()


class JaxAdapter(Adapter):
    """``horovod.jax`` on concrete ``jax.Array`` values (the jit path has its own suite in tests/jax)."""

    name, module, framework = "jax", "horovod.jax", "jax"
    inplace = False   # JAX arrays are immutable: horovod.jax has no in-place forms

    @classmethod
    def unavailable(cls) -> Optional[str]:
        # With tests/ on sys.path, tests/jax would import as an empty namespace package named jax.
        spec = importlib.util.find_spec("jax") if "jax" not in sys.modules else None
        if "jax" not in sys.modules and (spec is None or spec.origin in (None, "namespace")):
            return f"jax is not installed for {sys.executable} (pip install 'horovod-next[jax]')"
        if importlib.util.find_spec("optax") is None:
            return f"optax is not installed for {sys.executable} (pip install 'horovod-next[jax]')"
        return None

    def __init__(self) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)   # int64 / float64 arrays exist in JAX's 64-bit mode only
        super().__init__()
        import jax.numpy as jnp

        self.jnp = jnp

    def tensor(self, storage, dtype):
        if dtype == "bfloat16":
            return self.jnp.asarray(np.asarray(storage, dtype=np.uint16).view(self.jnp.bfloat16))
        return self.jnp.asarray(storage)

    def storage(self, t, dtype):
        array = np.asarray(t)
        return array.view(np.uint16) if dtype == "bfloat16" else array


class JaxJitAdapter(JaxAdapter):
    """``horovod.jax`` inside ``jax.jit`` (ordered host callbacks), wherever the result shape is known when tracing.

    Ragged allgathers (the ranks' first dimensions differ: asked with ``allgather_object`` first) and alltoall
    with explicit splits cannot be expressed under ``jit`` (docs/jax.md) and run eagerly here.
    """

    name = "jax-jit"
    # Every case compiles its programs (the job's main cost): int8, uint16 and int16 take the same host path as
    # uint8 and int32 and are covered eagerly by the "jax" binding.
    dtypes = ("bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
    why_not = {d: f"{d} under jit takes the uint8 / int32 path; the jax binding checks it eagerly"
               for d in ("int8", "uint16", "int16")}

    def __init__(self) -> None:
        super().__init__()
        import jax

        self.jit = jax.jit

    def allreduce(self, x, dtype, op, name, prescale=1.0, postscale=1.0):
        return self.jit(lambda v: self.hvd.allreduce(v, op=op, name=op_name(name), prescale_factor=prescale,
                                                     postscale_factor=postscale))(x)

    def grouped_allreduce(self, xs, op, name):
        return self.jit(lambda vs: self.hvd.grouped_allreduce(vs, op=op, name=op_name(name)))(xs)

    def _even(self, xs) -> bool:
        rows = [int(x.shape[0]) for x in xs]
        return all(theirs == rows for theirs in self.hvd.allgather_object(rows))

    def allgather(self, x, name):
        if not self._even([x]):
            return super().allgather(x, name)
        return self.jit(lambda v: self.hvd.allgather(v, name=op_name(name)))(x)

    def grouped_allgather(self, xs, name):
        if not self._even(xs):
            return super().grouped_allgather(xs, name)
        return self.jit(lambda vs: self.hvd.grouped_allgather(vs, name=op_name(name)))(xs)

    def broadcast(self, x, root, name):
        return self.jit(lambda v: self.hvd.broadcast(v, root, name=op_name(name)))(x)

    def alltoall(self, x, splits, name):
        if splits is not None:
            return super().alltoall(x, splits, name)
        return self.jit(lambda v: self.hvd.alltoall(v, name=op_name(name)))(x), None

    def reducescatter(self, x, op, name, prescale=1.0, postscale=1.0):
        return self.jit(lambda v: self.hvd.reducescatter(v, op=op, name=op_name(name), prescale_factor=prescale,
                                                         postscale_factor=postscale))(x)

    def grouped_reducescatter(self, xs, op, name):
        return self.jit(lambda vs: self.hvd.grouped_reducescatter(vs, op=op, name=op_name(name)))(xs)


ADAPTERS = {cls.name: cls for cls in (NumpyAdapter, DeviceAdapter, DeviceNcclAdapter, TorchAdapter, TorchCudaAdapter,
                                      TensorflowAdapter, MxnetAdapter, JaxAdapter, JaxJitAdapter)}


def skip_reason(binding: str, dtype: Optional[str] = None, needs_inplace: bool = False) -> Optional[str]:
    """Why ``binding`` cannot run a case (``None`` when it can)."""
    cls = ADAPTERS[binding]
    if dtype is not None and dtype not in cls.dtypes:
        return cls.why_not.get(dtype, f"{binding} does not carry {dtype}")
    if needs_inplace and not cls.inplace:
        return f"{binding} tensors cannot be changed in place"
    return cls.unavailable()


def shapes_for(adapter: Adapter, shapes: Sequence[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """The shapes the binding can hold."""
    if adapter.zero_size:
        return list(shapes)
    return [s for s in shapes if len(s) > 0 and all(d > 0 for d in s)]
