"""Make the shared test helpers (tests/multiproc.py) importable from every test folder, and keep the test folders
named like frameworks (tests/torch, tests/ray, tests/jax, ...) from standing in for those frameworks."""
import glob
import importlib.util
import os
import resource
import shutil
import sys
import tempfile

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    # Appended, not prepended: tests/torch etc. must never shadow the real frameworks.
    sys.path.append(_TESTS)

import hidden_test_folders  # noqa: E402  (tests/ is on sys.path only now)


hidden_test_folders.install()   # in this process; tests/multiproc.py installs it in every rank too


# Folders whose every test drives a framework: where it is not installed, each test there is skipped, with the
# reason (most of them import the framework only inside their rank workers, so nothing else would skip them).
_FOLDER_NEEDS = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow",),
    "keras": ("tensorflow",),
    "jax": ("jax", "optax"),
    "mxnet": ("mxnet",),
    "ray": ("ray",),
    "lightning": ("lightning", "torch"),
}


def _missing(modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


def pytest_ignore_collect(collection_path, config):
    """``-m fast`` alone collects only the files the fast tier names: importing every test module (and with them
    torch, TensorFlow, JAX...) took ~45 s, longer than running the tier's tests on shared ranks."""
    if config.getoption("markexpr", "") != "fast" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    from fast_tier import FAST_TIER

    rel = os.path.relpath(str(collection_path), os.path.dirname(_TESTS)).replace(os.sep, "/")
    return True if all(entry.split("::", 1)[0] != rel for entry in FAST_TIER) else None


def pytest_collection_modifyitems(config, items):
    from fast_tier import FAST_TIER, selects


    missing = {folder: _missing(needs) for folder, needs in _FOLDER_NEEDS.items()}
    for item in items:
        if any(selects(entry, item.nodeid) for entry in FAST_TIER):   # node ids are relative to the repo root
            item.add_marker(pytest.mark.fast)
        rel = os.path.relpath(str(item.path), _TESTS).split(os.sep)
        lacking = missing.get(rel[0]) if len(rel) > 1 else None
        if lacking:
            item.add_marker(pytest.mark.skip(reason=f"tests/{rel[0]} needs {', '.join(lacking)} (not installed; "
                                                    f"pip install 'horovod-next[{rel[0]}]')"))


# Every failed `horovodrun` job keeps its hang-doctor directory (/tmp/horovod-doctor-*: its verdict names it), by
# design; the many jobs this suite fails on purpose would leave hundreds behind. The ones made during this session
# are removed at its end (the tests read them while they run); older ones are not this session's to touch.
_DOCTOR_DIRS = os.path.join(tempfile.gettempdir(), "horovod-doctor-*")
_doctor_dirs_before: set = set()


_file_seconds: dict = {}
_file_cpu: dict = {}
_CPU_AT_SETUP = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """CPU time of this process and of every child it reaped (ranks, launchers, their children)."""
    import rank_pool

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + rank_pool.live_cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Carried by the test's teardown report (so it also reaches xdist's controller); warm ranks count as they
    # run (rank_pool.live_cpu_seconds), the reaped ones in the children's time.
    outcome = yield
    if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
        outcome.get_result().user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_AT_SETUP]))


def pytest_runtest_logreport(report):
    # Setup, call and teardown of every test, summed per file.
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "cpu_seconds" and report.when == "teardown":
            _file_cpu[path] = _file_cpu.get(path, 0.0) + value


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time went: the slowest files and the total per folder (CONTRIBUTING quotes these)."""
    if not _file_seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("time per test file (setup + call + teardown)")
    write("    wall  CPU (s)  file")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:15]:
        write(f"{seconds:8.1f} {_file_cpu.get(path, 0.0):8.1f}  {path}")
    folders: dict = {}
    for path, seconds in _file_seconds.items():
        parts = path.split("/")
        folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        wall, cpu = folders.get(folder, (0.0, 0.0))
        folders[folder] = (wall + seconds, cpu + _file_cpu.get(path, 0.0))
    terminalreporter.section("time per folder")
    write("    wall  CPU (s)  folder")
    for folder, (wall, cpu) in sorted(folders.items(), key=lambda kv: -kv[1][0]):
        write(f"{wall:8.1f} {cpu:8.1f}  {folder}")
    write(f"{sum(w for w, _ in folders.values()):8.1f} {sum(c for _, c in folders.values()):8.1f}  in all "
          f"(summed over test processes; CPU of Spark's and Ray's daemons not counted)")


def pytest_sessionstart(session):
    _doctor_dirs_before.update(glob.glob(_DOCTOR_DIRS))


def pytest_sessionfinish(session, exitstatus):
    import rank_pool

    rank_pool.close_all()
    for path in set(glob.glob(_DOCTOR_DIRS)) - _doctor_dirs_before:
        shutil.rmtree(path, ignore_errors=True)
