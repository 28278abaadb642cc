"""The benchmarks: one entry point per question, each runnable as ``python benchmarks/<name>.py``.

- ``collectives.py``: the data plane against torch.distributed (Gloo, launched by torchrun) and Open MPI (by
  mpirun), each peer in jobs of its own interleaved with this project's (bandwidth, latency, fusion, memory); the
  targets it checks are data in ``targets.py``.
- ``transports.py``: this project's transports (shm, tcp, mpi) called directly, with transport options.
- ``big_result.py``: what a very large allreduce costs in place, into a new result, and against a first touch.
- ``torch_training.py``: horovod.torch under horovodrun against DDP under torchrun, in jobs of their own.
- ``tf_training.py``, ``jax_collectives.py``: the framework bindings against each framework's own data-parallel
  path, in the same processes (``tf_training.py``'s MWMS figures are withdrawn for that reason: issue 35).
- ``latency_stages.py``, ``control_plane.py``, ``round_boards.py``, ``flight_recorder.py``: where the time of one
  call or one training step's agreement goes (``round_boards.py``: the warm path's AND over real sockets).
- ``gpu.py``: the device plane (run on a GPU machine: ``tests/gpu/device_check.sh``).

Shared parts: ``_lib/`` (launching jobs under timeouts, sizes and bus-bandwidth math, tables and run headers, the
np = 1 worker of ``latency_stages.py --python-overhead``),
``_collectives/`` (the collective sweep that ``collectives.py`` and ``transports.py`` share) and ``charts.py``
(``--chart FILE.png``: matplotlib, imported only when a chart is asked for).
"""
