"""A real two-node Ray cluster on this machine, one per test module.

``ray.cluster_utils.Cluster`` starts a head and a second node as separate raylets, so the actors of a test really
land on two Ray nodes.  Ray is never pointed at any other address.  The raylets inherit this directory on
``PYTHONPATH`` so the actors can import the functions defined in the test modules.
"""
from __future__ import annotations

import os
import sys

import pytest

# Ray is imported by the fixture, not here: a conftest that skips at import stops the whole run where it is named
# on the command line (pytest tests/ray without Ray); each test module skips itself with the reason instead.

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)   # ray_helpers


def _with_test_path() -> None:
    path = os.environ.get("PYTHONPATH", "")
    if HERE not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, path) if p)


def _restore(name: str, value) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@pytest.fixture(scope="module")
def cluster():
    """Head (2 CPUs) + one more node (2 CPUs); shut down after the module."""
    saved = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    _with_test_path()
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, log_to_driver=True)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for name, value in saved.items():
            _restore(name, value)
