"""Shared-memory data plane for the ranks of one host.

How it works, and why:

* **Memory.** Every rank owns one segment per group: a small header (its step counter and per-round metadata)
  followed by two equal *halves* that consecutive rounds use alternately.  The segment is an anonymous ``memfd``
  (or, with ``shm_backing='file'``, a ``/dev/shm`` file unlinked right after it is opened).  Its descriptor travels
  to the peers over an authenticated AF_UNIX socket (``SCM_RIGHTS``), and peers map it read-only.  Nothing of the
  job has a name in ``/dev/shm`` after setup, so a rank killed with SIGKILL leaks nothing: the kernel frees the
  memory when the last mapping goes.
* **Progress.** Each rank publishes a step counter in its header.  All ranks of a group make the same steps in the
  same order, so "peer q reached step s" denotes the same protocol point on every rank.  Data written before a
  step is visible to whoever sees the step because x86 orders stores with stores and loads with loads (TSO);
  Python cannot issue a fence, so on weakly ordered CPUs (ARM, POWER) :func:`create_shm` refuses and the engine
  falls back to tcp.
* **Wake-ups without spinning.** After a step a rank writes to every peer's eventfd.  A waiter re-reads the
  counters, spins for a few microseconds only when every rank has a core of its own, then blocks in ``poll()`` on
  its eventfd plus one UNIX socket per peer; a peer's socket hangs up when that process exits, which turns into a
  :class:`TransportError` naming it.
* **Reusing a half.** Round *i* writes half ``i % 2``.  Readers read a round between the writer's publishing step
  ``s`` and their own step ``s + k``, so before writing a half again a rank waits (almost never blocking) until
  every peer has passed that step (``_free_at``).
* **Allreduce** (large): per chunk, every rank copies the shares it does not own into its half, then reduces its
  own share across all halves (in rank order, so every rank gets bitwise identical results), then everyone copies
  all reduced shares out: a reduce-scatter plus allgather through shared memory, with the reduction spread over
  all ranks.  Small buffers take one step: everyone copies in, everyone reduces everything.
* **Single-copy reads** (:mod:`horovod.transport.cma`): an allgather's block or an alltoall's piece of at least
  ``shm_single_copy_bytes`` (4 MiB) is read by its receiver straight from the sender's buffer with
  ``process_vm_readv``: one copy instead of two through the halves.  The sender posts the buffer's address in its
  round's metadata, and every rank takes one more step when it has read, so no buffer changes under a reader.
  Below that size the staged copies win (they stay in the caches; a cross-memory read runs at a third of a cached
  copy's speed here), and a broadcast never gains (its root copies once and its readers overlap).  The world group
  probes at setup whether every rank can read every other (same user, no ptrace restriction) and all ranks agree.
* **Broadcast** streams: the root writes a piece, steps, writes the next while the others copy the first out
  (while the host has a core per rank, pieces of 256 KiB or an eighth of the buffer, at most a half; a whole half
  per step on a crowded host).
* **sendrecv** is point-to-point and need not involve the whole group, so it never touches the step counters;
  it streams over the pair's UNIX socket with a length header (:mod:`horovod.transport.shm_pair`).
* **Subgroups** are created lazily at their first collective: the members exchange fresh segments over the same
  sockets, share the world's eventfds, and keep their own counters, so they never wait on non-members.

Calls on one transport (and its subgroups) must come from one thread at a time.  A child forked after setup
(e.g. a data-loader worker) drops its copies of the sockets, so it cannot mask its parent's death.  Built for
Linux (memfd, eventfd, abstract UNIX sockets; a /dev/shm file, a pipe and a socket file are the fallbacks).
"""
from __future__ import annotations

import os
import platform
from typing import List, Optional, Sequence

import numpy as np

from horovod.transport import cma
from horovod.transport.base import MAX, MIN, PRODUCT, SUM, Bootstrap, Finish, TransportError, check_op, register
from horovod.transport.cma import CmaError
from horovod.transport.shm_group import BROADCAST_PIECES, ShmGroup
from horovod.transport.shm_node import LINE_BYTES, Node, new_segment_fd, segment_layout
from horovod.transport.shm_pair import pair_exchange

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"}


_UFUNCS = {SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}
_BOOL_UFUNCS = {SUM: np.logical_or, MAX: np.logical_or, MIN: np.logical_and, PRODUCT: np.logical_and}


def _binary(dtype: np.dtype, op: str):
    """The elementwise ufunc of ``op`` (bool: sum/max are OR, min/product are AND, as in ``reduce_into``)."""
    check_op(op, "shm transport")
    return (_BOOL_UFUNCS if dtype == np.bool_ else _UFUNCS)[op]


def _combine(f, out: np.ndarray, srcs: Sequence[np.ndarray]) -> None:
    """``out = srcs[0] f srcs[1] f ...`` in this order (``out`` must not alias any source but ``srcs[0]``)."""
    f(srcs[0], srcs[1], out=out)
    for x in srcs[2:]:
        f(out, x, out=out)


def _byte_view(a: np.ndarray) -> np.ndarray:
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"shm transport: buffers must be 1-D and C-contiguous, got shape {a.shape}")
    return a.view(np.uint8)


class ShmTransport(ShmGroup):
    """Collectives among processes of one host through shared memory (see the module docstring).

    Create the world group with :func:`create_shm`; :meth:`subgroup` gives groups of a subset.

    Attributes:
        rank: this process's index in the group.
        size: the number of processes in the group.
    """

    name = "shm"

    # -- collectives -------------------------------------------------------------------------------------------

    def barrier(self) -> None:
        if self.size == 1:
            return
        self._enter("barrier")
        self._wait(self._step())

    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        self.allreduce_into(buf, buf, op)

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: str = SUM,
                       finish: Optional[Finish] = None) -> None:
        f = _binary(dst.dtype, op)
        if src is not dst:
            _byte_view(src)
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(f"shm transport: allreduce_into needs src and dst of one shape and dtype, got "
                                 f"{src.shape}/{src.dtype} and {dst.shape}/{dst.dtype}")
        if self.size == 1 or dst.size == 0:
            if src is not dst:
                np.copyto(dst, src)
            if finish is not None:
                finish(dst)
            return
        _byte_view(dst)
        self._enter("allreduce")
        if dst.dtype.kind in "fc":
            with np.errstate(all="ignore"):  # inf / nan are defined results (think loss scaling), not errors
                self._allreduce(src, dst, f, finish)
        else:
            self._allreduce(src, dst, f, finish)

    def _allreduce(self, src: np.ndarray, dst: np.ndarray, f, finish: Optional[Finish]) -> None:
        if dst.nbytes * self.size <= self._small_bytes and dst.nbytes <= self._half_bytes:
            self._allreduce_small(src, dst, f)
            if finish is not None:
                finish(dst)   # still in cache: the result is at most a MiB
        else:
            step = max(1, self._chunk_bytes // dst.itemsize)
            for start in range(0, dst.size, step):
                self._allreduce_chunk(src[start:start + step], dst[start:start + step], f, finish)

    def _allreduce_small(self, src: np.ndarray, dst: np.ndarray, f) -> None:
        """One step: everyone publishes its input, then everyone reduces all of them (in rank order)."""
        n = dst.size
        h = self._next_half(True)
        views = self._typed(dst.dtype, h)
        views[self.rank][:n] = src
        s = self._step()
        self._wait(s)
        f(views[0][:n], views[1][:n], out=dst)
        for v in views[2:]:
            f(dst, v[:n], out=dst)
        self._free_at[h] = s + 1

    def _share_bounds(self, n: int, itemsize: int) -> List[int]:
        """Split ``n`` elements into ``size`` shares at cache-line boundaries."""
        key = (n, itemsize)
        b = self._bounds_cache.get(key)
        if b is None:
            unit = max(1, LINE_BYTES // itemsize)
            units = -(-n // unit)
            b = [min(n, (q * units // self.size) * unit) for q in range(self.size)] + [n]
            if len(self._bounds_cache) > 64:
                self._bounds_cache.clear()
            self._bounds_cache[key] = b
        return b

    def _allreduce_chunk(self, src: np.ndarray, dst: np.ndarray, f, finish: Optional[Finish]) -> None:
        r, n = self.rank, dst.size
        h = self._next_half(True)
        views = self._typed(dst.dtype, h)
        b = self._share_bounds(n, dst.itemsize)
        lo, hi = b[r], b[r + 1]
        mine = views[r]
        # Only the shares the peers reduce are copied in: this rank reduces its own straight from ``src``.
        if lo:
            np.copyto(mine[:lo], src[:lo])
        if hi < n:
            np.copyto(mine[hi:n], src[hi:n])
        self._wait(self._step())
        if hi > lo:
            _combine(f, mine[lo:hi], [src[lo:hi] if q == r else views[q][lo:hi] for q in range(self.size)])
        s = self._step()
        self._wait(s)
        copy_out = np.copyto if finish is None else finish.copyto
        for i in range(self.size):
            q = (r + i) % self.size
            if b[q + 1] > b[q]:
                copy_out(dst[b[q]:b[q + 1]], views[q][b[q]:b[q + 1]])
        self._free_at[h] = s + 1

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        counts = self._check_counts(counts, "counts")
        if send.size != counts[self.rank]:
            raise ValueError(f"allgatherv: send has {send.size} elements, counts[{self.rank}] = {counts[self.rank]}")
        if recv.size < sum(counts):
            raise ValueError(f"allgatherv: recv has {recv.size} elements, sum(counts) = {sum(counts)}")
        if self.size == 1:
            recv[:send.size] = send
            return
        self._enter("allgatherv")
        isz = recv.itemsize
        nb = [c * isz for c in counts]
        displ = [0]
        for c in nb:
            displ.append(displ[-1] + c)
        sv, rv = _byte_view(send), _byte_view(recv)
        if np.may_share_memory(sv, rv):
            sv = sv.copy()
        r, hb = self.rank, self._half_bytes
        if self._node.cma is not None and max(nb) >= self._single_copy_bytes:   # (every rank has these counts)
            # Every block is read straight from its rank's send buffer: one copy, not two through the halves.
            h = self._next_half(True)
            self._post_buffer(h, sv)
            s = self._step()
            rv[displ[r]:displ[r] + nb[r]] = sv
            self._wait(s)
            failed = None
            for q in self._peers:
                if nb[q]:
                    failed = failed or self._read_peer(q, int(self._meta[q][h][1]), rv[displ[q]:displ[q] + nb[q]])
            self._free_at[h] = s + 1
            self._reads_done(failed)
            return
        rv[displ[r]:displ[r] + nb[r]] = sv
        for off in range(0, max(nb), hb):
            h = self._next_half(True)
            m = min(hb, max(0, nb[r] - off))
            if m:
                self._half[r][h][:m] = sv[off:off + m]
            s = self._step()
            self._wait(s, [q for q in self._peers if nb[q] > off])
            for q in self._peers:
                m = min(hb, max(0, nb[q] - off))
                if m:
                    rv[displ[q] + off:displ[q] + off + m] = self._half[q][h][:m]
            self._free_at[h] = s + 1

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of this group of {self.size}")
        if self.size == 1 or buf.size == 0:
            return
        self._enter("broadcast")
        data = _byte_view(buf)   # (every member cuts the same pieces: the size is the same)
        hb = min(self._half_bytes, max(self._broadcast_piece, data.size // BROADCAST_PIECES // LINE_BYTES * LINE_BYTES))
        for off in range(0, data.size, hb):
            m = min(hb, data.size - off)
            if self.rank == root:
                h = self._next_half(True)
                self._half[root][h][:m] = data[off:off + m]
                self._free_at[h] = self._step() + 1
            else:
                h = self._next_half(False)
                self._wait(self._step(), (root,))
                data[off:off + m] = self._half[root][h][:m]

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                  recv_counts: Sequence[int]) -> None:
        send_counts = self._check_counts(send_counts, "send_counts")
        recv_counts = self._check_counts(recv_counts, "recv_counts")
        if send.size < sum(send_counts) or recv.size < sum(recv_counts):
            raise ValueError(f"alltoallv: send/recv have {send.size}/{recv.size} elements, counts sum to "
                             f"{sum(send_counts)}/{sum(recv_counts)}")
        r = self.rank
        if send_counts[r] != recv_counts[r]:
            raise ValueError(f"alltoallv: send_counts[{r}] = {send_counts[r]} but recv_counts[{r}] = "
                             f"{recv_counts[r]} (what a rank sends itself)")
        isz = send.itemsize
        sb, rb = [c * isz for c in send_counts], [c * isz for c in recv_counts]
        sd, rd = [0], [0]
        for a, c in zip(sb, rb):
            sd.append(sd[-1] + a)
            rd.append(rd[-1] + c)
        sv, rv = _byte_view(send), _byte_view(recv)
        if self.size > 1 and np.may_share_memory(sv, rv):
            sv = sv.copy()
        rv[rd[r]:rd[r] + rb[r]] = sv[sd[r]:sd[r] + sb[r]]
        if self.size == 1:
            return
        self._enter("alltoallv")
        # A piece of at least the single-copy size is read straight from its sender's buffer (sender and receiver
        # both know its size), the others travel through the halves in rounds of one sub-slot per peer.
        single = self._single_copy_bytes if self._node.cma is not None else 0
        staged_sb = [0 if single and c >= single else c for c in sb]
        staged_rb = [0 if single and c >= single else c for c in rb]
        B, got, off = self._sub_bytes, [0] * self.size, 0
        pieces = {}    # q -> where q's piece for this rank starts in q's memory, and its bytes (single-copy pieces)
        error = None   # raised once every rank is past this call's steps (a peer may be reading this rank's buffer)
        while True:  # rounds continue while any rank has more: every rank reads every flag, so all agree
            h = self._next_half(True)
            meta, half = self._meta[r][h], self._half[r][h]
            more = 0
            for p in self._peers:
                m = min(B, max(0, staged_sb[p] - off))
                if m:
                    half[p * B:p * B + m] = sv[sd[p] + off:sd[p] + off + m]
                meta[2 + p] = m
                more |= staged_sb[p] > off + B
            if single and not off:
                self._post_buffer(h, sv, sd)
            meta[0] = more
            s = self._step()
            self._wait(s)
            for q in self._peers:
                mq = self._meta[q][h]
                if single and not off and rb[q] >= single:
                    start, stop = int(mq[2 + self.size + r]), int(mq[3 + self.size + r])
                    pieces[q] = (int(mq[1]) + start, stop - start)
                m = int(mq[2 + r])
                if got[q] + m > staged_rb[q]:
                    error = error or (q, got[q] + m)
                elif m:
                    rv[rd[q] + got[q]:rd[q] + got[q] + m] = self._half[q][h][r * B:r * B + m]
                    got[q] += m
                more |= int(mq[0])
            self._free_at[h] = s + 1
            off += B
            if not more:
                break
        if single:
            failed = None
            for q, (address, nbytes) in pieces.items():
                if nbytes != rb[q]:
                    error = error or (q, nbytes)
                else:
                    failed = failed or self._read_peer(q, address, rv[rd[q]:rd[q] + nbytes])
                    got[q] = nbytes
            self._reads_done(failed)
        short = [q for q in self._peers if got[q] != rb[q]]
        if error is not None or short:
            q, nbytes = error or (short[0], got[short[0]])
            raise TransportError(f"alltoallv: rank {q} sends {nbytes // isz} elements to rank {r}, but "
                                 f"recv_counts[{q}] = {recv_counts[q]}", peer=q)

    # -- single-copy reads (horovod.transport.cma) ------------------------------------------------------------

    def _post_buffer(self, h: int, buf: np.ndarray, offsets: Sequence[int] = ()) -> None:
        """Publish, in this round's metadata (half ``h``), where ``buf`` lies in this process and byte ``offsets``
        into it, for the peers to read it; ``buf`` must stay unchanged until every reader has made its next step."""
        meta = self._meta[self.rank][h]
        meta[1] = cma.address(buf)
        if offsets:
            meta[2 + self.size:2 + self.size + len(offsets)] = offsets

    def _read_peer(self, q: int, address: int, dst: np.ndarray) -> Optional[TransportError]:
        """Copy ``dst.nbytes`` bytes at ``address`` in group rank ``q``'s memory into ``dst``; the error, if the read
        failed, for the caller to raise after its last step (whose wait names a peer that died instead: a peer that
        gave up the call because a third rank died may have freed the buffer being read)."""
        node = self._node
        assert node.cma is not None
        try:
            node.cma.read(self._pid(q), address, dst)
            return None
        except CmaError as exc:
            error = TransportError(f"shm transport: rank {self.rank} could not read {dst.nbytes} bytes of "
                                   f"{node.describe(self._members[q])} in {self._op} ({exc}): the process exited "
                                   f"or was killed (if it is alive, HOROVOD_SHM_SINGLE_COPY_BYTES=0 turns these "
                                   f"reads off)", peer=q)
            error.__cause__ = exc
            return error

    def _reads_done(self, failed: Optional[TransportError]) -> None:
        """The last step of a call that posted a buffer for single-copy reads: once every peer has made it, nobody
        reads this rank's buffer any more, so it may change.  A failed read is raised only then: the wait names a
        peer that died, where the read itself may have failed on a living peer that gave up the call."""
        self._wait(self._step())
        if failed is not None:
            raise failed

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: str = SUM) -> None:
        counts = self._check_counts(counts, "counts")
        f = _binary(send.dtype, op)
        r = self.rank
        if send.size < sum(counts) or recv.size < counts[r]:
            raise ValueError(f"reducescatter: send has {send.size} elements (sum(counts) = {sum(counts)}), recv has "
                             f"{recv.size} (counts[{r}] = {counts[r]})")
        displ = [0]
        for c in counts:
            displ.append(displ[-1] + c)
        if self.size == 1:
            recv[:counts[0]] = send[:counts[0]]
            return
        _byte_view(send)  # checks the layout
        _byte_view(recv)
        self._enter("reducescatter")
        if np.may_share_memory(send, recv):
            send = send.copy()
        if send.dtype.kind in "fc":
            with np.errstate(all="ignore"):
                self._reducescatter(send, recv, counts, displ, f)
        else:
            self._reducescatter(send, recv, counts, displ, f)

    def _reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: List[int], displ: List[int], f) -> None:
        r = self.rank
        B = self._sub_bytes // send.itemsize
        for off in range(0, max(counts), B):
            h = self._next_half(True)
            sub = self._subslots(send.dtype, h)
            for p in self._peers:
                m = min(B, max(0, counts[p] - off))
                if m:
                    np.copyto(sub[r][p][:m], send[displ[p] + off:displ[p] + off + m])
            s = self._step()
            self._wait(s)
            m = min(B, max(0, counts[r] - off))
            if m:
                lo = displ[r] + off
                _combine(f, recv[off:off + m], [send[lo:lo + m] if q == r else sub[q][r][:m]
                                                for q in range(self.size)])
            self._free_at[h] = s + 1

    def sendrecv(self, send: Optional[np.ndarray], dest: Optional[int], recv: Optional[np.ndarray],
                 source: Optional[int]) -> None:
        if send is None:
            dest = None
        if recv is None:
            source = None
        for what, q in (("dest", dest), ("source", source)):
            if q is not None and not 0 <= q < self.size:
                raise ValueError(f"sendrecv: {what} {q} is not a rank of this group of {self.size}")
        if dest == self.rank or source == self.rank:
            if dest != source:
                raise ValueError("sendrecv: sending to oneself needs source == dest == this rank")
            assert send is not None and recv is not None   # dest and source are None where their buffer is
            recv[...] = send
            return
        if dest is None and source is None:
            return
        if self._closed or self._node.closed:
            raise TransportError("shm transport: sendrecv called after close()")
        self._op = "sendrecv"
        to = frm = None
        if dest is not None:
            assert send is not None   # dest is None where send is
            to = (dest, self._members[dest], _byte_view(send))
        if source is not None:
            assert recv is not None   # source is None where recv is
            _byte_view(recv)   # (checks its shape)
            frm = (source, self._members[source], recv)
        pair_exchange(self._node, self.rank, to, frm)


_MEMORY_ORDER_OK = platform.machine().lower() in _TSO_MACHINES


# Not registered on weakly ordered CPUs, so that the engine's automatic choice falls back to tcp there.
@register("shm") if _MEMORY_ORDER_OK else (lambda factory: factory)
def create_shm(boot: Bootstrap) -> ShmTransport:
    """Connect the ranks of ``boot`` (all on this host) through shared memory.

    Args:
        boot: the world bootstrap; ``boot.store`` carries the UNIX socket addresses under ``boot.scope + '-shm'``.
            Options (:class:`TransportOptions`): ``shm_segment_bytes``, ``shm_chunk_bytes``, ``shm_small_bytes``,
            ``shm_spin_us`` (adaptive spin before blocking; default 20 µs when every rank has a core, else 0),
            ``shm_backing``.

    Raises:
        TransportError: the ranks are not all on this host, or a peer did not connect in ``boot.timeout``.
    """
    if boot.size != boot.local_size:
        raise TransportError(f"shm transport needs every rank on one host, but size = {boot.size} and local_size = "
                             f"{boot.local_size}; use tcp (or hierarchical shm + tcp) across hosts")
    if not _MEMORY_ORDER_OK:
        raise TransportError(f"shm transport relies on x86 memory ordering and this CPU is "
                             f"{platform.machine()!r}; use the tcp transport here")
    node = Node(boot, ShmTransport)
    try:
        members = tuple(range(boot.size))
        if boot.size == 1:
            world = ShmTransport(node, members)
            world._ready = True
        else:
            if boot.store is None:
                raise TransportError("shm transport needs the rendezvous store to find its local peers")
            seg_bytes = segment_layout(node.segment_bytes, boot.size)[3]
            own = new_segment_fd(node.segment_name("w"), seg_bytes, node.backing)
            try:
                seg_fds = node.connect(boot, own, seg_bytes)
            except BaseException:
                os.close(own)
                raise
            seg_fds[boot.rank] = own
            world = ShmTransport(node, members, seg_fds)
            world.probe_single_copy()
        node.world = world
        return world
    except BaseException:
        node.close()
        raise
