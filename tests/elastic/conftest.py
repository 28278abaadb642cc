"""Fixtures of the elastic tests: a hard per-test timeout and a job factory that always cleans up."""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_helpers import ElasticJob  # noqa: E402

#: Abort the whole test process with every thread's stack if one test hangs past this (no pytest-timeout here).
HARD_TIMEOUT_S = 170


@pytest.fixture(autouse=True)
def _hard_timeout():
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.elastic_failed = report.failed


@pytest.fixture
def elastic_job(tmp_path, request):
    """``elastic_job(hosts, args, **kw)`` starts an :class:`ElasticJob`; every job is stopped after the test,
    and a failed test shows the jobs' launcher output and training log."""
    jobs = []

    def start(hosts, args, **kwargs) -> ElasticJob:
        job = ElasticJob(tmp_path, hosts, args, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()
        if getattr(request.node, "elastic_failed", False):
            print(job.diagnose())
