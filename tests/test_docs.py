"""The documentation and the tests themselves: the examples in docs/INTEGRATIONS.md and
docs/SERVING.md run, what a user reads names no internal document, and no test asserts on
wall-clock time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "INTEGRATIONS.md"


def test_integration_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 8
    namespace: dict = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {number}", "exec"), namespace)  # noqa: S102


def test_serving_examples_run():
    """docs/SERVING.md: packed sequences, and a continuous-batching loop over paged caches
    whose tokens equal each request decoded alone (the example asserts it)."""
    text = (REPO / "docs" / "SERVING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"SERVING.md block {number}", "exec"), namespace)  # noqa: S102
    assert namespace["batched"] and all(namespace["batched"])


INTERNAL = re.compile(r"seed (document|doc\b|\d{3}|is wrong|printed)|seeds/|issue \d|the issue's"
                      r"|shared/", re.IGNORECASE)
"""Words that point at documents a user of the package has never seen (a random generator's
seed is fine)."""


def user_facing_files() -> list[Path]:
    """What a user reads: README, docs/, the package's sources, the benchmark and tool scripts."""
    return ([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
            + sorted((REPO / "src" / "attnkit").rglob("*.py"))
            + sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "tools").glob("*.py")))


def test_user_facing_text_names_no_internal_documents():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in user_facing_files()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if INTERNAL.search(line)]
    assert not found, "\n".join(found)


# ---- no test asserts on wall-clock time ----------------------------------------------------------

TIME_CALLS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "time"}
"""Functions of the ``time`` module that read a clock."""

TIME_NAME = re.compile(r"^(seconds|secs|elapsed\w*|duration\w*|took|wall\w*|times|start|t0|t1)$")
"""Variable names that hold a clock reading or a duration."""

TIME_KEY = re.compile(r"(^|_)(s|ms|us|ns|seconds|elapsed)$")
"""Dictionary keys that hold a duration (``median_s``, ``us``)."""


def _reads_clock(node: ast.AST, time_names: set[str]) -> bool:
    """Whether the expression ``node`` holds a clock reading or a duration."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in TIME_CALLS and (
                    func.attr != "time" or getattr(func.value, "id", None) == "time"):
                return True
            if isinstance(func, ast.Name) and func.id in TIME_CALLS - {"time"}:
                return True
        if isinstance(sub, ast.Name) and (TIME_NAME.match(sub.id) or sub.id in time_names):
            return True
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) \
                and isinstance(sub.slice.value, str) and TIME_KEY.search(sub.slice.value):
            return True
    return False


def timing_assertions(source: str) -> list[int]:
    """Line numbers of ``assert`` statements that bound a duration or clock reading by anything
    but 0 (``elapsed < 25``, ``perf_counter() - start < 30``, ``all(s < 10 for s in times)``):
    such a test fails on a slow or busy machine, not on wrong code. ``duration > 0`` is fine."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        time_names: set[str] = set()
        for sub in ast.walk(node.test):  # comprehension variables over durations are durations
            if isinstance(sub, ast.comprehension) and _reads_clock(sub.iter, time_names):
                time_names |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        for sub in ast.walk(node.test):
            if not isinstance(sub, ast.Compare) or not any(
                    isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in sub.ops):
                continue
            operands = [sub.left, *sub.comparators]
            timed = [_reads_clock(operand, time_names) for operand in operands]
            against_zero = all(t or (isinstance(o, ast.Constant) and o.value == 0)
                               for o, t in zip(operands, timed))
            if any(timed) and not against_zero:
                lines.append(node.lineno)
                break
    return lines


def test_the_timing_check_finds_timing_assertions():
    flagged = timing_assertions("\n".join([
        "assert time.perf_counter() - start < 25",
        "assert elapsed < 120",
        "assert all(seconds < 10 for seconds in run['errors'].values())",
        "assert all(t is not None and t < 10 for t in times.values())",
        "assert 1.8 <= float(seconds) < 7",
        "assert record['median_s'] < 2.0",
        "assert record['median_s'] > 0 and row['us'] > 0",  # 2.: positive, not a bound
        "assert len(blocks) >= 8",
        "assert error < 1e-5",
        "assert start == 0",
    ]))
    assert flagged == [1, 2, 3, 4, 5, 6]


def test_no_test_asserts_on_wall_clock_time():
    found = [f"{path.name}:{line}" for path in sorted((REPO / "tests").glob("*.py"))
             for line in timing_assertions(path.read_text())]
    assert not found, ("these assertions bound a wall-clock time, which fails on a slow or busy "
                       "machine: check what the time stood for instead (sizes, messages, counts): "
                       + ", ".join(found))
