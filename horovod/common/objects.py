"""Object collectives shared by every binding: any picklable value, moved as bytes through the engine."""
from __future__ import annotations

import io
from typing import Any, List, Optional

import cloudpickle
import numpy as np

from horovod.engine import collectives


def _to_bytes(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8).copy()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set: int = 0) -> Any:
    """Serialize ``obj`` on ``root_rank`` and return a copy of it on every rank of the process set.

    All ranks of the process set must call it, in the same order.
    """
    from horovod.common import basics

    # Unnamed calls are matched by issue order, not by type name: `obj if rank == 0 else None` must work.
    name = name or collectives.tensor_name("object", None, process_set)
    is_root = basics.rank() == root_rank
    payload = _to_bytes(obj) if is_root else np.zeros(0, dtype=np.uint8)
    size = np.array([payload.size if is_root else 0], dtype=np.int64)
    collectives.broadcast_async([size], [f"broadcast.{name}.sz"], root_rank, process_set=process_set,
                                outputs=[size], attended=True).wait()
    if not is_root:
        payload = np.zeros(int(size[0]), dtype=np.uint8)
    collectives.broadcast_async([payload], [f"broadcast.{name}.t"], root_rank, process_set=process_set,
                                outputs=[payload], attended=True).wait()
    if is_root:
        return obj
    return cloudpickle.loads(payload.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: int = 0) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order (all ranks must call it)."""
    name = name or collectives.tensor_name("object", None, process_set)
    payload = _to_bytes(obj)
    sizes = collectives.allgather_async([np.array([payload.size], dtype=np.int64)],
                                        [f"allgather.{name}.sz"], process_set=process_set,
                                        attended=True).wait()
    data = collectives.allgather_async([payload], [f"allgather.{name}.t"], process_set=process_set,
                                       attended=True).wait()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
