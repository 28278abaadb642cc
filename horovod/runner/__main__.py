"""``python -m horovod.runner`` is ``horovodrun``."""
from __future__ import annotations

from horovod.runner.launch import run_commandline

if __name__ == "__main__":
    run_commandline()
