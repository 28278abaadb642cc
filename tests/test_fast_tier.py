"""The fast tier (tests/fast_tier.py) still names real tests, and still reaches every layer."""
from __future__ import annotations

import os
import subprocess
import sys

from fast_tier import FAST_TIER, selects

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each layer of docs/architecture.md, and the test folder (or file) through which the tier reaches it.
LAYERS = {"transport": "tests/transport/", "engine": "tests/engine/", "common": "tests/test_binding_adapters.py",
          "bindings": "tests/conformance/", "runner": "tests/runner/", "layering": "tests/test_layering.py"}


def test_every_entry_names_a_collected_test():
    files = sorted({entry.split("::")[0] for entry in FAST_TIER})
    missing_files = [f for f in files if not os.path.exists(os.path.join(REPO, f))]
    assert not missing_files, f"fast-tier entries name files that are gone: {missing_files}"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    stale = [entry for entry in FAST_TIER if not any(selects(entry, nodeid) for nodeid in ids)]
    assert not stale, f"fast-tier entries that select no test (renamed or removed?): {stale}"


def test_every_layer_is_in_the_tier():
    for layer, where in LAYERS.items():
        assert any(entry.startswith(where) for entry in FAST_TIER), f"the fast tier does not reach {layer} ({where})"


def test_selects_matches_ids_files_and_unparametrised_names():
    assert selects("tests/a.py", "tests/a.py::test_x[1]")
    assert selects("tests/a.py::test_x", "tests/a.py::test_x[1]")
    assert selects("tests/a.py::test_x[1]", "tests/a.py::test_x[1]")
    assert not selects("tests/a.py::test_x", "tests/a.py::test_xy")
    assert not selects("tests/a.py", "tests/a.pyc::test_x")
