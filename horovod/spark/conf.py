"""Spark settings that matter to Horovod jobs, as ``(key, value)`` pairs for ``SparkConf().set(*pair)``.

An elastic job (:func:`horovod.spark.run_elastic`) recovers from a lost task only if Spark retries it: Horovod
counts resets itself (``reset_limit``), so Spark's own retry limit should not end the job first. The
``blacklist`` keys decide whether a retried task may run on the executor or node where it failed (Spark 3.1
renamed them ``spark.excludeOnFailure.*``; the old names still work). The values are the original's.
"""

SPARK_CONF_MAX_INT = "2147483647"
SPARK_CONF_MAX_INT_MINUS_ONE = "2147483646"

# Retry failed tasks for ever: Horovod's reset limit is the one that counts.
SPARK_CONF_ALWAYS_RESTART_FAILED_TASK = ("spark.task.maxFailures", SPARK_CONF_MAX_INT)

# Spark's executor / node exclusion after failures.
SPARK_CONF_BLACKLIST_DISABLED = ("spark.blacklist.enabled", "false")
SPARK_CONF_BLACKLIST_ENABLED = ("spark.blacklist.enabled", "true")

# An executor where a task failed may (or may not) run other tasks of the stage (needs the blacklist enabled).
SPARK_CONF_REUSE_FAILED_EXECUTOR = ("spark.blacklist.stage.maxFailedTasksPerExecutor", SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILED_EXECUTOR = ("spark.blacklist.stage.maxFailedTasksPerExecutor", "1")

# A node with failed executors may (or may not) keep being used by the stage (needs SPARK_CONF_REUSE_FAILED_EXECUTOR
# for the "reuse" variant).
SPARK_CONF_REUSE_FAILING_NODE = ("spark.blacklist.stage.maxFailedExecutorsPerNode", SPARK_CONF_MAX_INT_MINUS_ONE)
SPARK_CONF_DONT_REUSE_FAILING_NODE = ("spark.blacklist.stage.maxFailedExecutorsPerNode", "1")

# A retried task may run again on the executor where it failed: always, once more, or never.
SPARK_CONF_REUSE_EXECUTOR_ALWAYS_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor", SPARK_CONF_MAX_INT)
SPARK_CONF_REUSE_EXECUTOR_ONCE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor", "2")
SPARK_CONF_DONT_REUSE_EXECUTOR_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor", "1")

# ... and on the node where it failed.
SPARK_CONF_REUSE_NODE_ALWAYS_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode",
                                              SPARK_CONF_MAX_INT_MINUS_ONE)
SPARK_CONF_REUSE_NODE_ONCE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode", "2")
SPARK_CONF_DONT_REUSE_NODE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode", "1")

# The same across the whole application (with dynamic allocation only executors excluded for the application
# can be given back to the cluster manager).
SPARK_CONF_REUSE_FAILED_EXECUTOR_IN_APP = ("spark.blacklist.application.maxFailedTasksPerExecutor", SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILED_EXECUTOR_IN_APP = ("spark.blacklist.application.maxFailedTasksPerExecutor", "1")
SPARK_CONF_REUSE_FAILING_NODE_IN_APP = ("spark.blacklist.application.maxFailedExecutorsPerNode", SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILING_NODE_IN_APP = ("spark.blacklist.application.maxFailedExecutorsPerNode", "1")

# Spark's defaults for the keys above (https://spark.apache.org/docs/latest/configuration.html).
SPARK_CONF_DEFAULT_VALUES = {
    "spark.task.maxFailures": "4",
    "spark.blacklist.enabled": "false",
    "spark.blacklist.stage.maxFailedTasksPerExecutor": "2",
    "spark.blacklist.stage.maxFailedExecutorsPerNode": "2",
    "spark.blacklist.task.maxTaskAttemptsPerExecutor": "1",
    "spark.blacklist.task.maxTaskAttemptsPerNode": "2",
    "spark.blacklist.application.maxFailedTasksPerExecutor": "2",
    "spark.blacklist.application.maxFailedExecutorsPerNode": "2",
}
