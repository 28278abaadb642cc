"""Elastic PyTorch job driven by test_elastic_torch.py: TorchState + ElasticSampler + DistributedOptimizer.

The data set is the numbers 0..N-1 (a sample is its own index), so the log shows exactly which samples every
committed batch held.  Events appended to ``ELASTIC_TEST_LOG`` (JSON lines, one ``os.write`` each):

- ``start`` (id, pid);
- ``join`` (id, epoch, rank, size, step, data_epoch, processed, params, momentum): after every (re)sync, with
  checksums of the model parameters and the optimizer's momentum buffers — equal on every rank if the sync worked;
- ``batch`` (id, data_epoch, indices): a batch is about to be trained on;
- ``commit`` (id, epoch, rank, size, step, data_epoch, indices): the samples of this rank's committed batch
  (``step`` counts committed batches);
- ``done`` (rank 0).

Training loops over data epochs until ``ELASTIC_TEST_STOP`` exists (rank 0 decides, at an epoch boundary).
"""
from __future__ import annotations

import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd
from horovod.common import basics
from job_worker import STEP_DELAY, STOP, log

SAMPLES, BATCH = 48, 4


torch.set_num_threads(1)
hvd.init()
log(ev="start", pid=os.getpid())
torch.manual_seed(1234 + hvd.rank())        # different on purpose: the first sync must make them equal
dataset = TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1))
model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, data_epoch=0, step=0)


def checksums() -> dict:
    params = sum(float(p.detach().double().sum()) for p in model.parameters())
    momentum = sum(float(s["momentum_buffer"].double().sum()) for s in optimizer.state.values()
                   if s.get("momentum_buffer") is not None)
    return {"params": round(params, 9), "momentum": round(momentum, 9)}


@hvd.elastic.run
def train(state) -> None:
    log(ev="join", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(),
        step=state.step, data_epoch=state.data_epoch, processed=state.sampler.processed_num, **checksums())
    while True:
        for batch_idx, (x,) in enumerate(loader):
            log(ev="batch", data_epoch=state.data_epoch, indices=[int(i) for i in x.squeeze(1).tolist()])
            optimizer.zero_grad()
            loss = ((model(x / SAMPLES) - 0.5) ** 2).mean()
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, BATCH)
            state.step += 1
            log(ev="commit", epoch=basics.runtime().epoch.epoch, rank=hvd.rank(), size=hvd.size(),
                step=state.step, data_epoch=state.data_epoch, indices=[int(i) for i in x.squeeze(1).tolist()])
            state.commit()
            time.sleep(STEP_DELAY)
        stop = hvd.broadcast_object(hvd.rank() == 0 and os.path.exists(STOP), root_rank=0, name="stop")
        state.data_epoch += 1
        state.sampler.set_epoch(state.data_epoch)
        state.commit()
        if stop:
            return


train(state)
if hvd.rank() == 0:
    log(ev="done", data_epoch=state.data_epoch)
