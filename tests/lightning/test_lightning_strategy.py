"""``Trainer(strategy="horovod")`` on 2 real ranks (tests/multiproc.py gives them horovodrun's environment).

- a model fitted on 2 ranks equals one process trained on the combined batch (plain torch, same seed), for the
  ``lightning`` package by name, for ``pytorch_lightning`` with a ``HorovodStrategy(scale_learning_rate=True)``
  instance and ``accumulate_grad_batches=3`` (a short last window in every epoch), with manual optimization,
  and with the ranks started by ``mpirun``;
- ModelCheckpoint and EarlyStopping on a rank-dependent score that ``sync_dist`` makes equal: every rank stops at
  the same epoch and names the same best checkpoint, and only rank 0 writes or removes files; then validate, test
  and predict, whose values are checked against numpy, and the strategy's collectives.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning_workers as lw  # noqa: E402

from multiproc import run_ranks  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
NP = 2
TIMEOUT = 600.0   # each rank imports torch and Lightning: slow on a loaded 2-core machine
ATOL = 2e-5


def _assert_params_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=ATOL, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("package, accumulate, batch, epochs, manual, launcher", [
    ("lightning.pytorch", 1, 4, 2, False, "subprocess"),
    ("pytorch_lightning", 3, 4, 2, False, "subprocess"),   # scale_learning_rate=True and half the learning rate
    ("lightning.pytorch", 1, 8, 1, True, "subprocess"),    # manual optimization: manual_backward, opt.step()
    ("lightning.pytorch", 2, 4, 1, False, "mpirun"),       # started by mpirun: Open MPI's environment
])
def test_fit_on_two_ranks_equals_one_process_on_the_combined_batch(package, accumulate, batch, epochs, manual,
                                                                     launcher):
    pytest.importorskip(package)
    if launcher == "mpirun" and (shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None):
        pytest.skip("mpirun and mpi4py are not installed")
    results = run_ranks(lw.fit_worker, NP, args=(package, accumulate, batch, epochs, manual), env=ENV,
                        timeout=TIMEOUT, launcher=launcher)
    want = lw.reference_fit(batch * NP, epochs, accumulate, lr=0.1, momentum=0.9)
    steps_per_epoch = -(-(lw.N_TRAIN // (batch * NP)) // accumulate)
    expected_module = {"lightning.pytorch": "horovod.lightning.strategy",
                       "pytorch_lightning": "horovod.lightning.pl_strategy"}[package]
    for rank, out in enumerate(results):
        assert (out["global_rank"], out["world_size"], out["strategy"]) == (rank, NP, expected_module), out
        assert out["passes"] == [accumulate], out["passes"]
        assert out["lr"] == [pytest.approx(0.1)], out["lr"]
        assert out["global_step"] == epochs * steps_per_epoch, (rank, out["global_step"])
        _assert_params_close(out["params"], want, f"rank {rank}, {package}, accumulate {accumulate}")
    # and the reference differs from a run without the other rank's half of each batch (the check can fail)
    alone = lw.reference_fit(batch, epochs, accumulate, lr=0.1, momentum=0.9)
    assert any(not np.allclose(alone[k], want[k], atol=1e-3) for k in want)


def test_callbacks_checkpoints_and_the_loops_on_two_ranks(tmp_path):
    pytest.importorskip("lightning")
    scores = [3.0, 2.0, 2.5, 2.7, 1.0, 0.5]   # best after epoch 1; no improvement in epoch 2: patience 1 stops
    results = run_ranks(lw.callbacks_worker, NP, args=(str(tmp_path), scores), env=ENV, timeout=TIMEOUT)
    r0 = results[0]

    # the callbacks decided alike on every rank, from the synced score
    for rank, out in enumerate(results):
        assert (out["current_epoch"], out["stopped_epoch"]) == (3, 2), (rank, out["current_epoch"],
                                                                        out["stopped_epoch"])
        assert out["best_path"] == "epoch=1.ckpt", (rank, out["best_path"])
        assert out["best_score"] == pytest.approx(2.0), (rank, out["best_score"])
    # only rank 0 wrote and removed files; what is left is the best checkpoint
    assert r0["saved"] == ["epoch=0.ckpt", "epoch=1.ckpt"], r0["saved"]
    assert r0["removed"] == ["epoch=0.ckpt"], r0["removed"]
    for rank, out in enumerate(results[1:], start=1):
        assert (out["saved"], out["removed"]) == ([], []), (rank, out["saved"], out["removed"])
    assert r0["files"] == ["epoch=1.ckpt"], r0["files"]

    # every rank holds the same parameters; validate/test/predict values against numpy over the whole data set
    params = r0["params"]
    for rank, out in enumerate(results[1:], start=1):
        for name in r0["params"]:
            np.testing.assert_array_equal(out["params"][name], r0["params"][name], err_msg=f"rank {rank} {name}")
    x_val, y_val = lw.data(lw.N_VAL, lw.SEED + 1)
    logits = lw.forward_np(params, x_val)
    for rank, out in enumerate(results):
        got = out["validate"]
        assert got["val_loss"] == pytest.approx(lw.cross_entropy_np(logits, y_val).mean(), rel=1e-5), (rank, got)
        assert got["val_max"] == pytest.approx(logits.max(), rel=1e-5), (rank, got)
        assert got["val_min"] == pytest.approx(logits.min(), rel=1e-5), (rank, got)

    x_test, y_test = lw.data(lw.N_VAL, lw.SEED + 2)
    accuracy = float((lw.forward_np(params, x_test).argmax(axis=1) == y_test).mean())
    for rank, out in enumerate(results):
        assert out["test"]["test_acc"] == pytest.approx(accuracy, abs=1e-6), (rank, out["test"])
        # each rank's batch holds 4 samples: their sum over ranks, summed over the batches
        assert out["test"]["test_count"] == pytest.approx(lw.N_VAL), (rank, out["test"])
        gathered = np.concatenate(out["gathered"], axis=1)
        assert gathered.shape == (NP, lw.N_VAL // NP), gathered.shape
        assert sorted(gathered.ravel().tolist()) == list(range(lw.N_VAL))
        assert all(np.array_equal(g, r0_g) for g, r0_g in zip(out["gathered"], r0["gathered"]))

    x_pred, _ = lw.data(lw.N_VAL, lw.SEED + 3)
    want_pred = lw.forward_np(params, x_pred)
    seen = []
    for out in results:
        for idx, pred in out["predict"]:
            np.testing.assert_allclose(pred, want_pred[idx], rtol=1e-5, atol=1e-5)
            seen.extend(idx.tolist())
    assert sorted(seen) == list(range(lw.N_VAL)), "every sample predicted exactly once, over the ranks"

    for rank, out in enumerate(results):
        c = out["collectives"]
        assert (c["rank"], c["world_size"], c["is_global_zero"]) == (rank, NP, rank == 0)
        np.testing.assert_allclose(c["sum"], [sum(r + 1.0 for r in range(NP)), 2.0 * NP])
        np.testing.assert_allclose(c["mean"], [np.mean([r + 1.0 for r in range(NP)])])
        np.testing.assert_allclose(c["max"], [NP - 1.0])
        assert c["int_mean"].dtype.kind == "i" and c["int_mean"].tolist() == [int(np.mean(
            [2 * r + 1 for r in range(NP)]))]
        assert c["not_a_tensor"] == 3.5
        np.testing.assert_array_equal(c["gather"], [[r, 10 * r] for r in range(NP)])
        assert c["broadcast"] == {"from": NP - 1}
        assert (c["any"], c["all"]) == (True, NP == 1)

    # resumed for one epoch from the best checkpoint (epoch 1): the step count goes on, the ranks agree
    steps_per_epoch = lw.N_TRAIN // (8 * NP)
    for rank, out in enumerate(results):
        got = out["resumed"]
        assert got["step_at_best"] == 2 * steps_per_epoch, got["step_at_best"]
        assert got["global_step"] == 3 * steps_per_epoch, (rank, got["global_step"])
        for name in r0["resumed"]["params"]:
            np.testing.assert_array_equal(got["params"][name], r0["resumed"]["params"][name], err_msg=name)
        assert len(got["momentum"]) == len(r0["params"])
        for a, b in zip(got["momentum"], r0["resumed"]["momentum"]):
            np.testing.assert_array_equal(a, b)
