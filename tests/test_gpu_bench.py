"""``benchmarks/gpu.py``, the GPU benchmark script, on CPU: its helpers (workload selection,
kernel profiles, walk families, losing candidates, loop sizes, host-bound rows, excluded walks,
config timings), the warm step (parts, pruning failing candidates, keeping failed jobs out of
the timed process) and ``--dry-run``, its whole pipeline end to end at toy sizes through the
Triton interpreter.

Triton is imported in interpreter mode at collection, and each test opts in with
``TRITON_INTERPRET=1``, as in ``tests/test_triton.py`` (see its docstring).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


from conftest import import_triton_interpreted, skip_module_unless_interpreted  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit.backends.triton import launch  # noqa: E402

skip_module_unless_interpreted(launch, __file__)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Opt in to the interpreter for this test only (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- the GPU benchmark's pipeline, end to end at toy sizes ---------------------------------------------

@pytest.fixture
def bench(monkeypatch):
    """``benchmarks/gpu.py`` as a module, with ``launch.CONFIGS`` restored afterwards."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends src/ to it
    spec.loader.exec_module(module)
    monkeypatch.setattr(launch, "CONFIGS", {name: {bucket: list(candidates) for bucket, candidates
                                                   in buckets.items()}
                                            for name, buckets in launch.CONFIGS.items()})
    return module


def test_benchmark_masks_pick_the_workloads(bench):
    """``--masks`` keeps the workloads of the masks named, in the script's order; an unknown
    name stops the run before anything is timed."""
    args = bench.parse_args(["--masks", "dense,window", "--dims", "64,128", "--lengths", "1024,4096"])
    assert [(w.mask, w.d, w.n) for w in bench.workloads(args)] == [
        ("window", 64, 8192), ("dense", 64, 1024), ("dense", 64, 4096),
        ("window", 128, 8192), ("dense", 128, 1024), ("dense", 128, 4096)]
    with pytest.raises(SystemExit, match="unknown"):
        bench.workloads(bench.parse_args(["--masks", "docs"]))


def test_benchmark_warm_parts(bench, monkeypatch):
    """``--warm-parts n``: n workers per (mask, head dim), each told its part; a candidate
    failing in one part drops it and reruns every part of that job (the drop shifts the
    candidates' indices between parts); a part failing for good keeps its whole job out."""
    bad = ["attn_fwd", 128, list(launch.CONFIGS["attn_fwd"][128][4])]
    crashed = f"{bench.TRACE}{json.dumps(bad)}\nCUDA error: illegal address"
    calls = []

    def run(jobs):
        calls.append(jobs)
        out = {}
        for label, argv in jobs.items():
            dropped = json.loads(argv[argv.index("--drop-configs") + 1])
            if label == "causal D128 part 2/3":
                out[label] = (0, "") if dropped == [bad] else (1, crashed)
            elif label == "window D128 part 3/3":
                out[label] = (1, "ImportError: boom")
            else:
                out[label] = (0, "")
        return out

    todo = [bench.Workload("causal", 1024, 128, 2, 16, 1024), bench.Workload("window", 8192, 128, 2, 16, 1024)]
    warmed = bench.warm(todo, bench.parse_args(["--warm-parts", "3"]), run=run)
    assert sorted(calls[0]) == sorted(f"{mask} D128 part {p}/3" for mask in ("causal", "window") for p in (1, 2, 3))
    assert [argv[argv.index("--warm-part") + 1] for argv in calls[0].values()] == ["0/3", "1/3", "2/3"] * 2
    assert warmed.dropped == [bad] and sorted(calls[1]) == [f"causal D128 part {p}/3" for p in (1, 2, 3)]
    assert list(warmed.broken) == ["window D128"] and warmed.skips("window D128")
    assert not warmed.skips("causal D128")
    # by default as many parts as the CPUs allow, at least 1, at most WARM_MAX_PARTS
    for cpus, parts in ((16, 4), (6, 3), (1, 1), (None, 1)):
        monkeypatch.setattr(bench.os, "cpu_count", lambda: cpus)
        calls.clear()
        bench.warm(todo, bench.parse_args([]), run=lambda jobs: calls.append(jobs) or
                   {label: (0, "") for label in jobs})
        assert len(calls[0]) == 2 * parts, cpus


def test_benchmark_budget_times_the_first_workload(tmp_path, capsys, bench):
    """``--budget`` counts from the start, warm step and checks included; a budget spent
    before any timing still times the first workload, and only that one."""
    assert bench.main(["--dry-run", "--budget", "0", "--masks", "causal,dense", "--competitors",
                       "attnkit-triton", "--profile", "none", "--out", str(tmp_path)]) == 0
    assert "over the --budget, not timed: dense" in capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    assert {(r["workload"], r["mode"]) for r in saved["results"]} == {("causal", "fwd"), ("causal", "fwd+bwd")}


def test_benchmark_dry_run(tmp_path, capsys, bench):
    """``benchmarks/gpu.py --dry-run``: the whole pipeline (checks, every competitor that runs on
    CPU, table, JSON) at toy sizes through the interpreter, in this process (its triton is
    already in interpreter mode, and the imports are paid)."""
    start = time.perf_counter()
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    # each mask once through each backward
    assert all(check["ok"] for check in saved["checks"]) and len(saved["checks"]) == 8
    assert sum("(stored dS)" in check["workload"] for check in saved["checks"]) == 4
    for backend in ("attnkit-triton", "attnkit-kernels"):  # the kernels alone: both modes too
        ours = [r for r in saved["results"] if r["backend"] == backend]
        assert len(ours) == 8 and all(r["tflops"] and r["tflops"] > 0 for r in ours)
    stored = [r for r in saved["results"] if r["backend"] == "attnkit-stored" and r["tflops"]]
    assert {(r["workload"], r["mode"]) for r in stored} == {
        (w, m) for w in ("window16", "docs16&causal", "causal", "dense") for m in ("fwd", "fwd+bwd")}
    assert "stored vs best" in printed
    assert "TFLOP/s" in printed and "docs16&causal" in printed
    assert time.perf_counter() - start < 180  # 25-40 s here: catches a run that compiles or
    # times far more than toy sizes, not a slow machine
    # one forward+backward under torch.profiler per workload (host operators on CPU)
    assert set(saved["info"]["kernel_profile"]) == {"window16 D32 N64", "docs16&causal D32 N64",
                                                    "causal D32 N64", "dense D32 N64"}
    ours = saved["info"]["kernel_profile"]["causal D32 N64"]["attnkit-triton"]
    assert ours and all(row["us"] > 0 and row["calls"] >= 1 for row in ours.values())
    assert saved["info"]["kernel_profile"]["window16 D32 N64"]["attnkit-stored"]
    assert "torch.profiler" in printed
    facts = {"grid": [8, 32, 1], "block": [256, 1, 1], "registers per thread": 255,
             "shared memory": 98304, "blocks per SM": 1, "est. achieved occupancy %": 12}
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 800.0, "args": facts},
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 10.0, "args": {}},
        {"cat": "kernel", "name": "attn_fwd", "dur": 400.0, "args": {}},
        {"cat": "gpu_memset", "name": "Memset (Device)", "dur": 2.0},
        {"cat": "cpu_op", "name": "aten::empty", "dur": 12.0}, {"name": "no category"}]}
    assert bench.kernel_times(trace, on_device=True) == {
        "attn_bwd_dkdv": {"us": 810.0, "calls": 2, "grid": [8, 32, 1], "block": [256, 1, 1],
                          "regs": 255, "smem": 98304, "blocks_per_sm": 1, "occupancy_pct": 12},
        "attn_fwd": {"us": 400.0, "calls": 1}, "Memset (Device)": {"us": 2.0, "calls": 1}}
    assert bench.kernel_times(trace, on_device=False) == {"aten::empty": {"us": 12.0, "calls": 1}}
    # each walk family's best autotuning time (the GPU run's answer to which walks pay)
    ms = {"128x128 w8 s2 partial_first": 0.30, "128x128 w8 s2 full_first": 0.29,
          "128x64 w8 s3 partial_first+flat": 0.31, "128x128 w8 s2 one_loop": 0.27,
          "128x128 w8 s2 partial_first+lpt": 0.28, "32x128 w8 s2 full_first+flat+lpt": 0.26,
          "128x128 w8 s2 one_loop+tma": 0.25}
    assert bench.walk_families(ms) == {"split": 0.29, "flat": 0.31, "one_loop": 0.27, "lpt": 0.26,
                                       "tma": 0.25}
    assert all(any(member(walk) for member in bench.WALK_FAMILIES.values()) for walk in launch.WALKS)
    # candidates never within 5 % of a tuning's fastest, per kernel and head dim
    tuned = {"window D128 N8192": {"attn_fwd": {"ms": {"a": 1.0, "b": 1.04, "c": 1.2, "d": None}},
                                   "attn_bwd_dq": {"ms": {"a": 2.0, "b": 2.0}}},
             "causal D128 N1024": {"attn_fwd": {"ms": {"a": 0.5, "c": 0.6, "e": 0.49}}},
             "causal D64 N1024": {"attn_fwd": {"ms": {"a": 0.3, "c": 0.3}}}}
    assert bench.losing_candidates(tuned) == {"attn_fwd D128": ["c"]}
    assert bench.losing_candidates(tuned, slack=1.01) == {"attn_fwd D128": ["b", "c"]}
    # --compile-only's loop sizes: instructions from a label to the branch back to it
    sass = "\n".join(["        /*0000*/   MOV R1, c[0x0][0x28] ;", ".L_x_1:",
                      *[f"        /*{16 * i:04x}*/   FFMA R2, R3, R4, R2 ;" for i in range(24)],
                      "        /*0190*/   @P0 BRA `(.L_x_1) ;", ".L_x_2:",
                      "        /*01a0*/   NOP ;", "        /*01b0*/   @!P1 BRA `(.L_x_2) ;",
                      "        /*01c0*/   BRA `(.L_x_3) ;", ".L_x_3:", "        /*01d0*/   EXIT ;"])
    assert bench.loop_sizes(sass) == [25] and bench.loop_sizes(sass, smallest=1) == [25, 2]
    # rows where the GPU waited on the Python: the whole call over 1.05x its kernels alone
    def row(backend, ms):
        return bench.Result("causal", 128, 1024, 16, 16, "fwd+bwd", backend, ms=ms)
    keyed = {("causal", 128, 1024, "fwd+bwd"): {"attnkit-triton": row("attnkit-triton", 1.34),
                                                "attnkit-kernels": row("attnkit-kernels", 1.06)},
             ("causal", 128, 4096, "fwd+bwd"): {"attnkit-triton": row("attnkit-triton", 3.07),
                                                "attnkit-kernels": row("attnkit-kernels", 3.01)},
             ("dense", 128, 1024, "fwd"): {"attnkit-triton": row("attnkit-triton", 0.4)}}
    assert bench.host_bound(keyed) == ["causal D128 N1024 fwd+bwd +0.280 ms"]
    # --exclude-walks: a walk that fails on some machine can be left out of a run
    assert bench.exclude_walks("tma, one_loop")
    walks = {c[4] for buckets in launch.CONFIGS.values() for cs in buckets.values() for c in cs}
    assert walks and not any("tma" in w or w.startswith("one_loop") for w in walks)


def test_benchmark_config_timings_tell_the_dkdv_variants_apart(bench, monkeypatch):
    """The plain and the dS-storing dK/dV share one autotuner; a tuning whose key has the
    stored-dS bit (30 of ``TUNE_KEY``) is reported as ``attn_bwd_dkdv+ds``."""
    import triton

    config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, **launch.WALKS[launch.F_FLAT]},
                           num_warps=8, num_stages=2)
    for stored, label in ((False, "attn_bwd_dkdv"), (True, "attn_bwd_dkdv+ds")):
        tuner = SimpleNamespace(cache={(128, 128, 5 | stored << 30, "bf16"): config},
                                configs_timings={config: [0.5, 0.4, 0.6]})
        monkeypatch.setattr(launch, "_TUNED", {"attn_bwd_dkdv": tuner})
        assert bench.config_timings() == {label: {"key": str((128, 128, 5 | stored << 30)),
                                                  "ms": {"32x128 w8 s2 full_first+flat": 0.5}}}


def test_benchmark_warm_isolates_failures(bench, capsys, monkeypatch):
    """The warm step finds a candidate that fails in a worker from the worker's launch trace,
    drops it (here and in the rerun's workers) and reruns the job; a job failing outside a
    launch, or a mask kind's, is kept out of the timed process (one crash there would end its
    CUDA context) and reported as a failed check instead."""
    # the trace: the launch running when the worker died is the last one without an "ok"
    real_launch = launch.Call._launch

    def sabotaged(self, *args, **options):
        if self.name == "attn_bwd_dq":
            raise RuntimeError("illegal memory access (sabotaged)")
        real_launch(self, *args, **options)

    monkeypatch.setattr(launch.Call, "_launch", sabotaged)
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    with bench.traced_launches(), pytest.raises(RuntimeError, match="sabotaged"):
        ak.attention(q, q, q, mask=ak.causal(), backend="triton").sum().backward()
    assert launch.Call._launch is sabotaged  # the tracer is undone
    trace = capsys.readouterr().out
    assert trace.count(bench.TRACE + "ok") == 1  # the forward ran; dQ runs before dK/dV
    assert bench.culprit(trace) == ["attn_bwd_dq", 64, [32, 32, None, None, "partial_first"]]
    assert bench.culprit(trace + bench.TRACE + "ok\nTraceback ...") is None
    assert bench.culprit(trace + bench.TRACE + "ok\n" + bench.TRACE + "direct\nCUDA error") is None
    assert bench.culprit("ImportError: no triton") is None

    # the warm loop, with fake workers
    bad = list(launch.CONFIGS["attn_fwd"][128][4])
    assert bad[4] == "partial_first+tma"
    calls = []

    def run(jobs):
        calls.append(jobs)
        crashed = f"{bench.TRACE}{json.dumps(['attn_fwd', 128, bad])}\nCUDA error: illegal address"
        out = {}
        for label, argv in jobs.items():
            dropped = json.loads(argv[argv.index("--drop-configs") + 1])
            if label == "causal D128":
                out[label] = (0, "") if [["attn_fwd", 128, bad]] == dropped else (1, crashed)
            elif label in ("window D128", "kind causal bf16"):
                out[label] = (1, crashed if label.startswith("kind") else "ImportError: boom")
            elif label == "kind window37 bf16":  # slow compiles, killed: neither dropped nor failed
                out[label] = (bench.TIMED_OUT, crashed)
            elif label == "documents&causal D128":  # every candidate passed, then direct launches failed
                out[label] = (1, f"{bench.TRACE}ok\n{bench.TRACE}direct\nCUDA error")
            else:
                out[label] = (0, "")
        return out

    todo = [bench.Workload("causal", 1024, 128, 2, 16, 1024), bench.Workload("window", 8192, 128, 2, 16, 1024),
            bench.Workload("documents&causal", 8192, 128, 2, 16, 1024)]
    warmed = bench.warm(todo, bench.parse_args(["--check-kinds", "--warm-parts", "1"]), run=run)
    assert warmed.dropped == [["attn_fwd", 128, bad]] and tuple(bad) not in launch.CONFIGS["attn_fwd"][128]
    assert sorted(warmed.broken) == ["kind causal bf16", "window D128"]
    assert len(calls) == 2 and list(calls[1]) == ["causal D128"]
    # 3 workload jobs; 11 kinds in bf16, 3 in fp16, 11 in bf16 through the stored-dS backward
    assert "kind documents bf16 stored_ds" in calls[0] and len(calls[0]) == 3 + 11 + 3 + 11
    assert warmed.direct_failed and "documents&causal D128" not in warmed.broken
    printed = capsys.readouterr().out
    assert "candidate dropped, job rerun" in printed and "left out of this run" in printed
    assert "kind window37 bf16: still running" in printed

    # what failed in a worker is a failed check in the timed process, not run there
    rows = bench.check_kinds(torch.bfloat16, torch.device("cpu"), ("causal",), warmed)
    assert rows == [{"case": "causal", "ok": False, "exception": rows[0]["exception"]}]
    assert "warm worker failed" in rows[0]["exception"]
    every = bench.Warmed(broken={bench.warm_label(mask, d): "" for mask, d in bench.config_checks(todo)})
    rows = bench.check_configs(todo, torch.bfloat16, torch.device("cpu"), every)
    assert len(rows) == len(bench.config_checks(todo)) and not any(row["ok"] for row in rows)
