"""Small helpers the bindings share (argument compatibility, lists)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator, List, Optional, Sequence, TypeVar

from horovod.engine import ops

T = TypeVar("T")


def get_average_backwards_compatibility_fun(reduce_ops):
    """Build the ``average=`` → ``op`` shim for a binding's op constants."""

    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            import warnings

            warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                          DeprecationWarning, stacklevel=3)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


class _Ops:
    Average, Sum, Adasum, Min, Max, Product = ops.Average, ops.Sum, ops.Adasum, ops.Min, ops.Max, ops.Product


handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_Ops)


def num_rank_is_power_2(num_rank: int) -> bool:
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items: Sequence[T], n: int) -> List[List[T]]:
    """Split ``items`` into ``n`` contiguous chunks of nearly equal length."""
    d, r = divmod(len(items), n)
    return [list(items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)]) for i in range(n)]


def is_iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    def parts(v):
        out = []
        for p in v.split("+")[0].split("."):
            digits = "".join(ch for ch in p if ch.isdigit())
            out.append(int(digits) if digits else 0)
        return out

    return parts(ver) >= parts(target)


@contextlib.contextmanager
def env(**kwargs: str) -> Iterator[None]:
    """Temporarily set environment variables (tests and launch helpers)."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _framework_answer(probe: str) -> Optional[bool]:
    for module in ("horovod.torch", "horovod.tensorflow", "horovod.mxnet"):
        framework = module.split(".")[1]
        if not module_installed(framework):
            continue
        from horovod.common import basics

        return bool(getattr(basics, probe)())
    return None


def mpi_built(verbose: bool = False) -> Optional[bool]:
    return _framework_answer("mpi_built")


def gloo_built(verbose: bool = False) -> Optional[bool]:
    return _framework_answer("gloo_built")


def nccl_built(verbose: bool = False) -> Optional[bool]:
    return _framework_answer("nccl_built")


def ddl_built(verbose: bool = False) -> Optional[bool]:
    return _framework_answer("ddl_built")


def ccl_built(verbose: bool = False) -> Optional[bool]:
    return _framework_answer("ccl_built")


def module_installed(name: str) -> bool:
    """True when ``name`` is an importable module, found without importing it.

    A bare directory of that name on ``sys.path`` (a namespace package, e.g. a ``tests/mxnet`` folder) does not
    count: it is not the framework.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when ``horovod.<ext_base_name>``'s framework is importable (nothing is compiled here)."""
    return module_installed(ext_base_name)


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    return False
