"""The one multi-process test harness: run a function on N real ranks and collect what each returned.

``run_ranks(fn, np)`` starts a real rendezvous server and ``np`` ranks with exactly the environment
``horovodrun`` gives its workers, runs ``fn(*args)`` in each and returns the per-rank results.  Three launchers:

- ``subprocess`` (default): a fresh interpreter per rank (``python=`` picks another venv's), ``fn`` shipped with
  cloudpickle;
- ``fork``: the test process forks the ranks (fast; ``args`` are passed as they are, queues and events work);
- ``mpirun``: ``mpirun -np N`` starts the ranks (Open MPI's environment instead of Horovod's ``HOROVOD_*``).

Every rank writes its outcome to a file in a private directory, so all launchers report the same way.  If a rank
raises, the test fails with its traceback (errors before deaths); if the job does not finish within ``timeout``
seconds, every rank's process group is killed and the test fails with their output.  Inside a rank,
:func:`report` sends a message to the test (:meth:`Job.messages`) and :func:`bootstrap` / :func:`open_transport`
connect a bare transport through the job's rendezvous server.
"""
from __future__ import annotations

import glob
import logging
import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import cloudpickle

import rank_pool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
_DIR_VAR = "HVD_TEST_JOB_DIR"  # where a rank finds its function and writes its outcome and messages
_HOLD_VAR = "HVD_TEST_HOLD"    # "1": wait for Job.release() before running fn
_LINGER_VAR = "HVD_TEST_LINGER"

# What a subprocess / mpirun rank runs: load (fn, args), hand over to the same code a forked rank runs.
_CHILD = r"""
import sys
sys.path.append(sys.argv[2])
import hidden_test_folders
hidden_test_folders.install()
import multiproc
multiproc._rank_main(None)
"""


class RankFailed(AssertionError):
    """A rank raised; carries its traceback text."""


class Outcome:
    """What one rank ended with.  Unpacks as ``(status, value)``.

    ``status``: ``ok`` (``value`` is what ``fn`` returned), ``error`` (``value`` is the traceback text and
    ``error`` a dict of ``type``, ``message``, ``peer``, ``traceback``) or ``died`` (exited without an outcome).
    """

    def __init__(self, rank: int, status: str, value: Any, error: Optional[dict], exitcode: Optional[int],
                 output: str) -> None:
        self.rank, self.status, self.value, self.error, self.exitcode, self.output = (rank, status, value, error,
                                                                                        exitcode, output)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.status, self.value))

    def __getitem__(self, i: int) -> Any:
        return (self.status, self.value)[i]

    def __repr__(self) -> str:
        return f"Outcome(rank={self.rank}, status={self.status!r}, exitcode={self.exitcode}, value={self.value!r})"


# -------------------------------------------------------------------------------------------- inside a rank

def rank_and_size() -> Tuple[int, int]:
    """This rank and the job's size, from Horovod's or Open MPI's environment."""
    env = os.environ
    if "HOROVOD_RANK" in env:
        return int(env["HOROVOD_RANK"]), int(env["HOROVOD_SIZE"])
    return int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])


def report(msg: Any) -> None:
    """From inside a rank: hand ``msg`` to the test process (read with :meth:`Job.messages`)."""
    rank, _ = rank_and_size()
    job_dir = os.environ[_DIR_VAR]
    path = os.path.join(job_dir, f"msg.{rank}.{time.monotonic_ns()}")
    with open(path + ".tmp", "wb") as f:
        cloudpickle.dump(msg, f)
    os.rename(path + ".tmp", path)


def bootstrap(scope: str = "test", options: Optional[dict] = None, timeout: float = 10.0):
    """From inside a ``run_ranks`` rank: a transport ``Bootstrap`` through the job's rendezvous server."""
    from horovod.transport.base import Bootstrap
    from horovod.transport.rendezvous import RendezvousClient

    env = os.environ
    rank, size = rank_and_size()
    secret = bytes.fromhex(env["_HOROVOD_SECRET_KEY"])
    store = RendezvousClient(env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]), secret,
                             timeout=timeout)
    return Bootstrap(rank, size, local_rank=int(env["HOROVOD_LOCAL_RANK"]), local_size=int(env["HOROVOD_LOCAL_SIZE"]),
                     store=store, secret=secret, timeout=timeout, scope=scope, options=dict(options or {}))


def open_transport(name: str, scope: str = "test", options: Optional[dict] = None, timeout: float = 10.0):
    """From inside a rank: a connected transport ``name`` (tcp, shm...) over the job's ranks."""
    import importlib

    from horovod.transport.base import REGISTRY

    boot = bootstrap(scope, options, timeout)
    importlib.import_module(f"horovod.transport.{name}")  # registers the factory
    return REGISTRY[name](boot)


def with_transport(fn: Callable, name: str = "tcp", scope: str = "test", options: Optional[dict] = None,
                   timeout: float = 10.0) -> Callable:
    """``fn(transport, *args)`` as a ``run_ranks`` function: connects first, closes afterwards."""
    def job(*args):
        t = open_transport(name, scope, options, timeout)
        try:
            return fn(t, *args)
        finally:
            t.close()

    return job


def _wait_for(path: str, what: str) -> None:
    deadline = time.monotonic() + 600
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the test never released this rank")
        time.sleep(0.01)


def _rank_main(fn_args: Optional[Tuple[Callable, tuple]]) -> None:
    """Run the rank's function, write its outcome and exit (``fn_args`` is given by a fork, loaded otherwise)."""
    job_dir = os.environ[_DIR_VAR]
    ok = _run_call(job_dir, fn_args)
    if os.environ.get(_LINGER_VAR) == "1":
        rank, _ = rank_and_size()
        _wait_for(os.path.join(job_dir, "done"), f"lingering rank {rank}")
    if not ok:
        # A non-zero exit also makes mpirun end the job: the other ranks may wait in a collective forever.
        os._exit(1)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)  # no atexit handlers: a framework's threads must not keep a finished rank alive


def _run_call(job_dir: str, fn_args: Optional[Tuple[Callable, tuple]] = None) -> bool:
    """Run one call's function on this rank and write its outcome file; True when it returned."""
    rank, _ = rank_and_size()
    try:
        if fn_args is None:
            with open(os.path.join(job_dir, "fn.pkl"), "rb") as f:
                fn_args = cloudpickle.load(f)
        fn, args = fn_args
        if os.environ.get(_HOLD_VAR) == "1":
            _wait_for(os.path.join(job_dir, "release"), f"held rank {rank}")
        outcome: tuple = ("ok", fn(*args), None)
    except BaseException as exc:  # noqa: BLE001  (everything goes to the test, nothing is swallowed)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        outcome = ("error", text, {"type": type(exc).__name__, "message": str(exc),
                                   "peer": getattr(exc, "peer", None), "traceback": text})
    path = os.path.join(job_dir, f"result.{rank}.pkl")
    try:
        with open(path + ".tmp", "wb") as f:
            cloudpickle.dump(outcome, f)
    except Exception as exc:  # noqa: BLE001  (an unpicklable result must still be reported)
        with open(path + ".tmp", "wb") as f:
            cloudpickle.dump(("error", f"rank {rank}: the result cannot be pickled: {exc!r}", None), f)
        outcome = ("error",)
    os.rename(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    return outcome[0] == "ok"


# ------------------------------------------------------------------------------------------ the test side

def rank_env(rank: int, size: int, addr: str, port: int, secret: bytes, extra: Optional[Dict[str, str]] = None,
             hosts: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """The environment horovodrun gives worker ``rank`` (all on one host unless ``hosts`` is given)."""
    hosts = list(hosts) if hosts else ["localhost"] * size
    host = hosts[rank]
    local_ranks = [r for r in range(size) if hosts[r] == host]
    local_rank = local_ranks.index(rank)
    host_order = list(dict.fromkeys(hosts))
    cross = [h for h in host_order if sum(1 for r in range(size) if hosts[r] == h) > local_rank]
    env = _base_env()
    env.update({
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(len(local_ranks)),
        "HOROVOD_CROSS_RANK": str(cross.index(host)), "HOROVOD_CROSS_SIZE": str(len(cross)),
        "HOROVOD_HOSTNAME": host,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "_HOROVOD_SECRET_KEY": secret.hex(),
    })
    env.update(extra or {})
    return env


def _base_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "PMIX_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, env.get("PYTHONPATH", "")])
    return env


class _Forked:
    """A forked rank, with the part of ``subprocess.Popen``'s interface the harness uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class Job:
    """A running job, as ``on_start`` sees it."""

    def __init__(self, job_dir: str, server, procs: Dict[int, Any]) -> None:
        self.dir, self.server, self.procs = job_dir, server, procs
        self._seen: set = set()

    def release(self) -> None:
        """Let the ranks held with ``hold=`` run their function."""
        open(os.path.join(self.dir, "release"), "w").close()

    def kill(self, rank: int) -> None:
        """SIGKILL one rank (no cleanup, like a crash)."""
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def messages(self, count: int, timeout: float = 60.0) -> List[Tuple[int, Any]]:
        """Wait for ``count`` new :func:`report` messages; returns ``(rank, msg)`` in arrival order."""
        deadline = time.monotonic() + timeout
        while True:
            new = sorted((int(p.split(".")[-1]), p) for p in glob.glob(os.path.join(self.dir, "msg.*"))
                         if not p.endswith(".tmp") and p not in self._seen)
            if len(new) >= count:
                out = []
                for _, path in new[:count]:
                    self._seen.add(path)
                    with open(path, "rb") as f:
                        out.append((int(os.path.basename(path).split(".")[1]), pickle.load(f)))
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout} s for {count} messages from the ranks, got {len(new)}")
            time.sleep(0.01)


def _start_fork(fn: Callable, args: tuple, env: Dict[str, str], log_path: str) -> _Forked:
    tie = die_with_launcher()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    try:  # the child: its own session (grandchildren are killed with it), its own output, horovodrun's env
        os.setsid()
        if tie is not None:
            tie()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # Like a fresh interpreter: the test runner's log handlers would swallow the rank's warnings.
        logging.getLogger().handlers.clear()
        logging.getLogger("horovod").handlers.clear()
        os.environ.clear()
        os.environ.update(env)
        _rank_main((fn, args))
    finally:
        os._exit(70)


def die_with_launcher() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that kills a rank when the test process dies, however it dies (Linux)."""
    from horovod.runner.exec import die_with_launcher as tie

    return tie()


def _register_by_value(obj: Any, depth: int = 0) -> None:
    """Ship the test modules ``obj`` comes from by value: their folders are not importable in a fresh rank.

    Follows closures and arguments a few levels (``with_transport`` wraps the test's function).  Helper modules
    whose functions are only referenced from such a module register themselves (``cloudpickle.
    register_pickle_by_value(sys.modules[__name__])``), as engine_helpers.py does.
    """
    if depth > 3:
        return
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None) or ""
    if module is not None and path.startswith(TESTS + os.sep) and module.__name__ not in ("multiproc", "checks"):
        cloudpickle.register_pickle_by_value(module)
    children: List[Any] = []
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            children.append(cell.cell_contents)
        except ValueError:   # an empty cell
            pass
    if isinstance(obj, (tuple, list)):
        children.extend(obj)
    for child in children:
        if callable(child) or isinstance(child, (tuple, list)):
            _register_by_value(child, depth + 1)


def _mpirun_command(np: int, argv: List[str]) -> List[str]:
    if shutil.which("mpirun") is None:
        raise RuntimeError("launcher='mpirun' needs mpirun on PATH (install Open MPI)")
    cmd = ["mpirun", "-np", str(np), "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if np > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd + argv


def run_ranks(fn: Callable, np: int, args: Sequence[Any] = (), env: Optional[Dict[str, str]] = None,
              timeout: float = 60.0, hosts: Optional[Sequence[str]] = None,
              rank_env_overrides: Optional[Dict[int, Dict[str, str]]] = None, expect_failure: bool = False,
              python: Optional[str] = None, launcher: str = "subprocess", ranks: Optional[Sequence[int]] = None,
              hold: Sequence[int] = (), on_start: Optional[Callable[[Job], None]] = None,
              linger: bool = False) -> List[Any]:
    """Run ``fn(*args)`` on ``np`` ranks; return the results by rank.

    Args:
        env: extra environment of every rank; ``rank_env_overrides``: per rank.
        hosts: the host name of each rank (local/cross ranks follow; everything still runs here).
        expect_failure: return every started rank's :class:`Outcome` (unpacks as ``(status, value)``) instead of
            failing the test when a rank raised or died.
        python: the interpreter of ``subprocess`` ranks (default: this one), e.g. the MXNet venv's.
        launcher: ``subprocess``, ``fork`` or ``mpirun`` (see the module docstring).
        ranks: start only these ranks (the others are missing on purpose).
        hold: ranks that wait for ``Job.release()`` before running ``fn``.
        on_start: called with the :class:`Job` once every rank is started (kill a rank, read messages...).
        linger: finished ranks stay alive until every rank finished (for transports that watch their peers).
    """
    from horovod.transport.rendezvous import RendezvousServer

    if launcher not in ("subprocess", "fork", "mpirun"):
        raise ValueError(f"launcher must be 'subprocess', 'fork' or 'mpirun', got {launcher!r}")
    if launcher == "mpirun" and (hosts or rank_env_overrides or ranks is not None or hold):
        raise ValueError("launcher='mpirun' starts every rank alike: hosts, rank_env_overrides, ranks and hold "
                         "need the subprocess or fork launcher")
    started = list(range(np)) if ranks is None else sorted(ranks)
    secret = secrets.token_bytes(16)
    job_dir = tempfile.mkdtemp(prefix="hvd-test-")
    procs: Dict[int, Any] = {}
    try:
        with RendezvousServer(secret) as server:
            if launcher != "fork":
                _register_by_value((fn, tuple(args)))
                with open(os.path.join(job_dir, "fn.pkl"), "wb") as f:
                    cloudpickle.dump((fn, tuple(args)), f)
            common = {_DIR_VAR: job_dir, _LINGER_VAR: "1" if linger else "0"}
            pool = _warm_pool(np, python, env, rank_env_overrides, common, server.port, secret, hosts) \
                if rank_pool.pooled_kwargs_ok(launcher, expect_failure, ranks, hold, on_start, linger) else None
            if pool is not None:
                return _run_in_pool(pool, np, job_dir, timeout)
            if launcher == "mpirun":
                full = _base_env()
                full.update(env or {})
                full.update(common)
                log = open(os.path.join(job_dir, "out.mpirun.txt"), "wb")
                proc = subprocess.Popen(_mpirun_command(np, [python or sys.executable, "-c", _CHILD, job_dir,
                                                             TESTS]),
                                        env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        cwd=REPO, preexec_fn=die_with_launcher())
                log.close()
                procs = {-1: proc}
            else:
                envs = _rank_envs(np, started, env, rank_env_overrides, common, server.port, secret, hosts, hold)
                for rank in started:
                    full = envs[rank]
                    log_path = os.path.join(job_dir, f"out.{rank}.txt")
                    if launcher == "fork":
                        procs[rank] = _start_fork(fn, tuple(args), full, log_path)
                    else:
                        with open(log_path, "wb") as log:
                            procs[rank] = subprocess.Popen([python or sys.executable, "-c", _CHILD, job_dir, TESTS],
                                                           env=full, stdout=log, stderr=subprocess.STDOUT,
                                                           start_new_session=True, preexec_fn=die_with_launcher())
            job = Job(job_dir, server, procs)
            deadline = time.monotonic() + timeout
            if on_start is not None:
                on_start(job)
            timed_out = _wait(procs, started, job_dir, deadline, linger)
            _end(procs)
        return _collect(np, started, procs, job_dir, timeout, timed_out, expect_failure)
    finally:
        _end(procs)   # when on_start or a launch raised
        shutil.rmtree(job_dir, ignore_errors=True)


def _rank_envs(np: int, ranks: Sequence[int], env: Optional[Dict[str, str]],
               overrides: Optional[Dict[int, Dict[str, str]]], common: Dict[str, str], port: int, secret: bytes,
               hosts: Optional[Sequence[str]], hold: Sequence[int] = ()) -> Dict[int, Dict[str, str]]:
    """The whole environment of each of ``ranks``: horovodrun's, the call's, the rank's own, the harness's."""
    envs = {}
    for rank in ranks:
        extra = dict(env or {})
        extra.update((overrides or {}).get(rank, {}))
        extra.update(common)
        extra[_HOLD_VAR] = "1" if rank in hold else "0"
        envs[rank] = rank_env(rank, np, "127.0.0.1", port, secret, extra, hosts)
    return envs


def _warm_pool(np: int, python: Optional[str], env: Optional[Dict[str, str]],
               overrides: Optional[Dict[int, Dict[str, str]]], common: Dict[str, str], port: int, secret: bytes,
               hosts: Optional[Sequence[str]]) -> Optional["rank_pool.Pool"]:
    envs = _rank_envs(np, range(np), env, overrides, common, port, secret, hosts)
    interpreter = python or sys.executable
    pool = rank_pool.pool_for(np, interpreter, envs,
                              lambda r, e: rank_pool.spawn(interpreter, TESTS, e, die_with_launcher()))
    if pool is not None:
        pool.submit(common[_DIR_VAR], envs)
    return pool


def _run_in_pool(pool: "rank_pool.Pool", np: int, job_dir: str, timeout: float) -> List[Any]:
    """Wait for a call handed to warm workers; keep the pool only when every rank returned and cleaned up."""
    procs = pool.procs()
    deadline = time.monotonic() + timeout
    results = [os.path.join(job_dir, f"result.{r}.pkl") for r in range(np)]
    timed_out = False
    while not all(os.path.exists(path) or procs[r].exited() for r, path in enumerate(results)):
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.005)
    ok = not timed_out and all(os.path.exists(path) for path in results) and not pool.broken
    if ok:
        for path in results:
            with open(path, "rb") as f:
                ok = ok and pickle.load(f)[0] == "ok"
    if not (ok and pool.await_ready()):
        rank_pool.discard(pool)
    return _collect(np, list(range(np)), procs, job_dir, timeout, timed_out, expect_failure=False)


def suite_runner(worker_env: Dict[str, str], timeout: float, **fixed: Any) -> Callable[..., List[Any]]:
    """A test suite's ``run(fn, np, args=(), env=None, timeout=..., **kwargs)``: :func:`run_ranks` with the
    suite's worker environment (a call's ``env`` is added on top), its default ``timeout``, and ``fixed`` keyword
    arguments of every call (e.g. ``python=``)."""
    default_timeout = timeout

    def run(fn: Callable, np: int, args: Sequence[Any] = (), env: Optional[Dict[str, str]] = None,
            timeout: float = default_timeout, **kwargs: Any) -> List[Any]:
        return run_ranks(fn, np, args=args, env={**worker_env, **(env or {})}, timeout=timeout, **fixed, **kwargs)

    return run


def _exited(p: Any) -> bool:
    """Whether ``p`` ended, without reaping it: until reaped, its pid (its process group's id) stays reserved."""
    if p.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait(procs: Dict[int, Any], started: List[int], job_dir: str, deadline: float, linger: bool) -> bool:
    """Wait until every process exited; ``True`` on timeout."""
    released = False
    while not all(_exited(p) for p in procs.values()):
        if time.monotonic() > deadline:
            return True
        if linger and not released and all(
                _exited(procs.get(r, procs.get(-1))) or os.path.exists(os.path.join(job_dir, f"result.{r}.pkl"))
                for r in started):
            open(os.path.join(job_dir, "done"), "w").close()
            released = True
        time.sleep(0.01)
    return False


def _end(procs: Dict[int, Any]) -> None:
    """SIGKILL each rank's process group (stragglers, anything they forked), then reap the ranks."""
    for p in procs.values():
        if p.returncode is None:   # not reaped yet, so the group id cannot belong to anyone else
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs.values():
        p.wait()


def _collect(np: int, started: List[int], procs: Dict[int, Any], job_dir: str, timeout: float, timed_out: bool,
             expect_failure: bool) -> List[Any]:
    def output(rank: int) -> str:
        path = os.path.join(job_dir, f"out.{rank}.txt")
        if not os.path.exists(path):
            path = os.path.join(job_dir, "out.mpirun.txt")
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()

    if timed_out:
        raise AssertionError(f"job of {np} ranks did not finish within {timeout} s (hang); output:\n" +
                             "\n".join(f"--- rank {r} ---\n{output(r)[-3000:]}" for r in started))
    outcomes = []
    for rank in started:
        proc = procs.get(rank, procs.get(-1))
        path = os.path.join(job_dir, f"result.{rank}.pkl")
        if not os.path.exists(path):
            outcomes.append(Outcome(rank, "died", f"rank {rank} exited with {proc.returncode} without a result; "
                                                  f"output:\n{output(rank)[-3000:]}", None, proc.returncode,
                                    output(rank)))
            continue
        with open(path, "rb") as f:
            status, value, error = pickle.load(f)
        outcomes.append(Outcome(rank, status, value, error, proc.returncode, output(rank)))
    if expect_failure:
        return outcomes
    bad = sorted((o for o in outcomes if o.status != "ok"), key=lambda o: (o.status != "error", o.rank))
    if bad:
        o = bad[0]
        # The first failure in full; the others in a line each: a rank that failed for its own reason (not only
        # because a peer went away) is often the cause, and would otherwise stay hidden.
        others = "".join(f"\nalso rank {b.rank} {'failed' if b.status == 'error' else 'died'}: "
                         f"{_last_line(str(b.value))}" for b in bad[1:])
        raise RankFailed(f"rank {o.rank} {'failed' if o.status == 'error' else 'died'}:\n{o.value}\n"
                         f"--- output ---\n{o.output[-2000:]}{others}")
    return [o.value for o in outcomes]


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "(no message)"


def output_lines(proc: subprocess.Popen, seconds: float) -> Iterator[str]:
    """The lines ``proc`` writes to its (text) stdout pipe, until it closes the pipe or ``seconds`` pass.

    A reader thread feeds a queue, so a process that goes silent without exiting cannot hold the caller past its
    deadline (a bare ``readline`` would block for as long as the process lives).
    """
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:
        try:
            for line in proc.stdout:   # type: ignore[union-attr]
                lines.put(line)
        finally:
            lines.put(None)

    threading.Thread(target=pump, name="output-lines", daemon=True).start()
    deadline = time.monotonic() + seconds
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line is None:
            return
        yield line
