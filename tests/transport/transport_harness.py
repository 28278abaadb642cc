"""Run a function on a real multi-process world over a real rendezvous server (test helper, not a test).

Every world is a set of forked (or spawned) processes that bootstrap a registered transport through a
:class:`~horovod.transport.rendezvous.RendezvousServer` living in the test process, run ``fn(transport, *args)``
and report back through a queue.  Every wait is bounded: processes still alive at the deadline are killed and
the run fails with what each rank reported.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import queue
import secrets
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from horovod.transport.rendezvous import RendezvousClient, RendezvousServer
from horovod.transport.base import REGISTRY, Bootstrap

_REPORT: Optional[Callable[[Any], None]] = None


def report(msg: Any) -> None:
    """From inside a worker: send an intermediate message to the test process's ``monitor``."""
    if _REPORT is not None:
        _REPORT(msg)


@dataclass
class Outcome:
    """What one rank ended with."""

    rank: int
    status: str = "missing"  # ok | error | missing (killed or hung)
    value: Any = None  # fn's return value, or a dict describing the exception
    warnings: List[str] = field(default_factory=list)
    exitcode: Optional[int] = None


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _worker(rank: int, size: int, transport: str, addr: str, port: int, secret: bytes, scope: str, timeout: float,
            options: dict, fn: Callable, args: Sequence, q, gate) -> None:
    global _REPORT
    _REPORT = lambda msg: q.put((rank, "msg", msg, None))  # noqa: E731
    handler = _ListHandler()
    logging.getLogger("horovod").addHandler(handler)
    try:
        if gate is not None and not gate.wait(timeout):
            raise TimeoutError(f"rank {rank} was never released by the test")
        store = RendezvousClient(addr, port, secret, timeout=timeout)
        boot = Bootstrap(rank, size, store=store, secret=secret, timeout=timeout, scope=scope, options=options)
        importlib.import_module(f"horovod.transport.{transport}")  # registers the factory
        t = REGISTRY[transport](boot)
        try:
            value = fn(t, *args)
        finally:
            t.close()
        q.put((rank, "ok", value, handler.lines))
    except BaseException as exc:  # report everything, including TransportError details, to the parent
        q.put((rank, "error", {"type": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None),
                               "traceback": traceback.format_exc()}, handler.lines))


def run_world(size: int, fn: Callable, args: Sequence = (), *, transport: str = "tcp", timeout: float = 60.0,
              transport_timeout: float = 10.0, options: Optional[dict] = None, secret: Optional[bytes] = None,
              start_method: str = "fork", monitor: Optional[Callable[[int, Any, Dict[int, Any]], None]] = None,
              ranks: Optional[Sequence[int]] = None, scope: str = "tcp-test",
              server: Optional[RendezvousServer] = None, hold: Sequence[int] = (),
              on_start: Optional[Callable[[Dict[int, Any], Callable[[], None]], None]] = None) -> List[Outcome]:
    """Run ``fn(transport, *args)`` on ``size`` processes; returns one :class:`Outcome` per started rank.

    Args:
        timeout: hard wall-clock bound for the whole world; stragglers are killed.
        transport_timeout: ``Bootstrap.timeout`` of every rank.
        monitor: called in the test process as ``monitor(rank, msg, procs)`` for each :func:`report`.
        ranks: start only these ranks (default all), e.g. to leave one missing on purpose.
        server: an already started rendezvous server (its secret must be ``secret``).
        hold: ranks that wait (before bootstrapping) until ``on_start`` calls its ``release`` argument.
        on_start: called in the test process as ``on_start(procs, release)`` once every rank is started.
    """
    ctx = mp.get_context(start_method)
    secret = secret or secrets.token_bytes(16)
    own_server = server is None
    if own_server:
        server = RendezvousServer(secret).start()
    ranks = list(range(size)) if ranks is None else list(ranks)
    q = ctx.Queue()
    gate = ctx.Event() if hold else None
    procs: Dict[int, Any] = {}
    outcomes = {r: Outcome(r) for r in ranks}
    deadline = time.monotonic() + timeout
    try:
        for r in ranks:
            p = ctx.Process(target=_worker, args=(r, size, transport, server.host, server.port, secret, scope,
                                                  transport_timeout, dict(options or {}), fn, tuple(args), q,
                                                  gate if r in hold else None),
                            name=f"world-rank-{r}", daemon=True)
            p.start()
            procs[r] = p
        if on_start is not None:
            on_start(procs, gate.set if gate is not None else (lambda: None))
        waiting = set(ranks)
        dead_since: Dict[int, float] = {}
        while waiting and time.monotonic() < deadline:
            try:
                rank, status, value, lines = q.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                # A rank that died without reporting (killed on purpose, or crashed) will never report; allow
                # the queue a moment to deliver a last message it may have written just before exiting.
                for r in list(waiting):
                    if procs[r].exitcode is not None:
                        first = dead_since.setdefault(r, time.monotonic())
                        if time.monotonic() - first > 1.0:
                            waiting.discard(r)
                continue
            if status == "msg":
                if monitor is not None:
                    monitor(rank, value, procs)
                continue
            outcomes[rank].status, outcomes[rank].value, outcomes[rank].warnings = status, value, lines
            waiting.discard(rank)
    finally:
        for r, p in procs.items():
            if outcomes[r].status != "missing":
                p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
            p.join(5)
            outcomes[r].exitcode = p.exitcode
        q.close()
        q.join_thread()
        if own_server:
            server.stop()
    return [outcomes[r] for r in ranks]


def values(outcomes: List[Outcome]) -> List[Any]:
    """The return values of every rank; fails the test with every rank's story unless all succeeded."""
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        lines = []
        for o in bad:
            detail = o.value["traceback"] if isinstance(o.value, dict) else "(no report: killed, crashed or hung)"
            lines.append(f"--- rank {o.rank}: {o.status}, exit code {o.exitcode}\n{detail}")
        raise AssertionError("some ranks failed:\n" + "\n".join(lines))
    return [o.value for o in outcomes]


def kill(proc) -> None:
    """SIGKILL a worker (no cleanup, like a crash)."""
    os.kill(proc.pid, signal.SIGKILL)
