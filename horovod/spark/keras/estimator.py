"""``KerasEstimator``: train a Keras 3 model with Horovod on a Spark DataFrame; ``KerasModel`` predicts."""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Tuple

import cloudpickle
import numpy as np

from horovod.spark.common.estimator import HorovodEstimator, HorovodModel
from horovod.spark.common.params import add_params
from horovod.spark.keras import remote

KERAS_ESTIMATOR_PARAMS: Dict[str, Tuple[Any, str]] = {
    "custom_objects": ({}, "custom Keras objects (layers, losses) by name, for loading the model"),
    "loss_weights": (None, "weight of each output's loss"),
    "checkpoint_callback": (None, "accepted for compatibility: every epoch is checkpointed to the store"),
    "tensorflow_dataset_prefetch_buffer_size": (None, "accepted for compatibility"),
    "input_shapes": (None, "shape of each feature column's array, e.g. [[-1, 8, 8, 1]]"),
}

KERAS_MODEL_PARAMS: Dict[str, Tuple[Any, str]] = {
    "custom_objects": ({}, "custom Keras objects used by the model"),
    "_floatx": (None, "keras.backend.floatx() of the training run"),
}


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    return keras


class KerasEstimator(HorovodEstimator):
    """Spark ML estimator that trains a Keras 3 model (TensorFlow backend) with Horovod on every process.

    ``model.fit`` runs on each process over its shard of the data, with ``hvd.DistributedOptimizer`` built from
    ``optimizer``'s config, ``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback()``.  One
    feature column is the model's input (several: a tuple of inputs); likewise for label columns.  Float64
    columns are fed as float32.  Every epoch rank 0 checkpoints the weights and optimizer variables to the
    store; a fit with the same ``run_id`` continues from there (``epochs`` counts across fits).
    """

    _EXTRA_PARAMS = KERAS_ESTIMATOR_PARAMS

    def _check_params(self) -> None:
        super()._check_params()
        keras = _keras()
        if not isinstance(self.getModel(), keras.Model):
            raise ValueError(f"KerasEstimator: model must be a keras.Model, got {type(self.getModel())}.")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, (keras.optimizers.Optimizer, str)):
            raise ValueError(f"KerasEstimator: optimizer must be a keras.optimizers.Optimizer (e.g. "
                             f"keras.optimizers.Adam(1e-3)) or its name, got {optimizer!r}.")
        if self.getLoss() is None:
            raise ValueError("KerasEstimator: loss is not set; pass loss=... (e.g. "
                             "'sparse_categorical_crossentropy').")

    def _fit_on_prepared_data(self, backend, store, meta, dataset_idx=None):
        keras = _keras()
        model = self.getModel()
        run_id = self._resolved_run_id()
        settings = self._settings(backend, store, meta, run_id, dataset_idx)
        settings.update({
            "custom_objects": self.getCustomObjects() or {},
            "input_shapes": self.getInputShapes(),
            "compression": self.getGradientCompression() or _no_compression(),
        })
        optimizer = self.getOptimizer()
        optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer
        compile_bytes = cloudpickle.dumps((self.getLoss(), self.getLossWeights(), self.getMetrics(),
                                           list(self.getCallbacks() or [])))
        results = backend.run(remote.train, args=(remote.model_to_bytes(model),
                                                  keras.optimizers.serialize(optimizer), compile_bytes, settings),
                              env=self.getBackendEnv())
        out = results[0]
        trained = remote.model_from_bytes(out["model"], self.getCustomObjects())
        return KerasModel(history=out["history"], model=trained, feature_columns=self._feature_cols(),
                          label_columns=self._label_cols(), custom_objects=self.getCustomObjects(),
                          run_id=run_id, _metadata=meta, _floatx=keras.backend.floatx())


def _no_compression():
    from horovod.tensorflow.compression import Compression
    return Compression.none


add_params(KerasEstimator, KERAS_ESTIMATOR_PARAMS)


class KerasModel(HorovodModel):
    """A trained Keras model; ``transform(df)`` adds its predictions (``getModel()`` is the ``keras.Model``)."""

    _EXTRA_PARAMS = KERAS_MODEL_PARAMS

    def _predict_fn(self):
        return functools.partial(_load_predictor, remote.model_to_bytes(self.getModel()),
                                 self.getCustomObjects())


add_params(KerasModel, KERAS_MODEL_PARAMS)


def _load_predictor(model_bytes: bytes, custom_objects):
    _keras()
    model = remote.model_from_bytes(model_bytes, custom_objects)

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        inputs = [f.astype(np.float32) if f.dtype == np.float64 else f for f in features]
        out = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
        out = out if isinstance(out, (list, tuple)) else [out]
        return [np.asarray(o) for o in out]
    return predict


__all__ = ["KerasEstimator", "KerasModel"]
