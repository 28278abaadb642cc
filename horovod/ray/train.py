"""``HorovodTrainer``: Horovod data-parallel training on Ray Train (v2, the default Ray Train in Ray 2.60).

A :class:`ray.train.v2.api.data_parallel_trainer.DataParallelTrainer` whose backend
(:class:`~horovod.ray.train_backend.HorovodBackend`) gives every worker its Horovod rank, local and cross rank,
host and the job's secret before the training function runs; the function calls ``hvd.init()`` itself.  Everything
else is Ray Train's own: ``ScalingConfig``, ``RunConfig`` (storage, ``FailureConfig``, ``CheckpointConfig``),
``ray.train.report`` / ``get_checkpoint`` / ``get_context`` / ``get_dataset_shard``.

The same script runs under ``horovodrun`` (or ``mpirun``): ``fit()`` in a process that a Horovod launcher started
runs the training function right there, as Ray Train's local mode does, with ``ray.train.get_context()`` giving
the Horovod rank and size, ``report`` keeping the last metrics and checkpoint (returned in the ``Result``; a
checkpoint is copied to ``<storage_path>/<name>/rank_<r>/checkpoint_<n>`` as Ray Train would upload it), and
``get_checkpoint`` returning the last one reported in this process (``None`` at the start).  See docs/ray.md.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Callable, Dict, Optional, Union

from ray.train import Checkpoint
from ray.train.v2._internal.execution.local_mode.utils import LocalController
from ray.train.v2._internal.execution.train_fn_utils import (LocalTrainFnUtils, get_train_fn_utils,
                                                             set_train_fn_utils)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.result import Result

from horovod.engine import config
from horovod.ray.train_backend import HorovodConfig

logger = logging.getLogger(__name__)


def launched_by_horovod() -> bool:
    """This process was started by ``horovodrun`` or ``mpirun`` (its Horovod rank is in the environment)."""
    return config.topology_from_env(config.environ()).launched_by != "none"


class HorovodTrainer(DataParallelTrainer):
    """Runs ``train_loop_per_worker`` on Ray Train workers that form one Horovod job.

    Args:
        train_loop_per_worker: the training function, with no argument or one (``train_loop_config``).  It calls
            ``hvd.init()`` (any binding) and may use every ``ray.train`` function of a training function.
        train_loop_config: passed to the training function.
        horovod_config: :class:`HorovodConfig` (default: ``HorovodConfig()``).
        scaling_config: ``ray.train.ScalingConfig``: the number of workers, their resources, GPUs, placement.
        run_config: ``ray.train.RunConfig``: name, ``storage_path``, ``FailureConfig``, ``CheckpointConfig``.
        datasets: Ray Data datasets; each worker reads its shard with ``ray.train.get_dataset_shard(name)``.
        dataset_config: ``ray.train.DataConfig``.
        resume_from_checkpoint, metadata: rejected by Ray Train v2 as by every v2 trainer (use
            ``ray.train.get_checkpoint`` with ``RunConfig(name=..., storage_path=...)`` to resume).
        **kwargs: passed on to ``DataParallelTrainer`` (for example ``validation_config``).

    Under ``horovodrun`` / ``mpirun``, :meth:`fit` runs the function in this process (module docstring).
    """

    def __init__(self, train_loop_per_worker: Union[Callable[[], Any], Callable[[Dict], Any]], *,
                 train_loop_config: Optional[Dict] = None, horovod_config: Optional[HorovodConfig] = None,
                 scaling_config=None, run_config=None, datasets: Optional[Dict[str, Any]] = None,
                 dataset_config=None, resume_from_checkpoint=None, metadata: Optional[Dict[str, Any]] = None,
                 **kwargs: Any):
        horovod_config = horovod_config if horovod_config is not None else HorovodConfig()
        if not isinstance(horovod_config, HorovodConfig):
            raise TypeError(f"horovod_config must be a horovod.ray.HorovodConfig, got "
                            f"{type(horovod_config).__module__}.{type(horovod_config).__qualname__} (Ray's removed "
                            f"ray.train.horovod.HorovodConfig takes the same fields: build ours from them)")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config, backend_config=horovod_config,
                         scaling_config=scaling_config, run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, resume_from_checkpoint=resume_from_checkpoint,
                         metadata=metadata, **kwargs)
        if launched_by_horovod():
            self.running_in_local_mode = True

    def _get_local_controller(self) -> LocalController:
        return _HorovodLocalController(experiment_name=self.run_config.name or "horovod", datasets=self.datasets,
                                       storage_path=self.run_config.storage_path)


class _HorovodLocalController(LocalController):
    """Ray Train's local mode with the Horovod launcher's rank, size, local and cross rank in the train context."""

    def __init__(self, experiment_name: str, datasets: Optional[Dict[str, Any]], storage_path: Optional[str]):
        super().__init__(experiment_name, datasets=datasets)
        self.storage_path = storage_path

    def _checkpoint_root(self, rank: int) -> str:
        if self.storage_path and "://" not in str(self.storage_path):
            root = os.path.join(os.path.expanduser(str(self.storage_path)), self.experiment_name, f"rank_{rank}")
            os.makedirs(root, exist_ok=True)
            return root
        root = tempfile.mkdtemp(prefix=f"horovod-train-rank{rank}-")
        logger.warning("HorovodTrainer under a Horovod launcher: storage_path=%r is not a local directory; "
                       "reported checkpoints are copied to %s", self.storage_path, root)
        return root

    def run(self, train_func: Callable[[], Any]) -> Result:
        topology = config.topology_from_env(config.environ())
        if topology.size > 1 and self.datasets:
            raise ValueError(f"HorovodTrainer(datasets={sorted(self.datasets)}) under a Horovod launcher with "
                             f"{topology.size} ranks: Ray Data shards come from Ray Train's workers, which a "
                             f"launcher does not start.  Read the data in the training function (a shard per "
                             f"hvd.rank()) or run the trainer on Ray (python script.py, not horovodrun).")
        logger.info("HorovodTrainer: started by %s as rank %d of %d: running the training function in this "
                    "process (Ray Train's local mode)", topology.launched_by, topology.rank, topology.size)
        set_train_fn_utils(_LauncherTrainFnUtils(
            lambda: self._checkpoint_root(topology.rank),
            experiment_name=self.experiment_name, dataset_shards=self.datasets, world_size=topology.size,
            world_rank=topology.rank, local_rank=topology.local_rank, local_world_size=topology.local_size,
            node_rank=topology.cross_rank))
        value = train_func()
        utils = get_train_fn_utils()
        assert isinstance(utils, _LauncherTrainFnUtils)
        # path: where this rank's checkpoints went (Ray's own local mode, which writes none, passes None too)
        return Result(metrics=utils._get_last_metrics(), checkpoint=utils.get_checkpoint(),
                      path=utils.checkpoint_root, error=None, return_value=value)  # type: ignore[arg-type, unused-ignore]


class _LauncherTrainFnUtils(LocalTrainFnUtils):
    """Local mode's ``report``, with a reported checkpoint copied out of the caller's (usually temporary)
    directory, as Ray Train's upload would: ``get_checkpoint`` and the ``Result`` then point at a copy that stays."""

    def __init__(self, checkpoint_root: Callable[[], str], **kwargs: Any):
        super().__init__(**kwargs)
        self._root_of = checkpoint_root
        self._root: Optional[str] = None
        self._reports = 0

    @property
    def checkpoint_root(self) -> Optional[str]:
        """The directory this rank's reported checkpoints were copied to (``None`` before the first)."""
        return self._root

    def report(self, metrics: Dict[str, Any], checkpoint: Optional[Checkpoint] = None, *args: Any,
               **kwargs: Any) -> None:
        if checkpoint is not None:
            if self._root is None:
                self._root = self._root_of()
            path = os.path.join(self._root, f"checkpoint_{self._reports:06d}")
            checkpoint = Checkpoint.from_directory(checkpoint.to_directory(path))
        self._reports += 1
        super().report(metrics, checkpoint, *args, **kwargs)
