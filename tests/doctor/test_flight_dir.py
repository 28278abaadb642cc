"""Issue 38: the shared flight-recorder directory ``<tmp>/horovod-flight-recorder`` is private to its user.

Another user who created it (or may write to it) could replace the dumps and so forge the doctor's verdict: it is
created 0700, and refused, with a per-user fallback, when it is someone else's or group/world-writable.
"""
from __future__ import annotations

import os
import stat
import tempfile
from types import SimpleNamespace

import pytest

from horovod.engine import flight_dump

OTHER_UID = 4242


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path`` (the default directory lives there), under umask 0: the modes
    seen are the ones the code asks for."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0)
    yield tmp_path
    os.umask(old)


def _config(**kw):
    return SimpleNamespace(flight_recorder_dir=kw.get("chosen", ""), topology=SimpleNamespace(launched_by=""))


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_directory_is_created_private(tmp_root):
    where = flight_dump.directory(_config())
    assert where == str(tmp_root / flight_dump.DEFAULT_DIR_NAME)
    assert _mode(where) == 0o700
    assert os.lstat(where).st_uid == os.getuid()


def test_a_chosen_directory_is_created_private_and_used_as_is(tmp_root):
    chosen = tmp_root / "mine" / "dumps"
    assert flight_dump.directory(_config(chosen=str(chosen))) == str(chosen)
    assert _mode(chosen) == 0o700


def test_a_group_writable_default_is_refused_for_a_private_fallback(tmp_root, caplog):
    shared = tmp_root / flight_dump.DEFAULT_DIR_NAME
    shared.mkdir(mode=0o777)
    where = flight_dump.directory(_config())
    assert where == f"{shared}-{os.getuid()}" and _mode(where) == 0o700
    assert "writable by its group or by everyone (mode 777)" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_a_default_owned_by_another_user_is_refused(tmp_root):
    shared = tmp_root / flight_dump.DEFAULT_DIR_NAME
    shared.mkdir(mode=0o700)
    os.chown(shared, OTHER_UID, OTHER_UID)
    where = flight_dump.directory(_config())
    assert where == f"{shared}-{os.getuid()}" and _mode(where) == 0o700
    # The fallback taken over too: a clear error that says what to do.
    os.rmdir(where)
    os.mkdir(where, 0o700)
    os.chown(where, OTHER_UID, OTHER_UID)
    with pytest.raises(flight_dump.UnsafeDirectoryError) as err:
        flight_dump.directory(_config())
    text = str(err.value)
    assert f"owned by uid {OTHER_UID}, not by this user" in text and "HOROVOD_FLIGHT_RECORDER_DIR" in text


def test_a_symbolic_link_is_refused(tmp_root):
    target = tmp_root / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_root / flight_dump.DEFAULT_DIR_NAME).symlink_to(target)
    assert flight_dump.directory(_config()) == f"{tmp_root / flight_dump.DEFAULT_DIR_NAME}-{os.getuid()}"


def test_a_dump_never_lands_in_a_directory_someone_else_may_write(tmp_root):
    """The whole path through ``dump()``: the rank's dump goes to the private fallback."""
    import horovod.numpy as hvd
    from horovod.common import basics

    (tmp_root / flight_dump.DEFAULT_DIR_NAME).mkdir(mode=0o777)
    hvd.init()
    try:
        path = flight_dump.dump(basics.runtime().state, "test")
    finally:
        hvd.shutdown()
    assert path is not None and os.path.dirname(path) == f"{tmp_root / flight_dump.DEFAULT_DIR_NAME}-{os.getuid()}"
    assert not os.listdir(tmp_root / flight_dump.DEFAULT_DIR_NAME)


def test_rank_0_under_mpirun_skips_the_collection_when_no_directory_is_private(tmp_root, caplog):
    """Rank 0 collects on a stall from the engine's thread: an unsafe directory is said, never raised there."""
    shared = tmp_root / flight_dump.DEFAULT_DIR_NAME
    shared.mkdir(mode=0o777)
    os.mkdir(f"{shared}-{os.getuid()}", 0o777)
    runtime = SimpleNamespace(rank=0, rendezvous_server=object(), config=_config())
    flight_dump.collect_under_mpirun(runtime, "stall warning")
    assert "no collection" in caplog.text and "not private" in caplog.text
