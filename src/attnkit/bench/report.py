"""Markdown of benchmark results, and the CPU targets (:func:`targets`) checked against them.

``benchmarks/cpu.py`` puts :func:`markdown` between the ``<!-- results:start -->`` and
``<!-- results:end -->`` markers of docs/BENCHMARKS.md with :func:`replace_section`.
"""

from __future__ import annotations

from typing import Optional

from .runner import first_sentence

START, END = "<!-- results:start -->", "<!-- results:end -->"

STRUCTURED = ("window", "documents", "causal_padding")


def replace_section(text: str, section: str) -> str:
    """``text`` with everything between the START and END markers replaced by ``section``;
    raises ``ValueError`` when the markers are missing or out of order."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document needs the markers {START} and {END}, in that order")
    return text[:start + len(START)] + "\n" + section.strip("\n") + "\n" + text[end:]


def _find(results: dict, workload: str, pass_name: str, method: str) -> Optional[dict]:
    for record in results["results"]:
        if (record["workload"], record["pass"], record["method"]) == (workload, pass_name, method):
            return record
    return None


def targets(results: dict) -> list[dict]:
    """The CPU targets, each with the measured value and whether it is met (``None``: not
    measured in this run). Values are speed-ups ``t_ref / t`` unless the target says time ratio.

    The targets: on dense attention, tiled within 1.15× and auto within 1.02× of torch SDPA's
    time; on window, documents and causal_padding, tiled forward ≥ 1.5× faster than compiled
    FlexAttention and ≥ 5× faster than SDPA with a dense mask, a first call under 1 s, and
    forward+backward ≥ 3× faster than SDPA with a dense mask; at most 64 MiB of extra peak
    memory for a causal forward+backward at the sweep's largest N."""
    rows = []

    def add(target, value, met, detail=""):
        rows.append({"target": target, "value": value, "met": met, "detail": detail})

    for method, limit in (("tiled", 1.15), ("auto", 1.02)):
        record = _find(results, "dense", "fwd", method)
        ratio = (1 / record["speedup"]["sdpa"]) if record and record["speedup"].get("sdpa") else None
        add(f"dense fwd: {method} time ≤ {limit}× torch SDPA", ratio,
            None if ratio is None else ratio <= limit, "time ratio t / t_SDPA")
    for workload in STRUCTURED:
        record = _find(results, workload, "fwd", "tiled")
        for column, limit, name in (("flex", 1.5, "compiled Flex (steady state)"),
                                    ("sdpa_mask", 5.0, "SDPA dense mask")):
            value = record["speedup"].get(column) if record else None
            add(f"{workload} fwd: tiled ≥ {limit}× faster than {name}", value,
                None if value is None else value >= limit)
    for workload in STRUCTURED:
        record = _find(results, workload, "fwd", "tiled")
        value = record["first_call_s"] if record else None
        flex = _find(results, workload, "fwd", "flex")
        detail = f"Flex first call {flex['first_call_s']:.1f} s" if flex and flex["first_call_s"] else ""
        add(f"{workload} fwd: tiled first call < 1 s", value, None if value is None else value < 1.0,
            detail)
    for workload in STRUCTURED:
        record = _find(results, workload, "fwd+bwd", "tiled")
        value = record["speedup"].get("sdpa_mask") if record else None
        add(f"{workload} fwd+bwd: tiled ≥ 3× faster than SDPA dense mask", value,
            None if value is None else value >= 3.0)
    memory = (results.get("memory") or {}).get("methods", {}).get("tiled")
    value = memory.get("extra_peak_mib") if memory else None
    n = (results.get("memory") or {}).get("n", "?")
    add(f"fwd+bwd causal N {n} H1 D64: tiled extra peak ≤ 64 MiB", value,
        None if value is None else value <= 64.0, "MiB")
    return rows


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def markdown(results: dict) -> str:
    """The results section: machine and command, one table per pass, memory and the sweep,
    and the targets."""
    machine = results["machine"]
    lines = [
        f"Measured {results['date']} on `{machine['hostname']}`: {machine['cpu_count']} CPUs "
        f"({machine['processor']}), **{machine['torch_threads']} torch threads**, torch "
        f"{machine['torch']}, attnkit {machine['attnkit']} (source "
        f"`{machine.get('source') or 'unknown'}`), Python {machine['python']}, {machine['platform']}.",
        "",
        f"Command: `{results['command']}` (total {results.get('elapsed_s', 0) / 60:.1f} min). "
        f"Rounds per method: {results['config']['min_reps']}–{results['config']['max_reps']} "
        f"(an equal share of a {results['config']['cell_budget_s']:.0f} s budget per workload × pass).",
        ""]
    for pass_name in ("fwd", "fwd+bwd"):
        records = [r for r in results["results"] if r["pass"] == pass_name]
        if not records:
            continue
        lines += [f"#### {'Forward' if pass_name == 'fwd' else 'Forward + backward'}", "",
                  "| workload | method | median ms | IQR ms | n | TFLOP/s | vs SDPA mask | vs Flex "
                  "| first call s | max err vs tiled | note |",
                  "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
        previous = None
        for r in records:
            workload = f"**{r['workload']}**" if r["workload"] != previous else ""
            previous = r["workload"]
            note = first_sentence(r["reason"])
            if r["status"] == "mismatch":
                note = f"**disagrees with tiled** (> {results['config']['tolerance']:g})"
            elif r["backend"]:
                note = f"auto picked `{r['backend']}`"
            if r["status"] == "ok" and r["method"] == "sdpa" and r["kind"] not in ("dense", "causal"):
                note = "mask ignored: speed reference only"
            speed = {c: _cell(r["speedup"].get(c), "{:.2f}×") for c in ("sdpa_mask", "flex")}
            lines.append(
                f"| {workload} | {r['label']} | {_ms(r['median_s'])} | {_ms(r['iqr_s'])}"
                f" | {r['n']} | {_cell(r['tflops'], '{:.3f}')} | {speed['sdpa_mask']} | {speed['flex']}"
                f" | {_cell(r['first_call_s'])} | {_cell(r['max_err'], '{:.1e}')} | {note} |")
        lines.append("")
    sweep = results.get("sweep") or []
    if sweep:
        lengths = sorted({r["n"] for r in sweep})
        methods = list(dict.fromkeys(r["method"] for r in sweep))
        labels = {r["method"]: r["label"] for r in sweep}
        notes = {r["method"]: r["reason"] for r in sweep if r["status"] == "unsupported"}
        shape = sweep_shape(sweep)
        for title, key, fmt in ((f"Extra peak memory (MiB), forward+backward, causal, {shape}",
                                 "extra_peak_mib", "{:.1f}"),
                                (f"Time (s), forward+backward, causal, {shape}", "median_s", "{:.3f}")):
            lines += [f"#### {title}", "", "| method | " + " | ".join(f"N={n}" for n in lengths) + " |",
                      "|---|" + "--:|" * len(lengths)]
            for method in methods:
                cells = []
                for n in lengths:
                    row = next((r for r in sweep if r["method"] == method and r["n"] == n), None)
                    if row is None or row["status"] == "unsupported":
                        cells.append("n/a")
                    elif row["status"] == "skipped":
                        cells.append("skipped")
                    else:
                        cells.append(_cell(row.get(key), fmt))
                lines.append(f"| {labels[method]} | " + " | ".join(cells) + " |")
            lines.append("")
        for method, reason in notes.items():
            lines.append(f"n/a — {labels[method]}: {first_sentence(reason)}.")
        lines.append("")
    lines += ["#### Targets (this run)", "", "| target | measured | met |", "|---|--:|:-:|"]
    for row in targets(results):
        met = "—" if row["met"] is None else ("yes" if row["met"] else "**short**")
        value = _cell(row["value"])
        if row["detail"]:
            value += f" ({row['detail']})"
        lines.append(f"| {row['target']} | {value} | {met} |")
    return "\n".join(lines) + "\n"


def sweep_shape(sweep: list) -> str:
    """``"H1 D64"``: the heads and head dim of the memory sweep's rows (as measured)."""
    first = sweep[0] if sweep else {}
    return f"H{first.get('heads', 1)} D{first.get('head_dim', 64)}"
