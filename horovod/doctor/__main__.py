"""``python -m horovod.doctor DUMP_DIR``: print the verdict on a hung or failed job and write its merged trace."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from horovod.doctor import DumpDirectoryError, report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod.doctor",
                                     description="Diagnose a hung Horovod job from its flight-recorder dumps.")
    parser.add_argument("directory", help="the dump directory (horovodrun prints it; HOROVOD_FLIGHT_RECORDER_DIR)")
    parser.add_argument("--latest", action="store_true",
                        help="read each rank's last dump instead of its first (the first caught the hang as it "
                             "began)")
    parser.add_argument("--generation", type=int, default=None,
                        help="diagnose this generation (an elastic job's epoch: the N of the g<N>- file names) "
                             "instead of the newest")
    parser.add_argument("--trace", default=None, help="where to write the merged trace (default: DIR/trace.json)")
    args = parser.parse_args(argv)
    try:
        print("\n".join(report(args.directory, latest=args.latest, trace_path=args.trace,
                                generation=args.generation)))
    except DumpDirectoryError as exc:
        print(f"horovod.doctor: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
