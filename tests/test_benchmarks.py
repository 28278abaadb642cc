"""The benchmarks package: every module imports, the targets are well-formed data that the evaluator reads as
meant, the charts draw, and the shared runner carries a real (tiny) sweep, transport comparison and big-result run
from launch to report."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"


def _modules():
    for root, dirs, files in os.walk(BENCH):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), REPO)[:-3].replace(os.sep, ".")
                yield rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


@pytest.mark.parametrize("module", list(_modules()))
def test_every_benchmark_module_imports_without_its_framework(module):
    # Frameworks (torch, tensorflow, jax, mpi4py, matplotlib) are imported inside the functions that use them, so
    # a numpy-only checkout can import (and --help) every benchmark.
    importlib.import_module(module)


def test_every_module_is_small():
    sizes = {}
    for module in _modules():
        path = os.path.join(REPO, *module.split(".")) + ".py"
        if not os.path.exists(path):
            path = os.path.join(REPO, *module.split("."), "__init__.py")
        with open(path, encoding="utf-8") as f:
            sizes[module] = sum(1 for _ in f)
    assert not {m: n for m, n in sizes.items() if n > 500}, f"split the benchmark modules over 500 lines: {sizes}"


def test_sizes_and_bus_factors():
    from benchmarks._lib.measure import bus_factor, format_size, parse_size, size_ladder, summarize

    assert [parse_size(s) for s in ("4096", "4K", "4KiB", "64M", "1.5G")] == [4096, 4096, 4096, 64 * MIB,
                                                                            3 << 29]
    assert format_size(64 * MIB) == "64 MiB" and format_size(8) == "8 B"
    assert size_ladder(4096, 64 * MIB, 16) == [4096, 65536, MIB, 16 * MIB, 64 * MIB]
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0
    with pytest.raises(ValueError, match="no bus factor"):
        bus_factor("gossip", 2)
    assert summarize([3.0, 1.0, 2.0])["median_s"] == 2.0
    with pytest.raises(ValueError):
        parse_size("lots")


def test_targets_are_well_formed_data():
    from benchmarks._collectives.cases import LABELS, LATENCY_PATTERNS, OPS
    from benchmarks._collectives.verdicts import EVALUATORS
    from benchmarks.targets import KINDS, TARGETS

    assert set(EVALUATORS) == set(KINDS), "every kind of target needs an evaluator, and only those"
    assert TARGETS and len(set(TARGETS)) == len(TARGETS), "targets are unique"
    for t in TARGETS:
        assert t.kind in KINDS, t
        assert t.np >= 2 and t.nbytes > 0, t
        assert f"{t.impl}-shm" in LABELS, f"{t}: no implementation family {t.impl!r}"
        if t.kind in ("busbw_ratio", "new_result", "fusion_gain"):
            assert t.at_least and t.at_least > 0, t
        if t.kind in ("busbw_ratio", "peer_sweep"):
            assert t.peer in LABELS, t
        if t.kind == "peer_sweep":
            assert t.ops and set(t.ops) <= set(OPS) and t.at_least and t.min_bytes > 0, t
        if t.kind == "latency":
            assert t.pattern in LATENCY_PATTERNS and t.at_most_s and t.at_most_s > 0, t


def _sweep(impl, op, np_, nbytes, seconds):
    return {"kind": "sweep", "impl": impl, "op": op, "np": np_, "bytes": nbytes, "median_s": seconds}


def test_targets_pass_and_fail_on_synthetic_results():
    from benchmarks._collectives.results import Results
    from benchmarks._collectives.verdicts import evaluate
    from benchmarks.targets import Target

    size = 64 * MIB
    res = Results([
        _sweep("engine-shm", "allreduce", 2, size, 0.010),   # 3× Gloo, 1.1× Open MPI
        _sweep("gloo", "allreduce", 2, size, 0.030),
        _sweep("openmpi", "allreduce", 2, size, 0.011),
        _sweep("engine-shm", "allreduce-new", 2, size, 0.0125),   # 80 % of in place
        {"kind": "latency", "impl": "engine-shm", "np": 2, "pattern": "back to back", "median_s": 50e-6},
        {"kind": "latency", "impl": "gloo", "np": 2, "pattern": "back to back", "median_s": 100e-6},
    ])
    rows = evaluate(res, "shm", [Target("busbw_ratio", peer="gloo", at_least=2.0),
                                 Target("busbw_ratio", peer="openmpi", at_least=1.2),
                                 Target("new_result", at_least=0.8),
                                 Target("latency", pattern="back to back", at_most_s=60e-6, times_faster=3.0),
                                 Target("fusion_gain", at_least=10.0),
                                 Target("busbw_ratio", np=4, peer="openmpi", at_least=0.5)])
    assert [r[-1] for r in rows] == ["PASS", "FAIL", "PASS", "FAIL", "n/a", "n/a"], rows
    assert "3.00×" in rows[0][1] and "not measured" in rows[4][1]


def test_peer_sweep_targets_hold_every_size_within_each_repetition():
    """Ours against a peer at every size, ratios taken within each repetition: the slowest size decides, sizes
    below ``min_bytes`` do not count, and 8 B comes from the latency phase."""
    from benchmarks._collectives.results import Results
    from benchmarks.targets import Target

    def rec(impl, nbytes, rep, seconds, kind="sweep"):
        r = {"kind": kind, "impl": impl, "np": 2, "bytes": nbytes, "rep": rep, "median_s": seconds}
        return {**r, "op": "allreduce"} if kind == "sweep" else {**r, "pattern": "back to back", "p90_s": seconds,
                                                                  "mean_s": seconds, "iters": 10}
    records = []
    for rep, drift in enumerate((1.0, 3.0, 1.5)):   # the machine slows down and recovers: both sides alike
        records += [rec("engine-shm", 4096, rep, 2e-3 * drift), rec("gloo", 4096, rep, 1e-3 * drift),  # 0.5×
                    rec("engine-shm", MIB, rep, 1e-3 * drift), rec("gloo", MIB, rep, 2e-3 * drift),    # 2×
                    rec("engine-shm", 8, rep, 10e-6 * drift, "latency"), rec("gloo", 8, rep, 30e-6 * drift,
                                                                              "latency")]              # 3×
    from benchmarks._collectives.verdicts import evaluate

    res = Results(records)
    assert res.ratio("allreduce", 2, MIB, "engine-shm", "gloo") == (2.0, 2.0, 2.0), "paired within each rep"
    rows = evaluate(res, "shm", [Target("peer_sweep", peer="gloo", at_least=1.0, ops=("allreduce", "broadcast")),
                                 Target("peer_sweep", peer="gloo", at_least=1.0, ops=("allreduce",),
                                        min_bytes=MIB)])
    assert [r[-1] for r in rows] == ["FAIL", "n/a", "PASS"], rows
    assert "slowest 0.50× at 4 KiB (3 sizes)" in rows[0][1] and "(1 sizes)" in rows[2][1], rows


def test_charts_draw_small_pngs_from_synthetic_tables(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import charts

    panels = {"allreduce, np = 2": {"ours": [(4096, 0.5), (MIB, 4.0), (64 * MIB, 11.0)],
                                    "theirs": [(4096, 0.05), (MIB, 0.9), (64 * MIB, 1.8)]},
              "allgather, np = 2": {"ours": [(4096, 0.4), (64 * MIB, 6.0)]}}
    paths = [charts.bandwidth(panels, str(tmp_path / "bw.png"), title="t", note="synthetic"),
             charts.bars({"back to back": {"ours": 20.0, "theirs": 110.0}}, str(tmp_path / "lat.png"), log=True),
             charts.throughput({"mlp": {"horovod": {"samples_per_sec": 600.0}, "ddp": {"failed": "x"}}},
                               {"horovod": "hvd", "ddp": "DDP"}, str(tmp_path / "sub" / "train.png"))]
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(PNG) and 2_000 < len(data) < 100_000, (path, len(data))
    with pytest.raises(ValueError, match="nothing to chart"):
        charts.bandwidth({}, str(tmp_path / "empty.png"))
    assert charts.sibling("out/c.png", "latency") == "out/c-latency.png"


def _run(args, timeout=120, env_extra=None):
    env = {**os.environ, "PYTHONPATH": REPO, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_collectives_smoke_run_through_the_runner(tmp_path):
    """Two repetitions of a horovodrun job (np = 2, the engine and its shm transport) and, with torch, of the Gloo
    peer's own torchrun job: their records, report and chart."""
    has_torch = importlib.util.find_spec("torch") is not None
    out = tmp_path / "run.json"
    chart = tmp_path / "c.png"
    args = ["benchmarks/collectives.py", "--np", "2", "--ops", "allreduce,allgather", "--sizes", "4K,64K",
            "--rounds", "2", "--sample-ms", "2", "--reps", "2", "--json", str(out), "--job-timeout", "180",
            "--skip", "latency,fusion,memory,memcpy,mpi,tcp" + ("" if has_torch else ",gloo")]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    proc = _run(args + (["--chart", str(chart)] if has_mpl else []), timeout=600)
    records = json.loads(out.read_text())["records"]
    timed = {(r["op"], r["bytes"], r["impl"]) for r in records if r.get("kind") == "sweep" and "median_s" in r}
    impls = ("engine-shm", "raw-shm") + (("gloo",) if has_torch else ())
    want = {(op, n, impl) for op in ("allreduce", "allgather") for n in (4096, 65536) for impl in impls}
    assert timed == want, proc.stdout
    reps = {(r["impl"], r["rep"]) for r in records if r.get("kind") == "sweep" and "median_s" in r}
    assert reps == {(impl, rep) for impl in impls for rep in (0, 1)}, "every job ran once per repetition"
    assert "## Targets" in proc.stdout and "### allgather, np = 2" in proc.stdout
    if has_torch:
        assert "against its peers" in proc.stdout and "× torch Gloo" in proc.stdout, proc.stdout
    if has_mpl:
        assert chart.read_bytes().startswith(PNG)


def test_latency_stages_stamps_every_stage_of_both_paths():
    """The stage timestamps wrap engine functions by name: a rename must fail here, not in the next measurement."""
    proc = _run(["benchmarks/latency_stages.py", "--calls", "30", "--transport", "shm"], timeout=300)
    for heading in ("fast lane: back to back", "coordinator, HOROVOD_FAST_LANE=0: 1 ms compute before each"):
        assert heading in proc.stdout, proc.stdout
    for stage in ("entry on the lane board", "every rank's entry seen", "payloads reduced", "call returns"):
        assert f"| {stage} |" in proc.stdout, proc.stdout


def test_hot_path_calls_counts_each_collective_it_is_asked_for():
    """``--hot-path-calls --collectives``: a row per collective and rank with a count in the range a warm blocking
    collective takes (a hot path that fell off the lane or the warm path makes several hundred calls)."""
    proc = _run(["benchmarks/latency_stages.py", "--hot-path-calls", "--transport", "shm",
                 "--collectives", "allreduce,alltoall"], timeout=300)
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| allreduce |", "| alltoall |"))]
    assert [(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows] == [
        ("allreduce", "shm", "0"), ("allreduce", "shm", "1"), ("alltoall", "shm", "0"), ("alltoall", "shm", "1")], \
        proc.stdout
    assert all(20 < float(r[-2]) < 200 for r in rows), proc.stdout


def test_the_gloo_peer_runs_in_its_own_torchrun_job_unbound(tmp_path):
    """The Gloo peer is started by torchrun (standalone rendezvous), in a job of its own, never inside this
    project's horovodrun job; its ranks may run on every CPU the driver may (no core binding) with the threads
    torchrun sets, and the report's header says so."""
    pytest.importorskip("torch")
    out = tmp_path / "run.json"
    proc = _run(["benchmarks/collectives.py", "--np", "2", "--ops", "allreduce", "--sizes", "4K", "--rounds", "1",
                 "--sample-ms", "1", "--reps", "1", "--skip", "latency,fusion,memory,memcpy,mpi,tcp,shm",
                 "--json", str(out), "--job-timeout", "180"], timeout=400,
                env_extra={"OMP_NUM_THREADS": "7", "HOROVOD_BIND_CORES": "1"})  # a user's shell: must not leak
    records = json.loads(out.read_text())["records"]
    jobs = {r["job"] for r in records if r.get("kind") == "sweep" and r["impl"] == "gloo"}
    assert jobs == {"np=2 torchrun gloo rep 0"}, jobs
    placement = [r for r in records if r.get("kind") == "placement"]
    assert sorted(r["rank"] for r in placement) == [0, 1], placement
    for r in placement:
        assert r["launcher"] == "torchrun"
        assert r["cpus_allowed"] == sorted(os.sched_getaffinity(0)), f"rank {r['rank']} was bound: {r}"
        assert r["OMP_NUM_THREADS"] == "1" and r["HOROVOD_BIND_CORES"] is None, r
    header = proc.stdout.split("Method:")[0]
    assert "torch Gloo: `" in header and "--standalone --nproc-per-node N" in header, header
    assert "horovod.runner" not in header.split("torch Gloo: `", 1)[1].split("`", 1)[0], header


def test_peer_commands_and_job_plan(tmp_path, monkeypatch):
    """What the drivers build, without running it: torchrun (no binding, no inherited thread or HOROVOD_*
    settings) for Gloo and DDP, horovodrun for this project, and every repetition runs each library's own job."""
    from benchmarks import collectives, torch_training
    from benchmarks._collectives.jobs import Runner
    from benchmarks._lib import launch

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("HOROVOD_BIND_CORES", "1")
    env = launch.torchrun_env()
    assert "OMP_NUM_THREADS" not in env and not any(k.startswith("HOROVOD_") for k in env)

    for cmd in (launch.torchrun_cmd(4, ["x.py"]),
                torch_training.side_cmd(torch_training.build_args(["--np", "2"]), "ddp", 2)):
        head = " ".join(cmd[:3])
        assert os.path.basename(cmd[0]) == "torchrun" or "-m torch.distributed.run" in head, cmd
        assert "--standalone" in cmd and "--nproc-per-node" in cmd, cmd
        assert not any("bind" in a or "horovod.runner" in a or "mpirun" in a for a in cmd), cmd
    hvd_cmd = torch_training.side_cmd(torch_training.build_args(["--np", "2"]), "horovod", 2)
    assert hvd_cmd[1:3] == ["-m", "horovod.runner"] and "--side" in hvd_cmd and "horovod" in hvd_cmd

    class Args:
        ops, sizes, rounds, sample_ms, lat_iters, quick = ["allreduce"], [4096], 1, 1.0, 10, True
        fusion_reps = fusion_rounds = 1
        job_timeout, mpirun_args = 10.0, "--bind-to none"

    runner = Runner(Args(), str(tmp_path), collectives.SCRIPT)
    plan = collectives.plan_jobs(runner, 2, 1, ["shm", "tcp"], None, True, set())
    assert [(p.func.__name__, p.args[1] if p.func.__name__ == "hvd_job" else None) for p in plan] == [
        ("hvd_job", "shm"), ("gloo_job", None), ("openmpi_job", None), ("hvd_job", "tcp"), ("mpi_job", None)]
    assert all(p.args[-1] is False for p in plan if p.func.__name__ == "hvd_job" and p.args[1] == "tcp")
    assert all("fusion" not in p.args[2] for p in plan if p.func.__name__ == "hvd_job"), "fusion: rep 0 only"
    gloo = runner.gloo_cmd(2, str(tmp_path / "spec.json"))
    assert "--standalone" in gloo and "horovod.runner" not in " ".join(gloo)


def test_transports_compares_an_option_on_the_same_sweep(tmp_path):
    out = tmp_path / "run.json"
    _run(["benchmarks/transports.py", "--transport", "tcp", "--np", "2", "--sizes", "4K", "--rounds", "2",
          "--sample-ms", "2", "--option", "tcp_chunk_bytes=65536", "--option", "shm_spin_us=0", "--json",
          str(out), "--job-timeout", "90"])
    impls = {r["impl"] for r in json.loads(out.read_text())["records"] if "median_s" in r}
    # the shm option does not run on tcp
    assert impls == {"raw-tcp", "raw-tcp-tcp_chunk_bytes=65536"}, impls


def test_big_result_small_run(tmp_path):
    out = tmp_path / "big.json"
    proc = _run(["benchmarks/big_result.py", "--size", "8M", "--rounds", "1", "--json", str(out),
                 "--timeout", "90"])
    data = json.loads(out.read_text())
    assert data["error"] is None
    assert all(len(data["samples_s"][p]) == 1 for p in ("first touch", "in place", "new result", "touch, recycled"))
    assert set(data["vmstat"]["first touch"]) == {"compact_stall", "thp_fault_fallback"}
    assert "| new result |" in proc.stdout


def test_lane_limits_small_run():
    proc = _run(["benchmarks/lane_limits.py", "--np", "2", "--sizes", "256K,1M", "--rounds", "2", "--batch", "2",
                 "--timeout", "120"])
    # at np = 2 an allgather of 1 MiB (512 KiB a rank) and an alltoall of 1 MiB (with its splits) are on the board
    assert "| allgather | 1 MiB | yes |" in proc.stdout and "| alltoall | 1 MiB | yes |" in proc.stdout, proc.stdout
    assert "WRONG" not in proc.stdout


def test_lane_limits_over_tcp():
    proc = _run(["benchmarks/lane_limits.py", "--transport", "tcp", "--np", "2", "--sizes", "256K,512K", "--rounds",
                 "2", "--batch", "2", "--timeout", "120"])
    # the TCP lane's records hold 256 KiB: an allgather of 512 KiB (256 KiB a rank) is on it, a broadcast is not
    assert "np = 2 (tcp;" in proc.stdout, proc.stdout
    assert "| allgather | 512 KiB | yes |" in proc.stdout and "| broadcast | 512 KiB | no |" in proc.stdout, \
        proc.stdout
    assert "WRONG" not in proc.stdout


def test_torch_training_runs_ddp_under_torchrun_and_horovod_under_horovodrun():
    """One tiny repetition of each side's job: the table, and a header that names both launchers and shows DDP's
    ranks allowed on every CPU the driver may use."""
    pytest.importorskip("torch")
    proc = _run(["benchmarks/torch_training.py", "--np", "2", "--models", "deepmlp", "--blocks", "1",
                 "--block-steps", "1", "--warmup", "1", "--reps", "1", "--no-scaling", "--timeout", "400"],
                timeout=900)
    out = proc.stdout
    assert "| deepmlp |" in out and "× DDP" in out and "Target: horovod.torch ≥ 1.1× DDP (torchrun)" in out, out
    ddp_cmd = out.split("DDP + Gloo (torchrun) launched as**: `", 1)[1].split("`", 1)[0]
    assert "--standalone --nproc-per-node 2" in ddp_cmd and "horovod.runner" not in ddp_cmd, ddp_cmd
    hvd_cmd = out.split("horovod.torch (horovodrun) launched as**: `", 1)[1].split("`", 1)[0]
    assert "-m horovod.runner -np 2" in hvd_cmd, hvd_cmd
    placement = out.split("DDP + Gloo (torchrun) ranks' placement**: ", 1)[1].splitlines()[0]
    cpus = str(sorted(os.sched_getaffinity(0)))
    assert placement.count(f"CPUs {cpus} of") == 2 and "OMP_NUM_THREADS=1" in placement, placement


def test_tf_training_runs_mwms_in_plain_processes_and_horovod_under_horovodrun():
    """One tiny repetition of each job: MultiWorkerMirroredStrategy in plain processes the driver starts (one per
    worker, TF_CONFIG each, no horovodrun: allowed on every CPU the driver may use, OMP_NUM_THREADS and HOROVOD_*
    of the user's shell not inherited), both Horovod sides under horovodrun, and the table with every side."""
    for module in ("tensorflow", "tf_keras"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (tf_training.py runs MWMS's model.fit under tf_keras)")
    proc = _run(["benchmarks/tf_training.py", "--np", "2", "--models", "mlp", "--blocks", "1", "--block-steps",
                 "1", "--warmup", "1", "--batch-size", "8", "--reps", "1", "--timeout", "300"], timeout=700,
                env_extra={"OMP_NUM_THREADS": "7", "HOROVOD_BIND_CORES": "1"})  # a user's shell: must not leak
    out = proc.stdout
    row = next((ln for ln in out.splitlines() if ln.startswith("| mlp |")), None)
    assert row is not None and "× MWMS" in out, out
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[1:4]) and cells[4].endswith("×"), row   # hvd, no buckets, MWMS, ratio
    mwms_cmd = out.split("MultiWorkerMirroredStrategy (plain processes) launched as**: 2 × `", 1)[1].split("`")[0]
    assert "--side mwms" in mwms_cmd and "horovod.runner" not in mwms_cmd and "torchrun" not in mwms_cmd, mwms_cmd
    hvd_cmd = out.split("horovod.tensorflow.keras (horovodrun) launched as**: `", 1)[1].split("`", 1)[0]
    assert "-m horovod.runner -np 2" in hvd_cmd and "--side horovod" in hvd_cmd, hvd_cmd
    started = [ln for ln in proc.stderr.splitlines() if "mwms, np=2:" in ln]
    assert len(started) == 1 and "horovod.runner" not in started[0] and "(× 2 processes)" in started[0], started
    placement = out.split("MultiWorkerMirroredStrategy (plain processes) ranks' placement**: ", 1)[1].splitlines()[0]
    cpus = str(sorted(os.sched_getaffinity(0)))
    assert placement.count(f"CPUs {cpus} of") == 2 and placement.count("OMP_NUM_THREADS=unset") == 2, placement
    assert "HOROVOD_BIND_CORES" not in placement, placement


def test_collectives_across_namespace_hosts(tmp_path):
    """``--hosts 2``: two network-namespace hosts (tests/runner/netns/cluster.py), one rank each; this project under
    horovodrun -H, Gloo under torchrun --nnodes 2 started on each host over ssh, Open MPI under mpirun -H (when
    installed); every job's ranks really ran on different hosts, and the tables compare them. Skipped, with the
    fixture's reason, where this machine cannot build the hosts (not root, no ip/sshd)."""
    pytest.importorskip("torch")
    from benchmarks._lib import netns

    fixture = netns.fixture()
    try:
        fixture.ensure_tools()
    except fixture.ClusterUnavailable as exc:
        pytest.skip(f"no fake cluster on this machine: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=REPO, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "benchmarks/collectives.py", "--hosts", "2", "--ops", "allreduce",
                           "--sizes", "4K,64K", "--rounds", "1", "--sample-ms", "2", "--reps", "1",
                           "--skip", "latency,fusion,memcpy", "--json", str(out), "--job-timeout", "60"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode == 2 and "no network-namespace hosts" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    records = json.loads(out.read_text())["records"]
    timed = {(r["bytes"], r["impl"]) for r in records if r.get("kind") == "sweep" and "median_s" in r}
    libraries = ["horovodrun", "torchrun"] + (["mpirun"] if any(r["impl"] == "openmpi" for r in records
                                                                if r.get("kind") == "sweep") else [])
    impls = {"engine-tcp", "raw-tcp", "gloo"} | ({"openmpi"} if "mpirun" in libraries else set())
    assert timed >= {(n, impl) for n in (4096, 65536) for impl in impls}, proc.stdout
    placed: dict = {}
    for r in records:
        if r.get("kind") == "placement":
            placed.setdefault(r["launcher"], {})[r["rank"]] = r["host"]
    for launcher in libraries:   # rank 0 on hostA, rank 1 on hostB: each job spanned both hosts
        assert placed.get(launcher) == {0: "hostA", 1: "hostB"}, (launcher, placed)
    assert {v for r in records for k, v in r.items() if k.startswith("engine_transport_")} == {"tcp"}
    head = proc.stdout.split("Method:")[0]
    assert "across 2 hosts" in head and "hostA 10.200.0.2" in head and "--nnodes 2" in head, head
    assert "-H hostA:1,hostB:1" in head, head
    table = proc.stdout.split("against its peers", 1)[1].split("## Details", 1)[0]
    assert "× torch Gloo" in table and "| allreduce | 4 KiB |" in table and "| allreduce | 64 KiB |" in table, table
