"""The examples in docs/INTEGRATIONS.md run, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATIONS.md"


def test_integration_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 8
    namespace: dict = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {number}", "exec"), namespace)  # noqa: S102
