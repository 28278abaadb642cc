"""horovodrun across hosts over ssh.

Three layers, fastest first:

* pure pieces: ssh argv, the remote command line, error wording, the check cache, address choice, launch mode;
* the real launcher with a stand-in ``ssh`` that runs the remote command on this machine (no sshd needed): the
  wrapper, the secret on standard input, the reachability probe and a real TCP job over two "hosts";
* real separate hosts: network namespaces with their own address, host name and sshd
  (``tests/runner/netns/cluster.py``), driven from a third namespace: collectives, a hostfile, an unreachable
  host, a host that dies mid-job, and mpirun across the hosts.  Skipped with the reason where namespaces are not
  permitted (not root, no iproute2/sshd that can be installed).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from horovod.runner import check_cache, ssh
from horovod.transport import network
from horovod.runner.hosts import HostInfo
from horovod.runner.launch import launch_mode, parse_args
from horovod.runner.mpi_job import spans_several_hosts
from runner_helpers import REPO, child_env, launcher_argv

sys.path.insert(0, str(Path(__file__).parent / "netns"))
from cluster import cluster_or_skip  # noqa: E402

JOB_TIMEOUT = 60

# Checks everything a worker on a (remote) host can see, against numpy.
CHECK_WORKER = r"""
import hashlib, os, socket, sys
import numpy as np
import horovod.numpy as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
x = np.arange(6, dtype=np.float64).reshape(2, 3) * (rank + 1)
total = hvd.allreduce(x, op=hvd.Sum, name="sum")
expected = np.arange(6, dtype=np.float64).reshape(2, 3) * sum(r + 1 for r in range(size))
assert np.allclose(total, expected), (total, expected)
rows = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int32), name="rows")
assert rows.shape == (size * (size + 1) // 2, 2)
assert np.array_equal(rows[:, 0], np.repeat(np.arange(size), np.arange(1, size + 1)))
got = hvd.broadcast(np.array([rank * 10.0]), root_rank=size - 1, name="bcast")
assert got[0] == (size - 1) * 10.0
secret = os.environ["_HOROVOD_SECRET_KEY"]
# The secret must not appear on any command line on this host (ps shows those to every user).
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert secret.encode() not in f.read(), f"secret on the command line of pid {pid}"
        except OSError:
            pass
print(f"OK rank={rank} size={size} local={hvd.local_rank()}/{hvd.local_size()} "
      f"cross={hvd.cross_rank()}/{hvd.cross_size()} label={os.environ['HOROVOD_HOSTNAME']} "
      f"uname={socket.gethostname()} cwd={os.getcwd()} "
      f"secret={hashlib.sha256(secret.encode()).hexdigest()[:16]}")
hvd.shutdown()
"""

LOOP_WORKER = r"""
import socket, time
import numpy as np
import horovod.numpy as hvd

hvd.init()
step = 0
while True:
    out = hvd.allreduce(np.full(1000, hvd.rank(), dtype=np.float32), op=hvd.Sum, name=f"step{step}")
    assert out[0] == sum(range(hvd.size()))
    if step == 0:
        print(f"ready {hvd.rank()} {socket.gethostname()}", flush=True)
    step += 1
    time.sleep(0.01)
"""

# A training-shaped loop that goes warm (horovod/engine/rounds.py) across hosts: the rounds run over TCP
# (horovod/engine/tcp_round_board.py) and hostB's ranks, which reach rank 0 over TCP, wait for its fences. New names
# every third step keep cold messages coming between warm rounds; every result is checked against numpy.
WARM_WORKER = r"""
import numpy as np
import horovod.numpy as hvd
from horovod.common import basics

hvd.init()
rank, size = hvd.rank(), hvd.size()
bad = 0
for step in range(30):
    handles = [hvd.allreduce_async(np.full(50 + i, rank + i, np.float32), op=hvd.Sum, name=f"g{i}")
               for i in range(12)]
    for i, h in enumerate(handles):
        bad += not np.array_equal(hvd.synchronize(h), np.full(50 + i, sum(range(size)) + size * i, np.float32))
    rows = hvd.allgather(np.full((rank + 1, 2), rank, np.int64), name="rows")
    bad += not np.array_equal(rows[:, 0], np.repeat(np.arange(size), np.arange(1, size + 1)))
    bad += hvd.broadcast(np.array([step * 1.0 + rank]), root_rank=size - 1, name="b")[0] != step + size - 1
    if step % 3 == 0:
        bad += hvd.allreduce(np.ones(3), op=hvd.Sum, name=f"cold{step}")[0] != size
warm = basics.runtime().state.warm
print(f"WARM rank={rank} bad={bad} warm={warm.state.warm} rounds={warm.state.rounds} "
      f"fenced={warm.fenced}", flush=True)
hvd.shutdown()
"""

MPI_WORKER = r"""
import os, socket
from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1)
print(f"MPI rank={comm.Get_rank()} size={comm.Get_size()} uname={socket.gethostname()} sum={total} "
      f"local={os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')} fusion={os.environ.get('HOROVOD_FUSION_THRESHOLD')}")
"""


def _oks(stdout: str):
    found = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"\[(\d+)\]<stdout>:OK (.*)", line)
        if match:
            found[int(match.group(1))] = dict(kv.split("=", 1) for kv in match.group(2).split())
    return found


# ------------------------------------------------------------------------------------------------ pure pieces

def test_ssh_argv_has_port_key_and_no_prompt_options():
    argv = ssh.SshSettings(2222, "/k/id").argv("hostB")
    assert argv == ["ssh", "-p", "2222", "-i", "/k/id", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                    "hostB"]
    assert ssh.SshSettings().argv("h") == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "h"]


def test_ssh_settings_validation(tmp_path):
    with pytest.raises(ValueError, match="--ssh-port 70000"):
        ssh.SshSettings.create(70000, None)
    with pytest.raises(ValueError, match="does not exist"):
        ssh.SshSettings.create(None, str(tmp_path / "missing_key"))
    key = tmp_path / "key"
    key.write_text("")
    assert ssh.SshSettings.create("22", str(key)) == ssh.SshSettings(22, str(key))


def test_remote_command_has_cwd_and_env_but_never_the_secret():
    env = {"HOROVOD_RANK": "3", "WITH SPACE": "x", "QUOTE": "it's", "_HOROVOD_SECRET_KEY": "feedface" * 8,
           "OLDPWD": "/old", "BASH_FUNC_f%%": "() { :; }", "CUDA_VISIBLE_DEVICES": "0"}
    filtered = ssh.remote_env(env)
    assert set(filtered) == {"HOROVOD_RANK", "WITH SPACE", "QUOTE"}
    text = ssh.remote_command("/work dir", filtered, ["python", "train.py", "--lr", "0.1"])
    assert text.startswith("cd '/work dir' >/dev/null 2>&1; ")
    assert "feedface" not in text
    words = shlex.split(text.split("exec ", 1)[1].split("; fi", 1)[0])
    assert words[0] == "env" and "HOROVOD_RANK=3" in words and "QUOTE=it's" in words
    assert words[-4:] == ["python", "train.py", "--lr", "0.1"]


@pytest.mark.parametrize("code, said, fragment", [
    (255, "ssh: connect to host h port 22: Connection refused", "is sshd running there"),
    (255, "ssh: Could not resolve hostname h: Name or service not known", "does not resolve"),
    (255, "ssh: connect to host h port 22: Connection timed out", "does not answer"),
    (255, "root@h: Permission denied (publickey).", "passwordless ssh"),
    (255, "Host key verification failed.", "ssh-keygen -R h"),
    (127, "horovodrun: no Python interpreter on this host (tried python3)", "no Python on that host"),
    (None, "", "no answer within 7 s"),
])
def test_ssh_failures_are_explained(code, said, fragment):
    text = ssh.explain_ssh_failure("h", ssh.SshSettings(), code, said, 7)
    assert fragment in text
    if said:
        assert said.strip() in text   # what ssh itself said is quoted


def test_check_cache_expires_and_can_be_disabled(tmp_path):
    now = [1000.0]
    cache = check_cache.CheckCache(str(tmp_path), clock=lambda: now[0])
    key = check_cache.make_key("ssh", "hostA", 22, None)
    assert cache.get(key) is None
    cache.put(key, True)
    now[0] += check_cache.STALENESS_SECONDS - 1
    assert cache.get(key) is True
    now[0] += 2
    assert cache.get(key) is None
    off = check_cache.CheckCache(str(tmp_path / "off"), enabled=False)
    off.put(key, True)
    assert off.get(key) is None and not (tmp_path / "off").exists()
    (tmp_path / check_cache.FILE_NAME).write_text("{not json")
    assert cache.get(key) is None   # a corrupt file is an empty cache


def test_address_choice():
    a, b = network.Candidate("eth0", "10.0.0.1"), network.Candidate("eth1", "192.168.1.1")
    assert network.choose_address([a, b], {"h1": ["10.0.0.1", "192.168.1.1"], "h2": ["192.168.1.1"]})[0] == b
    chosen, reached = network.choose_address([a, b], {"h1": ["10.0.0.1"], "h2": []})
    assert chosen is None and reached == {"h1": ["10.0.0.1"], "h2": []}


def test_interfaces_and_nic_candidates():
    interfaces = network.interface_addresses()
    assert interfaces.get("lo") == "127.0.0.1"
    assert network.nic_candidates(["lo"], interfaces) == [network.Candidate("lo", "127.0.0.1")]
    assert network.nic_candidates(["127.0.0.1"], interfaces) == [network.Candidate("lo", "127.0.0.1")]
    with pytest.raises(ValueError, match="none of --network-interfaces nosuchnic0 .* this machine has: .*lo"):
        network.nic_candidates(["nosuchnic0"], interfaces)
    routed = network.candidate_addresses(["127.0.0.1"])
    assert routed[0].addr == "127.0.0.1"   # loopback only when a host is reached through it


def test_launch_mode_defaults_to_mpi_only_across_hosts():
    def mode(argv, installed=True):
        return launch_mode(parse_args(argv + ["true"]), mpi_installed=lambda: installed)

    assert mode(["-np", "2"]) == "gloo"
    assert mode(["-np", "2", "-H", "localhost:2"]) == "gloo"
    assert mode(["-np", "2", "-H", "localhost:1,127.0.0.1:1"]) == "gloo"        # two names, one machine
    assert mode(["-np", "1", "-H", "localhost:1,far.example:1"]) == "gloo"      # the ranks fit on one host
    assert mode(["-np", "2", "-H", "localhost:1,far.example:1"]) == "mpi"
    assert mode(["-np", "2", "-H", "localhost:1,far.example:1"], installed=False) == "gloo"
    assert mode(["-np", "2", "-H", "localhost:1,far.example:1", "--gloo"]) == "gloo"
    assert mode(["-np", "2", "--mpi"], installed=False) == "mpi"
    assert spans_several_hosts([HostInfo("a.example", 1), HostInfo("b.example", 1)], 2)
    assert not spans_several_hosts([HostInfo("a.example", 2), HostInfo("b.example", 1)], 2)


# ---------------------------------------------------- the wrapper and the launcher with a stand-in for ssh

def _wrapper_proc(tmp_path, command, env=None):
    text = ssh.remote_command(str(tmp_path), env or {}, command)
    return subprocess.Popen(["sh", "-c", text], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def test_wrapper_takes_the_secret_from_stdin_and_passes_the_exit_status(tmp_path):
    proc = _wrapper_proc(tmp_path, [sys.executable, "-c",
                                    "import os, sys; print(os.environ['_HOROVOD_SECRET_KEY'], os.getcwd(), "
                                    "os.environ['ONE'], sys.argv[1:]); sys.exit(7)", "a b"],
                         env={"ONE": "1 1", "PATH": os.environ["PATH"]})
    proc.stdin.write(b"s3cr3t\n")
    proc.stdin.flush()   # and keep it open: its end means "stop the worker"
    proc.wait(timeout=JOB_TIMEOUT)
    out, err = proc.communicate(timeout=JOB_TIMEOUT)
    assert proc.returncode == 7, err
    assert out.decode().split() == ["s3cr3t", str(tmp_path), "1", "1", "['a", "b']"]


def test_wrapper_stops_the_worker_when_the_launcher_goes_away(tmp_path):
    pidfile = tmp_path / "pid"
    proc = _wrapper_proc(tmp_path, [sys.executable, "-c",
                                    f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                    f"time.sleep(120)"])
    proc.stdin.write(b"x\n")
    proc.stdin.flush()
    deadline = time.monotonic() + JOB_TIMEOUT
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    proc.stdin.close()   # what the remote side sees when ssh or the launcher dies
    assert proc.wait(timeout=JOB_TIMEOUT) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{worker}")


def test_wrapper_without_secret_line_does_not_start(tmp_path):
    marker = tmp_path / "started"
    proc = _wrapper_proc(tmp_path, ["touch", str(marker)], env={"PATH": os.environ["PATH"]})
    _, err = proc.communicate(b"", timeout=JOB_TIMEOUT)
    assert proc.returncode == 2 and b"before sending the job secret" in err
    assert not marker.exists()


FAKE_SSH = """#!{python}
# Stand-in for ssh: log the argv, then run the remote command here, standard input included.
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""


@pytest.fixture
def fake_ssh(tmp_path):
    if not [a for n, a in network.interface_addresses().items() if not a.startswith("127.")]:
        pytest.skip("this machine has no non-loopback IPv4 address for the launcher to listen on")
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    log = tmp_path / "ssh.log"
    (bindir / "ssh").write_text(FAKE_SSH.format(python=sys.executable, log=str(log)))
    (bindir / "ssh").chmod(0o755)
    key = tmp_path / "key"
    key.write_text("")
    env = child_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path / "home"))
    return env, log, key


def test_job_over_a_stand_in_ssh(tmp_path, fake_ssh, script):
    env, log, key = fake_ssh
    worker = script(CHECK_WORKER)
    proc = subprocess.run(launcher_argv(["-np", "3", "-H", "far-a.invalid:2,far-b.invalid:1", "--gloo", "-p", "2200",
                                         "-i", str(key), "--disable-cache", sys.executable, worker]),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, cwd=str(REPO),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    oks = _oks(proc.stdout)
    assert sorted(oks) == [0, 1, 2]
    assert [(o["label"], o["local"], o["cross"]) for _, o in sorted(oks.items())] == [
        ("far-a.invalid", "0/2", "0/2"), ("far-a.invalid", "1/2", "0/1"), ("far-b.invalid", "0/1", "1/2")]
    assert {o["cwd"] for o in oks.values()} == {str(REPO)}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 + 3   # one check per host, one session per rank
    for argv in calls:
        assert argv[:8] == ["-p", "2200", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    secret_digest = {o["secret"] for o in oks.values()}
    assert len(secret_digest) == 1
    for argv in calls:   # the secret itself is never on ssh's command line
        for word in argv:
            for token in re.findall(r"[0-9a-f]{64}", word):
                assert hashlib.sha256(token.encode()).hexdigest()[:16] not in secret_digest


def test_unreachable_launcher_address_is_reported(tmp_path, fake_ssh):
    env, _, _ = fake_ssh
    proc = subprocess.run(launcher_argv(["-np", "2", "-H", "far-a.invalid:1,far-b.invalid:1", "--gloo",
                                         "--network-interfaces", "nosuchnic0", "true"]),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "none of --network-interfaces nosuchnic0" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------- real hosts in namespaces

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from cluster_or_skip(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def cluster_home(tmp_path_factory):
    """A HOME of its own, so the ssh check cache starts empty and ~/.horovod of the user is not touched."""
    return tmp_path_factory.mktemp("home")


def _driver_env(cluster, home, **extra):
    env = cluster.env(child_env(HOME=str(home), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    env.update(extra)
    return env


def _horovodrun(cluster, home, args, timeout=JOB_TIMEOUT):
    return subprocess.run(cluster.in_driver(launcher_argv(args)), capture_output=True, text=True, timeout=timeout,
                          env=_driver_env(cluster, home), cwd=str(REPO), stdin=subprocess.DEVNULL)


def test_collectives_across_two_hosts(cluster, cluster_home, script):
    worker = script(CHECK_WORKER)
    proc = _horovodrun(cluster, cluster_home, ["-np", "4", "-H", "hostA:2,hostB:2", "--gloo", "--verbose",
                                               *cluster.ssh_flags(), sys.executable, worker])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    oks = _oks(proc.stdout)
    assert sorted(oks) == [0, 1, 2, 3]
    for rank, ok in oks.items():
        host = "hostA" if rank < 2 else "hostB"
        assert (ok["label"], ok["uname"]) == (host, host)   # really ran on that host
        assert ok["local"] == f"{rank % 2}/2" and ok["cross"] == f"{rank // 2}/2"
    assert "ssh check of hostA: ok; reaches 10.200.0.1" in proc.stderr
    assert "rendezvous store at 10.200.0.1:" in proc.stderr   # the bridge address, not 127.0.0.1 or 0.0.0.0
    cached = json.loads((cluster_home / ".horovod" / check_cache.FILE_NAME).read_text())
    assert any('"hostB"' in key for key in cached)


def test_numpy_example_with_a_hostfile_uses_the_cache(cluster, cluster_home, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nhostA slots=2\nhostB slots=2\n")
    proc = _horovodrun(cluster, cluster_home, ["-np", "4", "--hostfile", str(hostfile), "--gloo", "--verbose",
                                               *cluster.ssh_flags(), sys.executable, "examples/numpy_allreduce.py"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "<stdout>:rank" in line)
    assert len(lines) == 4, proc.stdout + proc.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"[{rank}]<stdout>:rank {rank}/4 (local {rank % 2}/2): sum=[6.0, 10.0, 14.0, 18.0]")
    assert "ssh check of hostA: ok (cached)" in proc.stderr, proc.stderr
    assert "ssh check of hostB: ok (cached)" in proc.stderr, proc.stderr


API_DRIVER = r"""
import socket, sys
from horovod.runner import run

def where(scale):
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum, name="t")
    out = (hvd.rank(), socket.gethostname(), float(total[0]) * scale)
    hvd.shutdown()
    return out

print("RESULT", run(where, args=(10,), num_proc=3, hosts="hostA:1,hostB:2", use_gloo=True,
                    ssh_port=int(sys.argv[1]), ssh_identity_file=sys.argv[2], disable_cache=True))
"""


def test_horovod_run_ships_a_function_to_other_hosts(cluster, cluster_home, script):
    driver = script(API_DRIVER, name="driver.py")   # functions of __main__ travel by value
    port, key = cluster.ssh_flags()[1], cluster.ssh_flags()[3]
    proc = subprocess.run(cluster.in_driver([sys.executable, driver, port, key]), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT, env=_driver_env(cluster, cluster_home), cwd=str(REPO),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT [(0, 'hostA', 60.0), (1, 'hostB', 60.0), (2, 'hostB', 60.0)]" in proc.stdout


def test_unreachable_hosts_are_named_and_nothing_starts(cluster, cluster_home, tmp_path):
    marker = tmp_path / "started"
    start = time.monotonic()
    proc = _horovodrun(cluster, cluster_home, ["-np", "3", "-H", "hostA:1,hostC:1,hostZ:1", "--gloo",
                                               "--start-timeout", "2", *cluster.ssh_flags(),
                                               "touch", str(marker)])
    assert proc.returncode == 1, proc.stderr
    assert "cannot use 2 of 3 remote host(s) over ssh" in proc.stderr
    assert re.search(r"hostC: nothing accepts ssh connections on port 2222 .*Connection refused", proc.stderr)
    assert re.search(r"hostZ: (the host does not answer|no answer)", proc.stderr)
    assert "  hostA:" not in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
    assert time.monotonic() - start < 30


def test_a_host_dying_mid_job_ends_the_job_and_names_it(cluster, cluster_home, script):
    worker = script(LOOP_WORKER)
    proc = subprocess.Popen(cluster.in_driver(launcher_argv(
        ["-np", "4", "-H", "hostA:2,hostB:2", "--gloo", "--disable-cache", "--network-interfaces", "br0",
         *cluster.ssh_flags(), sys.executable, worker])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_driver_env(cluster, cluster_home),
        cwd=str(REPO), stdin=subprocess.DEVNULL)
    lines: "queue.Queue[str]" = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        ready = set()
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(ready) < 4:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            match = re.match(r"\[(\d)\]<stdout>:ready (\d) (host[AB])", line)
            if match:
                ready.add(int(match.group(1)))
        cluster.kill_host("hostB")   # sshd, its sessions and both workers, at once
        _, err = proc.communicate(timeout=JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if cluster.hosts["hostB"].proc.poll() is not None:
            cluster.start_sshd("hostB")   # for the tests after this one
    assert proc.returncode == 1, err
    assert "The first process to do so was:" in err
    match = re.search(r"Rank: (\d)\nHost: (\w+)\nExit code: (-?\d+)", err)
    assert match and match.group(2) == "hostB" and match.group(1) in ("2", "3"), err
    assert "ssh to hostB exited with status 255" in err
    # The survivors on hostA were stopped too: only its sshd listener is left there.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        leftovers = cluster.host_pids_running("hostA", "python")
        if not leftovers:
            break
        time.sleep(0.1)
    assert not leftovers


def _have_mpi():
    import importlib.util
    import shutil

    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


@pytest.mark.parametrize("launch", ["--gloo", "--mpi"])
def test_repeated_collectives_run_warm_across_two_hosts(cluster, cluster_home, script, launch):
    if launch == "--mpi" and not _have_mpi():
        pytest.skip("mpirun and mpi4py are not installed")
    worker = script(WARM_WORKER)
    proc = _horovodrun(cluster, cluster_home, ["-np", "4", "-H", "hostA:2,hostB:2", launch, *cluster.ssh_flags(),
                                               sys.executable, worker])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {}
    for line in proc.stdout.splitlines():
        match = re.search(r"<stdout>:WARM (.*)", line)
        if match:
            stats = dict(kv.split("=", 1) for kv in match.group(1).split())
            found[int(stats["rank"])] = stats
    assert sorted(found) == [0, 1, 2, 3], proc.stdout + proc.stderr
    assert all(s["bad"] == "0" for s in found.values()), found
    # 14 repeated tensors a step; the first step and a few demoted hits are cold
    assert all(int(s["warm"]) >= 14 * 25 for s in found.values()), found
    assert len({(s["warm"], s["rounds"]) for s in found.values()}) == 1, found
    assert all(int(found[r]["fenced"]) > 0 for r in (2, 3)), found   # hostB heard rank 0's fences


@pytest.mark.skipif(not _have_mpi(), reason="mpirun and mpi4py are not installed")
def test_mpirun_across_two_hosts(cluster, cluster_home, script):
    worker = script(MPI_WORKER)
    # No --mpi: with mpirun + mpi4py installed, a job spanning hosts runs under mpirun by default.
    proc = _horovodrun(cluster, cluster_home, ["-np", "4", "-H", "hostA:2,hostB:2", "--fusion-threshold-mb", "2",
                                               *cluster.ssh_flags(), sys.executable, worker])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = sorted(line for line in proc.stdout.splitlines() if "<stdout>:MPI " in line)
    assert found == [f"[{r}]<stdout>:MPI rank={r} size=4 uname={'hostA' if r < 2 else 'hostB'} sum=10 "
                     f"local={r % 2} fusion=2097152" for r in range(4)]


def _bootstrap_knows_hosts():
    from horovod.engine import bootstrap

    return hasattr(bootstrap, "_mpi_bind_address")


@pytest.mark.skipif(not _have_mpi(), reason="mpirun and mpi4py are not installed")
@pytest.mark.skipif(not _bootstrap_knows_hosts(), reason=(
    "under mpirun, horovod/engine/bootstrap.py binds rank 0's rendezvous to 127.0.0.1 unless every rank is on one "
    "host, so ranks on other hosts cannot reach it; needs the _mpi_bind_address fix (see docs/cluster.md)"))
def test_hvd_init_under_mpirun_across_two_hosts(cluster, cluster_home):
    proc = _horovodrun(cluster, cluster_home, ["--mpi", "-np", "4", "-H", "hostA:2,hostB:2", *cluster.ssh_flags(),
                                               sys.executable, "examples/numpy_allreduce.py"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "<stdout>:rank" in line)
    assert [line.split(" avg=")[0] for line in lines] == [
        f"[{r}]<stdout>:rank {r}/4 (local {r % 2}/2): sum=[6.0, 10.0, 14.0, 18.0]" for r in range(4)]


# The hierarchical transport's three steps (shared memory in each host, TCP across) on an array large enough to take
# them, checked against numpy; and which ranks it grouped as one host.
HIERARCHICAL_WORKER = r"""
import numpy as np
import horovod.numpy as hvd
from horovod.common import basics

hvd.init()
rank, size = hvd.rank(), hvd.size()
world = basics.runtime().world
x = np.arange(100_000, dtype=np.float64) * (rank + 1)
total = hvd.allreduce(x, op=hvd.Sum, name="big")
ok = np.allclose(total, np.arange(100_000, dtype=np.float64) * sum(r + 1 for r in range(size)))
print(f"HIER rank={rank} transport={basics.runtime().transport_name} ok={ok} "
      f"groups={'|'.join(','.join(map(str, g)) for g in world.groups)}", flush=True)
hvd.shutdown()
"""


def test_shared_memory_groups_need_the_same_network_namespace():
    """The hierarchical transport's node key: the launcher's host name is not enough (under mpirun every rank says
    'localhost'); a rank in another network namespace (another host, or a container) is never in this shm group."""
    import shutil

    from horovod.transport.hierarchical import node_key

    assert node_key("localhost") == node_key("localhost") != node_key("hostB")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new network namespace needs root and unshare")
    probe = [sys.executable, "-c", "from horovod.transport.hierarchical import node_key; print(node_key('localhost'))"]
    other = subprocess.run(["unshare", "--net", *probe], capture_output=True, text=True, timeout=60,
                           env=child_env(), cwd=str(REPO))
    if other.returncode != 0:
        pytest.skip(f"unshare --net is not permitted here: {other.stderr.strip()}")
    assert other.stdout.strip() != node_key("localhost"), other.stdout


@pytest.mark.skipif(not _have_mpi(), reason="mpirun and mpi4py are not installed")
def test_hierarchical_transport_under_the_mpirun_horovodrun_chose(cluster, cluster_home, script):
    """No --mpi: across hosts horovodrun picks mpirun; ranks 2 and 3 (hostB) once died with 'shm transport: could not
    connect to local rank 0': under mpirun every rank was on host 'localhost', so all four formed one shared-memory
    group across the two hosts."""
    proc = _horovodrun(cluster, cluster_home, ["-np", "4", "-H", "hostA:2,hostB:2", "--transport", "hierarchical",
                                               *cluster.ssh_flags(), sys.executable, script(HIERARCHICAL_WORKER)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "under mpirun" in proc.stderr, proc.stderr   # horovodrun chose mpirun by itself
    found = sorted(line.split("<stdout>:", 1)[1] for line in proc.stdout.splitlines() if "<stdout>:HIER " in line)
    assert found == [f"HIER rank={r} transport=hierarchical ok=True groups=0,1|2,3" for r in range(4)], proc.stdout


PID_WORKER = """
import os, sys, time
path = os.path.join(sys.argv[1], "pid." + os.environ["HOROVOD_RANK"])
with open(path + ".part", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".part", path)
time.sleep(120)
"""


def test_kill_9_of_the_launcher_takes_remote_workers_down(tmp_path, fake_ssh, script):
    """ssh dies with the launcher (parent-death signal); the remote wrapper sees its stdin close and stops the
    worker."""
    env, _log, key = fake_ssh
    worker = script(PID_WORKER)
    proc = subprocess.Popen(launcher_argv(["-np", "2", "-H", "far-a.invalid:2", "--gloo", "-i", str(key),
                                           "--disable-cache", sys.executable, worker, str(tmp_path)]),
                            env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not all((tmp_path / f"pid.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
        proc.kill()
        proc.wait(timeout=JOB_TIMEOUT)
        deadline = time.monotonic() + 2.0
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "remote workers outlived the launcher"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
