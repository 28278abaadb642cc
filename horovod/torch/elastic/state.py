"""``TorchState``: elastic state made of torch models, optimizers, samplers and plain Python values.

Each keyword argument of :class:`TorchState` gets a *handler* chosen by its type from the handler registry:
modules and optimizers keep a deep copy of their ``state_dict()`` at every commit and are synchronised with
:func:`~horovod.torch.broadcast_parameters` / :func:`~horovod.torch.broadcast_optimizer_state`; an
:class:`ElasticSampler` keeps its position (``state_dict()``) and re-partitions after a reset; anything else
is a plain value, deep-copied at commit and sent with :func:`~horovod.torch.broadcast_object`.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from horovod.common.basics import rank
from horovod.common.elastic import ObjectState
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters


class StateHandler:
    """Keeps one value of a :class:`TorchState` committed, restorable and synchronisable."""

    def __init__(self, value: Any):
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int = 0) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Replace the value (``state.model = other_model``) and commit it at once."""
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: ``state_dict()`` deep copy; sync = broadcast of every parameter and buffer."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._saved = copy.deepcopy(model.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root_rank: int = 0) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (or ``DistributedOptimizer``): ``state_dict()`` deep copy; sync =
    :func:`broadcast_optimizer_state`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._saved = copy.deepcopy(optimizer.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root_rank: int = 0) -> None:
        broadcast_optimizer_state(self.value, root_rank=root_rank)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: its position in the epoch; loading it re-partitions over the current ranks."""

    def __init__(self, sampler: ElasticSampler):
        super().__init__(sampler)
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root_rank: int = 0) -> None:
        state = broadcast_object(self.value.state_dict(), root_rank=root_rank, name="elastic.sampler_state")
        self.value.load_state_dict(state)


_handler_registry: List[Tuple[Type, Type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[Type, Type[StateHandler]]]:
    """``[(type, handler class), ...]``: the first entry whose type matches a value handles it."""
    return _handler_registry


def set_handler_registry(registry: List[Tuple[Type, Type[StateHandler]]]) -> None:
    """Replace the registry (e.g. to add a handler for your own type in front)."""
    global _handler_registry
    _handler_registry = list(registry)


def _handler_for(value: Any):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler
    return None


def _split_handlers(kwargs: Dict[str, Any]) -> Tuple[Dict[str, StateHandler], Dict[str, Any]]:
    handlers: Dict[str, StateHandler] = {}
    plain: Dict[str, Any] = {}
    for name, value in kwargs.items():
        handler = _handler_for(value)
        if handler is None:
            plain[name] = value
        else:
            handlers[name] = handler(value)
    return handlers, plain


class TorchState(ObjectState):
    """Elastic state of a PyTorch training job.

    ``state.commit()`` saves everything in memory (the point a failure rolls back to) and checks for host
    changes; after a reset the state is synchronised from the rank holding the newest commit.

    Args:
        model: the ``torch.nn.Module`` being trained (optional).
        optimizer: its optimizer, plain or ``hvd.DistributedOptimizer`` (optional).
        kwargs: more state: :class:`ElasticSampler` objects, other modules/optimizers, and plain values such
            as ``epoch=0, batch=0`` (read and assign them as attributes: ``state.epoch += 1``).
    """

    _handlers: Dict[str, StateHandler]   # set through object.__setattr__: this class's __setattr__ reads it

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = _split_handlers(kwargs)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync(root_rank=self._sync_root)
        super().sync()
