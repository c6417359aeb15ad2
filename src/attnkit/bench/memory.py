"""Peak memory (and time) of one forward+backward pass, each measured in a fresh process.

What is measured: the growth of the process's resident-set high-water mark
(``getrusage(RUSAGE_SELF).ru_maxrss``) across one forward+backward call, after

1. a warm-up call of the same method at a small size (so one-off library set-up — thread
   pools, lazily loaded kernels — is not charged to the measured call),
2. allocating the inputs ``q, k, v [1, H, N, D]`` and the upstream gradient, and allocating,
   touching and freeing buffers the size of the output and the three gradients (so the
   high-water mark already covers them: what remains is the method's *extra* memory).

A dense bool mask (SDPA with a mask, naive) is built after the baseline: it is part of the
extra memory of those methods. Because the high-water mark only ever rises, every measurement
needs its own process: a forkserver (started once, with torch and attnkit imported but no
computation run) forks one child per (method, N). The number is the real peak of the process,
allocator behaviour included (glibc keeps some freed memory; page-granular touching).
After the memory call the child times up to ``max_reps`` further calls (median) within a small
time budget; when the measured call alone took longer than the budget, its time is the sample.
"""

from __future__ import annotations

import math
import multiprocessing
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import attnkit

SWEEP_METHODS = ("tiled", "sdpa", "sdpa_mask", "naive", "flex")
"""Methods measured against N: attnkit tiled, SDPA is_causal (no mask tensor), SDPA with the
dense bool mask, naive, and compiled FlexAttention (when it has a CPU backward)."""

LABELS = {"tiled": "attnkit tiled", "sdpa": "torch SDPA is_causal", "sdpa_mask": "torch SDPA dense mask",
          "naive": "naive", "flex": "FlexAttention compiled"}

MEMORY_LIMIT_BYTES = 8 * 2**30
"""Skip a (method, N) whose estimated peak exceeds this (about 8 GiB)."""

WARMUP_LEN = 256
"""Sequence length of the warm-up call made before the baseline."""

_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


def max_rss_bytes() -> int:
    """The process's resident-set high-water mark so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


def estimated_bytes(method: str, n: int, heads: int = 1) -> int:
    """Rough peak of a forward+backward of ``method`` at length ``n`` (to skip hopeless ones):
    the materialising methods hold about five ``N×N`` fp32 matrices (scores, masked scores,
    weights and their gradients) plus the bool mask."""
    square = heads * n * n
    if method == "naive":
        return 5 * 4 * square + square
    if method == "sdpa_mask":
        return 3 * 4 * square + square  # the bool mask, its float conversion, kernel scratch
    return 0


@dataclass(frozen=True)
class Spec:
    """One measurement: ``method`` at ``q, k, v [1, heads, n, head_dim]`` fp32, causal mask."""

    method: str
    n: int
    heads: int = 1
    head_dim: int = 64
    max_reps: int = 3
    time_budget_s: float = 5.0
    threads: Optional[int] = None  # torch.set_num_threads in the child; None: torch's default


def _method(method: str, n: int) -> tuple[Callable, bool]:
    """``(fn(q, k, v, allowed) -> out, needs_dense_mask)`` for a causal mask at length ``n``;
    ``allowed`` is the dense bool mask ``[1, 1, n, n]`` when needed, else ``None``."""
    mask = attnkit.causal()
    if method == "tiled":
        return (lambda q, k, v, allowed: attnkit.attention(q, k, v, mask, backend="tiled")), False
    if method == "sdpa":
        return (lambda q, k, v, allowed: F.scaled_dot_product_attention(q, k, v, is_causal=True)), False
    if method == "sdpa_mask":
        return (lambda q, k, v, allowed: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)), True
    if method == "naive":
        from .runner import naive_attention

        return naive_attention, True
    if method == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from .runner import flex_probe_backward

        flex_probe_backward()
        compiled = torch.compile(flex_attention)
        block_masks = {}

        def flex(q, k, v, allowed):
            length = q.shape[-2]
            if length not in block_masks:
                block_masks[length] = create_block_mask(
                    lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length,
                    device="cpu")
            return compiled(q, k, v, block_mask=block_masks[length])
        return flex, False
    raise ValueError(f"unknown method {method!r}: choose from {SWEEP_METHODS}")


def _causal_dense(n: int) -> torch.Tensor:
    """Bool ``[1, 1, n, n]``, True on and below the diagonal."""
    return torch.ones(n, n, dtype=torch.bool).tril_()[None, None]


def _fwd_bwd(fn, q, k, v, grad_out, allowed):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v, allowed).backward(grad_out)


def measure_here(spec: Spec) -> dict:
    """Run one measurement in *this* process (call it only in a fresh one: see :func:`measure`).
    Returns ``extra_peak_bytes``, ``baseline_bytes`` and the timings."""
    from .runner import Unsupported

    shape = (1, spec.heads, spec.n, spec.head_dim)  # [1, H, N, D]
    if spec.threads:
        torch.set_num_threads(spec.threads)
    try:
        fn, needs_mask = _method(spec.method, spec.n)
    except Unsupported as why:
        return {"status": "unsupported", "reason": str(why)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 1. warm-up at a small size
        small = min(WARMUP_LEN, spec.n)
        warm = [torch.randn(1, spec.heads, small, spec.head_dim, requires_grad=True) for _ in range(3)]
        _fwd_bwd(fn, *warm, torch.randn(1, spec.heads, small, spec.head_dim),
                 _causal_dense(small) if needs_mask else None)
        del warm
        # 2. inputs, and the output/gradient footprint allocated, touched and freed
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(shape)
        footprint = [torch.ones(shape) for _ in range(4)]  # out, dq, dk, dv
        del footprint
        baseline = max_rss_bytes()
        # 3. the measured call (the dense mask, where needed, counts as extra)
        start = time.perf_counter()
        allowed = _causal_dense(spec.n) if needs_mask else None
        _fwd_bwd(fn, q, k, v, grad_out, allowed)
        first_s = time.perf_counter() - start
        extra = max_rss_bytes() - baseline
        # 4. timing (mask already built), within the time budget; when the measured call alone
        #    used the budget up, its own time is the one sample
        times = [] if first_s <= spec.time_budget_s else [first_s]
        while not times or (len(times) < spec.max_reps and first_s + sum(times) <= spec.time_budget_s):
            start = time.perf_counter()
            _fwd_bwd(fn, q, k, v, grad_out, allowed)
            times.append(time.perf_counter() - start)
    return {"status": "ok", "reason": None, "extra_peak_bytes": extra, "baseline_bytes": baseline,
            "first_s": first_s, "times_s": times, "median_s": statistics.median(times),
            "reps": len(times), "torch_threads": torch.get_num_threads()}


def _child(spec: Spec, conn) -> None:
    try:
        result = measure_here(spec)
    except Exception as error:  # reported, not raised: the parent keeps going
        result = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
    conn.send(result)
    conn.close()


_CONTEXT = None


def _context():
    """A forkserver context whose server has imported torch and attnkit (and run nothing)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        # symbolic_shapes: imported lazily by the first backward call (seconds, in every child)
        _CONTEXT.set_forkserver_preload([__name__, "torch.fx.experimental.symbolic_shapes"])
    return _CONTEXT


def _nothing() -> None:
    pass


def start_server() -> None:
    """Start the forkserver now and wait until it has imported torch and attnkit (forking one
    child that does nothing), so the sweep measures the code the run started with."""
    child = _context().Process(target=_nothing)
    child.start()
    child.join()


def measure(spec: Spec) -> dict:
    """Measure ``spec`` in a fresh child process; returns the record for the JSON (with
    ``extra_peak_mib``; ``status`` ``ok``, ``skipped``, ``unsupported`` or ``error``)."""
    record = {"method": spec.method, "label": LABELS.get(spec.method, spec.method), "n": spec.n,
              "heads": spec.heads, "head_dim": spec.head_dim, "mask": "causal",
              "extra_peak_bytes": None, "extra_peak_mib": None, "median_s": None, "reps": 0}
    estimate = estimated_bytes(spec.method, spec.n, spec.heads)
    if estimate > MEMORY_LIMIT_BYTES:
        record.update(status="skipped", reason=f"estimated {estimate / 2**30:.1f} GiB > "
                                               f"{MEMORY_LIMIT_BYTES / 2**30:.0f} GiB limit")
        return record
    context = _context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(spec, send))
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # killed (out of memory?) before it could answer
        result = {"status": "error", "reason": "the measuring process died without a result"}
    child.join()
    record.update(result)
    if record.get("extra_peak_bytes") is not None:
        record["extra_peak_mib"] = record["extra_peak_bytes"] / 2**20
    return record


@dataclass(frozen=True)
class Plan:
    """Which (method, N) pairs to measure; ``headline_n`` is the N of the memory headline."""

    lengths: tuple[int, ...]
    methods: tuple[str, ...]
    headline_n: int
    heads: int = 1
    head_dim: int = 64
    max_reps: int = 3
    time_budget_s: float = 6.0
    threads: Optional[int] = None

    def specs(self) -> list[Spec]:
        # N-major order: the methods at one N run close together in time, so a burst of load
        # from other processes skews one N rather than one method
        return [Spec(method, n, self.heads, self.head_dim, self.max_reps, self.time_budget_s,
                     self.threads) for n in self.lengths for method in self.methods]

    def count(self) -> int:
        return len(self.lengths) * len(self.methods)


def default_plan(quick: bool = False, flex: bool = True,
                 methods: Optional[tuple[str, ...]] = None, threads: Optional[int] = None) -> Plan:
    """N ∈ {1024 … 16384} (headline 16384) for a full run; N ∈ {256, 512} for ``--quick``;
    the methods of :data:`SWEEP_METHODS` (those in ``methods`` when given; Flex only if ``flex``)."""
    methods = tuple(m for m in SWEEP_METHODS
                    if (flex or m != "flex") and (methods is None or m in methods))
    if quick:
        return Plan(lengths=(256, 512), methods=methods, headline_n=512, head_dim=32,
                    max_reps=1, time_budget_s=1.0, threads=threads)
    return Plan(lengths=(1024, 2048, 4096, 8192, 16384), methods=methods, headline_n=16384,
                threads=threads)


def run_plan(plan: Plan, on_measure: Callable[[str], None] = lambda text: None,
             after: Callable[[], None] = lambda: None) -> list[dict]:
    """Measure every (method, N) of ``plan``, one fresh process each; a method that is
    unsupported at one N is not retried at the others."""
    records, unsupported = [], {}
    for spec in plan.specs():
        on_measure(f"{LABELS.get(spec.method, spec.method)} N={spec.n}")
        if spec.method in unsupported:
            record = {"method": spec.method, "label": LABELS[spec.method], "n": spec.n,
                      "heads": spec.heads, "head_dim": spec.head_dim, "mask": "causal",
                      "status": "unsupported", "reason": unsupported[spec.method],
                      "extra_peak_bytes": None, "extra_peak_mib": None, "median_s": None, "reps": 0}
        else:
            record = measure(spec)
            if record["status"] == "unsupported":
                unsupported[spec.method] = record["reason"]
        records.append(record)
        after()
    return records


def headline(sweep: list[dict], plan: Plan) -> dict:
    """The memory headline: every method's record at ``plan.headline_n``."""
    return {"n": plan.headline_n, "heads": plan.heads, "head_dim": plan.head_dim, "mask": "causal",
            "pass": "fwd+bwd",
            "methods": {r["method"]: {k: r.get(k) for k in ("status", "reason", "extra_peak_mib",
                                                           "extra_peak_bytes", "median_s")}
                        for r in sweep if r["n"] == plan.headline_n}}


def fmt_mib(value: Optional[float]) -> str:
    """A MiB figure for tables ("—" when missing)."""
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"
