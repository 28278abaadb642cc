"""The collective sweep shared by ``collectives.py`` and ``transports.py``: what a rank measures (cases,
implementations, phases, worker) and what the driver does with it (jobs, results, report, targets)."""
