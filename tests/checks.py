"""The one result collector of the test suite (a helper module, not a test).

A multi-process test checks hundreds of cases inside each rank; stopping at the first mismatch would hide the
rest, and an exception would desynchronise the ranks.  So every rank records its checks in a :class:`Checks`,
returns ``checks.report()`` and the test process calls :func:`assert_no_failures` on the reports of all ranks.

A report is a plain dict (``rank``, ``checked``, ``failed``, ``items``) so that it crosses process boundaries
(pickle, JSON) unchanged.  :func:`assert_no_failures` also fails when a rank ran no check at all: a worker that
silently skipped everything must not pass.

``got`` / ``want`` in :meth:`Checks.equal` and :meth:`Checks.close` may be numpy arrays or torch, TensorFlow or
MXNet tensors (bfloat16 is compared through float32), or anything ``numpy.asarray`` accepts.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

ExcTypes = Union[Type[BaseException], Tuple[Type[BaseException], ...]]


def dtype_name(x: Any) -> Optional[str]:
    """The element type of ``x`` as a framework-neutral name (``float32``, ``bfloat16``, ``bool``...)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    name = getattr(dt, "name", None)          # numpy and TensorFlow dtypes
    if not isinstance(name, str):
        name = str(dt).replace("torch.", "")  # torch.float32 -> float32
    if isinstance(dt, type):                   # MXNet gives numpy scalar types (numpy.float32)
        import numpy as np

        name = np.dtype(dt).name
    return {"bool_": "bool"}.get(name, name)


def as_numpy(x: Any):
    """``x`` as a numpy array (framework tensors converted; bfloat16 widened to float32)."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    if hasattr(x, "asnumpy"):                  # MXNet NDArray / mx.np.ndarray
        return x.asnumpy()
    if hasattr(x, "numpy") and mod in ("tensorflow", "tf_keras", "keras"):
        out = x.numpy()
        return out.astype(np.float32) if dtype_name(x) == "bfloat16" else np.asarray(out)
    out = np.asarray(x)
    if out.dtype.name == "bfloat16":            # ml_dtypes arrays
        out = out.astype(np.float32)
    return out


def _framework(x: Any) -> str:
    """Which library made ``x`` (``numpy`` for numpy arrays and scalars and for plain Python values)."""
    root = type(x).__module__.split(".")[0]
    return "numpy" if root in ("numpy", "builtins") else root


class Checks:
    """The checks one rank ran, and which of them failed.

    Args:
        rank: written in front of every failure.
        rtol, atol: the default tolerance of :meth:`close` (0: exact).
        strict_dtype: :meth:`close` / :meth:`equal` also require ``got`` and ``want`` to be of the same library
            (a torch result compared with a torch tensor) and dtype.
        limit: failure descriptions kept (the count goes on).
    """

    def __init__(self, rank: int, *, rtol: float = 0.0, atol: float = 0.0, strict_dtype: bool = True,
                 limit: int = 500) -> None:
        self.rank, self.rtol, self.atol, self.strict_dtype, self.limit = rank, rtol, atol, strict_dtype, limit
        self.items: List[str] = []
        self.checked = 0
        self.failed = 0
        self._lock = threading.Lock()   # workers may check from several threads (engine background, MPI)

    # -- recording ----------------------------------------------------------------------------------------------
    def add(self, message: Optional[str]) -> None:
        """Record one check: ``None`` passed, a string describes the failure."""
        with self._lock:
            self.checked += 1
            if message is None:
                return
            self.failed += 1
            if len(self.items) < self.limit:
                self.items.append(f"rank {self.rank}: {message}")

    def true(self, cond: Any, what: str) -> None:
        self.add(None if cond else what)

    def error(self, what: str, exc: BaseException) -> None:
        """Record an exception that should not have happened (the job goes on)."""
        self.add(f"{what}: raised {type(exc).__name__}: {exc}")

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; an exception counts as a failed check (other ranks still run the same collectives)."""
        try:
            return fn()
        except Exception:  # noqa: BLE001  (recorded, not hidden)
            import traceback

            self.add(f"{what} raised:\n{traceback.format_exc()}")
            return None

    # -- comparisons --------------------------------------------------------------------------------------------
    def equal(self, got: Any, want: Any, what: str) -> None:
        """Same dtype (when strict), same shape, identical values."""
        self.add(self._compare(got, want, what, 0.0, 0.0))

    def close(self, got: Any, want: Any, what: str, rtol: Optional[float] = None,
              atol: Optional[float] = None) -> None:
        """Like :meth:`equal` but within ``rtol`` / ``atol`` (the collector's defaults when not given)."""
        self.add(self._compare(got, want, what, self.rtol if rtol is None else rtol,
                               self.atol if atol is None else atol))

    def raises(self, what: str, exc_type: ExcTypes, fn: Callable, *args, match: Optional[str] = None,
               **kwargs) -> None:
        """``fn(*args, **kwargs)`` must raise ``exc_type`` (with ``match`` in its message when given)."""
        names = getattr(exc_type, "__name__", None) or " or ".join(t.__name__ for t in exc_type)
        try:
            fn(*args, **kwargs)
        except exc_type as exc:
            self.add(None if match is None or match in str(exc) else
                     f"{what}: message {str(exc)!r} lacks {match!r}")
        except BaseException as exc:  # noqa: BLE001  (the wrong exception is a failure, not a crash)
            self.add(f"{what}: raised {type(exc).__name__}: {exc}, expected {names}")
        else:
            self.add(f"{what}: did not raise {names}")

    def expect_raises(self, what: str, exc_type: ExcTypes, fn: Callable[[], Any], contains: Sequence[str] = ()
                      ) -> None:
        """:meth:`raises` with several required message fragments (the engine suites' spelling)."""
        names = getattr(exc_type, "__name__", None) or " or ".join(t.__name__ for t in exc_type)
        try:
            fn()
        except exc_type as exc:
            missing = [c for c in contains if c not in str(exc)]
            self.add(f"{what}: message {str(exc)!r} lacks {missing}" if missing else None)
        except BaseException as exc:  # noqa: BLE001
            self.add(f"{what}: raised {type(exc).__name__}: {exc}, expected {names}")
        else:
            self.add(f"{what}: did not raise {names}")

    def _compare(self, got: Any, want: Any, what: str, rtol: float, atol: float) -> Optional[str]:
        import numpy as np

        try:
            if self.strict_dtype and _framework(got) != _framework(want):
                return f"{what}: got a {type(got).__module__}.{type(got).__name__}, expected a " \
                       f"{type(want).__module__}.{type(want).__name__}"
            if self.strict_dtype and dtype_name(want) is not None and dtype_name(got) != dtype_name(want):
                return f"{what}: dtype {dtype_name(got)}, expected {dtype_name(want)}"
            g, w = as_numpy(got), as_numpy(want)
            if tuple(g.shape) != tuple(w.shape):
                return f"{what}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
            if g.dtype == np.bool_ or w.dtype == np.bool_:
                ok = np.array_equal(g.astype(bool), w.astype(bool))
            elif rtol or atol:
                ok = np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)
            elif g.dtype.kind in "iub" and w.dtype.kind in "iub":   # exact, without float64 rounding of int64
                ok = np.array_equal(g.astype(np.int64) if g.dtype != np.uint64 else g, w)
            else:
                ok = np.array_equal(g.astype(np.float64), w.astype(np.float64), equal_nan=True)
            if ok:
                return None
            fg, fw = g.ravel(), w.ravel()
            bad = np.flatnonzero(fg != fw) if fg.shape == fw.shape else np.array([], dtype=np.int64)
            i = int(bad[0]) if bad.size else 0
            sample = f"; first difference at flat index {i}: got {fg[i]!r}, expected {fw[i]!r}" if fg.size else ""
            return f"{what}: values differ ({bad.size} of {fg.size} elements){sample}"
        except Exception as exc:  # noqa: BLE001  (a comparison bug is reported, not allowed to crash the job)
            return f"{what}: comparison raised {type(exc).__name__}: {exc}"

    # -- the result ---------------------------------------------------------------------------------------------
    def report(self) -> Dict[str, Any]:
        with self._lock:
            return {"rank": self.rank, "checked": self.checked, "failed": self.failed, "items": list(self.items)}


def assert_no_failures(reports: Sequence[Dict[str, Any]], minimum_checks: int = 1) -> None:
    """Fail with every rank's failures, or when a rank ran fewer than ``minimum_checks`` checks (default: none).

    ``reports`` holds one :meth:`Checks.report` per rank.
    """
    assert reports, "no rank reported anything: the test cannot have tested anything"
    idle = [(r["rank"], r["checked"]) for r in reports if r["checked"] < max(1, minimum_checks)]
    assert not idle, (f"rank(s) ran too few checks (rank, checks): {idle}; expected at least {max(1, minimum_checks)}"
                      f" each: the test cannot have tested what it claims there")
    bad = [r for r in reports if r["failed"]]
    if bad:
        lines = []
        for r in bad:
            lines.append(f"rank {r['rank']}: {r['failed']} of {r['checked']} checks failed")
            lines.extend("  " + item for item in r["items"][:60])
        raise AssertionError("\n".join(lines))


class JobPerCombination:
    """Runs one multi-process job per combination (binding, transport, world size...) for every case selected in
    the session, and hands each test its case's per-rank reports. A job that fails fails every test of its
    combination, naming the combination; a case a job did not run is a failure too.

    Args:
        describe: the combination as it reads in a message (the tests' id).
    """

    def __init__(self, describe: Callable[[Any], str]):
        self._describe = describe
        self._jobs: Dict[Any, object] = {}   # combo -> per-rank reports (dicts by case), or the job's exception

    @staticmethod
    def selected(session: Any, combo: Any) -> set:
        """The cases this pytest run selected for ``combo`` (tests named ``test_<case>``, parametrized by combo)."""
        wanted = set()
        for item in session.items:
            spec = getattr(item, "callspec", None)
            if spec is not None and spec.params.get("combo") == combo and item.originalname.startswith("test_"):
                wanted.add(item.originalname[len("test_"):])
        return wanted

    def reports(self, combo: Any, case: str, start: Callable[[], List[dict]]) -> List[dict]:
        if combo not in self._jobs:
            try:
                self._jobs[combo] = start()
            except BaseException as exc:  # noqa: BLE001  (every test of the combination reports the job's failure)
                self._jobs[combo] = exc
        result = self._jobs[combo]
        if isinstance(result, BaseException):
            raise AssertionError(f"the {self._describe(combo)} job failed, so {case} could not be checked") from result
        assert isinstance(result, list)
        missing = [r for r in result if case not in r]
        assert not missing, f"the {self._describe(combo)} job did not run {case} (it ran {sorted(result[0])})"
        return [r[case] for r in result]

