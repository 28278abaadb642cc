"""horovod.run(): results per rank, errors with tracebacks, argument checks."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import horovod
from horovod.runner import _HorovodArgs, run
from runner_helpers import CALL_TIMEOUT_S, child_env

MARK = "RESULT-JSON "


def _driver(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` as ``__main__`` of a fresh interpreter (functions defined there travel by value)."""
    path = tmp_path / "driver.py"
    path.write_text("import json, os, sys\nimport horovod\n" + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          env=child_env(), stdin=subprocess.DEVNULL, cwd=str(tmp_path))


def _result(proc):
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len(MARK):])


def test_returns_every_ranks_value_in_rank_order(tmp_path):
    proc = _driver(tmp_path, f"""
        def work(scale, offset=0):
            rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
            print("working", rank)
            return {{"rank": rank, "size": size, "value": rank * scale + offset,
                     "local": os.environ["HOROVOD_LOCAL_RANK"], "controller": os.environ["HOROVOD_CONTROLLER"]}}

        out = horovod.run(work, args=(10,), kwargs={{"offset": 1}}, num_proc=3)
        print({MARK!r} + json.dumps(out))
    """)
    out = _result(proc)
    assert [r["rank"] for r in out] == [0, 1, 2]
    assert all(r["size"] == 3 and r["controller"] == "gloo" for r in out)
    assert [r["value"] for r in out] == [1, 11, 21]
    assert [r["local"] for r in out] == ["0", "1", "2"]
    assert sorted(line for line in proc.stdout.splitlines() if "working" in line) == [
        f"[{r}]<stdout>:working {r}" for r in range(3)]


def test_worker_exception_reraises_with_traceback(tmp_path):
    proc = _driver(tmp_path, f"""
        import time

        class Boom(Exception):
            pass

        def work():
            if os.environ["HOROVOD_RANK"] == "1":
                raise Boom("rank one cannot go on")
            time.sleep(600)   # must be terminated, not waited for

        try:
            horovod.run(work, num_proc=2)
        except RuntimeError as exc:
            print({MARK!r} + json.dumps(str(exc)))
    """)
    message = _result(proc)
    assert "Horovod detected that one or more processes exited with non-zero status" in message
    assert "Rank: 1" in message
    assert "Traceback (most recent call last)" in message
    assert "Boom: rank one cannot go on" in message
    assert 'in work' in message


def test_single_process_and_deprecated_np(tmp_path):
    proc = _driver(tmp_path, f"""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = horovod.run(lambda: os.environ["HOROVOD_SIZE"], np=1)
        print({MARK!r} + json.dumps([out, [str(w.message) for w in caught if w.category is DeprecationWarning]]))
    """)
    out, warned = _result(proc)
    assert out == ["1"]
    assert any("'np' is deprecated" in w for w in warned)


def test_output_filename_from_the_api(tmp_path):
    proc = _driver(tmp_path, f"""
        out = horovod.run(lambda: print("hello", os.environ["HOROVOD_RANK"]), num_proc=2, output_filename="logs")
        print({MARK!r} + json.dumps(out))
    """)
    assert _result(proc) == [None, None]
    assert (tmp_path / "logs" / "rank.1" / "stdout").read_text() == "hello 1\n"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"hosts": "localhost:2", "hostfile": "hosts.txt"}, "either hosts or hostfile"),
    ({"use_gloo": True, "use_mpi": True}, "either use_gloo or use_mpi"),
    ({"num_proc": 0}, "must be >= 1"),
    ({"num_proc": 3, "hosts": "localhost:2"}, "only 2 slots"),
])
def test_value_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        run(lambda: None, **kwargs)


def test_deprecated_aliases_warn():
    with pytest.warns(DeprecationWarning, match="'np'"):
        assert run(lambda: 7, np=1) == [7]


def test_exports():
    assert horovod.runner.run is run
    assert horovod.run is not None
    assert _HorovodArgs().num_proc == 1
