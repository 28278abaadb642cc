"""Variable and object broadcasts for TensorFlow."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import tensorflow as tf

from horovod.common import objects
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.tensorflow import bridge
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.mpi_ops import _grouped_broadcast, _op_of


@not_converted
def broadcast_variables(variables, root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False):
    """Assign ``root_rank``'s values to ``variables`` on every rank of the process set.

    All variables travel as one group (one op, fused by the engine).  All ranks of the process set must call
    it with the same variables, in the same order.

    Args:
        variables: iterable of ``tf.Variable`` (or Keras variables).
        root_rank: global rank whose values win.
        inplace: accepted for compatibility; variables are always updated in place.

    Returns:
        ``None`` eagerly; in a graph, the op that performs the broadcast.
    """
    var_list = list(variables)
    if not var_list:
        return None if bridge.executing_eagerly() else tf.no_op()
    values = _grouped_broadcast([tf.convert_to_tensor(v) for v in var_list], root_rank,
                                name="broadcast_variables" if not bridge.executing_eagerly() else None,
                                process_set=process_set)
    assigns = [v.assign(b) for v, b in zip(var_list, values)]
    if bridge.executing_eagerly():
        return None
    deps = [o for o in (_op_of(a) for a in assigns) if o is not None]
    return tf.group(*deps)


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (any picklable value) on every rank of the process set.

    Works eagerly and in TF1 graph programs alike (objects never enter the graph); ``session`` is accepted
    for compatibility and not needed.
    """
    return objects.broadcast_object(obj, root_rank, name, _set_id(process_set))


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A reusable ``fn(obj) -> obj`` that broadcasts from ``root_rank``."""

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj`` (in rank order) on every rank of the process set."""
    return objects.allgather_object(obj, name, _set_id(process_set))
