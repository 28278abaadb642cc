"""From ``horovodrun`` flags (or ``horovod.run`` arguments) to a running :class:`ElasticDriver`.

``horovodrun`` reaches :func:`run_elastic` through ``JOB_RUNNERS["elastic"]`` when any elastic flag is given
(``--min-np``, ``--max-np``, ``--host-discovery-script``, ``--slots-per-host``, ``--elastic-timeout``,
``--reset-limit``, ``--blacklist-cooldown-range``); ``horovod.run`` reaches :func:`run_elastic_function`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import cloudpickle

from horovod.runner import cli
from horovod.runner.cli import start_timeout
from horovod.runner.hosts import resolve_hosts
from horovod.runner.elastic.discovery import FixedHosts, HostDiscovery, HostDiscoveryScript
from horovod.runner.elastic.driver import ElasticDriver, ElasticResult, ElasticSettings
from horovod.transport.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)

DEFAULT_ELASTIC_TIMEOUT = 600

#: Where ``horovod.run`` workers of an elastic job leave their return values, keyed by worker id.
RESULT_SCOPE = "runfunc_elastic_result"


def elastic_timeout(value: Optional[int], env: Mapping[str, str]) -> int:
    """``--elastic-timeout``, else ``HOROVOD_ELASTIC_TIMEOUT``, else 600 seconds."""
    return cli.seconds(value, env, "HOROVOD_ELASTIC_TIMEOUT", DEFAULT_ELASTIC_TIMEOUT)


def discovery_from_args(args: Any) -> HostDiscovery:
    """The discovery script, or the fixed ``-H`` / ``--hostfile`` hosts (``localhost:<np>`` when neither)."""
    script = getattr(args, "host_discovery_script", None)
    if script:
        return HostDiscoveryScript(script, getattr(args, "slots", None))
    return FixedHosts(resolve_hosts(args))


def settings_from_args(args: Any, command: Union[Sequence[str], Callable[[str, int], Sequence[str]]],
                       parent_env: Mapping[str, str]) -> ElasticSettings:
    """Resolve the elastic job's settings.

    Raises:
        ValueError: missing or inconsistent process counts, a bad cooldown range or timeout.
    """
    from horovod.runner.elastic.blacklist import validate_cooldown_range

    num_proc = args.num_proc if args.num_proc is not None else getattr(args, "min_num_proc", None)
    if num_proc is None:
        raise ValueError("-np/--num-proc is required: how many processes to start the elastic job with, e.g. "
                         "-np 4 --min-np 2 --max-np 8")
    min_np = args.min_num_proc if getattr(args, "min_num_proc", None) is not None else num_proc
    cooldown = getattr(args, "cooldown_range", None)
    validate_cooldown_range(cooldown)
    timeout = start_timeout(getattr(args, "start_timeout", None), parent_env)
    settings = ElasticSettings(
        num_proc=num_proc, min_np=min_np, max_np=getattr(args, "max_num_proc", None), command=command,
        discovery=discovery_from_args(args),
        elastic_timeout=float(elastic_timeout(getattr(args, "elastic_timeout", None), parent_env)),
        reset_limit=getattr(args, "reset_limit", None),
        cooldown_range=tuple(cooldown) if cooldown is not None else None,
        knob_env=cli.knob_env(args, parent_env), nics=list(getattr(args, "nics", None) or []),
        output_dir=getattr(args, "output_filename", None),
        prefix_timestamp=bool(getattr(args, "prefix_output_with_timestamp", False)), start_timeout=timeout,
        ssh_port=getattr(args, "ssh_port", None), ssh_identity_file=getattr(args, "ssh_identity_file", None))
    settings.validate()
    return settings


def run_elastic(args: Any, parent_env: Mapping[str, str]) -> None:
    """``JOB_RUNNERS["elastic"]``: run ``args.command`` as an elastic job (raises on failure)."""
    ElasticDriver(settings_from_args(args, list(args.command), parent_env), parent_env).run()


class _ElasticTask:
    """What ``horovod.run`` ships to elastic workers: the user's function, whose result is stored under the
    worker's id (ranks change during the job, so the launch-time rank cannot key it)."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __call__(self) -> None:
        from horovod.engine import config
        from horovod.transport.rendezvous import RendezvousClient

        result = cloudpickle.loads(self.payload)()
        topo = config.topology_from_env(config.environ())
        if topo.rendezvous_addr is None or topo.rendezvous_port is None or topo.secret is None:
            raise RuntimeError("an elastic worker started without the job's rendezvous (address, port, secret) in its "
                               "environment; start it with horovodrun or horovod.run")
        client = RendezvousClient(topo.rendezvous_addr, topo.rendezvous_port, topo.secret)
        client.put(RESULT_SCOPE, topo.elastic_worker_id, cloudpickle.dumps(result))


def run_elastic_function(hargs: Any, payload: bytes, parent_env: Mapping[str, str],
                         extra_env: Optional[Mapping[str, str]] = None) -> List[Any]:
    """``horovod.run`` in elastic mode: the results of the last epoch's ranks ``0 .. min_np - 1``.

    Args:
        hargs: the ``_HorovodArgs`` of the call.
        payload: the cloudpickled function (arguments bound).
        parent_env: the caller's environment.
        extra_env: more variables for the workers (e.g. ``PYTHONPATH``).
    """
    from horovod.runner.run_task import FUNC_KEY, FUNC_SCOPE

    task = cloudpickle.dumps(_ElasticTask(payload))

    def command(addr: str, port: int) -> List[str]:
        return [hargs.executable, "-m", "horovod.runner.run_task", addr, str(port)]

    def publish(server: RendezvousServer) -> None:
        server.store.put((FUNC_SCOPE, FUNC_KEY), task)

    settings = settings_from_args(hargs, command, parent_env)
    settings.extra_env.update(extra_env or {})
    result: ElasticResult = ElasticDriver(settings, parent_env).run(setup=publish)
    if len(result.members) < settings.min_np:
        raise RuntimeError(f"horovod.run(): the elastic job ended with {len(result.members)} workers in its last "
                           f"epoch, fewer than min_num_proc={settings.min_np}; the function must call hvd.init()")
    stored = result.store.scope(RESULT_SCOPE)
    out = []
    for rank, wid in enumerate(result.members[:settings.min_np]):
        raw = stored.get(wid)
        if raw is None:
            raise RuntimeError(f"horovod.run(): rank {rank} ({wid}) of the last epoch exited successfully but "
                               f"reported no result; the function must return normally on every rank")
        out.append(cloudpickle.loads(raw))
    return out
