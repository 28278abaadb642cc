"""The NCCL binding where no GPU is needed: finding and refusing libraries, the ctypes declarations against
nccl.h, the version arithmetic, the dtype/op tables and how the ranks of a set choose NCCL or host staging."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re

import numpy as np
import pytest

from horovod.engine import config
from horovod.engine.device_executor import HOST, NCCL, DeviceOptions, choose_mode
from horovod.transport import nccl, nccl_lib
from horovod.transport.nccl_lib import NcclUniqueId, NcclUnavailable

HERE = os.path.dirname(os.path.abspath(__file__))

_INTS = {"int", "ncclDataType_t", "ncclRedOp_t", "ncclResult_t"}


def _ctype(param: str, is_return: bool = False):
    """The ctypes type of one C parameter (or return type) as nccl.h spells it."""
    tokens = [t for t in re.findall(r"\w+|\*", param) if t != "const"]
    if not is_return and len(tokens) > 1 and tokens[-1] != "*":
        tokens = tokens[:-1]                 # drop the parameter's name
    stars = tokens.count("*")
    base = next(t for t in tokens if t != "*")
    if base in _INTS:
        return ctypes.c_int if not stars else ctypes.POINTER(ctypes.c_int)
    if base == "size_t":
        return ctypes.c_size_t
    if base == "char" and stars == 1:
        return ctypes.c_char_p
    if base in ("ncclComm_t", "cudaStream_t"):
        return ctypes.c_void_p if not stars else ctypes.POINTER(ctypes.c_void_p)
    if base == "void" and stars:
        return ctypes.c_void_p
    if base == "ncclUniqueId":
        return NcclUniqueId if not stars else ctypes.POINTER(NcclUniqueId)
    if base == "ncclConfig_t" and stars == 1:
        return ctypes.POINTER(nccl_lib.NcclConfig)
    return param.strip()   # a type horovod does not pass (ncclConfig_t ...): compared as text


def declarations(header: str) -> dict:
    """name -> (restype, argtypes) of every ``nccl*`` function declared in ``header``'s text."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", header, flags=re.S)
    out = {}
    for ret, name, params in re.findall(r"((?:const\s+)?\w+\s*\*?)\s*\b(nccl[A-Z]\w*)\s*\(([^)]*)\)\s*;", text):
        args = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        out[name] = (_ctype(ret, True), tuple(_ctype(a) for a in args))
    return out


def _headers():
    found = [os.path.join(HERE, "data", "nccl_api.h")]
    wheel = nccl_lib.wheel_library()
    if wheel:   # the real header beside the wheel's library (on a GPU machine)
        real = os.path.join(os.path.dirname(os.path.dirname(wheel)), "include", "nccl.h")
        if os.path.exists(real):
            found.append(real)
    return found


@pytest.mark.parametrize("header", _headers(), ids=os.path.basename)
def test_signatures_match_the_header(header):
    with open(header) as f:
        declared = declarations(f.read())
    table = dict(nccl_lib.SIGNATURES, **nccl_lib.OPTIONAL_SIGNATURES)
    missing = sorted(set(table) - set(declared))
    assert not missing, f"{header} does not declare {missing}"
    for name, (restype, argtypes) in table.items():
        assert declared[name] == (restype, tuple(argtypes)), f"{name}: header {declared[name]}, ours {table[name]}"


def test_unique_id_is_128_bytes_passed_by_value():
    assert ctypes.sizeof(NcclUniqueId) == 128
    with pytest.raises(ValueError, match="128 bytes"):
        nccl._id_struct(b"short")


@pytest.mark.parametrize("code, version", [(22805, (2, 28, 5)), (21003, (2, 10, 3)), (2708, (2, 7, 8)),
                                           (23000, (2, 30, 0))])
def test_version_codes(code, version):
    assert nccl_lib.decode_version(code) == version


def test_a_missing_library_is_named_with_what_to_do(tmp_path):
    path = str(tmp_path / "libnccl.so.2")
    with pytest.raises(NcclUnavailable) as info:
        nccl_lib.load(path)
    message = str(info.value)
    assert path in message and "HOROVOD_NCCL_SO_PATH" in message and "nvidia-nccl" in message
    assert nccl_lib.try_load(path) is None and nccl_lib.version_code(path) == 0


def test_a_library_that_is_not_nccl_is_refused():
    libc = ctypes.util.find_library("c")
    with pytest.raises(NcclUnavailable, match="not an NCCL-compatible library: it lacks ncclGetVersion"):
        nccl_lib.NcclLibrary(libc)


def test_search_order(tmp_path):
    explicit = str(tmp_path / "vendor.so")
    assert nccl_lib.candidates(explicit) == [explicit]
    order = nccl_lib.candidates()
    assert order[-len(nccl_lib.SYSTEM_NAMES):] == list(nccl_lib.SYSTEM_NAMES)
    if nccl_lib.wheel_library():
        assert order[0] == nccl_lib.wheel_library()


def test_dtype_and_op_tables():
    # nccl.h's enums
    assert [nccl.DTYPES[d] for d in ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
                                     "float64", "bfloat16")] == list(range(10))
    assert (nccl.SUM, nccl.PROD, nccl.MAX, nccl.MIN, nccl.AVG) == (0, 1, 2, 3, 4)
    assert nccl.reduction_dtype("int16", True) is None and nccl.reduction_dtype("uint16", True) is None
    assert nccl.reduction_dtype("bfloat16", False) is None and nccl.reduction_dtype("bfloat16", True) == 9
    # bool travels as uint8 0/1: sum/max are OR, product/min are AND, as on the CPU transports
    assert nccl.reduction_op("sum", "bool") == nccl.MAX and nccl.reduction_op("product", "bool") == nccl.MIN
    assert nccl.reduction_op("sum", "float32") == nccl.SUM


def _records(rows):
    return np.array(rows, dtype=np.int64)


def test_mode_nccl_when_everyone_can():
    assert choose_mode(_records([[22805, 1, 11, 0], [22805, 1, 12, 0]]), 2) == (NCCL, "")


def test_mode_host_when_asked_or_missing():
    mode, why = choose_mode(_records([[22805, 1, 11, 0], [22805, 0, 12, 0]]), 2)
    assert mode == HOST and "HOROVOD_GPU_OPERATIONS=HOST" in why
    mode, why = choose_mode(_records([[22805, 1, 11, 0], [0, 1, 12, 0], [0, 1, 13, 0]]), 3)
    assert mode == HOST and "set ranks 1, 2" in why


def test_mode_for_ranks_sharing_a_gpu():
    shared = [[22805, 1, 7, 1], [22805, 1, 7, 1], [22805, 1, 9, 1]]
    mode, why = choose_mode(_records(shared), 3)
    assert mode == HOST and "set ranks 0, 1 share one GPU" in why and "NCCL_MULTI_RANK_GPU_ENABLE=1" in why
    allowed = [[23000, 1, 7, 1], [23001, 1, 7, 1]]
    assert choose_mode(_records(allowed), 2)[0] == NCCL
    not_enabled = [[23000, 1, 7, 1], [23001, 1, 7, 0]]
    assert choose_mode(_records(not_enabled), 2)[0] == HOST


def test_knobs_reach_the_device_options():
    cfg = config.load({"HOROVOD_GPU_OPERATIONS": "host", "HOROVOD_NCCL_SO_PATH": "/x/libnccl.so.2",
                       "HOROVOD_NUM_NCCL_STREAMS": "2", "NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert DeviceOptions.from_config(cfg) == DeviceOptions("HOST", "/x/libnccl.so.2", 2, True)
    assert DeviceOptions.from_config(config.load({})) == DeviceOptions("", "", 1, False)


def test_queries_without_a_gpu():
    from horovod.common.basics import cuda_built, nccl_built
    from horovod.runner.launch import check_build_text

    loadable = nccl_lib.try_load(config.load().nccl_so_path) is not None   # as nccl_built() looks it up
    assert (nccl_built() > 0) == loadable
    assert ("[X] NCCL" in check_build_text()) == loadable
    assert isinstance(cuda_built(), bool)


def test_unique_ids_keep_every_byte():
    """An id holds NUL bytes: all 128 must travel (c_char arrays stop at the first NUL)."""
    uid = NcclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), bytes([7, 0, 9]) + bytes(125), 128)
    raw = ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))
    assert len(raw) == 128 and raw[:3] == bytes([7, 0, 9])
    assert bytes(nccl._id_struct(raw)) == raw
