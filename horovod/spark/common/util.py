"""DataFrame → Parquet in the store, and the column handling both sides need (driver and training processes).

Spark ML vectors cannot travel through Parquet readers or Arrow as vectors, so a vector column is stored as
``array<double>`` and its length recorded in the dataset's metadata (``_horovod_metadata.json`` next to the
Parquet files; names starting with ``_`` are ignored by Parquet readers).  The metadata says, for every
column, whether it was a ``vector``, an ``array`` or a ``scalar``, its length and its numpy dtype.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

METADATA_FILE = "_horovod_metadata.json"
VALIDATION_COL = "__horovod_validation"


def as_list(value, name: str) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a column name or a list of column names, got {value!r}.") from None
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{name} must contain column names (strings), got {item!r} in {value!r}.")
    return items


def check_columns(df, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{what} {missing} not found in the DataFrame; its columns are {df.columns}.")


def _is_vector(data_type) -> bool:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    return isinstance(data_type, (VectorUDT, OldVectorUDT))


_NUMPY_OF_SPARK = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
                   "FloatType": "float32", "DoubleType": "float64", "BooleanType": "bool"}


def _column_kind(data_type) -> Tuple[str, str]:
    """(kind, numpy dtype) of a Spark column type the estimators can train on."""
    from pyspark.sql.types import ArrayType
    if _is_vector(data_type):
        return "vector", "float64"
    if isinstance(data_type, ArrayType):
        inner = type(data_type.elementType).__name__
        if inner in _NUMPY_OF_SPARK:
            return "array", _NUMPY_OF_SPARK[inner]
    else:
        name = type(data_type).__name__
        if name in _NUMPY_OF_SPARK:
            return "scalar", _NUMPY_OF_SPARK[name]
    raise ValueError(f"cannot train on a column of type {data_type.simpleString()}: use numeric scalars, "
                     f"arrays of numbers or Spark ML vectors.")


def vectors_to_arrays(df, columns: Optional[Sequence[str]] = None):
    """``df`` with every vector column (of ``columns``, default all) replaced by an ``array<double>`` column."""
    from pyspark.ml.functions import vector_to_array
    for field in df.schema.fields:
        if (columns is None or field.name in columns) and _is_vector(field.dataType):
            df = df.withColumn(field.name, vector_to_array(df[field.name], "float64"))
    return df


def column_metadata(df, columns: Sequence[str]) -> Dict[str, dict]:
    """Kind, dtype and length of each column; lengths of array/vector columns come from the first row."""
    meta: Dict[str, dict] = {}
    fields = {f.name: f for f in df.schema.fields}
    for name in columns:
        kind, dtype = _column_kind(fields[name].dataType)
        meta[name] = {"kind": kind, "dtype": dtype, "shape": None}
    sized = [name for name in columns if meta[name]["kind"] != "scalar"]
    if sized:
        from pyspark.sql import functions as F
        first = vectors_to_arrays(df.select(*sized)).select(*[F.size(c).alias(c) for c in sized]).head(1)
        if not first:
            raise ValueError("the DataFrame has no rows: there is nothing to train on.")
        for name in sized:
            meta[name]["shape"] = int(first[0][name])
    return meta


def prepare_data(df, store, feature_cols: Sequence[str], label_cols: Sequence[str], validation=None,
                 sample_weight_col: Optional[str] = None, num_partitions: Optional[int] = None, dataset_idx=None,
                 random_seed: Optional[int] = None) -> dict:
    """Write the training (and validation) rows of ``df`` to ``store`` as Parquet; return the dataset metadata.

    ``validation`` is a fraction of rows picked at random (a float in [0, 1)) or the name of a column whose true
    (or non-zero) rows are the validation rows.  The metadata holds the row counts and per-column information
    and is also written next to the data, so :meth:`fit_on_parquet` can read it back.
    """
    from pyspark.sql import functions as F

    columns = list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col else [])
    check_columns(df, feature_cols, "feature columns")
    check_columns(df, label_cols, "label columns")
    if sample_weight_col:
        check_columns(df, [sample_weight_col], "sample weight column")
    if len(set(columns)) != len(columns):
        raise ValueError(f"a column appears twice among the feature, label and sample weight columns: {columns}.")

    if isinstance(validation, str):
        check_columns(df, [validation], "validation column")
        selected = df.select(*columns, F.col(validation).cast("boolean").alias(VALIDATION_COL))
    elif validation is None or validation == 0:
        selected = df.select(*columns)
    elif isinstance(validation, (int, float)) and 0 < validation < 1:
        selected = df.select(*columns, (F.rand(random_seed) < float(validation)).alias(VALIDATION_COL))
    else:
        raise ValueError(f"validation must be a fraction in [0, 1) or the name of a column marking validation "
                         f"rows, got {validation!r}.")

    meta: Dict[str, Any] = {"columns": column_metadata(df, columns)}
    selected = vectors_to_arrays(selected, columns)
    if num_partitions:
        selected = selected.repartition(int(num_partitions))

    train_path = store.get_train_data_path(dataset_idx)
    val_path = store.get_val_data_path(dataset_idx)
    if VALIDATION_COL in selected.columns:
        selected = selected.cache()
        try:
            selected.filter(~F.col(VALIDATION_COL)).drop(VALIDATION_COL).write.mode("overwrite").parquet(train_path)
            selected.filter(F.col(VALIDATION_COL)).drop(VALIDATION_COL).write.mode("overwrite").parquet(val_path)
        finally:
            selected.unpersist()
    else:
        selected.write.mode("overwrite").parquet(train_path)
        if store.exists(val_path):
            store.delete(val_path)   # stale validation rows of an earlier fit must not be used

    meta["train_rows"] = count_rows(store, train_path)
    meta["val_rows"] = count_rows(store, val_path) if store.exists(val_path) else 0
    if meta["train_rows"] == 0:
        raise ValueError("no training rows are left after the validation split: lower validation.")
    store.write_text(posixpath.join(train_path, METADATA_FILE), json.dumps(meta))
    return meta


def read_metadata(store, dataset_idx=None) -> dict:
    path = posixpath.join(store.get_train_data_path(dataset_idx), METADATA_FILE)
    if not store.exists(path):
        raise ValueError(f"no prepared training data in the store at {store.get_train_data_path(dataset_idx)} "
                         f"(missing {METADATA_FILE}); call fit(df) first, which writes it.")
    return json.loads(store.read(path))


def count_rows(store, path: str) -> int:
    dataset = store.get_parquet_dataset(path)
    return sum(fragment.metadata.num_rows for fragment in dataset.fragments)


def to_numpy(column, meta: dict) -> np.ndarray:
    """A pyarrow column as numpy: scalars as (n,), arrays and vectors as (n, length)."""
    import pyarrow as pa
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if meta["kind"] == "scalar":
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=meta["dtype"])
    lengths = np.asarray(column.value_lengths().to_numpy(zero_copy_only=False)) if len(column) else np.zeros(0)
    if len(column) and (lengths != meta["shape"]).any():
        bad = int(np.flatnonzero(lengths != meta["shape"])[0])
        raise ValueError(f"row {bad} of an array column has {lengths[bad]} values, expected {meta['shape']} "
                         f"(every row of a feature or label column must have the same length).")
    values = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=meta["dtype"])
    return values.reshape(len(column), meta["shape"])


def pandas_to_numpy(series, meta: dict) -> np.ndarray:
    """A pandas column of transform()'s input (arrays already converted from vectors) as numpy."""
    if meta["kind"] == "scalar":
        return series.to_numpy(dtype=meta["dtype"])
    if len(series) == 0:
        return np.zeros((0, meta["shape"]), dtype=meta["dtype"])
    return np.stack([np.asarray(v, dtype=meta["dtype"]) for v in series])
