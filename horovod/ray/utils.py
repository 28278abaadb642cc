"""Where Ray's own ``ray.train.horovod`` meets horovod-next: it says what to use instead.

Ray 2.60 still ships ``ray.train.horovod``, the ``HorovodTrainer`` Ray removed from Ray Train v2. Its backend
(``ray/train/horovod/config.py``) imports Horovod 0.28.1's internals — ``detect_nics`` and ``nics_to_env_var`` from
here, a ``Coordinator`` that starts the original's Gloo rendezvous — and drives them step by step. horovod-next has
no Gloo rendezvous to drive, and Ray refuses that trainer anyway under Ray Train v2, its default: the constructor
raises ``DeprecationWarning``. Faking those helpers would let the import pass only to fail later, further from
the cause, so this module names what to use instead the moment one of them is imported.

The module itself imports cleanly (tools that walk the package keep working); only its names refuse.
"""
from __future__ import annotations

from typing import NoReturn

__all__: list[str] = []

_USE_INSTEAD = (
    "Ray's own ray.train.horovod (its HorovodTrainer, which Ray Train v2, Ray's default, refuses and Ray has "
    "deprecated) drives Horovod 0.28.1's Gloo rendezvous internals (horovod.ray.utils.{name}), which horovod-next "
    "does not have. Use horovod-next's own Ray Train trainer, which takes the same keywords "
    "(train_loop_per_worker, train_loop_config, horovod_config, scaling_config, run_config, datasets): replace "
    "`from ray.train.horovod import HorovodTrainer, HorovodConfig` with "
    "`from horovod.ray import HorovodTrainer, HorovodConfig`; or run the function on Ray actors without Ray Train "
    "with horovod.ray.RayExecutor. docs/ray.md ('Porting from Ray's ray.train.horovod.HorovodTrainer') lists the "
    "rest of the changes."
)


def __getattr__(name: str) -> NoReturn:
    # Dunder and private lookups (copy, pickle, inspect, hasattr probes) must see an ordinary missing attribute.
    if name.startswith("_"):
        raise AttributeError(f"module 'horovod.ray.utils' has no attribute {name!r}")
    # An ImportError (not AttributeError) so that `from horovod.ray.utils import x` shows this text unchanged.
    raise ImportError(_USE_INSTEAD.format(name=name), name="horovod.ray.utils")
