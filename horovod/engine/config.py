"""The one table of knobs, and the frozen configuration resolved from it at ``init()``.

Every tunable of the project is declared here exactly once, as a typed field of :class:`Config`: its name, type,
default, the ``HOROVOD_*`` environment variable that carries it to a worker, the ``horovodrun`` flag that sets it,
its key in a ``--config-file`` YAML and the values it accepts (:func:`horovod.engine.knobs.knob`).
:data:`KNOBS` is read back from the class; the launcher generates its flags from it and the engine reads its
values from the environment through :func:`load` and nowhere else.  A misspelt knob (``config.fusion_threshol``)
is a mypy error, and a value outside what the table accepts is a ``ValueError`` naming the variable.

Precedence (highest first): explicit argument > horovodrun flag > ``HOROVOD_*`` environment > config file >
default.  The launcher folds flags and the config file into the workers' environment, so a worker only has
to read its environment.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from horovod.engine.knobs import MIB, Knob, knob, table
from horovod.transport.spin import default_budget_us

#: Upper limit of the byte-count knobs (1 TiB): far above any sensible buffer, far below an overflow.
MAX_BYTES = 1 << 40
#: Upper limit of the timeouts, in seconds (a year: "never" in practice; larger values overflow some waits).
MAX_SECONDS = 365 * 24 * 3600


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as the launcher (or MPI) told it."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"
    rendezvous_addr: Optional[str] = None
    rendezvous_port: Optional[int] = None
    secret: Optional[bytes] = None
    iface: str = ""
    launched_by: str = "none"   # 'horovodrun', 'mpirun' or 'none'
    elastic_worker_id: str = ""  # stable identity of an elastic worker across resets


@dataclass(frozen=True)
class Config:
    """Frozen knob values for one ``init()``; built by :func:`load`.  The class body is the knob table."""

    # Tensor fusion and the coordinator's batching window.
    fusion_threshold: int = knob(
        128 * MIB, "HOROVOD_FUSION_THRESHOLD", "Fusion buffer threshold in MB; 0 disables tensor fusion.",
        flag="--fusion-threshold-mb", config_key="params.fusion_threshold_mb", flag_scale=MIB, minimum=0,
        maximum=MAX_BYTES)
    # nan or inf would hold every collective that is not fused at once for ever (issue 38, E4).
    cycle_time_ms: float = knob(
        0.0, "HOROVOD_CYCLE_TIME", "Batching window in ms: how long the coordinator may hold ready tensors to fuse "
        "more of them (0: dispatch as soon as the data plane is free).",
        flag="--cycle-time-ms", config_key="params.cycle_time_ms", minimum=0, maximum=60_000)
    # The coordinator keeps a free list of every slot: the limit bounds that list to a few MiB.
    cache_capacity: int = knob(
        1024, "HOROVOD_CACHE_CAPACITY", "Response cache slots, the same on every rank: on one host (shm) a repeated "
        "collective runs from every rank's cache after one AND of hit bits per round, without the coordinator; "
        "otherwise a repeated request travels as a slot number and skips validation (0 disables both).",
        flag="--cache-capacity", config_key="params.cache_capacity", minimum=0, maximum=1 << 20)
    hierarchical_allreduce: bool = knob(
        False, "HOROVOD_HIERARCHICAL_ALLREDUCE", "Reduce inside each host first, then across hosts.",
        flag="--hierarchical-allreduce", config_key="params.hierarchical_allreduce", negatable=True)
    hierarchical_allgather: bool = knob(
        False, "HOROVOD_HIERARCHICAL_ALLGATHER", "Gather inside each host first, then across hosts.",
        flag="--hierarchical-allgather", config_key="params.hierarchical_allgather", negatable=True)
    torus_allreduce: bool = knob(
        False, "HOROVOD_TORUS_ALLREDUCE", "2D torus allreduce (accepted for compatibility; CPU paths ignore it).",
        flag="--torus-allreduce", config_key="params.torus_allreduce", negatable=True)
    # Autotune.
    autotune: bool = knob(
        False, "HOROVOD_AUTOTUNE", "Tune the fusion threshold and cycle time with Bayesian optimisation (knobs set "
        "explicitly stay fixed).", flag="--autotune", config_key="autotune.enabled", negatable=True)
    autotune_log: str = knob(
        "", "HOROVOD_AUTOTUNE_LOG", "CSV file where rank 0 logs every autotune sample.",
        flag="--autotune-log-file", config_key="autotune.log_file")
    autotune_warmup_samples: int = knob(
        3, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "Samples discarded before tuning starts.",
        flag="--autotune-warmup-samples", config_key="autotune.warmup_samples", minimum=0, maximum=1_000_000)
    autotune_steps_per_sample: int = knob(
        10, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "Steps measured per sample.",
        flag="--autotune-steps-per-sample", config_key="autotune.steps_per_sample", minimum=1, maximum=1_000_000)
    autotune_bayes_opt_max_samples: int = knob(
        20, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "Maximum samples of the Bayesian optimisation.",
        flag="--autotune-bayes-opt-max-samples", config_key="autotune.bayes_opt_max_samples", minimum=1,
        maximum=1_000_000)
    autotune_gaussian_process_noise: float = knob(
        0.8, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "Noise (alpha) of the Gaussian process, in [0, 1].",
        flag="--autotune-gaussian-process-noise", config_key="autotune.gaussian_process_noise", minimum=0,
        maximum=1)
    # Timeline.
    timeline: str = knob(
        "", "HOROVOD_TIMELINE", "Rank 0 writes a Chrome-trace timeline to this file from hvd.init() on "
        "(docs/timeline.md); the value DYNAMIC records nothing until hvd.start_timeline(path).",
        flag="--timeline-filename", config_key="timeline.filename")
    timeline_mark_cycles: bool = knob(
        False, "HOROVOD_TIMELINE_MARK_CYCLES", "Mark coordinator cycles in the timeline.",
        flag="--timeline-mark-cycles", config_key="timeline.mark_cycles", negatable=True)
    # Stall inspector.
    stall_check_disable: bool = knob(
        False, "HOROVOD_STALL_CHECK_DISABLE", "Disable the stall inspector.",
        flag="--no-stall-check", config_key="stall_check.enabled", inverted=True)
    stall_check_time_seconds: int = knob(
        60, "HOROVOD_STALL_CHECK_TIME_SECONDS", "Warn when some ranks have waited this long for the others.",
        flag="--stall-check-warning-time-seconds", config_key="stall_check.warning_time_seconds", minimum=0,
        maximum=MAX_SECONDS)
    stall_shutdown_time_seconds: int = knob(
        0, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "Fail the stalled collectives after this long (0: never; a value "
        "below the warning time is raised to it).", flag="--stall-check-shutdown-time-seconds",
        config_key="stall_check.shutdown_time_seconds", minimum=0, maximum=MAX_SECONDS)
    # Library options.
    mpi_threads_disable: bool = knob(
        False, "HOROVOD_MPI_THREADS_DISABLE", "Request MPI_THREAD_SINGLE instead of MPI_THREAD_MULTIPLE.",
        flag="--mpi-threads-disable", config_key="library_options.mpi_threads_disable", negatable=True)
    num_nccl_streams: int = knob(
        1, "HOROVOD_NUM_NCCL_STREAMS", "CUDA streams (each with its own NCCL communicator) that GPU collectives "
        "take turns on; more than 1 lets independent collectives overlap.",
        flag="--num-nccl-streams", config_key="library_options.num_nccl_streams", minimum=1, maximum=64)
    gpu_operations: str = knob(
        "", "HOROVOD_GPU_OPERATIONS", "How collectives on GPU tensors run: NCCL, or HOST (staged through pinned "
        "host memory and the CPU transport); empty: NCCL where every rank can load it and no two ranks share a "
        "GPU, else HOST.", choices=("", "NCCL", "HOST"))
    nccl_so_path: str = knob(
        "", "HOROVOD_NCCL_SO_PATH", "The NCCL library (or an NCCL-compatible one: RCCL, a vendor's) to load; "
        "empty: the nvidia-nccl wheel of this Python, then the system's libnccl.so.2.")
    gpu_operation_timeout_seconds: float = knob(
        600.0, "HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS", "Seconds a GPU collective may take on the device after it "
        "was enqueued; then (or at any asynchronous NCCL error) the engine dumps its flight recorder, aborts its NCCL "
        "communicators and fails every pending collective with the reason (0: never).",
        minimum=0, maximum=MAX_SECONDS)
    thread_affinity: str = knob(
        "", "HOROVOD_THREAD_AFFINITY", "Comma-separated core ids, one per local rank, for the background thread.",
        flag="--thread-affinity", config_key="library_options.thread_affinity",
        pattern=r"\s*(\d+\s*(,\s*\d+\s*)*)?", pattern_help="comma-separated core ids such as 0,1 (or empty)")
    bind_cores: bool = knob(
        False, "HOROVOD_BIND_CORES", "Bind each worker to its own share of its host's cores (cores // workers on "
        "the host); horovodrun, horovod.run, Spark and Ray turn it on unless you set it (or set OMP_NUM_THREADS "
        "above that share). Ignored when a host has more workers than cores.", flag="--bind-cores", negatable=True)
    # 0 would fail every wait at once and blame the peers for it.
    gloo_timeout_seconds: int = knob(
        30, "HOROVOD_GLOO_TIMEOUT_SECONDS", "Seconds a transport waits on a peer before the collective fails (also "
        "bounds rendezvous).", flag="--gloo-timeout-seconds", config_key="library_options.gloo_timeout_seconds",
        minimum=1, maximum=MAX_SECONDS)
    # The hang doctor (horovod/engine/flight_recorder.py, horovod/doctor; docs/debugging.md).
    flight_recorder_size: int = knob(
        2000, "HOROVOD_FLIGHT_RECORDER_SIZE", "About how many of its last collectives every rank's flight recorder "
        "keeps for hang dumps (0: off).", flag="--flight-recorder-size", minimum=0, maximum=1_000_000)
    flight_recorder_dir: str = knob(
        "", "HOROVOD_FLIGHT_RECORDER_DIR", "Directory for hang dumps (each rank's recorder and thread stacks); "
        "horovodrun makes one per job; empty outside horovodrun: <tmp>/horovod-flight-recorder. hvd.init() fails "
        "when it can neither be written to nor created.", flag="--flight-recorder-dir", directory=True)
    # Logging.
    log_level: str = knob(
        "WARNING", "HOROVOD_LOG_LEVEL", "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL.",
        flag="--log-level", config_key="logging.level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR",
                                                                  "FATAL"))
    log_hide_time: bool = knob(
        False, "HOROVOD_LOG_HIDE_TIME", "Hide timestamps in Horovod log lines.",
        flag="--log-without-timestamp", config_key="logging.with_timestamp", inverted=True)
    # Controller / data plane selection.
    controller: str = knob(
        "", "HOROVOD_CONTROLLER", "gloo (built-in) or mpi; empty: chosen from how the job was launched.",
        config_key="controller", choices=("", "gloo", "mpi"))
    cpu_operations: str = knob(
        "", "HOROVOD_CPU_OPERATIONS", "gloo (built-in transports) or mpi; empty: chosen from how the job was "
        "launched.", choices=("", "gloo", "mpi"))
    transport: str = knob(
        "auto", "HOROVOD_TRANSPORT", "Data plane: auto, tcp, shm or mpi (auto: shm inside a host, tcp across "
        "hosts; mpi under mpirun).", flag="--transport", config_key="params.transport",
        choices=("auto", "tcp", "shm", "mpi", "hierarchical"))
    # Engine behaviour.
    dynamic_process_sets: bool = knob(
        False, "HOROVOD_DYNAMIC_PROCESS_SETS", "Allow add_process_set / remove_process_set after init.")
    disable_group_fusion: bool = knob(
        False, "HOROVOD_DISABLE_GROUP_FUSION", "Fuse each explicit group on its own.")
    elastic: bool = knob(False, "HOROVOD_ELASTIC", "Set by the launcher for elastic jobs.")
    elastic_timeout_seconds: int = knob(
        600, "HOROVOD_ELASTIC_TIMEOUT", "Elastic jobs: seconds to wait for enough slots (min-np) after a change "
        "before failing.", minimum=1, maximum=MAX_SECONDS)
    init_timeout_seconds: int = knob(
        120, "HOROVOD_INIT_TIMEOUT_SECONDS", "Seconds init() waits for every rank to reach it (slow imports on busy "
        "hosts need headroom).", minimum=1, maximum=MAX_SECONDS)
    inline_bytes: int = knob(
        1024, "HOROVOD_INLINE_BYTES", "Allreduces of at most this many bytes travel with their request and are "
        "reduced by the coordinator (one round trip instead of negotiation plus a collective); 0 disables.",
        minimum=0, maximum=MAX_BYTES)
    fast_lane: bool = knob(
        True, "HOROVOD_FAST_LANE", "Ranks of one host agree on lone blocking allreduces of at most "
        "HOROVOD_FAST_LANE_BYTES through shared memory and reduce them themselves, in one synchronisation, without "
        "the coordinator; anything else, or a mismatch, takes the coordinator path (0 disables).")
    fast_lane_bytes: int = knob(
        1024 * 1024, "HOROVOD_FAST_LANE_BYTES", "Largest payload a rank posts on the fast lane (bytes; at most "
        "the lane's payload area: 1 MiB on shared memory, 256 KiB over TCP; an allreduce's at most 512 KiB / the "
        "number of ranks, since every rank reads and reduces every payload); larger collectives are agreed on the "
        "lane and carried by the data plane.",
        minimum=0, maximum=1024 * 1024)
    fast_lane_hold_us: float = knob(
        200.0, "HOROVOD_FAST_LANE_HOLD_US", "Microseconds a lone asynchronous collective the fast lane could take "
        "waits before it goes the coordinator's way: if its caller waits for it meanwhile, it takes the lane as a "
        "blocking call (0 disables).", minimum=0, maximum=1_000_000)
    # Spinning is bounded: a second of busy waiting per collective is already far past any use.
    spin_us: float = knob(
        100.0, "HOROVOD_SPIN_US", "Microseconds a rank waiting for its collective re-checks the control plane "
        "before it blocks; only when every local rank has a core of its own (0 disables).",
        minimum=0, maximum=1_000_000)
    # 4 MiB: each collective of a step costs ~0.1-0.3 ms of Python after a backward pass, so fewer, larger buckets
    # win (benchmarks/torch_training.py models: +1-8 % against 1 MiB, docs/decisions/0015-gradient-buckets.md);
    # still far below DDP's 25 MiB, so buckets keep leaving during backward.
    gradient_bucket_bytes: int = knob(
        4 * MIB, "HOROVOD_GRADIENT_BUCKET_BYTES", "horovod.torch, horovod.tensorflow and Keras "
        "DistributedOptimizer / DistributedGradientTape (without groups, not Adasum): small gradients travel "
        "packed in buckets of up to this many bytes, one allreduce per bucket (0: one allreduce per gradient).",
        minimum=0, maximum=MAX_BYTES)
    # 4 MiB: a copy that no longer fits the caches runs at memory speed, where one pass through the kernel beats
    # two through the segments (docs/benchmarks.md, session 21); below, the staged copies win.
    shm_single_copy_bytes: int = knob(
        4 * MIB, "HOROVOD_SHM_SINGLE_COPY_BYTES", "shm transport: an allgather's block or an alltoall's piece of "
        "at least this many bytes is read straight from the sending rank's memory (Linux cross-memory attach: one "
        "copy instead of two through shared memory), where the kernel lets every rank do so (0 disables).",
        minimum=0, maximum=MAX_BYTES)
    small_message_bytes: int = knob(
        256 * 1024, "HOROVOD_SMALL_MESSAGE_BYTES", "tcp transport: below this many bytes, latency-optimal "
        "algorithms instead of rings (shm switches at 1 MiB on its own).", minimum=0, maximum=MAX_BYTES)

    # Not knobs: resolved by load() beside them.
    #: NCCL's own switch (2.30+, ``NCCL_MULTI_RANK_GPU_ENABLE``) for several ranks of one communicator on one GPU:
    #: the device data plane must know whether NCCL will accept that before it creates a communicator.
    nccl_multi_rank_gpu: bool = False
    #: Knobs set explicitly (autotune leaves them alone).
    fixed: FrozenSet[str] = frozenset()
    topology: Topology = Topology()

    def __post_init__(self) -> None:
        # load() has checked what it read, naming the variable; this catches replace() and direct construction.
        for k in KNOBS:
            k.check(getattr(self, k.name))

    @property
    def spin_budget_us(self) -> float:
        """A waiting rank's re-check time before it sleeps: ``spin_us`` when each local rank has a core, else 0."""
        return default_budget_us(self.topology.local_size, self.spin_us)

    @property
    def values(self) -> Dict[str, Any]:
        """Every knob's value by name."""
        return {k.name: getattr(self, k.name) for k in KNOBS}

    def replace(self, **changes: Any) -> Config:
        """A copy with some knob values changed (used by autotune and tests).

        Raises:
            TypeError: a name is not a field of :class:`Config`.
            ValueError: a value is not accepted by its knob.
        """
        return dataclasses.replace(self, **changes)


#: Every knob, in table order (read back from :class:`Config`).
KNOBS: Tuple[Knob, ...] = table(Config, typing.get_type_hints(Config))
KNOBS_BY_NAME: Dict[str, Knob] = {k.name: k for k in KNOBS}


def parse_value(knob: Knob, raw: str) -> Any:
    """Parse a knob's environment string (see :meth:`Knob.parse`); the value is not range-checked here."""
    return knob.parse(raw)


SECRET_ENV = "_HOROVOD_SECRET_KEY"


def _first_int(env: Mapping[str, str], names: Sequence[str], default: int) -> int:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def topology_from_env(env: Mapping[str, str]) -> Topology:
    """Read the launcher's (or MPI's) description of this process."""
    if "HOROVOD_RANK" in env:
        launched_by = "horovodrun"
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env or "PMIX_RANK" in env:
        launched_by = "mpirun"
    else:
        launched_by = "none"
    rank = _first_int(env, ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"), 0)
    size = _first_int(env, ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), 1)
    local_rank = _first_int(env, ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), 0)
    local_size = _first_int(env, ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
                            size if launched_by == "mpirun" and "OMPI_COMM_WORLD_LOCAL_SIZE" not in env
                            and "MPI_LOCALNRANKS" not in env else 1)
    port = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    secret_hex = env.get(SECRET_ENV)
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=_first_int(env, ("HOROVOD_CROSS_RANK",), 0),
        cross_size=_first_int(env, ("HOROVOD_CROSS_SIZE",), 1),
        hostname=env.get("HOROVOD_HOSTNAME", "localhost"),
        rendezvous_addr=env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or None,
        rendezvous_port=int(port) if port not in (None, "", "-1") else None,
        secret=bytes.fromhex(secret_hex) if secret_hex else None,
        iface=env.get("HOROVOD_GLOO_IFACE", ""),
        launched_by=launched_by,
        elastic_worker_id=env.get("HOROVOD_ELASTIC_WORKER_ID", ""),
    )


def load(env: Optional[Mapping[str, str]] = None, **overrides: Any) -> Config:
    """Resolve and check every knob: explicit ``overrides`` > environment > default.

    Args:
        env: the environment to read (``os.environ`` when ``None``).
        overrides: knob values given explicitly by the caller.

    Returns:
        The frozen :class:`Config`.

    Raises:
        ValueError: a variable does not parse or is not accepted by its knob (not finite, out of range, not one of
            its choices), naming the variable, the value received and what is accepted.
    """
    env = os.environ if env is None else env
    values: Dict[str, Any] = {}
    fixed = set()
    for k in KNOBS:
        if k.name in overrides:
            value = overrides[k.name]
            k.check(value, f"{k.name}={value!r} (given explicitly)")
            values[k.name] = value
            fixed.add(k.name)
        elif k.env and env.get(k.env, "") != "":
            values[k.name] = k.load(env[k.env])
            fixed.add(k.name)
    # NCCL's own switch (2.30+) for several ranks of one communicator on one GPU.
    multi_rank_gpu = env.get("NCCL_MULTI_RANK_GPU_ENABLE", "0") not in ("", "0")
    return Config(**values, nccl_multi_rank_gpu=multi_rank_gpu, fixed=frozenset(fixed),
                  topology=topology_from_env(env))


def check_environment(env: Mapping[str, str]) -> None:
    """Check every knob variable set in ``env`` (the launcher, before it hands ``env`` to its workers).

    Raises:
        ValueError: as :func:`load`, for the first variable that is not accepted.
    """
    for k in KNOBS:
        if k.env and env.get(k.env, "") != "":
            k.load(env[k.env])


def env_value(knob: Knob, value: Any) -> str:
    """Render a knob value as the string a worker's environment carries."""
    if knob.type is bool:
        return "1" if value else "0"
    if knob.type is float:
        return repr(float(value))
    return str(value)


def flag_to_env(knob: Knob, flag_value: Any) -> Optional[str]:
    """What the launcher exports for a flag (or config-file) value; ``None`` when nothing is exported."""
    if flag_value is None:
        return None
    if knob.type is bool:
        value = bool(flag_value)
        return env_value(knob, (not value) if knob.inverted else value)
    if knob.flag_scale != 1:
        return str(int(float(flag_value) * knob.flag_scale))
    return env_value(knob, flag_value)


def environ() -> Mapping[str, str]:
    """The process environment; the only sanctioned read of ``os.environ`` outside the launcher."""
    return os.environ


def set_environ(name: str, value: Optional[str]) -> None:
    """Write one variable of the process environment (``init(process_sets='dynamic')``, elastic re-init)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def markdown_table() -> str:
    """Every knob as a Markdown table (``python -m horovod.engine.config > docs/knobs.md``)."""
    lines = ["# Knobs", "", "Generated from `horovod/engine/config.py` by `python -m horovod.engine.config`; "
             "precedence: explicit argument > horovodrun flag > `HOROVOD_*` environment > config file > default. "
             "A value outside *accepted* stops `hvd.init()` (and `horovodrun`, for a flag) with an error naming "
             "the variable.",
             "", "| knob | environment | horovodrun flag | config file | default | accepted | meaning |",
             "|---|---|---|---|---|---|---|"]
    for k in KNOBS:
        flag = k.flag or ""
        if flag and k.negatable:
            flag += f" / --no-{flag[2:]}"
        default = f"{k.default // MIB} MiB" if k.flag_scale == MIB else repr(k.default)
        lines.append(f"| `{k.name}` | `{k.env or ''}` | `{flag}` | `{k.config_key or ''}` | {default} | "
                     f"{k.accepted()} | {k.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
