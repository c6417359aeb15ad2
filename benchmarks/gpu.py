"""GPU benchmark of ``backend="triton"``: correctness at full size first, then TFLOP/s against
torch SDPA (flash and cuDNN backends), compiled FlexAttention and SDPA with a dense mask.

One command on a machine with an H100/H200 (about 6–10 minutes for the default set; the first
call also autotunes and compiles every kernel)::

    python benchmarks/gpu.py                      # everything; JSON to $OUT (or results/)
    python benchmarks/gpu.py --dims 128 --lengths 4096,16384   # a shorter first look
    python benchmarks/gpu.py --check-kinds ...    # first every mask kind (GQA, ragged, bf16/fp16)
                                                  # at small sizes against float64
    python benchmarks/gpu.py --check-configs ...  # and every autotune candidate on each mask

Before anything is timed, worker processes compile and run every candidate (``warm``): one
that fails there is dropped for the run, so a bad candidate cannot end the timed process.

Anywhere (no GPU)::

    python benchmarks/gpu.py --dry-run            # whole pipeline at toy sizes, CPU interpreter
    python benchmarks/gpu.py --compile-only       # build every kernel config for sm90 offline:
                                                  # shared memory, registers, spills per config,
                                                  # SASS instructions per tile of each loop
                                                  # (--compile-mask window|documents: other masks)

Method:

- Two numbers first: the machine's measured bf16 matmul rate and device-to-device copy
  bandwidth are printed before anything else; every row also shows its fraction of that matmul
  rate (attention is compute-bound at these sizes: the floor is FLOPs / matmul rate).
- Correct first: every workload is checked at its full sequence length (batch 1, 2 heads, fresh
  random inputs) against float32 math on the GPU (one head at a time), for out, LSE, dq, dk, dv,
  by ‖x − ref‖/‖ref‖. The allowed error is 2× that of the same call through torch SDPA in the
  same dtype, plus 2e-3. The caching allocator is filled with NaN first, so an output element
  the kernel never writes shows up as NaN.
- Timing: ``triton.testing.do_bench`` (CUDA events, warm-up first, median). FLOPs count only
  attended pairs: forward 4·B·H·D·pairs (pairs = N² dense, N²/2 causal, exact counts for the
  window and documents), forward+backward 3.5× that (backward 2.5× forward). 16k tokens per
  batch: B = 16384 / N, H = hidden / D.
- Host time: ``attnkit-kernels`` times our kernels alone (launched from a plan made once) next
  to the whole ``attnkit-triton`` call; the rows where the whole call is slower, the GPU
  having waited on our Python, are listed after the table.
- Where the time goes: one forward+backward of each of the real competitors under
  ``torch.profiler``, each kernel's device time (``--profile``: the window and documents rows
  and the shortest dense and causal ones by default), printed after the table: which of our
  kernels (forward, dQ, dK/dV) loses to which of theirs.

The table is printed last; the JSON holds every number, the device, versions and the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch  # does not import triton: --dry-run can still pick the interpreter below

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
sys.path.insert(0, str(REPO / "src"))

COMPETITORS = ("attnkit-triton", "attnkit-kernels", "attnkit-stored", "sdpa-flash", "sdpa-cudnn",
               "flex-compiled", "sdpa-dense-mask")
MASKS = ("window", "documents&causal", "causal", "dense")  # the workloads' masks, in run order
MASKED = MASKS[:2]  # timed at --masked-length; the rest at each of --lengths
STORED = "stored_ds"
"""``attnkit-stored``: ``backend="triton"`` with the stored-dS backward (``launch.BACKWARD``),
timed, profiled and checked (every candidate with ``--check-configs``, every kind with
``--check-kinds``) beside the default recomputing one on every workload: the masked ones it
is for, and dense and causal, whose buffers (8.6 GB at N 16k without a mask) a GPU can
hold, to see where it pays."""
PATHS = ("recompute", STORED)  # the backwards checked and warmed on every workload mask
OPTIONAL = ("attnkit-auto", "sdpa-default")  # ask with --competitors: what auto picks, torch's own pick


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="toy sizes on CPU through the Triton interpreter (sets TRITON_INTERPRET=1); "
                        "skips the CUDA-only competitors")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every kernel config for sm90 offline and report resources and each "
                        "loop's SASS instructions per tile (no GPU)")
    p.add_argument("--compile-mask", default="causal", choices=tuple(COMPILE_MASKS),
                   help="the mask --compile-only specializes the kernels for (N 512)")
    p.add_argument("--compile-kernels", default="",
                   help="--compile-only builds just these, comma separated (e.g. attn_bwd_dkdv+ds)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--dims", default="64,128", help="head dims, comma separated")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="sequence lengths N")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens / N")
    p.add_argument("--hidden", type=int, default=2048, help="model width: H = hidden / D")
    p.add_argument("--masks", default=",".join(MASKS),
                   help="the workloads' masks, comma separated (of %(default)s)")
    p.add_argument("--masked-length", type=int, default=8192,
                   help="N for the sliding-window and documents workloads")
    p.add_argument("--span", type=int, default=1024, help="window size and document length")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--competitors", default=",".join(COMPETITORS))
    p.add_argument("--flex-masks", default="window,documents&causal",
                   help="masks FlexAttention is timed on ('all' for every one; each costs a compile "
                        "of ~10-30 s for the forward and again for the backward)")
    p.add_argument("--profile", default="short", choices=("none", "short", "all"),
                   help="kernel device times of one forward+backward per competitor (torch.profiler): "
                        "'short' = the window and documents rows and the shortest dense and causal")
    p.add_argument("--skip-check", action="store_true", help="time without the correctness check")
    p.add_argument("--check-configs", action="store_true",
                   help="first check every autotune candidate (each walk and block shape) on each "
                        "workload mask at N 1024 against float32 math: the autotuner only ever "
                        "checks the config it picks")
    p.add_argument("--check-kinds", action="store_true",
                   help="first check every mask kind (GQA, ragged, bf16 and fp16) at small sizes "
                        "against float64")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds since the start (warm step and checks included): start no new "
                        "workload after this but the first (the JSON and table keep what ran)")
    p.add_argument("--no-warm", action="store_true",
                   help="skip compiling every kernel config in parallel processes first")
    p.add_argument("--exclude-walks", default="",
                   help="comma-separated walk parts (e.g. 'tma,one_loop') whose autotune candidates "
                        "are dropped for this run, warm workers included: if a walk fails on this "
                        "machine, the rest can still be measured")
    p.add_argument("--warm-parts", type=int, default=0,
                   help="warm workers per (mask, head dim), each compiling every n-th candidate "
                        "(0: as many as the CPUs allow, at most %d)" % WARM_MAX_PARTS)
    p.add_argument("--warm-one", default=None, help=argparse.SUPPRESS)  # "mask:d" (a warm worker)
    p.add_argument("--warm-part", default="0/1", help=argparse.SUPPRESS)  # "p/n": its candidates
    p.add_argument("--warm-kind", default=None, help=argparse.SUPPRESS)  # "kind:dtype:backward" (a warm worker)
    p.add_argument("--drop-configs", default="[]", help=argparse.SUPPRESS)  # JSON (see drop_configs)
    p.add_argument("--out", default=None, help="folder for the JSON (default: $OUT, else results/)")
    args = p.parse_args(argv)
    args.dims_given = any(a.startswith("--dims") for a in (argv if argv is not None else sys.argv[1:]))
    if args.dry_run:
        args.dims, args.lengths, args.tokens, args.hidden = "32", "64", 64, 64
        args.masked_length, args.span = 64, 16
    return args


# ---- workloads ---------------------------------------------------------------------------------------
@dataclass
class Workload:
    mask: str  # "dense", "causal", "window", "documents&causal"
    n: int
    d: int
    batch: int
    heads: int
    span: int

    @property
    def label(self) -> str:
        return {"window": f"window{self.span}", "documents&causal": f"docs{self.span}&causal"}.get(
            self.mask, self.mask)

    def pairs(self) -> float:
        """Attended (query, key) pairs per head: the FLOP count's N² factor."""
        n, w = self.n, self.span
        if self.mask == "dense":
            return float(n * n)
        if self.mask == "causal":
            return n * n / 2  # the usual convention (exactly n(n+1)/2)
        if self.mask == "window":  # query i sees keys max(0, i-w) .. i
            return float(sum(min(i, w) + 1 for i in range(n)))
        full, rest = divmod(n, w)  # causal documents of length w
        return float(full * w * (w + 1) // 2 + rest * (rest + 1) // 2)

    def flops(self, mode: str) -> float:
        forward = 4.0 * self.batch * self.heads * self.d * self.pairs()
        return forward * (3.5 if mode == "fwd+bwd" else 1.0)


def workloads(args) -> list[Workload]:
    """Per head dim: the masked workloads first (furthest from their targets, so a ``--budget``
    cuts the dense rows rather than these), then causal and dense at each length."""
    dims = [int(x) for x in args.dims.split(",")]
    masks = args.masks.split(",")
    unknown = sorted(set(masks) - set(MASKS))
    if unknown:
        raise SystemExit(f"--masks: unknown {unknown}; choose from {','.join(MASKS)}")
    out = []
    for d in dims:
        heads = max(1, args.hidden // d)
        for mask in (m for m in MASKED if m in masks):
            n = args.masked_length
            out.append(Workload(mask, n, d, max(1, args.tokens // n), heads, args.span))
        for mask in (m for m in MASKS if m in masks and m not in MASKED):
            for n in (int(x) for x in args.lengths.split(",")):
                out.append(Workload(mask, n, d, max(1, args.tokens // n), heads, args.span))
    return out


# ---- the ways to compute it -----------------------------------------------------------------------------
class Masks:
    """One workload's mask in every form: attnkit mask, FlexAttention mask_mod, dense bool."""

    def __init__(self, w: Workload, device):
        import attnkit as ak

        self.w, self.device = w, device
        self.doc_ids = (torch.arange(w.n, device=device) // w.span) if w.mask.startswith("documents") else None
        self.attnkit = {"dense": None, "causal": ak.causal(),
                        "window": ak.sliding_window(w.span),
                        "documents&causal": (ak.documents(self.doc_ids) & ak.causal())
                        if self.doc_ids is not None else None}[w.mask]
        self._dense = None

    def mask_mod(self):
        span, docs = self.w.span, self.doc_ids
        if self.w.mask == "causal":
            return lambda b, h, q, kv: q >= kv
        if self.w.mask == "window":
            return lambda b, h, q, kv: (q >= kv) & (q - kv <= span)
        if self.w.mask == "documents&causal":
            return lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv)
        return None

    def dense(self, rows: Optional[slice] = None):
        """Bool ``[N, N]`` (or the ``rows`` of it), True = may attend."""
        n = self.w.n
        q = torch.arange(n, device=self.device)[rows if rows is not None else slice(None)][:, None]
        kv = torch.arange(n, device=self.device)[None, :]
        if self.w.mask == "dense":
            return torch.ones(q.shape[0], n, dtype=torch.bool, device=self.device)
        allowed = q >= kv
        if self.w.mask == "window":
            allowed &= q - kv <= self.w.span
        if self.doc_ids is not None:
            allowed &= self.doc_ids[q] == self.doc_ids[kv]
        return allowed

    def dense_full(self):
        if self._dense is None:
            self._dense = self.dense()
        return self._dense


def stored_attention(mask) -> Callable:
    """``fn(q, k, v) -> out``: ``backend="triton"`` through the stored-dS backward (the plan,
    made in the call, keeps the path for the backward)."""
    import attnkit as ak
    from attnkit.backends.triton import launch

    def stored(q, k, v):
        with launch.backward_path(STORED):
            return ak.attention(q, k, v, mask, backend="triton")
    return stored


def make_fn(name: str, masks: Masks, device, flex_masks: str = "all") -> tuple[Optional[Callable], str]:
    """``fn(q, k, v) -> out`` for competitor ``name``, or ``(None, why not)``."""
    import torch.nn.functional as F

    import attnkit as ak

    kind = masks.w.mask
    if name == "attnkit-triton":
        mask = masks.attnkit
        return (lambda q, k, v: ak.attention(q, k, v, mask, backend="triton")), ""
    if name == "attnkit-auto":
        mask = masks.attnkit
        return (lambda q, k, v: ak.attention(q, k, v, mask)), ""
    if name == "attnkit-kernels":
        return KernelsOnly(masks.attnkit), ""
    if name == "attnkit-stored":
        return stored_attention(masks.attnkit), ""
    if name == "sdpa-default":
        if kind not in ("dense", "causal"):
            return None, "sdpa-default is timed without a mask but causal"
        causal = kind == "causal"
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), ""
    if name in ("sdpa-flash", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if kind not in ("dense", "causal"):
            return None, f"{name} takes no mask but causal"
        if name == "sdpa-cudnn" and device.type != "cuda":
            return None, "cuDNN needs CUDA"
        chosen = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION
        causal = kind == "causal"

        def run(q, k, v):
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run, ""
    if name == "flex-compiled":
        if device.type != "cuda":
            return None, "compiled FlexAttention needs CUDA here"
        if flex_masks != "all" and kind not in flex_masks.split(","):
            return None, f"not asked for {kind} (--flex-masks)"
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        mod = masks.mask_mod()
        block_mask = None if mod is None else create_block_mask(mod, None, None, masks.w.n, masks.w.n,
                                                                device=device)
        return (lambda q, k, v: compiled(q, k, v, block_mask=block_mask)), ""
    if name == "sdpa-dense-mask":
        allowed = masks.dense_full()
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)), ""
    raise KeyError(name)


# ---- timing ------------------------------------------------------------------------------------------------
def timer(device) -> Callable[[Callable], float]:
    """Median milliseconds of ``fn()``: ``do_bench`` on CUDA, a host clock on CPU (dry run)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def host(fn, repeats=1):
        fn()  # warm-up (interpreter: rewriting the kernels)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    return host


PROFILED = ("attnkit-triton", "attnkit-stored", "sdpa-flash", "sdpa-cudnn", "flex-compiled")


LAUNCH_FACTS = {"grid": "grid", "block": "block", "registers per thread": "regs",
                "shared memory": "smem", "blocks per SM": "blocks_per_sm",
                "est. achieved occupancy %": "occupancy_pct"}
"""What the profiler's trace records of a kernel launch (CUPTI), kept under shorter names."""


def kernel_times(trace: dict, on_device: bool) -> dict[str, dict]:
    """A ``torch.profiler`` Chrome trace → per name, largest total first: ``us`` (summed
    duration), ``calls`` and, for kernels, the first launch's :data:`LAUNCH_FACTS` (two blocks
    per SM hide one's loads behind the other's math; one cannot). Device events (kernels,
    copies, memsets), or, without a device (the dry run), host operators (inclusive times)."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset") if on_device else ("cpu_op",)
    totals: dict[str, dict] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") not in kinds or "dur" not in event:
            continue
        row = totals.setdefault(event["name"], {"us": 0.0, "calls": 0})
        row["us"] += float(event["dur"])
        row["calls"] += 1
        if row["calls"] == 1:
            facts = event.get("args", {})
            row.update({short: facts[key] for key, short in LAUNCH_FACTS.items() if key in facts})
    return dict(sorted(totals.items(), key=lambda item: -item[1]["us"]))


def kernel_profile(fn: Callable[[], None], device) -> dict[str, dict]:
    """:func:`kernel_times` of one call of ``fn`` (after one unprofiled call)."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    fn()
    if on_device:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        fn()
        if on_device:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return kernel_times(trace, on_device)


def profiled(w: "Workload", args) -> bool:
    """Whether ``--profile`` asks for workload ``w``'s kernel profile."""
    shortest = min(int(n) for n in args.lengths.split(","))
    return args.profile == "all" or (args.profile == "short" and (
        w.mask in MASKED or w.n == shortest))


class KernelsOnly:
    """``backend="triton"``'s kernels alone, launched back to back from a plan made once: no
    validation, dispatch or autograd. Next to ``attnkit-triton`` it shows how much of a row's
    time the GPU spent waiting on our Python (a small problem's kernels can finish before the
    host has launched the next ones)."""

    def __init__(self, mask):
        self.mask, self.plan = mask, None

    def _plan(self, q, k, v):
        from attnkit.backends.triton import launch
        from attnkit.inputs import validate

        if self.plan is None:
            self.plan = launch.make_plan(validate(q, k, v, self.mask))
        return self.plan

    def __call__(self, q, k, v):
        from attnkit.backends.triton.backend import _forward

        return _forward(q.detach(), k.detach(), v.detach(), self._plan(q, k, v))[0]

    def forward_backward(self, q, k, v, dout):
        from attnkit.backends.triton.backend import _backward, _forward

        q, k, v = q.detach(), k.detach(), v.detach()
        plan = self._plan(q, k, v)
        out, lse = _forward(q, k, v, plan)
        _backward(dout, None, q, k, v, out, lse, plan)


def step(fn, mode, q, k, v, dout) -> Callable[[], None]:
    if mode == "fwd":
        return lambda: fn(q, k, v)
    if isinstance(fn, KernelsOnly):
        return lambda: fn.forward_backward(q, k, v, dout)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)
    return forward_backward


# ---- correctness at full size --------------------------------------------------------------------------------
def reference(q, k, v, dout, masks: Masks, scale: float):
    """float32 math, one head at a time: ``out, lse, dq, dk, dv`` (float32)."""
    outs, lses, grads = [], [], [[], [], []]
    allowed = masks.dense_full()
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h:h + 1].detach().float().requires_grad_() for t in (q, k, v))
        scores = (qh @ kh.transpose(-1, -2)) * scale  # [1, 1, N, N]
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        out = torch.softmax(scores, -1) @ vh
        for store, g in zip(grads, torch.autograd.grad(out, (qh, kh, vh), dout[:, h:h + 1].float())):
            store.append(g)
        outs.append(out.detach())
        lses.append(lse.detach())
        del scores
    return (torch.cat(outs, 1), torch.cat(lses, 1), *(torch.cat(g, 1) for g in grads))


def relative_error(x, ref) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def exception_text(error: Exception) -> str:
    """A failed case's exception, one line."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def check_text(row: dict) -> str:
    """``ok``/``FAILED`` and each quantity's relative error (or the exception) of a check row."""
    errs = " ".join(f"{k} {v['triton']:.1e}" for k, v in row.get("errors", {}).items())
    return f"{'ok' if row['ok'] else 'FAILED'}  {errs or row.get('exception', '')}"


def allowed_error(yardstick: Optional[float]) -> float:
    """The error allowed: twice SDPA's own in the same dtype (``yardstick``), or 1e-4 where
    there is none (the LSE), plus 2e-3."""
    return (1e-4 if yardstick is None else 2 * yardstick) + 2e-3


def poison_allocator(device, nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so unwritten outputs read as NaN."""
    if device.type == "cuda":
        block = torch.full((nbytes // 4,), float("nan"), device=device)
        del block


def check(w: Workload, dtype, device) -> dict:
    """One workload at full N (batch 1, 2 heads) against float32 math; SDPA as the yardstick."""
    import torch.nn.functional as F

    import attnkit as ak

    gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{w.mask} {w.n} {w.d}".encode()))
    heads = 2
    q, k, v = (torch.randn(1, heads, w.n, w.d, generator=gen, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, heads, w.n, w.d, generator=gen, device=device, dtype=dtype)
    masks = Masks(Workload(w.mask, w.n, w.d, 1, heads, w.span), device)
    scale = 1 / math.sqrt(w.d)
    ref = reference(q, k, v, dout, masks, scale)

    def ours_now():
        poison_allocator(device, 8 * q.numel() * q.element_size())
        r = ak.attention(q, k, v, masks.attnkit, backend="triton", return_lse=True)
        return (r.out, r.lse, *torch.autograd.grad(r.out, (q, k, v), dout))

    ours = ours_now()  # the first call autotunes (or finds its config)
    direct = check_direct_launch(ours_now, device, ours)
    allowed = None if w.mask == "dense" else masks.dense_full()
    yard_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    yard_lse = ours[1].detach().float()  # SDPA returns no LSE: LSE is judged against fp32 alone
    yard = (yard_out, yard_lse, *torch.autograd.grad(yard_out, (q, k, v), dout))
    result = {"workload": w.label, "n": w.n, "d": w.d, "ok": True, "errors": {}, "direct_launch": direct}
    for name, mine, theirs, truth in zip(("out", "lse", "dq", "dk", "dv"), ours, yard, ref):
        err, yard_err = relative_error(mine, truth), relative_error(theirs, truth)
        bound = allowed_error(None if name == "lse" else yard_err)
        result["errors"][name] = {"triton": err, "sdpa": yard_err, "bound": bound}
        result["ok"] &= err <= bound
    return result


WARM_FAILED = "its warm worker failed: see the warm lines above"

def check_direct_launch(run: Callable[[], tuple], device, first: tuple) -> str:
    """``run()`` twice more after its ``first`` result (the autotuner's launches): once through
    ``JITFunction`` (which keeps the compiled kernels) and once launching them directly
    (``launch.DIRECT_LAUNCH``). The kernels are deterministic, so the three must agree bit for
    bit; if not, direct launches are turned off for the rest of the run (the timings then pay
    Triton's argument binding per launch) and the answer says so."""
    from attnkit.backends.triton import launch

    if device.type != "cuda" or not launch.DIRECT_LAUNCH:
        return "not used"
    through_jit, direct = run(), run()
    if all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, through_jit, direct)):
        return "same as JITFunction"
    launch.DIRECT_LAUNCH = False
    print("direct launches differ from JITFunction launches: turned off for this run", flush=True)
    return "DIFFERED from JITFunction: turned off"


KERNELS = {"recompute": ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"),
           STORED: ("attn_fwd", "attn_bwd_stats", "attn_bwd_dkdv", "attn_bwd_dq_stored")}
"""The kernels each backward path launches (forward first)."""


CONFIG_CHECKS_ALSO = (("causal", 256), ("documents&causal", 256))
"""(mask, head dim) pairs ``--check-configs`` checks besides the workloads': the D256
candidates, which no timed workload runs."""


def config_checks(todo: list["Workload"]) -> list[tuple[str, int]]:
    return sorted({(w.mask, w.d) for w in todo} | set(CONFIG_CHECKS_ALSO))


def check_configs(todo: list["Workload"], dtype, device, warmed: "Warmed") -> list[dict]:
    """Every autotune candidate (``launch.CONFIGS``: block shape, warps, stages, walk) of the
    three kernels on each workload mask (and :data:`CONFIG_CHECKS_ALSO`) at N 1024 (window and
    documents of 128) against float32 math, as :func:`check`; candidate i of each kernel runs
    together (``launch.pinned``). The binaries are those the warm step built; a (mask, head
    dim) whose warm job failed is a failed row here, not run."""
    from attnkit.backends.triton import launch

    rows = []
    for mask, d in config_checks(todo):
        if warmed.skips(warm_label(mask, d)):
            rows.append({"workload": f"configs: {mask}", "n": 1024, "d": d, "ok": False,
                         "errors": {}, "exception": WARM_FAILED})
            print(f"configs {mask:18s} D{d:<4d} FAILED ({WARM_FAILED})", flush=True)
            continue
        pad = launch.head_pad(d)
        count = max(len(launch.CONFIGS[name][launch.head_bucket(pad)]) for name in launch.CONFIGS)
        for index in range(count):
            for backward in PATHS:
                picked = {name: launch.pinned_config(name, pad, index) for name in KERNELS[backward]}
                label = "; ".join("{} {}x{} w{} s{} {}".format(name.replace("attn_", ""), *config)
                                  for name, config in picked.items())
                try:
                    with launch.pinned(index), launch.backward_path(backward):
                        result = check(Workload(mask, 1024, d, 1, 2, 128), dtype, device)
                except Exception as error:  # noqa: BLE001 - a failed check is a result
                    result = {"workload": mask, "n": 1024, "d": d, "ok": False, "errors": {},
                              "exception": exception_text(error)}
                result.update(workload=f"config {index}: {mask}", configs=label, backward=backward)
                rows.append(result)
                print(f"config {index:2d} {mask:18s} D{d:<4d} {check_text(result)}  [{label}]",
                      flush=True)
    return rows


# ---- every mask kind at small sizes ------------------------------------------------------------------
def mask_kinds(tq: int, tk: int, batch: int, gen: torch.Generator, device=None) -> dict:
    """Every kind of mask the kernels handle, drawn from ``gen`` on the CPU; the dense and bias
    tensors then moved to ``device`` (the library takes them only on q's device)."""
    import attnkit as ak

    ids_q = torch.randint(0, 4, (tq,), generator=gen).sort().values
    ids_k = torch.randint(0, 4, (tk,), generator=gen).sort().values
    return {
        "causal": ak.causal(),
        "causal_bottom_right": ak.causal("bottom_right"),
        "window37": ak.sliding_window(37),
        "padding_empty_rows": ak.padding(q_lengths=[tq, tq - 40][:batch], kv_lengths=[0, tk - 21][:batch]),
        "documents": ak.documents(ids_q, ids_k),
        "documents&causal": ak.documents(ids_q, ids_k) & ak.causal(),
        "dense_bool": ak.dense(torch.rand(tq, tk, generator=gen).to(device) < 0.7),
        "bias&causal": ak.bias(torch.randn(tq, tk, generator=gen).to(device)) & ak.causal(),
        "from_function": ak.from_function(lambda b, h, q, kv: (q + kv) % 3 != 0, "mod3"),
        "documents|window": ak.documents(ids_q, ids_k) | ak.sliding_window(5),
        "~causal": ~ak.causal(),
    }


KIND_SHAPE = (2, 4, 2, 300, 333, 64)  # batch, query heads, K/V heads, Tq, Tk, D
KIND_PASSES = (("bf16", None, "recompute"), ("fp16", ("causal", "documents&causal", "bias&causal"),
                                              "recompute"), ("bf16", None, STORED))
"""The dtypes and backward paths mask kinds are checked in, each with the kinds (``None``: all)
checked in it: each (kind, dtype, backward) compiles its own kernels, about 3 × 1–2 s."""


def kind_label(name: str, low: str, backward: str) -> str:
    """A mask-kind check's warm job: ``"kind name dtype"`` (+ the backward when stored)."""
    return f"kind {name} {low}" + ("" if backward == "recompute" else f" {backward}")


def check_kinds(dtype, device, only=None, warmed: Optional["Warmed"] = None,
                backward: str = "recompute") -> list[dict]:
    """Each mask kind (or those in ``only``), GQA 4/2, ragged Tq 300 × Tk 333, D 64, against
    float64 on the CPU: out, LSE, dq, dk, dv, with the error of torch's own SDPA (dense mask)
    in ``dtype`` as the yardstick (allowed: 2× it + 2e-3). An exception is a failed case,
    reported, not fatal; a kind whose warm worker failed is not run here (a crash would end
    this process's CUDA context). The kernels run one config each (``launch.pinned(0)``):
    autotuning would compile every candidate for every kind; the autotuned configs are checked
    at full size with the workloads. ``backward``: the backward path (``launch.BACKWARD``)."""
    import attnkit as ak
    from attnkit.backends.triton import launch

    gen = torch.Generator().manual_seed(1)
    batch, heads, heads_kv, tq, tk, d = KIND_SHAPE
    on_device = mask_kinds(tq, tk, batch, torch.Generator().manual_seed(1), device)  # same draws
    rows = []
    for name, mask in mask_kinds(tq, tk, batch, gen).items():  # the float64 truth's, on the CPU
        if only is not None and name not in only:
            continue
        row = {"case": name, "ok": False}
        try:
            low_name = next(key for key, value in DTYPES.items() if value == dtype)
            if warmed is not None and warmed.skips(kind_label(name, low_name, backward)):
                raise RuntimeError(WARM_FAILED)
            q, k, v = (torch.randn(batch, h, t, d, generator=gen, dtype=torch.float64)
                       for h, t in ((heads, tq), (heads_kv, tk), (heads_kv, tk)))
            dout = torch.randn(batch, heads, tq, d, generator=gen, dtype=torch.float64)
            low = [t.to(dtype) for t in (q, k, v)]  # the values every computation sees
            truth_in = [t.double().requires_grad_() for t in low]
            truth = ak.attention(*truth_in, mask, backend="reference", return_lse=True)
            truth_grads = torch.autograd.grad(truth.out, truth_in, dout.to(dtype).double())
            ours_in = [t.to(device).requires_grad_() for t in low]
            poison_allocator(device, 64 * 2**20)
            with launch.pinned(0), launch.backward_path(backward):
                ours = ak.attention(*ours_in, on_device[name], backend="triton", return_lse=True)
                grads = torch.autograd.grad(ours.out, ours_in, dout.to(dtype).to(device))
            yard_in = [t.to(device).requires_grad_() for t in low]
            yard = ak.attention(*yard_in, on_device[name], backend="torch")
            yard_grads = torch.autograd.grad(yard, yard_in, dout.to(dtype).to(device))
            pairs = {"out": (ours.out, yard, truth.out), "lse": (ours.lse, None, truth.lse)}
            for key, mine, theirs, t in zip(("dq", "dk", "dv"), grads, yard_grads, truth_grads):
                pairs[key] = (mine, theirs, t)
            row["errors"], ok = {}, True
            for key, (mine, theirs, t) in pairs.items():
                t = t.to(device)
                finite = torch.isfinite(t)
                if key == "lse":  # −inf exactly on fully masked rows, close elsewhere
                    ok &= bool(torch.equal(torch.isneginf(mine), torch.isneginf(t)))
                    mine, t = mine[finite], t[finite]
                err = relative_error(mine, t)
                bound = allowed_error(None if theirs is None else relative_error(theirs, t))
                row["errors"][key] = {"triton": err, "bound": bound}
                ok &= err <= bound
            row["ok"] = bool(ok)
        except Exception as error:  # noqa: BLE001 - a failed case is a result
            row["exception"] = exception_text(error)
        rows.append(row)
        print(f"kind {name:20s} {str(dtype).replace('torch.', ''):9s} "
              f"{'' if backward == 'recompute' else 'stored dS '}{check_text(row)}", flush=True)
    return rows


# ---- the two ceilings (METHOD.md: measure them once) ------------------------------------------------------------
def ceilings(device, dtype, bench) -> dict:
    if device.type != "cuda":
        return {"matmul_tflops": None, "copy_gbps": None}
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    ms = bench(lambda: a @ b)
    src = torch.randn(256 * 2**20, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    return {"matmul_tflops": 2 * 8192**3 / ms / 1e9, "copy_gbps": 2 * src.numel() * 4 / copy_ms / 1e6}


# ---- offline compile check --------------------------------------------------------------------------------------
COMPILE_MASKS = ("causal", "window", "documents")
"""``--compile-mask`` choices (documents: not aligned to the blocks, as aligned ones compile
as causal, ``launch.needed_leaves``)."""


def compile_only(dims: list[int], out: Optional[str], mask_name: str = "causal",
                 only: tuple = ()) -> int:
    """Build every kernel (the forward; dK/dV and dQ; the stored-dS backward's statistics,
    dK/dV storing dS and dQ) for sm90 at ``dims`` in every autotune config of their bucket,
    for the mask ``mask_name`` (one of :data:`COMPILE_MASKS`, at N 512); ``only``: just
    these labels (``attn_fwd``, ``attn_bwd_dkdv+ds``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnkit.backends.triton import launch
    import attnkit as ak
    from attnkit.inputs import validate

    if launch.interpreting():
        print("--compile-only needs compiled mode: unset TRITON_INTERPRET")
        return 2
    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64", torch.int8: "i8"}
    rows, failures = [], 0
    for d in dims:
        q = torch.zeros(1, 2, 512, d, dtype=torch.bfloat16)
        mask = {"causal": ak.causal(), "window": ak.sliding_window(170),
                "documents": ak.documents(torch.arange(512) // 170) & ak.causal()}[mask_name]
        inputs = validate(q, q, q, mask)
        plan = launch.make_plan(inputs)
        lse, delta = torch.zeros(1, 2, 512), torch.zeros(1, 2, 512)
        ds = launch.ds_buffer(q, plan)  # the stored-dS backward's kernels (launch.BACKWARD)
        calls = {"attn_fwd": launch.forward_call(q, q, q, q, lse, plan),
                 "attn_bwd_dkdv": launch.dkdv_call(q, q, q, q, lse, delta, q, q, plan),
                 "attn_bwd_dq": launch.dq_call(q, q, q, q, q, lse, None, lse, delta, q, plan),
                 "attn_bwd_dkdv+ds": launch.dkdv_call(q, q, q, q, lse, delta, q, q, plan, ds),
                 "attn_bwd_dq_stored": launch.dq_stored_call(q, q, q, ds, q, plan),
                 "attn_bwd_stats": launch.stats_call(q, q, lse, None, lse, delta, plan)}
        # as on sm90 (CPU tensors here): dS stored by TMA, dQ-stored's +tma candidates by TMA
        calls["attn_bwd_dkdv+ds"].args["DS_TMA"] = launch.DS_BY_TMA
        calls["attn_bwd_dq_stored"].args["TMA_OK"] = True
        calls = {label: call for label, call in calls.items() if not only or label in only}
        for label, call in calls.items():
            kernel = getattr(launch.kernels(), call.name)
            for m, n, warps, stages, walk in launch.CONFIGS[call.name][launch.head_bucket(d)]:
                values = dict(call.args, BLOCK_M=m, BLOCK_N=n, **launch.WALKS[walk])
                # as the JIT specializes a launch: ints equal to 1 become constants, multiples of
                # 16 (and 16-byte aligned pointers; the caching allocator's are) get the
                # divisibility hint, unless the kernel opts the argument out
                signature, constexprs, attrs = {}, {}, {}
                for i, param in enumerate(kernel.params):
                    value = values[param.name]
                    hinted = not param.do_not_specialize
                    if param.is_constexpr:
                        signature[param.name], constexprs[param.name] = "constexpr", value
                    elif isinstance(value, torch.Tensor):
                        signature[param.name] = "*" + type_names[value.dtype]
                        if hinted:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                    elif isinstance(value, float):
                        signature[param.name] = "fp32"
                    elif hinted and int(value) == 1:
                        signature[param.name], constexprs[param.name] = "constexpr", 1
                    else:
                        signature[param.name] = "i64" if abs(int(value)) >= 2**31 else "i32"
                        if hinted and int(value) % 16 == 0:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                start = time.perf_counter()
                row = {"kernel": label, "d": d, "block_m": m, "block_n": n, "warps": warps,
                       "stages": stages, "walk": walk}
                try:
                    log = io.StringIO()
                    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), \
                            contextlib.redirect_stdout(log):
                        triton.knobs.nvidia.dump_ptxas_log = True  # Triton's own ptxas run, its flags
                        triton.knobs.compilation.always_compile = True  # no cache hit: ptxas runs
                        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                                  target=GPUTarget("cuda", 90, 32),
                                                  options={"num_warps": warps, "num_stages": stages})
                    row["shared_kib"] = compiled.metadata.shared / 1024
                    row.update(_ptxas_report(log.getvalue()))
                    row["fits"] = compiled.metadata.shared <= 227 * 1024
                    row["wgmma"] = "wgmma" in compiled.asm["ptx"]
                    row["loops"] = _sass_loops(compiled)
                except Exception as error:  # noqa: BLE001 - reported, counted
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    failures += 1
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                print(_compile_line(row), flush=True)
    out_dir = Path(out or os.environ.get("OUT") or REPO / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compile_sm90.json").write_text(json.dumps(
        {"triton": triton.__version__, "target": "sm90 (offline, no device)", "rows": rows}, indent=1))
    print("\nkernel             D   BM  BN  w s W     smem KiB  regs  spill B  fits  wgmma  loops")
    for row in rows:
        print(_compile_line(row))
    return 1 if failures else 0


def _ptxas_report(log: str) -> dict:
    """Registers and spill bytes from the ptxas log of Triton's own compile (its own flags)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None}


def _walk_code(walk: str) -> str:
    """``partial_first+flat+lpt`` → ``pfl``: the walk's first letters (its parts)."""
    return "".join(part[0] for part in walk.split("+"))


def _compile_line(row: dict) -> str:
    head = (f"{row['kernel']:18s} {row['d']:3d} {row['block_m']:4d}{row['block_n']:4d} {row['warps']:2d} "
            f"{row['stages']} {_walk_code(row['walk']):3s}")
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    loops = "/".join(map(str, row.get("loops") or [])) or "?"
    return (f"{head} {row['shared_kib']:9.1f} {row['registers'] or '?':>5} {row['spill_bytes'] or 0:8d}"
            f"  {'yes' if row['fits'] else 'NO':4s}  {'yes' if row['wgmma'] else 'no':5s}  {loops}")


SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/")  # nvdisasm's address column


def loop_sizes(sass: str, smallest: int = 20) -> list[int]:
    """Instructions in each loop of ``nvdisasm -c`` output (from a label to the branch back to
    it), in order, leaving out loops under ``smallest`` instructions (spin-waits)."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        found = re.match(r"^\s*\.(L_x_\d+):", line)
        if found:
            labels[found.group(1)] = i
    sizes = []
    for i, line in enumerate(lines):
        back = re.search(r"\bBRA\b.*?\.(L_x_\d+)", line)
        if back and labels.get(back.group(1), i) < i:
            size = sum(1 for x in lines[labels[back.group(1)]:i + 1] if SASS_INSTRUCTION.search(x))
            if size >= smallest:
                sizes.append(size)
    return sizes


def _sass_loops(compiled) -> Optional[list[int]]:
    """:func:`loop_sizes` of a compiled kernel (its walk's loops: each tile's instruction count,
    the per-thread work the loop issues besides its wgmma), by the ``nvdisasm`` shipped with
    Triton; ``None`` without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        listing = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True)
    return loop_sizes(listing.stdout) if listing.returncode == 0 else None


# ---- main ------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    workload: str
    d: int
    n: int
    batch: int
    heads: int
    mode: str
    backend: str
    ms: Optional[float] = None
    tflops: Optional[float] = None
    status: str = "ok"


STARTED = time.perf_counter()


def exclude_walks(parts: str) -> list[str]:
    """Drop the autotune candidates whose walk has one of the comma-separated ``parts``
    (``launch.CONFIGS`` of this process); a bucket keeps at least its first candidate. Returns
    the dropped ones, as ``kernel D-bucket config``."""
    from attnkit.backends.triton import launch

    unwanted = {part.strip() for part in parts.split(",") if part.strip()}
    dropped = []
    for name, buckets in launch.CONFIGS.items():
        for bucket, candidates in buckets.items():
            kept = [c for c in candidates if not unwanted & set(c[4].split("+"))] or candidates[:1]
            dropped += [f"{name} D{bucket} {c}" for c in candidates if c not in kept]
            buckets[bucket] = kept
    return dropped


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.exclude_walks:
        dropped = exclude_walks(args.exclude_walks)
        if not (args.warm_one or args.warm_kind):
            print(f"--exclude-walks {args.exclude_walks}: {len(dropped)} candidates dropped", flush=True)
    drop_configs(json.loads(args.drop_configs))
    if args.warm_one:
        return warm_one(args.warm_one, args.dtype, args.span, args.warm_part)
    if args.warm_kind:
        return warm_kind(args.warm_kind)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the interpreter
    if args.compile_only:
        return compile_only([int(x) for x in (args.dims if args.dims_given else "64,128,256").split(",")],
                            args.out, args.compile_mask,
                            tuple(x for x in args.compile_kernels.split(",") if x))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run (CPU interpreter) or --compile-only")
        return 2
    dtype = DTYPES[args.dtype]
    bench = timer(device)
    import triton

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
            "dry_run": args.dry_run, "tokens": args.tokens, "hidden": args.hidden}
    info.update(ceilings(device, dtype, bench))
    print(f"device {info['device']}  torch {info['torch']}  triton {info['triton']}  {args.dtype}")
    if info["matmul_tflops"]:
        print(f"ceilings: bf16/fp16 matmul {info['matmul_tflops']:.0f} TFLOP/s, "
              f"copy {info['copy_gbps']:.0f} GB/s")

    from attnkit.backends.triton import launch

    launch.AUTOTUNE_CACHE = False  # this run's own autotuning, not timings an earlier run saved
    todo = workloads(args)
    warmed = warm(todo, args) if device.type == "cuda" and not args.no_warm else Warmed()
    info["dropped_configs"], info["warm_failed"] = warmed.dropped, sorted(warmed.broken)
    if warmed.direct_failed:
        launch.DIRECT_LAUNCH = False
    if device.type == "cuda":
        info["host_us_per_call"], info["host_profile"] = host_overhead(device, dtype)
        print("host time per call (tiny problem, GPU idle: the floor a small workload sees), us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in info["host_us_per_call"].items()), flush=True)
        print("attnkit-triton fwd+bwd there, cProfile, per call (self µs, total µs, calls):\n"
              + "\n".join(f"  {r['self_us']:7.1f} {r['total_us']:8.1f} {r['calls']:5.1f}  {r['function']}"
                          for r in info["host_profile"]), flush=True)
    checks = []
    if args.check_configs:
        if device.type == "cuda":
            checks += check_configs(todo, dtype, device, warmed)
        else:
            print("--check-configs: the interpreter runs one fixed config; skipped")
    if args.check_kinds:
        for low, only, backward in KIND_PASSES:
            checks += [dict(row, workload=f"kind:{row['case']}", d=64, dtype=str(DTYPES[low]),
                            backward=backward)
                       for row in check_kinds(DTYPES[low], device, only, warmed, backward)]
    if not args.skip_check:
        seen = set()
        for w in todo:  # each mask kind and head dim once, at its longest N
            longest = max(x.n for x in todo if x.mask == w.mask and x.d == w.d)
            if (w.mask, w.d) in seen or w.n != longest:
                continue
            seen.add((w.mask, w.d))
            for backward in PATHS:
                try:
                    if warmed.skips(warm_label(w.mask, w.d)):
                        raise RuntimeError(WARM_FAILED)
                    with launch.backward_path(backward):
                        result = check(w, dtype, device)
                except Exception as error:  # noqa: BLE001 - a failed check is a result
                    traceback.print_exc()
                    result = {"workload": w.label, "n": w.n, "d": w.d, "ok": False, "errors": {},
                              "exception": repr(error)}
                label = w.label + ("" if backward == "recompute" else " (stored dS)")
                result["workload"] = label
                checks.append(result)
                errs = " ".join(f"{k} {v['triton']:.1e}/{v['sdpa']:.1e}"
                                for k, v in result["errors"].items())
                print(f"check {label:18s} D{w.d:<4d} N{w.n:<6d} "
                      f"{'ok' if result['ok'] else 'FAILED'}  (triton/sdpa rel. error) {errs}",
                      flush=True)

    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = "dry_run" if args.dry_run else datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    path = out_dir / f"gpu_bench_{stamp}.json"
    competitors = [c for c in args.competitors.split(",") if c]
    results: list[Result] = []
    skipped = []

    def save() -> None:  # after every workload, so a cut-off run keeps what it timed
        path.write_text(json.dumps({"info": info, "checks": checks, "skipped": skipped,
                                    "results": [asdict(r) for r in results]}, indent=1))
    for w in todo:
        if args.budget is not None and time.perf_counter() - STARTED > args.budget and results:
            # (the first workload is timed whatever the checks before it took)
            skipped.append(f"{w.label} D{w.d} N{w.n}")
            continue
        if warmed.skips(warm_label(w.mask, w.d)):
            skipped.append(f"{w.label} D{w.d} N{w.n} ({WARM_FAILED})")
            continue
        masks = Masks(w, device)
        seen = config_timings()  # the tunings before this workload's
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(w.batch, w.heads, w.n, w.d, generator=gen, device=device,
                               dtype=dtype).requires_grad_() for _ in range(3))
        dout = torch.randn(w.batch, w.heads, w.n, w.d, generator=gen, device=device, dtype=dtype)
        for name in competitors:
            try:
                fn, why = make_fn(name, masks, device, args.flex_masks)
            except Exception as error:  # noqa: BLE001
                fn, why = None, f"setup failed: {error!r}"[:120]
            for mode in args.modes.split(","):
                row = Result(w.label, w.d, w.n, w.batch, w.heads, mode, name)
                if fn is None:
                    row.status = f"n/a: {why}"
                else:
                    try:
                        row.ms = bench(step(fn, mode, q, k, v, dout))
                        row.tflops = w.flops(mode) / row.ms / 1e9
                    except Exception as error:  # noqa: BLE001 - e.g. a backend refusing a shape
                        row.status = f"error: {str(error).splitlines()[0][:100]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(row)
            # after each competitor (the plain and the dS-storing dK/dV share one tuner), the
            # tunings this workload made
            tuned = {kernel: t for kernel, t in config_timings().items() if seen.get(kernel) != t}
            info.setdefault("config_ms", {}).setdefault(f"{w.label} D{w.d} N{w.n}", {}).update(tuned)
            if fn is not None and name in PROFILED and profiled(w, args):
                try:
                    times = kernel_profile(step(fn, "fwd+bwd", q, k, v, dout), device)
                except Exception as error:  # noqa: BLE001 - e.g. no backward for this mask
                    times = {"error": str(error).splitlines()[0][:100]}
                info.setdefault("kernel_profile", {}).setdefault(
                    f"{w.label} D{w.d} N{w.n}", {})[name] = times
        del q, k, v, dout, masks
        ours = [r for r in results[-len(competitors) * 2:] if r.backend == "attnkit-triton"]
        print(f"timed {w.label} D{w.d} N{w.n}: triton "
              + ", ".join(f"{r.mode} {r.tflops:.0f}" if r.tflops else f"{r.mode} {r.status}"
                          for r in ours)
              + f" TFLOP/s  [{time.perf_counter() - STARTED:.0f} s]", flush=True)
        info["autotuned"] = autotuned()
        save()
    info["autotuned"] = autotuned()
    info["direct_launch"] = launch.DIRECT_LAUNCH
    info["elapsed_s"] = time.perf_counter() - STARTED
    losing = info["losing_candidates"] = losing_candidates(info.get("config_ms", {}))
    save()
    print("\nautotuned configs (kernel: tune key -> BLOCK_M, BLOCK_N, warps, stages, walk)")
    for line in info["autotuned"]:
        print("  " + line)
    if skipped:
        print(f"over the --budget, not timed: {', '.join(skipped)}")
    print_walks(info.get("config_ms", {}))
    print(f"\nnever within {PRUNE_SLACK:.2f}x of the fastest on any timed workload (to drop, "
          f"unless kept for shapes not timed here, e.g. small problems):")
    for kernel, configs in losing.items():
        print(f"  {kernel}: " + ", ".join(configs))
    print_table(results, competitors, info)
    print_profile(info.get("kernel_profile", {}), on_device=device.type == "cuda")
    print(f"JSON: {path}")
    failed = [c for c in checks if not c["ok"]]
    if failed:
        print(f"CORRECTNESS FAILED for {[c['workload'] + ' D' + str(c['d']) for c in failed]}: "
              f"the timings above are not to be trusted")
        return 1
    return 0


def host_profile(fn: Callable[[], object], calls: int = 50, top: int = 12) -> list[dict]:
    """Where ``fn``'s host time goes: ``cProfile`` over ``calls`` calls (one untimed first),
    the ``top`` functions by their own time, each with µs and calls per ``fn()`` call."""
    import cProfile
    import pstats

    fn()
    profiler = cProfile.Profile()
    # a CUDA backward runs on autograd's device thread, which cProfile does not see: run it
    # on this thread instead
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) → (cc, nc, tottime, cumtime, callers)
    rows = [{"function": f"{Path(file).name}:{line} {name}", "self_us": own / calls * 1e6,
             "total_us": total / calls * 1e6, "calls": nc / calls}
            for (file, line, name), (_, nc, own, total, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def host_overhead(device, dtype, calls: int = 200) -> tuple[dict, list[dict]]:
    """Wall-clock µs per call of a tiny forward (B1 H1 N128 D128, causal), the GPU waiting on
    the host: what each backend's Python and launch path costs before any kernel time; and of
    a tiny forward+backward (``... fwd+bwd``): a row whose kernels take less than that waits.
    Second, :func:`host_profile` of our forward+backward there."""
    import torch.nn.functional as F

    import attnkit as ak

    from attnkit.backends.triton import launch
    from attnkit.inputs import validate

    q, k, v = (torch.randn(1, 1, 128, 128, device=device, dtype=dtype) for _ in range(3))
    mask = ak.causal()
    plan = launch.make_plan(validate(q, k, v, mask))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device=device)

    def jit_launch():  # without launch.DIRECT_LAUNCH: Triton binds the arguments every time
        direct, launch.DIRECT_LAUNCH = launch.DIRECT_LAUNCH, False
        try:
            launch.forward_call(q, k, v, out, lse, plan).run(plan.interpret)
        finally:
            launch.DIRECT_LAUNCH = direct

    fns = {"attnkit-triton": lambda: ak.attention(q, k, v, mask, backend="triton"),
           "attnkit-auto": lambda: ak.attention(q, k, v, mask),
           # the split: our Python before the launch, and Triton's launch (autotuner included)
           "validate+plan": lambda: launch.make_plan(validate(q, k, v, mask)),
           "forward_call": lambda: launch.forward_call(q, k, v, out, lse, plan),
           "triton-launch": lambda: launch.forward_call(q, k, v, out, lse, plan).run(plan.interpret),
           "triton-launch (JITFunction)": jit_launch,
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    fns["attnkit-triton fwd+bwd"] = step(lambda *t: ak.attention(*t, mask, backend="triton"),
                                         "fwd+bwd", *leaves, dout)
    fns["sdpa fwd+bwd"] = step(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True),
                               "fwd+bwd", *leaves, dout)

    # the stored-dS backward: one launch more
    fns["attnkit-stored fwd+bwd"] = step(stored_attention(mask), "fwd+bwd", *leaves, dout)

    result = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - start) / calls * 1e6
    return result, host_profile(fns["attnkit-triton fwd+bwd"])


def autotuned() -> list[str]:
    """The config the autotuner chose for each kernel and key seen so far."""
    from attnkit.backends.triton import launch

    lines = []
    for name, tuner in launch._TUNED.items():
        for key, config in getattr(tuner, "cache", {}).items():
            lines.append(f"{name}: {key[:3]} -> " + ", ".join(map(str, launch._config_key(config))))
    return lines


WALK_FAMILIES = {"split": lambda w: w in ("partial_first", "full_first"),
                 "flat": lambda w: w.endswith("+flat"), "one_loop": lambda w: w == "one_loop",
                 "lpt": lambda w: w.endswith("+lpt"), "tma": lambda w: w.endswith("+tma")}


def walk_families(ms: dict) -> dict:
    """Config label → ms (``config_timings``) to the best ms of each walk family: ``split``
    (the PARTIAL and FULL loops, sub-tiles unrolled: the walks of the first H200 runs),
    ``flat``, ``one_loop``, ``lpt`` and ``tma`` (any walk with ``+lpt``, ``+tma``)."""
    best = {}
    for label, t in ms.items():
        walk = label.rsplit(" ", 1)[1]
        for family, member in WALK_FAMILIES.items():
            if member(walk) and t is not None:
                best[family] = min(best.get(family, float("inf")), t)
    return best


def print_walks(config_ms: dict) -> None:
    """Per workload and kernel: each walk family's best autotuning time against ``split``, and
    the winning config: which of the walks added since the first runs pay, and where."""
    print("\nwalks (the autotuner's own timings, ms; ratio to split; winner)")
    for label, kernels_ in config_ms.items():
        for name, tuned in kernels_.items():
            ms = {c: t for c, t in tuned["ms"].items() if t is not None}
            if not ms:
                continue
            best = walk_families(ms)
            base = best.get("split")
            cells = "  ".join(f"{f} {t:.3f}" + (f" ({t / base:.2f}×)" if base and f != "split" else "")
                              for f, t in best.items())
            print(f"  {label:26s} {name:14s} {cells}  | {min(ms, key=ms.get)}")


PRUNE_SLACK = 1.05


def losing_candidates(config_ms: dict, slack: float = PRUNE_SLACK) -> dict:
    """``config_ms`` (workload label → kernel → ``{"ms": {config label: ms}}``) to the
    candidates never within ``slack`` × the fastest of their tuning on any workload, as
    ``"kernel Dd" → [config label]``: what to drop from ``launch.CONFIGS`` after a run."""
    best: dict[tuple, dict] = {}  # (kernel, "Dd") → config → its best ratio to the winner
    for label, kernels_ in config_ms.items():
        head = next(part for part in label.split() if part[0] == "D" and part[1:].isdigit())
        for name, tuned in kernels_.items():
            ms = {c: t for c, t in tuned["ms"].items() if t is not None and math.isfinite(t)}
            if not ms:
                continue
            fastest = min(ms.values())
            ratios = best.setdefault((name, head), {})
            for config, t in ms.items():
                ratios[config] = min(ratios.get(config, math.inf), t / fastest)
    return {f"{name} {head}": sorted(c for c, r in ratios.items() if r > slack)
            for (name, head), ratios in best.items() if any(r > slack for r in ratios.values())}


def config_timings() -> dict:
    """Each tuned kernel's latest autotuning (its key, and config → median ms as the autotuner
    measured it on the workload that triggered it). dK/dV storing dS (bit 30 of its
    ``TUNE_KEY``, the key's third part) is ``attn_bwd_dkdv+ds``, apart from the plain one."""
    from attnkit.backends.triton import launch

    table = {}
    for name, tuner in launch._TUNED.items():
        timings = getattr(tuner, "configs_timings", None) or {}
        keys = list(getattr(tuner, "cache", {}))
        if keys and isinstance(keys[-1][2], int) and keys[-1][2] >> 30 & 1:
            name += "+ds"
        table[name] = {"key": str(keys[-1][:3]) if keys else None, "ms": {
            "{}x{} w{} s{} {}".format(*launch._config_key(c)): (t[0] if isinstance(t, (list, tuple)) else t)
            for c, t in timings.items()}}
    return table


@dataclass
class Warmed:
    """What the warm step found: candidates dropped (``[kernel, bucket, config]``), and the
    jobs still failing once those are gone (``label → output tail``): a ``"mask Dd"`` or a
    ``"kind name dtype"``, kept out of this process, whose CUDA context one crash would end."""

    dropped: list = field(default_factory=list)
    broken: dict = field(default_factory=dict)
    direct_failed: bool = False  # a worker failed in its direct launches (launch.DIRECT_LAUNCH)

    def skips(self, label: str) -> bool:
        return label in self.broken


def warm(todo: list[Workload], args, run=None) -> Warmed:
    """Compile and run every kernel config each (mask, head dim) needs, in parallel processes:
    the binaries land in Triton's on-disk cache, so the timed process loads instead of
    compiling ~40 configs one after another. (The kernels do not specialize on lengths or mask
    parameters, only on whether the lengths are multiples of the 128-wide sparse blocks, as
    1024 and every workload's are, so one small problem per mask and head dim builds the
    binaries the workloads use.) Each (mask, head dim) job is split into ``--warm-parts``
    workers, each compiling every n-th candidate (one worker compiled ~45 at ~2 s each, one
    after another: 85–90 s on the H200's host).

    A candidate that fails in a (mask, head dim) worker (an exception, or a crash that leaves
    the CUDA context unusable) is named by the worker's trace (:func:`culprit`), dropped from
    ``launch.CONFIGS`` here, and the job is rerun without it: one bad candidate costs a rerun,
    not the timed run. A mask-kind worker's failure is that kind's (no config is dropped).
    ``run(jobs) -> {label: (returncode, output)}`` runs the workers (tests pass a fake)."""
    pairs = config_checks(todo) if args.check_configs else sorted({(w.mask, w.d) for w in todo})
    parts = args.warm_parts or max(1, min(WARM_MAX_PARTS, (os.cpu_count() or 1) // max(1, len(pairs))))
    jobs = {warm_label(mask, d, part, parts): ["--warm-one", f"{mask}:{d}", "--warm-part", f"{part}/{parts}",
                                               "--dtype", args.dtype, "--span", "128",
                                               "--exclude-walks", args.exclude_walks]
            for mask, d in pairs for part in range(parts)}
    if args.check_kinds:  # the mask-kind checks' one config per kernel, each kind in its dtypes
        for low, only, backward in KIND_PASSES:
            for name in (only or mask_kinds(*KIND_SHAPE[3:5], KIND_SHAPE[0], torch.Generator())):
                jobs[kind_label(name, low, backward)] = ["--warm-kind", f"{name}:{low}:{backward}",
                                                         "--exclude-walks", args.exclude_walks]
    start = time.perf_counter()
    found = Warmed()
    pending = dict(jobs)
    for attempt in range(WARM_ATTEMPTS):
        outcomes = (run or _run_workers)({label: [*argv, "--drop-configs", json.dumps(found.dropped)]
                                          for label, argv in pending.items()})
        pending = {}
        for label, (code, output) in outcomes.items():
            bad = culprit(output) if code and not label.startswith("kind ") else None
            if code and TRACE + "direct" in output.splitlines():  # its candidates all passed
                found.direct_failed = True
                print(f"warm {label}: direct launches FAILED, turned off for this run:\n"
                      f"{output[-800:]}", flush=True)
            elif code == 0:
                print(f"warm {label}: ok", flush=True)
            elif code == TIMED_OUT:  # most likely slow compiles: the timed process finishes them
                print(f"warm {label}: still running after {WARM_TIMEOUT_S} s, stopped; not judged",
                      flush=True)
            elif bad is None or attempt == WARM_ATTEMPTS - 1:
                found.broken[warm_job(label)] = output[-2000:]  # a part's failure is its job's
                print(f"warm {label}: FAILED ({code}); left out of this run:\n{output[-2000:]}",
                      flush=True)
            else:
                print(f"warm {label}: FAILED ({code}) in {bad[0]} D{bad[1]} {tuple(bad[2])}: "
                      f"candidate dropped, job rerun\n{output[-800:]}", flush=True)
                if bad not in found.dropped:
                    found.dropped.append(bad)
                # every part of the job: the drop shifts the candidates' indices between parts
                pending.update({other: argv for other, argv in jobs.items()
                                if warm_job(other) == warm_job(label)})
        if not pending:
            break
    drop_configs(found.dropped)
    print(f"warm: {len(jobs)} jobs in parallel, {len(found.dropped)} candidates dropped, "
          f"{len(found.broken)} jobs failing, {time.perf_counter() - start:.0f} s", flush=True)
    return found


def warm_label(mask: str, d: int, part: int = 0, parts: int = 1) -> str:
    """``"mask Dd"``: what the timed process skips if its warm job fails; with ``parts``
    workers per job, each worker's label adds its part."""
    return f"{mask} D{d}" + (f"{PART}{part + 1}/{parts}" if parts > 1 else "")


def warm_job(label: str) -> str:
    """The ``"mask Dd"`` (or mask kind) job a worker's :func:`warm_label` belongs to."""
    return label.split(PART)[0]


PART = " part "
WARM_MAX_PARTS = 4

WARM_ATTEMPTS = 4
WARM_TIMEOUT_S = 300  # all workers together; a D128 job has ~77 configs (both backwards) at ~2 s
# each (sm90, triton 3.6), split over its parts
TIMED_OUT = "timed out"
TRACE = "warm launch "


def _run_workers(jobs: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """Run this script once per job (``label → argv``), all at once; ``label → (returncode,
    output)``. A worker still running after :data:`WARM_TIMEOUT_S` is killed: :data:`TIMED_OUT`."""
    procs = {label: subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
             for label, argv in jobs.items()}
    deadline = time.perf_counter() + WARM_TIMEOUT_S
    outcomes = {}
    for label, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.perf_counter(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            outcomes[label] = (TIMED_OUT, proc.communicate()[0])
            continue
        outcomes[label] = (proc.returncode, output)
    return outcomes


def culprit(output: str) -> Optional[list]:
    """The candidate a failed worker was running: its last traced launch without an ``ok``
    after it (see :func:`traced_launches`), as ``[kernel, bucket, config]``; ``None`` when
    the worker failed outside a launch."""
    last = None
    for line in output.splitlines():
        if line.startswith(TRACE):
            traced = line[len(TRACE):]
            last = json.loads(traced) if traced.startswith("[") else None  # or "ok", "direct"
    return last


@contextlib.contextmanager
def traced_launches():
    """In a warm worker: each fixed-config launch prints ``kernel, bucket, config`` before it
    runs and ``ok`` once the GPU has finished it, so the launch that fails (or kills the
    process) is the last one printed without an ``ok``."""
    from attnkit.backends.triton import launch

    original = launch.Call._launch

    def traced(self, block_m, block_n, walk, **options):
        bucket = launch.head_bucket(max(self.args["DK_PAD"], self.args["DV_PAD"]))
        config = [block_m, block_n, options.get("num_warps"), options.get("num_stages"), walk]
        print(TRACE + json.dumps([self.name, bucket, config]), flush=True)
        original(self, block_m, block_n, walk, **options)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(TRACE + "ok", flush=True)

    launch.Call._launch = traced
    try:
        yield
    finally:
        launch.Call._launch = original


def drop_configs(dropped: list[list]) -> None:
    """Remove ``[kernel, bucket, config]`` candidates from ``launch.CONFIGS`` (this process)."""
    from attnkit.backends.triton import launch

    for name, bucket, config in dropped:
        candidates = launch.CONFIGS[name][int(bucket)]
        if tuple(config) in candidates:
            candidates.remove(tuple(config))


def warm_one(spec: str, dtype_name: str, span: int, part: str = "0/1") -> int:
    """One warm worker: forward and backward of ``mask:d`` at a small size, through each
    backward (:data:`PATHS`), with each candidate of its ``part`` (``"p/n"``: the candidates i
    with i mod n = p) in turn (``launch.pinned(i)``: candidate i of every kernel), each launch
    traced; then, in part 0 alone, three unpinned calls (autotuning, ``JITFunction``, direct
    launches: ``launch.DIRECT_LAUNCH``), by when the other parts' binaries are mostly on disk
    (those that are not, it compiles)."""
    import attnkit as ak
    from attnkit.backends.triton import launch

    mask, d = spec.rsplit(":", 1)
    device = torch.device("cuda")
    dtype = DTYPES[dtype_name]
    w = Workload(mask, 1024, int(d), 2, 2, span)
    q, k, v = (torch.randn(w.batch, w.heads, w.n, w.d, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    attn_mask = Masks(w, device).attnkit
    bucket = launch.head_bucket(launch.head_pad(w.d))
    mine, parts = (int(x) for x in part.split("/"))
    with traced_launches():
        for index in range(max(len(launch.CONFIGS[name][bucket]) for name in launch.CONFIGS)):
            if index % parts != mine:
                continue
            with launch.pinned(index):
                for backward in PATHS:
                    with launch.backward_path(backward):
                        out = ak.attention(q, k, v, attn_mask, backend="triton")
                    out.backward(torch.randn_like(out))
    if mine:
        return 0
    # then as the timed process launches: autotuned, through JITFunction, then directly
    print(TRACE + "direct", flush=True)
    for backward in PATHS:
        for _ in range(3):
            with launch.backward_path(backward):
                out = ak.attention(q, k, v, attn_mask, backend="triton")
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
    print(TRACE + "direct ok", flush=True)
    return 0


def warm_kind(spec: str) -> int:
    """One warm worker: the forward and backward ``check_kinds`` runs for mask kind ``name`` in
    ``dtype`` through ``backward`` (``"name:bf16:recompute"``), with the same shapes, mask and
    single configs: the same binaries, so the check in the timed process loads instead of
    compiling."""
    import attnkit as ak
    from attnkit.backends.triton import launch

    name, dtype_name, backward = spec.rsplit(":", 2)
    device = torch.device("cuda")
    dtype = DTYPES[dtype_name]
    batch, heads, heads_kv, tq, tk, d = KIND_SHAPE
    mask = mask_kinds(tq, tk, batch, torch.Generator().manual_seed(1), device)[name]
    q, k, v = (torch.randn(batch, h, t, d, device=device, dtype=dtype).requires_grad_()
               for h, t in ((heads, tq), (heads_kv, tk), (heads_kv, tk)))
    with launch.pinned(0), traced_launches(), launch.backward_path(backward):
        out = ak.attention(q, k, v, mask, backend="triton")
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return 0


def print_table(results: list[Result], competitors: list[str], info: dict) -> None:
    """TFLOP/s per competitor, side by side, and our ratio to the best competitor on the row
    (``attnkit-triton``'s, and ``attnkit-stored``'s where it ran)."""
    keyed = {}
    for r in results:
        keyed.setdefault((r.workload, r.d, r.n, r.mode), {})[r.backend] = r
    short = {"attnkit-triton": "triton", "attnkit-kernels": "kernels", "sdpa-flash": "flash",
             "sdpa-cudnn": "cudnn",
             "flex-compiled": "flex", "sdpa-dense-mask": "sdpa+mask", "attnkit-auto": "auto",
             "sdpa-default": "sdpa", "attnkit-stored": "stored"}
    with_stored = "attnkit-stored" in competitors
    header = f"{'workload':16s} {'D':>4s} {'N':>6s} {'mode':8s}" + "".join(
        f"{short.get(c, c):>10s}" for c in competitors) + f"{'vs best':>9s}{'% mm':>6s}" + (
        f"{'stored vs best':>15s}" if with_stored else "")
    print("\nTFLOP/s (median of do_bench; n/a = cannot run this mask)")
    print(header)
    for (workload, d, n, mode), row in keyed.items():
        cells, best_other = [], None
        for c in competitors:
            r = row.get(c)
            if r is None or r.tflops is None:
                cells.append(f"{'n/a' if r is None or r.status.startswith('n/a') else 'err':>10s}")
                continue
            cells.append(f"{r.tflops:10.1f}" if r.tflops >= 1 else f"{r.tflops:10.2g}")
            if not c.startswith("attnkit-"):
                best_other = max(best_other or 0.0, r.tflops)
        ours = row.get("attnkit-triton")
        ratio = (f"{ours.tflops / best_other:8.2f}x" if ours and ours.tflops and best_other
                 else f"{'':>9s}")
        peak = info.get("matmul_tflops")
        share = f"{100 * ours.tflops / peak:5.0f}%" if ours and ours.tflops and peak else f"{'':>6s}"
        stored = row.get("attnkit-stored")
        other = (f"{stored.tflops / best_other:14.2f}x" if with_stored and stored and stored.tflops
                 and best_other else "")
        print(f"{workload:16s} {d:4d} {n:6d} {mode:8s}" + "".join(cells) + ratio + share + other)
    waited = host_bound(keyed) if not info.get("dry_run") else []  # the interpreter: noise
    if waited:
        print(f"\nthe GPU waited on our Python (attnkit-triton over {HOST_SLACK:.2f}x the time of its "
              f"kernels launched alone, attnkit-kernels): " + ", ".join(waited))


def print_profile(profiles: dict, on_device: bool = True) -> None:
    """``kernel_profile`` (workload → competitor → name → :func:`kernel_times` row) as one line
    per competitor: the total µs and the six largest entries (names cut to 48 characters; for
    kernels, registers per thread and blocks per SM)."""
    if not profiles:
        return
    what = ("device µs per kernel" if on_device
            else "host µs per operator, inclusive (dry run: no kernels)")
    print(f"\none forward+backward under torch.profiler, {what}:")
    for label, by_backend in profiles.items():
        print(f"  {label}")
        for backend, times in by_backend.items():
            if "error" in times:
                print(f"    {backend:15s} {times['error']}")
                continue
            parts = []
            for name, row in list(times.items())[:6]:
                facts = [f"{row['regs']} regs"] if "regs" in row else []
                facts += [f"{row['smem'] / 1024:.0f} KiB"] if "smem" in row else []
                facts += [f"{row['blocks_per_sm']:.3g}/SM"] if "blocks_per_sm" in row else []
                parts.append(f"{name[:48]} {row['us']:.0f}"
                             + (f" ({', '.join(facts)})" if facts else ""))
            total = sum(row["us"] for row in times.values())
            print(f"    {backend:15s} {total:8.0f}  " + ", ".join(parts))


HOST_SLACK = 1.05


def host_bound(keyed: dict) -> list[str]:
    """The rows of ``keyed`` (``(workload, d, n, mode) → backend → Result``) whose
    ``attnkit-triton`` time exceeds ``HOST_SLACK`` × ``attnkit-kernels``', with the excess."""
    rows = []
    for (workload, d, n, mode), row in keyed.items():
        ours, alone = row.get("attnkit-triton"), row.get("attnkit-kernels")
        if ours and alone and ours.ms and alone.ms and ours.ms > HOST_SLACK * alone.ms:
            rows.append(f"{workload} D{d} N{n} {mode} +{ours.ms - alone.ms:.3f} ms")
    return rows


if __name__ == "__main__":
    sys.exit(main())
