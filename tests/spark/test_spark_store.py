"""Stores without Spark: the original's path layout, file access through pyarrow.fs, Parquet datasets, pickling,
and the shard arithmetic every training process relies on."""
import json
import pathlib
import pickle

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="the Spark stores need pyarrow (pip install 'horovod-next[spark]')")
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from horovod.spark.common import reader, util  # noqa: E402
from horovod.spark.common.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store  # noqa: E402


def test_layout_matches_the_original(tmp_path):
    store = Store.create(str(tmp_path))
    assert isinstance(store, FilesystemStore)
    prefix = tmp_path.as_uri()
    assert store.prefix_path == prefix
    assert store.get_train_data_path() == f"{prefix}/intermediate_train_data"
    assert store.get_train_data_path(3) == f"{prefix}/intermediate_train_data.3"
    assert store.get_val_data_path() == f"{prefix}/intermediate_val_data"
    assert store.get_val_data_path(0) == f"{prefix}/intermediate_val_data.0"
    assert store.get_test_data_path() == f"{prefix}/intermediate_test_data"
    assert store.get_runs_path() == f"{prefix}/runs"
    assert store.get_run_path("r1") == f"{prefix}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{prefix}/runs/r1"
    assert store.get_logs_path("r1") == f"{prefix}/runs/r1/logs"
    assert store.get_checkpoint_filename() == "checkpoint"
    assert store.get_logs_subdir() == "logs"
    assert store.saving_runs()


def test_save_runs_false_and_overrides(tmp_path):
    store = LocalStore(str(tmp_path), save_runs=False, train_path=str(tmp_path / "mytrain"),
                       checkpoint_filename="ckpt")
    assert store.get_checkpoint_path("r") is None and store.get_logs_path("r") is None
    assert store.get_train_data_path() == (tmp_path / "mytrain").as_uri()
    assert store.get_checkpoint_filename() == "ckpt"


def test_bad_arguments_are_explained(tmp_path):
    with pytest.raises(ValueError, match="prefix_path"):
        FilesystemStore("")
    with pytest.raises(ValueError, match="LocalStore needs a local path"):
        LocalStore("s3://bucket/x")
    with pytest.raises(ValueError, match="run_id"):
        Store.create(str(tmp_path)).get_run_path("a/b")
    with pytest.raises(TypeError, match="unexpected keyword"):
        FilesystemStore(str(tmp_path), no_such_option=1)


def test_read_write_exists_delete_and_checkpoint_listing(tmp_path):
    store = Store.create(str(tmp_path))
    ckpt = store.get_checkpoint_path("run") + "/epoch-1.ckpt"
    assert not store.exists(ckpt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        store.read(ckpt)
    store.write(ckpt, b"abc")
    store.write_text(store.get_checkpoint_path("run") + "/notes.txt", "hello")
    assert store.exists(ckpt) and store.read(ckpt) == b"abc"
    assert (tmp_path / "runs" / "run" / "epoch-1.ckpt").read_bytes() == b"abc"
    store.write(ckpt, b"new")          # replaced whole, no temporary file left behind
    assert store.read(ckpt) == b"new"
    assert sorted(p.name for p in (tmp_path / "runs" / "run").iterdir()) == ["epoch-1.ckpt", "notes.txt"]
    assert [pathlib.Path(p).name for p in store.get_checkpoints("run")] == ["epoch-1.ckpt"]
    assert store.get_checkpoints("other") == []
    store.delete(store.get_run_path("run"))
    assert not store.exists(ckpt)
    store.delete(store.get_run_path("run"))   # deleting what is gone is fine


def test_sync_fn_copies_a_local_tree_into_the_run(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    local = tmp_path / "local"
    (local / "logs").mkdir(parents=True)
    (local / "checkpoint").write_bytes(b"1")
    (local / "logs" / "events").write_bytes(b"2")
    store.sync_fn("r")(str(local))
    assert store.read(store.get_run_path("r") + "/checkpoint") == b"1"
    assert store.read(store.get_logs_path("r") + "/events") == b"2"
    with store.get_local_output_dir_fn("r")() as out:
        assert pathlib.Path(out).is_dir()


def test_any_pyarrow_filesystem_works(tmp_path):
    # A filesystem reached only through pyarrow.fs (here a SubTreeFileSystem rooted elsewhere): paths are
    # resolved by the filesystem, not by os.
    root = tmp_path / "subtree"
    root.mkdir()
    fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
    store = FilesystemStore("mock://bucket/prefix", filesystem=fs)
    assert store.get_train_data_path() == "mock://bucket/prefix/intermediate_train_data"
    store.write(store.get_checkpoint_path("r") + "/checkpoint", b"x")
    assert (root / "prefix" / "runs" / "r" / "checkpoint").read_bytes() == b"x"
    # It survives pickling (it is sent to every training process) and keeps working there.
    clone = pickle.loads(pickle.dumps(store))
    assert clone.read(clone.get_checkpoint_path("r") + "/checkpoint") == b"x"


def test_pickled_store_rebuilds_its_filesystem(tmp_path):
    store = Store.create(str(tmp_path))
    store.write(store.get_run_path("r") + "/f", b"1")
    clone = pickle.loads(pickle.dumps(store))
    assert clone._fs is None and clone.read(clone.get_run_path("r") + "/f") == b"1"


def test_hdfs_and_dbfs_paths():
    # No namenode here: only the path handling is checked; the filesystem is created lazily.
    store = HDFSStore("hdfs://namenode:8020/user/me/horovod")
    assert store.get_train_data_path() == "hdfs://namenode:8020/user/me/horovod/intermediate_train_data"
    assert store.get_localized_path(store.get_run_path("r")) == "/user/me/horovod/runs/r"
    assert (store._host, store._port) == ("namenode", 8020)
    bare = HDFSStore("/user/me/h")
    assert bare.prefix_path == "hdfs:///user/me/h" and (bare._host, bare._port) == ("default", 0)
    assert isinstance(Store.create("hdfs:///x"), HDFSStore)
    assert DBFSLocalStore.matches_dbfs("dbfs:/x") and DBFSLocalStore.normalize_datafame_path("/dbfs/a") == "dbfs:/a"
    dbfs = DBFSLocalStore("dbfs:/ml/h")
    assert dbfs.get_localized_path(dbfs.get_train_data_path()) == "/dbfs/ml/h/intermediate_train_data"


def _write_dataset(store, path, files):
    """Parquet files of consecutive ids, each file in row groups of the given sizes."""
    local = store.get_localized_path(path)
    pathlib.Path(local).mkdir(parents=True)
    start = 0
    for i, groups in enumerate(files):
        n = sum(groups)
        table = pa.table({"id": np.arange(start, start + n, dtype=np.int64),
                          "v": pa.array([[float(x), -float(x)] for x in range(start, start + n)],
                                        type=pa.list_(pa.float64()))})
        writer = pq.ParquetWriter(f"{local}/part-{i:05d}.parquet", table.schema)
        offset = 0
        for g in groups:
            writer.write_table(table.slice(offset, g))
            offset += g
        writer.close()
        start += n
    return start


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_shards_cover_every_row_once(tmp_path, size):
    store = Store.create(str(tmp_path))
    path = store.get_train_data_path()
    total = _write_dataset(store, path, [[7, 5], [0], [13], [1, 1, 1]])
    assert store.is_parquet_dataset(path) and not store.is_parquet_dataset(path + "_none")
    assert util.count_rows(store, path) == total == 28
    meta = {"id": {"kind": "scalar", "dtype": "int64", "shape": None},
            "v": {"kind": "array", "dtype": "float32", "shape": 2}}
    shards = [reader.read_shard(store, path, ["id", "v"], meta, r, size) for r in range(size)]
    ids = np.concatenate([s["id"] for s in shards])
    np.testing.assert_array_equal(ids, np.arange(total))            # contiguous, in order, no duplicates
    lengths = [len(s["id"]) for s in shards]
    assert max(lengths) - min(lengths) <= 1
    for s in shards:
        assert s["v"].dtype == np.float32 and s["v"].shape == (len(s["id"]), 2)
        np.testing.assert_array_equal(s["v"][:, 1], -s["id"].astype(np.float32))


def test_ragged_array_column_is_refused(tmp_path):
    store = Store.create(str(tmp_path))
    local = store.get_localized_path(store.get_train_data_path())
    pathlib.Path(local).mkdir(parents=True)
    pq.write_table(pa.table({"v": pa.array([[1.0, 2.0], [3.0]])}), local + "/p.parquet")
    with pytest.raises(ValueError, match="row 1 of an array column has 1 values, expected 2"):
        reader.read_shard(store, store.get_train_data_path(), ["v"],
                          {"v": {"kind": "array", "dtype": "float64", "shape": 2}}, 0, 1)


def test_steps_and_batches():
    assert reader.steps_per_epoch(1797, 32, 2) == 28
    assert reader.steps_per_epoch(10, 32, 4) == 1          # never zero: every rank runs at least one step
    assert reader.steps_per_epoch(10, 32, 4, requested=5) == 5
    with pytest.raises(ValueError, match="at least 1"):
        reader.steps_per_epoch(10, 2, 1, requested=0)
    assert [reader.shard_bounds(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    it = reader.BatchIterator({"x": np.arange(5)}, batch_size=2, shuffle=True, seed=1)
    seen = np.concatenate([next(it)["x"] for _ in range(3)])    # one pass: 2 + 2 + 1
    assert sorted(seen.tolist()) == [0, 1, 2, 3, 4]
    assert len(next(it)["x"]) == 2                               # and it starts over
    with pytest.raises(ValueError, match="shard of the data is empty"):
        reader.BatchIterator({"x": np.arange(0)}, batch_size=2)


def test_metadata_roundtrip_needs_prepared_data(tmp_path):
    store = Store.create(str(tmp_path))
    with pytest.raises(ValueError, match="call fit\\(df\\) first"):
        util.read_metadata(store)
    store.write_text(store.get_train_data_path() + "/" + util.METADATA_FILE, json.dumps({"train_rows": 3}))
    assert util.read_metadata(store) == {"train_rows": 3}
