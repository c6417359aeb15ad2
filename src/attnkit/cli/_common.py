"""Small helpers shared by the CLI commands: number formatting, matrix tables, PNG figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch


def fmt_number(x: float, digits: int = 4) -> str:
    """A float for a table cell: fixed point with ``digits`` decimals, scientific when tiny or huge."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e6):
        return f"{x:.{max(digits - 1, 1)}e}"
    return f"{x:.{digits}f}"


def matrix_table(matrix: torch.Tensor, *, title: str = "", row_name: str = "i",
                 col_labels: Optional[Sequence[str]] = None, extra: Optional[dict] = None,
                 digits: int = 4):
    """A rich table of a 2-D tensor ``[R, C]``: one row per query, columns labelled ``j=0..``.

    ``extra`` maps a column title to ``R`` values appended on the right (e.g. row sums).
    """
    from rich.table import Table

    rows, cols = matrix.shape
    table = Table(title=title or None, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column(row_name, justify="right", style="bold")
    for label in (col_labels or [f"{j}" for j in range(cols)]):
        table.add_column(label, justify="right")
    for name in (extra or {}):
        table.add_column(name, justify="right", style="italic")
    values = matrix.tolist()
    extra_values = [[float(v) for v in column] for column in (extra or {}).values()]
    for i in range(rows):
        cells = [fmt_number(float(x), digits) for x in values[i]]
        cells += [fmt_number(column[i], digits) for column in extra_values]
        table.add_row(str(i), *cells)
    return table


def agg_figure(**kwargs):
    """A matplotlib Figure drawn by the Agg canvas (no GUI, no pyplot global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(layout="constrained", **kwargs)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure, path) -> Path:
    """Write ``figure`` as a PNG at ``path`` (parent folders created); returns the path.
    Figures from :func:`agg_figure` lay themselves out (constrained layout): one draw only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path
