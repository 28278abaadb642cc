"""Broadcasting model parameters and arbitrary Python objects for ``horovod.mxnet``."""
from __future__ import annotations

import logging
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mxnet as mx

from horovod.common.basics import size
from horovod.common.objects import allgather_object as _allgather_object
from horovod.common.objects import broadcast_object as _broadcast_object
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.engine import collectives
from horovod.mxnet.mpi_ops import to_numpy, write_back

logger = logging.getLogger(__name__)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (any value cloudpickle can serialize).

    All ranks of the process set must call it, in the same order.  Without a ``name`` the call is matched by
    issue order (not by the type of ``obj``, which usually differs between the root and the others).
    """
    return _broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Return every rank's ``obj`` as a list in rank order (all ranks of the set must call it, in the same order)."""
    return _allgather_object(obj, name, _set_id(process_set))


def _param_types() -> Tuple[type, ...]:
    param_dict = getattr(mx.gluon.parameter, "ParameterDict", None)   # gone in MXNet 2
    return (dict, param_dict) if param_dict is not None else (dict,)


def _broadcast_arrays(groups: Sequence[List[mx.nd.NDArray]], names: Sequence[str], root_rank: int) -> None:
    """Broadcast ``groups[i][0]`` from ``root_rank`` under ``names[i]`` and write it into every array of group i.

    All broadcasts are issued before waiting on any, so the engine can fuse them.
    """
    hosts = [to_numpy(g[0], "broadcast_parameters") for g in groups]
    handles = [collectives.broadcast_async([h], [f"broadcast.{n}"], root_rank, outputs=[h], attended=True)
               for h, n in zip(hosts, names)]
    for handle in handles:
        handle.wait()
    for group, host in zip(groups, hosts):
        for array in group:
            write_back(array, host)


def _broadcast_after_init(param: mx.gluon.Parameter, root_rank: int, name: str) -> None:
    """Make the deferred initialisation of ``param`` end with a broadcast of its value from ``root_rank``.

    MXNet creates the data of such a parameter at its first forward pass, which every rank runs at the same point
    of the program, so the broadcast matches across ranks there.  The hook runs once and then removes itself.
    """
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        self._init_impl = original
        _broadcast_arrays([self.list_data()], [name], root_rank)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Dict[str, Any], root_rank: int = 0, prefix: Optional[str] = None) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    Args:
        params: ``net.collect_params()`` (a gluon ``ParameterDict``) or a dict of name to ``Parameter`` or
            NDArray (e.g. ``arg_params`` / ``aux_params`` of ``Module.get_params()``).  Parameters whose
            initialisation is deferred (shapes unknown until the first forward pass) are broadcast right after
            MXNet initialises them.
        root_rank: the rank whose values everyone receives.
        prefix: prepended to every broadcast's name, so several dicts with overlapping keys can be broadcast.

    Raises:
        ValueError: ``params`` is not a dict/``ParameterDict``, or ``prefix`` is not a string.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a string or None, got {prefix!r}.")
    if not isinstance(params, _param_types()):
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; expected a dict or "
                         f"a gluon ParameterDict (net.collect_params()).")
    prefix = prefix or ""
    for key, value in params.items():
        if not isinstance(value, (mx.gluon.Parameter, mx.nd.NDArray)):
            raise ValueError(f"broadcast_parameters: entry {key!r} is a {type(value).__name__}; expected a gluon "
                             f"Parameter or an NDArray.")
    if size() == 1:
        return
    groups: List[List[mx.nd.NDArray]] = []
    names: List[str] = []
    for key in sorted(params.keys(), key=str):
        value = params[key]
        name = prefix + str(key)
        if isinstance(value, mx.gluon.Parameter):
            try:
                arrays = value.list_data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, name)
                continue
        else:
            arrays = [value]
        groups.append(arrays)
        names.append(name)
    _broadcast_arrays(groups, names, root_rank)
