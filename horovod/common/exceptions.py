"""The exceptions of every binding, under the original's import path (defined in :mod:`horovod.engine.errors`)."""
from horovod.engine.errors import (  # noqa: F401  (re-exported)
    HorovodInternalError,
    InvalidArgumentError,
    HostsUpdatedInterrupt,
    MismatchError,
    ShutdownError,
    PeerFailureError,
    StallError,
    HorovodVersionMismatchError,
    get_version_mismatch_message,
)
