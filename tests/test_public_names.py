"""Each public binding module lists its API explicitly (``__all__``), and the list is the recorded one.

The names are spelled out in the modules (no ``export(globals())``, no ``import *``) so that IDEs, mypy and readers
see them; tests/public_names.json records them as they were when the lists were introduced. A name added to or
removed from a binding's API must be added to or removed from that record too, deliberately.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os

import pytest

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "public_names.json")
with open(RECORD, encoding="utf-8") as f:
    RECORDED = json.load(f)

# What each module needs installed to import.
NEEDS = {"horovod.lightning": ("torch", "lightning"),
         "horovod.numpy": (), "horovod.torch": ("torch",), "horovod.torch.mpi_ops": ("torch",),
         "horovod.tensorflow": ("tensorflow",), "horovod.keras": ("tensorflow",),
         "horovod.tensorflow.keras": ("tensorflow",), "horovod.jax": ("jax", "optax"),
         "horovod.ray": ("ray", "pydantic", "pandas", "pyarrow", "fsspec")}   # HorovodTrainer: Ray Train's deps


def _module(name: str):
    for needed in NEEDS[name]:
        pytest.importorskip(needed, reason=f"{name} needs {needed}")
    return importlib.import_module(name)


def test_every_recorded_module_is_checked():
    assert sorted(RECORDED) == sorted(NEEDS)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_all_is_the_recorded_api_and_resolves(name):
    mod = _module(name)
    listed = list(mod.__all__)
    assert len(listed) == len(set(listed)), f"{name}.__all__ repeats names"
    assert sorted(listed) == RECORDED[name], (
        f"{name}.__all__ differs from tests/public_names.json: added {sorted(set(listed) - set(RECORDED[name]))}, "
        f"removed {sorted(set(RECORDED[name]) - set(listed))}")
    unresolved = [n for n in listed if not hasattr(mod, n)]
    assert not unresolved, f"{name}.__all__ names what the module does not have: {unresolved}"


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_what_the_module_defines_publicly_is_listed(name):
    mod = _module(name)
    defined = [n for n, obj in vars(mod).items() if not n.startswith("_") and (inspect.isfunction(obj)
               or inspect.isclass(obj)) and getattr(obj, "__module__", None) == mod.__name__]
    unlisted = sorted(set(defined) - set(mod.__all__))
    assert not unlisted, f"{name} defines public {unlisted} but does not list them in __all__"


@pytest.mark.parametrize("name, owner", [("horovod.numpy", "horovod.numpy"),
                                         ("horovod.torch.mpi_ops", "horovod.torch.engine_ops")])
def test_handle_bindings_spell_out_every_shared_function(name, owner):
    from horovod.common.binding_ops import MODULE_FUNCTIONS

    mod, impl = _module(name), importlib.import_module(owner)
    collectives = impl._collectives
    for fn in MODULE_FUNCTIONS:
        assert fn in mod.__all__, f"{name}.__all__ lacks the shared {fn}"
        got = getattr(impl, fn)
        # the binding's own blocking forms (defined in the module) replace some; the rest are the bound methods
        if getattr(got, "__module__", None) != owner:
            assert got == getattr(collectives, fn), f"{owner}.{fn} is not the shared object's bound method"


def test_star_import_gives_exactly_the_listed_names():
    namespace: dict = {}
    exec("from horovod.numpy import *", namespace)
    assert sorted(n for n in namespace if n != "__builtins__") == RECORDED["horovod.numpy"]
