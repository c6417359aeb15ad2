"""The ``attnkit`` command line as a user meets it: Ctrl-C, non-UTF-8 output, matrices wider
or longer than the console, heatmaps of long sequences, sizes explain cannot hold.

Every command runs in-process through ``cli.main([...])``.
"""

from __future__ import annotations

import io
import struct
import sys

import numpy as np
import pytest
import torch

import attnkit
from attnkit import cli
from attnkit.cli._common import matrix_table


def one_line_on_stderr(capsys) -> str:
    """The single line on stderr (asserting there is exactly one and no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    data = path.read_bytes()
    return struct.unpack(">II", data[16:24])


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnkit {attnkit.__version__}"


def test_ctrl_c_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    from attnkit.bench import runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_benchmark", interrupted)
    try:
        code = cli.main(["bench", "--quick", "--no-memory", "--out", str(tmp_path / "b")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped attnkit.cli.main as a traceback")
    assert code == 130
    assert one_line_on_stderr(capsys) == "attnkit bench: interrupted (Ctrl-C)"
    assert not (tmp_path / "b" / "cpu.json").exists()


def test_output_to_an_ascii_stream_writes_question_marks(monkeypatch):
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stream)
    assert cli.main(["explain"]) == 0
    stream.flush()
    text = raw.getvalue().decode("ascii")
    assert "scale = 1/?2 = 0.707107" in text  # √ cannot be written in ASCII
    assert "2.8690" in text  # O[2] of the built-in example


def long_npy(tmp_path, rows: int, cols: int) -> str:
    """The path of a ``[rows, cols]`` float64 .npy file of distinct values in [0, 1)."""
    path = tmp_path / f"q{rows}x{cols}.npy"
    np.save(path, np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) / (rows * cols))
    return str(path)


def test_explain_of_a_long_sequence_keeps_every_digit_shown(tmp_path, capsys):
    # 64 positions: the 64-column score tables are wider than the 140 characters of a
    # non-terminal console and longer than the rows explain prints.
    assert cli.main(["explain", "--q", long_npy(tmp_path, 64, 2)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 140
    assert "not shown: columns" in out and "rows 31…62 (of 64 × 64)" in out
    scores_row_1 = next(line for line in lines[lines.index(next(
        line for line in lines if "2. Scores" in line)):] if line.lstrip().startswith("1 │"))
    cells = [cell.strip() for cell in scores_row_1.split("│")]
    assert "…" in cells
    assert all(cell == "…" or len(cell.split(".")[-1]) == 4 for cell in cells[1:]), cells
    assert "LSE[63] = " in out and "LSE[40] = " not in out


def test_matrix_table_fits_a_narrow_console():
    from rich.console import Console

    matrix = torch.linspace(-1, 1, 6 * 30, dtype=torch.float64).reshape(6, 30)  # [6, 30]
    console = Console(width=40, record=True, file=io.StringIO())
    console.print(matrix_table(matrix, width=40, max_rows=4,
                               extra={"row sum": matrix.sum(-1).tolist()}))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 40
    header = [cell.strip() for cell in lines[0].split("┃")]
    assert header[:2] == ["i", "0"] and header[-3:] == ["…", "29", "row sum"]
    assert lines[2].split("│")[1].strip() == "-1.0000"
    assert lines[6].split("│")[0].strip() == "5"  # rows 0-2, "…", the last row
    caption = " ".join(line.strip() for line in lines[7:])
    assert caption == "not shown: columns 1…28, rows 3…4 (of 6 × 30)"


def test_explain_plot_of_a_long_sequence_stays_screen_sized(tmp_path, capsys):
    path = tmp_path / "w.png"
    assert cli.main(["explain", "--q", long_npy(tmp_path, 64, 2), "--causal", "--plot",
                     str(path)]) == 0
    width, height = png_size(path)
    assert width <= 2000 and height <= 2000, (width, height)


def test_explain_refuses_more_scores_than_it_can_hold(tmp_path, capsys):
    path = tmp_path / "q.npy"
    np.save(path, np.zeros((4097, 1)))  # 4097² scores, one more row than 4096 × 4096
    assert cli.main(["explain", "--q", str(path)]) == 2
    line = one_line_on_stderr(capsys)
    assert line.startswith("attnkit explain: error: --q/--k: 1 × 1 × 4097 × 4097 attention scores")
    assert "at most 16777216" in line


def test_explain_of_a_vector_says_how_to_write_a_matrix(capsys):
    assert cli.main(["explain", "--q", "[1, 2, 3]"]) == 2
    line = one_line_on_stderr(capsys)
    assert line.startswith("attnkit explain: error: --q: '[1, 2, 3]' is one vector (shape (3,))")
    assert "'[[1,0]]'" in line and "q[None]" not in line


def test_explain_takes_a_json_matrix_longer_than_a_file_name(capsys):
    text = str([[0.001 * i, 1.0] for i in range(40)])  # > 255 characters: no file is that long
    assert len(text) > 255
    assert cli.main(["explain", "--q", text]) == 0
    assert "shape [40, 40]" in capsys.readouterr().out


@pytest.mark.parametrize("command, name", [("scale-study", "plot.png"), ("demo", "out.pdf"),
                                           ("bench", "results.json")])
def test_out_folder_named_like_a_file_is_a_usage_error(tmp_path, monkeypatch, capsys, command,
                                                       name):
    monkeypatch.chdir(tmp_path)
    argv = [command, "--out", name] + (["--quick"] if command == "bench" else [])
    assert cli.main(argv) == 2
    line = one_line_on_stderr(capsys)
    assert line.startswith(f"attnkit {command}: error: --out {name}: names a file")
    assert f"give a folder path such as {name.rsplit('.', 1)[0]}" in line
    assert list(tmp_path.iterdir()) == []


def test_main_puts_the_stdout_error_handler_back(monkeypatch):
    """main() called in-process (a notebook, a test) leaves sys.stdout as it found it."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stream)
    assert cli.main(["explain"]) == 0
    assert stream.errors == "strict"
