"""Several real hosts on this machine for a benchmark: the test suite's network-namespace cluster, reused.

The cluster itself (namespaces on a bridge, an address, host name and sshd per host, throwaway keys, an ``ssh``
wrapper, teardown) is ``tests/runner/netns/cluster.py``: the fixture ``tests/runner/test_ssh_hosts.py`` runs
horovodrun across.  A benchmark runs from a checkout (it imports this checkout's ``horovod``), so that file is
always beside it; it is loaded here by its path under a name of its own (``tests/`` is no package, and a plain
``import cluster`` could pick up another module of that name), not copied.  It needs nothing but the standard
library.  What is here on top: starting a command on a host over ssh from the driver's namespace, and killing
what a job left on the hosts.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Iterator, List, Mapping, Sequence

from benchmarks._lib.launch import REPO

FIXTURE = os.path.join(REPO, "tests", "runner", "netns", "cluster.py")
_MODULE = "_hvd_bench_netns_cluster"


def fixture() -> ModuleType:
    """The module ``tests/runner/netns/cluster.py`` (``NetnsCluster``, ``ensure_tools``, ``ClusterUnavailable``).

    Raises:
        FileNotFoundError: the checkout has no such file (a copy of ``benchmarks/`` alone).
    """
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    if not os.path.exists(FIXTURE):
        raise FileNotFoundError(f"--hosts needs the checkout's network-namespace fixture {FIXTURE}")
    spec = importlib.util.spec_from_file_location(_MODULE, FIXTURE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module   # before running it: its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE]
        raise
    return module


@contextlib.contextmanager
def cluster(hosts: int) -> Iterator:
    """``hosts`` namespace hosts (hostA, hostB, ...; sshd on each) up for the ``with`` block, always torn down.

    Raises:
        the fixture's ``ClusterUnavailable``: this machine cannot host them (not root, no ip/sshd); says why.
    """
    mod = fixture()
    mod.ensure_tools()
    workdir = tempfile.mkdtemp(prefix="hvd-bench-hosts-")
    fake = None
    try:
        fake = mod.NetnsCluster(Path(workdir), hosts=hosts).up()   # up() tears down what it made if it fails
        yield fake
    finally:
        if fake is not None:
            fake.down()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def ssh_options(fake) -> List[str]:
    """The ssh client options that reach a host of ``fake`` without a prompt (port, key, no host-key check)."""
    return [*fake.ssh_flags(), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]


def ssh_argv(fake, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str = REPO) -> List[str]:
    """``argv`` started on ``host`` over ssh from the driver's namespace, in ``cwd``, with exactly the variables of
    the ssh session (sshd's: a fresh login's) plus ``env``: as a user who logs into a node and starts a command."""
    remote = f"cd {shlex.quote(cwd)} && exec env " + " ".join(
        shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + shlex.join(argv)
    return fake.in_driver([str(fake.bin / "ssh"), *ssh_options(fake), host, remote])


def kill_leftovers(fake, marker: str) -> List[int]:
    """SIGKILL every process on the hosts whose command line contains ``marker`` (a job's spec path): a remote
    process whose ssh session ended does not always end with it. Returns the pids killed."""
    killed = []
    for name in fake.hosts:
        for pid in fake.host_pids_running(name, marker):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed
