"""What every estimator shares: Params with the original's accessors, clear errors for bad input, the
DataFrame → Parquet preparation (vectors, arrays, validation splits), fit_on_parquet, and transform's columns."""
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow", reason="the Spark estimators need pyarrow (pip install 'horovod-next[spark]')")

import cloudpickle  # noqa: E402

from horovod.spark.common import util  # noqa: E402
from horovod.spark.common.backend import LocalBackend, SparkBackend  # noqa: E402
from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.torch import TorchEstimator, TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 1))


def mse(output, label):
    return torch.nn.functional.mse_loss(output.reshape(-1), label.reshape(-1).float())


def test_params_have_the_original_accessors(tmp_path):
    model = _model()
    est = TorchEstimator(num_proc=2, model=model, batch_size=16, feature_cols=["f"], label_cols=["y"])
    assert est.getNumProc() == 2 and est.getModel() is model and est.getBatchSize() == 16
    assert est.getEpochs() == 1 and est.getShuffle() is True and est.getBackwardPassesPerStep() == 1
    assert est.setEpochs(4) is est and est.getEpochs() == 4
    assert est.setStore(Store.create(str(tmp_path))).getStore().prefix_path == tmp_path.as_uri()
    copy = est.copy({est.batch_size: 8})
    assert copy.getBatchSize() == 8 and est.getBatchSize() == 16
    for name in ("setNumProc", "getNumProc", "setOptimizer", "getLoss", "setFeatureCols", "getLabelCols",
                 "setValidation", "getRunId", "setCallbacks", "getTrainStepsPerEpoch", "setInputShapes",
                 "getTransformationFn", "setGradientCompression", "getSampleWeightCol"):
        assert callable(getattr(est, name)), name
    with pytest.raises(TypeError, match="unknown parameters \\['no_such'\\]"):
        TorchEstimator(no_such=1)
    with pytest.raises(ValueError, match="num_proc must be a positive int"):
        SparkBackend(num_proc=0)


def test_bad_settings_are_explained(tmp_path):
    model = _model()
    good = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=mse,
                store=Store.create(str(tmp_path)), feature_cols=["f"], label_cols=["y"])
    cases = [({"store": None}, "store must be a horovod.spark.common.store.Store"),
             ({"model": None}, "model is not set"),
             ({"feature_cols": None}, "feature_cols is not set"),
             ({"label_cols": []}, "label_cols is not set"),
             ({"batch_size": 0}, "batch_size must be an int >= 1"),
             ({"loss": None}, "loss is not set"),
             ({"optimizer": torch.optim.SGD(_model().parameters(), lr=1)}, "not the model's"),
             ({"model": object()}, "model must be a torch.nn.Module")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            TorchEstimator(**{**good, **change})._check_params()
    with pytest.raises(ValueError, match="set the number of processes on the backend only"):
        TorchEstimator(**good, num_proc=3, backend=LocalBackend(2))._get_or_create_backend()


def test_prepare_data_vectors_arrays_and_validation(spark, tmp_path):
    from pyspark.ml.linalg import Vectors
    store = Store.create(str(tmp_path))
    rows = [(Vectors.dense([i, 2.0 * i]), [float(i)] * 3, i % 3, i < 4) for i in range(20)]
    df = spark.createDataFrame(rows, ["vec", "arr", "y", "is_val"])
    with pytest.raises(ValueError, match="feature columns \\['nope'\\] not found"):
        util.prepare_data(df, store, ["nope"], ["y"])
    with pytest.raises(ValueError, match="validation must be a fraction"):
        util.prepare_data(df, store, ["vec"], ["y"], validation=1.5)

    meta = util.prepare_data(df, store, ["vec", "arr"], ["y"], validation="is_val", num_partitions=3)
    assert meta["train_rows"] == 16 and meta["val_rows"] == 4
    assert meta["columns"]["vec"] == {"kind": "vector", "dtype": "float64", "shape": 2}
    assert meta["columns"]["arr"] == {"kind": "array", "dtype": "float64", "shape": 3}
    assert meta["columns"]["y"] == {"kind": "scalar", "dtype": "int64", "shape": None}
    assert util.read_metadata(store) == meta
    from horovod.spark.common.reader import read_shard
    train = read_shard(store, store.get_train_data_path(), ["vec", "y"], meta["columns"], 0, 1)
    order = np.argsort(train["vec"][:, 0])
    np.testing.assert_array_equal(train["vec"][order], [[i, 2.0 * i] for i in range(4, 20)])
    np.testing.assert_array_equal(train["y"][order], [i % 3 for i in range(4, 20)])

    # Without validation the old validation rows go away (a random fraction is covered by the fit tests).
    meta = util.prepare_data(df, store, ["vec"], ["y"])
    assert meta["train_rows"] == 20 and meta["val_rows"] == 0 and not store.exists(store.get_val_data_path())


def _rank_and_env():
    import os
    return int(os.environ["HOROVOD_RANK"]), os.environ.get("HVD_TEST_MARK")


def test_local_backend_runs_every_rank_with_its_env():
    backend = LocalBackend(2, env={"HVD_TEST_MARK": "a"})
    assert backend.num_processes() == 2
    assert backend.run(_rank_and_env) == [(0, "a"), (1, "a")]
    assert backend.run(_rank_and_env, env={"HVD_TEST_MARK": "b"}) == [(0, "b"), (1, "b")]


@pytest.mark.timeout(600)
def test_transform_output_columns_and_types(spark):
    """A hand-made model (y = x·w, and a 2-wide output for a vector label) predicts exactly what numpy does."""
    from pyspark.ml.linalg import DenseVector, Vectors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3))
    w = np.array([1.0, -2.0, 0.5])
    df = spark.createDataFrame([(Vectors.dense(a), float(a @ w), Vectors.dense([0.0, 1.0]), i)
                                for i, a in enumerate(x)], ["f", "y", "pair", "id"]).coalesce(1)
    meta = {"columns": {"f": {"kind": "vector", "dtype": "float64", "shape": 3},
                        "y": {"kind": "scalar", "dtype": "float64", "shape": None},
                        "pair": {"kind": "vector", "dtype": "float64", "shape": 2}}}
    linear = _model()
    with torch.no_grad():
        linear[0].weight.copy_(torch.tensor(np.array([w]), dtype=torch.float32))
        linear[0].bias.zero_()
    scalar = TorchModel(model=linear, feature_columns=["f"], label_columns=["y"], _metadata=meta)
    out = scalar.setOutputCols(["pred"]).transform(df)
    assert [f.simpleString() for f in out.schema.fields] == ["f:vector", "y:double", "pair:vector", "id:bigint",
                                                             "pred:double"]
    pdf = out.toPandas().sort_values("id")
    np.testing.assert_allclose(pdf["pred"], x @ w, rtol=1e-5, atol=1e-5)
    assert isinstance(pdf["f"].iloc[0], DenseVector)          # vectors come back as vectors
    with pytest.raises(ValueError, match="already exist"):
        scalar.setOutputCols(["y"]).transform(df)

    wide = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with torch.no_grad():
        wide[0].weight.copy_(torch.tensor(np.array([w, -w]), dtype=torch.float32))
        wide[0].bias.zero_()
    vector = TorchModel(model=wide, feature_columns=["f"], label_columns=["pair"], _metadata=meta)
    pdf = vector.transform(df).toPandas().sort_values("id")
    assert isinstance(pdf["pair__output"].iloc[0], DenseVector)   # a vector label gets a vector output
    np.testing.assert_allclose(np.stack([v.toArray() for v in pdf["pair__output"]]),
                               np.stack([x @ w, -(x @ w)], axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
def test_fit_on_parquet_without_spark_and_backward_passes(tmp_path):
    """Data written by pyarrow in the store's layout trains through horovod.run (LocalBackend, no Spark job);
    with backward_passes_per_step=2 the optimizer steps once per two batches, on every rank alike."""
    import json
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    store = Store.create(str(tmp_path))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    path = store.get_localized_path(store.get_train_data_path())
    table = pa.table({"f": pa.array(list(x), type=pa.list_(pa.float64())), "y": y})
    os.makedirs(path)
    for i in range(3):   # three files, so the two ranks' shards cross a file boundary
        pq.write_table(table.slice(64 * i, 64), f"{path}/part-{i}.parquet")
    store.write_text(store.get_train_data_path() + "/" + util.METADATA_FILE, json.dumps({
        "columns": {"f": {"kind": "array", "dtype": "float64", "shape": 3},
                    "y": {"kind": "scalar", "dtype": "float64", "shape": None}},
        "train_rows": 192, "val_rows": 0}))

    model = _model()
    est = TorchEstimator(backend=LocalBackend(2), store=store, model=model,
                         optimizer=torch.optim.Adam(model.parameters(), lr=0.3), loss=mse, feature_cols=["f"],
                         label_cols=["y"], batch_size=16, epochs=4, backward_passes_per_step=2, verbose=0)
    fitted = est.fit_on_parquet()
    losses = fitted.getHistory()["loss"]
    assert losses[-1] < 0.5 * losses[0]
    # 192 rows / (16 x 2 ranks) = 6 batches per epoch, 4 epochs, one optimizer step per 2 backward passes: 12,
    # plus the one zero-gradient step hvd.broadcast_optimizer_state takes to create a fresh optimizer's state.
    state = fitted.getOptimizer().state_dict()["state"]
    assert [int(s["step"]) for s in state.values()] == [1 + 12, 1 + 12]
