"""docs/kubernetes.md's files, checked as far as a machine without Kubernetes allows."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBE = os.path.join(REPO, "examples", "kubernetes")


def _manifest() -> dict:
    with open(os.path.join(KUBE, "mpijob.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _dockerfile() -> str:
    with open(os.path.join(KUBE, "Dockerfile"), encoding="utf-8") as f:
        return f.read()


def test_the_mpijob_has_the_fields_the_schema_requires():
    job = _manifest()
    assert job["apiVersion"] == "kubeflow.org/v2beta1" and job["kind"] == "MPIJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])   # a DNS-1123 label
    specs = job["spec"]["mpiReplicaSpecs"]
    assert set(specs) == {"Launcher", "Worker"}
    for role, spec in specs.items():
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1, role
        containers = spec["template"]["spec"]["containers"]
        assert containers and all(c.get("name") and c.get("image") for c in containers), role
    assert specs["Launcher"]["replicas"] == 1
    assert job["spec"]["mpiImplementation"] == "OpenMPI"
    assert isinstance(job["spec"]["slotsPerWorker"], int)


def test_the_launcher_runs_every_slot_with_the_open_mpi_5_spelling():
    job = _manifest()
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "mpirun"
    slots = job["spec"]["slotsPerWorker"] * job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    assert command[command.index("-np") + 1] == str(slots)
    assert "--bind-to" in command and "--map-by" in command and "-bind-to" not in command
    script = command[-1]
    assert script.startswith("/app/") and os.path.exists(os.path.join(REPO, script[len("/app/"):]))
    images = {c["image"] for spec in job["spec"]["mpiReplicaSpecs"].values()
              for c in spec["template"]["spec"]["containers"]}
    assert len(images) == 1 and f"-t {images.pop()} " in _dockerfile()   # the tag the documented build gives


def test_every_file_the_dockerfile_copies_exists():
    copies = [line.split()[1:-1] for line in _dockerfile().splitlines() if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert os.path.exists(os.path.join(REPO, source)), source


@pytest.mark.slow
def test_the_project_installs_into_a_plain_venv_as_the_dockerfile_does(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "-e", REPO], check=True, timeout=600,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    out = subprocess.run([python, "-c", "import horovod.numpy as hvd; hvd.init(); print(hvd.size())"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
