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


# Collects the given files and prints each test's node id, and ``SKIPPED-FILE <file>`` for each file skipped whole
# at collection (a module-level ``pytest.importorskip``: its framework is not installed, so it has no tests here).
_COLLECT = """
import sys, pytest

class Report:
    def pytest_collectreport(self, report):
        if report.skipped and report.nodeid.endswith(".py"):
            print("SKIPPED-FILE " + report.nodeid)

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Report()])
sys.exit(int(code))
"""


def collected(files):
    """``(node ids, files skipped whole at collection)`` of a collection run over ``files`` in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-c", _COLLECT, *files], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    skipped = {line.split(" ", 1)[1] for line in lines if line.startswith("SKIPPED-FILE ")}
    return [line for line in lines if "::" in line and not line.startswith("SKIPPED-FILE ")], skipped


def test_every_entry_names_a_collected_test():
    files = sorted({entry.split("::")[0] for entry in FAST_TIER})
    missing_files = [f for f in files if not os.path.exists(os.path.join(REPO, f))]
    assert not missing_files, f"fast-tier entries name files that are gone: {missing_files}"
    ids, skipped_files = collected(files)
    # An entry in a file skipped whole (its framework is not installed: a core-only checkout) cannot be checked
    # here; it is where the framework is (CI's environment).
    stale = [entry for entry in FAST_TIER if entry.split("::")[0] not in skipped_files
             and not any(selects(entry, nodeid) for nodeid in ids)]
    assert not stale, f"fast-tier entries that select no test (renamed or removed?): {stale}"


def test_a_file_skipped_whole_is_told_apart_from_a_stale_entry(tmp_path):
    """The check above must still catch a renamed test; only a file that skips itself at import is excused."""
    gone = tmp_path / "test_gone.py"
    gone.write_text("import pytest\npytest.importorskip('no_such_framework_for_horovod')\n\ndef test_a():\n    pass\n")
    here = tmp_path / "test_here.py"
    here.write_text("def test_b():\n    pass\n")
    ids, skipped = collected([str(gone), str(here)])
    assert [s for s in skipped if s.endswith("test_gone.py")] and not [s for s in skipped if "test_here" in s], skipped
    assert [i for i in ids if i.endswith("::test_b")] and not [i for i in ids if i.endswith("::test_a")], ids


def test_every_layer_is_in_the_tier():
    for layer, where in LAYERS.items():
        assert any(entry.startswith(where) for entry in FAST_TIER), f"the fast tier does not reach {layer} ({where})"


def test_selects_matches_ids_files_and_unparametrised_names():
    assert selects("tests/a.py", "tests/a.py::test_x[1]")
    assert selects("tests/a.py::test_x", "tests/a.py::test_x[1]")
    assert selects("tests/a.py::test_x[1]", "tests/a.py::test_x[1]")
    assert not selects("tests/a.py::test_x", "tests/a.py::test_xy")
    assert not selects("tests/a.py", "tests/a.pyc::test_x")
