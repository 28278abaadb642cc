"""A checkout with only the core installed (``pip install -e '.[test]'``: numpy, no framework) runs its tests.

Builds a fresh virtual environment without the system's site-packages, installs the project with its ``test``
extra (from the package index pip is configured with), and runs pytest there over every framework's test folder
and the layering test: the framework tests must be skipped with their reason, not fail or stop collection (the
test folders named like frameworks once stood in for them; module-level imports of optional packages once
stopped collection). Collecting the whole suite there must raise no error either.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORK_FOLDERS = ("torch", "tensorflow", "keras", "jax", "mxnet", "ray", "spark")
# A fresh venv and an install: tens of seconds, so not in the fast tier. bin/python: the venv layout on Linux (CI).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux venv layout")]
FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet", "ray", "pyspark", "pyarrow", "mpi4py")


def _env() -> dict:
    # Nothing from the calling environment may reach the frameworks: no PYTHONPATH, no user site-packages.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _run(cmd, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def core_python(tmp_path_factory) -> str:
    where = tmp_path_factory.mktemp("core-venv")
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
    python = str(where / "bin" / "python")
    done = _run([python, "-m", "pip", "install", "-q", "-e", f"{REPO}[test]"], timeout=600)
    assert done.returncode == 0, f"pip install -e '.[test]' failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return python


def test_the_core_venv_has_no_framework(core_python):
    probe = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])" % (FRAMEWORKS,)
    done = _run([core_python, "-c", probe], timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the core venv sees frameworks: {done.stdout}"


def test_framework_tests_skip_with_their_reason(core_python):
    folders = [os.path.join("tests", f) for f in FRAMEWORK_FOLDERS]
    done = _run([core_python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *folders,
                 "tests/test_layering.py"], timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    # Each framework's folder says what it is missing (the reason), not a bare skip.
    for needed in ("torch", "tensorflow", "jax", "mxnet", "ray", "pyarrow"):
        assert any(needed in line for line in reasons), f"no skip reason names {needed}:\n{out[-6000:]}"


def test_the_whole_suite_collects(core_python):
    done = _run([core_python, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests"],
                timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
