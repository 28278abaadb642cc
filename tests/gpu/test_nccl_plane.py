"""NCCL as a data plane (horovod/engine/device_nccl.py, :class:`NcclPlane`): the CPU transports' operations on device
arrays become the NCCL calls the device path has always issued: equal blocks as one collective, ragged allgathers as
grouped broadcasts into place, uneven reducescatters as grouped reduces to each block's owner, alltoall as grouped
send/recv, byte counts for data movement, ncclAvg only where the host path's Average gives the same values.

In process, with a communicator that records calls and device arrays of the host-memory backend.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from horovod.engine import ops
from horovod.engine.device_nccl import NcclPlane
from horovod.engine.memory import DeviceMemory
from horovod.engine.messages import Response
from horovod.transport import nccl

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
import emulated_device  # noqa: E402  (tests/conformance)


class _Lib:
    has_avg = True


class _Comm:
    """Records every call as ``(name, *args)``; a group as ``("group",)`` ... ``("end",)``."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.lib, self.calls = rank, size, _Lib(), []

    @contextlib.contextmanager
    def group(self):
        self.calls.append(("group",))
        yield
        self.calls.append(("end",))

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name,) + args)


BACKEND = emulated_device.HostMemoryBackend()


def _array(n: int, dtype: str = "float32"):
    return BACKEND.empty((n,), dtype, 0, None)


def _plane(rank: int = 1, size: int = 3, dtype: str = "float32"):
    comm = _Comm(rank, size)
    return NcclPlane(comm, 77, dtype), comm.calls


def test_equal_blocks_are_one_collective_and_data_moves_as_bytes():
    plane, calls = _plane()
    send, recv = _array(4), _array(12)
    plane.allgatherv(send, recv, [4, 4, 4])
    plane.broadcast(recv, 2)
    plane.reducescatter(recv, send, [4, 4, 4], "max")
    assert calls == [("allgather", send.ptr, recv.ptr, 16, nccl.BYTES, 77),
                     ("broadcast", recv.ptr, recv.ptr, 48, nccl.BYTES, 2, 77),
                     ("reducescatter", recv.ptr, send.ptr, 4, nccl.DTYPES["float32"], nccl.MAX, 77)]


def test_a_ragged_allgather_is_grouped_broadcasts_into_place():
    plane, calls = _plane(rank=1)
    send, recv = _array(2), _array(5)
    plane.allgatherv(send, recv, [3, 2, 0])   # rank 2 has nothing: no call for it
    assert calls == [("group",),
                     ("broadcast", recv.ptr, recv.ptr, 12, nccl.BYTES, 0, 77),
                     ("broadcast", send.ptr, recv.ptr + 12, 8, nccl.BYTES, 1, 77),
                     ("end",)]


def test_an_uneven_reducescatter_is_grouped_reduces_to_each_owner():
    plane, calls = _plane(rank=0, size=2, dtype="int32")
    send, recv = _array(5, "int32"), _array(3, "int32")
    plane.reducescatter(send, recv, [3, 2], "sum")
    assert calls == [("group",),
                     ("reduce", send.ptr, recv.ptr, 3, nccl.DTYPES["int32"], nccl.SUM, 0, 77),
                     ("reduce", send.ptr + 12, send.ptr + 12, 2, nccl.DTYPES["int32"], nccl.SUM, 1, 77),
                     ("end",)]


def test_alltoall_is_grouped_send_and_recv_skipping_empty_blocks():
    plane, calls = _plane(rank=0, size=3, dtype="float64")
    send, recv = _array(3, "float64"), _array(4, "float64")
    plane.alltoallv(send, [1, 0, 2], recv, [0, 3, 1])
    assert calls == [("group",),
                     ("send", send.ptr, 8, nccl.BYTES, 0, 77),
                     ("recv", recv.ptr, 24, nccl.BYTES, 1, 77),
                     ("send", send.ptr + 8, 16, nccl.BYTES, 2, 77),
                     ("recv", recv.ptr + 24, 8, nccl.BYTES, 2, 77),
                     ("end",)]


def _resp(op: int, dtype: str, postscale: float = 1.0) -> Response:
    return Response(ops.ALLREDUCE, ["x"], dtype=dtype, op=op, postscale=postscale, shapes=[(4,)])


def test_nccl_averages_floats_only_and_the_device_finishes_the_rest():
    plane, calls = _plane(size=4)
    assert plane.averages(_resp(ops.Average, "float32"))
    assert not plane.averages(_resp(ops.Average, "int32"))   # the host path's truncating division instead
    assert not plane.averages(_resp(ops.Average, "float32", postscale=2.0))   # postscale comes before the division
    assert not plane.averages(_resp(ops.Sum, "float32"))
    buf = _array(4)
    plane.allreduce_into(buf, buf, plane.AVERAGE)
    assert calls == [("allreduce", buf.ptr, buf.ptr, 4, nccl.DTYPES["float32"], nccl.AVG, 77)]

    memory = DeviceMemory(BACKEND, 0, None, "int32", lambda n: _array(n, "uint8"))
    assert memory.finisher(ops.Sum, 1.0, 4) is None
    ints = _array(3, "int32")
    ints.owner[:] = [8, -7, 5]
    finish = memory.finisher(ops.Average, 1.0, 4)
    assert finish is not None
    finish(ints)
    np.testing.assert_array_equal(ints.owner, [2, -1, 1])   # truncated toward zero, as on the host
