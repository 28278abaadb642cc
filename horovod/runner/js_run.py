"""``horovodrun --jsrun``: launch through ``jsrun`` on an LSF cluster (IBM Spectrum MPI), as the original did.

Inside an LSF job, the hosts and their slots come from ``LSB_MCPU_HOSTS`` (``host slots host slots ...``; launch
and login nodes — names starting with ``batch`` or ``login`` — run no ranks), unless ``-H``/``--hostfile`` says
otherwise; ``-np`` defaults to every slot. The layout is written to an *explicit resource file* (ERF): one line per
rank naming its host and the logical CPU it may use, and the job runs as

    jsrun --erf_input <file> [--smpiargs "<--mpi-args>"] [--stdio_stdout/--stdio_stderr <--output-filename>] cmd

with the launcher's environment plus the knob variables. The ranks are MPI processes: ``hvd.init()`` finds MPI
(mpi4py) and runs over it. No LSF cluster exists on this project's machines: the tests put a stand-in ``jsrun``
on ``PATH`` that reads the ERF and starts the ranks with Open MPI's ``mpirun``.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence

from horovod.runner.exec import FAILURE_HEADLINE, JobFailedError, LaunchNotAvailableError, WorkerExit
from horovod.runner.hosts import HostInfo, SlotInfo, get_host_assignments

logger = logging.getLogger(__name__)

_LAUNCH_NODE_PREFIXES = ("batch", "login")


def lsf_hosts(env: Mapping[str, str]) -> List[HostInfo]:
    """The compute hosts of the current LSF job and their slots, from ``LSB_MCPU_HOSTS``.

    Raises:
        ValueError: not inside an LSF job, or the variable is malformed.
    """
    raw = env.get("LSB_MCPU_HOSTS", "").split()
    if not raw:
        raise ValueError("--jsrun needs an LSF job (LSB_MCPU_HOSTS is not set): run horovodrun inside a bsub "
                         "allocation, or give the hosts with -H")
    if len(raw) % 2:
        raise ValueError(f"LSB_MCPU_HOSTS should alternate host names and slot counts, got {' '.join(raw)!r}")
    hosts = []
    for name, slots in zip(raw[0::2], raw[1::2]):
        if name.startswith(_LAUNCH_NODE_PREFIXES):
            continue
        try:
            hosts.append(HostInfo(name, int(slots)))
        except ValueError:
            raise ValueError(f"LSB_MCPU_HOSTS: {slots!r} is not a slot count (for host {name})") from None
    if not hosts:
        raise ValueError(f"LSB_MCPU_HOSTS lists no compute host (only launch nodes): {' '.join(raw)!r}")
    return hosts


def erf_lines(slots: Sequence[SlotInfo]) -> List[str]:
    """The explicit resource file: each rank on its host, pinned to the logical CPU of its local rank."""
    lines = ["overlapping_rs: allow", "cpu_index_using: logical"]
    lines += [f"rank: {s.rank}: {{ hostname: {s.hostname}; cpu: {{{s.local_rank}}} ; mem: * }}" for s in slots]
    return lines


def jsrun_command(erf_path: str, command: Sequence[str], mpi_args: Optional[str] = None,
                  output_filename: Optional[str] = None, binding_args: Optional[str] = None) -> List[str]:
    """The ``jsrun`` argv (``--binding-args`` replace the ERF, as in the original)."""
    argv = ["jsrun"]
    argv += shlex.split(binding_args) if binding_args else ["--erf_input", erf_path]
    if mpi_args:
        argv += ["--smpiargs", mpi_args]
    if output_filename:
        argv += ["--stdio_stdout", output_filename, "--stdio_stderr", output_filename]
    return argv + list(command)


def run_jsrun(args: Any, parent_env: Mapping[str, str], knob_env: Dict[str, str],
              hosts: Optional[List[HostInfo]] = None) -> None:
    """Run ``args.command`` through ``jsrun`` and wait for it.

    Args:
        hosts: from ``-H``/``--hostfile``; the LSF job's hosts when ``None``.

    Raises:
        LaunchNotAvailableError: ``jsrun`` is not installed.
        ValueError: no LSF job and no ``-H``, or more processes than slots.
        JobFailedError: the job exited non-zero.
    """
    if shutil.which("jsrun", path=parent_env.get("PATH")) is None:
        raise LaunchNotAvailableError("--jsrun: jsrun is not on PATH (it comes with LSF and IBM Spectrum MPI); use "
                                      "--mpi or the built-in controller (--gloo) instead")
    if hosts is None:
        hosts = lsf_hosts(parent_env)
    num_proc = args.num_proc or sum(h.slots for h in hosts)
    slots = get_host_assignments(hosts, num_proc)
    env = dict(parent_env)
    env.update(knob_env)
    with tempfile.TemporaryDirectory(prefix="hvd-jsrun-") as tmp:
        erf = os.path.join(tmp, "ranks.erf")
        with open(erf, "w", encoding="utf-8") as f:
            f.write("\n".join(erf_lines(slots)) + "\n")
        argv = jsrun_command(erf, args.command, getattr(args, "mpi_args", None),
                             getattr(args, "output_filename", None), getattr(args, "binding_args", None))
        logger.info("running: %s", shlex.join(argv))
        code = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise JobFailedError(WorkerExit(-1, "jsrun", code),
                             details=f"jsrun exited with {code}; {FAILURE_HEADLINE.split(',')[0].lower()} "
                                     f"(jsrun's own output above names the rank)")
