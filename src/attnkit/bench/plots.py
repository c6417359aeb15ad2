"""PNG figures of benchmark results (matplotlib's Agg canvas: no display, no pyplot state).

- ``time_vs_n.png``: forward+backward time against N, log-log, one line per method,
- ``memory_vs_n.png``: extra peak memory against N, log-log, one line per method,
- ``speedups.png``: per workload, every method's speed-up over torch SDPA with a dense mask
  (torch SDPA without the mask is left out where the workload has one: it ignores it).

Each figure has one legend, under its plots.
"""

from __future__ import annotations

import math
import os

from .runner import PASSES, sizes

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
    """A Figure on the Agg canvas, laid out by constrained layout (room for a legend outside)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(layout="constrained", **kwargs)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path


def _legend_below(figure, handles, labels) -> None:
    """One legend for the whole figure, under the plots (never over a line or a bar)."""
    if handles:
        figure.legend(handles, labels, loc="outside lower center",
                      ncol=len(labels) if len(labels) <= 4 else 3, fontsize=8, frameon=False)


def against_n_figure(sweep: list[dict], value: str, ylabel: str, title: str, scale: float = 1.0):
    """``value`` (× ``scale``) of each sweep record against N, log-log, one line per method;
    returns the Figure."""
    figure = _figure(figsize=(6.4, 4.8))
    axes = figure.add_subplot()
    for method, (label, colour, marker) in METHOD_STYLE.items():
        points = sorted((r["n"], r[value] * scale) for r in sweep
                        if r["method"] == method and r.get(value) is not None and r[value] > 0)
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, ys, marker=marker, color=colour, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    _label_log_axis(axes.yaxis, suffix="")
    lengths = sorted({r["n"] for r in sweep})
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.xaxis.set_minor_locator(_null_locator())
    axes.set_xlabel("sequence length N")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    _legend_below(figure, *axes.get_legend_handles_labels())
    return figure


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _label_log_axis(axis, suffix: str) -> None:
    """Plain numbers on a log axis (``0.5``, ``2``, ``1000``, with ``suffix``), the 2 and 5
    minor ticks labelled too, so that a narrow range still shows values."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}{suffix}"))
    axis.set_minor_formatter(FuncFormatter(lambda y, position: _minor_label(y, position, suffix)))


def time_vs_n(sweep: list[dict], path: str) -> str:
    """Median forward+backward time (s) against N, one line per method → ``path``."""
    return _save(against_n_figure(sweep, "median_s", "forward+backward time (s)",
                                  f"causal, {_shape(sweep)} fp32, forward+backward"), path)


def memory_vs_n(sweep: list[dict], path: str) -> str:
    """Extra peak memory (MiB, RSS high-water mark) against N, one line per method → ``path``."""
    return _save(against_n_figure(sweep, "extra_peak_mib", "extra peak memory (MiB)",
                                  f"causal, {_shape(sweep)} fp32, forward+backward: peak beyond "
                                  f"inputs/outputs/grads"), path)


def _shape(sweep: list[dict]) -> str:
    first = sweep[0] if sweep else {}
    return f"B1 H{first.get('heads', '?')} D{first.get('head_dim', '?')}"


def speedup_bars(records: list[dict], reference: str = "sdpa_mask") -> dict[str, list[tuple[str, float]]]:
    """Bars of one pass: method → ``[(workload, speed-up over reference), ...]`` in workload
    order, for every method but the reference. A record that ignores its workload's mask (SDPA
    without the window mask) gets no bar: its time is not that of the same computation."""
    bars: dict[str, list[tuple[str, float]]] = {}
    for method in METHOD_STYLE:
        if method == reference:
            continue
        values = [(r["workload"], r["speedup"][reference]) for r in records
                  if r["method"] == method and r["speedup"].get(reference)
                  and not _ignores_mask(r)]
        if values:
            bars[method] = values
    return bars


def speedups_figure(results: list[dict], reference: str = "sdpa_mask"):
    """Grouped bars: for each workload (and pass), each method's speed-up over ``reference``
    (log scale; the line at 1 is the reference itself), one legend under the figure; returns
    the Figure."""
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in results)]
    figure = _figure(figsize=(9.0, 1.0 + 3.4 * max(1, len(passes))))
    handles = {}
    for row, pass_name in enumerate(passes):
        axes = figure.add_subplot(len(passes), 1, row + 1)
        records = [r for r in results if r["pass"] == pass_name]
        workloads = list(dict.fromkeys(r["workload"] for r in records))
        bars = speedup_bars(records, reference)
        width = 0.8 / max(1, len(bars))
        for slot, (method, values) in enumerate(bars.items()):
            label, colour, _ = METHOD_STYLE[method]
            xs = [workloads.index(workload) - 0.4 + width * (slot + 0.5) for workload, _ in values]
            handles[label] = axes.bar(xs, [value for _, value in values], width=width, color=colour,
                                      label=label)
        left_out = list(dict.fromkeys(r["workload"] for r in records if _ignores_mask(r)))
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_yscale("log")
        _label_log_axis(axes.yaxis, suffix="×")
        shapes = {r["workload"]: sizes(r) for r in records}
        axes.set_xticks(range(len(workloads)), [f"{w}\n{shapes[w]}" for w in workloads], fontsize=8)
        axes.set_ylabel(f"speed-up vs {METHOD_STYLE[reference][0]}", fontsize=8)
        note = (f"\nnot drawn: torch SDPA without the mask on {', '.join(left_out)} (it ignores "
                f"the mask)" if left_out else "")
        axes.set_title(f"{pass_name}: higher is faster{note}", fontsize=10 if not note else 9)
        axes.grid(True, axis="y", which="both", alpha=0.3)
    _legend_below(figure, list(handles.values()), list(handles))
    return figure


def speedups(results: list[dict], path: str, reference: str = "sdpa_mask") -> str:
    """:func:`speedups_figure` written as a PNG at ``path``; returns the path."""
    return _save(speedups_figure(results, reference), path)


def _ignores_mask(record: dict) -> bool:
    """Whether a record timed a method without its workload's mask (records written before
    the ``ignores_mask`` field: torch SDPA on a workload other than dense or causal)."""
    return record.get("ignores_mask", record["method"] == "sdpa"
                      and record.get("kind") not in ("dense", "causal"))


def _minor_label(y: float, _position, suffix: str = "×") -> str:
    """Label the 2 and 5 minor ticks of a log axis (0.2, 0.5, 2, 5, 20, …), not the others."""
    if y <= 0:
        return ""
    leading = y / 10 ** math.floor(math.log10(y))
    return f"{y:g}{suffix}" if min(abs(leading - 2), abs(leading - 5)) < 1e-6 else ""


FIGURES = ("time_vs_n.png", "memory_vs_n.png", "speedups.png")
"""The files :func:`write_all` writes, by name."""


def left_out(results: dict, reference: str = "sdpa_mask") -> dict[str, str]:
    """Figure name → why :func:`write_all` does not draw it for ``results`` (no line or bar to
    draw); the figures not named here are drawn."""
    reasons = {}
    sweep = results.get("sweep") or []
    for name, value in (("time_vs_n.png", "median_s"), ("memory_vs_n.png", "extra_peak_mib")):
        if not any(r.get(value) is not None and r[value] > 0 for r in sweep):
            reasons[name] = ("no measurement against N in this run, as asked by --no-memory"
                             if not sweep else "no method measured against N")
    records = results.get("results") or []
    if not any(speedup_bars([r for r in records if r["pass"] == p], reference) for p in PASSES):
        label = METHOD_STYLE[reference][0]
        reasons["speedups.png"] = (
            f"no speed-up over {label} to draw" if any(r["method"] == reference for r in records)
            else f"the speed-ups are over {label}, not timed in this run (add {reference} to "
                 f"--methods)")
    return reasons


def write_all(results: dict, out_dir: str) -> list[str]:
    """Every figure the results allow (see :func:`left_out`), written into ``out_dir``; any
    other file of :data:`FIGURES` already there is removed, so that the folder holds the
    figures of one run only. Returns the paths written."""
    skipped = left_out(results)
    for name in skipped:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    paths = []
    if "time_vs_n.png" not in skipped:
        paths.append(time_vs_n(results["sweep"], os.path.join(out_dir, "time_vs_n.png")))
    if "memory_vs_n.png" not in skipped:
        paths.append(memory_vs_n(results["sweep"], os.path.join(out_dir, "memory_vs_n.png")))
    if "speedups.png" not in skipped:
        paths.append(speedups(results["results"], os.path.join(out_dir, "speedups.png")))
    return paths
