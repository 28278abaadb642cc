"""Make the shared test helpers (tests/multiproc.py) importable from every test folder."""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
