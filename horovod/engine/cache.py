"""The response cache (``HOROVOD_CACHE_CAPACITY``): repeated collectives skip most of negotiation.

A training loop submits the same tensors with the same shapes every step.  Each rank remembers the requests it
sent, by signature, in ``capacity`` numbered slots (least recently used slot reused first).  A request seen
before travels as its slot number alone — plus, for an inline allreduce, its bytes — and the coordinator, which
mirrors every rank's slots, resolves it to the very request object it stored the first time.  When every rank's
request for a name resolves to the same objects as the last time that name was negotiated successfully, the
coordinator reuses that outcome instead of validating again (see :class:`~horovod.engine.negotiation.Coordinator`).

Capacity 0 turns the cache off: every request travels in full and is validated every time.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Dict, Optional, Tuple, Union

from horovod.engine import ops
from horovod.engine.messages import Request

# Rare requests whose payload (a list of ranks) is not a signature part: always sent in full.
_UNCACHED = (ops.ADD_PROCESS_SET, ops.REMOVE_PROCESS_SET)

# A request on the wire: in full (a new signature, carrying its slot) or as (slot, inline bytes or None).
Wire = Union[Request, Tuple[int, Optional[bytes]]]


def inline_data(req: Request) -> Optional[bytes]:
    """The per-call bytes of an inline allreduce (not part of the signature), else ``None``."""
    return req.payload if req.kind == ops.ALLREDUCE and isinstance(req.payload, bytes) else None


def _signature(req: Request, data: Optional[bytes]) -> tuple:
    payload = None if data is not None else req.payload
    return (req.name, req.process_set, req.kind, req.dtype, req.shape, req.op, req.root, req.prescale,
            req.postscale, req.group, req.splits, payload, data is not None, req.blocking, req.device)


def _template(req: Request, data: Optional[bytes], slot: int) -> Request:
    """The request as stored in a slot: without its per-call inline bytes."""
    if data is not None:
        req = dataclasses.replace(req, payload=None)
    req.slot = slot
    return req


class RequestCache:
    """One rank's slots for its own requests.

    Args:
        capacity: number of slots; 0 disables the cache.
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._slots: "OrderedDict[tuple, Request]" = OrderedDict()   # signature -> template, LRU order

    def canonical(self, req: Request) -> Tuple[Request, Optional[bytes], bool]:
        """``(template, inline bytes, hit)``: the stored request object for ``req``'s signature."""
        data = inline_data(req)
        if not self.capacity or req.kind in _UNCACHED:
            return req, data, False
        sig = _signature(req, data)
        template = self._slots.get(sig)
        if template is not None:
            self._slots.move_to_end(sig)
            return template, data, True
        if len(self._slots) >= self.capacity:
            _, evicted = self._slots.popitem(last=False)
            slot = evicted.slot
        else:
            slot = len(self._slots)
        template = _template(req, data, slot)
        self._slots[sig] = template
        return template, data, False

    def encode(self, req: Request) -> Wire:
        """What to send to the coordinator for ``req``."""
        template, data, hit = self.canonical(req)
        if hit:
            return (template.slot, data)
        if data is None or template.slot < 0:
            return req
        return dataclasses.replace(template, payload=data)   # a new slot's first use carries its bytes too


class CoordinatorCache:
    """The coordinator's mirror of every rank's slots."""

    def __init__(self) -> None:
        self._slots: Dict[int, Dict[int, Request]] = {}

    def decode(self, rank: int, wire: Wire) -> Tuple[Request, Optional[bytes]]:
        """``(template, inline bytes)`` for what ``rank`` sent.

        Raises:
            KeyError: a slot the rank never filled (a protocol error).
        """
        if isinstance(wire, tuple):
            slot, data = wire
            return self._slots[rank][slot], data
        data = inline_data(wire)
        if wire.slot < 0:
            return wire, data
        template = _template(wire, data, wire.slot) if data is not None else wire
        self._slots.setdefault(rank, {})[wire.slot] = template
        return template, data
