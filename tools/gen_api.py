"""Write docs/API.md, the API reference, from the docstrings of attnkit's public names.

    python tools/gen_api.py            # (re)write docs/API.md
    python tools/gen_api.py --check    # exit 1 when docs/API.md differs from the docstrings

Covers every name in the ``__all__`` of :data:`MODULES`, in that order: each function's and
class's signature and docstring, and each class's own public methods and properties. Standard
library only (``inspect``); ``tests/test_api_docs.py`` keeps the page in sync.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "API.md"

MODULES = ("attnkit", "attnkit.nn", "attnkit.distributed", "attnkit.integrations.transformers")
"""The modules whose ``__all__`` is the public API, in page order."""

HEADER = """# API reference

Every public name of attnkit with its signature and docstring, generated from the source by
`python tools/gen_api.py` (do not edit by hand; `tests/test_api_docs.py` checks it is current).
Shapes follow the project's names: `B` batch, `H` heads (`Hq` query, `Hkv` key/value), `T`
sequence length (`Tq` queries, `Tk` keys), `D` head dimension (`Dk` query/key, `Dv` value).
"""


def _docstring(obj) -> str:
    """The object's own docstring, dedented, as a fenced block (empty when it has none)."""
    text = inspect.getdoc(obj) if not isinstance(obj, property) else inspect.cleandoc(obj.__doc__ or "")
    return f"```text\n{text}\n```\n" if text else ""


class _Text:
    """An annotation written as source text (``from __future__ import annotations``), shown
    without quotes."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(annotation):
    if isinstance(annotation, str):
        return _Text(annotation)
    if hasattr(annotation, "__forward_arg__"):  # typing.ForwardRef
        return _Text(annotation.__forward_arg__)
    return annotation


def _signature(obj, *, bound: bool = False) -> str:
    """``(q: torch.Tensor, ...) -> Result`` of ``obj``: annotations as written, parameters named
    with a leading underscore (private) left out, and ``self``/``cls`` when ``bound``."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and some C types have none
        return "(...)"
    parameters = list(signature.parameters.values())
    if bound and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    parameters = [p.replace(annotation=_annotation(p.annotation)) for p in parameters
                  if not p.name.startswith("_")]
    return str(signature.replace(parameters=parameters,
                                 return_annotation=_annotation(signature.return_annotation)))


def _code(name: str, signature: str) -> str:
    return f"```python\n{name}{signature}\n```\n"


def _members(cls) -> list[tuple[str, object]]:
    """The class's own public methods and properties, in definition order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            members.append((name, value))
    return members


def _class(path: str, cls) -> list[str]:
    lines = [f"### `{path}`", "", f"class{_bases(cls)}", "", _code(cls.__name__, _signature(cls))]
    if hasattr(cls, "_fields"):  # a NamedTuple: its fields are its interface
        lines += [f"Fields: {', '.join(f'`{field}`' for field in cls._fields)}.", ""]
    lines += [_docstring(cls)]
    for name, member in _members(cls):
        if isinstance(member, property):
            lines += [f"#### `{path}.{name}`", "", "property", "", _docstring(member)]
        else:
            lines += [f"#### `{path}.{name}`", "", _code(name, _signature(member, bound=True)),
                      _docstring(member)]
    return lines


def _bases(cls) -> str:
    bases = [base for base in cls.__bases__ if base is not object]
    names = [f"{base.__module__}.{base.__qualname__}" if base.__module__ != "builtins"
             else base.__qualname__ for base in bases]
    return f" ({', '.join(f'`{name}`' for name in names)})" if names else ""


def _entry(module_name: str, name: str, value) -> list[str]:
    path = f"{module_name}.{name}"
    if isinstance(value, types.ModuleType):
        if value.__name__ in MODULES:
            return [f"### `{path}`", "", f"Module: see [`{value.__name__}`](#{_anchor(value.__name__)}).", ""]
        first = (inspect.getdoc(value) or "").split("\n\n")[0]
        return [f"### `{path}`", "", f"Module `{value.__name__}`:", "",
                f"```text\n{first}\n```\n" if first else ""]
    if inspect.isclass(value):
        return _class(path, value)
    if callable(value):
        return [f"### `{path}`", "", _code(name, _signature(value)), _docstring(value)]
    return [f"### `{path}`", "", f"`{path} = {value!r}`", ""]


def _anchor(module_name: str) -> str:
    """GitHub's anchor of the heading ``## `module_name` ``."""
    return module_name.replace(".", "").lower()


def render() -> str:
    """The whole page."""
    lines = [HEADER]
    lines += ["Modules: " + ", ".join(f"[`{m}`](#{_anchor(m)})" for m in MODULES) + ".", ""]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _docstring(module)]
        for name in module.__all__:
            lines += _entry(module_name, name, getattr(module, name))
    text = "\n".join(line.rstrip() for line in "\n".join(lines).splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/API.md instead of writing it; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.exists() and OUT.read_text() == text:
            return 0
        print(f"{OUT.relative_to(REPO)} is out of date: run python tools/gen_api.py", file=sys.stderr)
        return 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
