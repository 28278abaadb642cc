"""The smallest real job: every rank contributes a vector, all of them get the sum and the average.

    horovodrun -np 4 python examples/numpy_allreduce.py     # four ranks on this host
    python examples/numpy_allreduce.py                       # no launcher: a job of size 1
"""
import numpy as np

import horovod.numpy as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()

contribution = np.arange(4, dtype=np.float32) + rank
total = hvd.allreduce(contribution, op=hvd.Sum, name="contribution")
average = hvd.allreduce(contribution, name="contribution.avg")
gathered = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int64), name="ragged")
config = hvd.broadcast_object({"lr": 0.1 * size, "from": rank}, root_rank=0)

expected = np.arange(4, dtype=np.float32) * size + sum(range(size))
assert np.allclose(total, expected), (total, expected)
assert np.allclose(average, expected / size)
assert gathered.shape == (size * (size + 1) // 2, 2)
assert config["from"] == 0

print(f"rank {rank}/{size} (local {hvd.local_rank()}/{hvd.local_size()}): sum={total.tolist()} "
      f"avg={average.tolist()} gathered_rows={gathered.shape[0]} broadcast={config}")
hvd.shutdown()
