"""The shm transport's point-to-point exchange: a length header and the bytes, streamed over the pair's UNIX socket.

``sendrecv`` need not involve the whole group, so it never touches the step counters (see
:mod:`horovod.transport.shm`); both directions progress together, so two ranks sending each other more than a
socket buffer holds never wait on each other.
"""
from __future__ import annotations

import select
import socket
import time
from typing import List, Optional, Tuple

import numpy as np

from horovod.transport.base import TransportError
from horovod.transport.shm_node import IO_CHUNK, LENGTH, Node

#: One side of an exchange: (group rank, world rank, the bytes to send or the array to fill: 1-D, C-contiguous).
Side = Tuple[int, int, np.ndarray]


def pair_exchange(node: Node, rank: int, to: Optional[Side], frm: Optional[Side]) -> None:
    """Send ``to``'s bytes to its rank and receive ``frm``'s array from its rank (either may be None), within the
    node's timeout; group rank ``rank`` is this process's.

    Raises:
        TransportError: a peer exited, sent another number of bytes than expected, or the timeout passed.
    """
    deadline = time.monotonic() + node.timeout
    tx: Optional[List[memoryview]] = None
    rx: Optional[List[memoryview]] = None
    dest = source = tx_peer = rx_peer = -1   # (only read where tx / rx is set)
    if to is not None:
        dest, tx_peer, data = to
        tx_sock = node.peers[tx_peer].sock
        tx = [memoryview(LENGTH.pack(data.nbytes)), data.data]
    if frm is not None:
        source, rx_peer, rx_arr = frm
        rx_sock = node.peers[rx_peer].sock
        head = bytearray(LENGTH.size)
        rx = [memoryview(head), rx_arr.view(np.uint8).data]
    while tx or rx:
        progressed = False
        if tx:
            try:
                k = tx_sock.send(tx[0][:IO_CHUNK], socket.MSG_NOSIGNAL)
                tx[0] = tx[0][k:]
                progressed = True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise TransportError(f"shm transport: sendrecv to {node.describe(tx_peer)} failed "
                                     f"({exc}); the process exited or was killed", peer=dest) from exc
            while tx and not len(tx[0]):
                tx.pop(0)
        if rx:
            try:
                k = rx_sock.recv_into(rx[0], min(len(rx[0]), IO_CHUNK)) if len(rx[0]) else 0
                if len(rx[0]) and k == 0:
                    raise TransportError(
                        f"shm transport: {node.describe(rx_peer)} closed the connection during "
                        f"sendrecv (the process exited or was killed)", peer=source)
                rx[0] = rx[0][k:]
                progressed = True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise TransportError(f"shm transport: sendrecv from {node.describe(rx_peer)} "
                                     f"failed ({exc})", peer=source) from exc
            if rx and not len(rx[0]):
                if len(rx) == 2:
                    (n,) = LENGTH.unpack(head)
                    if n != rx_arr.nbytes:
                        raise TransportError(f"sendrecv: rank {source} sent {n} bytes, rank {rank} expected "
                                             f"{rx_arr.nbytes} (recv of {rx_arr.size} {rx_arr.dtype})",
                                             peer=source)
                rx.pop(0)
                progressed = True
        if progressed or not (tx or rx):
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            q = source if rx else dest
            raise TransportError(f"shm transport: sendrecv timed out after {node.timeout:.0f} s waiting for "
                                 f"{node.describe(rx_peer if rx else tx_peer)}", peer=q)
        p = select.poll()
        if tx:
            p.register(tx_sock, select.POLLOUT)
        if rx:
            p.register(rx_sock, select.POLLIN | (select.POLLOUT if tx and tx_sock is rx_sock else 0))
        p.poll(remaining * 1000 + 1)
