"""The two memories the collective algorithms (:mod:`horovod.engine.algorithms`) run over: host memory (numpy) and
device memory (a :class:`~horovod.engine.device.DeviceBackend`'s operations, enqueued on one stream).

Both speak flat element pieces of C-contiguous arrays.  They differ where the data planes differ: the host reduces
bfloat16 in float32 (staging widens and narrows it), the device reduces it natively; host copies run now, device
copies are batched into one launch and only enqueued.
"""
from __future__ import annotations

from typing import Callable, FrozenSet, Optional, Sequence

import numpy as np

from horovod.engine import ops, result_pool
from horovod.engine.device import DeviceArray, DeviceBackend


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


class HostMemory:
    """numpy arrays; one reusable fusion buffer per process (grown on demand, never shrunk below the last need).

    The single-tensor paths call these per collective: the plain ones are numpy's and the result pool's own
    functions, not wrappers, so the host's hot path pays no extra Python call for the shared algorithms."""

    widens = frozenset((ops.BFLOAT16,))
    flat = staticmethod(_flat)
    empty_like = staticmethod(result_pool.empty_like)
    overlaps = staticmethod(np.shares_memory)
    scale = staticmethod(ops.scale_inplace)

    def __init__(self) -> None:
        self._raw = np.empty(0, dtype=np.uint8)

    @staticmethod
    def reduce_dtype(dtype: str) -> str:
        """The dtype reductions of ``dtype`` run in: bfloat16 is widened to float32."""
        return "float32" if dtype == ops.BFLOAT16 else dtype

    @staticmethod
    def empty(shape: Sequence[int], dtype: str) -> np.ndarray:
        return result_pool.empty(tuple(shape), dtype=ops.storage_dtype(dtype))

    def fusion(self, count: int, dtype: str) -> np.ndarray:
        dt = ops.storage_dtype(dtype)
        nbytes = count * dt.itemsize
        if self._raw.nbytes < nbytes:
            self._raw = np.empty(max(nbytes, 2 * self._raw.nbytes if self._raw.nbytes < (64 << 20) else nbytes),
                                 dtype=np.uint8)
        return self._raw[:nbytes].view(dt)

    @staticmethod
    def piece(a: np.ndarray, start: int, count: int) -> np.ndarray:
        return a.reshape(-1)[start:start + count]

    @staticmethod
    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="no")

    @staticmethod
    def copy_many(dsts: Sequence[Optional[np.ndarray]], srcs: Sequence[np.ndarray]) -> None:
        """``dsts[i] <- srcs[i]`` (any shapes of equal size), skipping ``None``; bfloat16 bits (uint16) and float32
        meet only in staging, and are widened or narrowed on the way."""
        for dst, src in zip(dsts, srcs):
            if dst is None:
                continue
            if dst.dtype == src.dtype:
                np.copyto(dst.reshape(-1), src.reshape(-1), casting="no")
            elif dst.dtype == np.float32:
                ops.bf16_to_f32(src.reshape(-1), dst.reshape(-1))
            else:
                ops.f32_to_bf16(src.reshape(-1), dst.reshape(-1))

    @staticmethod
    def fill_zero(a: np.ndarray) -> None:
        a[...] = 0


class PinnedStage:
    """A reusable page-locked host buffer that device memory is staged through, used on one stream only (grown on
    demand)."""

    def __init__(self) -> None:
        self._raw = np.empty(0, np.uint8)

    def get(self, backend: DeviceBackend, stream: object, nbytes: int) -> np.ndarray:
        if self._raw.nbytes < nbytes:
            # The last copy back to the device may still read the old buffer: let it finish before it is freed.
            backend.synchronize(stream)
            self._raw = backend.pinned(max(nbytes, 2 * self._raw.nbytes))
        return self._raw


class DeviceFinish:
    """Postscale, then Average's division, enqueued on the device after the data plane wrote the whole result."""

    __slots__ = ("memory", "postscale", "divisor")

    def __init__(self, memory: "DeviceMemory", postscale: float, divisor: int):
        self.memory, self.postscale, self.divisor = memory, postscale, divisor

    def __call__(self, piece: DeviceArray) -> None:
        m = self.memory
        if self.postscale != 1.0:
            m.backend.scale(piece, self.postscale, m.dtype, m.stream)
        if self.divisor != 1:
            m.backend.divide(piece, self.divisor, m.dtype, m.stream)


class DeviceMemory:
    """One response's device memory: a backend, a device and the stream everything is enqueued on; ``dtype`` is
    the response's (device arrays are sliced and scaled as that engine dtype).  ``fusion_bytes(n)`` is the stream's
    reusable fusion buffer of at least ``n`` bytes."""

    def __init__(self, backend: DeviceBackend, device: int, stream: object, dtype: str,
                 fusion_bytes: Callable[[int], DeviceArray]):
        self.backend, self.device, self.stream, self.dtype = backend, device, stream, dtype
        self._fusion_bytes = fusion_bytes

    widens: FrozenSet[str] = frozenset()   # NCCL reduces bfloat16 natively

    @staticmethod
    def reduce_dtype(dtype: str) -> str:
        return dtype

    @staticmethod
    def flat(a: DeviceArray) -> DeviceArray:
        return a   # the backend and NCCL see device arrays as flat memory already

    @staticmethod
    def overlaps(a: DeviceArray, b: DeviceArray) -> bool:
        return a is b

    def empty(self, shape: Sequence[int], dtype: str) -> DeviceArray:
        return self.backend.empty(tuple(shape), dtype, self.device, self.stream)

    def empty_like(self, a: DeviceArray) -> DeviceArray:
        return self.empty(a.shape, self.dtype)

    def fusion(self, count: int, dtype: str) -> DeviceArray:
        raw = self._fusion_bytes(count * ops.storage_dtype(dtype).itemsize)
        return self.backend.slice(raw, 0, count, dtype)

    def piece(self, a: DeviceArray, start: int, count: int) -> DeviceArray:
        return self.backend.slice(a, start, count, self.dtype)

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        self.backend.copy(dst, src, self.stream)

    def copy_many(self, dsts: Sequence[Optional[DeviceArray]], srcs: Sequence[DeviceArray]) -> None:
        """One batched copy (one launch, not one per tensor), skipping ``None`` destinations."""
        pairs = [(d, s) for d, s in zip(dsts, srcs) if d is not None]
        if pairs:
            self.backend.copy_many([d for d, _ in pairs], [s for _, s in pairs], self.stream)

    def fill_zero(self, a: DeviceArray) -> None:
        self.backend.fill_zero(a, self.stream)

    def scale(self, a: DeviceArray, factor: float) -> None:
        if factor != 1.0:
            self.backend.scale(a, factor, self.dtype, self.stream)

    def finisher(self, op: int, postscale: float, set_size: int) -> Optional[DeviceFinish]:
        """The finish of a reduction (as :func:`horovod.engine.ops.finisher`), or None when it has nothing to do."""
        divisor = set_size if op == ops.Average else 1
        return None if postscale == 1.0 and divisor == 1 else DeviceFinish(self, postscale, divisor)
