"""Small helpers shared by the CLI commands: usage errors, output-path checks, number
formatting, matrix tables, PNG figures."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch


class UsageError(ValueError):
    """A mistake in the command line or its input files. :func:`attnkit.cli.main` prints the
    message as one line ``attnkit COMMAND: error: MESSAGE`` on stderr and exits with code 2.
    Messages name the argument, what is wrong with it and how to fix it."""


def check_device(option: str, value: str) -> str:
    """``value`` when it names a device this machine can allocate on (``cpu``, ``cuda``,
    ``cuda:1`` ...); else :class:`UsageError` naming ``option``."""
    usable = "cpu" + (", or cuda" if torch.cuda.is_available() else "")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise UsageError(f"{option} {value}: not a device name; use {usable}") from None
    if device.type == "meta":
        raise UsageError(f"{option} {value}: meta tensors hold no values to compute or "
                         f"compare; use {usable}")
    try:
        torch.empty(0, device=value)
    except Exception as error:  # torch raises many kinds for devices it was not built with
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise UsageError(f"{option} {value}: not a device this machine has ({reason}); use "
                         f"{usable}") from None
    return value


FILE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".json", ".txt")
"""Endings that name a file: :func:`check_output` refuses them for a folder it would create."""


def check_output(option: str, value, *names: str) -> Path:
    """Make sure a command can write its output, before it starts any work.

    ``value`` is the path given to ``option``: a file path, or, when ``names`` are given, a
    folder that will hold files of those names. The folder (``value`` itself, or the file's
    parent) is created if missing and a scratch file is created in it and removed; each output
    file must not be a folder and, if it exists, must be writable. A folder that does not
    exist yet may not end like a file (:data:`FILE_SUFFIXES`, e.g. ``--out plot.png``).
    Returns ``value`` as a :class:`~pathlib.Path`; raises :class:`UsageError` naming ``option``
    otherwise.
    """
    path = Path(value)
    where = f"{option} {value}"
    if not names and (path.is_dir() or str(value).endswith(("/", os.sep))):
        raise UsageError(f"{where}: is a folder; give a file path such as {path / 'out.png'}")
    if names and path.suffix.lower() in FILE_SUFFIXES and not path.exists():
        raise UsageError(f"{where}: names a file, where a folder for {', '.join(names)} goes; "
                         f"give a folder path such as {path.with_suffix('')} (it is created if "
                         f"missing)")
    folder = path if names else path.parent
    if folder.exists() and not folder.is_dir():
        fix = "give a folder path (it is created if missing)" if names else "choose another path"
        raise UsageError(f"{where}: {folder} is a file, not a folder; {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".attnkit-write-check-"):
            pass
    except OSError as error:
        raise UsageError(f"{where}: cannot create or write in the folder {folder} "
                         f"({error.strerror or error}); choose a path in a writable folder") from None
    for file in ([path / name for name in names] if names else [path]):
        if file.is_dir():
            raise UsageError(f"{where}: {file} is a folder, where a file goes; remove it or "
                             f"choose another path")
        if file.exists() and not os.access(file, os.W_OK):
            raise UsageError(f"{where}: {file} exists and is not writable; make it writable "
                             f"or choose another path")
    return path


def seed_type(text: str) -> int:
    """argparse ``type=`` for a random seed: an integer from 0 to 2**32 − 1."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= seed < 2 ** 32:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: give an integer from 0 to "
                                         f"{2 ** 32 - 1}")
    return seed


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
                 digits: int = 4, width: Optional[int] = None, max_rows: Optional[int] = None):
    """A rich table of a 2-D tensor ``[R, C]``: one row per query, columns labelled ``j=0..``.

    ``extra`` maps a column title to ``R`` values appended on the right (e.g. row sums).
    ``width`` (characters, e.g. ``console.width``): when the columns do not fit in it, the
    middle ones are left out behind one ``…`` column (the first ones, the last one and the
    ``extra`` ones stay), so every cell shown keeps its digits. ``max_rows``: at most this many
    rows are shown, the last one after a ``…`` row. A caption names what was left out.
    """
    from rich.table import Table

    rows, cols = matrix.shape
    labels = list(col_labels or [f"{j}" for j in range(cols)])
    shown_rows = (list(range(rows)) if max_rows is None or rows <= max(max_rows, 2)
                  else list(range(max(max_rows, 2) - 1)) + [None, rows - 1])
    picked = [i for i in shown_rows if i is not None]
    values = matrix[picked].tolist()  # only the rows shown are formatted
    cells = {i: [fmt_number(float(x), digits) for x in row] for i, row in zip(picked, values)}
    extra_cells = [{i: fmt_number(float(column[i]), digits) for i in picked}
                   for column in (extra or {}).values()]
    fixed = [max(len(row_name), len(str(rows - 1)))]  # the row labels, then the extra columns
    fixed += [max([len(name)] + [len(c) for c in column.values()])
              for name, column in zip(extra or {}, extra_cells)]
    shown_cols = _fit_columns(labels, list(cells.values()), width, fixed)
    left_out = []
    if None in shown_cols:
        first, last = shown_cols[shown_cols.index(None) - 1] + 1, shown_cols[-1] - 1
        left_out.append(f"columns {labels[first]}…{labels[last]}")
    if None in shown_rows:
        first, last = shown_rows[-3] + 1, rows - 2
        left_out.append(f"rows {first}…{last}")
    caption = f"not shown: {', '.join(left_out)} (of {rows} × {cols})" if left_out else None
    table = Table(title=title or None, title_justify="left", caption=caption,
                  caption_justify="left", show_edge=False, pad_edge=False)
    table.add_column(row_name, justify="right", style="bold")
    for j in shown_cols:
        table.add_column("…" if j is None else labels[j], justify="right")
    for name in (extra or {}):
        table.add_column(name, justify="right", style="italic")
    for i in shown_rows:
        if i is None:
            table.add_row("…", *["…"] * (len(shown_cols) + len(extra_cells)))
            continue
        table.add_row(str(i), *["…" if j is None else cells[i][j] for j in shown_cols],
                      *[column[i] for column in extra_cells])
    return table


def _fit_columns(labels: Sequence[str], cells: list, width: Optional[int],
                 fixed: Sequence[int]) -> list:
    """Indices of the columns :func:`matrix_table` shows within ``width`` characters, ``None``
    standing for the ``…`` column that replaces the ones left out. ``fixed``: the widths of the
    columns always shown (row labels, extra columns). A column takes its widest text plus 3
    (padding and the rule between columns)."""
    cols = len(labels)
    widths = [max([len(labels[j])] + [len(row[j]) for row in cells]) + 3 for j in range(cols)]
    budget = None if width is None else width + 3 - sum(w + 3 for w in fixed)
    if budget is None or cols <= 2 or sum(widths) <= budget:
        return list(range(cols))
    budget -= widths[-1] + 4  # the last column and the "…" column stay
    keep = 0
    while keep < cols - 2 and widths[keep] <= budget:
        budget -= widths[keep]
        keep += 1
    return list(range(max(keep, 1))) + [None, cols - 1]


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
