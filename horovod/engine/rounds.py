"""The warm path: repeated collectives agreed by one AND of cache-hit bits per round, without the coordinator.

A training loop issues the same tensors with the same shapes every step. The first time a tensor is negotiated
(the *cold* path: full requests gathered on rank 0, checked, answered), the coordinator gives its response a
*slot* of the response cache, the same on every rank (:class:`SlotTable`), and every rank stores the response in
that slot next to the signature of its own request (:class:`ResponseCache`). When a rank issues a tensor whose
signature sits in a slot, it does not send anything: it sets the slot's bit in its vector of the next *round*.

Every rank takes part in each round: it posts its vector — hit bits, its cache version, status flags — on the
round board (:mod:`horovod.engine.shm_round_board` on one host, :mod:`horovod.engine.tcp_round_board` across hosts)
and ANDs everyone's. A bit set in the AND is a tensor every rank
has issued with the very request that was validated the last time: each rank takes the cached responses of those
slots in slot order, fuses them with the same threshold and runs them, exactly as if the coordinator had sent
them. Nothing reaches rank 0 and nothing is sent down, so a warm step costs every rank the same, whatever the
number of ranks.

What the AND cannot decide goes to the coordinator as today, so errors and mismatches are unchanged:

* a request that misses the cache (a new tensor, a changed shape, another op...) travels in full; the coordinator
  then drops the name's slot on every rank (``ControlMessage.invalidate``), and the other ranks' hits on that
  slot follow in full, so the coordinator sees every rank's request and validates them as before;
* a hit still waiting after :data:`DEMOTE_AFTER_S` (a rank issues something else, joined, or is slow) is sent in
  full too, which drops the slot the same way: stall warnings and mismatch errors name the ranks as before;
* a round in which any rank has joined sends every waiting hit in full (joined ranks contribute zeros there).

Ordering. The coordinator's messages carry ``round``: the last round rank 0 had posted when it sent them. Every
rank runs a message after finishing that round and before running the next round's hits, so the cold and the warm
collectives run in one order everywhere. Rank 0 sends a message before it posts the next round; a rank reached
over a Unix socket has the message when that round completes, and a rank reached over TCP (another host) waits for
the *fence* rank 0 sends after its messages and before that post (the round's :data:`F_FENCED` flag says there is
one; :mod:`horovod.engine.warm`). A message may change slots; a round in which ranks posted with different cache
versions (one had applied a change, another not yet) runs nothing and is posted again.

Who posts. A rank posts a round when it has hits it has not posted, when the last round was void, or when another
rank posted a round it has not (every driving rank answers; an idle rank answers at its background thread's idle
poll). A rank with nothing to add posts its empty vector: rounds need everyone.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod.engine import ops
from horovod.engine.cache import inline_data
from horovod.engine.messages import Request, Response

#: Seconds a hit may wait for the other ranks before it goes to the coordinator in full (the coordinator's stall
#: inspector, mismatch checks and joins then see it).
DEMOTE_AFTER_S = 1.0

#: Kinds whose responses may be cached (process-set changes, joins and errors never are).
CACHEABLE = (ops.ALLREDUCE, ops.ALLGATHER, ops.BROADCAST, ops.ALLTOALL, ops.REDUCESCATTER)

# Vector layout (uint64 words): inverted flags (AND of inverted = NOT OR), cache version and its complement (all
# equal iff both ANDs give this rank's own), then one bit per slot.
_FLAGS, _VERSION, _NOT_VERSION, HEADER_WORDS = 0, 1, 2, 3
F_JOINED = 1
F_FENCED = 2   # the coordinator sent messages before posting this round, and a fence after them (multi-host)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def signature(req: Request) -> tuple:
    """What must be equal for a request to reuse a cached response (the inline bytes of tiny allreduces are not
    part of it: a warm tiny allreduce is reduced on the data plane)."""
    data = inline_data(req)
    payload = None if data is not None else req.payload
    return (req.name, req.process_set, req.kind, req.dtype, req.shape, req.op, req.root, req.prescale,
            req.postscale, req.group, req.splits, payload)


def cacheable(resp: Response) -> bool:
    """Whether the coordinator may give ``resp`` a slot (a single tensor on the global set, no join, no error)."""
    return (resp.kind in CACHEABLE and resp.process_set == 0 and not resp.joined and len(resp.names) == 1
            and resp.error is None)


def slot_words(capacity: int) -> int:
    """Words of the round vector for ``capacity`` slots."""
    return HEADER_WORDS + (capacity + 63) // 64


def split_response(resp: Response) -> List[Tuple[int, Response]]:
    """``(slot, single-tensor template)`` for each tensor of a (possibly fused) response that carries a slot."""
    out = []
    for i, slot in enumerate(resp.slots):
        if slot < 0:
            continue
        out.append((slot, Response(resp.kind, [resp.names[i]], resp.process_set, resp.dtype, resp.op, resp.root,
                                   resp.prescale, resp.postscale, [resp.shapes[i]],
                                   [resp.first_dims[i]] if resp.first_dims else [],
                                   [resp.splits[i]] if resp.splits else [], None, (), -1, None, resp.group,
                                   device=resp.device)))
    return out


def fenced(anded: np.ndarray) -> bool:
    """Whether a finished round's AND says the coordinator fenced it: every rank whose control connection is TCP
    must then have received the fence (and so every message sent before it) before it runs the round."""
    return bool(~anded[_FLAGS] & np.uint64(F_FENCED))


class SlotTable:
    """The coordinator's assignment of slots to ``(process set, name)``, least recently assigned reused first.

    Args:
        capacity: number of slots.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots: "OrderedDict[Tuple[int, str], int]" = OrderedDict()
        self._free: List[int] = list(range(capacity - 1, -1, -1))

    def assign(self, key: Tuple[int, str]) -> int:
        """A slot for ``key``: its own, a free one, or the least recently assigned (every rank then replaces that
        slot's response when it runs the response that carries the assignment)."""
        slot = self._slots.pop(key, None)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                _, slot = self._slots.popitem(last=False)
        self._slots[key] = slot
        return slot

    def invalidate(self, key: Tuple[int, str]) -> Optional[int]:
        """Drop ``key``'s slot; returns it (every rank must drop it too), or None when it had none."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def __len__(self) -> int:
        return len(self._slots)


class ResponseCache:
    """One rank's copy of the response cache: slot -> (its own request's signature, the response template).

    Every rank applies the same assignments and invalidations in the same order (they travel in the coordinator's
    messages), so slot ``s`` holds the same tensor's response everywhere; :attr:`version` counts the changes.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots: Dict[int, Tuple[tuple, Response]] = {}
        self._by_sig: Dict[tuple, int] = {}
        self.version = 0

    def lookup(self, req: Request) -> Tuple[int, tuple]:
        """``(slot or -1, signature)`` of ``req``."""
        sig = signature(req)
        return self._by_sig.get(sig, -1), sig

    def entry(self, slot: int) -> Optional[Tuple[tuple, Response]]:
        return self._slots.get(slot)

    def template(self, slot: int) -> Response:
        """The response in ``slot`` (which holds one)."""
        return self._slots[slot][1]

    def store(self, slot: int, sig: Optional[tuple], template: Response) -> None:
        """Put ``template`` in ``slot`` under ``sig`` (None: this rank has no request for it; the slot is only
        cleared, and this rank never hits it)."""
        self.drop(slot)
        self.version += 1
        if sig is None or not 0 <= slot < self.capacity:
            return
        old = self._by_sig.pop(sig, None)
        if old is not None:
            self._slots.pop(old, None)
        self._slots[slot] = (sig, template)
        self._by_sig[sig] = slot

    def invalidate(self, slot: int) -> None:
        self.drop(slot)
        self.version += 1

    def drop(self, slot: int) -> None:
        item = self._slots.pop(slot, None)
        if item is not None:
            self._by_sig.pop(item[0], None)

    def __len__(self) -> int:
        return len(self._slots)


@dataclasses.dataclass
class _Hit:
    request: Request
    sig: tuple
    template: Response
    since: float
    posted: int = 0   # the round this hit was last posted in (0: not yet)


class RoundState:
    """One rank's side of the rounds: its waiting hits, the vector it posts, what a finished round runs.

    Pure bookkeeping, no I/O: the runtime posts the vectors on the board and runs what :meth:`finish` returns (the
    control-plane benchmark drives the same class for simulated ranks).

    Args:
        capacity: response-cache slots (at most ``64 * (board words - HEADER_WORDS)``).
    """

    def __init__(self, capacity: int):
        self.cache = ResponseCache(capacity)
        self.length = slot_words(capacity)
        self.hits: Dict[int, _Hit] = {}
        self.posted = 0        # rounds this rank posted
        self.done = 0          # rounds this rank finished
        self.joined = False    # this rank's join is in flight
        self.others_joined = False   # the last round said some rank had joined
        self._fresh = False    # hits not posted yet, or the last round was void
        self._posted_version = 0
        self._vector = np.zeros(self.length, dtype=np.uint64)
        self._result = np.zeros(self.length, dtype=np.uint64)
        self.rounds = self.warm = self.void = 0   # diagnostics and tests: rounds, tensors run warm, void rounds

    # -- issuing ---------------------------------------------------------------------------------------------

    def take(self, req: Request, now: float) -> bool:
        """Record ``req`` as a hit when its signature is cached (True); False: it goes to the coordinator."""
        if req.process_set != 0 or req.kind not in CACHEABLE or self.others_joined or self.joined:
            return False
        slot, sig = self.cache.lookup(req)
        if slot < 0:
            return False
        self.hits[slot] = _Hit(req, sig, self.cache.template(slot), now)
        self._fresh = True
        return True

    @property
    def in_round(self) -> bool:
        return self.posted > self.done

    def wants_post(self, highest: int, answer: bool = True) -> bool:
        """Whether to post the next round now: new hits, a void round to repeat, or others already in it (when
        ``answer``: a rank with nothing in flight lets them wait for its next hit instead of posting an empty
        round now, except at its idle poll)."""
        return not self.in_round and (self._fresh or (answer and highest > self.posted))

    # -- a round ---------------------------------------------------------------------------------------------

    def vector(self, fenced: bool = False) -> np.ndarray:
        """The next round's vector (and counts it as posted); stale hits must have been taken out first.
        ``fenced``: the coordinator sent a fence before this round (:func:`fenced`)."""
        vec = self._vector
        vec[:] = 0
        flags = (F_JOINED if self.joined else 0) | (F_FENCED if fenced else 0)
        vec[_FLAGS] = ~np.uint64(flags)
        self._posted_version = self.cache.version
        version = np.uint64(self._posted_version)
        vec[_VERSION] = version
        vec[_NOT_VERSION] = ~version
        self.posted += 1
        for slot, hit in self.hits.items():
            vec[HEADER_WORDS + (slot >> 6)] |= np.uint64(1 << (slot & 63))
            hit.posted = self.posted
            hit.template = self.cache.template(slot)   # stale() left only hits whose slot still holds their request
        self._fresh = False
        return vec

    def result_buffer(self) -> np.ndarray:
        return self._result

    def finish(self, anded: np.ndarray) -> List[Response]:
        """The round just posted is complete with AND ``anded``: the cached responses to run, in slot order (their
        hits are done). Waiting hits that must go to the coordinator are left to :meth:`stale`."""
        self.done = self.posted
        self.rounds += 1
        joined = bool(~anded[_FLAGS] & np.uint64(F_JOINED))
        self.others_joined = joined and not self.joined
        version = np.uint64(self._posted_version)
        if anded[_VERSION] != version or anded[_NOT_VERSION] != ~version:
            # Ranks posted with different cache versions: a bit may not mean the same tensor everywhere.
            self.void += 1
            self._fresh = bool(self.hits)
            return []
        bits = anded[HEADER_WORDS:]
        if not self.hits or not bits.any():
            return []
        out = []
        for word in np.flatnonzero(bits):
            value = int(bits[word])
            while value:
                low = value & -value
                slot = (int(word) << 6) + low.bit_length() - 1
                value ^= low
                hit = self.hits.get(slot)
                if hit is not None and hit.posted == self.posted:
                    del self.hits[slot]
                    out.append(hit.template)
        self.warm += len(out)
        return out

    def stale(self, now: float, demote_after: float = DEMOTE_AFTER_S) -> List[Request]:
        """Hits that must go to the coordinator in full now (removed here): their slot changed, some rank has
        joined, or they waited longer than ``demote_after``. Never while a round that includes them is open."""
        if not self.hits or self.in_round:
            return []
        out = []
        for slot, hit in list(self.hits.items()):
            entry = self.cache.entry(slot)
            if (entry is None or entry[0] != hit.sig or self.others_joined or self.joined
                    or now - hit.since >= demote_after):
                del self.hits[slot]
                out.append(hit.request)
        return out

    def next_deadline(self) -> Optional[float]:
        """When the oldest waiting hit is due for :meth:`stale`."""
        if not self.hits:
            return None
        return min(h.since for h in self.hits.values()) + DEMOTE_AFTER_S

    # -- the coordinator's messages --------------------------------------------------------------------------

    def apply(self, invalidate: Sequence[int], responses: Sequence[Response], own: Dict[str, Request]) -> None:
        """Apply a message's slot changes: ``invalidate`` first, then each slot its responses assign (``own``: this
        rank's requests by name, whose signature the slot is stored under)."""
        for slot in invalidate:
            self.cache.invalidate(slot)
        for resp in responses:
            if not resp.slots:
                continue
            for slot, template in split_response(resp):
                req = own.get(template.names[0])
                self.cache.store(slot, None if req is None else signature(req), template)
