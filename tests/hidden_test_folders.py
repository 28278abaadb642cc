"""Keep the test folders named like frameworks (tests/torch, tests/jax, ...) from standing in for them.

tests/ is on ``sys.path`` in the test process (pytest puts this folder there) and in every rank (the harness puts it
on ``PYTHONPATH``), so where a framework is not installed, ``import jax`` found the folder tests/jax as a namespace
package: ``pytest.importorskip`` passed, ``importlib.util.find_spec`` said installed, and libraries that probe for
an optional framework (scipy for torch, TensorFlow for jax) failed on it (``module 'jax' has no attribute
'monitoring'``).  :func:`install` wraps the finder of the tests/ path entry so that a folder without
``__init__.py`` resolves to nothing; a name then resolves to an installed package or to nothing.
"""
from __future__ import annotations

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


class _FoldersHidden:
    """The finder of the tests/ path entry, minus the test folders that are not packages."""

    def __init__(self, inner, hidden):
        self.inner, self.hidden = inner, hidden

    def find_spec(self, fullname, target=None):
        if fullname in self.hidden:
            return None
        return self.inner.find_spec(fullname, target)

    def invalidate_caches(self):
        self.inner.invalidate_caches()


def _tests_path_hook(entry):
    """``sys.path_hooks`` entry: wrap the ordinary finder of tests/ (and decline every other path entry)."""
    if os.path.abspath(entry or os.curdir) != TESTS:
        raise ImportError("not the tests folder")
    hidden = frozenset(d for d in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, d))
                       and not os.path.exists(os.path.join(TESTS, d, "__init__.py")))
    for hook in sys.path_hooks:
        if hook is not _tests_path_hook:
            try:
                return _FoldersHidden(hook(entry), hidden)
            except ImportError:
                continue
    raise ImportError("no finder for the tests folder")


def install() -> None:
    """Hide the folders in this process (idempotent); finders made before, e.g. to import this module, are dropped."""
    if _tests_path_hook.__qualname__ in [getattr(h, "__qualname__", None) for h in sys.path_hooks]:
        return
    sys.path_hooks.insert(0, _tests_path_hook)
    for entry in list(sys.path_importer_cache):
        if os.path.abspath(entry or os.curdir) == TESTS:
            del sys.path_importer_cache[entry]
