"""The README's Python examples, run as written.

Each ```python block of README.md is a complete program: it runs here in a fresh namespace, in
a scratch directory, so an example that stops working fails the suite. The README's shell
blocks are checked elsewhere: the `bf16opt` command lines by tests/test_cli.py, the `pip install`
lines by tests/test_packaging.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_its_examples():
    # Quickstart, per-group precision, checkpoint and resume, offload, update in backward, CUDA
    # graphs, telemetry
    assert len(python_blocks()) == 7


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = python_blocks()[index]
    if 'device="cuda"' in block and not torch.cuda.is_available():
        pytest.skip("this example needs a CUDA device")
    exec(compile(block, f"README.md example {index}", "exec"), {"__name__": "example"})  # noqa: S102
