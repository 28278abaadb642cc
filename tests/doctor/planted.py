"""Planted hangs for the hang doctor's tests: ``python planted.py SCENARIO`` under horovodrun.

Every scenario runs a few healthy steps first (so the recorders hold history), then hangs in its own way; the
line each rank is left on carries a ``# HANG:<scenario>:<role>`` marker the tests look up, so no line number is
written down twice.  The job ends through the stall inspector (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) or the
liveness timeout, which the tests set short.
"""
import os
import signal
import sys
import time

import numpy as np

import horovod.numpy as hvd

SCENARIO = sys.argv[1]
BIG = np.ones(512, dtype=np.float32)   # 2 KiB: past the fast lane, through the coordinator


def healthy_steps(n=3):
    for _ in range(n):
        hvd.allreduce(BIG, name="grad.fc1.weight")
        hvd.allreduce(BIG, name="grad.fc2.weight")
        hvd.allgather(BIG[:4], name="stats")


def loader_worker(conn):
    """A data loader's worker process that never produces its batch."""
    time.sleep(600)  # HANG:loader:worker


class StuckDataset:
    """A torch Dataset whose item never arrives on the culprit (its loader worker is stuck in user code)."""

    def __init__(self, stuck):
        self.stuck = stuck

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if self.stuck:
            time.sleep(600)  # HANG:torch_loader:worker
        return np.ones(4, dtype=np.float32)


THREAD_ERRORS = []


def issue_from_a_thread():
    try:
        hvd.allreduce(BIG, name="grad.fc1.bias")  # HANG:thread:waiter
    except Exception as exc:   # the stall error: re-raised on the main thread, so the rank fails and the job ends
        THREAD_ERRORS.append(exc)


def main():
    size = int(os.environ.get("HOROVOD_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"])   # mpirun: Open MPI's
    culprit = size - 1
    solo = hvd.ProcessSet([culprit])
    hvd.init(process_sets=[solo] if SCENARIO == "process_set" else None)
    rank = hvd.rank()
    healthy_steps()
    print(f"planted: rank {rank} hangs now", flush=True)
    if SCENARIO == "skip":
        # One step more, in which the culprit skips an allreduce and goes on to the step's next collective.
        hvd.allreduce(BIG, name="grad.fc1.weight")
        if rank != culprit:
            hvd.allreduce(BIG, name="grad.fc2.weight")  # HANG:skip:waiter
        hvd.allgather(BIG[:4], name="stats")  # HANG:skip:culprit
    elif SCENARIO == "order":
        if rank != culprit:
            hvd.allgather(BIG, name="a")  # HANG:order:waiter
            hvd.allreduce(BIG, name="b")
        else:
            hvd.allreduce(BIG, name="b")  # HANG:order:culprit
            hvd.allgather(BIG, name="a")
    elif SCENARIO == "sleep":
        if rank == culprit:
            time.sleep(600)  # HANG:sleep:culprit
        hvd.allreduce(BIG, name="grad.fc1.bias")  # HANG:sleep:waiter
    elif SCENARIO == "sleep_tiny":   # an 8-byte allreduce: on one host the fast lane, not the coordinator
        if rank == culprit:
            time.sleep(600)  # HANG:sleep_tiny:culprit
        hvd.allreduce(np.ones(2, dtype=np.float32), name="loss")  # HANG:sleep_tiny:waiter
    elif SCENARIO == "sigstop":
        if rank == culprit:
            os.kill(os.getpid(), signal.SIGSTOP)  # HANG:sigstop:culprit
        hvd.allreduce(BIG, name="grad.fc1.bias")  # HANG:sigstop:waiter
    elif SCENARIO == "kill":
        if rank == culprit:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)  # HANG:kill:culprit
        hvd.allreduce(BIG, name="grad.fc1.bias")  # HANG:kill:waiter
    elif SCENARIO == "process_set":
        # The culprit issues the collective on a set of its own; the others on the global set.
        if rank == culprit:
            hvd.allreduce(BIG, process_set=solo)
            time.sleep(600)  # HANG:process_set:culprit
        hvd.allreduce(BIG)  # HANG:process_set:waiter
    elif SCENARIO == "loader":
        import multiprocessing as mp
        if rank == culprit:
            ctx = mp.get_context("fork")
            parent, child = ctx.Pipe()
            worker = ctx.Process(target=loader_worker, args=(child,), daemon=True)
            worker.start()
            parent.recv()  # HANG:loader:culprit
        hvd.allreduce(BIG, name="batch.stats")  # HANG:loader:waiter
    elif SCENARIO == "torch_loader":
        import torch.utils.data as tud
        loader = iter(tud.DataLoader(StuckDataset(rank == culprit), batch_size=1, num_workers=1))
        next(loader)   # HANG:torch_loader:culprit
        hvd.allreduce(BIG, name="batch.stats")  # HANG:torch_loader:waiter
    elif SCENARIO == "thread":   # the waiters issue the collective from a thread of their own; main joins it
        import threading
        if rank == culprit:
            time.sleep(600)  # HANG:thread:culprit
        worker = threading.Thread(target=issue_from_a_thread, name="trainer")
        worker.start()
        worker.join()  # HANG:thread:main
        if THREAD_ERRORS:
            raise THREAD_ERRORS[0]
    else:
        raise SystemExit(f"unknown scenario {SCENARIO!r}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
