"""``horovodrun``: parse the command line, then run the job with the launcher the flags ask for.

Launch modes are chosen by :func:`launch_mode` and dispatched through :data:`JOB_RUNNERS`; ``gloo`` is the
built-in controller (remote hosts are reached over ssh, see :mod:`horovod.runner.ssh`) and ``mpi`` runs the job
under ``mpirun`` (:mod:`horovod.runner.mpi_job`).  A mode without a runner reports that it is not available yet;
whoever adds one registers a function ``(args, parent_env) -> None`` in :data:`JOB_RUNNERS`.

Without ``--gloo`` or ``--mpi`` a job runs under mpirun when mpirun and mpi4py are installed and the job spans
several hosts, and with the built-in launcher otherwise.

Deviation from the original: ``-np 2 -H localhost:4`` starts exactly 2 workers (the original's Gloo path
started one per slot, 4).
"""
from __future__ import annotations

import argparse
from horovod.common.util import module_installed
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, Mapping, NoReturn, Optional, Sequence

from horovod.runner import cli, config_file
from horovod.runner.cli import DEFAULT_START_TIMEOUT, start_timeout  # noqa: F401  (part of this module's API)
from horovod.runner.doctor_watch import STARTING, UNDER_MPIRUN, NotServing
from horovod.runner.exec import JobFailedError, LaunchNotAvailableError, WorkerStartError
from horovod.runner.hosts import get_host_assignments, placement_text, resolve_hosts
from horovod.runner.job import JobSettings, run_gloo_job
from horovod.runner.mpi_job import mpi_available, run_mpi_job, spans_several_hosts

logger = logging.getLogger(__name__)

#: Exit status for usage errors and launch modes that are not available (argparse's convention).
USAGE_EXIT = 2


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``horovodrun`` arguments, fold in ``--config-file`` and validate the tuning values.

    Exits with status 2 and a usage message on any error, as argparse does.
    """
    parser = cli.build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.config_file:
        try:
            config_file.apply(args, config_file.load(args.config_file), source=args.config_file)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        config_file.validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _framework_available(module: str) -> bool:
    # Found without importing the framework: checking must stay cheap and side-effect free.
    return module_installed(module)


#: Every binding, as ``--check-build`` lists it: (name shown, the module whose presence makes it usable).  The
#: original's three first, in its order; horovod.keras / horovod.tensorflow.keras come with TensorFlow.
FRAMEWORKS = (("TensorFlow", "tensorflow"), ("PyTorch", "torch"), ("MXNet", "mxnet"), ("JAX", "jax"),
              ("NumPy", "numpy"))


def check_build_text() -> str:
    """What ``horovodrun --check-build`` prints: the truth about this installation."""
    from horovod.version import __version__

    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    mpi = _framework_available("mpi4py")
    # The original's first line, then this installation's own version (0.28.1 scripts matched the line's start).
    lines = [f"Horovod v{__version__} ({cli.DISTRIBUTION} {cli.distribution_version()}):", "",
             "Available Frameworks:"]
    for name, module in FRAMEWORKS:
        lines.append(f"    {mark(_framework_available(module))} {name}")
    lines += ["", "Available Controllers:", f"    {mark(mpi)} MPI", f"    {mark(True)} Gloo", "",
              "Available Tensor Operations:"]
    from horovod.common import basics

    nccl = basics.nccl_built() > 0
    for name, ok in (("NCCL", nccl), ("DDL", False), ("CCL", False), ("MPI", mpi), ("Gloo", True)):
        lines.append(f"    {mark(ok)} {name}")
    return "\n".join(lines) + "\n"


def launch_mode(args: Any, mpi_installed: Optional[Callable[[], bool]] = None) -> str:
    """``elastic``, ``mpi``, ``jsrun`` or ``gloo``.

    Without ``--gloo``/``--mpi``/``--jsrun``: ``mpi`` when mpirun and mpi4py are installed and the job spans
    several hosts, ``gloo`` (the built-in controller, always there) otherwise.
    """
    if cli.elastic_requested(args):
        return "elastic"
    if getattr(args, "use_mpi", None):
        return "mpi"
    if getattr(args, "use_jsrun", None):
        return "jsrun"
    if getattr(args, "use_gloo", None):
        return "gloo"
    try:
        several = spans_several_hosts(resolve_hosts(args), getattr(args, "num_proc", None))
    except ValueError:
        several = False   # a bad host list is reported by the job itself
    if several and (mpi_installed or mpi_available)():
        return "mpi"
    return "gloo"


def _not_available(mode: str, args: Any) -> NoReturn:
    if mode == "elastic":
        given = ", ".join(cli.option_for(d) for d in cli.elastic_requested(args))
        raise LaunchNotAvailableError(
            f"elastic mode ({given}) is not yet supported by this launcher; run a static job with -np instead")
    raise LaunchNotAvailableError(
        f"launching with {mode} (--{mode}) is not yet supported by this launcher; use the built-in controller "
        f"(--gloo, the default)")


def job_settings(args: Any, command: Any, parent_env: Mapping[str, str]) -> JobSettings:
    """Turn parsed arguments into :class:`JobSettings` for a static built-in-controller job.

    Raises:
        ValueError: -np missing or not positive, a bad host list, a bad start timeout.
    """
    if args.num_proc is None:
        raise ValueError("-np/--num-proc is required: how many processes to start, e.g. -np 2")
    if args.num_proc < 1:
        raise ValueError(f"-np/--num-proc must be >= 1, got {args.num_proc}")
    timeout = start_timeout(getattr(args, "start_timeout", None), parent_env)
    if timeout < 0:
        raise ValueError(f"--start-timeout must be >= 0, got {timeout}")
    return JobSettings(
        num_proc=args.num_proc,
        hosts=resolve_hosts(args),
        command=command,
        knob_env=cli.knob_env(args, parent_env),
        nics=list(getattr(args, "nics", None) or []),
        output_dir=getattr(args, "output_filename", None),
        prefix_timestamp=bool(getattr(args, "prefix_output_with_timestamp", False)),
        start_timeout=timeout,
        ssh_port=getattr(args, "ssh_port", None),
        ssh_identity_file=getattr(args, "ssh_identity_file", None),
        disable_cache=bool(getattr(args, "disable_cache", False)),
        mpi_args=getattr(args, "mpi_args", None),
        binding_args=getattr(args, "binding_args", None),
        tcp=bool(getattr(args, "tcp_flag", False)),
    )


def announce(settings: JobSettings, how: str = "") -> None:
    """Say on standard error, before anything starts, how many processes the job runs and where (the first thing a
    user sees while the workers import their frameworks)."""
    slots = get_host_assignments(settings.hosts, settings.num_proc)
    print(f"horovodrun: starting {placement_text(slots)}{how}", file=sys.stderr, flush=True)


def run_gloo(args: Any, parent_env: Mapping[str, str]) -> None:
    """Run ``args.command`` as a static job with the built-in controller on this machine."""
    settings = job_settings(args, list(args.command), parent_env)
    announce(settings)
    run_gloo_job(settings, parent_env)


def run_elastic(args: Any, parent_env: Mapping[str, str]) -> None:
    """Run ``args.command`` as an elastic job (:mod:`horovod.runner.elastic`, imported only when used)."""
    from horovod.runner.elastic.launch import run_elastic as _run_elastic

    _run_elastic(args, parent_env)


def run_mpi(args: Any, parent_env: Mapping[str, str]) -> None:
    """Run ``args.command`` as a static job under ``mpirun``."""
    settings = job_settings(args, list(args.command), parent_env)
    announce(settings, " under mpirun")
    run_mpi_job(settings, parent_env)


def run_jsrun(args: Any, parent_env: Mapping[str, str]) -> None:
    """Run ``args.command`` through ``jsrun`` on an LSF cluster (:mod:`horovod.runner.js_run`)."""
    from horovod.runner import js_run

    given = bool(getattr(args, "hosts", None) or getattr(args, "hostfile", None))
    if args.num_proc is not None and args.num_proc < 1:
        raise ValueError(f"-np/--num-proc must be >= 1, got {args.num_proc}")
    js_run.run_jsrun(args, parent_env, cli.knob_env(args, parent_env), resolve_hosts(args) if given else None)


#: Launch mode → function running the job; see the module docstring.
JOB_RUNNERS: Dict[str, Callable[[Any, Mapping[str, str]], None]] = {"gloo": run_gloo, "mpi": run_mpi,
                                                                    "elastic": run_elastic, "jsrun": run_jsrun}


class _Stopped(BaseException):
    """Raised in the main thread by the SIGTERM / SIGHUP handler so the job unwinds and kills its workers."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalGuard:
    """The first SIGINT / SIGTERM / SIGHUP unwinds the job (which stops the workers); later ones are ignored
    so that they cannot interrupt the cleanup half-way and leave workers behind."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum, _frame):
        if self.fired:
            logger.warning("already stopping the workers; ignoring %s", signal.Signals(signum).name)
            return
        self.fired = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Stopped(signum)


def _configure_logging(verbose: bool) -> None:
    root = logging.getLogger("horovod.runner")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("horovodrun: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


#: The launcher's ``SIGUSR1`` handler until a job's hang watch takes over (``--dump-flight-recorder``).
_DUMP_PLACEHOLDER = NotServing(STARTING)


def _run(args: argparse.Namespace, parent_env: Mapping[str, str]) -> int:
    mode = launch_mode(args)
    runner = JOB_RUNNERS.get(mode)
    if runner is None:
        _not_available(mode, args)
    if mode == "mpi":
        _DUMP_PLACEHOLDER.why = UNDER_MPIRUN
    runner(args, parent_env)
    return 0


def run_commandline(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``horovodrun`` (and ``python -m horovod.runner``); exits the process.

    Exit status: 0 when every worker succeeded; 1 when one failed (the others are terminated); 2 for usage
    errors and launch modes that are not available; 127/126 when the command cannot be started;
    128 + signal number when the launcher was interrupted.
    """
    args = parse_args(argv)
    if args.check_build:
        sys.stdout.write(check_build_text())
        sys.exit(0)
    if args.dump_flight_recorder is not None:
        from horovod.runner.doctor_watch import request_dump   # the hang doctor

        sys.exit(request_dump(args.dump_flight_recorder))
    prog = "horovodrun"
    if not args.command:
        cli.build_parser().error("no command to run; usage: horovodrun -np <n> <command> [args...]")
    _configure_logging(args.verbose)
    parent_env = dict(os.environ)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        guard = _SignalGuard()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:   # respect nohup / background-job ignores
                previous[sig] = signal.signal(sig, guard)
        if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            # A dump request must never kill the launcher (SIGUSR1's default action) or go unanswered.
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, _DUMP_PLACEHOLDER)
    try:
        code = _run(args, parent_env)
    except (LaunchNotAvailableError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = USAGE_EXIT
    except WorkerStartError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except JobFailedError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; all workers were stopped", file=sys.stderr)
        code = 128 + signal.SIGINT
    except _Stopped as exc:
        print(f"{prog}: received {signal.Signals(exc.signum).name}; all workers were stopped", file=sys.stderr)
        code = 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run_commandline()
