"""What the Keras estimator reads from the model: which Keras it belongs to, and the shapes of its inputs and
outputs, which decide how the stored columns are reshaped (as Horovod 0.28.1's estimator did).

Two Keras flavours are accepted: Keras 3 (``keras``, TensorFlow backend) and Keras 2 (``tf_keras``, which is
``tf.keras`` when ``TF_USE_LEGACY_KERAS=1`` was set before TensorFlow was imported).  The flavour is read from
the model's class, so deciding it imports neither package.
"""
from __future__ import annotations

import math
import os
from types import ModuleType
from typing import Dict, List, Optional, Sequence

KERAS3 = "keras3"
TF_KERAS = "tf_keras"


def _class_modules(obj) -> List[str]:
    return [c.__module__ or "" for c in type(obj).__mro__]


def flavour_of(obj) -> Optional[str]:
    """``TF_KERAS`` for a tf_keras object (model, layer, optimizer), ``KERAS3`` for a Keras 3 one, else None."""
    modules = _class_modules(obj)
    if any(m == "tf_keras" or m.startswith("tf_keras.") for m in modules):
        return TF_KERAS
    if any(m == "keras" or m.startswith("keras.") for m in modules):
        return KERAS3
    return None


def keras_module(flavour: str) -> ModuleType:
    """The package of ``flavour``: ``tf_keras``, or ``keras`` (Keras 3 on the TensorFlow backend)."""
    if flavour == TF_KERAS:
        import tf_keras
        return tf_keras
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    return keras


def training_env(flavour: str) -> Dict[str, str]:
    """Environment the training processes need so that ``tf.keras`` (which Horovod's callbacks and optimizer
    follow) is the model's Keras: it must be set before TensorFlow is imported, hence at process start."""
    if flavour == TF_KERAS:
        return {"TF_USE_LEGACY_KERAS": "1"}
    return {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "tensorflow"}


def _shape_list(tensors) -> Optional[List[List[Optional[int]]]]:
    shapes = []
    for tensor in tensors:
        shape = tensor.shape
        dims = shape.as_list() if hasattr(shape, "as_list") else list(shape)
        shapes.append([None if d is None else int(d) for d in dims])
    return shapes


def model_shapes(model, which: str) -> Optional[List[List[Optional[int]]]]:
    """The shapes of the model's ``inputs`` or ``outputs`` (batch dimension first, ``None`` where unknown), or
    None when the model does not know them (a subclassed model, a Sequential model without an input shape)."""
    try:
        tensors = getattr(model, which)
    except (AttributeError, ValueError):
        return None
    if not tensors:
        return None
    return _shape_list(tensors if isinstance(tensors, (list, tuple)) else [tensors])


def _values_per_row(column_meta: dict) -> int:
    return 1 if column_meta["kind"] == "scalar" else int(column_meta["shape"])


def _row_dims(shape: Sequence[Optional[int]]) -> List[Optional[int]]:
    return [None if d in (None, -1) else int(d) for d in list(shape)[1:]]


def feature_shapes(model, columns: Sequence[str], meta: Dict[str, dict]) -> Optional[List[Optional[List[int]]]]:
    """How to reshape each feature column for the model: one ``[-1, d1, d2, ...]`` per column (``None``: as
    stored), from the model's inputs in column order, or None when the model gives no input shapes.

    Raises:
        ValueError: the number of columns differs from the model's inputs, or a column holds another number of
            values per row than its input takes.
    """
    shapes = model_shapes(model, "inputs")
    if shapes is None:
        return None
    if len(shapes) != len(columns):
        raise ValueError(f"KerasEstimator: the model has {len(shapes)} inputs {shapes} but {len(columns)} feature "
                         f"columns {list(columns)} were given; give one feature column per model input, in the "
                         f"order of model.inputs.")
    out: List[Optional[List[int]]] = []
    for index, (column, shape) in enumerate(zip(columns, shapes)):
        out.append(_fit(column, meta[column], shape, f"model input {index}", strict=True))
    return out


def label_shapes(model, columns: Sequence[str], meta: Dict[str, dict]) -> Optional[List[Optional[List[int]]]]:
    """How to reshape each label column: to its output's shape when it holds as many values per row (a scalar
    label for an output of shape ``(None, 1)``, a one-hot vector of 10 for ``(None, 10)``); otherwise as stored
    (a class index for a softmax output of 10, as sparse losses take)."""
    shapes = model_shapes(model, "outputs")
    if shapes is None or len(shapes) != len(columns):
        return None
    return [_fit(column, meta[column], shape, f"model output {i}", strict=False)
            for i, (column, shape) in enumerate(zip(columns, shapes))]


def _fit(column: str, column_meta: dict, shape: Sequence[Optional[int]], what: str,
         strict: bool) -> Optional[List[int]]:
    dims = _row_dims(shape)
    values = _values_per_row(column_meta)
    unknown = [i for i, d in enumerate(dims) if d is None]
    known = math.prod(d for d in dims if d is not None)
    if len(unknown) > 1:
        return None                                   # e.g. (None, None, None, 3): fed as stored
    if len(unknown) == 1:
        if values % known == 0:
            return [-1] + [-1 if d is None else d for d in dims]
    elif known == values:
        return [-1] + [d for d in dims if d is not None]      # (there is no None left)
    if strict:
        raise ValueError(f"KerasEstimator: feature column {column!r} holds {values} value(s) per row, but "
                         f"{what} has shape {tuple(shape)} ({known} values per row): the column cannot be "
                         f"reshaped to it. Check feature_cols' order against model.inputs, or the model's "
                         f"input shape.")
    return None
