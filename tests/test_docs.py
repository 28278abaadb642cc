"""Documentation that is generated from code must match the code."""
import os

from horovod.engine import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_knobs_page_is_generated_from_the_knob_table():
    with open(os.path.join(REPO, "docs", "knobs.md"), encoding="utf-8") as f:
        assert f.read() == config.markdown_table(), "regenerate: python -m horovod.engine.config > docs/knobs.md"


def test_readme_opens_with_the_two_commands():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    first, second = text.index("horovodrun -np 2 python examples/torch/train_digits.py"), text.index("bash .ci/run")
    assert first < second
    assert os.path.exists(os.path.join(REPO, "examples", "torch", "train_digits.py"))
