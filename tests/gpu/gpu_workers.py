"""What each rank runs in the GPU tests: every collective × dtype on CUDA tensors, checked against numpy.

Values are small integers, so every dtype holds every sum exactly and a rank can compute every other rank's
input (and so the expected result) by itself.
"""
from __future__ import annotations

import logging
from typing import Dict, List

import numpy as np

DTYPES = ("float16", "float32", "float64", "bfloat16", "int32", "int64", "uint8")
FLOATS = ("float16", "float32", "float64", "bfloat16")


def _setup():
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch, hvd


def _values(rank: int, rows: int, cols: int = 3) -> np.ndarray:
    return ((np.arange(rows * cols).reshape(rows, cols) + 3 * rank) % 5).astype(np.float64)


def _to(torch, array: np.ndarray, dtype: str):
    t = torch.tensor(array, dtype=torch.float64, device="cuda")
    return t.to(getattr(torch, dtype))


def _np(x) -> np.ndarray:
    t = x.detach().cpu()
    if t.dtype in (__import__("torch").bfloat16, __import__("torch").float16):
        t = t.float()
    return t.double().numpy()


def device_mode(set_id: int = 0) -> str:
    """Which data plane the process set's GPU collectives took (NCCL or HOST)."""
    from horovod.engine import state

    return state.runtime().executor.devices.mode(set_id) or "none"


def collectives(dtypes=DTYPES) -> Dict[str, object]:
    """Every collective × dtype; returns the checks' report, the mode and the notices logged."""
    from checks import Checks

    torch, hvd = _setup()
    notices: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            notices.append(record.getMessage())

    logging.getLogger("horovod.engine.device_executor").addHandler(Keep())
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    inputs = [_values(r, 2 * size + 1) for r in range(size)]
    total = np.sum(inputs, axis=0)
    mode = "none"
    for dt in dtypes:
        x = _to(torch, inputs[rank], dt)
        tol = {"rtol": 1e-2, "atol": 1e-2} if dt in ("float16", "bfloat16") else {"rtol": 1e-6, "atol": 1e-6}

        def check(what, got, want, exact=False):
            c.true(got.is_cuda and got.dtype == x.dtype, f"{dt} {what}: result on {got.device} {got.dtype}")
            c.close(_np(got), np.asarray(want, dtype=np.float64), f"{dt} {what}",
                    **({} if exact else tol))

        check("allreduce sum", hvd.allreduce(x, op=hvd.Sum, name=f"s.{dt}"), total)
        mode = device_mode()   # now: the engine forgets its device plane when another rank shuts down
        avg = total / size if dt in FLOATS else np.trunc(total / size)
        check("allreduce average", hvd.allreduce(x, op=hvd.Average, name=f"a.{dt}"), avg)
        check("allreduce min", hvd.allreduce(x, op=hvd.Min, name=f"mn.{dt}"), np.min(inputs, axis=0))
        check("allreduce max", hvd.allreduce(x, op=hvd.Max, name=f"mx.{dt}"), np.max(inputs, axis=0))
        ones = _to(torch, np.full((7,), 1.0 + (rank % 2)), dt)
        check("allreduce product", hvd.allreduce(ones, op=hvd.Product, name=f"p.{dt}"),
              np.prod([np.full((7,), 1.0 + (r % 2)) for r in range(size)], axis=0))
        if dt in FLOATS:
            check("allreduce pre/postscale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                                           name=f"ps.{dt}"), total * 1.5)
        y = x.clone()
        hvd.allreduce_(y, op=hvd.Sum, name=f"ip.{dt}")
        check("allreduce_ in place", y, total)
        handles = [hvd.allreduce_async(_to(torch, _values(rank, 4 + i), dt), op=hvd.Sum, name=f"f{i}.{dt}")
                   for i in range(3)]
        for i, h in enumerate(handles):
            check(f"fused async allreduce {i}", hvd.synchronize(h),
                  np.sum([_values(r, 4 + i) for r in range(size)], axis=0))
        grouped = hvd.grouped_allreduce([x, x[:2]], op=hvd.Sum, name=f"g.{dt}")
        check("grouped allreduce 0", grouped[0], total)
        check("grouped allreduce 1", grouped[1], total[:2])
        mine = _values(rank, rank + 1)
        check("allgather (ragged)", hvd.allgather(_to(torch, mine, dt), name=f"ag.{dt}"),
              np.concatenate([_values(r, r + 1) for r in range(size)]), exact=True)
        g2 = hvd.grouped_allgather([_to(torch, mine, dt), _to(torch, mine[:1], dt)], name=f"gag.{dt}")
        check("grouped allgather 1", g2[1], np.concatenate([_values(r, r + 1)[:1] for r in range(size)]), exact=True)
        root = size - 1
        check("broadcast", hvd.broadcast(x, root_rank=root, name=f"b.{dt}"), inputs[root], exact=True)
        z = x.clone()
        hvd.broadcast_(z, root_rank=0, name=f"bi.{dt}")
        check("broadcast_ in place", z, inputs[0], exact=True)
        splits = [(rank + p) % 3 for p in range(size)]
        send = _values(rank, sum(splits))
        out, received = hvd.alltoall(_to(torch, send, dt), splits=torch.tensor(splits), name=f"a2a.{dt}")
        want = []
        for p in range(size):
            theirs = [(p + q) % 3 for q in range(size)]
            start = sum(theirs[:rank])
            want.append(_values(p, sum(theirs))[start:start + theirs[rank]])
        check("alltoall", out, np.concatenate(want), exact=True)
        c.equal(received.tolist(), [(p + rank) % 3 for p in range(size)], f"{dt} alltoall received splits")
        rows = np.array([len(total) // size + (1 if r < len(total) % size else 0) for r in range(size)])
        start = int(rows[:rank].sum())
        check("reducescatter sum", hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dt}"),
              total[start:start + rows[rank]])
        check("reducescatter average", hvd.reducescatter(x, op=hvd.Average, name=f"rsa.{dt}"),
              avg[start:start + rows[rank]])
    hvd.shutdown()
    return {"report": c.report(), "mode": mode, "notices": notices}


def mismatch() -> str:
    """Rank 0 passes a CPU tensor, the others a CUDA one: every rank must get the device mismatch error."""
    torch, hvd = _setup()
    t = torch.ones(8) if hvd.rank() == 0 else torch.ones(8, device="cuda")
    try:
        hvd.allreduce(t, name="mixed")
    except Exception as exc:   # noqa: BLE001  (the test asserts on the type's name and the text)
        return f"{type(exc).__name__}: {exc}"
    finally:
        hvd.shutdown()
    return "no error"


def optimizer(steps: int = 4, fp16: bool = False) -> Dict[str, object]:
    """DistributedOptimizer on half batches equals one process on the whole batch (CUDA model); ``fp16``:
    gradients travel compressed to float16."""
    torch, hvd = _setup()
    rank, size = hvd.rank(), hvd.size()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).cuda()

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * size, 8, generator=gen), torch.randn(4 * size, 2, generator=gen))
               for _ in range(steps)]
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xb, yb in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xb.cuda()), yb.cuda()).backward()
        ref_opt.step()
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    mode = device_mode()
    for xb, yb in batches:
        part = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xb[part].cuda()), yb[part].cuda()).backward()
        opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))
    hvd.shutdown()
    return {"max_diff": diff, "mode": mode}


def sync_batch_norm() -> Dict[str, float]:
    """SyncBatchNorm on each rank's part of a CUDA batch equals BatchNorm on the whole batch (outputs, input
    gradients, running statistics)."""
    torch, hvd = _setup()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    x = torch.randn(4 * size, 3, 5, device="cuda")
    sync, ref = hvd.SyncBatchNorm(3).cuda(), torch.nn.BatchNorm1d(3).cuda()
    part = x[4 * rank:4 * rank + 4].clone().requires_grad_()
    full = x.clone().requires_grad_()
    out, want = sync(part), ref(full)
    (out * out).sum().backward()
    (want * want).sum().backward()
    mine = slice(4 * rank, 4 * rank + 4)
    result = {"output": float((out - want[mine]).abs().max()),
              "grad": float((part.grad - full.grad[mine]).abs().max()),
              "running_mean": float((sync.running_mean - ref.running_mean).abs().max()),
              "running_var": float((sync.running_var - ref.running_var).abs().max()),
              "on_gpu": float(out.is_cuda and part.grad.is_cuda)}
    hvd.shutdown()
    return result


def timeline() -> str:
    torch, hvd = _setup()
    x = torch.ones(1024, device="cuda")
    hvd.grouped_allreduce([x * i for i in range(3)], name="fused")   # one fused response: the fusion buffer
    hvd.allreduce(x, name="single")
    mode = device_mode()   # np = 1: nobody else can tear the engine down first
    hvd.shutdown()
    return mode
