"""The constants Horovod 0.28.1's ``horovod.spark.common.constants`` offered, with the same names and values.

Scripts written for the original read them (for example to compare a column's ``intermediate_format``, or to
size reader buffers), so they stay importable.  Most describe the original's Petastorm-based data path; this
project stores vectors as plain ``array<double>`` Parquet columns and reads them with pyarrow (see
docs/spark_estimators.md), so here they are names with values and steer nothing.
"""
from __future__ import annotations

#: The HDFS driver the original handed to Petastorm.
PETASTORM_HDFS_DRIVER = "libhdfs"
#: In verbose mode, the original printed the running metrics every this many steps.
METRIC_PRINT_FREQUENCY = 100

# How a column is stored in the intermediate Parquet data (the original's ``intermediate_format``).
ARRAY = "array"
CUSTOM_SPARSE = "custom_sparse_format"
NOCHANGE = "nochange"

# What a vector column holds: only sparse vectors, only dense ones, or both.
MIXED_SPARSE_DENSE_VECTOR = "mixed_sparse_dense_vector"
SPARSE_VECTOR = "sparse_vector"
DENSE_VECTOR = "dense_vector"

#: The original capped the readers' shuffle and prefetch buffers at this many GiB in total.
TOTAL_BUFFER_MEMORY_CAP_GIB = 4
BYTES_PER_GIB = 1073741824   # 2 ** 30

__all__ = ["ARRAY", "BYTES_PER_GIB", "CUSTOM_SPARSE", "DENSE_VECTOR", "METRIC_PRINT_FREQUENCY",
           "MIXED_SPARSE_DENSE_VECTOR", "NOCHANGE", "PETASTORM_HDFS_DRIVER", "SPARSE_VECTOR",
           "TOTAL_BUFFER_MEMORY_CAP_GIB"]
