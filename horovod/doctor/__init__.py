"""The hang doctor: reads the ranks' flight-recorder dumps and says, in a sentence, which rank is where and why the
job does not move (``python -m horovod.doctor DUMP_DIR``; docs/debugging.md).

Pure Python over JSON: it imports nothing of the engine, so it runs anywhere the dump directory is readable.
"""
from __future__ import annotations

import os
from typing import List, Optional

from horovod.doctor.dumps import DumpDirectoryError, Job, load  # noqa: F401
from horovod.doctor.trace import write as write_trace
from horovod.doctor.verdict import diagnose  # noqa: F401

TRACE_FILE = "trace.json"


def report(directory: str, latest: bool = False, trace_path: Optional[str] = None,
           generation: Optional[int] = None) -> List[str]:
    """The verdict for ``directory`` as lines of text, the merged trace written next to the dumps (or to
    ``trace_path``).

    Raises:
        DumpDirectoryError: no dump in ``directory``.
    """
    job = load(directory, latest=latest, generation=generation)
    lines = [f"Horovod doctor ({len(job.ranks)} of {job.size} ranks dumped, generation {job.generation}):"]
    lines += [f"  - {finding}" for finding in diagnose(job)]
    path = trace_path or os.path.join(directory, TRACE_FILE)
    try:
        write_trace(job, path)
        lines.append(f"  trace of the ranks' last collectives: {path} (open in ui.perfetto.dev or chrome://tracing)")
    except OSError as exc:
        lines.append(f"  (could not write the trace to {path}: {exc})")
    return lines
