"""horovod.torch.elastic: ElasticSampler partitions, TorchState commit/restore/sync, and a real elastic job
(growth and a killed worker) with TorchState + ElasticSampler + DistributedOptimizer."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import horovod.torch as hvd  # noqa: E402
from horovod.common import basics  # noqa: E402
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: E402
from horovod.torch.elastic import ElasticSampler, TorchState  # noqa: E402
from horovod.torch.elastic import state as state_module  # noqa: E402

from elastic_helpers import check_training, third_host  # noqa: E402


def test_public_surface():
    from horovod.torch import elastic

    assert elastic.__all__ == ["TorchState", "ElasticSampler", "run"]
    assert hvd.elastic is elastic and callable(hvd.elastic.run)
    assert [h for _, h in state_module.get_handler_registry()] == [
        state_module.ModelStateHandler, state_module.OptimizerStateHandler, state_module.SamplerStateHandler]


# -- ElasticSampler: the partition arithmetic, for world sizes this process cannot be -----------------------
@pytest.fixture
def world(monkeypatch):
    """Pretend to be ``rank`` of ``size`` (the sampler only asks basics.size() / basics.rank())."""
    def set_world(size: int, rank: int) -> None:
        monkeypatch.setattr(basics, "size", lambda: size)
        monkeypatch.setattr(basics, "rank", lambda: rank)
    return set_world


def _partition(world, dataset, size, state=None, **kwargs):
    out = []
    for rank in range(size):
        world(size, rank)
        sampler = ElasticSampler(dataset, **kwargs)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(list(sampler))
        assert len(sampler) == len(out[-1])
    return out


def test_sampler_partitions_like_a_distributed_sampler(world):
    parts = _partition(world, list(range(10)), 3, shuffle=False)
    assert parts == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]     # padded by wrapping around


def test_sampler_resumes_with_the_remaining_samples_over_a_new_size(world):
    world(3, 0)
    sampler = ElasticSampler(list(range(24)), shuffle=True, seed=5)
    order = sampler.remaining_indices
    assert sorted(order) == list(range(24))
    sampler.record_batch(0, 2)                                       # 2 samples on each of 3 ranks
    sampler.record_batch(1, 2)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 12}
    parts = _partition(world, list(range(24)), 2, state=sampler.state_dict(), shuffle=True, seed=5)
    assert sorted(parts[0] + parts[1]) == sorted(order[12:])          # exactly the rest, split in two
    assert parts[0] == order[12::2] and parts[1] == order[13::2]


def test_sampler_epochs_reshuffle_and_reset_the_position(world):
    world(1, 0)
    sampler = ElasticSampler(list(range(50)), shuffle=True, seed=1)
    first = list(sampler)
    sampler.record_batch(0, 10)
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sorted(list(sampler)) == list(range(50)) and list(sampler) != first
    again = ElasticSampler(list(range(50)), shuffle=True, seed=1)
    again.load_state_dict({"epoch": 1, "processed_num": 0})
    assert list(again) == list(sampler)                              # same seed + epoch: same order everywhere
    assert sampler.get_indices(1, 10) == list(sampler)[10:20]


# -- TorchState in one process ----------------------------------------------------------------------------
@pytest.fixture
def single():
    hvd.init()
    yield
    hvd.shutdown()


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()
    optimizer.step()


def test_torch_state_commit_and_restore(single):
    model, optimizer = _model_and_optimizer()
    sampler = ElasticSampler(list(range(8)), shuffle=False)
    state = TorchState(model, optimizer, sampler=sampler, epoch=0, note="a")
    _step(model, optimizer)
    sampler.record_batch(0, 2)
    state.epoch = 1
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state[model.weight]["momentum_buffer"].clone()
    _step(model, optimizer)
    sampler.record_batch(1, 2)
    state.epoch, state.note = 2, "b"
    state.restore()
    for key, value in model.state_dict().items():
        assert torch.equal(value, committed[key]), key
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], momentum)
    assert sampler.processed_num == 2 and list(sampler) == [2, 3, 4, 5, 6, 7]
    assert (state.epoch, state.note) == (1, "a")


def test_torch_state_value_replacement_and_sync(single):
    model, optimizer = _model_and_optimizer()
    state = TorchState(model=model, optimizer=optimizer, batch=3)
    other = torch.nn.Linear(3, 2)
    state.model = other                                              # handler follows, commits the new model
    assert state.model is other and state._handlers["model"].value is other
    state.sync()                                                     # a job of one: everything stays
    assert state.batch == 3
    assert TorchState(model=None).model is None                      # optional arguments


def test_run_restores_resets_and_retries(single):
    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer, step=0)
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, fail_with):
        calls.append(state.step)
        if len(calls) == 1:
            state.step = 5
            state.commit()
            state.step = 6                                           # not committed: rolled back
            raise HorovodInternalError("peer died")
        if len(calls) == 2:
            state.step = 7
            state.commit()
            raise fail_with(True)                                    # hosts changed: nothing rolled back
        return state.step

    assert train(state, HostsUpdatedInterrupt) == 7
    assert calls == [0, 5, 7] and resets == [1, 1]
    assert basics.is_initialized()


# -- a real elastic job ----------------------------------------------------------------------------------
WORKER = Path(__file__).resolve().parent / "torch_worker.py"


def test_torch_job_grows_and_survives_a_killed_worker(elastic_job):
    third = third_host()
    if third is None:
        pytest.skip("this machine's host name is localhost: no third local host name")
    job = elastic_job(["localhost:1", "127.0.0.1:1"], ["-np", "2", "--min-np", "1", "--max-np", "3"],
                      worker=WORKER, step_delay=0.02)

    def joined(size, after_epoch):
        return lambda evs: any(e["ev"] == "join" and e["size"] == size and e["epoch"] > after_epoch for e in evs)

    job.wait_for("training at size 2", lambda evs: any(e["ev"] == "commit" and e["size"] == 2 for e in evs),
                 timeout=60)
    job.set_hosts(["localhost:1", "127.0.0.1:1", f"{third}:1"])
    job.wait_for("a third worker joins", joined(3, 0))
    grown = max(e["epoch"] for e in job.events("join"))
    job.wait_for("training at size 3", lambda evs: any(e["ev"] == "commit" and e["size"] == 3 for e in evs))
    job.kill("127.0.0.1:0")
    job.wait_for("the job goes on without the killed worker", joined(2, grown))
    job.wait_for("training at size 2 again",
                 lambda evs: any(e["ev"] == "commit" and e["size"] == 2 and e["epoch"] > grown for e in evs))
    assert job.finish() == 0, job.diagnose()        # stops at the end of a data epoch

    events = job.events()
    eps = check_training(events, sizes=[2, 3, 2], resets=2, finished=False)
    assert set(eps[1].ranks) == {"localhost:0", "127.0.0.1:0", f"{third}:0"}
    assert set(eps[2].ranks) == {"localhost:0", f"{third}:0"}
    # After every sync all ranks hold the same model and optimizer state (newcomers included).
    for ep in eps:
        joins = [e for e in events if e["ev"] == "join" and e["epoch"] == ep.number]
        assert len({(e["params"], e["momentum"], e["data_epoch"], e["processed"]) for e in joins}) == 1, joins
    # No sample of a finished data epoch was skipped, however the workers changed during it.  The killed
    # worker's last batch may have been trained on (its gradients reached the others) without being logged.
    killed = [e for e in events if e["ev"] == "batch" and e["id"] == "127.0.0.1:0"][-1]
    last = max(e["data_epoch"] for e in events if e["ev"] == "commit")
    for data_epoch in range(last + 1):
        seen = [i for e in events if e["ev"] == "commit" and e["data_epoch"] == data_epoch for i in e["indices"]]
        missing = set(range(48)) - set(seen)
        in_flight = set(killed["indices"]) if killed["data_epoch"] == data_epoch else set()
        assert missing <= in_flight, (data_epoch, sorted(missing), sorted(in_flight))
        assert len(seen) <= 48 + 3 * 3 * 4, (data_epoch, len(seen))   # padding / a redone batch at a reset
