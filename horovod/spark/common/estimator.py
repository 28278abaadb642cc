"""The Spark ML bases of the estimators: ``HorovodEstimator.fit(df)`` → ``HorovodModel``; ``transform(df)``.

``fit`` writes the DataFrame to the store as Parquet (:mod:`horovod.spark.common.util`), runs the framework's
training function on every process through the backend (each process reads its shard, see
:mod:`horovod.spark.common.reader`), and builds the model from what rank 0 returns.  ``transform`` runs the
model in ``mapInPandas``: the model is deserialised once per partition, not once per batch.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence

import numpy as np
from pyspark.ml import Estimator, Model

from horovod.spark.common import util
from horovod.spark.common.backend import Backend, SparkBackend
from horovod.spark.common.params import ESTIMATOR_PARAMS, MODEL_PARAMS, add_params, set_defaults, set_given
from horovod.spark.common.store import Store


class HorovodEstimator(Estimator):
    """Base of the framework estimators; subclasses implement :meth:`_fit_on_prepared_data`."""

    _EXTRA_PARAMS: Dict[str, tuple] = {}

    if TYPE_CHECKING:
        # The getX/setX accessors are generated from the parameter tables (params.add_params): typed as Any.
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, **kwargs) -> None:
        super().__init__()
        set_defaults(self, [ESTIMATOR_PARAMS, self._EXTRA_PARAMS])
        set_given(self, kwargs)

    def setParams(self, **kwargs):
        set_given(self, kwargs)
        return self

    # -- fitting -----------------------------------------------------------------------------------------------
    def fit(self, df, params=None):
        """Train on ``df`` and return the trained model (a Spark ML ``Model``).

        ``params`` (a dict of Param → value) overrides this estimator's params for this fit only.
        """
        return super().fit(df, params)

    def _fit(self, df):
        self._check_params()
        backend = self._get_or_create_backend()
        store = self.getStore()
        args = dict(feature_cols=self._feature_cols(), label_cols=self._label_cols(),
                    validation=self.getValidation(), sample_weight_col=self.getSampleWeightCol(),
                    num_partitions=backend.num_processes() * (self.getPartitionsPerProcess() or 1),
                    random_seed=self.getRandomSeed())
        meta = _prepared_before(store, df, args)
        if meta is None:
            meta = util.prepare_data(df, store, **args)
            _remember_prepared(store, df, args, meta)
        return self._fit_on_prepared_data(backend, store, meta, dataset_idx=None)

    def fit_on_parquet(self, params=None, dataset_idx=None):
        """Train on data a previous ``fit`` (or the user) left in the store, without a DataFrame."""
        if params:
            return self.copy(params).fit_on_parquet(dataset_idx=dataset_idx)
        self._check_params()
        store = self.getStore()
        meta = util.read_metadata(store, dataset_idx)
        needed = self._feature_cols() + self._label_cols()
        missing = [c for c in needed if c not in meta["columns"]]
        if missing:
            raise ValueError(f"columns {missing} are not in the prepared data at "
                             f"{store.get_train_data_path(dataset_idx)} (it has {sorted(meta['columns'])}).")
        return self._fit_on_prepared_data(self._get_or_create_backend(), store, meta, dataset_idx=dataset_idx)

    def _fit_on_prepared_data(self, backend: Backend, store: Store, meta: dict, dataset_idx=None):
        raise NotImplementedError()

    # -- helpers for subclasses --------------------------------------------------------------------------------
    def _feature_cols(self) -> List[str]:
        return util.as_list(self.getFeatureCols(), "feature_cols")

    def _label_cols(self) -> List[str]:
        return util.as_list(self.getLabelCols(), "label_cols")

    def _check_params(self) -> None:
        name = type(self).__name__
        if self.getModel() is None:
            raise ValueError(f"{name}: model is not set; pass model=... (the model to train).")
        if not isinstance(self.getStore(), Store):
            raise ValueError(f"{name}: store must be a horovod.spark.common.store.Store (e.g. "
                             f"Store.create('/tmp/horovod')), got {self.getStore()!r}.")
        if not self._feature_cols():
            raise ValueError(f"{name}: feature_cols is not set; name the columns the model reads.")
        if not self._label_cols():
            raise ValueError(f"{name}: label_cols is not set; name the columns the model predicts.")
        for param in ("batch_size", "epochs"):
            value = self.getOrDefault(param)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if param == "batch_size" else 0):
                raise ValueError(f"{name}: {param} must be an int >= {1 if param == 'batch_size' else 0}, "
                                 f"got {value!r}.")

    def _get_or_create_backend(self) -> Backend:
        backend = self.getBackend()
        num_proc = self.getNumProc()
        if backend is None:
            return SparkBackend(num_proc, env=self.getBackendEnv())
        if num_proc is not None and num_proc != backend.num_processes():
            raise ValueError(f"num_proc={num_proc} and a backend with {backend.num_processes()} processes were "
                             f"both given: set the number of processes on the backend only.")
        if not isinstance(backend, Backend):
            raise ValueError(f"backend must be a horovod.spark.common.backend.Backend, got {backend!r}.")
        return backend

    def _resolved_run_id(self) -> str:
        run_id = self.getRunId()
        if run_id is None:
            # A fresh run per fit; the estimator keeps no run_id, so a second fit does not resume this one.
            run_id = f"run_{int(time.time())}_{uuid.uuid4().hex[:8]}"
        return run_id

    def _settings(self, backend: Backend, store: Store, meta: dict, run_id: str, dataset_idx) -> dict:
        """What every training process needs, as plain picklable values."""
        batch_size = self.getBatchSize()
        return {
            "store": store,
            "run_id": run_id,
            "dataset_idx": dataset_idx,
            "train_path": store.get_train_data_path(dataset_idx),
            "val_path": store.get_val_data_path(dataset_idx) if meta.get("val_rows") else None,
            "meta": meta,
            "feature_cols": self._feature_cols(),
            "label_cols": self._label_cols(),
            "sample_weight_col": self.getSampleWeightCol(),
            "batch_size": batch_size,
            "val_batch_size": self.getValBatchSize() or batch_size,
            "epochs": self.getEpochs(),
            "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            "validation_steps_per_epoch": self.getValidationStepsPerEpoch(),
            "shuffle": self.getShuffle(),
            "random_seed": self.getRandomSeed(),
            "verbose": self.getVerbose(),
            "transformation_fn": self.getTransformationFn(),
            "label_shapes": self.getLabelShapes(),
            "num_proc": backend.num_processes(),
        }


add_params(HorovodEstimator, ESTIMATOR_PARAMS)


# Fitting the same DataFrame again (another model, or resuming a run) reuses the Parquet data already in the
# store, as the original did: the key is the DataFrame's plan (semanticHash) and the preparation arguments.
def _preparation_key(df, args: dict):
    try:
        plan = df.semanticHash()
    except Exception:   # e.g. Spark Connect without the method: never reuse
        return None
    return repr((plan, sorted(args.items())))


def _prepared_before(store, df, args):
    key = _preparation_key(df, args)
    cache = getattr(store, "_prepared_data", {})
    meta = cache.get(key) if key is not None else None
    if meta is not None:
        try:
            if util.read_metadata(store) == meta:   # still there, and not replaced by another fit's data
                return meta
        except ValueError:
            pass
    return None


def _remember_prepared(store, df, args, meta) -> None:
    key = _preparation_key(df, args)
    if key is not None:
        # Only the latest: every fit(df) writes to the same dataset path of the store.
        store._prepared_data = {key: meta}


class HorovodModel(Model):
    """Base of the trained models; subclasses give :meth:`_predict_fn`, a picklable batch predictor."""

    _EXTRA_PARAMS: Dict[str, tuple] = {}

    if TYPE_CHECKING:
        # The getX/setX accessors are generated from the parameter tables (params.add_params): typed as Any.
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, **kwargs) -> None:
        super().__init__()
        set_defaults(self, [MODEL_PARAMS, self._EXTRA_PARAMS])
        set_given(self, kwargs)

    def setParams(self, **kwargs):
        set_given(self, kwargs)
        return self

    def transform(self, df, params=None):
        """``df`` with one prediction column per label column (``<label>__output`` unless ``output_cols``)."""
        return super().transform(df, params)

    def _output_cols(self) -> List[str]:
        cols = self.getOutputCols()
        if cols is None:
            return [f"{label}__output" for label in self.getLabelColumns()]
        return util.as_list(cols, "output_cols")

    def _predict_fn(self) -> Callable[[Sequence[np.ndarray]], List[np.ndarray]]:
        """A picklable function: feature arrays (one per feature column, rows first) → one array per output.

        It is called once per partition with no arguments to load the model (``loader()`` returns the
        predictor), so implementations return ``functools.partial(load, model_bytes)``-style callables.
        """
        raise NotImplementedError()

    def _transform(self, df):
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        features = util.as_list(self.getFeatureColumns(), "feature_columns")
        outputs = self._output_cols()
        util.check_columns(df, features, "feature columns")
        clash = [c for c in outputs if c in df.columns]
        if clash:
            raise ValueError(f"output columns {clash} already exist in the DataFrame; choose other names with "
                             f"setOutputCols([...]).")
        meta = self.getMetadata()["columns"]
        vector_cols = [f.name for f in df.schema.fields if util._is_vector(f.dataType)]
        arrays = util.vectors_to_arrays(df)   # Arrow carries no vectors: round-trip them as arrays

        loader = self._predict_fn()
        # The width of each output decides its column type: one row of zeros predicted here tells it.
        probe = [np.zeros((1,) if meta[c]["kind"] == "scalar" else (1, meta[c]["shape"]), dtype=meta[c]["dtype"])
                 for c in features]
        predicted = loader()(probe)
        if len(predicted) != len(outputs):
            raise ValueError(f"the model gives {len(predicted)} outputs but there are {len(outputs)} output "
                             f"columns {outputs}; set output_cols to one name per model output.")
        widths = [int(np.prod(np.shape(p)[1:])) for p in predicted]
        out_fields = [StructField(name, DoubleType() if width == 1 else ArrayType(DoubleType()), True)
                      for name, width in zip(outputs, widths)]
        schema = StructType(arrays.schema.fields + out_fields)
        label_vector = {out for out, label in zip(outputs, self.getLabelColumns())
                        if meta.get(label, {}).get("kind") == "vector"}
        partition_fn = _PartitionPredictor(loader, features, {c: meta[c] for c in features}, outputs, widths)
        result = arrays.mapInPandas(partition_fn, schema)
        for name in vector_cols:
            result = result.withColumn(name, array_to_vector(result[name]))
        for name, width in zip(outputs, widths):
            if name in label_vector and width > 1:
                result = result.withColumn(name, array_to_vector(result[name]))
        return result


add_params(HorovodModel, MODEL_PARAMS)


class _PartitionPredictor:
    """The ``mapInPandas`` function: loads the model once, then predicts every batch of the partition."""

    def __init__(self, loader, features, feature_meta, outputs, widths) -> None:
        self.loader = loader
        self.features = features
        self.feature_meta = feature_meta
        self.outputs = outputs
        self.widths = widths

    def __call__(self, batches):
        predict = None
        for pdf in batches:
            if predict is None:
                predict = self.loader()
            inputs = [util.pandas_to_numpy(pdf[c], self.feature_meta[c]) for c in self.features]
            predicted = predict(inputs) if len(pdf) else [np.zeros((0, w)) for w in self.widths]
            pdf = pdf.copy()
            for name, width, values in zip(self.outputs, self.widths, predicted):
                values = np.asarray(values, dtype=np.float64).reshape(len(pdf), -1)
                pdf[name] = values[:, 0] if width == 1 else list(values)
            yield pdf
