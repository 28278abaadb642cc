"""Helpers the original exposed from ``horovod.tensorflow`` (kept for scripts that import them)."""
from __future__ import annotations

import functools
from typing import Callable, List, Sequence

import tensorflow as tf

from horovod.common.util import gpu_available, split_list  # noqa: F401  (re-exported)


def _executing_eagerly() -> bool:
    """True outside ``tf.function`` and TF1 graphs."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable) -> Callable:
    """``tf.function`` of ``f`` (the original compiled its allreduce helpers this way)."""
    return tf.function(f)


def _cache(f: Callable) -> Callable:
    """Memoize ``f`` on its (hashable) arguments."""
    cache: dict = {}

    @functools.wraps(f)
    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Sequence) -> List:
    """Hashable references of variables (``v.ref()``)."""
    return [v.ref() for v in variables]


def refs_to_vars(refs: Sequence) -> List:
    """The variables behind :func:`vars_to_refs` references."""
    return [r.deref() for r in refs]
