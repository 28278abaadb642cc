"""A checkout with only the core installed (``pip install -e '.[test]'``: numpy, no framework) runs its tests.

Builds a fresh virtual environment without the system's site-packages, installs the project with its ``test``
extra (with uv where it is on PATH, as .ci/run does, else pip; from the index they are configured with), and runs
pytest there over every framework's test folder and the layering test: the framework tests must be skipped with
their reason, not fail or stop collection (the test folders named like frameworks once stood in for them;
module-level imports of optional packages once stopped collection). Collecting the whole suite there must raise
no error either.

CONTRIBUTING's first steps must pass in that set-up as they do in CI's: ``python -m pytest -m fast`` (its
self-check once counted a skipped framework's entry as stale), ``mypy`` (once failed on a torch-only type alias),
and, with torch added alone (no pyarrow, no Spark), collecting the whole suite (the Spark estimator tests once
imported pyarrow before skipping).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORK_FOLDERS = ("torch", "tensorflow", "keras", "jax", "mxnet", "ray", "spark", "lightning")
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
    python = str(where / "bin" / "python")
    uv = shutil.which("uv")
    if uv:   # what .ci/run installs with: seconds from its cache, where pip takes a minute
        _run([uv, "venv", "-q", "--seed", "--python", sys.executable, str(where)], timeout=120).check_returncode()
        install = [uv, "pip", "install", "-q", "--python", python]
    else:
        venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
        install = [python, "-m", "pip", "install", "-q"]
    done = _run(install + ["-e", f"{REPO}[test]"], timeout=600)
    assert done.returncode == 0, f"installing '.[test]' failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
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


def test_the_fast_tier_passes_in_the_core_venv(core_python):
    done = _run([core_python, "-m", "pytest", "-m", "fast", "-q", "-p", "no:cacheprovider"], timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", out), out[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)")
def test_mypy_passes_without_frameworks(core_python, tmp_path):
    """``mypy`` as configured in pyproject.toml, resolving third-party packages in the core venv (no framework)."""
    done = _run([sys.executable, "-m", "mypy", "--python-executable", core_python, "--cache-dir",
                 str(tmp_path / "mypy-cache")], timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def _alone(dist: str, where) -> str:
    """A folder of links to ``dist`` and the distributions it requires (this interpreter's copies), nothing else:
    put on PYTHONPATH, it adds that one framework to the core venv."""
    from packaging.requirements import Requirement

    todo, seen = [dist], set()
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen or key in ("numpy", "pip", "setuptools"):
            continue
        seen.add(key)
        found = importlib.metadata.distribution(name)
        for raw in found.requires or ():
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        tops = {str(f).split("/")[0] for f in found.files or ()}
        for top in tops:
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            target = found.locate_file(top)
            link = where / top
            if os.path.exists(target) and not os.path.lexists(link):
                os.symlink(target, link)
    return str(where)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
def test_the_whole_suite_collects_with_torch_alone(core_python, tmp_path):
    """CONTRIBUTING's second set-up (the core plus the binding one works on): torch without pyarrow, Spark, ..."""
    extra = _alone("torch", tmp_path)
    env = _env()
    env["PYTHONPATH"] = extra
    probe = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])" % (FRAMEWORKS,)
    seen = subprocess.run([core_python, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == "['torch']", seen.stdout + seen.stderr
    done = subprocess.run([core_python, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
