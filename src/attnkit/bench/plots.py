"""PNG figures of benchmark results (matplotlib's Agg canvas: no display, no pyplot state).

- ``time_vs_n.png``: forward+backward time against N, log-log, one line per method,
- ``memory_vs_n.png``: extra peak memory against N, log-log, one line per method,
- ``speedups.png``: per workload, every method's speed-up over torch SDPA with a dense mask.
"""

from __future__ import annotations

import math
import os
from typing import Optional

METHOD_STYLE = {
    "tiled": ("attnkit tiled", "tab:blue", "o"),
    "auto": ("attnkit auto", "tab:cyan", "v"),
    "sdpa": ("torch SDPA (no mask / is_causal)", "tab:green", "s"),
    "sdpa_mask": ("torch SDPA dense mask", "tab:orange", "^"),
    "flex": ("FlexAttention compiled", "tab:purple", "D"),
    "naive": ("naive", "tab:red", "x"),
}
"""Method key → (legend label, colour, marker), the same in every figure."""


def _figure(**kwargs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


def _against_n(sweep: list[dict], value: str, scale: float, ylabel: str, title: str, path: str) -> str:
    figure = _figure(figsize=(6.4, 4.4))
    axes = figure.add_subplot()
    for method, (label, colour, marker) in METHOD_STYLE.items():
        points = sorted((r["n"], r[value] * scale) for r in sweep
                        if r["method"] == method and r.get(value) is not None and r[value] > 0)
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, ys, marker=marker, color=colour, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    lengths = sorted({r["n"] for r in sweep})
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.minorticks_off()
    axes.set_xlabel("sequence length N")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    if axes.lines:
        axes.legend(fontsize=8)
    return _save(figure, path)


def time_vs_n(sweep: list[dict], path: str) -> str:
    """Median forward+backward time (s) against N, one line per method → ``path``."""
    return _against_n(sweep, "median_s", 1.0, "forward+backward time (s)",
                      f"causal, {_shape(sweep)} fp32, forward+backward", path)


def memory_vs_n(sweep: list[dict], path: str) -> str:
    """Extra peak memory (MiB, RSS high-water mark) against N, one line per method → ``path``."""
    return _against_n(sweep, "extra_peak_mib", 1.0, "extra peak memory (MiB)",
                      f"causal, {_shape(sweep)} fp32, forward+backward: peak beyond "
                      f"inputs/outputs/grads", path)


def _shape(sweep: list[dict]) -> str:
    first = sweep[0] if sweep else {}
    return f"B1 H{first.get('heads', '?')} D{first.get('head_dim', '?')}"


def speedups(results: list[dict], path: str, reference: str = "sdpa_mask") -> str:
    """Grouped bars: for each workload (and pass), each method's speed-up over ``reference``
    (log scale; the line at 1 is the reference itself) → ``path``."""
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in results)]
    from matplotlib.ticker import FuncFormatter

    figure = _figure(figsize=(9.0, 3.6 * max(1, len(passes))))
    for row, pass_name in enumerate(passes):
        axes = figure.add_subplot(len(passes), 1, row + 1)
        records = [r for r in results if r["pass"] == pass_name]
        workloads = list(dict.fromkeys(r["workload"] for r in records))
        methods = [m for m in METHOD_STYLE if m != reference
                   and any(r["method"] == m and r["speedup"].get(reference) for r in records)]
        width = 0.8 / max(1, len(methods))
        for slot, method in enumerate(methods):
            label, colour, _ = METHOD_STYLE[method]
            xs, ys = [], []
            for position, workload in enumerate(workloads):
                value = _speedup_of(records, workload, method, reference)
                if value is not None:
                    xs.append(position - 0.4 + width * (slot + 0.5))
                    ys.append(value)
            axes.bar(xs, ys, width=width, color=colour, label=label)
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}×"))
        axes.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
        axes.set_xticks(range(len(workloads)), workloads)
        axes.set_ylabel(f"speed-up vs {METHOD_STYLE[reference][0]}", fontsize=8)
        axes.set_title(f"{pass_name}: higher is faster", fontsize=10)
        axes.grid(True, axis="y", which="both", alpha=0.3)
        if methods:
            axes.legend(fontsize=7, ncol=3)
    return _save(figure, path)


def _minor_label(y: float, _position) -> str:
    """Label the 2× and 5× minor ticks of a log axis (0.2, 0.5, 2, 5, 20, …), not the others."""
    if y <= 0:
        return ""
    leading = y / 10 ** math.floor(math.log10(y))
    return f"{y:g}×" if min(abs(leading - 2), abs(leading - 5)) < 1e-6 else ""


def _speedup_of(records: list[dict], workload: str, method: str, reference: str) -> Optional[float]:
    for record in records:
        if record["workload"] == workload and record["method"] == method:
            return record["speedup"].get(reference)
    return None


def write_all(results: dict, out_dir: str) -> list[str]:
    """Every figure the results allow, written into ``out_dir``; returns their paths."""
    paths = []
    if results.get("sweep"):
        paths.append(time_vs_n(results["sweep"], os.path.join(out_dir, "time_vs_n.png")))
        paths.append(memory_vs_n(results["sweep"], os.path.join(out_dir, "memory_vs_n.png")))
    if results.get("results"):
        paths.append(speedups(results["results"], os.path.join(out_dir, "speedups.png")))
    return paths
