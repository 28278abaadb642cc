"""TorchEstimator end to end on the shared Spark cluster: fit on scikit-learn's digits through Spark tasks,
transform with accuracy far above chance, and fit_on_parquet with the same run_id resuming its checkpoint."""
import io
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("pyarrow", reason="the Spark estimators need pyarrow (pip install 'horovod-next[spark]')")

import cloudpickle  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.torch import TorchEstimator, TorchModel  # noqa: E402


# The training processes cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def digits_df(spark, label_type=float):
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), label_type(y)) for x, y in zip(digits.data, digits.target)]
    # Two partitions: transform() starts one Python worker (which imports torch) per partition.
    return spark.createDataFrame(rows, ["features", "label"]).coalesce(2)


def accuracy(pdf, output="label__output"):
    predicted = np.array([np.argmax(p) for p in pdf[output]])
    return float(np.mean(predicted == pdf["label"].to_numpy()))


def cross_entropy(output, label):
    return F.cross_entropy(output, label.long())


@pytest.mark.timeout(900)
def test_fit_transform_and_resume_from_checkpoint(spark, tmp_path):
    df = digits_df(spark)
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    estimator = TorchEstimator(num_proc=2, store=store, model=model, optimizer=optimizer, loss=cross_entropy,
                               metrics=[], feature_cols=["features"], label_cols=["label"], batch_size=32,
                               epochs=2, validation=0.1, run_id="digits", partitions_per_process=1,
                               random_seed=1, verbose=0)
    first = estimator.fit(df)

    assert isinstance(first, TorchModel) and first.getRunId() == "digits"
    history = first.getHistory()
    assert history["epoch"] == [0, 1]
    assert history["loss"][1] < history["loss"][0] < 2.5             # ln(10) = 2.30 is where it starts
    assert len(history["val_loss"]) == 2 and history["val_loss"][1] < 1.0
    # The user's model is left as it was; the trained one differs from it.
    assert all(torch.equal(a, b) for a, b in zip(initial, model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(initial, first.getModel().parameters()))
    # Rank 0 checkpointed every epoch; the last checkpoint holds exactly the returned weights.
    saved = torch.load(io.BytesIO(store.read(store.get_checkpoint_path("digits") + "/" +
                                             store.get_checkpoint_filename())), weights_only=True)
    assert saved["epoch"] == 2 and saved["history"] == history
    for name, value in first.getModel().state_dict().items():
        assert torch.equal(saved["model"][name], value), name

    predicted = first.transform(df)
    assert predicted.columns == ["features", "label", "label__output"]
    pdf = predicted.toPandas()
    assert len(pdf) == 1797
    assert accuracy(pdf) > 0.8                                           # chance is 0.1

    # Same run_id, epochs=3, on the data already in the store: loads the checkpoint of epoch 2 and trains one
    # more epoch.
    second = estimator.setEpochs(3).fit_on_parquet()
    resumed = second.getHistory()
    assert resumed["epoch"] == [0, 1, 2]
    assert resumed["loss"][:2] == history["loss"]
    assert resumed["loss"][2] < history["loss"][1]
