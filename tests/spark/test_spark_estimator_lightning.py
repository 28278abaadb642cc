"""horovod.spark.lightning.TorchEstimator on the shared Spark cluster: a LightningModule trained on digits through
Spark tasks (its training_step/validation_step/configure_optimizers), transform accuracy far above chance, and a
second fit with the same run_id that resumes its checkpoint."""
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
pytest.importorskip("sklearn")
pytest.importorskip("pyarrow", reason="the Spark estimators need pyarrow (pip install 'horovod-next[spark]')")

import cloudpickle  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.lightning import TorchEstimator, TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DigitsNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["features"]), batch["label"].long())

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch["features"]), batch["label"].long()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def digits_df(spark):
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), float(y)) for x, y in zip(digits.data, digits.target)]
    return spark.createDataFrame(rows, ["features", "label"]).coalesce(2)


def test_model_must_be_a_lightning_module():
    with pytest.raises(ValueError, match="must be a lightning.LightningModule"):
        TorchEstimator(model=torch.nn.Linear(2, 2), store=Store.create("/tmp/unused_hvd_store"),
                       feature_cols=["f"], label_cols=["y"])._check_params()


@pytest.mark.timeout(900)
def test_fit_transform_and_resume_from_checkpoint(spark, tmp_path):
    df = digits_df(spark)
    torch.manual_seed(0)
    estimator = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=DigitsNet(),
                               feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=2,
                               validation=0.1, run_id="lightning_digits", partitions_per_process=1,
                               random_seed=1, verbose=0)
    first = estimator.fit(df)
    assert isinstance(first, TorchModel) and isinstance(first.getModel(), DigitsNet)
    history = first.getHistory()
    assert history["epoch"] == [0, 1]
    assert history["loss"][1] < history["loss"][0] and history["val_loss"][1] < 1.0

    pdf = first.transform(df).toPandas()
    predicted = np.array([np.argmax(p) for p in pdf["label__output"]])
    assert np.mean(predicted == pdf["label"].to_numpy()) > 0.8          # chance is 0.1

    second = estimator.setEpochs(3).fit(df)
    resumed = second.getHistory()
    assert resumed["epoch"] == [0, 1, 2] and resumed["loss"][:2] == history["loss"]
    assert resumed["loss"][2] < history["loss"][1]
