"""Host parsing and rank layout (pure functions)."""
from __future__ import annotations

import socket

import pytest

from horovod.runner.hosts import (HostInfo, SlotInfo, get_host_assignments, is_local_host, parse_hostfile,
                                  parse_hostfile_lines, parse_hosts)


def test_parse_hosts_with_slots():
    assert parse_hosts("host1:2,host2:4") == [HostInfo("host1", 2), HostInfo("host2", 4)]


def test_parse_hosts_bare_host_has_one_slot_and_spaces_are_ignored():
    assert parse_hosts(" a , b:3 ") == [HostInfo("a", 1), HostInfo("b", 3)]


def test_parse_hosts_ipv6():
    assert parse_hosts("[::1]:2") == [HostInfo("::1", 2)]
    assert parse_hosts("fe80::1") == [HostInfo("fe80::1", 1)]


@pytest.mark.parametrize("text, fragment", [
    ("host:x", "not an integer"),
    ("host:0", "must be >= 1"),
    (":2", "no host name"),
    ("", "lists no host"),
    ("a:1,a:2", "more than once"),
])
def test_parse_hosts_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_hosts(text)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nhost1 slots=2\n\nhost2 slots=4  # big one\nhost3\nhost4 slots=1 max_slots=8\n")
    assert parse_hostfile(str(path)) == [HostInfo("host1", 2), HostInfo("host2", 4), HostInfo("host3", 1),
                                         HostInfo("host4", 1)]


@pytest.mark.parametrize("lines, fragment", [
    (["host1 slots=two"], r"hostfile:1: slots='two' is not an integer"),
    (["", "host1 cores=2"], r"hostfile:2: cannot parse"),
    (["host1 slots=0"], r"slots must be >= 1"),
    (["# nothing"], r"lists no host"),
])
def test_parse_hostfile_errors(lines, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_hostfile_lines(lines)


def _check_consistent(slots):
    size = len(slots)
    assert [s.rank for s in slots] == list(range(size))
    assert all(s.size == size for s in slots)
    for host in {s.hostname for s in slots}:
        on_host = [s for s in slots if s.hostname == host]
        assert [s.local_rank for s in on_host] == list(range(len(on_host)))
        assert all(s.local_size == len(on_host) for s in on_host)
    for local in {s.local_rank for s in slots}:
        peers = [s for s in slots if s.local_rank == local]
        assert [s.cross_rank for s in peers] == list(range(len(peers)))
        assert all(s.cross_size == len(peers) for s in peers)


def test_assignment_fills_hosts_in_order():
    slots = get_host_assignments([HostInfo("a", 2), HostInfo("b", 2)], 4)
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank) for s in slots] == [
        ("a", 0, 0, 0), ("a", 1, 1, 0), ("b", 2, 0, 1), ("b", 3, 1, 1)]
    assert all((s.size, s.local_size, s.cross_size) == (4, 2, 2) for s in slots)
    _check_consistent(slots)


def test_assignment_uneven_hosts_cross_ranks():
    slots = get_host_assignments([HostInfo("a", 2), HostInfo("b", 1), HostInfo("c", 3)], 6)
    _check_consistent(slots)
    by_rank = {s.rank: s for s in slots}
    # local rank 0 lives on a, b, c; local rank 1 on a and c; local rank 2 on c only.
    assert (by_rank[0].cross_rank, by_rank[0].cross_size) == (0, 3)
    assert (by_rank[2].hostname, by_rank[2].cross_rank, by_rank[2].cross_size) == ("b", 1, 3)
    assert (by_rank[4].hostname, by_rank[4].local_rank, by_rank[4].cross_rank, by_rank[4].cross_size) == ("c", 1, 1, 2)
    assert (by_rank[5].local_rank, by_rank[5].cross_rank, by_rank[5].cross_size) == (2, 0, 1)


def test_assignment_starts_exactly_np_not_one_per_slot():
    # The original's static Gloo path started 4 workers here; this launcher starts exactly -np.
    slots = get_host_assignments([HostInfo("localhost", 4)], 2)
    assert len(slots) == 2
    assert all((s.size, s.local_size) == (2, 2) for s in slots)


def test_assignment_skips_hosts_not_needed():
    slots = get_host_assignments([HostInfo("a", 3), HostInfo("b", 3)], 2)
    assert {s.hostname for s in slots} == {"a"}
    assert all(s.cross_size == 1 for s in slots)


def test_assignment_with_maximum_uses_available_slots():
    slots = get_host_assignments([HostInfo("a", 2), HostInfo("b", 2)], 2, max_num_proc=3)
    assert len(slots) == 3
    _check_consistent(slots)


@pytest.mark.parametrize("np_", [1, 2, 3, 5, 7])
def test_assignment_consistent_for_many_sizes(np_):
    _check_consistent(get_host_assignments([HostInfo("a", 3), HostInfo("b", 1), HostInfo("c", 4)], np_))


def test_assignment_not_enough_slots():
    with pytest.raises(ValueError, match=r"requested 5 processes but the hosts provide only 3 slots"):
        get_host_assignments([HostInfo("a", 1), HostInfo("b", 2)], 5)
    with pytest.raises(ValueError, match=">= 1"):
        get_host_assignments([HostInfo("a", 1)], 0)


def test_slot_strings_and_env():
    slot = SlotInfo(hostname="h", rank=3, local_rank=1, cross_rank=1, size=4, local_size=2, cross_size=2)
    assert slot.to_response_string() == "3,4,1,2,1,2"
    assert slot.env() == {"HOROVOD_HOSTNAME": "h", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
                          "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1",
                          "HOROVOD_CROSS_SIZE": "2"}


def test_local_hosts():
    for name in ("localhost", "127.0.0.1", socket.gethostname()):
        assert is_local_host(name)
    assert not is_local_host("surely-not-this-machine.example")
