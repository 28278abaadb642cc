"""Helpers shared by the launcher tests (a uniquely named module, so no other conftest can shadow it)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
#: Hard ceiling of any single launcher test (seconds); each subprocess call has its own smaller timeout.
HARD_TIMEOUT_S = 120
CALL_TIMEOUT_S = 60


def child_env(**extra: str) -> dict:
    """The test process's environment, with this checkout first on PYTHONPATH and no stray job variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HOROVOD_") and k != "_HOROVOD_SECRET_KEY"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def launcher_argv(args: List[str]) -> List[str]:
    return [sys.executable, "-m", "horovod.runner", *args]
