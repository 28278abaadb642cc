"""docs/spark.md and docs/ray.md install horovod-next the way it is distributed: from a checkout or a wheel built
from one (it is on no package index), and the wheel their commands build installs with the extra they name."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = {"spark": REPO / "docs" / "spark.md", "ray": REPO / "docs" / "ray.md"}


def _install_block(page: pathlib.Path) -> str:
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    install = [b for b in blocks if "pip install" in b]
    assert install, f"{page.name} has no install commands"
    return install[0]


@pytest.mark.parametrize("extra", sorted(PAGES))
def test_install_commands_use_a_checkout_or_a_wheel(extra):
    block = _install_block(PAGES[extra])
    assert "pip install 'horovod-next" not in block and "pip install horovod-next" not in block, \
        f"{PAGES[extra].name} installs from a package index: {block}"
    assert f"pip install -e '.[{extra}]'" in block
    assert "pip wheel --no-deps -w dist ." in block and f"dist/horovod_next-*.whl)[{extra}]" in block


def test_the_documented_wheel_builds_and_takes_the_extras(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, timeout=300, capture_output=True)
    wheels = list(tmp_path.glob("horovod_next-*.whl"))
    assert len(wheels) == 1, wheels
    for extra in sorted(PAGES):
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                               f"{wheels[0]}[{extra}]"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "horovod-next" in proc.stdout
