"""``join`` and the in-graph queries (``size_op``, ``rank_op`` …): int32 ops evaluated when the graph runs, so
a graph traced once keeps giving the current values after an elastic resize."""
from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from horovod.common import basics
from horovod.common.process_sets import ProcessSet
from horovod.engine import collectives
from horovod.tensorflow import bridge
from horovod.tensorflow.bridge import not_converted


def _registered_set(process_set_id: int) -> ProcessSet:
    sets = basics.registered_process_sets()
    if process_set_id not in sets:
        raise ValueError(f"Process set id {process_set_id} is not registered on this rank "
                         f"(registered: {sorted(sets)}).")
    return sets[process_set_id]


@not_converted
def join() -> tf.Tensor:
    """Declare that this rank has no more data; returns (an int32 tensor of) the rank that joined last.

    Until every rank joined, this rank contributes zeros to the allreduces the others still run.
    """
    def kernel():
        return [np.asarray(bridge.wait(collectives.join_async(attended=True)), dtype=np.int32)]

    return bridge.run(kernel, [], [tf.int32], "HorovodJoin", [tf.TensorShape([])])[0]


def _query_op(value_fn, op_type: str, name: Optional[str]) -> tf.Tensor:
    def kernel():
        return [np.asarray(value_fn(), dtype=np.int32)]

    return bridge.run(kernel, [], [tf.int32], name or op_type, [tf.TensorShape([])])[0]


@not_converted
def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """An int32 op giving the number of ranks in the process set when it runs (follows elastic resizes)."""
    return _query_op(lambda: len(_registered_set(process_set_id).ranks) if process_set_id else basics.size(),
                     "HorovodSize", name)


@not_converted
def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 op giving the number of ranks on this host when it runs."""
    return _query_op(basics.local_size, "HorovodLocalSize", name)


@not_converted
def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 op giving this process's global rank when it runs."""
    return _query_op(basics.rank, "HorovodRank", name)


@not_converted
def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 op giving this process's local rank when it runs."""
    return _query_op(basics.local_rank, "HorovodLocalRank", name)


@not_converted
def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """An int32 op: 1 if this rank belongs to the process set, else 0."""
    return _query_op(lambda: int(basics.rank() in _registered_set(process_set_id).ranks)
                     if process_set_id else 1, "HorovodProcessSetIncluded", name)
