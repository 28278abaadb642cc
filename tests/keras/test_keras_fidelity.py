"""Keras behaviours of Horovod 0.28.1 that scripts rely on, in both Keras flavours (Keras 3, and tf_keras with
TF_USE_LEGACY_KERAS=1): ``hvd.SyncBatchNormalization`` is a layer of the active Keras, a wrapped tf_keras
optimizer answers ``_compute_gradients`` (falling back to ``compute_gradients``), and
``BroadcastGlobalVariablesCallback`` works on a model that is built by its first batch.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tensorflow"))

from tf_helpers import FLAVOURS, flavour_params, run_tf  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed")


def _keras_worker(flavour):
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd

    keras = tf.keras
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "keras": keras.__name__.split(".")[0]}

    # 7. SyncBatchNormalization is a layer of the Keras tf.keras is; a tf.keras model accepts it and its
    #    statistics are those of the global batch.
    layer_cls = hvd_tf.SyncBatchNormalization
    out["sbn_is_layer"] = issubclass(layer_cls, keras.layers.Layer)
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) * (r + 1)
    model = keras.Sequential([keras.layers.Input((3,)), layer_cls(momentum=0.0, epsilon=0.0)])
    y = model(x, training=True).numpy()
    out["sbn_output"] = y
    out["sbn_moving_mean"] = np.asarray(model.layers[-1].moving_mean.numpy())
    out["sbn_moving_variance"] = np.asarray(model.layers[-1].moving_variance.numpy())
    out["sbn_fn_output"] = tf.function(lambda t: model(t, training=True))(tf.constant(x)).numpy()

    # 9. _compute_gradients on a wrapped optimizer (tf_keras: new and legacy optimizers; Keras 3 has no such
    #    method, so there only the public path is checked)
    w = tf.Variable([1.0, 2.0])
    loss = lambda: tf.reduce_sum(w * float(r + 1))  # noqa: E731
    if flavour == "tf_keras":
        for kind, opt in (("new", keras.optimizers.SGD(0.1)), ("legacy", keras.optimizers.legacy.SGD(0.1))):
            dist = hvd.DistributedOptimizer(opt)
            with tf.GradientTape() as tape:
                value = loss()
            pairs = dist._compute_gradients(value, [w], tape=tape)
            out[f"compute_{kind}"] = [g.numpy() for g, _ in pairs]
            pairs = dist._compute_gradients(loss, [w])   # a callable loss: no tape needed
            out[f"compute_{kind}_callable"] = [g.numpy() for g, _ in pairs]
    else:
        dist = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        with tf.GradientTape() as tape:
            value = loss()
        dist.apply_gradients(zip(tape.gradient(value, [w]), [w]))
        out["keras3_applied"] = w.numpy()

    # 10. BroadcastGlobalVariablesCallback on a Sequential built by its first batch: every rank ends with the
    #     same weights (the root's after the first batch), whatever each rank initialised.
    keras.utils.set_random_seed(100 + r)
    unbuilt = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    unbuilt.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    data = np.random.RandomState(7).rand(8, 4).astype(np.float32)
    unbuilt.fit(data, data[:, :1], batch_size=4, epochs=1, verbose=0,
                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["broadcast_weights"] = [v.numpy() for v in unbuilt.weights]
    out["gathered_first_kernel"] = hvd_tf.allgather(tf.convert_to_tensor(unbuilt.weights[0])[None]).numpy()
    out["size"] = n
    return out


@flavour_params
def test_keras_behaviours(flavour):
    results = run_tf(_keras_worker, 2, args=(flavour,), env=FLAVOURS[flavour])
    n = 2
    xs = [np.arange(8 * 3, dtype=np.float64).reshape(8, 3) * (p + 1) for p in range(n)]
    batch = np.concatenate(xs)
    mean, var = batch.mean(axis=0), batch.var(axis=0)
    for res in results:
        r = res["rank"]
        assert res["keras"] == ("tf_keras" if flavour == "tf_keras" else "keras"), res["keras"]
        assert res["sbn_is_layer"], f"SyncBatchNormalization is no {res['keras']} layer"
        want = (xs[r] - mean) / np.sqrt(var)
        np.testing.assert_allclose(res["sbn_output"], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(res["sbn_fn_output"], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(res["sbn_moving_mean"], mean, rtol=1e-5)
        np.testing.assert_allclose(res["sbn_moving_variance"], var, rtol=1e-4)

        averaged = np.full(2, np.mean([p + 1.0 for p in range(n)]))
        if flavour == "tf_keras":
            for kind in ("new", "legacy"):
                for key in (f"compute_{kind}", f"compute_{kind}_callable"):
                    np.testing.assert_allclose(res[key][0], averaged, err_msg=key)
        else:
            np.testing.assert_allclose(res["keras3_applied"], np.array([1.0, 2.0]) - 0.1 * averaged)

        for a, b in zip(res["broadcast_weights"], results[0]["broadcast_weights"]):
            np.testing.assert_allclose(a, b)
        gathered = res["gathered_first_kernel"]
        np.testing.assert_allclose(gathered[0], gathered[1])
