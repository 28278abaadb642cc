"""Finding, loading and declaring ``libnccl.so.2`` through ``ctypes``: NCCL with nothing to compile.

GPU builds of PyTorch (and JAX, CuPy) install NVIDIA's NCCL as a wheel (``nvidia-nccl-cu12`` / ``-cu13``, the
library under ``nvidia/nccl/lib``); its C API is small and takes only pointers, integers and one 128-byte struct,
so it is called directly.  RCCL (AMD) and NCCL-compatible vendor libraries export the same symbols
(:data:`SIGNATURES`) and load the same way through ``HOROVOD_NCCL_SO_PATH``.

Where the library comes from, in order: the explicit path (``HOROVOD_NCCL_SO_PATH``), the ``nvidia.nccl`` package
of the running Python, then the system's loader (``libnccl.so.2``, ``libnccl.so``, ``librccl.so``).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import Dict, List, Optional, Sequence, Tuple

# ncclResult_t codes (nccl.h) and their names, for error messages.
RESULT_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
SUCCESS, IN_PROGRESS = 0, 7

# The oldest NCCL this binding drives: ncclSend/ncclRecv (alltoall) arrived in 2.7.
MIN_VERSION = (2, 7, 0)
# ncclAvg and ncclBfloat16 arrived in 2.10; two ranks of one communicator may share a GPU from 2.30 on
# (with NCCL_MULTI_RANK_GPU_ENABLE=1); before, the communicator's creation fails with "Duplicate GPU detected".
AVG_VERSION = (2, 10, 0)
MULTI_RANK_GPU_VERSION = (2, 30, 0)

_UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes made by one rank and handed to the others out of band."""

    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class NcclConfig(ctypes.Structure):
    """``ncclConfig_t`` as NCCL 2.17 lays it out (newer libraries read the fields of the version it states)."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


CONFIG_MAGIC, CONFIG_UNDEF_INT = 0xCAFEBEEF, -(1 << 31)
# ncclCommInitRankConfig with this struct's fields (non-blocking creation: ncclInProgress, then polled).
CONFIG_VERSION = (2, 17, 0)
# From 2.26 on, NCCL_LAUNCH_ORDER_IMPLICIT=1 orders the kernels of several communicators on several streams by the
# order the host issued them (otherwise "deadlocks could ensue").
IMPLICIT_ORDER_VERSION = (2, 26, 0)


def nonblocking_config() -> NcclConfig:
    """``NCCL_CONFIG_INITIALIZER`` with ``blocking = 0``."""
    cfg = NcclConfig(ctypes.sizeof(NcclConfig), CONFIG_MAGIC, 21700, 0, CONFIG_UNDEF_INT, CONFIG_UNDEF_INT,
                     CONFIG_UNDEF_INT, None)
    return cfg


_p = ctypes.c_void_p        # device buffers, communicators, streams: plain pointers
_int, _size = ctypes.c_int, ctypes.c_size_t
_result = ctypes.c_int      # ncclResult_t (an enum)

# name -> (restype, argtypes), exactly as nccl.h declares them (tests/gpu compares this table with the header).
SIGNATURES: Dict[str, Tuple[object, Tuple[object, ...]]] = {
    "ncclGetVersion": (_result, (ctypes.POINTER(_int),)),
    "ncclGetUniqueId": (_result, (ctypes.POINTER(NcclUniqueId),)),
    "ncclCommInitRank": (_result, (ctypes.POINTER(_p), _int, NcclUniqueId, _int)),
    "ncclCommDestroy": (_result, (_p,)),
    "ncclCommAbort": (_result, (_p,)),
    "ncclCommGetAsyncError": (_result, (_p, ctypes.POINTER(_result))),
    "ncclCommCount": (_result, (_p, ctypes.POINTER(_int))),
    "ncclCommCuDevice": (_result, (_p, ctypes.POINTER(_int))),
    "ncclCommUserRank": (_result, (_p, ctypes.POINTER(_int))),
    "ncclGetErrorString": (ctypes.c_char_p, (_result,)),
    "ncclAllReduce": (_result, (_p, _p, _size, _int, _int, _p, _p)),
    "ncclBroadcast": (_result, (_p, _p, _size, _int, _int, _p, _p)),
    "ncclReduce": (_result, (_p, _p, _size, _int, _int, _int, _p, _p)),
    "ncclAllGather": (_result, (_p, _p, _size, _int, _p, _p)),
    "ncclReduceScatter": (_result, (_p, _p, _size, _int, _int, _p, _p)),
    "ncclSend": (_result, (_p, _size, _int, _int, _p, _p)),
    "ncclRecv": (_result, (_p, _size, _int, _int, _p, _p)),
    "ncclGroupStart": (_result, ()),
    "ncclGroupEnd": (_result, ()),
}
# Declared where present (ncclGetLastError: 2.13+); a library without them still loads.
OPTIONAL_SIGNATURES: Dict[str, Tuple[object, Tuple[object, ...]]] = {
    "ncclGetLastError": (ctypes.c_char_p, (_p,)),
    "ncclCommInitRankConfig": (_result, (ctypes.POINTER(_p), _int, NcclUniqueId, _int, ctypes.POINTER(NcclConfig))),
    "ncclCommFinalize": (_result, (_p,)),
}

# Names the system loader is asked for when neither an explicit path nor the wheel gives one.
SYSTEM_NAMES = ("libnccl.so.2", "libnccl.so", "librccl.so.1", "librccl.so")


class NcclUnavailable(RuntimeError):
    """No usable NCCL library: not found, not loadable, missing symbols, or too old (the message says which)."""


class NcclError(RuntimeError):
    """An NCCL call failed.

    Attributes:
        code: the ``ncclResult_t`` value.
        call: the NCCL function that returned it.
    """

    def __init__(self, call: str, code: int, detail: str = ""):
        name = RESULT_NAMES.get(code, f"code {code}")
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))
        self.call, self.code = call, code


def decode_version(code: int) -> Tuple[int, int, int]:
    """``ncclGetVersion``'s integer as ``(major, minor, patch)``: ``major*10000 + minor*100 + patch`` from 2.9 on,
    ``major*1000 + minor*100 + patch`` before."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def version_string(version: Sequence[int]) -> str:
    return ".".join(str(v) for v in version)


def wheel_library() -> Optional[str]:
    """``libnccl.so.2`` from the ``nvidia.nccl`` package of this Python (the wheel GPU builds of torch depend on)."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for root in list(spec.submodule_search_locations or []):
        path = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    return None


def candidates(explicit: str = "") -> List[str]:
    """Where to look, in order (see the module docstring)."""
    if explicit:
        return [explicit]
    found = wheel_library()
    return ([found] if found else []) + list(SYSTEM_NAMES)


class NcclLibrary:
    """A loaded NCCL library with its functions declared.

    Attributes:
        path: what was loaded.
        version: ``(major, minor, patch)``.
    """

    def __init__(self, path: str, deepbind: bool = False):
        # An explicitly named library is loaded with RTLD_DEEPBIND: beside torch's own NCCL in the process, its
        # calls to its own internal symbols must not bind to that other copy's.
        mode = ctypes.DEFAULT_MODE | (getattr(os, "RTLD_DEEPBIND", 0) if deepbind else 0)
        try:
            self._dll = ctypes.CDLL(path, mode=mode)
        except OSError as exc:
            raise NcclUnavailable(f"cannot load NCCL from {path!r}: {exc}") from None
        missing = [name for name in SIGNATURES if not hasattr(self._dll, name)]
        if missing:
            raise NcclUnavailable(f"{path!r} is not an NCCL-compatible library: it lacks {', '.join(missing)}")
        for name, (restype, argtypes) in list(SIGNATURES.items()) + list(OPTIONAL_SIGNATURES.items()):
            if hasattr(self._dll, name):
                fn = getattr(self._dll, name)
                fn.restype, fn.argtypes = restype, list(argtypes)
        self.path = path
        code = _int()
        self.check("ncclGetVersion", self._dll.ncclGetVersion(ctypes.byref(code)))
        self.version = decode_version(code.value)
        if self.version < MIN_VERSION:
            raise NcclUnavailable(f"NCCL {version_string(self.version)} at {path!r} is too old: horovod needs "
                                  f"{version_string(MIN_VERSION)} or newer (ncclSend/ncclRecv)")

    @property
    def version_code(self) -> int:
        """``major*10000 + minor*100 + patch`` (``nccl_built()``'s form, whatever the library's own encoding)."""
        major, minor, patch = self.version
        return major * 10000 + minor * 100 + patch

    @property
    def has_config(self) -> bool:
        """Whether communicators can be created non-blocking (``ncclCommInitRankConfig``, 2.17's config)."""
        return self.version >= CONFIG_VERSION and hasattr(self._dll, "ncclCommInitRankConfig")

    @property
    def implicit_order(self) -> bool:
        """Whether ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` is understood (2.26+)."""
        return self.version >= IMPLICIT_ORDER_VERSION

    @property
    def has_avg(self) -> bool:
        """Whether ``ncclAvg`` (and ``ncclBfloat16``) exist."""
        return self.version >= AVG_VERSION

    def __getattr__(self, name: str):
        if name.startswith("nccl"):
            return getattr(self._dll, name)
        raise AttributeError(name)

    def error_string(self, code: int) -> str:
        raw = self._dll.ncclGetErrorString(code)
        return raw.decode(errors="replace") if raw else RESULT_NAMES.get(code, str(code))

    def last_error(self, comm: Optional[int] = None) -> str:
        if not hasattr(self._dll, "ncclGetLastError"):
            return ""
        raw = self._dll.ncclGetLastError(comm)
        return raw.decode(errors="replace") if raw else ""

    def check(self, call: str, code: int, comm: Optional[int] = None) -> None:
        """Raise :class:`NcclError` for a failed call, with NCCL's own explanation."""
        if code != SUCCESS:
            detail = self.last_error(comm) or self.error_string(code)
            raise NcclError(call, code, detail)


_loaded: Dict[str, NcclLibrary] = {}
_failures: Dict[str, str] = {}


def load(explicit: str = "") -> NcclLibrary:
    """The first loadable library of :func:`candidates` (cached per ``explicit`` path).

    Raises:
        NcclUnavailable: none could be loaded; the message lists every place tried and why it failed.
    """
    if explicit in _loaded:
        return _loaded[explicit]
    if explicit in _failures:
        raise NcclUnavailable(_failures[explicit])
    reasons = []
    for path in candidates(explicit):
        try:
            lib = NcclLibrary(path, deepbind=bool(explicit))
        except NcclUnavailable as exc:
            reasons.append(str(exc))
            continue
        _loaded[explicit] = lib
        return lib
    hint = ("set HOROVOD_NCCL_SO_PATH to the library, or install the NCCL wheel of your CUDA version "
            "(pip install nvidia-nccl-cu12 / nvidia-nccl-cu13)")
    message = "NCCL is not available: " + "; ".join(reasons) + f". To use it, {hint}."
    _failures[explicit] = message
    raise NcclUnavailable(message)


def try_load(explicit: str = "") -> Optional[NcclLibrary]:
    """:func:`load`, or ``None`` when no library can be loaded."""
    try:
        return load(explicit)
    except NcclUnavailable:
        return None


def version_code(explicit: str = "") -> int:
    """``major*10000 + minor*100 + patch`` of the loadable NCCL (``nccl_built()``'s value), 0 when none loads."""
    lib = try_load(explicit)
    if lib is None:
        return 0
    return lib.version_code
