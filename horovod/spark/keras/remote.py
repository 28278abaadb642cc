"""The training function of :class:`horovod.spark.keras.KerasEstimator`, run on every Horovod process.

Models travel as ``.keras`` archive bytes (both Keras 3 and tf_keras write and read that format).  The process
uses the model's Keras (``settings["flavour"]``), and its ``tf.keras`` must be that Keras too, since Horovod's
callbacks and optimizer wrapper follow ``tf.keras``: the estimator sets ``TF_USE_LEGACY_KERAS`` for the process.

The checkpoint of a run is two files in the run's directory:
``<checkpoint filename>.npz`` (model weights and optimizer variables, numpy only: nothing is unpickled on load)
and ``<checkpoint filename>.json`` (epochs done and the history), written after the weights, so a present JSON
always describes complete weights.
"""
from __future__ import annotations

import io
import json
import os
import posixpath
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle
import numpy as np

from horovod.spark.common import reader
from horovod.spark.common.reader import load_shard
from horovod.spark.keras import model_info


def checkpoint_files(store, run_id: str) -> Optional[Tuple[str, str]]:
    path = store.get_checkpoint_path(run_id)
    if path is None:
        return None
    base = posixpath.join(path, store.get_checkpoint_filename())
    return base + ".npz", base + ".json"


def model_to_bytes(model) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects=None, compile: bool = False, flavour: str = model_info.KERAS3):
    keras = model_info.keras_module(flavour)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or {}, compile=compile)


def _optimizer_variables(optimizer) -> list:
    # A property in Keras 3, a method in tf_keras's legacy optimizers, a callable list in its new ones.
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _build_optimizer(optimizer, model) -> None:
    """Create the optimizer's variables (slots) so that a checkpoint's values can be assigned to them."""
    if hasattr(optimizer, "_create_all_weights") and not hasattr(optimizer, "build"):
        optimizer._create_all_weights(model.trainable_variables)     # tf_keras legacy (OptimizerV2)
    elif not getattr(optimizer, "built", False) and not getattr(optimizer, "_built", False):
        optimizer.build(model.trainable_variables)


def _pack(model, optimizer) -> bytes:
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"o{i}": np.asarray(v) for i, v in enumerate(_optimizer_variables(optimizer))})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _unpack(data: bytes, model, optimizer) -> None:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        weights = [archive[f"w{i}"] for i in range(sum(k.startswith("w") for k in archive.files))]
        opt_values = [archive[f"o{i}"] for i in range(sum(k.startswith("o") for k in archive.files))]
    model.set_weights(weights)
    _build_optimizer(optimizer, model)
    variables = _optimizer_variables(optimizer)
    if len(opt_values) != len(variables):
        raise ValueError(f"the checkpoint holds {len(opt_values)} optimizer variables, this optimizer has "
                         f"{len(variables)}: was the run trained with another optimizer?")
    for variable, value in zip(variables, opt_values):
        variable.assign(value)


def shaped_columns(columns: List[np.ndarray], shapes) -> List[np.ndarray]:
    """Each column (rows first) reshaped to its shape (``[-1, d1, ...]``, the original's form, or one row's
    ``[d1, ...]``; ``None``: as it is), float64 made float32."""
    values = []
    for i, a in enumerate(columns):
        if shapes and shapes[i] is not None:
            dims = list(shapes[i])
            if dims and dims[0] in (-1, None):
                dims = dims[1:]
            try:
                a = a.reshape(len(a), *[-1 if d is None else d for d in dims])
            except ValueError as exc:
                raise ValueError(f"column {i} holds {a.shape[1:]} values per row and cannot take the shape "
                                 f"{list(shapes[i])}: set input_shapes/label_shapes to match the model, or "
                                 f"leave them unset to use the model's ({exc})") from None
        values.append(a.astype(np.float32) if a.dtype == np.float64 else a)
    return values


def _columns(arrays: Dict[str, np.ndarray], cols, shapes):
    values = shaped_columns([arrays[c] for c in cols], shapes)
    return values[0] if len(values) == 1 else tuple(values)


def _dataset(arrays, settings, batch_size: int, training: bool, seed):
    import tensorflow as tf
    x = _columns(arrays, settings["feature_cols"], settings.get("input_shapes"))
    y = _columns(arrays, settings["label_cols"], settings.get("label_shapes"))
    weight_col = settings.get("sample_weight_col")
    parts = (x, y, arrays[weight_col].astype(np.float32)) if weight_col else (x, y)
    ds = tf.data.Dataset.from_tensor_slices(parts)
    rows = len(arrays[settings["label_cols"][0]])
    if training and settings["shuffle"]:
        ds = ds.shuffle(rows, seed=seed, reshuffle_each_iteration=True)
    # Repeated: every rank runs the same number of steps whatever the size of its shard.
    return ds.repeat().batch(batch_size).prefetch(2)


def train(model_bytes: bytes, optimizer_bytes: bytes, compile_bytes: bytes, settings: Dict[str, Any]):
    flavour = settings.get("flavour", model_info.KERAS3)
    keras = model_info.keras_module(flavour)

    import horovod.tensorflow.keras as hvd
    from horovod._keras.flavour import is_tf_keras

    if is_tf_keras() != (flavour == model_info.TF_KERAS):
        active = "tf_keras" if is_tf_keras() else "Keras 3"
        raise RuntimeError(f"the model is a {'tf_keras' if flavour == model_info.TF_KERAS else 'Keras 3'} model, "
                           f"but tf.keras is {active} in this training process (TF_USE_LEGACY_KERAS="
                           f"{os.environ.get('TF_USE_LEGACY_KERAS')!r}); Horovod's callbacks follow tf.keras. "
                           f"TF_USE_LEGACY_KERAS must be set before TensorFlow is imported: the estimator sets it "
                           f"in the processes' environment; do not override it in backend_env.")
    hvd.init()
    try:
        return _train(keras, hvd, model_bytes, optimizer_bytes, compile_bytes, settings)
    finally:
        hvd.shutdown()


def _train(keras, hvd, model_bytes, optimizer_bytes, compile_bytes, settings):
    rank, size = hvd.rank(), hvd.size()
    store, run_id = settings["store"], settings["run_id"]
    seed = settings.get("random_seed")
    if seed is not None:
        keras.utils.set_random_seed(seed)
    custom_objects = settings.get("custom_objects") or {}
    loss, loss_weights, metrics, user_callbacks = cloudpickle.loads(compile_bytes)
    model = model_from_bytes(model_bytes, custom_objects, flavour=settings.get("flavour", model_info.KERAS3))
    optimizer_cls, optimizer_config = cloudpickle.loads(optimizer_bytes)
    optimizer = hvd.DistributedOptimizer(optimizer_cls.from_config(optimizer_config, custom_objects=custom_objects),
                                         compression=settings["compression"])
    model.compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics)

    # Resume: rank 0 reads the run's checkpoint, every rank gets it.
    files = checkpoint_files(store, run_id)
    blob = None
    if rank == 0 and files and store.exists(files[1]):
        blob = (store.read(files[0]), json.loads(store.read(files[1])))
    from horovod.tensorflow import broadcast_object
    blob = broadcast_object(blob, 0, name="spark_keras_checkpoint")
    start_epoch, history = 0, {}
    if blob is not None:
        _unpack(blob[0], model, optimizer)
        start_epoch, history = int(blob[1]["epoch"]), blob[1]["history"]

    columns = reader.data_columns(settings)
    meta = settings["meta"]
    train_data = load_shard(settings, settings["train_path"], columns, rank, size)
    if len(train_data[columns[0]]) == 0:
        raise ValueError("this process's shard of the data is empty: there are fewer rows than processes; use "
                         "fewer processes (num_proc) or more data.")
    steps = reader.steps_per_epoch(meta["train_rows"], settings["batch_size"], size,
                                   settings.get("train_steps_per_epoch"))
    fit_args = {}
    if settings["val_path"]:
        val_data = load_shard(settings, settings["val_path"], columns, rank, size)
        if len(val_data[columns[0]]) == 0:   # fewer validation rows than ranks: evaluate rank 0's rows
            val_data = load_shard(settings, settings["val_path"], columns, 0, size)
        vbs = settings["val_batch_size"]
        fit_args["validation_data"] = _dataset(val_data, settings, vbs, False, None)
        # Enough steps to see every validation row (a smaller shard wraps around a few rows).
        fit_args["validation_steps"] = settings.get("validation_steps_per_epoch") or \
            max(1, -(-meta["val_rows"] // (vbs * size)))

    epochs = settings["epochs"]
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    callbacks += list(user_callbacks or [])
    recorder = _Recorder(keras, history, store, files, rank, model, optimizer)
    callbacks.append(recorder)
    if start_epoch < epochs:
        model.fit(_dataset(train_data, settings, settings["batch_size"], True, None if seed is None else seed + rank),
                  steps_per_epoch=steps, epochs=epochs, initial_epoch=start_epoch, callbacks=callbacks,
                  verbose=settings.get("verbose", 1) if rank == 0 else 0, shuffle=False, **fit_args)
    if rank != 0:
        return None
    return {"model": model_to_bytes(model), "history": history, "start_epoch": start_epoch}


class _Recorder:
    """Keras callback (built lazily: keras is imported in the process) that keeps the history across fits and
    checkpoints on rank 0 after every epoch."""

    def __new__(cls, keras, history, store, files, rank, model, optimizer):
        class Recorder(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                history.setdefault("epoch", []).append(epoch)
                for key, value in (logs or {}).items():
                    history.setdefault(key, []).append(float(value))
                if rank == 0 and files:
                    store.write(files[0], _pack(model, optimizer))
                    store.write_text(files[1], json.dumps({"epoch": epoch + 1, "history": history}))
        return Recorder()
