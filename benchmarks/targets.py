"""The targets the collectives benchmark checks, as data: what is compared, against what, and the bar.

``python benchmarks/collectives.py`` ends its report with one row per target of its kind of run (one host, or
``--hosts N``: :func:`for_run`) (PASS, FAIL, or n/a when the run did
not measure it); ``benchmarks/_collectives/verdicts.py`` evaluates each kind. Implementations are named by family
(``engine``: ``horovod.numpy``; ``torch``: ``horovod.torch``), the run adds its primary transport (``engine-shm``).
Change a bar here, not in the code that evaluates it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

MIB = 1 << 20

# What a target of each kind compares (the evaluator's names).
KINDS = ("busbw_ratio", "latency", "new_result", "fusion_gain", "peer_sweep")
# peer_sweep: every size the run measured from ``min_bytes`` up (8 B: the latency phase's back-to-back allreduce)
# of every collective in ``ops``, ours against ``peer`` (each peer launched as its users launch it, issue 35);
# the row reports the slowest size.
SWEEP_OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str                           # one of KINDS
    np: int = 2                         # world size
    nbytes: int = 64 * MIB              # message size (busbw_ratio, new_result)
    impl: str = "engine"                # our side, by family
    peer: Optional[str] = None          # busbw_ratio: the other side (``gloo``, ``openmpi``)
    at_least: Optional[float] = None    # busbw_ratio: ours ÷ peer; new_result: new ÷ in place; fusion_gain
    pattern: Optional[str] = None       # latency: which pattern (benchmarks/_collectives/cases.LATENCY_PATTERNS)
    at_most_s: Optional[float] = None   # latency: the median per call
    times_faster: Optional[float] = None    # latency: Gloo's median ÷ ours
    floor_factor: Optional[float] = None    # latency: or within this factor of the machine's wake-up floor
    ops: Tuple[str, ...] = SWEEP_OPS        # peer_sweep: the collectives
    min_bytes: int = 8                      # peer_sweep: the smallest size held to the bar
    hosts: int = 0                          # 0: one host (the default run); N: ``--hosts N``, one rank per host


TARGETS: Tuple[Target, ...] = (
    # Bandwidth at the size gradients come in, against each peer library.
    Target("busbw_ratio", np=2, peer="gloo", at_least=2.0),
    Target("busbw_ratio", np=2, peer="openmpi", at_least=1.2),
    # Small messages: a tight loop, and after 1 ms of "compute" (peers asleep must be woken).
    Target("latency", pattern="back to back", at_most_s=60e-6, times_faster=3.0),
    Target("latency", pattern="1 ms compute before each", at_most_s=100e-6, times_faster=3.0, floor_factor=1.5),
    # A new result array costs at most a fifth more than reducing in place (numpy and torch bindings).
    Target("new_result", impl="engine", at_least=0.8),
    Target("new_result", impl="torch", at_least=0.8),
    # 1,000 small tensors: fusion must pay for itself.
    Target("fusion_gain", at_least=10.0),
    # Four ranks on two cores: within 1.5× of Open MPI.
    Target("busbw_ratio", np=4, peer="openmpi", at_least=1 / 1.5),
    # Issue 35: faster than Gloo (torchrun) at every size, at least even with Open MPI (mpirun) from 1 MiB up.
    Target("peer_sweep", np=2, peer="gloo", at_least=1.0),
    Target("peer_sweep", np=4, peer="gloo", at_least=1.0),
    Target("peer_sweep", np=2, peer="openmpi", at_least=1.0, min_bytes=MIB),
    Target("peer_sweep", np=4, peer="openmpi", at_least=1.0, min_bytes=MIB),
    # ... and across four hosts (network namespaces, one rank each, tcp): ``collectives.py --hosts 4``.
    Target("peer_sweep", np=4, peer="gloo", at_least=1.0, hosts=4),
)


def for_run(hosts: int = 0) -> Tuple[Target, ...]:
    """The targets a run checks: the single-host ones (``hosts`` 0) or those of ``--hosts N``."""
    return tuple(t for t in TARGETS if t.hosts == hosts)
