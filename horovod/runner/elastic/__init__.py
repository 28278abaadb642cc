"""Elastic jobs: the driver that adds, removes and replaces workers while training goes on.

- :mod:`~horovod.runner.elastic.discovery`: which hosts exist (a discovery script, or fixed hosts).
- :mod:`~horovod.runner.elastic.blacklist`: hosts whose workers failed, with cooldowns.
- :mod:`~horovod.runner.elastic.layout`: who is in the next epoch and with which ranks (pure).
- :mod:`~horovod.runner.elastic.driver`: the job: the rendezvous store, discovery, epochs.
- :mod:`~horovod.runner.elastic.workers`: the driver's worker processes: start, stop, what an exit means.
- :mod:`~horovod.runner.elastic.launch`: from ``horovodrun`` flags / ``horovod.run`` arguments to a driver.

The worker side is :mod:`horovod.engine.membership` (joining epochs) and :mod:`horovod.common.elastic`
(state, commit, the retry loop).
"""
from __future__ import annotations

from horovod.runner.elastic.driver import (RESET_LIMIT_MESSAGE, ElasticDriver, ElasticJobError,  # noqa: F401
                                           ElasticResult, ElasticSettings)

__all__ = ["ElasticDriver", "ElasticSettings", "ElasticResult", "ElasticJobError", "RESET_LIMIT_MESSAGE"]
