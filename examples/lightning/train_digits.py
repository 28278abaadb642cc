"""Train a small MLP on scikit-learn's handwritten digits with Lightning and ``Trainer(strategy="horovod")``.

    horovodrun -np 2 python examples/lightning/train_digits.py

The script is a plain Lightning script: the strategy shards the data loaders by rank, averages the gradients,
broadcasts rank 0's initial state and syncs the logged metrics (``sync_dist=True``); rank 0 prints the training
loss and validation accuracy after each epoch and, with ``--checkpoint-dir``, is the only rank that writes the
best checkpoint.  No download: the digits ship with scikit-learn.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd  # any horovod import registers strategy="horovod" with Lightning


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Lightning with strategy='horovod' on the digits dataset",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="learning rate (not scaled by the number of ranks; see docs/lightning.md)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint-dir", default=None, help="keep the best checkpoint here (rank 0 writes it)")
    return parser.parse_args(argv)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class PrintEpoch(pl.Callback):
    """Rank 0 prints one line per epoch, from the metrics every rank agrees on."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            m = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch + 1}: loss {float(m['train_loss']):.4f}, "
                  f"val accuracy {float(m['val_acc']):.3f} ({trainer.world_size} ranks)", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=args.seed)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=256)

    callbacks: list = [PrintEpoch()]
    if args.checkpoint_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, monitor="val_acc", mode="max"))
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_epochs=args.epochs, callbacks=callbacks,
                         logger=False, enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    model = DigitsClassifier(args.lr)
    trainer.fit(model, train_loader, val_loader)
    result = trainer.validate(model, val_loader, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"final: val loss {result['val_loss']:.4f}, val accuracy {result['val_acc']:.3f}", flush=True)


if __name__ == "__main__":
    main()
