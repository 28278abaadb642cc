"""The one table of knobs, and the frozen configuration resolved from it at ``init()``.

Every tunable of the project is declared here exactly once: its name, type, default, the ``HOROVOD_*``
environment variable that carries it to a worker, the ``horovodrun`` flag that sets it, and its key in a
``--config-file`` YAML.  The launcher generates its flags from this table; the engine reads its values
from the environment through :func:`load` and nowhere else.

Precedence (highest first): explicit argument > horovodrun flag > ``HOROVOD_*`` environment > config file >
default.  The launcher folds flags and the config file into the workers' environment, so a worker only has
to read its environment.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

MIB = 1024 * 1024


@dataclass(frozen=True)
class Knob:
    """One tunable.

    Attributes:
        name: attribute name on :class:`Config`.
        type: ``int``, ``float``, ``bool`` or ``str``.
        default: value when nothing sets it.
        env: the ``HOROVOD_*`` variable carrying it to workers (``None``: launcher-only).
        flag: the ``horovodrun`` long flag, or ``None``.
        config_key: ``section.key`` in the YAML config file, or ``None``.
        help: one line for ``horovodrun --help``.
        negatable: the flag also has a ``--no-`` form (booleans).
        flag_scale: a flag value is multiplied by this before it goes into ``env`` (MiB → bytes).
        inverted: the flag / config value is the logical complement of the env value.
        aliases: extra spellings of the flag.
    """

    name: str
    type: type
    default: Any
    env: Optional[str]
    flag: Optional[str]
    config_key: Optional[str]
    help: str
    negatable: bool = False
    flag_scale: float = 1
    inverted: bool = False
    aliases: Tuple[str, ...] = ()


KNOBS: Tuple[Knob, ...] = (
    # Tensor fusion and the coordinator's batching window.
    Knob("fusion_threshold", int, 128 * MIB, "HOROVOD_FUSION_THRESHOLD", "--fusion-threshold-mb",
         "params.fusion_threshold_mb", "Fusion buffer threshold in MB; 0 disables tensor fusion.", flag_scale=MIB),
    Knob("cycle_time_ms", float, 0.0, "HOROVOD_CYCLE_TIME", "--cycle-time-ms", "params.cycle_time_ms",
         "Batching window in ms: how long the coordinator may hold ready tensors to fuse more of them "
         "(0: dispatch as soon as the data plane is free)."),
    Knob("cache_capacity", int, 1024, "HOROVOD_CACHE_CAPACITY", "--cache-capacity", "params.cache_capacity",
         "Response cache slots, the same on every rank: on one host (shm) a repeated collective runs from every "
         "rank's cache after one AND of hit bits per round, without the coordinator; otherwise a repeated request "
         "travels as a slot number and skips validation (0 disables both)."),
    Knob("hierarchical_allreduce", bool, False, "HOROVOD_HIERARCHICAL_ALLREDUCE", "--hierarchical-allreduce",
         "params.hierarchical_allreduce", "Reduce inside each host first, then across hosts.", negatable=True),
    Knob("hierarchical_allgather", bool, False, "HOROVOD_HIERARCHICAL_ALLGATHER", "--hierarchical-allgather",
         "params.hierarchical_allgather", "Gather inside each host first, then across hosts.", negatable=True),
    Knob("torus_allreduce", bool, False, "HOROVOD_TORUS_ALLREDUCE", "--torus-allreduce",
         "params.torus_allreduce", "2D torus allreduce (accepted for compatibility; CPU paths ignore it).",
         negatable=True),
    # Autotune.
    Knob("autotune", bool, False, "HOROVOD_AUTOTUNE", "--autotune", "autotune.enabled",
         "Tune the fusion threshold and cycle time with Bayesian optimisation (knobs set explicitly stay fixed).",
         negatable=True),
    Knob("autotune_log", str, "", "HOROVOD_AUTOTUNE_LOG", "--autotune-log-file", "autotune.log_file",
         "CSV file where rank 0 logs every autotune sample."),
    Knob("autotune_warmup_samples", int, 3, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "--autotune-warmup-samples",
         "autotune.warmup_samples", "Samples discarded before tuning starts."),
    Knob("autotune_steps_per_sample", int, 10, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "--autotune-steps-per-sample",
         "autotune.steps_per_sample", "Steps measured per sample."),
    Knob("autotune_bayes_opt_max_samples", int, 20, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
         "--autotune-bayes-opt-max-samples", "autotune.bayes_opt_max_samples",
         "Maximum samples of the Bayesian optimisation."),
    Knob("autotune_gaussian_process_noise", float, 0.8, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
         "--autotune-gaussian-process-noise", "autotune.gaussian_process_noise",
         "Noise (alpha) of the Gaussian process, in [0, 1]."),
    # Timeline.
    Knob("timeline", str, "", "HOROVOD_TIMELINE", "--timeline-filename", "timeline.filename",
         "Rank 0 writes a Chrome-trace timeline to this file from hvd.init() on (docs/timeline.md); the value "
         "DYNAMIC records nothing until hvd.start_timeline(path)."),
    Knob("timeline_mark_cycles", bool, False, "HOROVOD_TIMELINE_MARK_CYCLES", "--timeline-mark-cycles",
         "timeline.mark_cycles", "Mark coordinator cycles in the timeline.", negatable=True),
    # Stall inspector.
    Knob("stall_check_disable", bool, False, "HOROVOD_STALL_CHECK_DISABLE", "--no-stall-check",
         "stall_check.enabled", "Disable the stall inspector.", inverted=True),
    Knob("stall_check_time_seconds", int, 60, "HOROVOD_STALL_CHECK_TIME_SECONDS",
         "--stall-check-warning-time-seconds", "stall_check.warning_time_seconds",
         "Warn when some ranks have waited this long for the others."),
    Knob("stall_shutdown_time_seconds", int, 0, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
         "--stall-check-shutdown-time-seconds", "stall_check.shutdown_time_seconds",
         "Fail the stalled collectives after this long (0: never; a value below the warning time is raised to it)."),
    # Library options.
    Knob("mpi_threads_disable", bool, False, "HOROVOD_MPI_THREADS_DISABLE", "--mpi-threads-disable",
         "library_options.mpi_threads_disable", "Request MPI_THREAD_SINGLE instead of MPI_THREAD_MULTIPLE.",
         negatable=True),
    Knob("num_nccl_streams", int, 1, "HOROVOD_NUM_NCCL_STREAMS", "--num-nccl-streams",
         "library_options.num_nccl_streams", "CUDA streams (each with its own NCCL communicator) that GPU "
         "collectives take turns on; more than 1 lets independent collectives overlap."),
    Knob("gpu_operations", str, "", "HOROVOD_GPU_OPERATIONS", None, None,
         "How collectives on GPU tensors run: NCCL, or HOST (staged through pinned host memory and the CPU "
         "transport); empty: NCCL where every rank can load it and no two ranks share a GPU, else HOST."),
    Knob("nccl_so_path", str, "", "HOROVOD_NCCL_SO_PATH", None, None,
         "The NCCL library (or an NCCL-compatible one: RCCL, a vendor's) to load; empty: the nvidia-nccl wheel "
         "of this Python, then the system's libnccl.so.2."),
    Knob("thread_affinity", str, "", "HOROVOD_THREAD_AFFINITY", "--thread-affinity",
         "library_options.thread_affinity", "Comma-separated core ids, one per local rank, for the background "
         "thread."),
    Knob("bind_cores", bool, False, "HOROVOD_BIND_CORES", "--bind-cores", None,
         "Bind each worker to its own share of its host's cores (cores // workers on the host); horovodrun, "
         "horovod.run, Spark and Ray turn it on unless you set it (or set OMP_NUM_THREADS above that share). "
         "Ignored when a host has more workers than cores.",
         negatable=True),
    Knob("gloo_timeout_seconds", int, 30, "HOROVOD_GLOO_TIMEOUT_SECONDS", "--gloo-timeout-seconds",
         "library_options.gloo_timeout_seconds",
         "Seconds a transport waits on a peer before the collective fails (also bounds rendezvous)."),
    # The hang doctor (horovod/engine/flight_recorder.py, horovod/doctor; docs/debugging.md).
    Knob("flight_recorder_size", int, 2000, "HOROVOD_FLIGHT_RECORDER_SIZE", "--flight-recorder-size",
         None,
         "About how many of its last collectives every rank's flight recorder keeps for hang dumps (0: off)."),
    Knob("flight_recorder_dir", str, "", "HOROVOD_FLIGHT_RECORDER_DIR", "--flight-recorder-dir",
         None,
         "Directory for hang dumps (each rank's recorder and thread stacks); horovodrun makes one per job; "
         "empty outside horovodrun: <tmp>/horovod-flight-recorder."),
    # Logging.
    Knob("log_level", str, "WARNING", "HOROVOD_LOG_LEVEL", "--log-level", "logging.level",
         "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL."),
    Knob("log_hide_time", bool, False, "HOROVOD_LOG_HIDE_TIME", "--log-without-timestamp",
         "logging.with_timestamp", "Hide timestamps in Horovod log lines.", inverted=True),
    # Controller / data plane selection.
    Knob("controller", str, "", "HOROVOD_CONTROLLER", None, "controller",
         "gloo (built-in) or mpi; empty: chosen from how the job was launched."),
    Knob("cpu_operations", str, "", "HOROVOD_CPU_OPERATIONS", None, None,
         "gloo (built-in transports) or mpi; empty: chosen from how the job was launched."),
    Knob("transport", str, "auto", "HOROVOD_TRANSPORT", "--transport", "params.transport",
         "Data plane: auto, tcp, shm or mpi (auto: shm inside a host, tcp across hosts; mpi under mpirun)."),
    # Engine behaviour.
    Knob("dynamic_process_sets", bool, False, "HOROVOD_DYNAMIC_PROCESS_SETS", None, None,
         "Allow add_process_set / remove_process_set after init."),
    Knob("disable_group_fusion", bool, False, "HOROVOD_DISABLE_GROUP_FUSION", None, None,
         "Fuse each explicit group on its own."),
    Knob("elastic", bool, False, "HOROVOD_ELASTIC", None, None, "Set by the launcher for elastic jobs."),
    Knob("elastic_timeout_seconds", int, 600, "HOROVOD_ELASTIC_TIMEOUT", None, None,
         "Elastic jobs: seconds to wait for enough slots (min-np) after a change before failing."),
    Knob("init_timeout_seconds", int, 120, "HOROVOD_INIT_TIMEOUT_SECONDS", None, None,
         "Seconds init() waits for every rank to reach it (slow imports on busy hosts need headroom)."),
    Knob("inline_bytes", int, 1024, "HOROVOD_INLINE_BYTES", None, None,
         "Allreduces of at most this many bytes travel with their request and are reduced by the coordinator "
         "(one round trip instead of negotiation plus a collective); 0 disables."),
    Knob("fast_lane", bool, True, "HOROVOD_FAST_LANE", None, None,
         "Ranks of one host agree on tiny blocking allreduces (at most HOROVOD_INLINE_BYTES and 1 KiB) through "
         "shared memory and reduce them themselves, without the coordinator; anything else, or a mismatch, takes "
         "the coordinator path (0 disables)."),
    Knob("spin_us", float, 100.0, "HOROVOD_SPIN_US", None, None,
         "Microseconds a rank waiting for its collective re-checks the control plane before it blocks; only when "
         "every local rank has a core of its own (0 disables)."),
    # 4 MiB: each collective of a step costs ~0.1-0.3 ms of Python after a backward pass, so fewer, larger buckets
    # win (benchmarks/torch_training.py models: +1-8 % against 1 MiB, NOTES.md); still far below DDP's 25 MiB, so
    # buckets keep leaving during backward.
    Knob("gradient_bucket_bytes", int, 4 * MIB, "HOROVOD_GRADIENT_BUCKET_BYTES", None, None,
         "horovod.torch, horovod.tensorflow and Keras DistributedOptimizer / DistributedGradientTape (without "
         "groups, not Adasum): small gradients travel packed in buckets of up to "
         "this many bytes, one allreduce per bucket (0: one allreduce per gradient)."),
    Knob("small_message_bytes", int, 256 * 1024, "HOROVOD_SMALL_MESSAGE_BYTES", None, None,
         "tcp transport: below this many bytes, latency-optimal algorithms instead of rings (shm switches at "
         "1 MiB on its own)."),
)

KNOBS_BY_NAME: Dict[str, Knob] = {k.name: k for k in KNOBS}


def parse_value(knob: Knob, raw: str) -> Any:
    """Parse a knob's environment string the way the original's core did (booleans: integer > 0)."""
    raw = raw.strip()
    if knob.type is bool:
        if raw.lower() in ("true", "yes", "on"):
            return True
        if raw.lower() in ("false", "no", "off", ""):
            return False
        try:
            return int(float(raw)) > 0
        except ValueError as exc:
            raise ValueError(f"{knob.env}={raw!r}: expected 0 or 1") from exc
    if knob.type is int:
        try:
            return int(float(raw))
        except ValueError as exc:
            raise ValueError(f"{knob.env}={raw!r}: expected an integer") from exc
    if knob.type is float:
        try:
            return float(raw)
        except ValueError as exc:
            raise ValueError(f"{knob.env}={raw!r}: expected a number") from exc
    return raw


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
    """Frozen knob values for one ``init()``; built by :func:`load`."""

    values: Mapping[str, Any] = field(default_factory=dict)
    fixed: frozenset = frozenset()   # knobs set explicitly (autotune leaves them alone)
    topology: Topology = Topology()

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **changes: Any) -> "Config":
        """A copy with some knob values changed (used by autotune and tests)."""
        return dataclasses.replace(self, values={**self.values, **changes})


SECRET_ENV = "_HOROVOD_SECRET_KEY"


def _first_int(env: Mapping[str, str], names, default: int) -> int:
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
    """Resolve every knob: explicit ``overrides`` > environment > default.

    Args:
        env: the environment to read (``os.environ`` when ``None``).
        overrides: knob values given explicitly by the caller.

    Returns:
        The frozen :class:`Config`.

    Raises:
        ValueError: a variable does not parse, naming the variable and the value received.
    """
    env = os.environ if env is None else env
    values: Dict[str, Any] = {}
    fixed = set()
    for knob in KNOBS:
        if knob.name in overrides:
            values[knob.name] = overrides[knob.name]
            fixed.add(knob.name)
        elif knob.env and env.get(knob.env, "") != "":
            values[knob.name] = parse_value(knob, env[knob.env])
            fixed.add(knob.name)
        else:
            values[knob.name] = knob.default
    # NCCL's own switch (2.30+) for several ranks of one communicator on one GPU: the device data plane must know
    # whether NCCL will accept that before it creates a communicator.
    values["nccl_multi_rank_gpu"] = env.get("NCCL_MULTI_RANK_GPU_ENABLE", "0") not in ("", "0")
    return Config(values=values, fixed=frozenset(fixed), topology=topology_from_env(env))


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
             "precedence: explicit argument > horovodrun flag > `HOROVOD_*` environment > config file > default.",
             "", "| knob | environment | horovodrun flag | config file | default | meaning |",
             "|---|---|---|---|---|---|"]
    for k in KNOBS:
        flag = k.flag or ""
        if flag and k.negatable:
            flag += f" / --no-{flag[2:]}"
        default = f"{k.default // MIB} MiB" if k.flag_scale == MIB else repr(k.default)
        lines.append(f"| `{k.name}` | `{k.env or ''}` | `{flag}` | `{k.config_key or ''}` | {default} | {k.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
