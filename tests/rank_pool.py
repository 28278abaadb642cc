"""Warm ranks: processes started once per test module and reused by every ``run_ranks`` call that fits them.

Starting a rank costs an interpreter, numpy and horovod (~0.3 s of CPU) and, once a test imports it, torch
(~2.3 s) or TensorFlow (~5 s); with np ranks on 2 cores that was most of the suite's time.  A pool keeps np
processes of one interpreter and one import-time environment alive for the test module that started them, and runs
each test's function in them as a fresh subprocess rank would: the job's environment (its rendezvous server,
secret, ``HOROVOD_*`` knobs) is set anew for every call, output goes to the call's files, and after the function
the worker shuts Horovod down, so the next call starts from ``hvd.init()`` like a new process.

What a pool never serves (``run_ranks`` starts fresh processes for it): a call that expects failure, kills,
holds or watches ranks (``expect_failure``, ``on_start``, ``hold``, ``linger``, ``ranks``), another launcher, or
a module that opts out with ``WARM_RANKS = False``.  A pool is thrown away after any call in which a rank failed,
died or timed out, when its cleanup does not finish, and when the next test module starts; so a test that breaks
its ranks on purpose costs the next test a fresh start, never a wrong result.

The wire: the test writes the call's directory on a worker's stdin; the worker reads ``fn.pkl`` and
``env.<rank>.pkl`` from it, writes ``result.<rank>.pkl`` (the same files a fresh rank writes), cleans up and
answers ``ready`` on its stdout.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

# What a warm worker runs: the harness module's loop, which handles one call per line read from stdin.
_WARM_CHILD = r"""
import sys
sys.path.append(sys.argv[1])
import hidden_test_folders
hidden_test_folders.install()
import rank_pool
rank_pool._worker_main()
"""

# Variables that belong to one call, not to the process: they are set per call, so calls that differ only in
# them share a pool.  Everything else is read at import time by some library (OMP_NUM_THREADS, TF_USE_LEGACY_KERAS,
# ...) and so is part of the pool's key.
_PER_CALL_PREFIXES = ("HOROVOD_", "_HOROVOD_", "HVD_TEST_", "PYTEST_")
_CLEANUP_SECONDS = 30.0
# Ranks kept alive at once, over every pool of the module: np = 1, 2, 3 and 4 of one environment (a test
# parametrised over sizes visits them in turn) without a restart; a torch rank holds ~0.4 GB, a TensorFlow one ~0.7.
_MAX_RANKS = 10


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank, self.proc = rank, proc
        self.returncode: Optional[int] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self) -> int:
        """``subprocess.Popen.wait`` for the harness's reaping (the worker is killed first)."""
        if self.returncode is None:
            self.returncode = self.proc.wait()
        return self.returncode

    def exited(self) -> bool:
        return self.proc.poll() is not None


class Pool:
    """np warm workers of one interpreter and import-time environment."""

    def __init__(self, key: tuple, workers: List[_Worker]) -> None:
        self.key, self.workers = key, workers
        self.broken = False
        self.calls = 0

    def procs(self) -> Dict[int, _Worker]:
        return {w.rank: w for w in self.workers}

    def submit(self, job_dir: str, envs: Dict[int, Dict[str, str]]) -> None:
        """Hand every worker the call in ``job_dir`` (``fn.pkl`` is written already)."""
        for w in self.workers:
            with open(os.path.join(job_dir, f"env.{w.rank}.pkl"), "wb") as f:
                pickle.dump(envs[w.rank], f)
        for w in self.workers:
            try:
                w.proc.stdin.write((job_dir + "\n").encode())   # type: ignore[union-attr]
                w.proc.stdin.flush()                            # type: ignore[union-attr]
            except (BrokenPipeError, OSError):
                self.broken = True
        self.calls += 1

    def await_ready(self) -> bool:
        """Wait for every worker's ``ready`` after a call that succeeded; False (pool broken) when one fails."""
        deadline = time.monotonic() + _CLEANUP_SECONDS
        for w in self.workers:
            out = w.proc.stdout
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([out], [], [], left)[0]:
                    return False
                chunk = os.read(out.fileno(), 64)   # type: ignore[union-attr]
                if not chunk:
                    return False
                line += chunk
            if line.strip() != b"ready":
                return False
        return True

    def close(self) -> None:
        for w in self.workers:
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for w in self.workers:
            w.wait()
            for stream in (w.proc.stdin, w.proc.stdout):
                try:
                    stream.close()   # type: ignore[union-attr]
                except OSError:
                    pass


_pools: Dict[tuple, Pool] = {}
_module: Optional[str] = None


def current_module() -> Optional[str]:
    """The test file of the running test (pytest's ``PYTEST_CURRENT_TEST``), or None outside a test."""
    nodeid = os.environ.get("PYTEST_CURRENT_TEST")
    return nodeid.split("::", 1)[0] if nodeid else None


def _module_opts_out(module_path: str) -> bool:
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) and os.path.abspath(mod.__file__).endswith(module_path) \
                and getattr(mod, "WARM_RANKS", True) is False:
            return True
    return False


def pool_for(np: int, python: str, envs: Dict[int, Dict[str, str]], start: Callable[[int, Dict[str, str]],
                                                                                     subprocess.Popen]
             ) -> Optional[Pool]:
    """The pool for this call (started on first use), or None where calls are not pooled (outside pytest, or
    the module opted out)."""
    global _module
    if os.environ.get("HVD_TEST_WARM_RANKS", "1") == "0":
        return None
    module = current_module()
    if module is None or _module_opts_out(module):
        return None
    if module != _module:
        close_all()
        _module = module
    key = (np, python, tuple(tuple(sorted((k, v) for k, v in envs[r].items()
                                         if not k.startswith(_PER_CALL_PREFIXES))) for r in range(np)))
    pool = _pools.pop(key, None)
    if pool is not None:
        _pools[key] = pool   # the most recently used last
    if pool is not None and (pool.broken or any(w.exited() for w in pool.workers)):
        discard(pool)
        pool = None
    if pool is None:
        while _pools and sum(len(p.workers) for p in _pools.values()) + np > _MAX_RANKS:
            discard(next(iter(_pools.values())))   # the least recently used
        pool = Pool(key, [_Worker(r, start(r, envs[r])) for r in range(np)])
        _pools[key] = pool
    return pool


def discard(pool: Pool) -> None:
    _pools.pop(pool.key, None)
    pool.close()


def close_all() -> None:
    for pool in list(_pools.values()):
        discard(pool)


def live_cpu_seconds() -> float:
    """CPU time of the warm workers still running (reaped ones count in the test process's children's time)."""
    total = 0
    for pool in _pools.values():
        for w in pool.workers:
            try:
                with open(f"/proc/{w.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])   # utime, stime
            except (OSError, IndexError, ValueError):
                pass
    return total / os.sysconf("SC_CLK_TCK")


def spawn(python: str, tests_dir: str, env: Dict[str, str], preexec_fn: Optional[Callable[[], None]]
          ) -> subprocess.Popen:
    """Start one warm worker (its own session, so a kill takes whatever it started)."""
    return subprocess.Popen([python, "-c", _WARM_CHILD, tests_dir], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=preexec_fn)


# -------------------------------------------------------------------------------------------- inside a worker

def _worker_main() -> None:
    """Serve calls until stdin closes: each one as a fresh rank would run it, then clean up and say ``ready``."""
    import warnings

    import multiproc

    control = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    stdin = os.fdopen(0, "rb", buffering=0)
    filters = list(warnings.filters)
    while True:
        line = stdin.readline()
        if not line:
            os._exit(0)
        job_dir = line.decode().strip()
        rank = int(os.environ["HOROVOD_RANK"])
        with open(os.path.join(job_dir, f"env.{rank}.pkl"), "rb") as f:
            env = pickle.load(f)
        os.environ.clear()
        os.environ.update(env)
        _redirect_output(os.path.join(job_dir, f"out.{rank}.txt"))
        # A warning shown by an earlier call would be shown once only: start each call with the original filters
        # and empty once-registries, as a new process has.
        warnings.filters[:] = filters
        getattr(warnings, "_filters_mutated", lambda: None)()
        ok = multiproc._run_call(job_dir)
        if not ok:
            os._exit(1)
        _clean_up()
        _redirect_output(os.devnull)
        control.write(b"ready\n")


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _clean_up() -> None:
    """Leave the process as a new rank would find it: no engine, call numbering from the start."""
    basics = sys.modules.get("horovod.common.basics")
    if basics is not None:
        basics.shutdown()
        basics.set_generation(0)


def pooled_kwargs_ok(launcher: str, expect_failure: bool, ranks: Optional[Sequence[int]], hold: Sequence[int],
                     on_start: Any, linger: bool) -> bool:
    """Whether a ``run_ranks`` call may run in warm workers (see the module docstring)."""
    return (launcher == "subprocess" and not expect_failure and ranks is None and not hold and on_start is None
            and not linger)

