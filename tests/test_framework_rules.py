"""The rules every binding shares (horovod/common/framework_rules.py) and the engine's half-precision scaling, in
whatever NumPy this interpreter has (NumPy 2 in the main environment; the MXNet venv's NumPy 1.x runs the same
scaling through real collectives in tests/mxnet/test_mxnet_fidelity.py)."""
from __future__ import annotations

import numpy as np
import pytest

from horovod.common import framework_rules as rules
from horovod.engine import ops
from horovod.engine.ops import Adasum, Average, Max, Sum


def test_reducescatter_gradient_scale_is_the_originals():
    assert rules.reducescatter_grad_scale(Sum, 1.0, 1.0, 3) == 3.0          # x set size for Sum
    assert rules.reducescatter_grad_scale(Average, 1.0, 1.0, 3) == 1.0      # x 1 for Average
    assert rules.reducescatter_grad_scale(Sum, 0.5, 4.0, 2) == 4.0          # times the forward's scale factors
    assert rules.reducescatter_grad_scale(Average, 0.5, 3.0, 7) == 1.5


def test_sparse_allreduce_rules():
    rules.check_sparse_allreduce(Sum, 1.0, 1.0)
    rules.check_sparse_allreduce(Average, 1.0, 1.0)
    for op in (Max, Adasum):
        with pytest.raises(NotImplementedError, match="Only Sum and Average"):
            rules.check_sparse_allreduce(op, 1.0, 1.0)
    for pre, post in ((2.0, 1.0), (1.0, 0.5)):
        with pytest.raises(NotImplementedError, match="Pre/postscale"):
            rules.check_sparse_allreduce(Sum, pre, post)
    assert rules.sparse_average_divisor(Average, 4) == 4
    assert rules.sparse_average_divisor(Sum, 4) is None


def test_half_precision_is_scaled_in_float32():
    assert rules.scaling_dtype("float16") == "float32" and rules.scaling_dtype("bfloat16") == "float32"
    assert rules.scaling_dtype("float64") == "float64" and rules.scaling_dtype("int32") == "int32"
    values = (np.arange(289, dtype=np.float32) * 0.37 + 1.0).astype(np.float16)
    for factor in (1.0 / 3.0, 0.1, 7.0, 1e-3):
        got = values.copy()
        ops.scale_inplace(got, factor)
        want = (values.astype(np.float32) * np.float32(factor)).astype(np.float16)
        np.testing.assert_array_equal(got, want, err_msg=f"scale by {factor}")
    for divisor in (3, 7):
        got = values.copy()
        ops.divide_inplace(got, divisor)
        np.testing.assert_array_equal(got, (values.astype(np.float32) / np.float32(divisor)).astype(np.float16))
