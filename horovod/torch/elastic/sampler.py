"""``ElasticSampler``: a distributed sampler that survives resets without repeating or skipping samples.

Within an epoch the sampler remembers how many samples the whole job has processed (``processed_num``, advanced
by :meth:`ElasticSampler.record_batch`).  After a reset — a different number of workers, different ranks —
:meth:`ElasticSampler.reset` splits only the samples not yet processed over the new workers.  Put the sampler in
a :class:`~horovod.torch.elastic.TorchState` so that ``processed_num`` is committed, restored and synchronised
with the rest of the state.
"""
from __future__ import annotations

import math
import random
from typing import Dict, Iterator, List, Sized

import torch.utils.data

from horovod.common import basics


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions ``dataset`` over the current workers, like ``DistributedSampler``, and follows resets.

    Every rank sees ``ceil(remaining / size)`` indices per epoch; the last ones wrap around to the start of the
    remaining indices so that every rank has the same number of batches.

    Args:
        dataset: anything with ``len()``.
        shuffle: permute the indices every epoch (the same permutation on every rank: seeded by
            ``seed + epoch``).
        seed: base of the shuffling seed; must be the same on every rank.

    ``hvd.init()`` must have been called: the partition depends on ``hvd.size()`` and ``hvd.rank()``.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.remaining_indices: List[int] = []
        self.indices: List[int] = []
        self.num_replicas = 1
        self.rank = 0
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new permutation."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one processed batch of ``batch_size`` samples per rank (``batch_size * size`` in all).

        Call it after each batch, before ``state.commit()``, so that a restore resumes after the committed batch.
        """
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: List[int]) -> None:
        """Count ``len(indices)`` processed samples per rank (for batches of varying size)."""
        self.processed_num += len(indices) * self.num_replicas

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The indices of batch ``batch_idx`` of this rank (``__iter__`` must have run)."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-partition the indices not processed yet in this epoch over the current ranks."""
        self.num_replicas = basics.size()
        self.rank = basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:   # wrap around so every rank gets num_samples
            padded += padded[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
