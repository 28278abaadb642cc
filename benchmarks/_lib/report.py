"""What every report shares: markdown tables, the run header (machine, load, versions, checkout) and JSON output."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

from benchmarks._lib.launch import REPO


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Optional[str] = None) -> List[str]:
    """A markdown table; ``align`` is one letter per column (``l`` or ``r``; default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        return rev or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def version(dist: str) -> Optional[str]:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    return f"{os.cpu_count()} cores (nproc), {cpu_model()}, {platform.machine()}, Linux {platform.release()}"


def load() -> float:
    """The 1-minute load average (what a reader needs to weigh a number measured on a shared machine)."""
    return os.getloadavg()[0]


def header(argv: Optional[Sequence[str]]) -> Dict[str, str]:
    """The lines every report starts with: date, machine, command, load average at start."""
    args = sys.argv if argv is None else [sys.argv[0], *argv]
    return {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
            "command": "python " + " ".join(shlex.quote(a) for a in args),
            "load average": f"{load():.2f} at start"}


def print_run_lines(script: str, load_start: float) -> None:
    """The first Markdown lines of a training benchmark's report: date, machine, command, load, checkout."""
    print(f"- **date**: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"- **machine**: {machine()}")
    print(f"- **command**: python {shlex.join([os.path.relpath(script), *sys.argv[1:]])}")
    print(f"- **load average**: {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (1-minute)")
    print(f"- **horovod checkout**: {git_rev()}")


def write_json(path: str, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)


def chart_note(what: str = "") -> str:
    """A chart's footnote: when, on how many cores, at what load (and ``what`` ran: the command's sizes)."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return f"{now}; {os.cpu_count()} cores; load average {load():.1f}" + (f"; {what}" if what else "")
