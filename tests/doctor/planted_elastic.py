"""A planted hang in an elastic job (``python planted_elastic.py`` under horovodrun elastic, Spark's or Ray's elastic
driver): every epoch, the last rank skips one allreduce and goes on to the step's next collective.  The stall
inspector ends each epoch with a stall error, the workers reset, and the job fails at the reset limit; the verdict
names the epoch's culprit rank, the tensor and the lines marked ``# HANG:<scenario>:<role>`` (as in planted.py).
"""
import numpy as np

import horovod.numpy as hvd
from horovod.common.elastic import ObjectState, default_reset, run_fn

BIG = np.ones(512, dtype=np.float32)   # 2 KiB: past the fast lane, through the coordinator


def train(state):
    culprit = hvd.size() - 1
    for _ in range(3):   # healthy steps: the recorders hold history
        hvd.allreduce(BIG, name="grad.fc1.weight")
        hvd.allreduce(BIG, name="grad.fc2.weight")
        hvd.allgather(BIG[:4], name="stats")
    print(f"planted: rank {hvd.rank()} hangs now", flush=True)
    hvd.allreduce(BIG, name="grad.fc1.weight")
    if hvd.rank() != culprit:
        hvd.allreduce(BIG, name="grad.fc2.weight")  # HANG:elastic_skip:waiter
    hvd.allgather(BIG[:4], name="stats")  # HANG:elastic_skip:culprit


def main():
    hvd.init()
    run_fn(train, default_reset)(ObjectState(hvd.broadcast_object, hvd.rank, step=0))


if __name__ == "__main__":
    main()
