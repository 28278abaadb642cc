"""Framework-neutral gradient bucketing: which small gradients travel packed together as one flat tensor.

A bucket costs one request, one negotiation and one collective however many gradients it holds, which is what a
model of many small layers pays most for (~25 µs of Python per request).  Bindings pass the size in bytes and the
dtype of each gradient, in the order they want them packed; the plan depends only on those, so it is the same on
every rank.  ``HOROVOD_GRADIENT_BUCKET_BYTES`` (``engine.config``'s ``gradient_bucket_bytes``) is the usual cap.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence

from horovod.engine import config as _config

_KNOB = "HOROVOD_GRADIENT_BUCKET_BYTES"
_cap_by_raw: Dict[Optional[str], int] = {}


def configured_cap() -> int:
    """``HOROVOD_GRADIENT_BUCKET_BYTES`` as the engine's config reads it, parsed once per distinct value (bindings
    ask at every step, and a full config load costs ~0.1 ms)."""
    raw = _config.environ().get(_KNOB)
    value = _cap_by_raw.get(raw)
    if value is None:
        value = _cap_by_raw[raw] = _config.load({} if raw is None else {_KNOB: raw}).gradient_bucket_bytes
    return value


def plan_buckets(nbytes: Sequence[Optional[int]], dtypes: Sequence[Hashable], cap: int) -> List[List[int]]:
    """Pack consecutive items of one dtype into buckets of at most ``cap`` bytes.

    Args:
        nbytes: size of each item in bytes; ``None`` (size unknown, e.g. a dynamic shape) keeps it out of
            every bucket.
        dtypes: dtype of each item (anything comparable); a change of dtype closes the current bucket.
        cap: the bucket size in bytes; ``<= 0`` disables bucketing.

    Returns:
        Buckets of at least two item indices each, in order.  Items in no bucket (larger than ``cap``, of unknown
        size, or alone between neighbours of other dtypes) keep their per-tensor path.
    """
    buckets: List[List[int]] = []
    if cap <= 0:
        return buckets
    current: List[int] = []
    current_bytes = 0
    for i, (size, dtype) in enumerate(zip(nbytes, dtypes)):
        if current and (size is None or dtype != dtypes[current[0]] or current_bytes + size > cap):
            if len(current) > 1:
                buckets.append(current)
            current, current_bytes = [], 0
        if size is None or size > cap:
            continue
        current.append(i)
        current_bytes += size
    if len(current) > 1:
        buckets.append(current)
    return buckets
