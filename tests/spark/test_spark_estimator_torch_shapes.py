"""TorchEstimator's shapes as in 0.28.1: features reshaped by ``input_shapes``, and each label reshaped to its
output's shape when it holds as many values (a scalar label for an output of shape ``(batch, 1)``), so a plain
``F.mse_loss`` compares row with row instead of broadcasting ``(batch, 1)`` against ``(batch,)``."""
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")   # the estimators' stores (a torch-only venv collects this file too)

import cloudpickle  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from horovod.spark.common import util  # noqa: E402
from horovod.spark.common.backend import LocalBackend  # noqa: E402
from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.torch import TorchEstimator  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRUE_W = np.array([1.0, -2.0, 0.5, 3.0])


def _write_regression_data(store, rows=192):
    """A 4-value array column ``f`` and a scalar ``y = f . TRUE_W``, in the store's layout (no Spark job)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4))
    path = store.get_localized_path(store.get_train_data_path())
    os.makedirs(path)
    pq.write_table(pa.table({"f": pa.array(list(x), type=pa.list_(pa.float64())), "y": x @ TRUE_W}),
                   f"{path}/part-0.parquet")
    store.write_text(store.get_train_data_path() + "/" + util.METADATA_FILE, json.dumps({
        "columns": {"f": {"kind": "array", "dtype": "float64", "shape": 4},
                    "y": {"kind": "scalar", "dtype": "float64", "shape": None}},
        "train_rows": rows, "val_rows": 0}))


def plain_mse(output, label):
    return F.mse_loss(output, label)      # no reshape of its own: the estimator must give matching shapes


@pytest.mark.timeout(600)
def test_scalar_labels_take_the_output_shape_and_features_the_input_shapes(tmp_path):
    store = Store.create(str(tmp_path))
    _write_regression_data(store)
    torch.manual_seed(0)
    # The features arrive as 2 x 2 (input_shapes), the model flattens them back: a linear model of 4 inputs.
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 1, bias=False))
    est = TorchEstimator(backend=LocalBackend(2), store=store, model=model, input_shapes=[[-1, 2, 2]],
                         optimizer=torch.optim.Adam(model.parameters(), lr=0.1), loss=plain_mse,
                         feature_cols=["f"], label_cols=["y"], batch_size=16, epochs=12, verbose=0)
    fitted = est.fit_on_parquet()
    losses = fitted.getHistory()["loss"]
    # Broadcasting (batch, 1) against (batch,) would fit every row to the batch's mean label: the loss would
    # stay near the labels' variance (about 14) and the weights would not approach TRUE_W.
    assert losses[-1] < 0.02 * losses[0], losses
    weights = fitted.getModel()[1].weight.detach().numpy().reshape(-1)
    np.testing.assert_allclose(weights, TRUE_W, atol=0.25)   # Adam at lr 0.1 still moves a little
