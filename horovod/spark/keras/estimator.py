"""``KerasEstimator``: train a Keras model (Keras 3, or Keras 2 from ``tf_keras``) with Horovod on a Spark
DataFrame; ``KerasModel`` predicts."""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle
import numpy as np

from horovod.spark.common import util
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel
from horovod.spark.common.params import add_params
from horovod.spark.keras import model_info, remote

KERAS_ESTIMATOR_PARAMS: Dict[str, Tuple[Any, str]] = {
    "custom_objects": ({}, "custom Keras objects (layers, losses) by name, for loading the model"),
    "loss_weights": (None, "weight of each output's loss"),
    "checkpoint_callback": (None, "accepted for compatibility: every epoch is checkpointed to the store"),
    "tensorflow_dataset_prefetch_buffer_size": (None, "accepted for compatibility"),
    "input_shapes": (None, "shape of each feature column's array, e.g. [[-1, 8, 8, 1]] (default: the model's "
                           "input shapes)"),
}

KERAS_MODEL_PARAMS: Dict[str, Tuple[Any, str]] = {
    "custom_objects": ({}, "custom Keras objects used by the model"),
    "_floatx": (None, "keras.backend.floatx() of the training run"),
    "input_shapes": (None, "shape of each feature column's array (default: the model's input shapes)"),
}


class KerasEstimator(HorovodEstimator):
    """Spark ML estimator that trains a Keras model with Horovod on every process: Keras 3 (TensorFlow backend),
    or Keras 2 (``tf_keras``, i.e. ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``); the model's class decides,
    and the training processes get the matching ``TF_USE_LEGACY_KERAS``.

    ``model.fit`` runs on each process over its shard of the data, with ``hvd.DistributedOptimizer`` built from
    ``optimizer``'s config, ``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback()``.  One
    feature column is the model's input (several: a tuple of inputs, in the order of ``model.inputs``); likewise
    for label columns.  As in Horovod 0.28.1 the columns take the model's shapes: a flat column of 784 values
    feeds an input of shape ``(None, 28, 28, 1)``; a label column is reshaped to its output's shape when it holds
    as many values per row (otherwise it is fed as stored, e.g. class indices for a sparse loss).  Float64
    columns are fed as float32.  Every epoch rank 0 checkpoints the weights and optimizer variables to the
    store; a fit with the same ``run_id`` continues from there (``epochs`` counts across fits).
    """

    _EXTRA_PARAMS = KERAS_ESTIMATOR_PARAMS

    def _flavour(self) -> str:
        flavour = model_info.flavour_of(self.getModel())
        if flavour is None:
            raise ValueError(f"KerasEstimator: model must be a keras.Model (Keras 3) or a tf_keras model "
                             f"(tf.keras under TF_USE_LEGACY_KERAS=1), got {type(self.getModel())}.")
        return flavour

    def _check_params(self) -> None:
        super()._check_params()
        flavour = self._flavour()
        keras = model_info.keras_module(flavour)
        if not isinstance(self.getModel(), keras.Model):
            raise ValueError(f"KerasEstimator: model must be a keras.Model (Keras 3) or a tf_keras model "
                             f"(tf.keras under TF_USE_LEGACY_KERAS=1), got {type(self.getModel())}.")
        _check_optimizer(flavour, keras, self.getOptimizer())
        if self.getLoss() is None:
            raise ValueError("KerasEstimator: loss is not set; pass loss=... (e.g. "
                             "'sparse_categorical_crossentropy').")

    def _shapes(self, meta: dict) -> Tuple[Optional[list], Optional[list]]:
        """The feature and label reshapes: the params when given, else read from the model."""
        columns = meta["columns"]
        inputs = self.getInputShapes()
        if inputs is None:
            inputs = model_info.feature_shapes(self.getModel(), self._feature_cols(), columns)
        labels = self.getLabelShapes()
        if labels is None:
            labels = model_info.label_shapes(self.getModel(), self._label_cols(), columns)
        return inputs, labels

    def _fit_on_prepared_data(self, backend, store, meta, dataset_idx=None):
        flavour = self._flavour()
        keras = model_info.keras_module(flavour)
        model = self.getModel()
        run_id = self._resolved_run_id()
        settings = self._settings(backend, store, meta, run_id, dataset_idx)
        input_shapes, label_shapes = self._shapes(meta)
        settings.update({
            "flavour": flavour,
            "custom_objects": self.getCustomObjects() or {},
            "input_shapes": input_shapes,
            "label_shapes": label_shapes,
            "compression": self.getGradientCompression() or _no_compression(),
        })
        optimizer = self.getOptimizer()
        optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer
        # Class and config: the process rebuilds the optimizer with the class of the model's Keras (also a
        # tf_keras legacy optimizer, or a subclass of the user's, which cloudpickle carries by value).
        optimizer_bytes = cloudpickle.dumps((type(optimizer), optimizer.get_config()))
        compile_bytes = cloudpickle.dumps((self.getLoss(), self.getLossWeights(), self.getMetrics(),
                                           list(self.getCallbacks() or [])))
        env = model_info.training_env(flavour)
        env.update(self.getBackendEnv() or {})
        results = backend.run(remote.train, args=(remote.model_to_bytes(model), optimizer_bytes, compile_bytes,
                                                  settings),
                              env=env)
        out = results[0]
        trained = remote.model_from_bytes(out["model"], self.getCustomObjects(), flavour=flavour)
        return KerasModel(history=out["history"], model=trained, feature_columns=self._feature_cols(),
                          label_columns=self._label_cols(), custom_objects=self.getCustomObjects(),
                          run_id=run_id, _metadata=meta, _floatx=keras.backend.floatx(),
                          input_shapes=self.getInputShapes())


def _check_optimizer(flavour: str, keras, optimizer) -> None:
    if isinstance(optimizer, str):
        return
    kinds = [keras.optimizers.Optimizer]
    if flavour == model_info.TF_KERAS:
        kinds.append(keras.optimizers.legacy.Optimizer)
    if isinstance(optimizer, tuple(kinds)):
        return
    other = model_info.flavour_of(optimizer)
    if other is not None and other != flavour:
        names = {model_info.KERAS3: "Keras 3 (keras)", model_info.TF_KERAS: "Keras 2 (tf_keras)"}
        raise ValueError(f"KerasEstimator: the model is a {names[flavour]} model but the optimizer "
                         f"{type(optimizer).__name__} is {names[other]}'s; build both with the same Keras "
                         f"(tf.keras under TF_USE_LEGACY_KERAS=1 is tf_keras).")
    example = "tf.keras.optimizers.Adam(1e-3)" if flavour == model_info.TF_KERAS else "keras.optimizers.Adam(1e-3)"
    raise ValueError(f"KerasEstimator: optimizer must be a Keras optimizer of the model's Keras (e.g. {example}) "
                     f"or its name, got {optimizer!r}.")


def _no_compression():
    from horovod.tensorflow.compression import Compression
    return Compression.none


add_params(KerasEstimator, KERAS_ESTIMATOR_PARAMS)


class KerasModel(HorovodModel):
    """A trained Keras model; ``transform(df)`` adds its predictions (``getModel()`` is the Keras model).

    Each feature column is reshaped to its model input's shape (or to ``input_shapes`` when set), as in training.
    """

    _EXTRA_PARAMS = KERAS_MODEL_PARAMS

    def _predict_fn(self):
        model = self.getModel()
        flavour = model_info.flavour_of(model) or model_info.KERAS3
        shapes = self.getInputShapes()
        if shapes is None:
            meta = (self.getMetadata() or {}).get("columns")
            features = util.as_list(self.getFeatureColumns(), "feature_columns")
            if meta and all(c in meta for c in features):
                shapes = model_info.feature_shapes(model, features, meta)
        return functools.partial(_load_predictor, remote.model_to_bytes(model), self.getCustomObjects(), flavour,
                                 shapes)


add_params(KerasModel, KERAS_MODEL_PARAMS)


def _load_predictor(model_bytes: bytes, custom_objects, flavour: str = model_info.KERAS3, shapes=None):
    model = remote.model_from_bytes(model_bytes, custom_objects, flavour=flavour)

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        inputs = remote.shaped_columns(features, shapes)
        out = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
        out = out if isinstance(out, (list, tuple)) else [out]
        return [np.asarray(o) for o in out]
    return predict


__all__ = ["KerasEstimator", "KerasModel"]
