"""``Trainer(strategy="horovod")``: put the name into Lightning's strategy registry, whenever Lightning is imported.

Lightning looks strategy names up in ``StrategyRegistry`` (``lightning.pytorch.strategies`` and, for the older
package name, ``pytorch_lightning.strategies``), and it offers no entry point through which another package could
add a name: the name has to be registered by code that runs after that module and before the ``Trainer`` is
built.  ``import horovod`` (which every ``import horovod.torch`` / ``import horovod.lightning`` runs first) calls
:func:`install`: the name is registered at once where Lightning is already imported, and otherwise by a finder at
the front of ``sys.meta_path`` that runs the registration right after Lightning's strategies module has executed.
The finder answers only for those two module names and imports nothing itself; the registered factory imports
:mod:`horovod.lightning.strategy` (and with it torch and Lightning) only when a ``Trainer`` asks for the strategy.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any, Callable, Dict, Optional, Sequence

logger = logging.getLogger(__name__)

NAME = "horovod"
DESCRIPTION = "Horovod: data-parallel training over horovodrun / mpirun ranks (horovod.lightning)"
# Lightning's strategies module → the horovod module that holds the strategy class for that package name.
WATCHED: Dict[str, str] = {"lightning.pytorch.strategies": "horovod.lightning.strategy",
                           "pytorch_lightning.strategies": "horovod.lightning.pl_strategy"}


def _factory(strategy_module: str) -> Callable[..., Any]:
    def make_horovod_strategy(**kwargs: Any) -> Any:
        if strategy_module == "horovod.lightning.strategy":
            from horovod.lightning.strategy import HorovodStrategy
        else:
            from horovod.lightning.pl_strategy import HorovodStrategy  # type: ignore[assignment, unused-ignore]
        return HorovodStrategy(**kwargs)

    return make_horovod_strategy


def register(strategies_module: Any) -> None:
    """Register ``"horovod"`` in ``strategies_module.StrategyRegistry`` unless the name is taken already."""
    registry = getattr(strategies_module, "StrategyRegistry", None)
    if registry is None or NAME in registry:
        return
    registry.register(NAME, _factory(WATCHED[strategies_module.__name__]), description=DESCRIPTION)


class _RegisterAfterExec(importlib.abc.Loader):
    """The loader of a watched module, with :func:`register` run after the module's own code."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            register(module)
        except Exception as exc:  # noqa: BLE001  (Lightning must import even if the registration cannot run)
            logger.warning("could not register strategy %r with %s: %r; pass HorovodStrategy() from "
                           "horovod.lightning instead of the name", NAME, module.__name__, exc)

    def __getattr__(self, name: str) -> Any:   # everything else (get_code, is_package, ...) from the real loader
        return getattr(self._inner, name)


class _Watcher(importlib.abc.MetaPathFinder):
    """Answers only for the watched module names: their real spec, with the loader wrapped."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Make ``strategy="horovod"`` available to Lightning, now or when it is imported (idempotent)."""
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            register(module)
    if not any(isinstance(finder, _Watcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())
