"""A Spark MNIST-style Keras script as 0.28.1 users wrote it: the images are one flat vector column of 784 values
and the model's input is 28 x 28 x 1, so the estimator must take the shapes from the model (a helper module of
tests/spark/test_spark_estimator_keras_shapes.py, not a test).

The images are scikit-learn's 8 x 8 digits scaled up to 28 x 28 (nearest neighbour): no download.  ``fit_and_check``
runs in the test process on the shared cluster (Keras 3); run as a script it starts its own Spark session, which
is how the tf_keras flavour runs (``TF_USE_LEGACY_KERAS=1`` must be set before TensorFlow is imported, so in a
process of its own)::

    TF_USE_LEGACY_KERAS=1 python tests/spark/keras_flat_mnist.py STORE_DIR    # prints one JSON line: RESULT {...}
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

ROWS = 400


def flat_images(rows: int = ROWS):
    """(images as (rows, 784) floats in [0, 1], labels) from scikit-learn's digits, scaled up to 28 x 28."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    small = digits.images[:rows] / 16.0                        # (rows, 8, 8)
    index = (np.arange(28) * 8) // 28                          # nearest source pixel of each target pixel
    big = small[:, index][:, :, index]                         # (rows, 28, 28)
    return big.reshape(rows, 784), digits.target[:rows].astype(np.int64)


def dataframe(spark, images, labels, extra=None):
    """Columns ``features`` (a dense vector of 784), ``label`` (int), ``label_vec`` (one-hot dense vector of 10)
    and, when ``extra`` is given, ``extra`` (a dense vector of 4)."""
    from pyspark.ml.linalg import Vectors
    rows = []
    for i, (image, label) in enumerate(zip(images, labels)):
        row = [Vectors.dense(image), int(label), Vectors.dense(np.eye(10)[label])]
        if extra is not None:
            row.append(Vectors.dense(extra[i]))
        rows.append(tuple(row))
    names = ["features", "label", "label_vec"] + (["extra"] if extra is not None else [])
    # Two partitions: transform() starts one Python worker (which imports TensorFlow) per partition.
    return spark.createDataFrame(rows, names).coalesce(2)


def classic_model(keras):
    """The original's MNIST example in small: Conv2D with ``input_shape=(28, 28, 1)`` on a Sequential model."""
    return keras.models.Sequential([
        keras.layers.Conv2D(4, kernel_size=(3, 3), strides=(2, 2), activation="relu", input_shape=(28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])


def two_input_model(keras):
    """Two inputs, each fed by one flat column: the image (784 → 28 x 28 x 1) and ``extra`` (4 → 2 x 2)."""
    image = keras.Input((28, 28, 1), name="image")
    extra = keras.Input((2, 2), name="extra")
    x = keras.layers.Conv2D(4, kernel_size=(3, 3), strides=(2, 2), activation="relu")(image)
    x = keras.layers.Flatten()(x)
    e = keras.layers.Flatten()(extra)
    out = keras.layers.Dense(10, activation="softmax")(keras.layers.Concatenate()([x, e]))
    return keras.Model([image, extra], out)


def fit_and_check(spark, store_dir: str, two_inputs: bool) -> dict:
    """Fit a KerasEstimator on the flat column(s) through Spark tasks, transform, and return what the test checks:
    the history, the accuracy of transform's predictions, and how far they are from the trained model's own
    ``predict`` on the images reshaped to 28 x 28 x 1 here (0 when transform reshapes them the same way)."""
    import tensorflow as tf

    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator

    keras = tf.keras                     # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1: as the user's script
    keras.utils.set_random_seed(0)
    images, labels = flat_images()
    rng = np.random.default_rng(0)
    extra = rng.normal(size=(len(labels), 4)) if two_inputs else None
    df = dataframe(spark, images, labels, extra)
    if two_inputs:
        model = two_input_model(keras)
        feature_cols, label_cols, loss = ["features", "extra"], ["label"], "sparse_categorical_crossentropy"
    else:
        model = classic_model(keras)
        feature_cols, label_cols, loss = ["features"], ["label_vec"], "categorical_crossentropy"
    estimator = KerasEstimator(num_proc=2, store=Store.create(store_dir), model=model,
                               optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["accuracy"],
                               feature_cols=feature_cols, label_cols=label_cols, batch_size=16, epochs=4,
                               partitions_per_process=1, random_seed=1, verbose=0)
    trained = estimator.fit(df)
    output = label_cols[0] + "__output"
    pdf = trained.transform(df).select(*feature_cols, "label", output).toPandas()

    predicted = np.stack([np.asarray(p, dtype=np.float64) for p in pdf[output]])
    pixels = np.stack([np.asarray(v.toArray()) for v in pdf["features"]]).astype(np.float32)
    inputs = [pixels.reshape(-1, 28, 28, 1)]
    if two_inputs:
        inputs.append(np.stack([np.asarray(v.toArray()) for v in pdf["extra"]]).astype(np.float32).reshape(-1, 2, 2))
    expected = trained.getModel().predict(inputs[0] if len(inputs) == 1 else inputs, verbose=0)
    return {
        "keras": type(trained.getModel()).__module__.split(".")[0],
        "history": trained.getHistory(),
        "rows": len(pdf),
        "output_width": int(predicted.shape[1]),
        "accuracy": float(np.mean(predicted.argmax(axis=1) == pdf["label"].to_numpy())),
        "max_diff_from_local_predict": float(np.max(np.abs(predicted - expected))),
    }


def _wait_for_executors(sc, executors: int, timeout: float = 300.0) -> None:
    """Block until ``executors`` executors registered (the training job is a barrier stage over all of them)."""
    import time
    deadline = time.monotonic() + timeout
    while sc._jsc.sc().getExecutorMemoryStatus().size() < executors + 1:     # the driver counts too
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Spark cluster did not register {executors} executors within {timeout:.0f} s")
        time.sleep(0.5)


def main(store_dir: str) -> None:
    from pyspark.sql import SparkSession

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("horovod-keras-flat-mnist")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.default.parallelism", "2").config("spark.executor.memory", "768m")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        _wait_for_executors(spark.sparkContext, 2)
        result = fit_and_check(spark, store_dir, two_inputs=False)
    finally:
        spark.stop()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
