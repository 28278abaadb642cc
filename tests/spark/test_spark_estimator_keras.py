"""KerasEstimator end to end on the shared Spark cluster: fit on scikit-learn's digits through Spark tasks,
transform with accuracy far above chance, and a second fit with the same run_id that resumes its checkpoint."""
import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")
pytest.importorskip("pyarrow", reason="the Spark estimators need pyarrow (pip install 'horovod-next[spark]')")

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.keras import KerasEstimator, KerasModel  # noqa: E402


def digits_df(spark):
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), int(y)) for x, y in zip(digits.data, digits.target)]
    # Two partitions: transform() starts one Python worker (which imports TensorFlow) per partition.
    return spark.createDataFrame(rows, ["features", "label"]).coalesce(2)


@pytest.mark.timeout(900)
def test_fit_transform_and_resume_from_checkpoint(spark, tmp_path):
    df = digits_df(spark)
    store = Store.create(str(tmp_path / "store"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    estimator = KerasEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(0.01),
                               loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                               feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=2,
                               validation=0.1, run_id="keras_digits", partitions_per_process=1, random_seed=1,
                               verbose=0)
    first = estimator.fit(df)

    assert isinstance(first, KerasModel) and first.getRunId() == "keras_digits"
    history = first.getHistory()
    assert history["epoch"] == [0, 1]
    assert history["loss"][1] < history["loss"][0]
    assert history["accuracy"][1] > 0.7 and len(history["val_loss"]) == 2
    # The last checkpoint (rank 0, every epoch) holds exactly the returned weights.
    base = store.get_checkpoint_path("keras_digits") + "/" + store.get_checkpoint_filename()
    assert json.loads(store.read(base + ".json"))["epoch"] == 2
    with np.load(io.BytesIO(store.read(base + ".npz"))) as saved:
        for i, weight in enumerate(first.getModel().get_weights()):
            np.testing.assert_array_equal(saved[f"w{i}"], weight)

    predicted = first.transform(df)
    assert predicted.columns == ["features", "label", "label__output"]
    pdf = predicted.toPandas()
    assert len(pdf) == 1797
    predicted_labels = np.array([np.argmax(p) for p in pdf["label__output"]])
    assert np.mean(predicted_labels == pdf["label"].to_numpy()) > 0.8           # chance is 0.1

    # Same run_id, epochs=3: loads the checkpoint of epoch 2 and trains one more epoch.  The same DataFrame
    # is not written again: Spark names every file it writes anew, so the names would show a rewrite.
    train_files = sorted(store.get_parquet_dataset(store.get_train_data_path()).files)
    second = estimator.setEpochs(3).fit(df)
    assert sorted(store.get_parquet_dataset(store.get_train_data_path()).files) == train_files
    resumed = second.getHistory()
    assert resumed["epoch"] == [0, 1, 2]
    assert resumed["loss"][:2] == history["loss"]
    assert resumed["loss"][2] < history["loss"][1]
