"""Collective conformance: every op x dtype x shape family on np = 1..4 ranks, over TCP and shared memory.

One ``run_ranks`` job per (np, transport) runs the whole matrix inside the workers: every rank regenerates all
ranks' inputs from their seeds, computes the expected result with numpy and returns the list of mismatches, so a
single job checks well over a thousand cases.  Ops are issued asynchronously in batches (as a training step
would), which also exercises negotiation order, tensor fusion and zero-size tensors inside fused buffers.

This is the engine's suite: its paths (inline and data plane, fusion and cycle knobs, two hosts), join, process
sets, objects, Adasum, shutdown and init again.  The same collectives through every binding's public API (numpy,
torch, TensorFlow, MXNet) are tests/conformance/test_collective_conformance.py.
"""
from __future__ import annotations

import pytest

from engine_helpers import (AVERAGE, DTYPES, MAX, MIN, NOT_INITIALIZED, PRODUCT, SUM, TRANSPORTS, Failures,
                            adasum_tree, assert_no_failures, compare, expected_reduce, input_for, logical_inputs, run,
                            scale_variants, split_rows, transport_skip_reason)

# Shape families.  Scalars are only legal for allreduce and broadcast.
SHAPES = [(), (0,), (0, 3), (3, 0), (1,), (7,), (5, 3), (2, 3, 2)]
BIG = (1 << 19,)  # 2 MiB of float32: more than one pipeline chunk, fused with nothing
OPS = (SUM, AVERAGE, MIN, MAX, PRODUCT)
KIND_OF = {SUM: "small", AVERAGE: "small", MIN: "wide", MAX: "wide", PRODUCT: "prod"}

# allgather: first dimension may differ per rank (rank 0 sometimes contributes nothing).
GATHER_SHAPES = {
    "zero": lambda r: (0,),
    "zero2d": lambda r: (0, 3),
    "one": lambda r: (1,),
    "mixed_empty": lambda r: (r % 3,),
    "growing": lambda r: (7 + r,),
    "rows2d": lambda r: (r + 1, 3),
    "zero_trailing": lambda r: (r + 2, 0),
    "rows3d": lambda r: (2 - r % 2, 2, 2),
}


def _alltoall_uneven(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to ``dst`` in the uneven case (some zero)."""
    return (src + 2 * dst) % 3


def conformance_worker(transport: str) -> dict:  # noqa: C901  (one long, flat script on purpose)
    import os

    import numpy as np

    import horovod.numpy as hvd
    from horovod.engine import collectives

    rank = int(os.environ["HOROVOD_RANK"])
    fails = Failures(rank)

    # -- before init: queries raise the documented ValueError ------------------------------------------
    for q in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"):
        fails.expect_raises(f"{q}() before init", ValueError, getattr(hvd, q), [NOT_INITIALIZED])
    fails.add(None if hvd.is_initialized() is False else "is_initialized() before init is not False")

    size_env = int(os.environ["HOROVOD_SIZE"])
    even = hvd.ProcessSet(list(range(0, size_env, 2)))
    hvd.init(process_sets=[even])
    size = hvd.size()
    fails.add(None if hvd.rank() == rank and size == size_env else f"rank/size {hvd.rank()}/{size}")
    fails.add(None if hvd.is_initialized() else "is_initialized() after init is not True")
    topology = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    ranks = list(range(size))

    def ar_submit(t, dtype, name, op, pre=1.0, post=1.0, inplace=False, pset=None):
        pset = pset if pset is not None else hvd.global_process_set
        opv = getattr(hvd, op)
        if dtype == "bfloat16":
            # bfloat16 has no numpy dtype, so the numpy binding cannot name it: use the engine API
            h = collectives.allreduce_async([t], [collectives.tensor_name("allreduce", name)], op=opv,
                                            prescale=pre, postscale=post, dtypes=["bfloat16"],
                                            outputs=[t if inplace else None], process_set=pset.process_set_id)
            return h.wait
        if inplace:
            hd = hvd.allreduce_async_(t, name=name, op=opv, prescale_factor=pre, postscale_factor=post,
                                      process_set=pset)
        else:
            hd = hvd.allreduce_async(t, name=name, op=opv, prescale_factor=pre, postscale_factor=post,
                                     process_set=pset)
        return lambda: hvd.synchronize(hd)

    def collect(pending):
        """pending: list of (label, waiter, check(result) -> Optional[str])."""
        for label, waiter, check in pending:
            try:
                result = waiter()
            except Exception as exc:  # noqa: BLE001
                fails.error(label, exc)
                continue
            try:
                fails.add(check(result))
            except Exception as exc:  # noqa: BLE001
                fails.error(label + " (check)", exc)

    def submit(pending, label, make, check):
        try:
            pending.append((label, make(), check))
        except Exception as exc:  # noqa: BLE001
            fails.error(label + " (submit)", exc)

    # -- allreduce: op x dtype x shape, plus scale factors -----------------------------------------------
    for dtype in DTYPES:
        pending = []
        for shape in SHAPES:
            for op in OPS:
                for pre, post in scale_variants(op, dtype):
                    key = ("ar", dtype, str(shape), op, pre)
                    label = f"allreduce {op} {dtype} {shape} pre={pre} post={post}"
                    kind = KIND_OF[op]
                    t = input_for(key, rank, shape, dtype, kind)
                    want = expected_reduce(logical_inputs(key, ranks, lambda r: shape, dtype, kind), op, dtype,
                                           size, pre, post)
                    submit(pending, label,
                           lambda t=t, dtype=dtype, op=op, pre=pre, post=post, label=label:
                           ar_submit(t, dtype, label.replace(" ", "_"), op, pre, post),
                           lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
        collect(pending)

    # integer sums wrap around like C integer arithmetic, on the inline and on the data-plane path alike
    pending = []
    for dtype, lo, hi in (("int8", 60, 127), ("uint8", 100, 255), ("int16", 20000, 32767)):
        for n in (5, 5000):
            key = ("wrap", dtype, n)
            stored = [np.random.default_rng([r, n]).integers(lo, hi, n).astype(dtype) for r in ranks]
            want = np.sum([x.astype(np.int64) for x in stored], axis=0).astype(dtype).astype(np.int64)
            label = f"allreduce Sum {dtype} wraps ({n} elements)"
            submit(pending, label, lambda t=stored[rank], dtype=dtype, label=label:
                   ar_submit(t, dtype, label.replace(" ", "_"), SUM),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
    collect(pending)

    # in place (named and unnamed), and one few-MB tensor per float dtype
    pending = []
    for dtype in DTYPES:
        for shape in ((), (5, 3), (0,)):
            key = ("ar_", dtype, str(shape))
            t = input_for(key, rank, shape, dtype)
            want = expected_reduce(logical_inputs(key, ranks, lambda r: shape, dtype), SUM, dtype, size)
            label = f"allreduce_ Sum {dtype} {shape}"

            def check(res, t=t, want=want, label=label, dtype=dtype):
                if res is not t:
                    return f"{label}: in-place op returned a different array"
                return compare(label, t, want, dtype)

            submit(pending, label, lambda t=t, dtype=dtype: ar_submit(t, dtype, None, SUM, inplace=True), check)
    # inputs that are not C-contiguous are reduced as their logical values
    base = input_for(("noncontig",), rank, (6, 4), "float64")
    want_base = expected_reduce(logical_inputs(("noncontig",), ranks, lambda r: (6, 4), "float64"), SUM, "float64",
                                size)
    for label, view, want in (("transposed", base.T, want_base.T), ("strided", base[::2, 1:3], want_base[::2, 1:3]),
                              ("fortran", np.asfortranarray(base), want_base)):
        submit(pending, f"allreduce of a {label} view",
               lambda view=view: (lambda h: lambda: hvd.synchronize(h))(
                   hvd.allreduce_async(view, op=hvd.Sum, name=f"noncontig_{label}")),
               lambda res, want=want, label=label: compare(f"allreduce of a {label} view", res, want, "float64"))
    # deprecated average= argument
    for average, op in ((True, AVERAGE), (False, SUM)):
        key = ("average_arg", average)
        t = input_for(key, rank, (3,), "float32")
        want = expected_reduce(logical_inputs(key, ranks, lambda r: (3,), "float32"), op, "float32", size)
        label = f"allreduce(average={average})"

        def make(t=t, average=average, label=label):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                h = hvd.allreduce_async(t, average=average, name=label)
            fails.add(None if isinstance(hvd.poll(h), bool) else "poll() did not return a bool")
            return lambda: hvd.synchronize(h)

        submit(pending, label, make, lambda res, want=want, label=label: compare(label, res, want, "float32"))
    for dtype in ("float32", "float64", "bfloat16", "int32"):
        for op in (SUM, AVERAGE):
            key = ("big", dtype, op)
            t = input_for(key, rank, BIG, dtype)
            want = expected_reduce(logical_inputs(key, ranks, lambda r: BIG, dtype), op, dtype, size)
            label = f"allreduce {op} {dtype} big {BIG}"
            submit(pending, label, lambda t=t, dtype=dtype, op=op, label=label: ar_submit(t, dtype, label, op),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
    collect(pending)

    # -- grouped allreduce (mixed shapes, mixed dtypes, in place) ------------------------------------------
    pending = []
    group_shapes = [(3,), (), (0,), (4, 2), (1,), (2, 0)]
    for dtype in DTYPES:
        if dtype == "bfloat16":
            continue  # the numpy binding has no bfloat16; the engine-level group is covered below
        for op in (SUM, AVERAGE, MAX):
            key = ("gar", dtype, op)
            ts = [input_for(key + (i,), rank, s, dtype, KIND_OF[op]) for i, s in enumerate(group_shapes)]
            wants = [expected_reduce(logical_inputs(key + (i,), ranks, lambda r, s=s: s, dtype, KIND_OF[op]), op,
                                     dtype, size) for i, s in enumerate(group_shapes)]
            label = f"grouped_allreduce {op} {dtype}"

            def check(res, wants=wants, label=label, dtype=dtype):
                if len(res) != len(wants):
                    return f"{label}: {len(res)} results for {len(wants)} tensors"
                for i, (r_, w) in enumerate(zip(res, wants)):
                    msg = compare(f"{label}[{i}]", r_, w, dtype)
                    if msg:
                        return msg
                return None

            submit(pending, label, lambda ts=ts, op=op, label=label: (lambda h: lambda: hvd.synchronize(h))(
                hvd.grouped_allreduce_async(ts, name=label.replace(" ", "_"), op=getattr(hvd, op))), check)
    # mixed dtypes in one group, in place
    mixed = [("int32", (4,)), ("float64", (2, 2)), ("uint8", (0,)), ("float16", ()), ("bool", (3,))]
    ts = [input_for(("gmix", i), rank, s, d) for i, (d, s) in enumerate(mixed)]
    wants = [expected_reduce(logical_inputs(("gmix", i), ranks, lambda r, s=s: s, d), SUM, d, size)
             for i, (d, s) in enumerate(mixed)]

    def check_mixed(res, ts=ts, wants=wants):
        for i, ((d, _), r_, w, t) in enumerate(zip(mixed, res, wants, ts)):
            if r_ is not t:
                return f"grouped_allreduce_ mixed[{i}]: not in place"
            msg = compare(f"grouped_allreduce_ mixed[{i}] {d}", r_, w, d)
            if msg:
                return msg
        return None

    submit(pending, "grouped_allreduce_ mixed dtypes", lambda: (lambda h: lambda: hvd.synchronize(h))(
        hvd.grouped_allreduce_async_(ts, op=hvd.Sum)), check_mixed)
    # engine-level bfloat16 group
    bts = [input_for(("gbf", i), rank, s, "bfloat16") for i, s in enumerate(group_shapes)]
    bwants = [expected_reduce(logical_inputs(("gbf", i), ranks, lambda r, s=s: s, "bfloat16"), AVERAGE,
                              "bfloat16", size) for i, s in enumerate(group_shapes)]
    bts.append(input_for(("gbf", "scalar"), rank, (), "bfloat16"))
    bwants.append(expected_reduce(logical_inputs(("gbf", "scalar"), ranks, lambda r: (), "bfloat16"), AVERAGE,
                                  "bfloat16", size))
    names, _ = collectives.group_names("grouped_allreduce", "bf16group", len(bts))

    def check_bf(res):
        for i, (r_, w) in enumerate(zip(res, bwants)):
            msg = compare(f"grouped bfloat16 [{i}]", r_, w, "bfloat16")
            if msg:
                return msg
        return None

    submit(pending, "grouped allreduce bfloat16",
           lambda: collectives.allreduce_async(bts, names, op=hvd.Average, dtypes=["bfloat16"] * len(bts),
                                               grouped=True).wait, check_bf)
    # an empty group completes immediately
    submit(pending, "grouped_allreduce of no tensors", lambda: (lambda h: lambda: hvd.synchronize(h))(
        hvd.grouped_allreduce_async([], name="empty_group")),
        lambda res: None if list(res) == [] else f"empty group returned {res!r}")
    collect(pending)

    # -- allgather ---------------------------------------------------------------------------------------
    def ag_submit(t, dtype, name, pset=None):
        pset = pset if pset is not None else hvd.global_process_set
        if dtype == "bfloat16":
            return collectives.allgather_async([t], [collectives.tensor_name("allgather", name)],
                                               dtypes=["bfloat16"], process_set=pset.process_set_id).wait
        hd = hvd.allgather_async(t, name=name, process_set=pset)
        return lambda: hvd.synchronize(hd)

    pending = []
    for dtype in DTYPES:
        for fam, shape_of in GATHER_SHAPES.items():
            key = ("ag", dtype, fam)
            t = input_for(key, rank, shape_of(rank), dtype)
            want = np.concatenate(logical_inputs(key, ranks, shape_of, dtype), axis=0)
            label = f"allgather {dtype} {fam}"
            submit(pending, label, lambda t=t, dtype=dtype, label=label: ag_submit(t, dtype, label.replace(" ", "_")),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype, True))
    key = ("ag_big",)
    big_rows = lambda r: (BIG[0] // 4 + 1000 * r, 2)  # noqa: E731  (~2 MiB per rank, uneven)
    t = input_for(key, rank, big_rows(rank), "float32")
    want = np.concatenate(logical_inputs(key, ranks, big_rows, "float32"), axis=0)
    submit(pending, "allgather big", lambda t=t: ag_submit(t, "float32", "ag_big"),
           lambda res, want=want: compare("allgather big", res, want, "float32", True))
    # grouped allgather: members with different per-rank first dims and dtypes
    gshapes = [GATHER_SHAPES["growing"], GATHER_SHAPES["mixed_empty"], GATHER_SHAPES["rows2d"],
               GATHER_SHAPES["zero"]]
    for dtype in ("float32", "int8", "bool", "float64"):
        key = ("gag", dtype)
        ts = [input_for(key + (i,), rank, f(rank), dtype) for i, f in enumerate(gshapes)]
        wants = [np.concatenate(logical_inputs(key + (i,), ranks, f, dtype), axis=0) for i, f in enumerate(gshapes)]
        label = f"grouped_allgather {dtype}"

        def check(res, wants=wants, label=label, dtype=dtype):
            if len(res) != len(wants):
                return f"{label}: {len(res)} results for {len(wants)} tensors"
            for i, (r_, w) in enumerate(zip(res, wants)):
                msg = compare(f"{label}[{i}]", r_, w, dtype, True)
                if msg:
                    return msg
            return None

        submit(pending, label, lambda ts=ts: (lambda h: lambda: hvd.synchronize(h))(
            hvd.grouped_allgather_async(ts)), check)
    collect(pending)

    # -- broadcast: every root, every dtype and shape; in place ---------------------------------------
    def bc_submit(t, dtype, name, root, inplace=False, pset=None):
        pset = pset if pset is not None else hvd.global_process_set
        if dtype == "bfloat16":  # see ar_submit
            return collectives.broadcast_async([t], [collectives.tensor_name("broadcast", name)], root,
                                               outputs=[t if inplace else t.copy()], dtypes=["bfloat16"],
                                               process_set=pset.process_set_id).wait
        if inplace:
            hd = hvd.broadcast_async_(t, root, name=name, process_set=pset)
        else:
            hd = hvd.broadcast_async(t, root, name=name, process_set=pset)
        return lambda: hvd.synchronize(hd)

    pending = []
    for dtype in DTYPES:
        for shape in SHAPES:
            for root in ranks:
                key = ("bc", dtype, str(shape), root)
                t = input_for(key, rank, shape, dtype, "wide")
                want = logical_inputs(key, [root], lambda r: shape, dtype, "wide")[0]
                before = t.copy()
                label = f"broadcast {dtype} {shape} root={root}"

                def check(res, t=t, before=before, want=want, label=label, dtype=dtype):
                    if not np.array_equal(t, before):
                        return f"{label}: the input array was modified by an out-of-place broadcast"
                    return compare(label, res, want, dtype, True)

                submit(pending, label, lambda t=t, dtype=dtype, root=root, label=label:
                       bc_submit(t, dtype, label.replace(" ", "_"), root), check)
        if dtype in ("float32", "uint8"):
            key = ("bc_big", dtype)
            root = size // 2
            t = input_for(key, rank, BIG, dtype, "wide")
            want = logical_inputs(key, [root], lambda r: BIG, dtype, "wide")[0]
            label = f"broadcast big {dtype}"
            submit(pending, label, lambda t=t, dtype=dtype, root=root, label=label:
                   bc_submit(t, dtype, label.replace(" ", "_"), root),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype, True))
        root = size - 1
        key = ("bc_", dtype)
        t = input_for(key, rank, (5, 3), dtype, "wide")
        want = logical_inputs(key, [root], lambda r: (5, 3), dtype, "wide")[0]
        label = f"broadcast_ {dtype} root={root}"

        def check_inplace(res, t=t, want=want, label=label, dtype=dtype):
            if res is not t:
                return f"{label}: in-place broadcast returned a different array"
            return compare(label, t, want, dtype, True)

        submit(pending, label, lambda t=t, dtype=dtype, root=root: bc_submit(t, dtype, None, root, inplace=True),
               check_inplace)
    collect(pending)

    # -- alltoall: even (no splits) and uneven splits with received splits ----------------------------------
    def a2a_submit(t, dtype, name, splits, pset=None):
        pset = pset if pset is not None else hvd.global_process_set
        if dtype == "bfloat16":
            return collectives.alltoall_async(t, collectives.tensor_name("alltoall", name), splits,
                                              process_set=pset.process_set_id, dtype="bfloat16").wait
        hd = hvd.alltoall_async(t, splits=splits, name=name, process_set=pset)
        return lambda: hvd.synchronize(hd)

    pending = []
    for dtype in DTYPES:
        for trailing in ((), (3,), (0,), (2, 2)):
            for mode in ("even0", "even1", "even2", "uneven"):
                if mode == "uneven":
                    rows_of = lambda r: sum(_alltoall_uneven(r, p) for p in ranks)  # noqa: E731
                    splits = [_alltoall_uneven(rank, p) for p in ranks]
                    sent = lambda src, dst: _alltoall_uneven(src, dst)  # noqa: E731
                else:
                    k = int(mode[-1])
                    rows_of = lambda r, k=k: k * size  # noqa: E731
                    splits = None
                    sent = lambda src, dst, k=k: k  # noqa: E731
                key = ("a2a", dtype, str(trailing), mode)
                t = input_for(key, rank, (rows_of(rank),) + trailing, dtype, "wide")
                parts = []
                for src in ranks:
                    x = logical_inputs(key, [src], lambda r: (rows_of(r),) + trailing, dtype, "wide")[0]
                    start = sum(sent(src, d) for d in range(rank))
                    parts.append(x[start:start + sent(src, rank)])
                want = np.concatenate(parts, axis=0)
                want_splits = [sent(src, rank) for src in ranks]
                label = f"alltoall {dtype} {trailing} {mode}"

                def check(res, want=want, want_splits=want_splits, label=label, dtype=dtype):
                    out, recv = res  # synchronize() of an alltoall handle gives (output, received_splits)
                    if [int(v) for v in np.asarray(recv).ravel()] != want_splits:
                        return f"{label}: received splits {list(np.asarray(recv).ravel())}, expected {want_splits}"
                    return compare(label, out, want, dtype, True)

                submit(pending, label, lambda t=t, dtype=dtype, label=label, splits=splits:
                       a2a_submit(t, dtype, label.replace(" ", "_"), splits), check)
    key = ("a2a_big",)
    big_sent = lambda src, dst: 20000 + 1000 * ((src + dst) % 3)  # noqa: E731  (~2 MiB per rank in total)
    t = input_for(key, rank, (sum(big_sent(rank, p) for p in ranks), 4), "float32")
    parts = []
    for src in ranks:
        x = logical_inputs(key, [src], lambda r: (sum(big_sent(r, p) for p in ranks), 4), "float32")[0]
        start = sum(big_sent(src, d) for d in range(rank))
        parts.append(x[start:start + big_sent(src, rank)])
    want = np.concatenate(parts, axis=0)
    submit(pending, "alltoall big", lambda t=t: a2a_submit(t, "float32", "a2a_big", [big_sent(rank, p) for p in ranks]),
           lambda res, want=want: compare("alltoall big", res[0], want, "float32", True))
    collect(pending)
    # the blocking form returns only the output without splits, (output, received_splits) with them
    try:
        t = np.arange(2 * size, dtype=np.int64) + 100 * rank
        out = hvd.alltoall(t, name="a2a_sync_even")
        want = np.concatenate([np.arange(2 * size)[2 * rank:2 * rank + 2] + 100 * r for r in ranks])
        fails.add(compare("alltoall blocking, no splits", out, want, "int64", True))
        out, recv = hvd.alltoall(t, splits=[2] * size, name="a2a_sync_splits")
        fails.add(compare("alltoall blocking, splits", out, want, "int64", True))
        fails.add(None if list(np.asarray(recv)) == [2] * size else f"alltoall blocking received splits {recv}")
    except Exception as exc:  # noqa: BLE001
        fails.error("alltoall blocking", exc)

    # -- reducescatter: uneven first dims (lower ranks get the extra rows) ---------------------------------
    def rs_submit(t, dtype, name, op, pre=1.0, post=1.0, pset=None):
        pset = pset if pset is not None else hvd.global_process_set
        if dtype == "bfloat16":
            return collectives.reducescatter_async([t], [collectives.tensor_name("reducescatter", name)],
                                                   op=getattr(hvd, op), prescale=pre, postscale=post,
                                                   dtypes=["bfloat16"], process_set=pset.process_set_id).wait
        hd = hvd.reducescatter_async(t, name=name, op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post,
                                     process_set=pset)
        return lambda: hvd.synchronize(hd)

    rs_shapes = [(0,), (0, 3), (3, 0), (1,), (7,), (5, 3), (2 * size + 1, 2), (size, 2, 2)]
    pending = []
    for dtype in DTYPES:
        for shape in rs_shapes:
            for op in (SUM, AVERAGE):
                for pre, post in scale_variants(op, dtype):
                    key = ("rs", dtype, str(shape), op, pre)
                    t = input_for(key, rank, shape, dtype)
                    full = expected_reduce(logical_inputs(key, ranks, lambda r: shape, dtype), op, dtype, size,
                                           pre, post)
                    sp = split_rows(shape[0], size)
                    start = sum(sp[:rank])
                    want = full[start:start + sp[rank]]
                    label = f"reducescatter {op} {dtype} {shape} pre={pre}"
                    submit(pending, label, lambda t=t, dtype=dtype, op=op, pre=pre, post=post, label=label:
                           rs_submit(t, dtype, label.replace(" ", "_"), op, pre, post),
                           lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
    for dtype in ("float32", "bfloat16"):
        key = ("rs_big", dtype)
        shape = (BIG[0] // 4 + 3, 4)
        t = input_for(key, rank, shape, dtype)
        full = expected_reduce(logical_inputs(key, ranks, lambda r: shape, dtype), SUM, dtype, size)
        sp = split_rows(shape[0], size)
        want = full[sum(sp[:rank]):sum(sp[:rank]) + sp[rank]]
        label = f"reducescatter big {dtype}"
        submit(pending, label, lambda t=t, dtype=dtype, label=label: rs_submit(t, dtype, label.replace(" ", "_"), SUM),
               lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
    # grouped reducescatter
    gshapes_rs = [(7,), (size, 3), (1,), (0, 2)]
    for dtype in ("float32", "int64", "float16"):
        key = ("grs", dtype)
        ts = [input_for(key + (i,), rank, s, dtype) for i, s in enumerate(gshapes_rs)]
        wants = []
        for i, s in enumerate(gshapes_rs):
            full = expected_reduce(logical_inputs(key + (i,), ranks, lambda r, s=s: s, dtype), AVERAGE, dtype, size)
            sp = split_rows(s[0], size)
            wants.append(full[sum(sp[:rank]):sum(sp[:rank]) + sp[rank]])
        label = f"grouped_reducescatter {dtype}"

        def check(res, wants=wants, label=label, dtype=dtype):
            if len(res) != len(wants):
                return f"{label}: {len(res)} results for {len(wants)} tensors"
            for i, (r_, w) in enumerate(zip(res, wants)):
                msg = compare(f"{label}[{i}]", r_, w, dtype)
                if msg:
                    return msg
            return None

        submit(pending, label, lambda ts=ts: (lambda h: lambda: hvd.synchronize(h))(
            hvd.grouped_reducescatter_async(ts, op=hvd.Average)), check)
    collect(pending)

    # -- Adasum: power-of-two worlds compare with the pairwise formula; other sizes refuse -------------------
    if size & (size - 1) == 0:
        for dtype in ("float32", "float64"):
            key = ("adasum", dtype)
            t = input_for(key, rank, (11,), dtype, "normal")
            want = adasum_tree(logical_inputs(key, ranks, lambda r: (11,), dtype, "normal"))
            try:
                res = hvd.allreduce(t, op=hvd.Adasum, name=f"adasum_{dtype}")
                fails.add(compare(f"Adasum {dtype}", res, want, dtype))
            except Exception as exc:  # noqa: BLE001
                fails.error(f"Adasum {dtype}", exc)
    else:
        fails.expect_raises("Adasum on a non-power-of-two world", NotImplementedError,
                            lambda: hvd.allreduce(np.ones(3, np.float32), op=hvd.Adasum, name="adasum_np3"))

    # -- barrier, objects ---------------------------------------------------------------------------------
    try:
        for _ in range(3):
            hvd.barrier()
        fails.add(None)
    except Exception as exc:  # noqa: BLE001
        fails.error("barrier", exc)
    for root in ranks:
        try:
            obj = {"root": rank, "payload": list(range(rank * 3)), "text": "x" * (100 * rank)}
            got = hvd.broadcast_object(obj, root_rank=root, name=f"obj{root}")
            want = {"root": root, "payload": list(range(root * 3)), "text": "x" * (100 * root)}
            fails.add(None if got == want else f"broadcast_object root={root}: {got!r}")
        except Exception as exc:  # noqa: BLE001
            fails.error(f"broadcast_object root={root}", exc)
    try:
        got = hvd.broadcast_object(None if rank else {"k": 1}, root_rank=0, name="named_none")
        fails.add(None if got == {"k": 1} else f"broadcast_object with non-root None: {got!r}")
        got = hvd.allgather_object((rank, "r" * rank, [rank] * rank))
        want = [(r, "r" * r, [r] * r) for r in ranks]
        fails.add(None if got == want else f"allgather_object: {got!r}")
    except Exception as exc:  # noqa: BLE001
        fails.error("object collectives", exc)

    # -- join: joined ranks contribute zeros, Average still divides by the set size ---------------------------
    try:
        steps = []
        for k in range(rank + 1):
            for dtype, op in (("float32", AVERAGE), ("int32", AVERAGE), ("float64", SUM)):
                key = ("join", k, dtype, op)
                t = input_for(key, rank, (4, 2), dtype)
                steps.append((k, dtype, op, key, hvd.allreduce_async(t, name=f"join_step_{k}_{dtype}_{op}",
                                                                     op=getattr(hvd, op))))
            # a grouped op while others have joined
            key = ("joing", k)
            g = [input_for(key + (i,), rank, s, "float32") for i, s in enumerate([(3,), (2, 2)])]
            steps.append((k, "float32", "group", key, hvd.grouped_allreduce_async(g, name=f"join_group_{k}",
                                                                                    op=hvd.Sum)))
        # Wait for this rank's own ops first: step k completes only once every rank < k joined, so ranks
        # join in rank order and the last joiner is size - 1 deterministically.
        results = [hvd.synchronize(h) for *_, h in steps]
        last = hvd.join()
        fails.add(None if last == size - 1 else f"join returned {last}, expected the last joiner {size - 1}")
        for (k, dtype, op, key, _), res in zip(steps, results):
            active = [r for r in ranks if r >= k]
            if op == "group":
                for i, s in enumerate([(3,), (2, 2)]):
                    want = expected_reduce(logical_inputs(key + (i,), active, lambda r, s=s: s, "float32"), SUM,
                                           "float32", size)
                    fails.add(compare(f"join step {k} group[{i}]", res[i], want, "float32"))
                continue
            xs = logical_inputs(key, active, lambda r: (4, 2), dtype)
            xs += [np.zeros_like(xs[0])] * (size - len(active))
            want = expected_reduce(xs, op, dtype, size)
            fails.add(compare(f"join step {k} {op} {dtype}", res, want, dtype))
        # join twice in a row works (state resets)
        last = hvd.join()
        fails.add(None if 0 <= last < size else f"second join returned {last}")
    except Exception as exc:  # noqa: BLE001
        fails.error("join", exc)

    # -- process sets: static (init) and dynamic (add/remove) ------------------------------------------
    def check_set(ps, tag):
        members = list(ps.ranks)
        n = len(members)
        if rank not in members:
            fails.add(None if ps.included() is False else f"{tag}: included() should be False")
            fails.expect_raises(f"{tag}: allreduce by non-member", ValueError,
                                lambda: hvd.allreduce(np.ones(2), name=f"{tag}_nonmember", process_set=ps),
                                [f"Rank {rank} is not a member of the provided process set"])
            return
        me = members.index(rank)
        fails.add(None if (ps.size(), ps.rank(), ps.included()) == (n, me, True) else
                  f"{tag}: size/rank/included {ps.size()}/{ps.rank()}/{ps.included()}")
        pend = []
        for dtype in ("float32", "int32", "bfloat16", "uint8"):
            for op in (SUM, AVERAGE, MAX):
                key = (tag, "ar", dtype, op)
                t = input_for(key, rank, (6,), dtype, KIND_OF[op])
                want = expected_reduce(logical_inputs(key, members, lambda r: (6,), dtype, KIND_OF[op]), op, dtype, n)
                label = f"{tag} allreduce {op} {dtype}"
                submit(pend, label, lambda t=t, dtype=dtype, op=op, label=label:
                       ar_submit(t, dtype, label.replace(" ", "_"), op, pset=ps),
                       lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
            key = (tag, "ag", dtype)
            f = lambda r: (r % 2 + 1, 2)  # noqa: E731
            t = input_for(key, rank, f(rank), dtype)
            want = np.concatenate(logical_inputs(key, members, f, dtype))
            label = f"{tag} allgather {dtype}"
            submit(pend, label, lambda t=t, dtype=dtype, label=label: ag_submit(t, dtype, label.replace(" ", "_"), ps),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype, True))
            root = members[-1]
            key = (tag, "bc", dtype)
            t = input_for(key, rank, (3,), dtype, "wide")
            want = logical_inputs(key, [root], lambda r: (3,), dtype, "wide")[0]
            label = f"{tag} broadcast {dtype} root={root}"
            submit(pend, label, lambda t=t, dtype=dtype, root=root, label=label:
                   bc_submit(t, dtype, label.replace(" ", "_"), root, pset=ps),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype, True))
            key = (tag, "rs", dtype)
            shape = (2 * n + 1, 2)
            t = input_for(key, rank, shape, dtype)
            full = expected_reduce(logical_inputs(key, members, lambda r: shape, dtype), AVERAGE, dtype, n)
            sp = split_rows(shape[0], n)
            want = full[sum(sp[:me]):sum(sp[:me]) + sp[me]]
            label = f"{tag} reducescatter {dtype}"
            submit(pend, label, lambda t=t, dtype=dtype, label=label:
                   rs_submit(t, dtype, label.replace(" ", "_"), AVERAGE, pset=ps),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res, want, dtype))
            key = (tag, "a2a", dtype)
            sent = lambda s, d: (members.index(s) + d + 1) % 3  # noqa: E731
            rows_of = lambda r: sum(sent(r, d) for d in range(n))  # noqa: E731
            t = input_for(key, rank, (rows_of(rank), 2), dtype)
            parts = []
            for src in members:
                x = logical_inputs(key, [src], lambda r: (rows_of(r), 2), dtype)[0]
                start = sum(sent(src, d) for d in range(me))
                parts.append(x[start:start + sent(src, me)])
            want = np.concatenate(parts)
            splits = [sent(rank, d) for d in range(n)]
            label = f"{tag} alltoall {dtype}"
            submit(pend, label, lambda t=t, dtype=dtype, label=label, splits=splits:
                   a2a_submit(t, dtype, label.replace(" ", "_"), splits, pset=ps),
                   lambda res, want=want, label=label, dtype=dtype: compare(label, res[0], want, dtype, True))
        collect(pend)
        try:
            hvd.barrier(process_set=ps)
            got = hvd.allgather_object(rank, process_set=ps)
            fails.add(None if got == members else f"{tag}: allgather_object {got}")
            got = hvd.broadcast_object(f"from {rank}", root_rank=members[0], process_set=ps)
            fails.add(None if got == f"from {members[0]}" else f"{tag}: broadcast_object {got!r}")
        except Exception as exc:  # noqa: BLE001
            fails.error(f"{tag} barrier/objects", exc)

    check_set(even, "static_even")
    fails.add(None if even.process_set_id == 1 else f"static set id {even.process_set_id}, expected 1")
    if size >= 2:
        try:
            odd = hvd.add_process_set(list(range(1, size, 2)))
            check_set(odd, "dynamic_odd")
            fails.expect_raises("add_process_set duplicate of a static set", ValueError,
                                lambda: hvd.add_process_set(list(range(0, size, 2))))
            fails.expect_raises("add_process_set of every rank (duplicate of the global set)", ValueError,
                                lambda: hvd.add_process_set(hvd.ProcessSet(ranks)))
            removed = hvd.remove_process_set(odd)
            fails.add(None if removed is True else f"remove_process_set returned {removed!r}")
            fails.add(None if odd.process_set_id is None else "removed set still has an id")
            fails.expect_raises("allreduce on a removed process set", ValueError,
                                lambda: hvd.allreduce(np.ones(2), name="removed", process_set=odd))
            fails.add(None if hvd.remove_process_set(hvd.global_process_set) is False else
                      "remove_process_set(global) is not False")
            again = hvd.add_process_set(hvd.ProcessSet(list(range(1, size, 2))))
            check_set(again, "dynamic_again")
            hvd.remove_process_set(again)
        except Exception as exc:  # noqa: BLE001
            fails.error("dynamic process sets", exc)

    # -- shutdown, then init again in the same process --------------------------------------------------
    try:
        hvd.shutdown()
        fails.add(None if hvd.is_initialized() is False else "is_initialized() after shutdown is not False")
        fails.expect_raises("rank() after shutdown", ValueError, hvd.rank, [NOT_INITIALIZED])
        fails.expect_raises("allreduce after shutdown", (ValueError, RuntimeError), lambda: hvd.allreduce(np.ones(2)))
        hvd.init()
        res = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum)
        fails.add(compare("allreduce after re-init", res, np.full(3, size * (size + 1) / 2), "float64"))
        res = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum)   # same auto name sequence on every rank
        fails.add(compare("second unnamed allreduce after re-init", res, np.full(3, size * (size + 1) / 2),
                          "float64"))
        hvd.shutdown()
        hvd.shutdown()  # idempotent
    except Exception as exc:  # noqa: BLE001
        fails.error("shutdown/init", exc)
    report = fails.report()
    report["topology"] = topology
    return report


# By default a lone blocking collective of at most 256 KiB on one shm host is agreed and reduced on the fast lane, and
# other allreduces of at most HOROVOD_INLINE_BYTES travel with their request and are reduced by the coordinator;
# with the lane off and 0 every tensor goes through fusion and the transport.  Both paths must agree with numpy.
DATA_PLANE = {"HOROVOD_INLINE_BYTES": "0", "HOROVOD_FAST_LANE": "0"}
PATHS = {"inline": {}, "data_plane": DATA_PLANE}


def _expected_topology(np_, hosts):
    """(local_rank, local_size, cross_rank, cross_size) per rank, as the launcher defines them."""
    hosts = hosts or ["localhost"] * np_
    out = []
    for rank, host in enumerate(hosts):
        local = [r for r in range(np_) if hosts[r] == host]
        order = list(dict.fromkeys(hosts))
        cross = [h for h in order if sum(1 for r in range(np_) if hosts[r] == h) > local.index(rank)]
        out.append((local.index(rank), len(local), cross.index(host), len(cross)))
    return out


def _run_matrix(np_, transport, extra_env, hosts=None):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    env.update(extra_env)
    reports = run(conformance_worker, np_, transport, args=(transport,), env=env, timeout=180, hosts=hosts)
    assert all(r["checked"] > 1000 for r in reports), [r["checked"] for r in reports]
    assert_no_failures(reports)
    assert [tuple(r["topology"]) for r in reports] == _expected_topology(np_, hosts)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collective_matrix(np_, transport, path):
    if np_ == 1 and transport != TRANSPORTS[0]:
        pytest.skip("a single rank runs on the local transport whatever HOROVOD_TRANSPORT says; covered once")
    _run_matrix(np_, transport, PATHS[path])


KNOB_VARIANTS = {
    # tiny fusion buffer: many fused responses of a few tensors, plus tensors larger than the buffer
    "fusion_512_bytes_cycle_5ms": (3, "tcp", {"HOROVOD_INLINE_BYTES": "0", "HOROVOD_FUSION_THRESHOLD": "512",
                                              "HOROVOD_CYCLE_TIME": "5"}),
    "fusion_disabled": (3, "shm", {**DATA_PLANE, "HOROVOD_FUSION_THRESHOLD": "0"}),
    "cycle_20ms": (4, "tcp", {"HOROVOD_INLINE_BYTES": "0", "HOROVOD_CYCLE_TIME": "20"}),
}


@pytest.mark.parametrize("variant", sorted(KNOB_VARIANTS))
def test_collective_matrix_under_fusion_and_cycle_knobs(variant):
    np_, transport, env = KNOB_VARIANTS[variant]
    _run_matrix(np_, transport, env)


def test_collective_matrix_on_two_hosts_with_the_automatic_transport():
    """Three ranks on one "host" and one on another (localhost vs 127.0.0.1): local/cross ranks differ per rank
    and the engine picks its multi-host data plane by itself."""
    _run_matrix(4, "auto", {"HOROVOD_INLINE_BYTES": "0"},
                hosts=["localhost", "localhost", "localhost", "127.0.0.1"])
