"""Whether this machine can run CUDA at all: the driver library (``libcuda.so.1``) and its device count.

Asked by ``hvd.cuda_built()`` and ``horovodrun --check-build``, which must tell the truth about what can be used
here without importing a framework (and without creating a CUDA context: ``cuInit`` and ``cuDeviceGetCount``
only read the driver's state).
"""
from __future__ import annotations

import ctypes
from typing import Optional

_count: Optional[int] = None


def device_count() -> int:
    """CUDA devices the driver reports; 0 when there is no driver or no device."""
    global _count
    if _count is None:
        _count = 0
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return 0
        count = ctypes.c_int()
        if driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0:
            _count = count.value
    return _count
