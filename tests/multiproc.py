"""Multi-process test harness: run a function on N real ranks and collect what each returned.

``run_ranks(fn, np)`` starts a real rendezvous server and ``np`` Python processes with exactly the environment
``horovodrun`` gives its workers, runs ``fn(*args)`` in each (shipped with cloudpickle), and returns the list
of per-rank results.  If any rank raises, the first failing rank's traceback is raised in the test; if the job
does not finish within ``timeout`` seconds every rank is killed and the test fails with their output.
"""
from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import cloudpickle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import os, pickle, sys, traceback
import cloudpickle
path = sys.argv[1]
rank = int(os.environ["HOROVOD_RANK"])
with open(os.path.join(path, "fn.pkl"), "rb") as f:
    fn, args = cloudpickle.load(f)
try:
    result = ("ok", fn(*args))
except BaseException as exc:
    result = ("error", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
with open(os.path.join(path, f"result.{rank}.pkl"), "wb") as f:
    cloudpickle.dump(result, f)
sys.stdout.flush()
os._exit(0)
"""


class RankFailed(AssertionError):
    """A rank raised; carries its traceback text."""


def _register_by_value(fn: Callable) -> None:
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if module is not None and module.__name__ not in ("__main__",) and module.__name__.startswith("test"):
        cloudpickle.register_pickle_by_value(module)
    elif module is not None and "tests" in (getattr(module, "__file__", "") or ""):
        cloudpickle.register_pickle_by_value(module)


def rank_env(rank: int, size: int, addr: str, port: int, secret: bytes, extra: Optional[Dict[str, str]] = None,
             hosts: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """The environment horovodrun gives worker ``rank`` (all on one host unless ``hosts`` is given)."""
    hosts = list(hosts) if hosts else ["localhost"] * size
    host = hosts[rank]
    local_ranks = [r for r in range(size) if hosts[r] == host]
    local_rank = local_ranks.index(rank)
    host_order = list(dict.fromkeys(hosts))
    cross = [h for h in host_order if sum(1 for r in range(size) if hosts[r] == h) > local_rank]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "PMIX_"))}
    env.update({
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(len(local_ranks)),
        "HOROVOD_CROSS_RANK": str(cross.index(host)), "HOROVOD_CROSS_SIZE": str(len(cross)),
        "HOROVOD_HOSTNAME": host,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "_HOROVOD_SECRET_KEY": secret.hex(), "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]),
    })
    env.update(extra or {})
    return env


def run_ranks(fn: Callable, np: int, args: Sequence[Any] = (), env: Optional[Dict[str, str]] = None,
              timeout: float = 60.0, hosts: Optional[Sequence[str]] = None,
              rank_env_overrides: Optional[Dict[int, Dict[str, str]]] = None,
              expect_failure: bool = False, python: Optional[str] = None) -> List[Any]:
    """Run ``fn(*args)`` on ``np`` ranks; return results by rank (or tracebacks when ``expect_failure``).

    ``python`` is the interpreter the ranks run (default: this one), e.g. a separate venv's for MXNet.
    """
    from horovod.transport.rendezvous import RendezvousServer

    _register_by_value(fn)
    secret = secrets.token_bytes(16)
    with tempfile.TemporaryDirectory(prefix="hvd-test-") as tmp, RendezvousServer(secret) as server:
        with open(os.path.join(tmp, "fn.pkl"), "wb") as f:
            cloudpickle.dump((fn, tuple(args)), f)
        procs = []
        logs = []
        for rank in range(np):
            extra = dict(env or {})
            extra.update((rank_env_overrides or {}).get(rank, {}))
            log = open(os.path.join(tmp, f"out.{rank}.txt"), "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [python or sys.executable, "-c", _CHILD, tmp],
                env=rank_env(rank, np, "127.0.0.1", server.port, secret, extra, hosts),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for p in procs:
                p.wait()
        for log in logs:
            log.close()
        outputs = [open(os.path.join(tmp, f"out.{r}.txt"), encoding="utf-8", errors="replace").read()
                   for r in range(np)]
        if timed_out:
            raise AssertionError(f"job of {np} ranks did not finish within {timeout} s (hang); output:\n" +
                                 "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs)))
        results = []
        for rank in range(np):
            path = os.path.join(tmp, f"result.{rank}.pkl")
            if not os.path.exists(path):
                results.append(("died", f"rank {rank} exited with {procs[rank].returncode} without a result; "
                                        f"output:\n{outputs[rank][-3000:]}"))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        if expect_failure:
            return results
        for rank, (status, value) in enumerate(results):
            if status != "ok":
                raise RankFailed(f"rank {rank} failed:\n{value}\n--- output ---\n{outputs[rank][-2000:]}")
        return [value for _, value in results]
