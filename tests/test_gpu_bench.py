"""``benchmarks/gpu.py``, the GPU timing script, on CPU: argument parsing and workload
selection, the FLOP counts, the profile and table helpers, a failed check's exit status, and
``--dry-run``, its whole pipeline end to end at toy sizes through the Triton interpreter.

Triton is imported in interpreter mode at collection, and each test opts in with
``TRITON_INTERPRET=1``, as in ``tests/test_triton.py`` (see its docstring).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


from conftest import import_triton_interpreted, skip_module_unless_interpreted  # noqa: E402

import_triton_interpreted()

from attnkit.backends.triton import launch  # noqa: E402

skip_module_unless_interpreted(launch, __file__)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Opt in to the interpreter for this test only (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def bench(monkeypatch):
    """``benchmarks/gpu.py`` as a module."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends src/ to it
    spec.loader.exec_module(module)
    return module


def test_arguments_pick_the_workloads(bench):
    """``--masks`` keeps the workloads of the masks named, in the script's order: the window
    and documents at ``--masked-length``, causal and dense at each of ``--lengths``; B and H
    follow from ``--tokens`` and ``--hidden``. Unknown names stop the run before anything."""
    args = bench.parse_args(["--masks", "dense,window", "--dims", "64,128", "--lengths", "1024,4096"])
    assert [(w.mask, w.d, w.n, w.batch, w.heads) for w in bench.workloads(args)] == [
        ("window", 64, 8192, 2, 32), ("dense", 64, 1024, 16, 32), ("dense", 64, 4096, 4, 32),
        ("window", 128, 8192, 2, 16), ("dense", 128, 1024, 16, 16), ("dense", 128, 4096, 4, 16)]
    for flag, value in (("--masks", "docs"), ("--competitors", "flash"), ("--modes", "bwd")):
        with pytest.raises(SystemExit):
            bench.parse_args([flag, value])
    dry = bench.parse_args(["--dry-run", "--dims", "128"])  # toy sizes whatever else is asked
    assert [(w.mask, w.n, w.d, w.span) for w in bench.workloads(dry)] == [
        ("window", 64, 32, 16), ("documents&causal", 64, 32, 16), ("causal", 64, 32, 16),
        ("dense", 64, 32, 16)]


@pytest.mark.parametrize("mask,n,span", [("window", 300, 37), ("documents&causal", 300, 37),
                                         ("documents&causal", 256, 64), ("dense", 96, 16)])
def test_flops_count_the_attended_pairs(bench, mask, n, span):
    """The forward counts 4·B·H·D per attended pair, exactly as the dense mask allows them
    (causal: N²/2 by convention); forward+backward 3.5× the forward."""
    w = bench.Workload(mask, n, 64, 3, 5, span)
    allowed = bench.dense_mask(w, "cpu")
    assert w.pairs() == (n * n if allowed is None else int(allowed.sum()))
    assert w.flops("fwd") == 4 * 3 * 5 * 64 * w.pairs()
    assert w.flops("fwd+bwd") == 3.5 * w.flops("fwd")
    assert bench.Workload("causal", n, 64, 1, 1, span).pairs() == n * n / 2


def test_kernel_times_and_table(bench, capsys):
    """A profiler trace becomes per-name totals (device events on a GPU, host operators on
    CPU); the table puts each competitor's TFLOP/s side by side with attnkit's ratio to the
    best other competitor on the row (``n/a``: cannot run it, ``err``: failed)."""
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 800.0},
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 10.0},
        {"cat": "kernel", "name": "attn_fwd", "dur": 400.0},
        {"cat": "gpu_memset", "name": "Memset (Device)", "dur": 2.0},
        {"cat": "cpu_op", "name": "aten::empty", "dur": 12.0}, {"name": "no category"}]}
    assert bench.kernel_times(trace, on_device=True) == {
        "attn_bwd_dkdv": {"us": 810.0, "calls": 2}, "attn_fwd": {"us": 400.0, "calls": 1},
        "Memset (Device)": {"us": 2.0, "calls": 1}}
    assert bench.kernel_times(trace, on_device=False) == {"aten::empty": {"us": 12.0, "calls": 1}}

    def row(backend, tflops, status="ok"):
        return {"workload": "causal", "d": 128, "n": 1024, "mode": "fwd", "backend": backend,
                "tflops": tflops, "status": status}
    competitors = ["attnkit-triton", "attnkit-stored", "sdpa-flash", "sdpa-cudnn", "flex-compiled"]
    bench.print_table([row("attnkit-triton", 300.0), row("attnkit-stored", 330.0),
                       row("sdpa-flash", 200.0), row("sdpa-cudnn", 250.0),
                       row("flex-compiled", None, "error: out of memory")], competitors)
    header, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.split() == ["workload", "D", "N", "mode", "triton", "stored", "flash", "cudnn",
                              "flex", "triton", "vs", "best", "stored", "vs", "best"]
    assert line.split() == ["causal", "128", "1024", "fwd", "300", "330", "200", "250", "err",
                            "1.20x", "1.32x"]
    bench.print_table([row("attnkit-triton", 300.0), row("sdpa-flash", None, "n/a: no")],
                      ["attnkit-triton", "sdpa-flash", "sdpa-cudnn"])
    assert capsys.readouterr().out.strip().splitlines()[-1].split() == [
        "causal", "128", "1024", "fwd", "300", "n/a", "n/a"]


def test_a_failed_check_fails_the_run(bench, tmp_path, capsys, monkeypatch):
    """An attnkit result off by more than allowed is a failed check: reported, kept in the
    JSON, and the exit status is 1 (the run still times everything)."""
    import torch.nn.functional as F

    def off(name, w, device):
        def run(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out * 1.05, torch.zeros(out.shape[:-1])
        return run
    monkeypatch.setattr(bench, "attnkit_fn", off)
    assert bench.main(["--dry-run", "--masks", "causal", "--competitors", "attnkit-triton,sdpa-flash",
                       "--out", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "CORRECTNESS FAILED for causal D32 N64 (attnkit-triton)" in printed
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    [failed] = saved["checks"]
    assert not failed["ok"] and failed["errors"]["out"]["error"] > failed["errors"]["out"]["allowed"]
    assert {(r["backend"], r["mode"]) for r in saved["results"] if r["tflops"]} == {
        (b, m) for b in ("attnkit-triton", "sdpa-flash") for m in ("fwd", "fwd+bwd")}


def test_budget_times_the_first_workload(bench, tmp_path, capsys):
    """``--budget`` counts from the start; a budget spent before any timing still times the
    first workload, and only that one."""
    assert bench.main(["--dry-run", "--budget", "0", "--masks", "causal,dense", "--competitors",
                       "attnkit-triton", "--skip-check", "--out", str(tmp_path)]) == 0
    assert "over the --budget, not timed: dense D32 N64" in capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    assert saved["skipped"] == ["dense D32 N64"] and saved["checks"] == []
    assert {(r["workload"], r["mode"]) for r in saved["results"]} == {
        ("causal", "fwd"), ("causal", "fwd+bwd")}


def test_dry_run(bench, tmp_path, capsys):
    """``benchmarks/gpu.py --dry-run --profile``: the whole pipeline (checks, every competitor
    that runs on CPU, profiles, table, JSON) at toy sizes through the interpreter, in this
    process (its triton is already in interpreter mode, and the imports are paid)."""
    assert bench.main(["--dry-run", "--profile", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    # toy sizes everywhere, whatever the full-size defaults are
    assert {(r["n"], r["d"], r["batch"], r["heads"]) for r in saved["results"]} == {(64, 32, 1, 2)}
    assert {(r["n"], r["d"]) for r in saved["mods"]} == {(64, 32)}
    assert {"date", "device", "torch", "triton", "args", "elapsed_s"} <= set(saved["info"])
    keys = ["window16 D32 N64", "docs16&causal D32 N64", "causal D32 N64", "dense D32 N64"]
    # each workload checked through both attnkit backwards before it is timed
    assert [(c["workload"], c["backend"]) for c in saved["checks"]] == [
        (key, name) for key in keys for name in ("attnkit-triton", "attnkit-stored")]
    assert all(c["ok"] and set(c["errors"]) == {"out", "lse", "dq", "dk", "dv"} for c in saved["checks"])
    # decoding rows (bottom-right causal against SDPA's lower-right causal bias), each checked
    assert [(r["batch"], r["q_len"], r["kv_len"]) for r in saved["decode"]] == [(1, 1, 96), (2, 4, 96)]
    assert all(r["ok"] and r["attnkit-auto"]["us"] > 0 and r["copy_gbs"] > 0 for r in saved["decode"])
    # paged caches: a ragged decode step against SDPA on the gathered keys, forks of a prompt
    assert [r["case"] for r in saved["paged"]] == ["paged decode B3 keys 16..80",
                                                   "shared prefix B4 prompt 64"]
    assert all(r["ok"] and r["copy_gbs"] > 0 for r in saved["paged"])
    assert saved["paged"][0]["attnkit-paged"]["us"] > 0
    shared = saved["paged"][1]
    assert shared["attnkit-shared"]["us"] > 0 < shared["attnkit-unshared"]["us"]
    # ring steps: the fused kernels against the tiled step, both checked equal first
    assert [(r["step"], r["n"], r["world"]) for r in saved["ring"]] == [("diagonal", 128, 2), ("below", 128, 2)]
    assert all(r["ok"] and r[f"{name} {mode}"]["us"] > 0 and r[f"speedup {mode}"] > 0
               for r in saved["ring"] for name in ("triton", "tiled") for mode in ("fwd", "fwd+bwd"))
    # score modifiers: the triton kernels checked against float32 math with the modifier, timed
    assert [r["modifier"] for r in saved["mods"]] == ["alibi", "softcap"]
    assert all(r["ok"] and r["attnkit-triton fwd"] > 0 and r["attnkit-triton fwd+bwd"] > 0
               for r in saved["mods"])
    rows = {(r["workload"], r["backend"], r["mode"]): r for r in saved["results"]}
    assert len(rows) == len(saved["results"]) == 4 * 6 * 2
    for (workload, backend, mode), r in rows.items():
        runs = (backend in ("attnkit-triton", "attnkit-stored", "sdpa-dense-mask")
                or (backend == "sdpa-flash" and workload in ("causal", "dense")))
        assert (r["tflops"] is not None and r["tflops"] > 0 and r["ms"] > 0) == runs, (workload, backend)
        assert runs or r["status"].startswith("n/a")
    assert set(saved["profiles"]) == set(keys)
    ours = saved["profiles"]["causal D32 N64"]["attnkit-stored"]
    assert ours and all(row["us"] > 0 and row["calls"] >= 1 for row in ours.values())
    # the table last, after the profiles
    assert printed.index("torch.profiler") < printed.index("TFLOP/s (do_bench") < printed.index("JSON:")
    assert "triton vs best" in printed and "stored vs best" in printed and "docs16&causal" in printed
