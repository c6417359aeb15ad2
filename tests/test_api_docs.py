"""docs/API.md, the API reference, is generated from the docstrings by tools/gen_api.py: it
covers every public name and is current."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # attnkit.integrations.transformers is on the page

REPO = Path(__file__).resolve().parent.parent
REGENERATE = "python tools/gen_api.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "tools" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_page_is_current(generator):
    expected = generator.render()
    current = generator.OUT.read_text() if generator.OUT.exists() else ""
    diff = "".join(list(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                             "docs/API.md", "from the docstrings", n=1))[:40])
    assert current == expected, (f"docs/API.md is out of date with the docstrings; regenerate it "
                                 f"with `{REGENERATE}`:\n{diff}")


def test_api_page_covers_every_public_name(generator):
    text = generator.OUT.read_text()
    missing = [f"{module_name}.{name}" for module_name in generator.MODULES
               for name in importlib.import_module(module_name).__all__
               if f"### `{module_name}.{name}`" not in text]
    assert not missing, f"not on docs/API.md: {missing}; regenerate it with `{REGENERATE}`"
    for module_name in ("attnkit.nn", "attnkit.distributed", "attnkit.integrations.transformers"):
        assert f"## `{module_name}`" in text
