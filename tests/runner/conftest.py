"""Shared fixtures of the launcher tests: a hard per-test timeout and helpers that run the real launcher."""
from __future__ import annotations

import faulthandler
import subprocess
from typing import List, Optional

import pytest

from runner_helpers import CALL_TIMEOUT_S, HARD_TIMEOUT_S, child_env, launcher_argv


@pytest.fixture(autouse=True)
def _hard_timeout():
    """Abort the whole test process with every thread's stack if a test hangs (no pytest-timeout needed)."""
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def hvdrun():
    """Run ``python -m horovod.runner <args>`` to completion (bounded) and return the CompletedProcess."""

    def run(args: List[str], timeout: float = CALL_TIMEOUT_S, input: Optional[str] = None, env: Optional[dict] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        return subprocess.run(launcher_argv(args), capture_output=True, text=True, timeout=timeout,
                              input=input, env=env or child_env(), cwd=cwd,
                              stdin=None if input is not None else subprocess.DEVNULL)

    return run


@pytest.fixture
def script(tmp_path):
    """Write a worker script into the test's directory and return its path as a string."""

    def write(source: str, name: str = "worker.py") -> str:
        path = tmp_path / name
        path.write_text(source)
        return str(path)

    return write
