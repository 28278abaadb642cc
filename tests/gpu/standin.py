"""The stand-in NCCL (``standin_nccl/nccl_standin.c``), compiled once per source version with the system's C
compiler, and what the CPU tests of the NCCL path share: its environment and its call logs.

A test that needs it calls :func:`library` (skipped with the reason when there is no C compiler) and runs its ranks
with :func:`env`; the ranks hand the engine device arrays of
:class:`emulated_device.NcclHostBackend` (``tests/conformance/emulated_device.py``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "standin_nccl", "nccl_standin.c")

_DECOY = "int standinIdentity(void) { return 2; }\n"


def compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build(name: str, source_text: str, extra: List[str]) -> str:
    cc = compiler()
    if cc is None:
        import pytest

        pytest.skip("no C compiler (cc) to build the stand-in NCCL; install gcc or clang")
    digest = hashlib.sha256(source_text.encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"hvd-standin-nccl-{digest}-{os.getuid()}")
    target = os.path.join(folder, name)
    if os.path.exists(target):
        return target
    os.makedirs(folder, exist_ok=True)
    src = os.path.join(folder, name + ".c")
    with open(src, "w") as f:
        f.write(source_text)
    partial = f"{target}.{os.getpid()}.tmp"
    result = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", partial, src] + extra, capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the stand-in NCCL with {cc} failed:\n{result.stderr}")
    os.replace(partial, target)
    return target


def library() -> str:
    """The path of the compiled stand-in ``libnccl.so.2``."""
    with open(SOURCE) as f:
        return _build("libnccl.so.2", f.read(), ["-lm"])


def decoy() -> str:
    """A library that exports one of the stand-in's internal symbols with another value (RTLD_DEEPBIND's test)."""
    return _build("libdecoy.so", _DECOY, [])


def env(folder: str, **extra: str) -> Dict[str, str]:
    """The ranks' environment: the stand-in loaded as NCCL, its exchange and logs in ``folder``."""
    out = {"HOROVOD_NCCL_SO_PATH": library(), "STANDIN_NCCL_DIR": str(folder), "STANDIN_NCCL_WAIT": "60"}
    out.update({k: str(v) for k, v in extra.items()})
    return out


def calls(folder: str, rank: int) -> List[List[str]]:
    """Rank ``rank``'s recorded calls, each line split into words."""
    with open(os.path.join(str(folder), f"calls.{rank}.log")) as f:
        return [line.split() for line in f if line.strip()]


def sequences(folder: str, rank: int, kinds=("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                                             "ncclReduceScatter")) -> Dict[str, List[str]]:
    """Per communicator, the collectives rank ``rank`` called on it, in order, as ``"call count dtype op"``."""
    out: Dict[str, List[str]] = {}
    for words in calls(folder, rank):
        if len(words) > 2 and words[2] in kinds:
            fields = dict(w.split("=", 1) for w in words[3:] if "=" in w)
            out.setdefault(words[0], []).append(f"{words[2]} {fields['count']} {fields['dtype']} {fields['op']}")
    return out
