"""What the Lightning tests run on each rank (shipped to the ranks by value) and the numpy references they compare
with.  Data are made here from fixed seeds; every size divides evenly among 1, 2 and 4 ranks, so the distributed
samplers add no padding and a mean over all ranks is the mean over the data set.
"""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

N_TRAIN, N_VAL, N_FEATURES, N_HIDDEN, N_CLASSES = 64, 32, 8, 16, 3
SEED = 1234


def data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    w = rng.normal(size=(N_FEATURES, N_CLASSES))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, N_CLASSES)), axis=1).astype(np.int64)
    return x, y


def forward_np(params: Dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    h = np.maximum(x.astype(np.float64) @ params["net.0.weight"].T + params["net.0.bias"], 0.0)
    return h @ params["net.2.weight"].T + params["net.2.bias"]


def cross_entropy_np(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(y)), y]


def make_net(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, N_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(N_HIDDEN, N_CLASSES))


def reference_fit(batch: int, epochs: int, accumulate: int, lr: float, momentum: float) -> Dict[str, np.ndarray]:
    """One process, plain torch, on the combined batch: what ``strategy="horovod"`` must reproduce.

    Like Lightning's automatic optimization: the loss of each batch divided by ``accumulate``, a step every
    ``accumulate`` batches and at the end of each epoch.  The order is that of the training sampler Lightning
    puts in (``DistributedSampler(shuffle=True, seed=0)``, ``set_epoch`` each epoch): a permutation seeded with
    the epoch, of which rank ``r`` takes every ``size``-th index from ``r``; one step's batches on all ranks are
    therefore ``batch`` consecutive indices of the permutation.
    """
    import torch
    import torch.nn.functional as F

    x, y = (torch.from_numpy(a) for a in data(N_TRAIN, SEED))
    net = make_net(SEED)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    batches = N_TRAIN // batch
    for epoch in range(epochs):
        order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(epoch))
        opt.zero_grad()
        for i in range(batches):
            take = order[i * batch:(i + 1) * batch]
            (F.cross_entropy(net(x[take]), y[take]) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == batches:
                opt.step()
                opt.zero_grad()
    return {"net." + k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _module_class(pl):
    """A LightningModule over the package ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    import torch
    import torch.nn.functional as F

    class Classifier(pl.LightningModule):
        def __init__(self, lr: float = 0.1, momentum: float = 0.9, scores=None, manual: bool = False) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            import horovod.torch as hvd

            hvd.init()   # idempotent; the strategy calls it too, but this module is built before the Trainer
            self.net = make_net(SEED + hvd.rank())   # different on each rank: the strategy broadcasts rank 0's
            self.lr, self.momentum, self.scores = lr, momentum, scores
            self.gathered: List[np.ndarray] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            logits = self(x)
            self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
            self.log("val_max", logits.max(), reduce_fx="max", sync_dist=True)
            self.log("val_min", logits.min(), reduce_fx="min", sync_dist=True)
            if self.scores is not None:
                # rank-dependent before the sync, the scripted score after it: only sync_dist makes ranks agree
                rank, size = self.trainer.global_rank, self.trainer.world_size
                score = self.scores[min(self.current_epoch, len(self.scores) - 1)] + rank - (size - 1) / 2
                self.log("val_score", torch.tensor(score), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y, idx = batch
            self.gathered.append(self.all_gather(idx).numpy().copy())
            self.log("test_acc", (self(x).argmax(dim=1) == y).float().mean(), sync_dist=True)
            self.log("test_count", torch.tensor(float(len(y))), reduce_fx="sum", sync_dist=True)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            x, _, idx = batch
            return idx.numpy().copy(), self(x).numpy().astype(np.float64)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    return Classifier


def loader(n: int, seed: int, batch: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y = data(n, seed)
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y), torch.arange(n)), batch_size=batch,
                      shuffle=False)


def _trainer_kwargs(tmpdir=None) -> dict:
    return dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmpdir)


def _params(module) -> Dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def fit_worker(package: str, accumulate: int, batch: int, epochs: int, manual: bool = False) -> dict:
    """Fit with ``strategy="horovod"`` (``lightning``) or ``HorovodStrategy(scale_learning_rate=True)`` and half the
    learning rate (``pytorch_lightning``): both must give the reference's learning rate of 0.1 at 2 ranks."""
    import importlib

    import torch

    torch.set_num_threads(1)
    import horovod.torch as hvd  # what registers the strategy name: any horovod import

    hvd.init()
    pl = importlib.import_module(package)
    lr = 0.1
    if package == "lightning.pytorch":
        strategy = "horovod"
    else:
        from horovod.lightning.pl_strategy import HorovodStrategy

        strategy, lr = HorovodStrategy(scale_learning_rate=True), 0.1 / hvd.size()
    model = _module_class(pl)(lr=lr, manual=manual)
    trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, accumulate_grad_batches=accumulate,
                         enable_checkpointing=False, num_sanity_val_steps=0, **_trainer_kwargs())
    trainer.fit(model, loader(N_TRAIN, SEED, batch))
    return {"params": _params(model), "global_step": trainer.global_step, "world_size": trainer.world_size,
            "global_rank": trainer.global_rank, "strategy": type(trainer.strategy).__module__,
            "passes": [getattr(o, "backward_passes_per_step", None) for o in trainer.optimizers],
            "lr": [g["lr"] for o in trainer.optimizers for g in o.param_groups]}


def callbacks_worker(tmpdir: str, scores: List[float]) -> dict:
    """Fit with ModelCheckpoint and EarlyStopping on a scripted score, then validate, test and predict."""
    import torch
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    import horovod.lightning  # noqa: F401
    import horovod.torch as hvd

    torch.set_num_threads(1)

    class RecordingIO(TorchCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self.saved: List[str] = []
            self.removed: List[str] = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saved.append(os.path.basename(str(path)))
            return super().save_checkpoint(checkpoint, path, storage_options)

        def remove_checkpoint(self, path):
            self.removed.append(os.path.basename(str(path)))
            return super().remove_checkpoint(path)

    io = RecordingIO()
    ckpt_dir = os.path.join(tmpdir, "ckpt")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_score", mode="min", save_top_k=1,
                                 filename="{epoch}")
    stopping = EarlyStopping(monitor="val_score", mode="min", patience=1)
    model = _module_class(pl)(scores=scores)
    trainer = pl.Trainer(strategy="horovod", max_epochs=len(scores), callbacks=[checkpoint, stopping],
                         plugins=[io], **_trainer_kwargs(tmpdir))
    trainer.fit(model, loader(N_TRAIN, SEED, 8), loader(N_VAL, SEED + 1, 4))
    hvd.barrier()
    out: dict = {
        "saved": io.saved, "removed": io.removed, "files": sorted(os.listdir(ckpt_dir)),
        "stopped_epoch": stopping.stopped_epoch, "current_epoch": trainer.current_epoch,
        "best_path": os.path.basename(checkpoint.best_model_path),
        "best_score": float(checkpoint.best_model_score), "params": _params(model),
    }
    out["validate"] = {k: float(v) for k, v in trainer.validate(model, loader(N_VAL, SEED + 1, 4))[0].items()}
    out["test"] = {k: float(v) for k, v in trainer.test(model, loader(N_VAL, SEED + 2, 4))[0].items()}
    out["gathered"] = model.gathered
    out["predict"] = trainer.predict(model, loader(N_VAL, SEED + 3, 4))
    out["collectives"] = _collectives(trainer.strategy)

    # resume from the best checkpoint (written by rank 0, read by every rank) for one more epoch
    resumed = _module_class(pl)()
    trainer2 = pl.Trainer(strategy="horovod", max_epochs=3, enable_checkpointing=False, num_sanity_val_steps=0,
                          **_trainer_kwargs(tmpdir))
    trainer2.fit(resumed, loader(N_TRAIN, SEED, 8), ckpt_path=checkpoint.best_model_path)
    momentum = [s["momentum_buffer"].numpy().copy() for s in trainer2.optimizers[0].state.values()]
    out["resumed"] = {"global_step": trainer2.global_step, "params": _params(resumed), "momentum": momentum,
                      "step_at_best": int(torch.load(checkpoint.best_model_path, weights_only=False)["global_step"])}
    return out


def _collectives(strategy) -> dict:
    import torch
    from torch.distributed import ReduceOp

    rank = strategy.global_rank
    strategy.barrier("collectives")
    return {
        "rank": rank, "world_size": strategy.world_size, "is_global_zero": strategy.is_global_zero,
        "sum": strategy.reduce(torch.tensor([rank + 1.0, 2.0]), reduce_op=ReduceOp.SUM).numpy(),
        "mean": strategy.reduce(torch.tensor([rank + 1.0])).numpy(),
        "max": strategy.reduce(torch.tensor([float(rank)]), reduce_op="max").numpy(),
        "int_mean": strategy.reduce(torch.tensor([2 * rank + 1]), reduce_op="mean").numpy(),
        "not_a_tensor": strategy.reduce(3.5),
        "gather": strategy.all_gather(torch.tensor([rank, 10 * rank])).numpy(),
        "broadcast": strategy.broadcast({"from": rank}, src=strategy.world_size - 1),
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "all": strategy.reduce_boolean_decision(rank == 0, all=True),
    }
