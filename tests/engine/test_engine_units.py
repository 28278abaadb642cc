"""Unit tests of the engine's pure parts: fusion planning, coordinator negotiation, knob parsing and precedence.

No processes, no sockets: these modules are plain functions over plain data, so they are tested in-process.
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod.engine import config, fusion, negotiation, ops
from horovod.engine.messages import ERROR, Request, Response
from horovod.engine.negotiation import Coordinator, validate

MIB = 1024 * 1024


# ------------------------------------------------------------------------------------------------ fusion.plan
def ar(name, shape=(4,), dtype="float32", op=ops.Sum, pset=0, pre=1.0, post=1.0, joined=(), kind=ops.ALLREDUCE,
       root=-1, first_dims=None, payload=None):
    return Response(kind, [name], pset, dtype=dtype, op=op, root=root, prescale=pre, postscale=post,
                    shapes=[tuple(shape)], first_dims=[list(first_dims)] if first_dims else [], joined=tuple(joined),
                    payload=payload)


def names(plan):
    return [r.names for r in plan]


def test_plan_fuses_consecutive_compatible_responses_in_order():
    ready = [ar("a"), ar("b", (2, 3)), ar("c", ())]
    out = fusion.plan(ready, 1 * MIB)
    assert names(out) == [["a", "b", "c"]]
    assert out[0].shapes == [(4,), (2, 3), ()]
    assert out[0].kind == ops.ALLREDUCE and out[0].dtype == "float32"


def test_plan_threshold_zero_disables_fusion():
    ready = [ar("a"), ar("b"), ar("c")]
    assert names(fusion.plan(ready, 0)) == [["a"], ["b"], ["c"]]


def test_plan_respects_threshold_bytes_exactly():
    # three 16-byte tensors: 32 bytes fit two, the third starts a new buffer
    ready = [ar("a"), ar("b"), ar("c")]
    assert names(fusion.plan(ready, 32)) == [["a", "b"], ["c"]]
    assert names(fusion.plan(ready, 48)) == [["a", "b", "c"]]
    assert names(fusion.plan(ready, 47)) == [["a", "b"], ["c"]]


def test_plan_tensor_larger_than_threshold_stays_alone():
    ready = [ar("a"), ar("big", (100,)), ar("b"), ar("c")]
    assert names(fusion.plan(ready, 64)) == [["a"], ["big"], ["b", "c"]]


def test_plan_runs_large_host_responses_alone_but_fuses_them_on_a_device():
    # a 1 MiB float32 tensor (fusion.ALONE_BYTES) is never copied into a fusion buffer on the host, even far below
    # the threshold; one byte less still fuses; on a GPU copies are cheap and calls are not: fused as before
    big, under = (fusion.ALONE_BYTES // 4,), (fusion.ALONE_BYTES // 4 - 1,)
    ready = [ar("a"), ar("big", big), ar("b"), ar("under", under, "float32"), ar("c")]
    assert names(fusion.plan(ready, 128 * MIB)) == [["a"], ["big"], ["b", "under", "c"]]
    on_device = [ar(n, shape) for n, shape in (("a", (4,)), ("big", big), ("b", (4,)))]
    for resp in on_device:
        resp.device = 0
    assert names(fusion.plan(on_device, 128 * MIB)) == [["a", "big", "b"]]
    grouped = [ar("g1", big), ar("g2", big)]   # a group's members too: each alone
    assert names(fusion.plan(grouped, 128 * MIB)) == [["g1"], ["g2"]]


@pytest.mark.parametrize("field,value", [
    ("dtype", "float64"), ("op", ops.Average), ("pset", 1), ("pre", 2.0), ("post", 0.5), ("joined", (1,)),
])
def test_plan_never_fuses_across_differing_parameters(field, value):
    kwargs = {field: value}
    ready = [ar("a"), ar("b", **kwargs), ar("c", **kwargs)]
    assert names(fusion.plan(ready, MIB)) == [["a"], ["b", "c"]]


def test_plan_never_fuses_different_kinds_or_roots():
    ready = [ar("a"), ar("g", kind=ops.ALLGATHER, first_dims=[4, 4]), ar("r", kind=ops.REDUCESCATTER),
             ar("b0", kind=ops.BROADCAST, root=0), ar("b1", kind=ops.BROADCAST, root=1),
             ar("b1b", kind=ops.BROADCAST, root=1)]
    assert names(fusion.plan(ready, MIB)) == [["a"], ["g"], ["r"], ["b0"], ["b1", "b1b"]]


def test_plan_passes_non_fusible_responses_through_and_they_break_runs():
    a2a = Response(ops.ALLTOALL, ["x"], 0, shapes=[(4,)], splits=[[[2, 2], [2, 2]]])
    err = Response(ERROR, ["e"], 0, error="boom")
    bar = Response(ops.BARRIER, ["barrier.noname"], 0)
    ready = [ar("a"), a2a, ar("b"), err, ar("c"), bar, ar("d"), ar("e2")]
    out = fusion.plan(ready, MIB)
    assert names(out) == [["a"], ["x"], ["b"], ["e"], ["c"], ["barrier.noname"], ["d", "e2"]]
    assert out[1] is a2a and out[3] is err and out[5] is bar


def test_plan_separate_groups_keeps_explicit_groups_apart():
    def member(name, group):
        r = ar(name)
        r.group = group
        return r

    ready = [member("a1", "ga"), member("a2", "ga"), member("b1", "gb"), member("b2", "gb"), ar("solo")]
    assert names(fusion.plan(ready, MIB)) == [["a1", "a2", "b1", "b2", "solo"]]
    ready = [member("a1", "ga"), member("a2", "ga"), member("b1", "gb"), member("b2", "gb"), ar("solo")]
    assert names(fusion.plan(ready, MIB, separate_groups=True)) == [["a1", "a2"], ["b1", "b2"], ["solo"]]


def test_plan_does_not_fuse_inline_responses():
    ready = [ar("a", payload=b"\0" * 16), ar("b", payload=b"\0" * 16), ar("c"), ar("d")]
    assert names(fusion.plan(ready, MIB)) == [["a"], ["b"], ["c", "d"]]


def test_plan_does_not_mutate_its_input():
    ready = [ar("a"), ar("b"), ar("c")]
    fusion.plan(ready, MIB)
    assert names(ready) == [["a"], ["b"], ["c"]]
    assert [r.shapes for r in ready] == [[(4,)], [(4,)], [(4,)]]


def test_plan_allgather_counts_every_ranks_rows():
    # rows of 3 float32 = 12 bytes; 2+3 rows = 60 bytes, then 1+1 rows = 24 bytes
    g1 = ar("g1", (2, 3), kind=ops.ALLGATHER, first_dims=[2, 3])
    g2 = ar("g2", (1, 3), kind=ops.ALLGATHER, first_dims=[1, 1])
    assert fusion.response_bytes(g1) == 60 and fusion.response_bytes(g2) == 24
    assert names(fusion.plan([g1, g2], 84)) == [["g1", "g2"]]
    assert names(fusion.plan([ar("g1", (2, 3), kind=ops.ALLGATHER, first_dims=[2, 3]),
                              ar("g2", (1, 3), kind=ops.ALLGATHER, first_dims=[1, 1])], 83)) == [["g1"], ["g2"]]
    fused = fusion.plan([g1, g2], MIB)[0]
    assert fused.first_dims == [[2, 3], [1, 1]]


def test_response_bytes_by_dtype():
    assert fusion.response_bytes(ar("a", (10,), "uint8")) == 10
    assert fusion.response_bytes(ar("a", (10,), "float64")) == 80
    assert fusion.response_bytes(ar("a", (0, 3), "float64")) == 0
    assert fusion.response_bytes(ar("a", (), "int32")) == 4
    # bfloat16 is staged as float32 in the fusion buffer
    assert fusion.response_bytes(ar("a", (10,), "bfloat16")) == 40


def test_plan_is_deterministic():
    def mk():
        return [ar(f"t{i}", (i % 5 + 1,), ("float32", "float64")[i % 7 == 0]) for i in range(50)]
    assert names(fusion.plan(mk(), 64)) == names(fusion.plan(mk(), 64))


# ------------------------------------------------------------------------------------------------ validate
def req(rank, name="t", kind=ops.ALLREDUCE, dtype="float32", shape=(3,), op=ops.Sum, root=-1, pre=1.0, post=1.0,
        pset=0, group=None, splits=None, payload=None):
    return Request(rank=rank, name=name, kind=kind, dtype=dtype, shape=tuple(shape), op=op, root=root,
                   prescale=pre, postscale=post, process_set=pset, group=group, splits=splits, payload=payload)


@pytest.mark.parametrize("a,b,expected", [
    (dict(dtype="float32"), dict(dtype="int32"),
     "Mismatched data types: One rank had type float32, but another rank had type int32."),
    (dict(kind=ops.ALLREDUCE), dict(kind=ops.ALLGATHER),
     "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."),
    (dict(shape=(17, 17, 17)), dict(shape=(18, 18, 18)),
     "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 17, 17], but another rank sent a "
     "tensor of shape [18, 18, 18]."),
    (dict(kind=ops.ALLGATHER, shape=(2, 2)), dict(kind=ops.ALLGATHER, shape=(2, 2, 2)),
     "Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank 2, but another rank sent a tensor of "
     "rank 3."),
    (dict(kind=ops.ALLGATHER, shape=(4, 23)), dict(kind=ops.ALLGATHER, shape=(4, 57)),
     "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 23, but another rank "
     "sent a tensor with dimension 1 equal to 57."),
    (dict(kind=ops.BROADCAST, root=0), dict(kind=ops.BROADCAST, root=1),
     "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1."),
    (dict(pre=1.0), dict(pre=2.0), "Mismatched prescale and/or postscale factors"),
    (dict(post=1.0), dict(post=0.5), "Mismatched prescale and/or postscale factors"),
    (dict(op=ops.Sum), dict(op=ops.Max), "Mismatched reduction operation"),
    (dict(kind=ops.REDUCESCATTER, op=ops.Sum), dict(kind=ops.REDUCESCATTER, op=ops.Average),
     "Mismatched reduction operation"),
    (dict(kind=ops.REDUCESCATTER, shape=(4,)), dict(kind=ops.REDUCESCATTER, shape=(5,)),
     "Mismatched REDUCESCATTER tensor shapes"),
    (dict(kind=ops.BROADCAST, root=0, shape=(3,)), dict(kind=ops.BROADCAST, root=0, shape=(4,)),
     "Mismatched BROADCAST tensor shapes"),
    (dict(kind=ops.ALLTOALL, shape=(4, 2)), dict(kind=ops.ALLTOALL, shape=(4, 3)),
     "Mismatched ALLTOALL tensor shapes"),
    (dict(pset=0), dict(pset=1), "Mismatched process sets"),
])
def test_validate_mismatch_messages(a, b, expected):
    msg = validate("t", [req(0, **a), req(1, **b)])
    assert msg is not None and expected in msg, msg
    assert "'t'" in msg  # the tensor name is part of the message


def test_validate_accepts_agreeing_requests_and_allgather_first_dims():
    assert validate("t", [req(0), req(1), req(2)]) is None
    assert validate("t", [req(0, kind=ops.ALLGATHER, shape=(1, 3)), req(1, kind=ops.ALLGATHER, shape=(5, 3)),
                          req(2, kind=ops.ALLGATHER, shape=(0, 3))]) is None
    assert validate("t", [req(0, kind=ops.ALLTOALL, shape=(4, 2)), req(1, kind=ops.ALLTOALL, shape=(1, 2))]) is None
    assert validate("barrier.noname", [req(0, kind=ops.BARRIER, shape=()), req(1, kind=ops.BARRIER, shape=())]) is None


def test_validate_rank_zero_allgather():
    msg = validate("t", [req(0, kind=ops.ALLGATHER, shape=()), req(1, kind=ops.ALLGATHER, shape=())])
    assert msg is not None and "tried to ALLGATHER a rank-zero tensor" in msg


@pytest.mark.parametrize("kind,label", [(ops.ALLGATHER, "Allgather"), (ops.BROADCAST, "Broadcast"),
                                        (ops.ALLTOALL, "Alltoall"), (ops.REDUCESCATTER, "Reducescatter")])
def test_validate_join_unsupported_ops(kind, label):
    msg = validate("t", [req(1, kind=kind, shape=(4,), root=1), req(2, kind=kind, shape=(4,), root=1)], joined=[0])
    assert msg is not None and f"{label} is not supported with Join at this time" in msg
    assert validate("t", [req(1), req(2)], joined=[0]) is None  # allreduce is fine with joined ranks


# ------------------------------------------------------------------------------------------------ Coordinator
def test_coordinator_ready_only_when_every_rank_submitted():
    c = Coordinator(3)
    c.add(req(0, "a"))
    c.add(req(2, "a"))
    assert c.take_ready() == []
    c.add(req(1, "a"))
    out = c.take_ready()
    assert [r.names for r in out] == [["a"]] and out[0].kind == ops.ALLREDUCE and out[0].shapes == [(3,)]
    assert c.take_ready() == []  # taken once


def test_coordinator_orders_by_readiness_not_by_first_submission():
    c = Coordinator(2)
    c.add(req(0, "first"))
    c.add(req(0, "second"))
    c.add(req(1, "second"))
    c.add(req(1, "first"))
    assert [r.names for r in c.take_ready()] == [["second"], ["first"]]


def test_coordinator_mismatch_becomes_one_error_response():
    c = Coordinator(2)
    c.add(req(0, "a", dtype="float32"))
    c.add(req(1, "a", dtype="float64"))
    out = c.take_ready()
    assert len(out) == 1 and out[0].kind == ERROR and out[0].names == ["a"]
    assert "Mismatched data types" in out[0].error
    # the name is free again afterwards
    c.add(req(0, "a"))
    c.add(req(1, "a"))
    assert [r.kind for r in c.take_ready()] == [ops.ALLREDUCE]


def test_coordinator_duplicate_submission_is_an_error_not_a_hang():
    c = Coordinator(2)
    c.add(req(0, "a"))
    c.add(req(0, "a"))
    out = c.take_ready()
    assert len(out) == 1 and out[0].kind == ERROR and "twice" in out[0].error


def test_coordinator_unknown_process_set():
    c = Coordinator(2)
    c.add(req(1, "a", pset=7))
    out = c.take_ready()
    assert out[0].kind == ERROR and "7" in out[0].error


def test_coordinator_allgather_and_alltoall_metadata_in_set_rank_order():
    c = Coordinator(3)
    for r, rows in ((2, 5), (0, 1), (1, 0)):
        c.add(req(r, "g", kind=ops.ALLGATHER, shape=(rows, 2)))
    (g,) = c.take_ready()
    assert g.first_dims == [[1, 0, 5]]
    for r in (1, 0, 2):
        c.add(req(r, "x", kind=ops.ALLTOALL, shape=(3, 2), splits=(r, 1, 2 - r)))
    (x,) = c.take_ready()
    assert x.splits == [[[0, 1, 2], [1, 1, 1], [2, 1, 0]]]


def test_coordinator_groups_are_released_together():
    c = Coordinator(2)
    for r in (0, 1):
        c.add(req(r, "g_1of2", group=("g_1of2", 2)))
    assert c.take_ready() == []  # the other member is not ready yet
    c.add(req(0, "solo"))
    c.add(req(1, "solo"))
    c.add(req(0, "g_2of2", group=("g_1of2", 2)))
    c.add(req(1, "g_2of2", group=("g_1of2", 2)))
    assert [r.names for r in c.take_ready()] == [["solo"], ["g_1of2"], ["g_2of2"]]


def _group(c, rank, count, base="grouped_allreduce.g"):
    for i in range(1, count + 1):
        c.add(req(rank, f"{base}_{i}of{count}", group=(f"{base}_1of{count}", count)))


def test_coordinator_fails_a_group_whose_ranks_passed_different_counts_on_every_rank():
    # Issue 53: the members' names never meet, so without the check every rank waited for the stall inspector.
    c = Coordinator(3)
    _group(c, 0, 3)
    assert c.take_ready() == []
    _group(c, 2, 2)
    out = c.take_ready()
    failed = sorted(n for r in out for n in r.names)
    assert all(r.kind == ERROR for r in out) and failed == sorted(
        [f"grouped_allreduce.g_{i}of3" for i in (1, 2, 3)] + [f"grouped_allreduce.g_{i}of2" for i in (1, 2)])
    assert out[0].error == ("Mismatched grouped_allreduce group sizes (group 'grouped_allreduce.g'): rank 0 passed "
                            "3 tensors, but rank 2 passed 2 tensors (rank 1 had not called it yet). Every rank must "
                            "pass the same number of tensors to a grouped call; check how each rank builds its list.")
    # Rank 1 comes late, with either count or another one: it gets the error too, nothing stays pending.
    _group(c, 1, 4)
    late = c.take_ready()
    assert [r.kind for r in late] == [ERROR] * 4 and late[0].error == out[0].error
    assert all(not pset.pending for pset in c.sets.values())
    # The name is free again: the same group, agreed, runs (also while a rank still owes members of the old one).
    c2 = Coordinator(2)
    _group(c2, 0, 2)
    c2.add(req(1, "grouped_allreduce.g_1of1", group=("grouped_allreduce.g_1of1", 1)))
    assert {r.kind for r in c2.take_ready()} == {ERROR}
    for c_ in (c, c2):
        for rank in sorted(c_.sets[0].ranks):
            _group(c_, rank, 2)
        assert [r.kind for r in c_.take_ready()] == [ops.ALLREDUCE] * 2
    # Groups of equal counts and different names never meet, and a group with no rival is left alone.
    _group(c2, 0, 2, "grouped_allreduce.a")
    _group(c2, 1, 3, "grouped_allreduce.a_1of2_b")
    assert c2.take_ready() == []


def test_coordinator_join_excludes_joined_ranks_and_reports_last_joiner():
    c = Coordinator(3)
    c.add(req(0, "a"))
    c.add(req(1, "j", kind=ops.JOIN))
    c.add(req(2, "a"))
    out = c.take_ready()
    assert [r.names for r in out] == [["a"]] and out[0].joined == (1,)
    c.add(req(0, "j", kind=ops.JOIN))
    assert c.take_ready() == []
    c.add(req(2, "b"))  # 0 and 1 have joined: ready with 2 alone
    out = c.take_ready()
    assert [r.names for r in out] == [["b"]] and out[0].joined == (0, 1)
    c.add(req(2, "j", kind=ops.JOIN))
    out = c.take_ready()
    assert [r.kind for r in out] == [ops.JOIN] and out[0].last_joined == 2
    # join state is reset: the next tensor needs everyone again
    c.add(req(0, "c"))
    assert c.take_ready() == []


def test_coordinator_join_releases_tensors_waiting_only_for_the_joiner():
    c = Coordinator(2)
    c.add(req(0, "a"))
    c.add(req(1, "j", kind=ops.JOIN))
    out = c.take_ready()
    assert [r.names for r in out] == [["a"]] and out[0].joined == (1,)


def test_coordinator_process_sets_are_independent():
    c = Coordinator(4)
    c.register_set(1, [0, 2])
    c.register_set(2, [1, 3])
    c.add(req(0, "x", pset=1))
    c.add(req(1, "x", pset=2))
    c.add(req(2, "x", pset=1))
    out = c.take_ready()
    assert [(r.process_set, r.names) for r in out] == [(1, ["x"])]
    c.add(req(3, "x", pset=2))
    assert [(r.process_set, r.names) for r in c.take_ready()] == [(2, ["x"])]


def test_coordinator_same_name_on_two_sets_by_one_rank_is_an_error_for_everyone():
    c = Coordinator(3)
    c.register_set(1, [0, 1])
    c.add(req(0, "x", pset=0))
    c.add(req(2, "x", pset=0))
    c.add(req(1, "x", pset=1))  # rank 1 belongs to set 0, where "x" waits for it, but used set 1
    out = c.take_ready()
    assert {r.process_set for r in out} == {0, 1}, out
    assert all(r.kind == ERROR and "Mismatched process sets" in r.error for r in out)


def test_coordinator_add_and_remove_process_sets():
    c = Coordinator(3)
    for r in range(3):
        c.add(req(r, "add.0", kind=ops.ADD_PROCESS_SET, payload=[2, 0]))
    (resp,) = c.take_ready()
    set_id, ranks = resp.payload
    assert ranks == (0, 2) and set_id >= 1 and c.sets[set_id].ranks == (0, 2)
    for r in range(3):
        c.add(req(r, "add.1", kind=ops.ADD_PROCESS_SET, payload=[0, 2]))
    (dup,) = c.take_ready()
    assert dup.kind == ERROR and "already registered" in dup.error
    for r in range(3):
        c.add(req(r, "add.2", kind=ops.ADD_PROCESS_SET, payload=[0, 1] if r else [1, 2]))
    (bad,) = c.take_ready()
    assert bad.kind == ERROR and "Mismatched add_process_set" in bad.error
    for r in range(3):
        c.add(req(r, "rm.0", kind=ops.REMOVE_PROCESS_SET, payload=set_id))
    (rm,) = c.take_ready()
    assert rm.payload == (set_id, True) and set_id not in c.sets


def test_coordinator_stall_inspection_names_missing_ranks():
    c = Coordinator(4)
    c.add(req(0, "late"), now=100.0)
    c.add(req(2, "late"), now=100.5)
    c.add(req(1, "fresh"), now=109.0)
    stalled = c.stalled(now=110.0, older_than=5.0)
    assert stalled == [(0, "late", [1, 3], 10.0)]
    c.fail_stalled(now=110.0, older_than=5.0, reason="Stalled")
    out = c.take_ready()
    assert len(out) == 1 and out[0].kind == ERROR and out[0].names == ["late"] and "[1, 3]" in out[0].error
    assert c.stalled(now=200.0, older_than=5.0) == [(0, "fresh", [0, 2, 3], 91.0)]


def test_reduce_inline_matches_numpy():
    xs = [np.arange(5, dtype=np.int32) * (r + 1) - 3 for r in range(3)]
    reqs = [req(r, op=ops.Average, dtype="int32", shape=(5,), payload=x.tobytes()) for r, x in enumerate(xs)]
    got = np.frombuffer(negotiation.reduce_inline(reqs, [r.payload for r in reqs], 3), dtype=np.int32)
    assert got.tolist() == np.trunc(np.sum(xs, axis=0) / 3).astype(np.int32).tolist()
    reqs = [req(r, op=ops.Max, dtype="float64", shape=(5,), payload=x.astype(np.float64).tobytes())
            for r, x in enumerate(xs)]
    got = np.frombuffer(negotiation.reduce_inline(reqs, [r.payload for r in reqs], 3), dtype=np.float64)
    assert got.tolist() == np.max(xs, axis=0).astype(np.float64).tolist()


# ------------------------------------------------------------------------------------------------ ops helpers
def test_bfloat16_round_trip_and_rounding():
    vals = np.array([0.0, 1.0, -2.5, 3.140625, 1e-3, 65280.0, 1.00390625, 1.01171875], dtype=np.float32)
    bits = np.empty(vals.shape, np.uint16)
    ops.f32_to_bf16(vals, bits)
    back = np.empty(vals.shape, np.float32)
    ops.bf16_to_f32(bits, back)
    # exactly representable values survive; 1 + 2^-8 is a tie and rounds to even (1.0); 1 + 3*2^-8 rounds up
    assert back[:4].tolist() == [0.0, 1.0, -2.5, 3.140625]
    assert back[6] == 1.0 and back[7] == np.float32(1.015625)
    assert abs(back[4] - 1e-3) / 1e-3 < 2 ** -8
    nan = np.array([np.nan], np.float32)
    ops.f32_to_bf16(nan, bits[:1])
    ops.bf16_to_f32(bits[:1], back[:1])
    assert np.isnan(back[0])


def test_scale_inplace_truncates_integers_and_leaves_bool():
    x = np.array([5, -5, 7], dtype=np.int32)
    ops.scale_inplace(x, 1 / 3)
    assert x.tolist() == [1, -1, 2]
    b = np.array([True, False])
    ops.scale_inplace(b, 0.5)
    assert b.tolist() == [True, False]
    f = np.array([1.5], dtype=np.float16)
    ops.scale_inplace(f, 2.0)
    assert f.dtype == np.float16 and f.tolist() == [3.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.uint8, np.complex64])
@pytest.mark.parametrize("postscale,divisor", [(1.0, 3), (0.5, 3), (2.0, 1), (1.0, 2)])
def test_finish_copy_gives_the_bits_of_finishing_in_place(dtype, postscale, divisor):
    # A transport either finishes a reduced piece in place or while copying it out: both must equal the old
    # "reduce, then postscale, then divide the whole buffer" bit for bit (Average is a true division).
    rng = np.random.default_rng(7)
    src = (rng.uniform(-1000, 1000, 1001) * (1 if np.dtype(dtype).kind in "fc" else 0.1)).astype(dtype)
    expected = src.copy()
    ops.finish_reduction(expected, ops.Average if divisor > 1 else ops.Sum, postscale, divisor)
    finish = ops.finisher(ops.Average if divisor > 1 else ops.Sum, postscale, divisor)
    in_place, copied = src.copy(), np.empty_like(src)
    finish(in_place)
    finish.copyto(copied, src)
    assert in_place.tobytes() == expected.tobytes()
    assert copied.tobytes() == expected.tobytes()


def test_finisher_is_none_when_there_is_nothing_to_finish():
    assert ops.finisher(ops.Sum, 1.0, 4) is None
    assert ops.finisher(ops.Max, 1.0, 4) is None
    assert ops.finisher(ops.Average, 1.0, 1) is None
    assert ops.finisher(ops.Average, 1.0, 4) is not None
    assert ops.finisher(ops.Sum, 0.5, 4) is not None


def test_dtype_names():
    assert ops.dtype_name(np.zeros(1, np.int16)) == "int16"
    assert ops.dtype_name(np.zeros(1, np.uint16), "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="complex64 is not supported"):
        ops.dtype_name(np.zeros(1, np.complex64))


def test_reducescatter_split_rule():
    from horovod.engine.ops import split_rows

    assert split_rows(7, 3) == [3, 2, 2]
    assert split_rows(1, 4) == [1, 0, 0, 0]
    assert split_rows(0, 2) == [0, 0]
    assert split_rows(8, 4) == [2, 2, 2, 2]


# ------------------------------------------------------------------------------------------------ config
def test_config_defaults():
    cfg = config.load(env={})
    assert cfg.fusion_threshold == 128 * MIB
    assert cfg.cache_capacity == 1024
    assert cfg.stall_check_time_seconds == 60 and cfg.stall_shutdown_time_seconds == 0
    assert cfg.stall_check_disable is False
    assert cfg.gloo_timeout_seconds == 30
    assert cfg.timeline == "" and cfg.timeline_mark_cycles is False
    assert cfg.dynamic_process_sets is False
    assert cfg.log_level == "WARNING"
    assert cfg.fixed == frozenset()
    topo = cfg.topology
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (0, 1, 0, 1)
    assert topo.launched_by == "none" and topo.rendezvous_addr is None and topo.secret is None


def test_config_precedence_explicit_over_env_over_default():
    env = {"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "3.5"}
    cfg = config.load(env=env)
    assert cfg.fusion_threshold == MIB and cfg.cycle_time_ms == 3.5
    assert {"fusion_threshold", "cycle_time_ms"} <= cfg.fixed and "cache_capacity" not in cfg.fixed
    cfg = config.load(env=env, fusion_threshold=0)
    assert cfg.fusion_threshold == 0 and cfg.cycle_time_ms == 3.5 and "fusion_threshold" in cfg.fixed
    # an empty variable counts as unset
    cfg = config.load(env={"HOROVOD_FUSION_THRESHOLD": ""})
    assert cfg.fusion_threshold == 128 * MIB and "fusion_threshold" not in cfg.fixed


# 2 and -1 are refused since issue 53 (0.28.1 read them as on and off): tests/engine/test_config.py.
@pytest.mark.parametrize("raw,expected", [("1", True), ("0", False), ("true", True), ("True", True),
                                          ("yes", True), ("false", False), (" 1 ", True), ("0.0", False)])
def test_config_bool_parsing(raw, expected):
    assert config.load(env={"HOROVOD_TIMELINE_MARK_CYCLES": raw}).timeline_mark_cycles is expected


def test_config_numbers_and_strings():
    cfg = config.load(env={"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "0.25",
                           "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_TIMELINE": "/tmp/x.json",
                           "HOROVOD_LOG_LEVEL": "debug"})
    assert cfg.fusion_threshold == 64 * MIB and isinstance(cfg.fusion_threshold, int)
    assert cfg.cycle_time_ms == 0.25 and isinstance(cfg.cycle_time_ms, float)
    assert cfg.stall_check_time_seconds == 5
    assert cfg.timeline == "/tmp/x.json" and cfg.log_level == "debug"


@pytest.mark.parametrize("var,raw", [("HOROVOD_FUSION_THRESHOLD", "lots"), ("HOROVOD_CYCLE_TIME", "fast"),
                                     ("HOROVOD_TIMELINE_MARK_CYCLES", "maybe")])
def test_config_bad_values_name_the_variable(var, raw):
    with pytest.raises(ValueError) as info:
        config.load(env={var: raw})
    assert var in str(info.value) and raw in str(info.value)


def test_config_topology_from_launcher_and_from_mpirun():
    topo = config.topology_from_env({
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "h2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
        "_HOROVOD_SECRET_KEY": "00ff"})
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == \
        (3, 4, 1, 2, 1, 2)
    assert topo.hostname == "h2" and topo.rendezvous_addr == "10.0.0.1" and topo.rendezvous_port == 1234
    assert topo.secret == b"\x00\xff" and topo.launched_by == "horovodrun"
    mpi = config.topology_from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
                                    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (mpi.rank, mpi.size, mpi.local_rank, mpi.local_size, mpi.launched_by) == (2, 3, 0, 1, "mpirun")
    pmi = config.topology_from_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (pmi.rank, pmi.size, pmi.launched_by) == (1, 2, "mpirun")
    assert config.topology_from_env({"HOROVOD_GLOO_RENDEZVOUS_PORT": "-1"}).rendezvous_port is None


def test_knob_table_is_consistent_and_round_trips():
    seen_names, seen_env, seen_flags = set(), set(), set()
    for knob in config.KNOBS:
        assert knob.name not in seen_names
        seen_names.add(knob.name)
        if knob.env:
            assert knob.env.startswith("HOROVOD_") and knob.env not in seen_env
            seen_env.add(knob.env)
            assert config.parse_value(knob, config.env_value(knob, knob.default)) == knob.default, knob.name
        if knob.flag:
            assert knob.flag.startswith("--") and knob.flag not in seen_flags
            seen_flags.add(knob.flag)


def test_flag_and_config_values_become_environment():
    k = config.KNOBS_BY_NAME
    assert config.flag_to_env(k["fusion_threshold"], 32) == str(32 * MIB)  # --fusion-threshold-mb is in MiB
    assert config.flag_to_env(k["fusion_threshold"], 0) == "0"
    assert config.flag_to_env(k["cycle_time_ms"], 5) == "5.0"
    assert config.flag_to_env(k["timeline_mark_cycles"], True) == "1"
    # stall_check.enabled: false means HOROVOD_STALL_CHECK_DISABLE=1
    assert config.flag_to_env(k["stall_check_disable"], False) == "1"
    assert config.flag_to_env(k["stall_check_disable"], True) == "0"
    assert config.flag_to_env(k["log_hide_time"], False) == "1"
    assert config.flag_to_env(k["cycle_time_ms"], None) is None
    # and what the launcher exports parses back to the value the flag meant
    env = {"HOROVOD_FUSION_THRESHOLD": config.flag_to_env(k["fusion_threshold"], 32),
           "HOROVOD_STALL_CHECK_DISABLE": config.flag_to_env(k["stall_check_disable"], False)}
    cfg = config.load(env=env)
    assert cfg.fusion_threshold == 32 * MIB and cfg.stall_check_disable is True
