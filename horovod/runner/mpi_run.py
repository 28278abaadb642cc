"""The ``mpirun`` command line behind ``horovodrun --mpi``: pure functions, no process is started here.

Three families are told apart by ``mpirun --version``: Open MPI (and IBM Spectrum MPI, which is built on it),
MPICH-style Hydra launchers (MPICH, MVAPICH) and Intel MPI (also Hydra, different host syntax).

Open MPI 5 notes (checked with Open MPI 5.0.11 from PyPI): its PRRTE launcher no longer accepts the single-dash long
options ``-bind-to``, ``-map-by`` and ``-rank-by`` (``-bind-to none`` even makes ``none`` the program to run), so the
builder writes them with two dashes, which every Open MPI since 1.x accepts, and rewrites them in user-supplied
arguments; ``--output-filename <dir>`` became ``--output file=<prefix>``; the ``openib`` BTL is gone, so TCP-only
means naming the BTLs (``self,sm,tcp``) rather than excluding ``openib``.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

OPENMPI, SPECTRUM, MPICH, INTEL = "openmpi", "spectrum", "mpich", "intel"
UNKNOWN, MISSING = "unknown", "missing"
OPENMPI_FAMILY = (OPENMPI, SPECTRUM)
HYDRA_FAMILY = (MPICH, INTEL)

# Horovod's documented default; written with two dashes (see the module docstring).
DEFAULT_BINDING_ARGS = {OPENMPI: "--bind-to none --map-by slot", SPECTRUM: "--bind-to none --map-by slot",
                        MPICH: "-bind-to none", INTEL: ""}

# Single-dash spellings Open MPI 5 rejects, and the spelling every Open MPI accepts.
_OPENMPI_LONG_OPTIONS = {"-bind-to": "--bind-to", "-map-by": "--map-by", "-rank-by": "--rank-by"}


@dataclass(frozen=True)
class MpiImplementation:
    """What ``mpirun --version`` said.

    Attributes:
        name: ``openmpi``, ``spectrum``, ``mpich``, ``intel``, ``unknown`` (unrecognised output) or ``missing``
            (no such executable).
        version: the version numbers found, e.g. ``(5, 0, 11)``; None when not found.
        text: the raw output, for error messages.
    """

    name: str
    version: Optional[Tuple[int, ...]] = None
    text: str = ""


def _version(match: Optional[re.Match]) -> Optional[Tuple[int, ...]]:
    return tuple(int(p) for p in match.group(1).split(".") if p.isdigit()) if match else None


def parse_mpi_version_output(text: str) -> MpiImplementation:
    """Recognise the MPI implementation from the output of ``mpirun --version``.

    Args:
        text: stdout and stderr of ``mpirun --version``.

    Returns:
        The implementation; ``name == 'unknown'`` when nothing matched.
    """
    if re.search(r"Intel\(R\) MPI Library|Intel MPI", text):
        return MpiImplementation(INTEL, _version(re.search(r"Version\s+(\d+(?:\.\d+)*)", text)), text)
    if "IBM Spectrum MPI" in text:
        return MpiImplementation(SPECTRUM, _version(re.search(r"Spectrum MPI\)?\s+(\d+(?:\.\d+)*)", text)), text)
    if re.search(r"\((?:Open MPI|OpenRTE)\)", text) or "Open MPI" in text:
        return MpiImplementation(OPENMPI, _version(re.search(r"\((?:Open MPI|OpenRTE)\)\s+(\d+(?:\.\d+)*)", text)),
                                 text)
    if "HYDRA" in text or "MPICH" in text or "MVAPICH" in text:
        return MpiImplementation(MPICH, _version(re.search(r"Version:\s+(\d+(?:\.\d+)*)", text)), text)
    return MpiImplementation(UNKNOWN, None, text)


def detect_mpi(mpirun: str = "mpirun", timeout: float = 10.0) -> MpiImplementation:
    """Run ``<mpirun> --version`` (bounded by ``timeout`` seconds) and recognise the implementation.

    Returns:
        The implementation; ``missing`` if the executable is not found, ``unknown`` if it fails, hangs or prints
        something unrecognised.
    """
    try:
        proc = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return MpiImplementation(MISSING, None, f"{mpirun}: not found")
    except (subprocess.TimeoutExpired, OSError) as exc:
        logger.warning("%s --version failed: %s", mpirun, exc)
        return MpiImplementation(UNKNOWN, None, str(exc))
    return parse_mpi_version_output(proc.stdout or "")


def detect_mpi_implementation(mpirun: str = "mpirun", timeout: float = 10.0) -> str:
    """The name of the MPI implementation behind ``mpirun`` (see :class:`MpiImplementation`)."""
    return detect_mpi(mpirun, timeout).name


def normalize_openmpi_args(args: Sequence[str]) -> List[str]:
    """Rewrite ``-bind-to``/``-map-by``/``-rank-by`` to their two-dash form, which Open MPI 5 requires."""
    out = []
    for arg in args:
        fixed = _OPENMPI_LONG_OPTIONS.get(arg, arg)
        if fixed != arg:
            logger.debug("mpirun argument %s rewritten as %s", arg, fixed)
        out.append(fixed)
    return out


def hostfile_text(hosts: Sequence[Tuple[str, int]]) -> str:
    """A Hydra (MPICH / Intel MPI) machine file: one ``host:slots`` line per host, for ``-f``."""
    return "".join(f"{host}:{slots}\n" for host, slots in hosts)


def _is_openmpi5(impl: str, version: Optional[Tuple[int, ...]]) -> bool:
    # Spectrum MPI numbers its releases 10.x but is built on Open MPI 3/4.
    return impl == OPENMPI and (version is None or version[0] >= 5)


def tcp_args(impl: str, version: Optional[Tuple[int, ...]] = None) -> List[str]:
    """Arguments that keep MPI traffic on TCP (and shared memory inside a host), for ``--tcp``."""
    if impl in OPENMPI_FAMILY:
        if _is_openmpi5(impl, version):
            return ["--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp"]
        return ["--mca", "pml", "ob1", "--mca", "btl", "^openib"]
    if impl == INTEL:
        return ["-genv", "I_MPI_FABRICS", "shm:ofi", "-genv", "FI_PROVIDER", "tcp"]
    if impl == MPICH:
        return ["-genv", "FI_PROVIDER", "tcp"]   # ch4:ofi builds; ch3/ucx builds ignore it
    return []


def build_mpirun_command(impl: str, np: int, hosts: Sequence[Tuple[str, int]], command: Sequence[str],
                         env_names: Sequence[str] = (), mpi_args: Optional[str] = None,
                         binding_args: Optional[str] = None, tcp: bool = False,
                         output_filename: Optional[str] = None, as_root: bool = False, *,
                         version: Optional[Tuple[int, ...]] = None, mpirun: str = "mpirun",
                         nics: Sequence[str] = (), hostfile: Optional[str] = None,
                         tag_output: bool = True) -> List[str]:
    """The argv that starts ``command`` on ``np`` ranks with the given MPI implementation.

    Args:
        impl: ``openmpi``, ``spectrum``, ``mpich`` or ``intel`` (see :func:`detect_mpi`).
        np: number of processes.
        hosts: ``(hostname, slots)`` pairs; empty means ``localhost`` with ``np`` slots.
        command: the program and its arguments.
        env_names: environment variables to forward; their values are taken from mpirun's own environment,
            so the caller sets them there (Open MPI ``-x NAME``, Hydra ``-genvlist``).
        mpi_args: extra mpirun arguments (``--mpi-args``), split like a shell would.
        binding_args: process binding (``--binding-args``); None uses :data:`DEFAULT_BINDING_ARGS`, ``""`` none.
        tcp: keep MPI on TCP (``--tcp``), see :func:`tcp_args`.
        output_filename: directory for per-rank output (``--output-filename``).  Open MPI 4 writes
            ``<dir>/1/rank.N/stdout``; Open MPI 5 writes ``<dir>/rank.<job>.N.out`` and ``.err``; Hydra writes
            ``<dir>/rank.N.stdout`` and ``.stderr`` into an existing directory.
        as_root: we run as root (Open MPI refuses without ``--allow-run-as-root``).
        version: the implementation's version (from :func:`detect_mpi`); None means the current major release.
        mpirun: the launcher executable.
        nics: network interfaces MPI may use (``--network-interfaces``).
        hostfile: a Hydra machine file (see :func:`hostfile_text`); required by Intel MPI when hosts have
            different slot counts.
        tag_output: prefix each output line with the rank (``--tag-output`` / ``-l``).

    Returns:
        The argument vector, ``mpirun`` first.

    Raises:
        ValueError: an unknown implementation, ``np < 1``, a bad host, or heterogeneous hosts for Intel MPI
            without a hostfile.
    """
    if np < 1:
        raise ValueError(f"np={np}: expected at least one process")
    if not command:
        raise ValueError("command is empty: expected the program to run on every rank")
    hosts = list(hosts) or [("localhost", np)]
    for host, slots in hosts:
        if not host or int(slots) < 1:
            raise ValueError(f"host {host!r} with {slots} slots: expected a hostname and at least one slot")
    slots_total = sum(int(s) for _, s in hosts)
    binding = shlex.split(DEFAULT_BINDING_ARGS.get(impl, "") if binding_args is None else binding_args)
    extra = shlex.split(mpi_args) if mpi_args else []

    if impl in OPENMPI_FAMILY:
        cmd = [mpirun]
        if as_root:
            cmd.append("--allow-run-as-root")
        if tag_output:
            cmd.append("--tag-output")
        cmd += ["-np", str(np), "-H", ",".join(f"{h}:{s}" for h, s in hosts)]
        if np > slots_total:
            cmd.append("--oversubscribe")
        cmd += normalize_openmpi_args(binding)
        if tcp:
            cmd += tcp_args(impl, version)
        if nics:
            cmd += ["--mca", "btl_tcp_if_include", ",".join(nics)]
        if output_filename:
            if _is_openmpi5(impl, version):
                cmd += ["--output", f"file={os.path.join(output_filename, 'rank')}"]
            else:
                cmd += ["--output-filename", output_filename]
        for name in env_names:
            cmd += ["-x", name]
        cmd += normalize_openmpi_args(extra)
        return cmd + list(command)

    if impl in HYDRA_FAMILY:
        cmd = [mpirun]
        if tag_output:
            cmd.append("-l")
        cmd += ["-n", str(np)]
        if hostfile:
            cmd += ["-f", hostfile]
        elif len({int(s) for _, s in hosts}) == 1:
            cmd += ["-hosts", ",".join(h for h, _ in hosts), "-ppn", str(int(hosts[0][1]))]
        elif impl == MPICH:
            cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)]
        else:
            raise ValueError(f"Intel MPI cannot take per-host slot counts on the command line (hosts {hosts}); "
                             f"write hostfile_text(hosts) to a file and pass it as hostfile=")
        cmd += binding
        if tcp:
            cmd += tcp_args(impl, version)
        if nics:
            cmd += ["-iface", nics[0]]
        if output_filename:
            cmd += ["-outfile-pattern", os.path.join(output_filename, "rank.%r.stdout"),
                    "-errfile-pattern", os.path.join(output_filename, "rank.%r.stderr")]
        if env_names:
            cmd += ["-genvlist", ",".join(env_names)]
        cmd += extra
        return cmd + list(command)

    raise ValueError(f"cannot build an mpirun command for MPI implementation {impl!r}: expected one of "
                     f"{OPENMPI_FAMILY + HYDRA_FAMILY}; check `mpirun --version`, or use the built-in launcher "
                     f"(horovodrun --gloo)")
