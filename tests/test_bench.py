"""The benchmark machinery: workloads (FLOPs, three equivalent masks), the interleaved runner and
its mismatch flag, the memory measurement in fresh processes, and ``attnkit bench --quick``
end to end. Tests check results, never speed."""

from __future__ import annotations

import io
import json

import pytest
import torch

from attnkit.bench import memory, plots, report, runner
from attnkit.bench.workloads import Workload, quick_workloads, select, standard_workloads
from attnkit.cli import main as cli_main

N_SMALL = 100  # not a multiple of any block size or document length below


def small_workloads(n: int = N_SMALL) -> list[Workload]:
    """Every kind at a small, ragged size, with B and H above 1."""
    return [Workload("dense", "dense", 2, 3, n, 8),
            Workload("causal", "causal", 2, 3, n, 8),
            Workload("window", "window", 2, 3, n, 8, window=7),
            Workload("documents", "documents", 2, 3, n, 8, doc_len=13),
            Workload("causal_padding", "causal_padding", 2, 3, n, 8, real_len=3 * n // 4)]


def hand_allowed(workload: Workload) -> torch.Tensor:
    """The mask from its definition, with Python loops: bool ``[N, N]``."""
    n = workload.seq_len
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if workload.kind == "dense":
                allowed[i, j] = True
            elif workload.kind == "causal":
                allowed[i, j] = j <= i
            elif workload.kind == "window":
                allowed[i, j] = i - workload.window <= j <= i
            elif workload.kind == "documents":
                allowed[i, j] = j <= i and i // workload.doc_len == j // workload.doc_len
            else:
                allowed[i, j] = j <= i < workload.real_len
    return allowed


# ---- FLOPs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", small_workloads(), ids=lambda w: w.kind)
def test_flops_count_allowed_pairs(workload):
    mask = workload.attnkit_mask()
    if mask is None:
        pairs = workload.seq_len ** 2
    else:
        pairs = int(mask.to_dense(workload.space).sum())  # brute force over [1, 1, N, N]
    per_pair = 4 * workload.batch * workload.heads * workload.head_dim
    if workload.kind == "causal":
        # the convention counts N²/2 pairs; the mask really allows N(N+1)/2
        n = workload.seq_len
        assert pairs == n * (n + 1) // 2
        assert workload.flops() == per_pair * n * n / 2
    else:
        assert workload.flops() == per_pair * pairs
    assert workload.flops(backward=True) == pytest.approx(3.5 * workload.flops())


def test_standard_workloads_match_the_documented_table():
    shapes = {w.name: (w.shape, w.kind, w.window, w.doc_len, w.real_len) for w in standard_workloads()}
    assert shapes == {
        "dense": ((1, 8, 2048, 64), "dense", None, None, None),
        "causal": ((1, 8, 2048, 64), "causal", None, None, None),
        "window": ((1, 4, 8192, 64), "window", 512, None, None),
        "documents": ((1, 4, 8192, 64), "documents", None, 512, None),
        "causal_padding": ((1, 4, 8192, 64), "causal_padding", None, None, 6144)}
    assert all(w.dtype == torch.float32 for w in standard_workloads())


# ---- the three masks agree -----------------------------------------------------------------------

@pytest.mark.parametrize("workload", small_workloads(40), ids=lambda w: w.kind)
def test_mask_forms_agree(workload):
    n = workload.seq_len
    expected = hand_allowed(workload)
    ak_dense = workload.dense_mask()  # [1, 1, N, N]
    assert ak_dense.shape == (1, 1, n, n)
    assert torch.equal(ak_dense[0, 0], expected)
    b = torch.arange(workload.batch)[:, None, None, None]
    h = torch.arange(workload.heads)[None, :, None, None]
    q_idx = torch.arange(n)[None, None, :, None]
    kv_idx = torch.arange(n)[None, None, None, :]
    flex = workload.mask_mod()(b, h, q_idx, kv_idx)
    flex = flex.expand(workload.batch, workload.heads, n, n)  # [B, H, N, N]
    assert torch.equal(flex, expected.expand_as(flex))
    assert torch.equal(workload.rows_with_keys(), expected.any(dim=-1))


@pytest.mark.parametrize("workload", quick_workloads(), ids=lambda w: w.kind)
def test_flex_block_mask_covers_the_mask(workload):
    """Flex's block mask (block 128) lists exactly the 128×128 blocks with an allowed pair."""
    block_mask = workload.block_mask()
    if block_mask is None:
        assert workload.kind == "dense"
        return
    n, size = workload.seq_len, 128
    allowed = workload.dense_mask()[0, 0]  # [N, N]
    blocks = allowed.reshape(n // size, size, n // size, size).any(dim=3).any(dim=1)  # [nq, nk]
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), blocks)


# ---- the runner ----------------------------------------------------------------------------------

def test_stats_median_and_iqr():
    median, iqr = runner._stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0
    assert iqr == 4.0 - 2.0  # inclusive quartiles of five points are the 2nd and 4th
    assert runner._stats([0.5]) == (0.5, 0.0)


def test_naive_attention_matches_float64_softmax():
    workload = small_workloads(24)[3]  # documents
    q, k, v = (t.double() for t in workload.inputs(seed=3))
    allowed = workload.dense_mask()
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / workload.head_dim ** 0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    expected = torch.einsum("bhij,bhjd->bhid", weights, v)
    torch.testing.assert_close(runner.naive_attention(q, k, v, allowed), expected, rtol=1e-12, atol=1e-12)


def test_cell_interleaves_rounds_and_flags_a_wrong_method(monkeypatch):
    calls = []
    real = runner.make_method

    def recording(key, workload, **kwargs):
        fn = real(key, workload, **kwargs)
        if key == "naive":  # a wrong answer: must be flagged
            def wrong(q, k, v):
                calls.append(key)
                return fn(q, k, v) + 1e-3
            return wrong

        def counted(q, k, v):
            calls.append(key)
            return fn(q, k, v)
        return counted

    monkeypatch.setattr(runner, "make_method", recording)
    workload = small_workloads(64)[2]  # window
    settings = runner.Settings(max_reps=3, min_reps=3, methods=("tiled", "sdpa_mask", "naive"))
    records = {r["method"]: r for r in runner.run_cell(workload, backward=True, settings=settings)}
    order = ["tiled", "sdpa_mask", "naive"]
    assert calls == order * 4  # one warm-up round, then three interleaved rounds
    assert records["naive"]["status"] == "mismatch" and records["naive"]["agrees"] is False
    assert records["naive"]["max_err"] == pytest.approx(1e-3, rel=1e-3)
    assert records["sdpa_mask"]["status"] == "ok" and records["sdpa_mask"]["max_err"] < 1e-5
    assert records["tiled"]["max_err"] == 0.0 and records["tiled"]["n"] == 3
    for record in records.values():
        assert record["speedup"]["sdpa_mask"] == pytest.approx(
            records["sdpa_mask"]["median_s"] / record["median_s"])


# ---- memory --------------------------------------------------------------------------------------

def test_memory_of_naive_is_positive_and_above_tiled():
    small = memory.measure(memory.Spec("naive", 1024, max_reps=1, time_budget_s=0))
    assert small["status"] == "ok", small
    assert small["extra_peak_bytes"] > 0
    n = 4096
    naive = memory.measure(memory.Spec("naive", n, max_reps=1, time_budget_s=0))
    tiled = memory.measure(memory.Spec("tiled", n, max_reps=1, time_budget_s=0))
    assert naive["status"] == tiled["status"] == "ok", (naive, tiled)
    assert naive["extra_peak_bytes"] >= n * n * 4  # at least one fp32 score matrix
    assert tiled["extra_peak_bytes"] < naive["extra_peak_bytes"]


def test_memory_skips_what_would_not_fit():
    record = memory.measure(memory.Spec("naive", 65536))
    assert record["status"] == "skipped" and "GiB" in record["reason"]


# ---- end to end ----------------------------------------------------------------------------------

def test_quick_run_writes_json_and_pngs(tmp_path, capsys):
    assert cli_main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "B1 H2 T256 D32" in printed and "B1 H2 T512 D32" in printed
    assert "TFLOP/s" not in printed and "vs Flex" not in printed  # toy sizes; no Flex in --quick
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert results["schema"] == runner.SCHEMA
    assert set(results["machine"]) >= {"cpu_count", "torch_threads", "torch"}
    assert results["machine"]["torch_threads"] == torch.get_num_threads()
    assert results["date"] and results["command"].startswith("attnkit bench")
    kinds = [w.name for w in quick_workloads()]
    methods = [m for m in runner.METHODS if m != "flex"]  # no compile in --quick
    got = [(r["workload"], r["pass"], r["method"]) for r in results["results"]]
    assert got == [(w, p, m) for w in kinds for p in runner.PASSES for m in methods]
    for r in results["results"]:
        assert set(r) >= {"median_s", "iqr_s", "n", "tflops", "speedup", "first_call_s", "max_err"}
        assert r["status"] == "ok", r
        assert r["n"] >= 1 and r["median_s"] > 0 and r["tflops"] > 0
        assert r["speedup"]["sdpa_mask"] > 0
        assert r["ignores_mask"] == (r["method"] == "sdpa" and r["kind"] not in ("dense", "causal"))
        if r["ignores_mask"]:
            assert r["agrees"] is None  # not checked
        else:
            assert r["agrees"] is True and r["max_err"] < runner.TOLERANCE
    sweep = results["sweep"]
    assert {(r["method"], r["n"]) for r in sweep} == {
        (m, n) for m in ("tiled", "sdpa", "sdpa_mask", "naive") for n in (256, 512)}
    assert all(r["status"] == "ok" and r["extra_peak_bytes"] >= 0 for r in sweep)
    assert set(results["memory"]["methods"]) == {"tiled", "sdpa", "sdpa_mask", "naive"}
    for name in ("time_vs_n.png", "memory_vs_n.png", "speedups.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    section = report.markdown(results)
    assert "| **window** |" in section and "#### Targets (this run)" in section
    assert "torch threads" in section and results["command"] in section


def _record(workload: Workload, pass_name: str, method: str, median_s: float, **extra) -> dict:
    """A result record as :func:`runner.run_cell` makes it (timings made up)."""
    record = {"workload": workload.name, "description": workload.describe(), "kind": workload.kind,
              "shape": list(workload.shape), "pass": pass_name, "method": method,
              "label": runner.method_label(method, workload), "status": "ok", "reason": None,
              "median_s": median_s, "iqr_s": 0.0, "n": 2,
              "tflops": median_s and workload.flops() / median_s / 1e12,
              "first_call_s": median_s, "max_err": 0.0, "agrees": True, "speedup": {},
              "backend": None, "ignores_mask": method == "sdpa" and workload.structured}
    record.update(extra)
    return record


def _quick_results() -> dict:
    """Results of a quick run without Flex: on window, SDPA without the mask is the fastest."""
    dense, window = quick_workloads()[0], quick_workloads()[2]
    records = []
    for workload in (dense, window):
        for pass_name in runner.PASSES:
            times = {"tiled": 2e-3, "sdpa": 1e-3, "sdpa_mask": 1.5e-3, "naive": 3e-3}
            for method, median in times.items():
                records.append(_record(workload, pass_name, method, median,
                                       speedup={"sdpa_mask": 1.5e-3 / median}))
            records.append(_record(workload, pass_name, "flex", None, status="unsupported",
                                   reason="FlexAttention: not run", tflops=None, speedup={}))
    return {"config": {"quick": True, "tolerance": runner.TOLERANCE}, "results": records}


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    return console.file.getvalue()


def test_quick_table_shows_sizes_and_only_meaningful_columns():
    """--quick: each workload with its B, H, T, D; no TFLOP/s (toy sizes measure the per-call
    cost) and no Flex column when no row has a Flex ratio; SDPA that ignores the window mask
    is marked as such, not shown as a competitor."""
    results = _quick_results()
    for pass_name in runner.PASSES:
        text = _text(runner.results_table(results, pass_name))
        header = next(line for line in text.splitlines() if "median ms" in line)
        assert "TFLOP/s" not in header and "vs Flex" not in header and "1st call" not in header
        assert "vs SDPA mask" in header
        assert "B1 H2 T256 D32" in text and "B1 H2 T512 D32" in text
        [ignored] = [line for line in text.splitlines() if "│" in line and "SDPA" in line
                     and "dense mask" not in line and "no mask" not in line]
        assert "mask ignored" in ignored and "speed reference" in ignored, ignored
    full = dict(results, config={"quick": False, "tolerance": runner.TOLERANCE})
    header = next(line for line in _text(runner.results_table(full, "fwd")).splitlines()
                  if "median ms" in line)
    assert "TFLOP/s" in header and "1st call" in header


def test_speedup_bars_leave_out_a_method_that_ignores_the_mask():
    records = _quick_results()["results"]
    bars = plots.speedup_bars([r for r in records if r["pass"] == "fwd"], "sdpa_mask")
    assert set(bars) == {"tiled", "sdpa", "naive"}
    assert [workload for workload, _ in bars["sdpa"]] == ["dense"]  # not window: mask ignored
    assert [workload for workload, _ in bars["tiled"]] == ["dense", "window"]


@pytest.mark.parametrize("draw", ["speedups", "time_vs_n"])
def test_figures_have_one_legend_off_the_plots(draw):
    if draw == "speedups":
        figure = plots.speedups_figure(_quick_results()["results"])
    else:
        sweep = [{"method": m, "n": n, "median_s": 1e-3 * n, "heads": 1, "head_dim": 64}
                 for m in ("tiled", "naive") for n in (256, 512)]
        figure = plots.against_n_figure(sweep, "median_s", "time (s)", "title")
    assert figure.axes and all(axes.get_legend() is None for axes in figure.axes)
    assert len(figure.legends) == 1


def test_replace_section_keeps_the_rest():
    text = f"head\n{report.START}\nold\n{report.END}\ntail\n"
    assert report.replace_section(text, "new") == f"head\n{report.START}\nnew\n{report.END}\ntail\n"
    with pytest.raises(ValueError, match="markers"):
        report.replace_section("no markers", "new")


def test_threads_option_is_recorded_and_restored(tmp_path):
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    code = cli_main(["bench", "--quick", "--workloads", "dense", "--methods", "tiled", "sdpa_mask",
                     "--no-memory", "--threads", str(wanted), "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert results["machine"]["torch_threads"] == wanted
    assert [r["method"] for r in results["results"]] == ["tiled", "sdpa_mask"] * 2
    assert torch.get_num_threads() == before


def test_unknown_method_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["bench", "--quick", "--methods", "tiled", "magic", "--no-memory",
                     "--out", str(tmp_path)]) == 2
    assert "unknown method(s) ['magic']" in capsys.readouterr().err


def test_overhead_script_runs_and_checks_the_decode_loop(tmp_path):
    """``benchmarks/overhead.py --quick`` end to end: tiny calls against SDPA and the decode
    loop, whose attnkit and SDPA outputs it checks equal before timing; JSON written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    try:
        assert script.main(["--quick", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "overhead_quick.json").read_text())
    assert len(data["tiny"]) == 12 and {r["is_causal"] for r in data["decode"]} == {True, False}
    assert all(r["attnkit_us"] > 0 and r["sdpa_us"] > 0 for r in data["tiny"])
    # the work counts: SDPA is one aten operation without a mask, attnkit at least its kernel
    work = {r["mask"]: r for r in data["work"]}
    assert set(work) == {"none", "causal", "window", "padding"}
    assert work["none"]["sdpa_aten_ops"] == 1 and work["none"]["attnkit_aten_ops"] >= 1
    assert all(r["attnkit_python_calls"] > r["sdpa_python_calls"] > 0 for r in work.values())


def test_source_revision_is_attnkits_checkout_not_an_enclosing_project(tmp_path, monkeypatch):
    """Installed into a project's ignored ``.venv``, attnkit records no revision (the
    project's commit is not attnkit's)."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git")
    project = tmp_path / "project"
    package = project / ".venv" / "site-packages" / "attnkit"
    (package / "bench").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (project / ".gitignore").write_text(".venv/\n")
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", ".gitignore"], [*env, "commit", "-qm", "x"]):
        subprocess.run(["git", *command], cwd=project, check=True, capture_output=True)
    monkeypatch.setattr(runner, "__file__", str(package / "bench" / "runner.py"))
    assert runner.source_revision() is None


FIGURE_NAMES = ("time_vs_n.png", "memory_vs_n.png", "speedups.png")


def test_no_speedups_figure_without_its_baseline(tmp_path, capsys):
    """Without sdpa_mask in --methods there is no speed-up to draw: no empty speedups.png, and
    the output says why."""
    code = cli_main(["bench", "--quick", "--workloads", "dense", "--methods", "tiled", "naive",
                     "--no-memory", "--reps", "1", "--out", str(tmp_path)])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert (tmp_path / "cpu.json").is_file()
    assert not any((tmp_path / name).exists() for name in FIGURE_NAMES)
    assert "not written: speedups.png" in printed and "add sdpa_mask to --methods" in printed
    assert plots.left_out({"results": [], "sweep": None}).keys() == set(FIGURE_NAMES)


def test_a_run_removes_the_figures_of_an_earlier_run_it_does_not_write(tmp_path, capsys):
    """--no-memory into a folder holding an earlier run's figures: the memory figures go (the
    folder holds one run), the speed-ups are rewritten, files of other names stay."""
    for name in (*FIGURE_NAMES, "notes.txt"):
        (tmp_path / name).write_bytes(b"earlier run")
    code = cli_main(["bench", "--quick", "--workloads", "dense", "--methods", "tiled", "sdpa_mask",
                     "--no-memory", "--reps", "1", "--out", str(tmp_path)])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert not (tmp_path / "time_vs_n.png").exists() and not (tmp_path / "memory_vs_n.png").exists()
    assert (tmp_path / "speedups.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "notes.txt").read_bytes() == b"earlier run"
    assert "removed memory_vs_n.png from an earlier run" in printed


def test_a_workload_named_twice_runs_once():
    chosen = select(quick_workloads(), ["window", "dense", "window"])
    assert [w.name for w in chosen] == ["window", "dense"]
