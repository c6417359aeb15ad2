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


def check_output(option: str, value, *names: str) -> Path:
    """Make sure a command can write its output, before it starts any work.

    ``value`` is the path given to ``option``: a file path, or, when ``names`` are given, a
    folder that will hold files of those names. The folder (``value`` itself, or the file's
    parent) is created if missing and a scratch file is created in it and removed; each output
    file must not be a folder and, if it exists, must be writable. Returns ``value`` as a
    :class:`~pathlib.Path`; raises :class:`UsageError` naming ``option`` otherwise.
    """
    path = Path(value)
    where = f"{option} {value}"
    if not names and (path.is_dir() or str(value).endswith(("/", os.sep))):
        raise UsageError(f"{where}: is a folder; give a file path such as {path / 'out.png'}")
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
