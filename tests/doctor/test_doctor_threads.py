"""Issue 38: the doctor names the line of the thread that issued the collective, not the main thread's ``join()``.

A planted hang under horovodrun (tests/doctor/planted.py, scenario ``thread``): the waiting ranks issue their
allreduce from a worker thread while their main thread joins it; the last rank sleeps in user code.
"""
from __future__ import annotations

from test_planted_hangs import marker_line, run_planted

from horovod.doctor.verdict import where


def test_where_follows_the_thread_that_issued_the_collective():
    main_frames = [["/x/train.py", 10, "<module>", "t.join()", False],
                   ["/usr/lib/python3/threading.py", 1100, "join", "", True]]
    thread_frames = [["/x/train.py", 5, "run", "hvd.allreduce(g)", False],
                     ["/h/horovod/engine/handles.py", 70, "wait", "", True]]
    dump = {"threads": [{"name": "MainThread", "ident": 1, "main": True, "frames": main_frames},
                        {"name": "trainer", "ident": 2, "main": False, "frames": thread_frames}]}
    assert where(dump, {"thread": 2}) == "train.py:5 (`hvd.allreduce(g)`)"
    assert where(dump) == "train.py:10 (`t.join()`)"                  # no collective: the main thread
    assert where(dump, {"thread": 3}) == "train.py:10 (`t.join()`)"   # its thread is gone: the main thread
    assert where(dump, {}) == "train.py:10 (`t.join()`)"              # a dump of an older format


def test_a_collective_issued_from_a_thread_is_named_at_its_line(tmp_path):
    verdict, output = run_planted(tmp_path, "thread", 2, "tcp")
    expected = ["rank 1 never submitted allreduce 'grad.fc1.bias'",
                f"it is in {marker_line('thread', 'culprit')}",
                f"rank 0 waits in it ({marker_line('thread', 'waiter')})"]
    for piece in expected:
        assert piece in verdict, f"{piece!r} not in the verdict:\n{verdict}\n--- job output:\n{output[-3000:]}"
    assert marker_line("thread", "main") not in verdict, verdict
