"""``attnkit check``: every registered backend against the float64 reference.

For each available backend in ``attnkit.dispatch.BACKENDS`` and each case of a grid (dtypes ×
shapes × masks), the forward output, the LSE and (float32/float64) the gradients of q, k, v
are compared with the reference backend run in float64 on the *same* (already rounded) inputs.

Pass rule (flash-attn's): a backend's max-abs error must be at most twice the error
of plain PyTorch math in the result's dtype — ``softmax(q kᵀ·scale + mask) v`` with
``masked_fill``, nothing upcast; the input dtype, and float32 for the LSE of fp16/bf16 inputs
(the same inputs, cast exactly) — plus an absolute floor. Any NaN fails.

The floor covers what the 2× rule cannot see: where the result's dtype is float32 or float64
(fp32/fp64 inputs, and the fp32 LSE of fp16/bf16 inputs) plain math is itself exact to an ulp
or two, and a correct kernel that sums in another order (tiles, a recomputing backward) differs
from it by about √n roundings (n = the longest reduction: Tq, Tk or D), so the floor is
``√n · eps · max|reference|`` (at least 1e-12 for float64; at least
:data:`LOW_PRECISION_LSE_FLOOR` for the LSE of fp16/bf16 inputs, whose kernels may take a fast
approximate ``exp``: an LSE rounded to fp16 or bf16 still fails). For float16/bfloat16 results
it is flash-attn's ``2·max|(ref + 0.3) − 0.3 − ref|`` (the error of rounding the reference into
the dtype); there the 2× plain-math term dominates. A real error (a wrong mask, a 1% scale bug, a
low-precision accumulation) still exceeds the bound by orders of magnitude. Backends registered
later (tiled, triton) are picked up automatically.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from .. import dispatch
from ..api import attention
from ..backends.reference import steps
from ..inputs import validate
from ..masks import Mask, MaskSpace, bias, causal, dense, documents, padding, sliding_window
from ..numerics import accum_dtype

from ._common import UsageError, check_device, seed_type

HELP = ("check every available backend against the float64 reference (exit 1 on any failure "
        "or when nothing could be checked)")

GRAD_DTYPES = (torch.float64, torch.float32)
"""Gradients are checked for these dtypes (low-precision backward is left to the benchmarks)."""

FLOAT64_FLOOR = 1e-12
"""Smallest absolute error floor for float64 results (plain float64 math can be exact)."""

LOW_PRECISION_LSE_FLOOR = 2.0 ** -13
"""Smallest absolute error floor for the float32 LSE of fp16/bf16 inputs. A fused kernel for
those dtypes may take ``exp`` from a fast approximation (torch's CPU flash kernel does), whose
relative error moves the LSE by about as much absolutely, whatever its size. A quarter of
fp16's unit roundoff: an LSE rounded to fp16 or bf16 (errors up to ``2^-11·|lse|`` and
``2^-8·|lse|`` a row) exceeds it on any case with a few rows of ``|lse| ≥ 1``."""


class Shape(NamedTuple):
    """Problem size: q ``[batch, heads_q, q_len, dim_qk]``, k/v ``[batch, heads_kv, kv_len, dim_qk|dim_v]``."""

    batch: int
    heads_q: int
    heads_kv: int
    q_len: int
    kv_len: int
    dim_qk: int
    dim_v: int

    @property
    def label(self) -> str:
        heads = f"H{self.heads_q}" + (f":{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        dims = f"D{self.dim_qk}" + (f"→{self.dim_v}" if self.dim_v != self.dim_qk else "")
        return f"B{self.batch} {heads} {self.q_len}×{self.kv_len} {dims}"


MaskFactory = Callable[[Shape, torch.Generator], Optional[Mask]]


def _segments(length: int, parts: int) -> torch.Tensor:
    """Document ids ``[length]``: ``parts`` consecutive documents of uneven lengths."""
    cuts = sorted({max(1, round(length * f)) for f in (0.3, 0.55, 0.85)[: parts - 1]})
    ids = torch.zeros(length, dtype=torch.long)
    for cut in cuts:
        ids[cut:] += 1
    return ids


def _padding(shape: Shape, gen) -> Mask:
    # Batch 1 has padded queries (fully masked rows: output 0, LSE -inf) and padded keys.
    q_lengths = [shape.q_len, max(1, shape.q_len // 2)] + [shape.q_len] * (shape.batch - 2)
    kv_lengths = [max(1, shape.kv_len - 3), max(1, shape.kv_len // 2)] + [shape.kv_len] * (shape.batch - 2)
    return padding(q_lengths=q_lengths[: shape.batch], kv_lengths=kv_lengths[: shape.batch])


def _dense(shape: Shape, gen) -> Mask:
    allowed = torch.rand(shape.batch, 1, shape.q_len, shape.kv_len, generator=gen) < 0.7  # [B, 1, Tq, Tk]
    allowed[0, 0, 1] = False  # one fully masked row
    return dense(allowed)


def _bias(shape: Shape, gen) -> Mask:
    values = torch.randn(1, shape.heads_q, shape.q_len, shape.kv_len, generator=gen)  # [1, H, Tq, Tk]
    return bias(values)


def _documents(shape: Shape, gen) -> Mask:
    return documents(_segments(shape.q_len, 3), _segments(shape.kv_len, 3))


MASKS: dict[str, MaskFactory] = {
    "none": lambda shape, gen: None,
    "causal": lambda shape, gen: causal(),
    "causal(bottom_right)": lambda shape, gen: causal("bottom_right"),
    "sliding_window(4)": lambda shape, gen: sliding_window(4),
    "padding": _padding,
    "documents": _documents,
    "documents&causal": lambda shape, gen: _documents(shape, gen) & causal(),
    "dense": _dense,
    "bias": _bias,
    "bias&causal": lambda shape, gen: _bias(shape, gen) & causal(),
}
"""Mask name → factory ``(shape, generator) -> Mask | None`` (built fresh for every run)."""

SQUARE = Shape(2, 2, 2, 16, 16, 16, 16)
WIDE = Shape(2, 2, 2, 8, 24, 16, 16)  # Tq < Tk (decoding with a cache)
TALL = Shape(2, 2, 2, 24, 8, 16, 16)  # Tq > Tk
DV = Shape(2, 2, 2, 16, 16, 16, 24)  # Dv != Dk
GQA = Shape(2, 4, 2, 16, 16, 16, 16)  # 2 query heads per key/value head
MQA_DV = Shape(1, 4, 1, 12, 20, 8, 12)  # 1 key/value head, Tq != Tk, Dv != Dk
RAGGED = Shape(2, 2, 2, 37, 37, 20, 20)  # sizes that are no multiple of any block

FULL_CASES: tuple[tuple[str, Shape], ...] = (
    ("none", SQUARE), ("none", WIDE), ("none", TALL), ("none", DV), ("none", GQA), ("none", RAGGED),
    ("causal", SQUARE), ("causal", WIDE), ("causal", RAGGED), ("causal", MQA_DV),
    ("causal(bottom_right)", WIDE), ("causal(bottom_right)", TALL),
    ("sliding_window(4)", RAGGED), ("padding", RAGGED), ("padding", DV),
    ("documents", SQUARE), ("documents&causal", RAGGED), ("dense", GQA), ("dense", WIDE),
    ("bias", SQUARE), ("bias&causal", DV),
)
"""(mask, shape) pairs of the full grid; each runs in every dtype of :data:`FULL_DTYPES`."""
FULL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

QUICK_CASES: tuple[tuple[str, Shape], ...] = (
    ("none", GQA), ("causal(bottom_right)", TALL), ("padding", RAGGED), ("bias&causal", DV),
)
QUICK_DTYPES = (torch.float32, torch.float16)


@dataclass
class Measure:
    """One compared quantity (``out``, ``lse``, ``dq``, ``dk``, ``dv``) of one backend × case."""

    quantity: str
    error: float
    bound: float
    status: str  # "PASS" | "FAIL" | "skip"
    reason: str = ""


@dataclass
class CheckResult:
    """One backend on one case: ``status`` is FAIL if any measure fails (or the run raised),
    ``skip`` if the backend refused the case (``reason`` says why), else PASS."""

    backend: str
    case: str
    dtype: str
    status: str
    reason: str = ""
    measures: list[Measure] = field(default_factory=list)

    def measure(self, quantity: str) -> Optional[Measure]:
        return next((m for m in self.measures if m.quantity == quantity), None)


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Max-abs difference from the float64 ``reference``; equal infinities count as 0; NaN → nan."""
    value = value.detach().to(torch.float64)
    if torch.isnan(value).any():
        return math.nan
    if value.shape != reference.shape:
        return math.inf
    diff = torch.where(value == reference, torch.zeros_like(value), (value - reference).abs())
    return diff.max().item() if diff.numel() else 0.0


def plain_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], scale: float,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention in the inputs' own dtype: ``q [B, Hq, Tq, Dk]``, ``k [B, Hkv, Tk, Dk]``,
    ``v [B, Hkv, Tk, Dv]`` → ``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq])``, both in that dtype.

    Masked scores are ``masked_fill``-ed with −inf; a fully masked row is given finite scores
    before the softmax and zeroed after (output 0, LSE −inf), so it never makes NaN.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, Tk, D]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    row_ok = None
    if mask is not None:
        b, h, tq, tk = scores.shape
        space = MaskSpace(batch=b, heads=h, q_len=tq, kv_len=tk, device=q.device)
        additive = mask.dense_bias(space)
        if additive is not None:
            scores = scores + additive.to(q.dtype)
        allowed = mask.to_dense(space)  # [Bm, Hm, Tq, Tk]
        row_ok = allowed.any(dim=-1, keepdim=True)  # [Bm, Hm, Tq, 1]
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_ok, 0.0)
    weights = torch.softmax(scores, dim=-1)  # [B, Hq, Tq, Tk]
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Tq]
    if row_ok is not None:
        weights = weights.masked_fill(~row_ok, 0.0)
        lse = lse.masked_fill(~row_ok[..., 0], float("-inf"))
    return weights @ v, lse


class _Truth(NamedTuple):
    """The reference and plain-math results for one case and dtype."""

    inputs: tuple  # (q, k, v) in the case's dtype (rounded once from float64 draws)
    grad_out: torch.Tensor  # [B, Hq, Tq, Dv] float64: L = Σ out ⊙ grad_out
    reference: dict  # quantity → float64 tensor
    plain_error: dict  # quantity → max error of plain math


def _make_mask(mask_name: str, shape: Shape, seed: int) -> Optional[Mask]:
    return MASKS[mask_name](shape, torch.Generator().manual_seed(seed + 1))


def _truth(mask_name: str, shape: Shape, dtype: torch.dtype, seed: int) -> _Truth:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.batch, shape.heads_q, shape.q_len, shape.dim_qk, generator=gen, dtype=torch.float64)
    k = torch.randn(shape.batch, shape.heads_kv, shape.kv_len, shape.dim_qk, generator=gen, dtype=torch.float64)
    v = torch.randn(shape.batch, shape.heads_kv, shape.kv_len, shape.dim_v, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(shape.batch, shape.heads_q, shape.q_len, shape.dim_v, generator=gen,
                           dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the case's inputs, rounded once
    with_grad = dtype in GRAD_DTYPES

    # Reference: float64 on the rounded inputs.
    leaves64 = [t.to(torch.float64, copy=True).requires_grad_(with_grad) for t in (q, k, v)]
    inputs64 = validate(*leaves64, _make_mask(mask_name, shape, seed))
    result = steps(inputs64)
    reference = {"out": result.out.detach(), "lse": result.lse.detach()}
    # Plain math in the case's dtype.
    leaves = [t.clone().requires_grad_(with_grad) for t in (q, k, v)]
    plain_inputs = validate(*leaves, _make_mask(mask_name, shape, seed))
    plain_out, plain_lse = plain_math(*leaves, plain_inputs.mask, plain_inputs.scale)
    lse_dtype = accum_dtype(dtype)  # the LSE's own dtype: float32 for fp16/bf16 inputs
    if lse_dtype != dtype:
        with torch.no_grad():
            plain_lse = plain_math(*(t.to(lse_dtype) for t in leaves), plain_inputs.mask,
                                   plain_inputs.scale)[1]
    plain_error = {"out": max_error(plain_out, reference["out"]), "lse": max_error(plain_lse, reference["lse"])}
    if with_grad:
        grads64 = torch.autograd.grad((result.out * grad_out).sum(), leaves64)
        grads = torch.autograd.grad((plain_out.to(torch.float64) * grad_out).sum(), leaves)
        for name, g64, g in zip(("dq", "dk", "dv"), grads64, grads):
            reference[name] = g64
            plain_error[name] = max_error(g, g64)
    return _Truth((q, k, v), grad_out, reference, plain_error)


def error_floor(reference: torch.Tensor, dtype: torch.dtype, reduction: int) -> float:
    """The absolute floor of the bound for a result of ``dtype`` compared with ``reference``
    (float64): ``√reduction · eps · max|ref|`` for float32/float64 (≥ 1e-12 for float64), and
    twice the rounding error ``max|(r + 0.3) − 0.3 − r|`` (computed in ``dtype``) for fp16/bf16."""
    finite = reference[torch.isfinite(reference)]  # [N]
    if finite.numel() == 0:
        return FLOAT64_FLOOR if dtype == torch.float64 else 0.0
    if dtype in (torch.float32, torch.float64):
        floor = math.sqrt(reduction) * torch.finfo(dtype).eps * finite.abs().max().item()
        return max(floor, FLOAT64_FLOOR) if dtype == torch.float64 else floor
    rounded = finite.to(dtype)
    return 2.0 * ((rounded + 0.3) - 0.3 - rounded).abs().max().item()


def _judge(quantity: str, value: torch.Tensor, truth: _Truth, dtype: torch.dtype,
           shape: Shape) -> Measure:
    reference = truth.reference[quantity]
    error = max_error(value, reference)
    result_dtype = accum_dtype(dtype) if quantity == "lse" else dtype  # LSE is float32/float64
    reduction = max(shape.q_len, shape.kv_len, shape.dim_qk, shape.dim_v)
    floor = error_floor(reference, result_dtype, reduction)
    if result_dtype != dtype:  # the float32 LSE of fp16/bf16 inputs
        floor = max(floor, LOW_PRECISION_LSE_FLOOR)
    bound = 2.0 * truth.plain_error[quantity] + floor
    if math.isnan(error):
        return Measure(quantity, error, bound, "FAIL", "NaN in the result")
    return Measure(quantity, error, bound, "PASS" if error <= bound else "FAIL")


def check_case(backend_name: str, mask_name: str, shape: Shape, dtype: torch.dtype, *,
               seed: int = 0, truth: Optional[_Truth] = None) -> CheckResult:
    """Run one backend on one case and compare out, LSE and (float32/64) gradients."""
    case = f"{mask_name} {shape.label}"
    dtype_name = str(dtype).replace("torch.", "")
    truth = truth or _truth(mask_name, shape, dtype, seed)
    backend = dispatch.BACKENDS[backend_name]
    q, k, v = truth.inputs

    def refusals(tensors, **need) -> list[str]:
        return backend.not_supported_reasons(validate(*tensors, _make_mask(mask_name, shape, seed), **need))

    with torch.no_grad():
        reasons = refusals((q, k, v))
    if reasons:
        return CheckResult(backend_name, case, dtype_name, "skip", "; ".join(reasons))
    measures = []
    try:
        leaves = [t.clone().requires_grad_(dtype in GRAD_DTYPES) for t in (q, k, v)]
        grad_reasons = refusals(leaves) if dtype in GRAD_DTYPES else []
        with_grad = dtype in GRAD_DTYPES and not grad_reasons
        with torch.set_grad_enabled(with_grad):
            out = attention(*leaves, _make_mask(mask_name, shape, seed), backend=backend_name)
        measures.append(_judge("out", out, truth, dtype, shape))
        if with_grad:
            grads = torch.autograd.grad((out.to(torch.float64) * truth.grad_out).sum(), leaves)
            measures += [_judge(name, g, truth, dtype, shape) for name, g in zip(("dq", "dk", "dv"), grads)]
        elif grad_reasons:
            measures.append(Measure("dq", math.nan, math.nan, "skip", "; ".join(grad_reasons)))
        with torch.no_grad():  # the LSE is checked forward-only
            lse_reasons = refusals((q, k, v), need_lse=True)
            if lse_reasons:
                measures.append(Measure("lse", math.nan, math.nan, "skip", "; ".join(lse_reasons)))
            else:
                result = attention(q, k, v, _make_mask(mask_name, shape, seed), backend=backend_name,
                                   return_lse=True)
                measures.append(_judge("lse", result.lse, truth, dtype, shape))
    except Exception as error:  # a crash is a failure of this backend on this case, not of check
        return CheckResult(backend_name, case, dtype_name, "FAIL",
                           f"raised {type(error).__name__}: {error}".splitlines()[0], measures)
    failed = [m for m in measures if m.status == "FAIL"]
    reason = "; ".join(f"{m.quantity}: {m.reason or f'{m.error:.2e} > {m.bound:.2e}'}" for m in failed)
    return CheckResult(backend_name, case, dtype_name, "FAIL" if failed else "PASS", reason, measures)


def run_checks(quick: bool = False, backends: Optional[list[str]] = None, *, seed: int = 0,
               on_result: Optional[Callable[[CheckResult], None]] = None) -> list[CheckResult]:
    """Check every available backend (or those named in ``backends``) on the grid.

    ``quick`` uses a small grid (a few seconds). Returns one :class:`CheckResult` per
    backend × case × dtype, plus one ``skip`` result for each unavailable backend.
    ``on_result`` is called after each result (for progress display).
    """
    names = list(dispatch.BACKENDS) if backends is None else list(backends)
    unknown = [n for n in names if n not in dispatch.BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}: choose from {list(dispatch.BACKENDS)}")
    results = []
    runnable = []
    for name in names:
        why_not = dispatch.BACKENDS[name].unavailable_reason()
        if why_not:
            results.append(CheckResult(name, "(all cases)", "-", "skip", why_not))
        else:
            runnable.append(name)
    cases = QUICK_CASES if quick else FULL_CASES
    dtypes = QUICK_DTYPES if quick else FULL_DTYPES
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra CPU threads only add synchronisation (~10x slower)
    try:
        for index, (mask_name, shape) in enumerate(cases):
            for dtype in dtypes:
                case_seed = seed * 7919 + index
                truth = _truth(mask_name, shape, dtype, case_seed)
                for name in runnable:
                    result = check_case(name, mask_name, shape, dtype, seed=case_seed, truth=truth)
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
    finally:
        torch.set_num_threads(threads)
    return results


def count_runs(quick: bool, n_backends: int) -> int:
    """How many backend × case × dtype runs :func:`run_checks` makes."""
    return n_backends * len(QUICK_CASES if quick else FULL_CASES) * len(QUICK_DTYPES if quick else FULL_DTYPES)


def _cell(result: CheckResult, quantities: tuple[str, ...]) -> str:
    """'error / bound' for the worst of ``quantities`` (ratio error/bound), coloured by status."""
    measures = [m for m in (result.measure(q) for q in quantities) if m is not None]
    if not measures:
        return "" if result.status != "skip" else "–"
    if all(m.status == "skip" for m in measures):
        return "[dim]skip"

    def ratio(m):
        if m.status == "skip":
            return -1.0
        if math.isnan(m.error):
            return math.inf
        return m.error / m.bound if m.bound > 0 else (math.inf if m.error > 0 else 0.0)
    worst = max(measures, key=ratio)
    colour = "red" if worst.status == "FAIL" else "green"
    return f"[{colour}]{worst.error:.1e} / {worst.bound:.1e}"


def results_table(results: list[CheckResult]):
    """A rich table, one row per backend × case × dtype: error / bound per quantity, and the verdict."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="max |error| vs float64 reference  /  bound = 2 × plain-math error in the same dtype + rounding floor",
                  title_justify="left", show_edge=False, pad_edge=False)
    for column, justify in (("backend", "left"), ("case", "left"), ("dtype", "left"), ("out", "right"),
                            ("lse", "right"), ("grad q,k,v", "right"), ("result", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for r in results:
        verdict = {"PASS": "[green]PASS", "FAIL": "[bold red]FAIL"}.get(r.status, "[yellow]skip")
        if r.reason and r.status != "PASS":
            verdict += f"[/]: {escape(r.reason)}"
        skipped = [m for m in r.measures if m.status == "skip"]
        if skipped:
            verdict += "[/] [dim]" + escape("; ".join(f"{m.quantity} skipped: {m.reason}" for m in skipped))
        table.add_row(r.backend, r.case, r.dtype, _cell(r, ("out",)), _cell(r, ("lse",)),
                      _cell(r, ("dq", "dk", "dv")), verdict)
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small grid (a few seconds); "
                        "with --invariance, sequences of 100 positions")
    parser.add_argument("--backend", action="extend", nargs="+", metavar="NAME", default=None,
                        help=f"check only these backends (default: all of {list(dispatch.BACKENDS)})")
    parser.add_argument("--seed", type=seed_type, default=0,
                        help="random seed of the inputs (default 0)")
    parser.add_argument("--invariance", action="store_true",
                        help="check the invariance contract instead (run to run, batch, "
                             "chunking, ring; attnkit.invariant()): holds / refused / BROKEN per "
                             "backend, exit 1 on BROKEN")
    parser.add_argument("--device", default=None,
                        help="with --invariance: the device (default cuda when present, else "
                             "cpu)")


def run_invariance(names: list[str], device: str, seed: int, console, quick: bool = False) -> int:
    """``attnkit check --invariance``: :func:`attnkit.invariance.check` on ``names`` as a table
    (check × backend); 1 when any check is BROKEN or none could run (every backend refused).
    ``quick``: sequences of 100 positions
    (seconds on the Triton interpreter, where 600 take minutes)."""
    from rich.markup import escape
    from rich.table import Table

    from .. import invariance

    checks = [c for c in invariance.CHECKS if c != "ring" or torch.device(device).type == "cpu"]
    findings = invariance.check(names, device=device, seed=seed, checks=checks,
                                length=100 if quick else None)
    table = Table(title=f"invariance contract on {device} (float32; bits, not tolerances)")
    table.add_column("check")
    for name in names:
        table.add_column(name)
    style = {"holds": "green", "refused": "yellow", "BROKEN": "bold red"}
    for check in checks:
        cells = []
        for name in names:
            found = next(f for f in findings if f.check == check and f.backend == name)
            detail = f" [dim]{escape(found.detail)}" if found.detail else ""
            cells.append(f"[{style[found.status]}]{found.status}[/]{detail}")
        table.add_row(check, *cells)
    console.print(table)
    broken = [f for f in findings if f.status == "BROKEN"]
    held = sum(f.status == "holds" for f in findings)
    summary = f"{held} held, {len(broken)} broken"
    if not held and not broken:
        summary += ": nothing could be checked (every backend refused)"
    console.print(f"[bold red]{summary}" if broken or not held else f"[bold green]{summary}")
    return 1 if broken or not held else 0


def run(args: argparse.Namespace, console) -> int:
    from rich.progress import Progress

    names = args.backend if args.backend else list(dispatch.BACKENDS)
    unknown = [n for n in names if n not in dispatch.BACKENDS]
    if unknown:
        raise UsageError(f"--backend: unknown backend(s) {unknown}; choose from {list(dispatch.BACKENDS)}")
    available = [n for n in names if dispatch.BACKENDS[n].is_available()]
    missing = [n for n in names if n not in available]
    if args.backend and missing:
        reasons = "; ".join(f"{n}: {dispatch.BACKENDS[n].unavailable_reason()}" for n in missing)
        usable = [n for n, b in dispatch.BACKENDS.items() if b.is_available()]
        raise UsageError(f"--backend {' '.join(missing)}: cannot run on this machine ({reasons}); "
                         f"choose from the available backends {usable} (see `attnkit info`)")
    if args.invariance:
        device = (check_device("--device", args.device) if args.device is not None
                  else "cuda" if torch.cuda.is_available() else "cpu")
        return run_invariance(available, device, args.seed, console, args.quick)
    if args.device is not None:
        raise UsageError("--device goes with --invariance (the reference check runs on CPU)")
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("checking backends", total=count_runs(args.quick, len(available)))
        results = run_checks(args.quick, names, seed=args.seed,
                             on_result=lambda result: progress.advance(task))
    console.print(results_table(results))
    counts = {status: sum(r.status == status for r in results) for status in ("PASS", "FAIL", "skip")}
    grid = "quick" if args.quick else "full"
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['skip']} skipped ({grid} grid)"
    console.print(f"[bold red]{summary}" if counts["FAIL"] else f"[bold green]{summary}")
    if counts["PASS"] + counts["FAIL"] == 0:
        print("attnkit check: error: nothing was checked: every backend or case was skipped "
              "(reasons in the table); check other backends (see `attnkit info`)", file=sys.stderr)
        return 1
    return 1 if counts["FAIL"] else 0
