"""Output forwarding and worker supervision, in-process with real pipes and real processes."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from horovod.runner import exec as hexec
from horovod.runner.output import OutputSink, pad_rank, prefix, rank_dir


@pytest.mark.parametrize("rank, size, padded", [(0, 1, "0"), (3, 10, "3"), (3, 11, "03"), (10, 11, "10"),
                                                (7, 101, "007")])
def test_pad_rank(rank, size, padded):
    assert pad_rank(rank, size) == padded
    assert rank_dir("out", rank, size) == os.path.join("out", f"rank.{padded}")


def test_prefix():
    assert prefix(3, "stdout") == "[3]<stdout>:"
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} \[1\]<stderr>:", prefix(1, "stderr", True))


def _pipe_with(data: bytes):
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as writer:
        writer.write(data)
    return os.fdopen(read_fd, "rb")


def test_sink_tags_whole_lines_and_copies_raw_output(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    sink = OutputSink(size=12, output_dir=str(tmp_path), stdout=out, stderr=err)
    sink.attach(0, {"stdout": _pipe_with(b"a\nb\nno newline"), "stderr": _pipe_with(b"oops\n")})
    sink.attach(11, {"stdout": _pipe_with("é\n".encode()), "stderr": _pipe_with(b"")})
    sink.finish(timeout=10)
    assert sorted(out.getvalue().splitlines()) == sorted(["[0]<stdout>:a", "[0]<stdout>:b", "[0]<stdout>:no newline",
                                                          "[11]<stdout>:é"])
    assert err.getvalue() == "[0]<stderr>:oops\n"
    assert (tmp_path / "rank.00" / "stdout").read_bytes() == b"a\nb\nno newline\n"
    assert (tmp_path / "rank.00" / "stderr").read_bytes() == b"oops\n"
    assert (tmp_path / "rank.11" / "stdout").read_bytes() == "é\n".encode()
    assert (tmp_path / "rank.11" / "stderr").read_bytes() == b""


def _spec(rank, code, env=None):
    return hexec.WorkerSpec(rank=rank, hostname="localhost", command=[sys.executable, "-c", code],
                            env={**os.environ, **(env or {})})


def test_run_workers_success_returns_every_exit():
    sink = OutputSink(2, stdout=io.StringIO(), stderr=io.StringIO())
    exits = hexec.run_workers([_spec(0, "print('hi')"), _spec(1, "pass")], sink)
    assert [(e.rank, e.returncode) for e in exits] == [(0, 0), (1, 0)]


def test_worker_ignoring_sigterm_is_killed_after_grace(tmp_path):
    armed = tmp_path / "armed"
    stubborn = ("import signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                f"open({str(armed)!r}, 'w').close()\n"
                "time.sleep(600)\n")
    # Fail only once rank 0 ignores SIGTERM, however slowly it started.
    failing = (f"import os, time\n"
               f"deadline = time.monotonic() + 60\n"
               f"while not os.path.exists({str(armed)!r}) and time.monotonic() < deadline:\n"
               f"    time.sleep(0.05)\n"
               f"raise SystemExit(5)\n")
    out = io.StringIO()
    sink = OutputSink(2, stdout=out, stderr=io.StringIO())
    with pytest.raises(hexec.JobFailedError) as info:
        hexec.run_workers([_spec(0, stubborn), _spec(1, failing)], sink, grace_seconds=0.5)
    exc = info.value
    assert (exc.first.rank, exc.first.returncode) == (1, 5)
    assert isinstance(exc, RuntimeError)
    assert str(exc).startswith(hexec.FAILURE_HEADLINE)
    assert "Rank: 1\nHost: localhost\nExit code: 5" in str(exc)
    # Rank 0 ignored SIGTERM, so it must have died of SIGKILL.
    assert {e.rank: e.returncode for e in exc.exits}[0] == -9


def test_signal_exit_is_described():
    assert "killed by SIGKILL" in hexec.WorkerExit(2, "h", -9).describe()


def test_unknown_host_fails_before_anything_starts(tmp_path):
    marker = tmp_path / "started"
    specs = [_spec(0, f"open({str(marker)!r}, 'w')"),
             hexec.WorkerSpec(rank=1, hostname="far-away.example", command=["true"], env={})]
    saved = list(hexec._STARTERS)
    hexec._STARTERS[:] = [r for r in saved if r.name == "local"]   # without the ssh starter no remote host works
    try:
        with pytest.raises(hexec.LaunchNotAvailableError, match="not available yet"):
            hexec.run_workers(specs, OutputSink(2))
    finally:
        hexec._STARTERS[:] = saved
    assert not marker.exists()


def test_missing_command_is_a_start_error():
    spec = hexec.WorkerSpec(rank=0, hostname="localhost", command=["definitely-not-a-command-xyz"],
                            env=dict(os.environ))
    with pytest.raises(hexec.WorkerStartError, match="not found") as info:
        hexec.run_workers([spec], OutputSink(1))
    assert info.value.exit_code == 127


def test_starters_can_be_registered_for_other_hosts():
    calls = []

    def fake_start(spec):
        calls.append(spec.hostname)
        return hexec.start_local(spec)

    hexec.register_starter("test-remote", lambda host: host == "pretend-remote", fake_start, priority=5)
    try:
        spec = hexec.WorkerSpec(rank=0, hostname="pretend-remote", command=[sys.executable, "-c", "pass"],
                                env=dict(os.environ), stdin=subprocess.DEVNULL)
        hexec.run_workers([spec], OutputSink(1, stdout=io.StringIO()))
        assert calls == ["pretend-remote"]
    finally:
        hexec._STARTERS[:] = [r for r in hexec._STARTERS if r.name != "test-remote"]
