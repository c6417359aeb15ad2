"""Run the attention benchmark: every method on every workload, timed side by side in one run.

Method (one *cell* is a workload × pass, ``fwd`` or ``fwd+bwd``):

1. Build the inputs, the dense bool mask and Flex's block mask once, outside any timing.
2. Warm-up: call every method once; that first call is timed as ``first_call_s`` (for Flex it
   includes the compilation, after ``torch._dynamo.reset()``, so each workload compiles afresh).
   Its output (and gradients) are compared with ``attnkit tiled``'s; a method whose maximum
   absolute difference exceeds :data:`TOLERANCE` is flagged ``mismatch``.
3. Timed repetitions *interleaved* across methods (A, B, C, A, B, C, …) so that noise from
   other processes on the machine hits every method alike; each method's number of rounds fits
   an equal share of a time budget per cell (between ``min_reps`` and ``max_reps``), so the
   fast methods get more rounds than the slow references.
4. Median and inter-quartile range per method, TFLOP/s from the useful-FLOP count
   (:mod:`attnkit.bench.workloads`) and speed-ups ``t_reference / t_method`` against torch SDPA
   without a mask, SDPA with the dense bool mask, and compiled FlexAttention.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import __version__
from ..api import attention
from .workloads import Workload, quick_workloads, standard_workloads

SCHEMA = "attnkit-bench/1"
"""Version tag of the JSON layout written by :func:`run_benchmark`."""

TOLERANCE = 1e-4
"""Largest max-abs difference from ``attnkit tiled`` (fp32) before a method is flagged."""

METHODS = ("tiled", "auto", "sdpa", "sdpa_mask", "flex", "naive")
"""Method keys in table order; ``tiled`` first, as every other output is checked against it."""

PASSES = ("fwd", "fwd+bwd")

REFERENCES = {"sdpa": "sdpa", "sdpa_mask": "sdpa_mask", "flex": "flex"}
"""Speed-up columns: name in the JSON → method whose median is the numerator."""


class Unsupported(Exception):
    """A method cannot run a cell (e.g. FlexAttention has no CPU backward); the message says why."""


def method_label(key: str, workload: Workload) -> str:
    """The row label of method ``key`` on ``workload``."""
    if key == "sdpa":
        if workload.kind == "dense":
            return "torch SDPA no mask"
        if workload.kind == "causal":
            return "torch SDPA is_causal"
        return "SDPA (ignores mask)"
    return {"tiled": "attnkit tiled", "auto": "attnkit auto", "sdpa_mask": "torch SDPA dense mask",
            "flex": "FlexAttention compiled", "naive": "naive"}[key]


def ignores_mask(key: str, workload: Workload) -> bool:
    """Whether method ``key`` computes ``workload`` without its mask: torch SDPA without a mask
    on window, documents and padding, timed as a speed reference only (its output differs)."""
    return key == "sdpa" and workload.structured


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Textbook attention: ``softmax(mask(q kᵀ / sqrt(D))) v``, every score materialised.

    ``q, k, v [B, H, N, D]``, ``allowed`` bool ``[1|B, 1|H, N, N]`` or ``None``. Masked scores are
    filled with the dtype's most negative finite value (as Hugging Face does), so a row with no
    allowed key averages all values instead of producing NaN.
    """
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, N, N]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v  # [B, H, N, D]


def flex_probe_backward() -> None:
    """Raise :class:`Unsupported` when FlexAttention cannot differentiate CPU tensors (tried
    eagerly on a tiny input, not guessed from a version number)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, 16, 16, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention(q, q, q).sum().backward()
    except NotImplementedError as error:
        raise Unsupported(f"FlexAttention: {error}") from None


def make_method(key: str, workload: Workload, *, backward: bool, dense_mask: torch.Tensor,
                block_mask=None) -> Callable:
    """A function ``(q, k, v) -> out [B, H, N, D]`` running method ``key`` on ``workload``.

    Raises :class:`Unsupported` when the method cannot run this cell. For ``flex`` the returned
    function is freshly compiled (``torch._dynamo.reset()`` first): its first call compiles.
    """
    mask = workload.attnkit_mask()
    if key in ("tiled", "auto"):
        backend = "tiled" if key == "tiled" else "auto"
        return lambda q, k, v: attention(q, k, v, mask, backend=backend)
    if key == "sdpa":
        is_causal = workload.kind == "causal"
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    if key == "sdpa_mask":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    if key == "naive":
        allowed = None if workload.kind == "dense" else dense_mask
        return lambda q, k, v: naive_attention(q, k, v, allowed)
    if key == "flex":
        if backward:
            flex_probe_backward()
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown method {key!r}: choose from {METHODS}")


def auto_backend_name(workload: Workload, backward: bool) -> str:
    """Which backend ``backend="auto"`` picks for ``workload`` (as dispatch decides it)."""
    from .. import dispatch
    from ..inputs import validate

    q = torch.empty(workload.shape, dtype=workload.dtype, requires_grad=backward)
    return dispatch.select(validate(q, q, q, workload.attnkit_mask()), "auto").NAME


@dataclass
class Settings:
    """How hard to measure: rounds per cell between ``min_reps`` and ``max_reps``, fitted to
    ``cell_budget_s`` seconds of timed rounds; which methods and passes."""

    max_reps: int = 10
    min_reps: int = 2
    cell_budget_s: float = 20.0
    methods: tuple[str, ...] = METHODS
    passes: tuple[str, ...] = PASSES
    tolerance: float = TOLERANCE
    seed: int = 0


def interleaved(fns: dict[str, Callable[[], object]], calls: int, blocks: int,
                warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternating blocks of ``calls``
    calls after ``warmup`` untimed calls of each: alternating spreads a noisy machine's load
    over every function alike, so their ratios hold where absolute times drift."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def _stats(times: list[float]) -> tuple[float, float]:
    """Median and inter-quartile range (0 for fewer than two samples)."""
    if len(times) < 2:
        return times[0], 0.0
    quartiles = statistics.quantiles(times, n=4, method="inclusive")
    return statistics.median(times), quartiles[2] - quartiles[0]


def _max_error(result: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...],
               rows: torch.Tensor) -> float:
    """Max abs difference over the output's rows that have an allowed key (``rows [N]``) and,
    when present, every gradient (dq on those rows only)."""
    errors = []
    for position, (got, want) in enumerate(zip(result, reference)):
        if position < 2:  # out and dq: a padded query row's value is not defined by the mask
            got, want = got[..., rows, :], want[..., rows, :]
        errors.append(float((got.double() - want.double()).abs().max()))
    return max(errors)


def run_cell(workload: Workload, backward: bool, settings: Settings,
             on_step: Callable[[str], None] = lambda text: None) -> list[dict]:
    """Time every method of ``settings.methods`` on one workload and pass; one record each."""
    pass_name = "fwd+bwd" if backward else "fwd"
    q, k, v = workload.inputs(settings.seed, requires_grad=backward)
    rows = workload.rows_with_keys()  # [N]
    gen = torch.Generator().manual_seed(settings.seed + 1)
    # upstream gradient, zero on padded query rows (a real loss ignores them)
    grad_out = torch.randn(workload.shape, generator=gen) * rows[:, None]  # [B, H, N, D]
    dense_mask = workload.dense_mask()  # [1, 1, N, N], built once, outside timing
    block_mask = workload.block_mask() if "flex" in settings.methods and not backward else None

    records: dict[str, dict] = {}
    steps: dict[str, Callable[[], tuple]] = {}
    for key in settings.methods:
        record = {"workload": workload.name, "description": workload.describe(),
                  "kind": workload.kind, "shape": list(workload.shape),
                  "dtype": str(workload.dtype).replace("torch.", ""), "pass": pass_name,
                  "method": key, "label": method_label(key, workload), "status": "ok",
                  "reason": None, "median_s": None, "iqr_s": None, "n": 0, "times_s": [],
                  "tflops": None, "first_call_s": None, "max_err": None, "agrees": None,
                  "speedup": {}, "backend": None, "ignores_mask": ignores_mask(key, workload)}
        records[key] = record
        try:
            fn = make_method(key, workload, backward=backward, dense_mask=dense_mask,
                             block_mask=block_mask)
        except Unsupported as why:
            record.update(status="unsupported", reason=str(why))
            continue
        if key == "auto":
            record["backend"] = auto_backend_name(workload, backward)
        steps[key] = _step(fn, q, k, v, grad_out if backward else None)

    # warm-up: the first call of every method, timed, and its result kept for the check
    results, estimate = {}, {}
    for key, step in list(steps.items()):
        on_step(f"{records[key]['label']} · first call")
        start = time.perf_counter()
        try:
            results[key] = step()
        except Exception as error:  # a method failing must not sink the whole run
            records[key].update(status="error", reason=f"{type(error).__name__}: {error}")
            del steps[key]
            continue
        records[key]["first_call_s"] = estimate[key] = time.perf_counter() - start
        if key == "flex":  # the first call compiled: time one steady call for the estimate
            start = time.perf_counter()
            step()
            estimate[key] = time.perf_counter() - start
    reference = results.get("tiled")
    for key, result in results.items():
        if reference is None:
            break
        error = _max_error(result, reference, rows)
        records[key]["max_err"] = error
        if records[key]["ignores_mask"]:
            records[key]["reason"] = "speed reference only: computes attention without the mask"
            continue
        records[key]["agrees"] = error <= settings.tolerance
        if not records[key]["agrees"]:
            records[key]["status"] = "mismatch"
    del results, reference

    # timed rounds, interleaved across methods; each method's round count fits an equal share
    # of the budget, so a slow method (naive, a dense mask) does not cut the fast ones' rounds
    share = settings.cell_budget_s / max(len(steps), 1)
    reps = {key: int(min(settings.max_reps, max(settings.min_reps, share // max(estimate[key], 1e-9))))
            for key in steps}
    for rep in range(max(reps.values(), default=0)):
        for key, step in steps.items():
            if rep >= reps[key]:
                continue
            on_step(f"{records[key]['label']} · rep {rep + 1}/{reps[key]}")
            start = time.perf_counter()
            step()
            records[key]["times_s"].append(time.perf_counter() - start)

    flops = workload.flops(backward)
    for key in steps:
        record = records[key]
        record["median_s"], record["iqr_s"] = _stats(record["times_s"])
        record["n"] = len(record["times_s"])
        record["tflops"] = flops / record["median_s"] / 1e12
    for key, record in records.items():
        for column, ref in REFERENCES.items():
            ref_median = records.get(ref, {}).get("median_s")
            if record["median_s"] and ref_median:
                record["speedup"][column] = ref_median / record["median_s"]
    return list(records.values())


def _step(fn: Callable, q, k, v, grad_out: Optional[torch.Tensor]) -> Callable[[], tuple]:
    """One timed call: forward, or forward+backward when ``grad_out`` is given → ``(out,)`` or
    ``(out, dq, dk, dv)`` (detached)."""
    if grad_out is None:
        def forward_only():
            return (fn(q, k, v),)
        return forward_only

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(grad_out)
        return out.detach(), q.grad, k.grad, v.grad
    return forward_backward


def machine_info() -> dict:
    """CPU count, torch threads, versions and the source revision: what the numbers depend on."""
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "attnkit": __version__, "source": source_revision(),
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "hostname": platform.node()}


def source_revision() -> Optional[str]:
    """``git describe``-style revision of the attnkit checkout (``+modified`` when its
    ``src/attnkit`` differs from the commit), or ``None`` outside a git checkout."""
    import subprocess

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        # an installed copy inside another project's repository (its .venv) is not tracked
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"],
                                 cwd=package, capture_output=True, text=True, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package,
                                capture_output=True, text=True, timeout=10)
        if tracked.returncode != 0 or commit.returncode != 0:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=package,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    modified = [line[3:] for line in changed.stdout.splitlines() if line[:2] != "??"]
    return commit.stdout.strip() + (f"+modified ({', '.join(modified)})" if modified else "")


@dataclass
class Options:
    """Everything ``attnkit bench`` can be asked (see :mod:`attnkit.cli.bench`)."""

    quick: bool = False
    out: Optional[str] = None
    workloads: Optional[list[str]] = None
    methods: Optional[list[str]] = None
    reps: Optional[int] = None
    flex: Optional[bool] = None  # None: on for full runs, off for --quick
    memory: bool = True
    threads: Optional[int] = None  # torch.set_num_threads for the run; None: torch's default
    command: str = "attnkit bench"

    def settings(self) -> Settings:
        chosen = self.methods or METHODS
        unknown = [m for m in chosen if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}: choose from {list(METHODS)}")
        if "tiled" not in chosen:
            raise ValueError("--methods must include tiled: every output is checked against it")
        methods = tuple(m for m in METHODS if m in chosen and (m != "flex" or self.use_flex))
        if self.quick:
            return Settings(max_reps=self.reps or 2, min_reps=1, cell_budget_s=1.0, methods=methods)
        return Settings(max_reps=self.reps or 10, min_reps=min(2, self.reps or 2), methods=methods)

    @property
    def use_flex(self) -> bool:
        wanted = (not self.quick) if self.flex is None else self.flex
        return wanted and (self.methods is None or "flex" in self.methods)

    def out_dir(self) -> str:
        return self.out or os.path.join("results", "quick" if self.quick else "")


def _fresh_inductor_cache() -> Optional[str]:
    """Point torch's compile cache at a new empty folder (unless the user chose one), so Flex's
    first call is a real compile, not a hit in a cache left by an earlier run."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    import tempfile

    folder = tempfile.mkdtemp(prefix="attnkit-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def run_benchmark(options: Options, console=None) -> dict:
    """Run the workloads, then (unless ``options.memory`` is off) the memory measurements and
    the sweep against N, with a rich progress bar; return the results dict (see ``SCHEMA``).
    The thread count and compile-cache setting it changes are restored afterwards."""
    from . import memory
    from .workloads import select

    workloads = select(quick_workloads() if options.quick else standard_workloads(),
                       options.workloads)
    settings = options.settings()
    plan = (memory.default_plan(options.quick, flex=options.use_flex, methods=settings.methods,
                                threads=options.threads) if options.memory else None)
    threads_before = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    inductor_cache = _fresh_inductor_cache() if "flex" in settings.methods else None
    try:
        if plan:
            memory.start_server()  # imports attnkit now: the sweep runs the same code as the cells
        results = {
            "schema": SCHEMA,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": options.command, "machine": machine_info(),
            "config": {"quick": options.quick, "max_reps": settings.max_reps,
                       "min_reps": settings.min_reps, "cell_budget_s": settings.cell_budget_s,
                       "methods": list(settings.methods), "tolerance": settings.tolerance,
                       "inductor_cache": (inductor_cache and "fresh folder for this run") or (
                           "TORCHINDUCTOR_CACHE_DIR as set" if "flex" in settings.methods else None),
                       "flop_convention": "4*B*H*D per attended (q,k) pair forward (causal: "
                                          "N^2/2); fwd+bwd = 3.5x fwd"},
            "workloads": [w.describe() for w in workloads], "results": [], "memory": None,
            "sweep": None}
        started = time.perf_counter()
        _measure(results, workloads, settings, plan, console)
        results["elapsed_s"] = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads_before)
        if inductor_cache:
            import shutil

            shutil.rmtree(inductor_cache, ignore_errors=True)
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return results


def _measure(results: dict, workloads: list[Workload], settings: Settings, plan, console) -> None:
    """The cells, then the memory plan, under one progress bar; fills ``results`` in place."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    from . import memory

    cells = [(w, p == "fwd+bwd") for w in workloads for p in settings.passes]
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False)
    with progress:
        task = progress.add_task("benchmark", total=len(cells) + (plan.count() if plan else 0))
        for workload, backward in cells:
            where = f"{workload.name} · {'fwd+bwd' if backward else 'fwd'}"
            results["results"].extend(run_cell(
                workload, backward, settings,
                on_step=lambda text: progress.update(task, description=f"{where} · {text}")))
            progress.advance(task)
        if plan:
            results["sweep"] = memory.run_plan(
                plan, on_measure=lambda text: progress.update(task, description=f"memory · {text}"),
                after=lambda: progress.advance(task))
            results["memory"] = memory.headline(results["sweep"], plan)
        progress.update(task, description="done")


# ---- reporting ---------------------------------------------------------------------------------

def first_sentence(text: Optional[str]) -> str:
    """The first sentence of a reason, for a table cell (the JSON keeps it whole)."""
    return (text or "").split(". ")[0]


def _ms(seconds: Optional[float]) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def _speedup(record: dict, column: str) -> str:
    value = record["speedup"].get(column)
    return "—" if value is None else f"{value:.2f}×"


def sizes(record: dict) -> str:
    """``B1 H2 T512 D32``: the q/k/v sizes of a result record."""
    batch, heads, length, dim = record["shape"]
    return f"B{batch} H{heads} T{length} D{dim}"


def results_table(results: dict, pass_name: str):
    """A rich table of one pass: a row per workload × method, each workload with its sizes.

    Columns without meaning for the run are left out: in a ``--quick`` run TFLOP/s (toy sizes
    time the per-call cost, not throughput) and the first call's time unless Flex compiled, and
    a speed-up column no row has (Flex not run or not supported). A method that ignores the
    workload's mask is dimmed and marked as a speed reference (a caption says so)."""
    from rich.table import Table

    records = [r for r in results["results"] if r["pass"] == pass_name]
    ratios = [(column, title) for column, title in (("sdpa_mask", "vs SDPA mask"), ("flex", "vs Flex"))
              if any(r["speedup"].get(column) for r in records)]
    quick = results["config"].get("quick")
    show_tflops = not quick
    show_first = not quick or any(r["method"] == "flex" and r["first_call_s"] for r in records)
    ignoring = [r for r in records if r.get("ignores_mask")]
    caption = None
    if ignoring:
        caption = (f"{ignoring[0]['label']} runs torch SDPA without the mask of "
                   f"{', '.join(dict.fromkeys(r['workload'] for r in ignoring))}: a speed "
                   f"reference, not a result")
    table = Table(title=f"{pass_name}: median of interleaved rounds; speed-up = t_ref / t "
                        f"(> 1: faster than the reference)", caption=caption,
                  title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    columns = [("workload", "left"), ("method", "left"), ("median ms", "right"), ("IQR ms", "right"),
               ("n", "right")]
    columns += [("TFLOP/s", "right")] if show_tflops else []
    columns += [(title, "right") for _, title in ratios]
    columns += [("1st call s", "right")] if show_first else []
    columns += [("max err", "right")]
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)
    table.add_column("note", overflow="fold")
    previous, row = None, 0
    for record in records:
        if previous is not None and record["workload"] != previous:
            table.add_section()
        row = 0 if record["workload"] != previous else row + 1
        previous = record["workload"]
        workload = {0: record["workload"], 1: sizes(record)}.get(row, "")  # name, then sizes
        style, note = "", ""
        if record["status"] == "mismatch":
            style, note = "red", f"DISAGREES with tiled (> {results['config']['tolerance']:g})"
        elif record["status"] in ("unsupported", "error"):
            style, note = "dim", first_sentence(record["reason"])
        elif record.get("ignores_mask"):
            style, note = "dim", "mask ignored: speed reference"
        elif record["backend"]:
            note = f"auto picked {record['backend']}"
        first = "—" if record["first_call_s"] is None else f"{record['first_call_s']:.2f}"
        error = "—" if record["max_err"] is None else f"{record['max_err']:.1e}"
        cells = [workload, record["label"], _ms(record["median_s"]), _ms(record["iqr_s"]),
                 str(record["n"])]
        if show_tflops:
            cells.append("—" if record["tflops"] is None else f"{record['tflops']:.3g}")
        cells += [_speedup(record, column) for column, _ in ratios]
        cells += [first] if show_first else []
        table.add_row(*cells, error, note, style=style)
    return table


def memory_table(results: dict):
    """A rich table of the sweep against N (its largest N is the memory headline)."""
    from rich.table import Table

    from .memory import fmt_mib

    from .report import sweep_shape

    table = Table(title=f"forward+backward, causal, {sweep_shape(results.get('sweep') or [])}, "
                        f"one fresh process each: extra peak RSS beyond inputs, outputs and "
                        f"gradients",
                  title_justify="left", show_edge=False, pad_edge=False)
    for column in ("method", "N", "extra peak MiB", "median s", "n"):
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    table.add_column("note", overflow="fold")
    for row in results.get("sweep") or []:
        median = "—" if row.get("median_s") is None else f"{row['median_s']:.3f}"
        table.add_row(row["label"], str(row["n"]), fmt_mib(row.get("extra_peak_mib")), median,
                      str(row.get("reps", 0)), first_sentence(row.get("reason")),
                      style="" if row["status"] == "ok" else "dim")
    return table


def print_report(results: dict, console) -> None:
    """Print the machine line, one table per pass and the memory table."""
    machine = results["machine"]
    console.print(f"[bold]machine:[/bold] {machine['cpu_count']} CPUs, {machine['torch_threads']} "
                  f"torch threads, torch {machine['torch']}, {machine['platform']}; {results['date']}")
    for pass_name in PASSES:
        if any(r["pass"] == pass_name for r in results["results"]):
            console.print(results_table(results, pass_name))
    if results.get("sweep"):
        console.print(memory_table(results))


def write_results(results: dict, out_dir: str, name: str = "cpu.json") -> str:
    """Write the results as strict JSON (NaN/inf become null) into ``out_dir`` (created);
    returns the file's path."""
    import json

    os.makedirs(out_dir or ".", exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as handle:
        json.dump(_jsonable(results), handle, indent=1, allow_nan=False)
    return path


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
