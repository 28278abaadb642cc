"""Forward the workers' output line by line, each line tagged with its rank.

A line of rank 3's standard output reaches the launcher's standard output as ``[3]<stdout>:text`` (standard
error likewise on the launcher's standard error), optionally preceded by the local time.  Lines from
different workers never interleave inside a line.  With ``--output-filename DIR`` every rank's streams are
also written, untagged, to ``DIR/rank.<padded rank>/stdout`` and ``stderr``.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO, Dict, List, Optional

logger = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")


def pad_rank(rank: int, size: int) -> str:
    """``rank`` zero-padded to the width of the largest rank (size 11 → ``"03"``)."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


def rank_dir(output_dir: str, rank: int, size: int) -> str:
    """``<output_dir>/rank.<padded rank>``."""
    return os.path.join(output_dir, f"rank.{pad_rank(rank, size)}")


def prefix(rank: int, stream: str, with_timestamp: bool = False) -> str:
    """The tag put in front of each forwarded line: ``[rank]<stream>:``, after the time if asked."""
    tag = f"[{rank}]<{stream}>:"
    return f"{time.asctime()} {tag}" if with_timestamp else tag


class OutputSink:
    """Collects the workers' pipes and writes whole, tagged lines to the launcher's streams.

    Args:
        size: number of ranks (for the padding of ``rank.<n>`` directories).
        prefix_timestamp: put the local time before each line's tag.
        output_dir: also write each rank's raw output under this directory.
        stdout, stderr: where tagged lines go (the launcher's own streams by default).
    """

    def __init__(self, size: int, prefix_timestamp: bool = False, output_dir: Optional[str] = None,
                 stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None):
        self.size = size
        self.prefix_timestamp = prefix_timestamp
        self.output_dir = output_dir
        self._targets = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        # One lock per target stream keeps every line whole even when many ranks write at once.
        self._locks = {name: threading.Lock() for name in STREAMS}
        self._threads: List[threading.Thread] = []
        self._files: List[IO[bytes]] = []

    def attach(self, rank: int, pipes: Dict[str, Optional[IO[bytes]]]) -> None:
        """Start forwarding ``pipes`` (``{"stdout": pipe, "stderr": pipe}``) of ``rank``."""
        files: Dict[str, Optional[IO[bytes]]] = {name: None for name in STREAMS}
        if self.output_dir:
            directory = rank_dir(self.output_dir, rank, self.size)
            os.makedirs(directory, exist_ok=True)
            for name in STREAMS:
                handle = open(os.path.join(directory, name), "wb")
                self._files.append(handle)
                files[name] = handle
        for name in STREAMS:
            pipe = pipes.get(name)
            if pipe is None:
                continue
            thread = threading.Thread(target=self._pump, args=(rank, name, pipe, files[name]),
                                      name=f"hvd-output-{rank}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, rank: int, stream: str, pipe: IO[bytes], copy: Optional[IO[bytes]]) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                if copy is not None:
                    copy.write(line)
                    copy.flush()
                self._emit(rank, stream, line)
        except (OSError, ValueError) as exc:  # the pipe or a target closed under us at shutdown
            logger.debug("output of rank %s (%s) stopped: %s", rank, stream, exc)
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def _emit(self, rank: int, stream: str, line: bytes) -> None:
        target = self._targets[stream]
        tag = prefix(rank, stream, self.prefix_timestamp).encode()
        with self._locks[stream]:
            buffer = getattr(target, "buffer", None)
            if buffer is not None:
                # Raw bytes: a worker's output need not be valid in the launcher's encoding.
                target.flush()
                buffer.write(tag + line)
                buffer.flush()
            else:
                target.write((tag + line).decode("utf-8", errors="replace"))
                target.flush()

    def finish(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the pipes to drain, then close the per-rank files.

        A worker's own child may keep a pipe open after the worker exits; its reader is abandoned after
        ``timeout`` seconds (it is a daemon thread) rather than holding the launcher.
        """
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.info("output of %s still open after the worker exited; no longer waiting for it",
                            thread.name)
        for handle in self._files:
            try:
                handle.close()
            except OSError:
                pass
        self._files = []
