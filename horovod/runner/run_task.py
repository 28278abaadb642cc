"""Worker side of :func:`horovod.run`: ``python -m horovod.runner.run_task <addr> <port>``.

Fetches the cloudpickled function from the launcher's rendezvous store (scope ``runfunc``, key ``func``),
calls it, and stores the cloudpickled return value at ``runfunc_result/<rank>``.  If the function raises,
the traceback text goes to ``runfunc_error/<rank>`` (and to standard error) and the process exits with
status 1, which stops the job.  The job secret arrives in the environment, never on the command line.
"""
from __future__ import annotations

import sys
import traceback
from typing import Any, List, Optional, Sequence

import cloudpickle

from horovod.common import mpi_abort
from horovod.engine import config
from horovod.transport.rendezvous import RendezvousClient

FUNC_SCOPE = "runfunc"
FUNC_KEY = "func"
RESULT_SCOPE = "runfunc_result"
ERROR_SCOPE = "runfunc_error"


def tracebacks(store, first_rank: int) -> str:
    """The tracebacks the ranks reported, the first failing rank's first (usually the cause; the rest follow)."""
    errors = store.scope(ERROR_SCOPE)
    order = sorted(errors, key=lambda r: (r != str(first_rank), int(r) if r.isdigit() else 0))
    return "\n".join(f"rank {r} raised:\n{errors[r].decode('utf-8', errors='replace').rstrip()}" for r in order)


def results_by_rank(store, num_proc: int, caller: str) -> List[Any]:
    """Every rank's return value, in rank order.

    Raises:
        RuntimeError: a rank ended without reporting one (it must return normally on every rank).
    """
    results = store.scope(RESULT_SCOPE)
    out = []
    for rank in range(num_proc):
        raw = results.get(str(rank))
        if raw is None:
            raise RuntimeError(f"{caller}: rank {rank} exited successfully but reported no result; the function "
                               f"must return normally on every rank")
        out.append(cloudpickle.loads(raw))
    return out


def _timeout(env) -> float:
    raw = env.get("HOROVOD_START_TIMEOUT", "")
    try:
        return float(raw) if raw.strip() else 30.0
    except ValueError:
        return 30.0


def _report(client: RendezvousClient, rank: str, text: str) -> int:
    sys.stderr.write(text)
    sys.stderr.flush()
    try:
        client.put(ERROR_SCOPE, rank, text.encode("utf-8", errors="replace"))
    except (OSError, PermissionError) as exc:
        print(f"run_task: could not report the error to the launcher: {exc}", file=sys.stderr)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the shipped function once; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m horovod.runner.run_task <rendezvous addr> <rendezvous port>", file=sys.stderr)
        return 2
    addr, port = argv[0], int(argv[1])
    env = config.environ()
    topology = config.topology_from_env(env)
    if topology.secret is None:
        print(f"run_task: {config.SECRET_ENV} is not set; this module is started by horovod.run(), which passes "
              f"the job secret in the environment", file=sys.stderr)
        return 2
    client = RendezvousClient(addr, port, topology.secret, timeout=_timeout(env))
    rank = str(topology.rank)
    try:
        # The store is authenticated with the job secret, so the payload comes from our own launcher.
        func = cloudpickle.loads(client.get(FUNC_SCOPE, FUNC_KEY))
    except BaseException:  # noqa: BLE001 - the caller must learn why, whatever it was
        return _report(client, rank, traceback.format_exc())
    try:
        result = func()
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
        # Start the traceback at the user's function, not at this module.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        return _report(client, rank, "".join(traceback.format_exception(type(exc), exc, tb)))
    try:
        payload = cloudpickle.dumps(result)
    except BaseException:  # noqa: BLE001
        return _report(client, rank, "the function's return value cannot be pickled:\n" + traceback.format_exc())
    client.put(RESULT_SCOPE, rank, payload)
    return 0


if __name__ == "__main__":
    status = main()
    if status:
        mpi_abort.abort(status)   # under mpirun (use_mpi=True): end every rank now, not at their MPI_Finalize
    sys.exit(status)
