"""KerasEstimator as 0.28.1 users wrote for it: flat columns take the model's input shapes (each input its own),
labels take the output shapes where they hold as many values, tf_keras models (TF_USE_LEGACY_KERAS=1) train as
Keras 3 ones do, and ``horovod.spark.common.constants`` has the original's names and values.

The two end-to-end fits (one per Keras flavour) are the Spark MNIST script of the original in small
(tests/spark/keras_flat_mnist.py): Keras 3 on the shared cluster, tf_keras in a process of its own with its own
``local-cluster[2,1,1024]`` session, since the flavour is fixed when TensorFlow is imported.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.keras import KerasEstimator, model_info  # noqa: E402
from horovod.spark.keras.estimator import _load_predictor  # noqa: E402
from horovod.spark.keras.remote import model_to_bytes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import keras_flat_mnist  # noqa: E402

needs_tf_keras = pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                                    reason="tf_keras not installed (pip install tf_keras)")


def test_constants_have_the_original_names_and_values():
    from horovod.spark.common import constants
    assert constants.PETASTORM_HDFS_DRIVER == "libhdfs"
    assert constants.METRIC_PRINT_FREQUENCY == 100
    assert (constants.ARRAY, constants.CUSTOM_SPARSE, constants.NOCHANGE) == \
        ("array", "custom_sparse_format", "nochange")
    assert (constants.MIXED_SPARSE_DENSE_VECTOR, constants.SPARSE_VECTOR, constants.DENSE_VECTOR) == \
        ("mixed_sparse_dense_vector", "sparse_vector", "dense_vector")
    assert constants.TOTAL_BUFFER_MEMORY_CAP_GIB == 4 and constants.BYTES_PER_GIB == 2 ** 30
    assert sorted(constants.__all__) == sorted(n for n in vars(constants) if n.isupper())


def _vec(n):
    return {"kind": "vector", "dtype": "float64", "shape": n}


SCALAR_INT = {"kind": "scalar", "dtype": "int64", "shape": None}


def test_shapes_are_read_from_the_model():
    classic = keras_flat_mnist.classic_model(keras)
    assert model_info.feature_shapes(classic, ["features"], {"features": _vec(784)}) == [[-1, 28, 28, 1]]
    # One-hot labels take the output's shape, class indices stay as stored (sparse losses take them so).
    assert model_info.label_shapes(classic, ["y"], {"y": _vec(10)}) == [[-1, 10]]
    assert model_info.label_shapes(classic, ["y"], {"y": SCALAR_INT}) == [None]
    regression = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    assert model_info.label_shapes(regression, ["y"], {"y": SCALAR_INT}) == [[-1, 1]]
    # Several inputs: each column takes its own input's shape, in the order of model.inputs.
    two = keras_flat_mnist.two_input_model(keras)
    meta = {"features": _vec(784), "extra": _vec(4)}
    assert model_info.feature_shapes(two, ["features", "extra"], meta) == [[-1, 28, 28, 1], [-1, 2, 2]]
    # One unknown dimension is inferred; a model without known inputs leaves the columns as stored.
    ragged = keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(1)])
    assert model_info.feature_shapes(ragged, ["f"], {"f": _vec(12)}) == [[-1, -1, 3]]
    assert model_info.feature_shapes(keras.Sequential([keras.layers.Dense(1)]), ["f"], {"f": _vec(5)}) is None

    with pytest.raises(ValueError, match=r"'extra' holds 4 value\(s\) per row, but model input 0 has shape "
                                         r"\(None, 28, 28, 1\) \(784 values per row\)"):
        model_info.feature_shapes(two, ["extra", "features"], meta)
    with pytest.raises(ValueError, match="the model has 2 inputs .* but 1 feature columns"):
        model_info.feature_shapes(two, ["features"], meta)


def test_predictor_reshapes_flat_rows_to_each_input():
    two = keras_flat_mnist.two_input_model(keras)
    rng = np.random.default_rng(0)
    pixels, extra = rng.random((5, 784)), rng.normal(size=(5, 4))
    predict = _load_predictor(model_to_bytes(two), {}, model_info.KERAS3, [[-1, 28, 28, 1], [-1, 2, 2]])
    (out,) = predict([pixels, extra])
    expected = two.predict([pixels.reshape(5, 28, 28, 1).astype(np.float32),
                            extra.reshape(5, 2, 2).astype(np.float32)], verbose=0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@needs_tf_keras
def test_flavour_is_the_model_s_and_the_optimizer_must_match(tmp_path):
    import tf_keras
    legacy_model = tf_keras.Sequential([tf_keras.layers.Dense(10, input_shape=(4,))])
    common = dict(store=Store.create(str(tmp_path)), loss="mse", feature_cols=["f"], label_cols=["y"])
    assert model_info.flavour_of(legacy_model) == model_info.TF_KERAS
    assert model_info.flavour_of(keras.Sequential()) == model_info.KERAS3
    assert model_info.training_env(model_info.TF_KERAS) == {"TF_USE_LEGACY_KERAS": "1"}
    for optimizer in (tf_keras.optimizers.Adam(), tf_keras.optimizers.legacy.SGD(0.1), "adam"):
        KerasEstimator(model=legacy_model, optimizer=optimizer, **common)._check_params()
    with pytest.raises(ValueError, match="the model is a Keras 2 \\(tf_keras\\) model but the optimizer Adam is "
                                         "Keras 3 \\(keras\\)'s"):
        KerasEstimator(model=legacy_model, optimizer=keras.optimizers.Adam(), **common)._check_params()
    with pytest.raises(ValueError, match="model must be a keras.Model \\(Keras 3\\) or a tf_keras model"):
        KerasEstimator(model=object(), optimizer="adam", **common)._check_params()


def _check_fit(result, two_inputs):
    print(f"flat-column fit ({'two inputs' if two_inputs else 'one input'}): {result}")   # shown with -s
    history = result["history"]
    assert history["epoch"] == [0, 1, 2, 3]
    assert history["loss"][-1] < history["loss"][0], history["loss"]
    assert result["rows"] == keras_flat_mnist.ROWS and result["output_width"] == 10
    assert result["accuracy"] > 0.8, result                     # chance is 0.1 (0.99 seen in both flavours)
    # transform() fed each flat column to the model as 28 x 28 x 1 (and 2 x 2): the same predictions as the
    # model's own predict on the arrays reshaped here.
    assert result["max_diff_from_local_predict"] < 1e-4, result


@pytest.mark.timeout(900)
def test_keras3_flat_columns_feed_a_two_input_model(spark, tmp_path):
    pytest.importorskip("sklearn")
    result = keras_flat_mnist.fit_and_check(spark, str(tmp_path / "store"), two_inputs=True)
    assert result["keras"] == "keras"
    _check_fit(result, two_inputs=True)


def _no_spark_reason():
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed"
    java_home = os.environ.get("JAVA_HOME")
    if not (shutil.which("java") or (java_home and os.path.exists(os.path.join(java_home, "bin", "java")))):
        return "no Java runtime (Spark needs Java 17+)"
    return None


@needs_tf_keras
@pytest.mark.timeout(900)
def test_tf_keras_original_mnist_script_under_legacy_keras(tmp_path):
    """The original's script under TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras in the driver, the training
    processes and the executors' transform workers; Conv2D(input_shape=(28, 28, 1)) on a flat column, one-hot
    labels with categorical_crossentropy."""
    pytest.importorskip("sklearn")
    reason = _no_spark_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "keras_flat_mnist.py"), str(tmp_path / "store")],
                          env=env, capture_output=True, text=True, timeout=840)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"the tf_keras script failed (exit {proc.returncode}):\n"
                                            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["keras"] == "tf_keras"
    _check_fit(result, two_inputs=False)
