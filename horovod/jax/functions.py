"""Python objects across ranks (any cloudpickle-able value), with ``horovod.jax``'s process-set arguments."""
from __future__ import annotations

from typing import Any, List, Optional

from horovod.common import objects as _objects
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.jax.adapter import after_jitted_collectives


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank of the process set (JAX arrays inside travel pickled).

    All ranks of the set must call it; unnamed calls are matched by issue order, so non-root ranks may pass a
    placeholder such as ``None``.  Not usable inside ``jax.jit`` (objects are not traceable).
    """
    after_jitted_collectives()
    return _objects.broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order (all ranks must call it)."""
    after_jitted_collectives()
    return _objects.allgather_object(obj, name, _set_id(process_set))
