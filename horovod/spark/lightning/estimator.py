"""``horovod.spark.lightning.TorchEstimator``: train a ``lightning.LightningModule`` with Horovod on Spark."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import cloudpickle

from horovod.spark.common.estimator import HorovodEstimator
from horovod.spark.common.params import add_params
from horovod.spark.lightning import remote
from horovod.spark.torch.estimator import TORCH_MODEL_PARAMS, TorchModel as _TorchModel

LIGHTNING_PARAMS: Dict[str, Tuple[Any, str]] = {
    "input_shapes": (None, "shape of each feature column's tensor, e.g. [[-1, 1, 8, 8]]"),
    "trainer_args": ({}, "keyword arguments for lightning.Trainer (accelerator, devices, max_epochs, "
                         "limit_train_batches and callbacks are set by the estimator)"),
    "num_gpus": (None, "accepted for compatibility (this build trains on CPU)"),
    "logger": (None, "a Lightning logger (default: none)"),
    "log_every_n_steps": (50, "Lightning's log_every_n_steps"),
    "loader_num_epochs": (None, "accepted for compatibility"),
    "terminate_on_nan": (False, "accepted for compatibility"),
    "profiler": (None, "accepted for compatibility"),
    "debug_data_loader": (False, "accepted for compatibility"),
    "train_async_data_loader_queue_size": (None, "accepted for compatibility"),
    "val_async_data_loader_queue_size": (None, "accepted for compatibility"),
    "transformation_edit_fields": (None, "accepted for compatibility"),
    "transformation_removed_fields": (None, "accepted for compatibility"),
}


class TorchEstimator(HorovodEstimator):
    """Spark ML estimator for a ``lightning.LightningModule``.

    Every process runs a single-device ``lightning.Trainer`` on its shard; gradients are averaged across the
    processes after each backward pass, rank 0's parameters are broadcast at the start, and the epoch's metrics
    (``self.log`` values and the training loss) are averaged into the history.  The module's
    ``training_step(batch, batch_idx)`` / ``validation_step`` receive ``batch`` as a dict of tensors keyed by
    column name (features float32, labels in their stored dtype); ``configure_optimizers`` gives the optimizer.
    Checkpoints and resuming by ``run_id`` work as for :class:`horovod.spark.torch.TorchEstimator` (learning-
    rate schedulers restart with each fit).
    """

    _EXTRA_PARAMS = LIGHTNING_PARAMS

    def _check_params(self) -> None:
        super()._check_params()
        import lightning as L
        if not isinstance(self.getModel(), L.LightningModule):
            raise ValueError(f"horovod.spark.lightning.TorchEstimator: model must be a lightning.LightningModule, "
                             f"got {type(self.getModel())}; use horovod.spark.torch.TorchEstimator for a plain "
                             f"torch.nn.Module.")

    def _fit_on_prepared_data(self, backend, store, meta, dataset_idx=None):
        model = self.getModel()
        run_id = self._resolved_run_id()
        settings = self._settings(backend, store, meta, run_id, dataset_idx)
        settings.update({
            "input_shapes": self.getInputShapes(),
            "trainer_args": self.getTrainerArgs() or {},
            "logger": self.getLogger(),
            "log_every_n_steps": self.getLogEveryNSteps(),
            "callbacks": list(self.getCallbacks() or []),
        })
        results = backend.run(remote.train, args=(cloudpickle.dumps(model), settings), env=self.getBackendEnv())
        out = results[0]
        return TorchModel(history=out["history"], model=cloudpickle.loads(out["model"]),
                          feature_columns=self._feature_cols(), input_shapes=self.getInputShapes(),
                          label_columns=self._label_cols(), run_id=run_id, _metadata=meta)


add_params(TorchEstimator, LIGHTNING_PARAMS)


class TorchModel(_TorchModel):
    """A trained LightningModule; ``transform(df)`` adds the predictions of its ``forward``."""


add_params(TorchModel, TORCH_MODEL_PARAMS)

__all__ = ["TorchEstimator", "TorchModel"]
