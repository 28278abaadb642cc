"""The elastic driver's pure parts (layout, blacklist, discovery parsing, settings) and its launcher wiring."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from elastic_helpers import REPO, child_env
from horovod.runner import launch
from horovod.runner.elastic.blacklist import HostBlacklist, cooldown_seconds, validate_cooldown_range
from horovod.runner.elastic.discovery import DiscoveryError, HostDiscoveryScript, parse_discovery_output
from horovod.runner.elastic.driver import ElasticSettings
from horovod.runner.elastic.launch import elastic_timeout, settings_from_args
from horovod.runner.elastic.layout import assign_ranks, plan_members, slot_ids
from horovod.runner.hosts import HostInfo


# -- layout -----------------------------------------------------------------------------------------------
def test_first_epoch_fills_hosts_in_order_up_to_max_np():
    hosts = [HostInfo("a", 2), HostInfo("b", 2)]
    assert plan_members([], hosts, alive=set()) == ["a:0", "a:1", "b:0", "b:1"]
    assert plan_members([], hosts, alive=set(), max_np=3) == ["a:0", "a:1", "b:0"]


def test_survivors_keep_their_order_and_come_first():
    hosts = [HostInfo("a", 2), HostInfo("b", 1), HostInfo("c", 1)]
    current = ["b:0", "a:1", "x:0"]                      # x is gone from discovery
    alive = {"b:0", "a:1", "x:0", "a:0"}
    assert plan_members(current, hosts, alive) == ["b:0", "a:1", "a:0", "c:0"]
    # A survivor that died is not kept; max_np trims newcomers, never survivors.
    assert plan_members(current, hosts, alive - {"a:1"}, max_np=2) == ["b:0", "a:0"]
    assert plan_members(["a:0", "a:1", "b:0"], hosts, {"a:0", "a:1", "b:0"}, max_np=2) == ["a:0", "a:1"]


@pytest.mark.parametrize("order, expected", [
    (["a:0", "a:1", "b:0", "b:1"],
     {"a:0": (0, 4, 0, 2, 0, 2, "a"), "a:1": (1, 4, 1, 2, 0, 2, "a"),
      "b:0": (2, 4, 0, 2, 1, 2, "b"), "b:1": (3, 4, 1, 2, 1, 2, "b")}),
    (["b:0", "a:0", "a:1"],                               # uneven hosts: local rank 1 exists on one host only
     {"b:0": (0, 3, 0, 1, 0, 2, "b"), "a:0": (1, 3, 0, 2, 1, 2, "a"), "a:1": (2, 3, 1, 2, 0, 1, "a")}),
    (["a:1", "b:0", "a:0"],                               # a host's workers need not have neighbouring ranks
     {"a:1": (0, 3, 0, 2, 0, 2, "a"), "b:0": (1, 3, 0, 1, 1, 2, "b"), "a:0": (2, 3, 1, 2, 0, 1, "a")}),
])
def test_assign_ranks(order, expected):
    assert assign_ranks(order) == expected


def test_slot_ids_handle_ipv6_hosts():
    assert slot_ids([HostInfo("::1", 2)]) == ["::1:0", "::1:1"]
    assert assign_ranks(["::1:0"])["::1:0"][-1] == "::1"


# -- blacklist ----------------------------------------------------------------------------------------------
def test_cooldown_doubles_and_is_capped():
    assert [cooldown_seconds(n, 10, 100, 0.0) for n in range(5)] == [10, 20, 40, 80, 100]
    assert cooldown_seconds(0, 10, 100, 0.5) == 15
    assert cooldown_seconds(0, 10, 10, 0.9) == 10


def test_blacklist_with_cooldown_expires_and_grows():
    now = [0.0]
    black = HostBlacklist((1, 100), clock=lambda: now[0], uniform=lambda: 0.0)
    assert black.blacklist("h") == 1
    assert black.blacklist("h") == 1                       # already out: no second count
    assert black.is_blacklisted("h") and black.blacklisted() == ["h"]
    now[0] = 1.0
    assert not black.is_blacklisted("h")
    assert black.blacklist("h") == 2                       # second time: twice as long
    now[0] = 2.5
    assert black.is_blacklisted("h") and black.next_expiry() == pytest.approx(0.5)


def test_blacklist_without_range_is_forever():
    now = [0.0]
    black = HostBlacklist(None, clock=lambda: now[0])
    assert black.blacklist("h") is None
    now[0] = 1e9
    assert black.is_blacklisted("h") and not black.is_blacklisted("other")


@pytest.mark.parametrize("bad", [(0, 10), (5, 4000), (10, 5), (1,)])
def test_bad_cooldown_ranges(bad):
    with pytest.raises(ValueError, match="blacklist-cooldown-range"):
        validate_cooldown_range(bad)


# -- discovery ----------------------------------------------------------------------------------------------
def test_parse_discovery_output():
    lines = ["a:2", "", "# comment", "b", "  c:1  # trailing", "a:3", "[::1]:2", "fe80::1"]
    assert parse_discovery_output(lines, default_slots=4) == [
        HostInfo("a", 3), HostInfo("b", 4), HostInfo("c", 1), HostInfo("::1", 2), HostInfo("fe80::1", 4)]
    assert parse_discovery_output(["b"]) == [HostInfo("b", 1)]


def test_parse_discovery_output_rejects_garbage():
    with pytest.raises(DiscoveryError, match="line 2"):
        parse_discovery_output(["a:1", "b:x"])


def test_discovery_script_runs_and_reports_failures(tmp_path):
    good = tmp_path / "good.sh"
    good.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1\n")
    good.chmod(0o755)
    assert HostDiscoveryScript(str(good), default_slots=3).find() == [HostInfo("localhost", 2),
                                                                      HostInfo("127.0.0.1", 3)]
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(DiscoveryError, match="exited with status 3: oops"):
        HostDiscoveryScript(str(bad)).find()
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    with pytest.raises(DiscoveryError, match="did not finish within"):
        HostDiscoveryScript(str(slow), timeout=0.2).find()


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_hung_discovery_script_is_killed_with_everything_it_started(tmp_path):
    """Issue 38: the driver gave up on a hung script but left what it started running (only the shell died)."""
    pids = tmp_path / "pids"
    hung = tmp_path / "hung.sh"
    hung.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > '{pids}'\nwait\n")
    hung.chmod(0o755)
    with pytest.raises(DiscoveryError, match="did not finish within 1 s"):
        HostDiscoveryScript(str(hung), timeout=1.0).find()
    shell, child = (int(p) for p in pids.read_text().split())
    try:
        assert _gone(child), f"the script's child {child} (sleep 300) is still running"
        assert _gone(shell), f"the script {shell} is still running"
    finally:
        for pid in (shell, child):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# -- settings -----------------------------------------------------------------------------------------------
def _args(argv):
    return launch.parse_args(argv + ["true"])


def test_settings_from_flags():
    s = settings_from_args(_args(["-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "d.sh",
                                  "--slots-per-host", "3", "--elastic-timeout", "7", "--reset-limit", "2",
                                  "--blacklist-cooldown-range", "1", "9"]), ["true"], {})
    assert (s.num_proc, s.min_np, s.max_np, s.elastic_timeout, s.reset_limit, s.cooldown_range) == \
        (2, 1, 4, 7.0, 2, (1, 9))
    assert isinstance(s.discovery, HostDiscoveryScript) and s.discovery.default_slots == 3
    fixed = settings_from_args(_args(["-np", "2", "--min-np", "1", "-H", "localhost:2"]), ["true"], {})
    assert fixed.discovery.find() == [HostInfo("localhost", 2)] and fixed.max_np is None


def test_elastic_timeout_from_environment():
    assert elastic_timeout(None, {"HOROVOD_ELASTIC_TIMEOUT": "12"}) == 12
    assert elastic_timeout(None, {}) == 600
    assert elastic_timeout(3, {"HOROVOD_ELASTIC_TIMEOUT": "12"}) == 3


@pytest.mark.parametrize("argv, fragment", [
    (["--min-np", "3", "-np", "2"], "-np 2 is below --min-np 3"),
    (["-np", "4", "--max-np", "2"], "--max-np 2 is below -np 4"),
    (["-np", "2", "--min-np", "0"], "--min-np must be >= 1"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be >= 0"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0", "5"], "blacklist-cooldown-range 0 5"),
])
def test_inconsistent_settings(argv, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        settings_from_args(_args(argv), ["true"], {})


def test_settings_validate_directly():
    with pytest.raises(ValueError, match="elastic-timeout"):
        ElasticSettings(2, 1, None, ["true"], None, elastic_timeout=-1).validate()


def _horovodrun(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "horovod.runner", *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=str(REPO), stdin=subprocess.DEVNULL)


def test_broken_discovery_script_is_a_usage_error():
    result = _horovodrun(["-np", "2", "--host-discovery-script", "/nonexistent/discover.sh", "true"])
    assert result.returncode == 2, result.stderr
    assert "the first host discovery must succeed" in result.stderr and "Traceback" not in result.stderr


def test_workers_that_never_join_end_the_job():
    # Elastic flags with a command that is not elastic-aware: like the original, exit 0 means done.
    result = _horovodrun(["-np", "2", "--min-np", "1", "-H", "localhost:2", "sh", "-c", "echo hi $HOROVOD_ELASTIC"])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:hi 1", "[1]<stdout>:hi 1"]


def test_failing_command_fails_when_nothing_can_take_over():
    # Every worker failed: the job fails at once (like the original), not after --elastic-timeout (600 s).
    result = _horovodrun(["-np", "1", "--min-np", "1", "--elastic-timeout", "600", "-H", "localhost:1",
                          "sh", "-c", "exit 3"])
    assert result.returncode == 1, result.stderr
    assert "worker localhost:0 (not in an epoch yet) exited with 3; blacklisting host localhost" in result.stderr
    assert "Horovod detected that one or more processes exited with non-zero status" in result.stderr
    assert "waiting up to" not in result.stderr
    assert "blacklisted hosts: localhost" in result.stderr
