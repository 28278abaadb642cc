"""Make the shared test helpers (tests/multiproc.py) importable from every test folder."""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    # Appended, not prepended: tests/torch etc. must never shadow the real frameworks.
    sys.path.append(_TESTS)
