"""The training function of :class:`horovod.spark.torch.TorchEstimator`, run on every Horovod process."""
from __future__ import annotations

import io
import posixpath
from typing import Any, Dict, Optional

import cloudpickle
import numpy as np

from horovod.spark.common import reader
from horovod.spark.common.reader import load_shard


def checkpoint_file(store, run_id: str) -> Optional[str]:
    path = store.get_checkpoint_path(run_id)
    return None if path is None else posixpath.join(path, store.get_checkpoint_filename())


def saved_state(hvd, store, ckpt: Optional[str], name: str) -> Optional[Dict[str, Any]]:
    """The checkpoint ``ckpt`` (``torch.save`` of a dict), read by rank 0 and broadcast to every rank; ``None``
    when the run has none yet."""
    import torch
    blob = store.read(ckpt) if hvd.rank() == 0 and ckpt and store.exists(ckpt) else None
    blob = hvd.broadcast_object(blob, 0, name=name)
    return torch.load(io.BytesIO(blob), weights_only=True) if blob is not None else None


def _shaped(array: np.ndarray, shape):
    """Rows reshaped to ``shape`` (the original's form ``[-1, d1, d2, ...]``, or one row's ``[d1, d2, ...]``)."""
    import torch
    tensor = torch.from_numpy(np.require(array, requirements=["C", "W"]))
    if shape is not None:
        dims = list(shape)
        if dims and dims[0] in (-1, None):
            dims = dims[1:]
        tensor = tensor.reshape(len(array), *dims)
    return tensor


def _inputs(batch, settings) -> list:
    shapes = settings.get("input_shapes") or [None] * len(settings["feature_cols"])
    return [_shaped(batch[c], s).float() for c, s in zip(settings["feature_cols"], shapes)]


def _labels(batch, settings) -> list:
    shapes = settings.get("label_shapes") or [None] * len(settings["label_cols"])
    out = []
    for c, s in zip(settings["label_cols"], shapes):
        tensor = _shaped(batch[c], s)
        out.append(tensor.float() if tensor.is_floating_point() else tensor)
    return out


def _labels_like(labels: list, outputs: list, settings) -> list:
    """Without ``label_shapes``, each label takes its output's shape when it holds as many values (0.28.1 did
    the same): a scalar label of an output of shape ``(batch, 1)`` becomes ``(batch, 1)``, so a loss compares
    row with row instead of broadcasting; class indices for an output of 10 scores stay as they are."""
    if settings.get("label_shapes"):
        return labels
    return [lab.reshape(out.shape) if hasattr(out, "shape") and out.shape != lab.shape
            and out.numel() == lab.numel() else lab for lab, out in zip(labels, outputs)]


def _as_list(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _loss(outputs, labels, loss_fns, loss_weights, weights):
    import torch
    total = 0
    for i, (out, lab) in enumerate(zip(outputs, labels)):
        fn = loss_fns[i] if len(loss_fns) > 1 else loss_fns[0]
        value = fn(out, lab)
        if weights is not None:
            # With sample weights the loss must give one value per row (reduction='none').
            value = (value.reshape(len(weights), -1).mean(dim=1) * weights).sum() / weights.sum()
        total = total + (loss_weights[i] if loss_weights else 1.0) * value
    return total if isinstance(total, torch.Tensor) else torch.tensor(float(total))


def train(model_bytes: bytes, optimizer_cls, optimizer_defaults: dict, optimizer_state: dict, loss_bytes: bytes,
          settings: Dict[str, Any]):
    import torch

    import horovod.torch as hvd

    hvd.init()
    try:
        return _train(hvd, torch, model_bytes, optimizer_cls, optimizer_defaults, optimizer_state, loss_bytes,
                      settings)
    finally:
        hvd.shutdown()


def _train(hvd, torch, model_bytes, optimizer_cls, optimizer_defaults, optimizer_state, loss_bytes, settings):
    rank, size = hvd.rank(), hvd.size()
    store, run_id = settings["store"], settings["run_id"]
    seed = settings.get("random_seed")
    if seed is not None:
        torch.manual_seed(seed)
    model = cloudpickle.loads(model_bytes)
    optimizer = optimizer_cls(model.parameters(), **optimizer_defaults)
    optimizer.load_state_dict(optimizer_state)
    loss_fns, loss_weights, metrics = cloudpickle.loads(loss_bytes)

    # Resume: rank 0 reads the run's checkpoint, every rank gets it.
    ckpt = checkpoint_file(store, run_id)
    state = saved_state(hvd, store, ckpt, "spark_torch_checkpoint")
    start_epoch, history = 0, {}
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, history = int(state["epoch"]), state["history"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist_optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=settings["compression"],
        backward_passes_per_step=settings["backward_passes_per_step"])

    weight_col = settings.get("sample_weight_col")
    columns = reader.data_columns(settings)
    _, batches, steps = reader.training_shard(settings, rank, size, seed)
    val_data = load_shard(settings, settings["val_path"], columns, rank, size) if settings["val_path"] else None
    minibatch_fn = settings.get("train_minibatch_fn")
    # With backward_passes_per_step = k the optimizer steps after every k-th backward pass (gradients of the
    # k passes accumulate and are allreduced once), counted across epochs the same way on every rank.
    passes = settings["backward_passes_per_step"]
    backward_count = 0
    dist_optimizer.zero_grad()

    for epoch in range(start_epoch, settings["epochs"]):
        model.train()
        loss_sum = 0.0
        metric_sums = [0.0] * len(metrics)
        for _ in range(steps):
            batch = next(batches)
            inputs, labels = _inputs(batch, settings), _labels(batch, settings)
            weights = _shaped(batch[weight_col], None).float() if weight_col else None
            if minibatch_fn is not None:
                loss_value, outputs = minibatch_fn(model, dist_optimizer, inputs, labels, weights, loss_fns,
                                                   loss_weights)
            else:
                outputs = _as_list(model(*inputs))
                labels = _labels_like(labels, outputs, settings)
                loss_value = _loss(outputs, labels, loss_fns, loss_weights, weights)
                loss_value.backward()
                backward_count += 1
                if backward_count % passes == 0:
                    dist_optimizer.step()
                    dist_optimizer.zero_grad()
            loss_sum += float(loss_value.detach())
            with torch.no_grad():
                for i, metric in enumerate(metrics):
                    metric_sums[i] += float(metric(_as_list(outputs)[0].detach(), labels[0]))
        local = torch.tensor([loss_sum / steps] + [m / steps for m in metric_sums], dtype=torch.float64)
        averaged = hvd.allreduce(local, name="spark_torch_train_metrics", op=hvd.Average).tolist()
        record = {"loss": averaged[0]}
        record.update({_metric_name(m): v for m, v in zip(metrics, averaged[1:])})
        if val_data is not None:
            record.update(_evaluate(hvd, torch, model, val_data, settings, loss_fns, loss_weights, metrics))
        history.setdefault("epoch", []).append(epoch)
        for key, value in record.items():
            history.setdefault(key, []).append(value)
        if rank == 0:
            if ckpt:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1, "history": history}, buffer)
                store.write(ckpt, buffer.getvalue())
            if settings.get("verbose"):
                print(f"epoch {epoch + 1}/{settings['epochs']}: "
                      + ", ".join(f"{k}={v:.4f}" for k, v in record.items()), flush=True)

    if rank != 0:
        return None
    return {"model": cloudpickle.dumps(model), "optimizer_state": optimizer.state_dict(), "history": history,
            "start_epoch": start_epoch}


def _metric_name(metric) -> str:
    return getattr(metric, "__name__", None) or type(metric).__name__


def _evaluate(hvd, torch, model, data, settings, loss_fns, loss_weights, metrics) -> dict:
    """Validation loss and metrics over every rank's shard, weighted by rows (a shard may be empty)."""
    model.eval()
    totals = np.zeros(2 + len(metrics))
    weight_col = settings.get("sample_weight_col")
    with torch.no_grad():
        for batch in reader.batches_in_order(data, settings["val_batch_size"]):
            n = len(batch[settings["label_cols"][0]])
            if n == 0:
                continue
            inputs, labels = _inputs(batch, settings), _labels(batch, settings)
            weights = _shaped(batch[weight_col], None).float() if weight_col else None
            outputs = _as_list(model(*inputs))
            labels = _labels_like(labels, outputs, settings)
            totals[0] += n
            totals[1] += n * float(_loss(outputs, labels, loss_fns, loss_weights, weights))
            for i, metric in enumerate(metrics):
                totals[2 + i] += n * float(metric(outputs[0], labels[0]))
    summed = hvd.allreduce(torch.from_numpy(totals), name="spark_torch_val_metrics", op=hvd.Sum).numpy()
    rows = max(summed[0], 1.0)
    record = {"val_loss": float(summed[1] / rows)}
    record.update({"val_" + _metric_name(m): float(summed[2 + i] / rows) for i, m in enumerate(metrics)})
    return record
