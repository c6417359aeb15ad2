"""GPU timing of ``backend="triton"`` against torch SDPA, FlexAttention and SDPA with a dense mask.

    PYTHONPATH=src python3 benchmarks/gpu.py --dims 128 --lengths 1024,16384 --budget 420
    PYTHONPATH=src python3 benchmarks/gpu.py --dry-run   # anywhere: toy sizes, Triton interpreter

Workloads, per head dim: a sliding window and causal documents (both ``--span`` long) at
``--masked-length``, then causal and no mask at each of ``--lengths``; ``--tokens`` per batch
(B = tokens / N), H = ``--hidden`` / D. Competitors, in one run: ``attention(backend="triton")``,
the triton backend's own ``forward`` with ``TritonOptions(backward="stored_ds")`` (called on
validated inputs: no dispatch, garbage guard or non-finite flags, which the public call
adds; ``attention`` takes no backend options), torch SDPA's flash and cuDNN backends
(no mask or causal), compiled FlexAttention with a block mask (``--flex-masks``: each costs a
compile) and SDPA with a dense bool mask; ``--dry-run`` leaves out those that need CUDA.

- Correct first: before timing a workload, each attnkit competitor runs it at its full shape
  (fresh inputs; its autotuning is then done for the timing); out, LSE, dq, dk, dv are compared
  with float32 math on the device, one head at a time, by ‖x − ref‖/‖ref‖, allowed twice SDPA's
  error in the same dtype plus 2e-3, with NaN left in the caching allocator so unwritten outputs
  show. A failure makes the exit status 1.
- Timing: ``triton.testing.do_bench`` medians. FLOPs count attended pairs: forward
  4·B·H·D·pairs (N² without a mask, N²/2 causal by convention, exact for the window and the
  documents), backward 2.5× the forward (fwd+bwd 3.5×). The table: TFLOP/s per competitor,
  and each attnkit competitor's ratio to the best other one on the row.
- Decoding (``--decode``, run first): Tq queries of 64 heads (GQA 8:1, D 128) against a cache
  of Tk keys under bottom-right causal, ``attention`` (the split-key kernel) against SDPA's
  flash, efficient and cuDNN backends (with torch's lower-right causal bias): µs and the K/V
  bytes read per second against the device copy bandwidth measured in the same run; each
  attnkit row checked against SDPA's math backend first.
- Ring steps (``--ring NxP``, run second): one rank's step of causal ring attention, on the
  fused triton kernels against the tiled engine's step they replace (the diagonal step and a
  full one), µs, TFLOP/s and the ratio, outputs compared first.
- Score modifiers (``--mods``, run third): causal attention with ALiBi or a softcap at
  ``--mods-length``, the triton kernels against FlexAttention compiled with the same
  ``score_mod``, TFLOP/s and the ratio, each row checked first.
- ``--profile``: each kernel's device time in one forward+backward (``torch.profiler``).
  ``--budget SECONDS``: no workload after the first starts past it.

The JSON (``$OUT``, else ``results/``; rewritten after each workload) holds the device,
versions, checks, timings and profiles; the table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch  # does not import triton: --dry-run still picks the interpreter in main()

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("window", "documents&causal", "causal", "dense")
MASKED = MASKS[:2]  # at --masked-length; the others at each of --lengths
OURS = ("attnkit-triton", "attnkit-stored")
COMPETITORS = (*OURS, "sdpa-flash", "sdpa-cudnn", "flex-compiled", "sdpa-dense-mask")
SHORT = {"attnkit-triton": "triton", "attnkit-stored": "stored", "sdpa-flash": "flash",
         "sdpa-cudnn": "cudnn", "flex-compiled": "flex", "sdpa-dense-mask": "sdpa+mask"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (Triton interpreter)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--dims", default="64,128", help="head dims, comma separated")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="N of causal and dense")
    p.add_argument("--masked-length", type=int, default=8192, help="N of the window and documents")
    p.add_argument("--span", type=int, default=1024, help="window size and document length")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens / N")
    p.add_argument("--hidden", type=int, default=2048, help="model width: H = hidden / D")
    p.add_argument("--masks", default=",".join(MASKS), help="of %(default)s")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--competitors", default=",".join(COMPETITORS), help="of %(default)s")
    p.add_argument("--flex-masks", default="window,documents&causal", help="or 'all'")
    p.add_argument("--profile", action="store_true", help="per-kernel device times (torch.profiler)")
    p.add_argument("--skip-check", action="store_true", help="time without the correctness checks")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: no workload but the first starts after")
    p.add_argument("--decode", default="1x1,1x8,16x1", help="decoding rows, BxTq, comma separated "
                   "(each at every --decode-lengths key count; '' for none)")
    p.add_argument("--decode-lengths", default="4096,16384,131072")
    p.add_argument("--ring", default="16384x4", help="ring-step rows, NxP: the global length and "
                   "the ranks (one step of one rank, causal; '' for none)")
    p.add_argument("--mods", default="alibi,softcap", help="score-modifier rows under causal "
                   "masking at --mods-length ('' for none)")
    p.add_argument("--mods-length", type=int, default=8192)
    p.add_argument("--paged", default="8x512-8192,16x4096", help="paged-cache rows: BxLO-HI a "
                   "decode step of B sequences of LO..HI keys; BxP B forks of a P-token prompt "
                   "(shared blocks against unshared copies); '' for none")
    p.add_argument("--out", default=None, help="folder for the JSON (default: $OUT, else results/)")
    args = p.parse_args(argv)
    for name, allowed in (("masks", MASKS), ("competitors", COMPETITORS), ("modes", ("fwd", "fwd+bwd"))):
        unknown = sorted(set(getattr(args, name).split(",")) - set(allowed))
        if unknown:
            p.error(f"--{name}: unknown {unknown}; choose from {','.join(allowed)}")
    if args.dry_run:
        args.dims, args.lengths, args.tokens, args.hidden = "32", "64", 64, 64
        args.masked_length, args.span = 64, 16
        args.decode, args.decode_lengths = "1x1,2x4", "96"
        args.ring = "128x2"
        args.mods_length = 64
        args.paged = "3x16-80,4x64"
    return args


# ---- workloads and competitors -------------------------------------------------------------------
@dataclass
class Workload:
    mask: str  # one of MASKS
    n: int
    d: int
    batch: int
    heads: int
    span: int

    @property
    def label(self) -> str:
        return {"window": f"window{self.span}", "documents&causal": f"docs{self.span}&causal"}.get(
            self.mask, self.mask)

    @property
    def key(self) -> str:
        return f"{self.label} D{self.d} N{self.n}"

    def pairs(self) -> float:
        """Attended (query, key) pairs per head."""
        n, w = self.n, self.span
        if self.mask == "dense":
            return float(n * n)
        if self.mask == "causal":
            return n * n / 2  # the usual convention (exactly n(n+1)/2)
        if self.mask == "window":  # query i sees keys max(0, i - w) .. i
            return float(sum(min(i, w) + 1 for i in range(n)))
        full, rest = divmod(n, w)  # causal documents of length w
        return float(full * w * (w + 1) // 2 + rest * (rest + 1) // 2)

    def flops(self, mode: str) -> float:
        forward = 4.0 * self.batch * self.heads * self.d * self.pairs()
        return forward * (3.5 if mode == "fwd+bwd" else 1.0)


def workloads(args) -> list[Workload]:
    """Per head dim: the masked workloads first, then causal and dense at each length."""
    masks, out = args.masks.split(","), []
    for d in (int(x) for x in args.dims.split(",")):
        for mask in (m for m in MASKS if m in masks):
            lengths = [args.masked_length] if mask in MASKED else [int(x) for x in args.lengths.split(",")]
            out += [Workload(mask, n, d, max(1, args.tokens // n), max(1, args.hidden // d), args.span)
                    for n in lengths]
    return out


def mask_mod(w: Workload, device) -> Optional[Callable]:
    """``w``'s mask as a FlexAttention ``mask_mod`` (``None`` without a mask)."""
    span, docs = w.span, torch.arange(w.n, device=device) // w.span
    return {"dense": None, "causal": lambda b, h, q, kv: q >= kv,
            "window": lambda b, h, q, kv: (q >= kv) & (q - kv <= span),
            "documents&causal": lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv)}[w.mask]


def dense_mask(w: Workload, device) -> Optional[torch.Tensor]:
    """``w``'s mask as a bool ``[N, N]``, True = may attend (``None`` without a mask)."""
    mod, positions = mask_mod(w, device), torch.arange(w.n, device=device)
    return None if mod is None else mod(0, 0, positions[:, None], positions)


def attnkit_fn(name: str, w: Workload, device) -> Callable:
    """``fn(q, k, v) -> (out [B, H, N, D], lse [B, H, N])`` of attnkit competitor ``name``."""
    import attnkit as ak
    from attnkit.backends.triton import TritonBackend, launch
    from attnkit.inputs import validate

    mask = {"dense": None, "causal": ak.causal(), "window": ak.sliding_window(w.span),
            "documents&causal": ak.documents(torch.arange(w.n, device=device) // w.span) & ak.causal(),
            }[w.mask]
    if name == "attnkit-triton":
        return lambda q, k, v: ak.attention(q, k, v, mask, backend="triton", return_lse=True)[:2]
    backend = TritonBackend(launch.TritonOptions(backward="stored_ds"))
    return lambda q, k, v: backend.forward(validate(q, k, v, mask))[:2]


def make_fn(name: str, w: Workload, device, flex_masks: str = "all") -> tuple[Optional[Callable], str]:
    """``fn(q, k, v) -> out`` of competitor ``name`` on ``w``'s mask, or ``(None, why not)``."""
    import torch.nn.functional as F

    if name in OURS:
        ours = attnkit_fn(name, w, device)
        return (lambda q, k, v: ours(q, k, v)[0]), ""
    if name in ("sdpa-flash", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if w.mask not in ("dense", "causal"):
            return None, "takes no mask but causal"
        if name == "sdpa-cudnn" and device.type != "cuda":
            return None, "needs CUDA"
        chosen = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, is_causal=w.mask == "causal")
        return sdpa, ""
    if name == "flex-compiled":
        if device.type != "cuda" or (flex_masks != "all" and w.mask not in flex_masks.split(",")):
            return None, "needs CUDA" if device.type != "cuda" else "not in --flex-masks"
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled, mod = torch.compile(flex_attention, dynamic=False), mask_mod(w, device)
        block = None if mod is None else create_block_mask(mod, None, None, w.n, w.n, device=device)
        return (lambda q, k, v: compiled(q, k, v, block_mask=block)), ""
    allowed = dense_mask(w, device)
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)), ""


# ---- correctness at full size ------------------------------------------------------------------------
def reference(q, k, v, dout, allowed: Optional[torch.Tensor], scale: float,
              modify: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None) -> list[torch.Tensor]:
    """float32 math, one head at a time, for ``q, k, v, dout [B, H, N, D]`` and ``allowed
    [N, N]``: ``out [B, H, N, D], lse [B, H, N], dq, dk, dv [B, H, N, D]`` (float32).
    ``modify(scores, h)``: a score modifier applied to head ``h``'s scaled scores before the
    mask."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(5)]
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h:h + 1].detach().float().requires_grad_() for t in (q, k, v))
        scores = (qh @ kh.transpose(-1, -2)) * scale
        if modify is not None:
            scores = modify(scores, h)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, -1) @ vh
        grads = torch.autograd.grad(out, (qh, kh, vh), dout[:, h:h + 1].float())
        for store, x in zip(parts, (out.detach(), torch.logsumexp(scores, -1).detach(), *grads)):
            store.append(x)
    return [torch.cat(p, 1) for p in parts]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ (infinite when ``x`` is not finite)."""
    x, ref = x.detach().float(), ref.detach().float()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def describe(error: Exception) -> str:
    """An exception in one line: its type and its message's first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


def check(w: Workload, name: str, dtype: torch.dtype, device) -> dict:
    """Attnkit competitor ``name`` on ``w``'s shape, against :func:`reference`, with SDPA in
    ``dtype`` as the yardstick. An exception is a failed check."""
    import torch.nn.functional as F

    row = {"workload": w.key, "backend": name, "ok": False, "errors": {}}
    try:
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(w.key.encode()))
        q, k, v, dout = (torch.randn(w.batch, w.heads, w.n, w.d, generator=gen, device=device,
                                     dtype=dtype) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        allowed, scale = dense_mask(w, device), 1 / math.sqrt(w.d)
        truth = reference(q, k, v, dout, allowed, scale)
        poison = torch.full((16 * q.numel(),), math.nan, device=device)
        del poison  # NaN left in the allocator's free blocks: unwritten outputs show
        out, lse = attnkit_fn(name, w, device)(q, k, v)
        ours = (out, lse, *torch.autograd.grad(out, (q, k, v), dout))
        yard = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        yard = (yard, None, *torch.autograd.grad(yard, (q, k, v), dout))
        for key, mine, theirs, t in zip(("out", "lse", "dq", "dk", "dv"), ours, yard, truth):
            yardstick = 1e-4 if theirs is None else 2 * relative_error(theirs, t)  # no LSE from SDPA
            row["errors"][key] = {"error": relative_error(mine, t), "allowed": yardstick + 2e-3}
        row["ok"] = all(e["error"] <= e["allowed"] for e in row["errors"].values())
    except Exception as error:  # noqa: BLE001 - a failed check is a result
        row["exception"] = describe(error)
    errors = " ".join(f"{key} {e['error']:.1e}/{e['allowed']:.1e}" for key, e in row["errors"].items())
    print(f"check {w.key:26s} {name:15s} {'ok' if row['ok'] else 'FAILED'}  "
          f"(error/allowed) {errors or row.get('exception')}", flush=True)
    return row


# ---- timing and profiles --------------------------------------------------------------------------
def timer(device) -> Callable[[Callable], float]:
    """Median milliseconds of ``fn()``: ``do_bench`` on CUDA; on CPU one call after a warm-up."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def once(fn) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return once


def step(fn: Callable, mode: str, q, k, v, dout) -> Callable[[], None]:
    """One forward (``mode`` ``"fwd"``) or forward+backward of ``fn`` on ``q, k, v``."""
    def forward_backward():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)
    return (lambda: fn(q, k, v)) if mode == "fwd" else forward_backward


def kernel_times(trace: dict, on_device: bool) -> dict[str, dict]:
    """A ``torch.profiler`` Chrome trace → per event name (largest first) ``us`` summed and
    ``calls``: device events (kernels, copies, memsets), or host operators without a device."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset") if on_device else ("cpu_op",)
    totals: dict[str, dict] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") in kinds and "dur" in event:
            row = totals.setdefault(event["name"], {"us": 0.0, "calls": 0})
            row["us"] += float(event["dur"])
            row["calls"] += 1
    return dict(sorted(totals.items(), key=lambda item: -item[1]["us"]))


def kernel_profile(fn: Callable[[], None], device) -> dict[str, dict]:
    """:func:`kernel_times` of one call of ``fn`` (after one call outside the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    fn()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_device) as prof:
        fn()
        if on_device:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(str(Path(folder) / "trace.json"))
        return kernel_times(json.loads((Path(folder) / "trace.json").read_text()), on_device)


def time_workload(w: Workload, competitors: list[str], args, device, dtype, bench,
                  profiles: dict) -> list[dict]:
    """Every competitor in every mode on ``w`` (random ``q, k, v [B, H, N, D]``): one row each."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(w.batch, w.heads, w.n, w.d, generator=gen, device=device, dtype=dtype)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rows = []
    for name in competitors:
        try:
            fn, why = make_fn(name, w, device, args.flex_masks)
        except Exception as error:  # noqa: BLE001 - reported in the row
            fn, why = None, f"setup failed: {describe(error)}"
        for mode in args.modes.split(","):
            row = dict(asdict(w), workload=w.label, mode=mode, backend=name, ms=None, tflops=None,
                       status=f"n/a: {why}")
            if fn is not None:
                try:
                    row["ms"] = bench(step(fn, mode, q, k, v, dout))
                    row["tflops"], row["status"] = w.flops(mode) / row["ms"] / 1e9, "ok"
                except Exception as error:  # noqa: BLE001 - e.g. a backend refusing a shape
                    row["status"] = f"error: {describe(error)}"
            rows.append(row)
        if args.profile and fn is not None:
            try:
                times = kernel_profile(step(fn, "fwd+bwd", q, k, v, dout), device)
            except Exception as error:  # noqa: BLE001 - reported in the profile
                times = {"error": describe(error)}
            profiles.setdefault(w.key, {})[name] = times
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- report ------------------------------------------------------------------------------------------
def print_table(results: list[dict], competitors: list[str]) -> None:
    """TFLOP/s per competitor side by side, and each attnkit competitor's ratio to the best
    of the others on the row."""
    table: dict[tuple, dict[str, dict]] = {}
    for r in results:
        table.setdefault((r["workload"], r["d"], r["n"], r["mode"]), {})[r["backend"]] = r
    ours = [c for c in competitors if c in OURS]
    print("\nTFLOP/s (do_bench medians; n/a: cannot run this mask; err: failed)")
    names = "".join(f"{SHORT[c]:>10s}" for c in competitors)
    versus = "".join(f"{SHORT[c] + ' vs best':>16s}" for c in ours)
    print(f"{'workload':16s} {'D':>4s} {'N':>6s} {'mode':8s}{names}{versus}")
    for (workload, d, n, mode), row in table.items():
        rate = {c: row[c]["tflops"] for c in competitors if c in row and row[c]["tflops"]}
        cells = "".join(f"{rate[c]:10.4g}" if c in rate else
                        f"{'err' if c in row and row[c]['status'].startswith('error') else 'n/a':>10s}"
                        for c in competitors)
        best = max((t for c, t in rate.items() if c not in OURS), default=None)
        ratios = "".join(f"{rate[c] / best:15.2f}x" if c in rate and best else f"{'':>16s}" for c in ours)
        print(f"{workload:16s} {d:4d} {n:6d} {mode:8s}{cells}{ratios}")


def print_profile(profiles: dict, on_device: bool) -> None:
    """Per workload and competitor: the total µs and the five largest entries."""
    if profiles:
        print(f"\none forward+backward under torch.profiler, "
              f"{'device µs per kernel' if on_device else 'host µs per operator (dry run)'}:")
    for key, by_name in profiles.items():
        print(f"  {key}")
        for name, times in by_name.items():
            if "error" in times:
                print(f"    {name:15s} {times['error']}")
                continue
            top = ", ".join(f"{kernel[:48]} {t['us']:.0f}" for kernel, t in list(times.items())[:5])
            print(f"    {name:15s} {sum(t['us'] for t in times.values()):8.0f}  {top}")


def decode_rows(args, device, dtype, bench) -> list[dict]:
    """Decoding steps: Tq queries of 64 heads (GQA 8:1, D 128) against a cache of Tk keys,
    bottom-right causal; attnkit (``auto``: the split-key kernel on CUDA) against SDPA's
    backends, as µs and achieved K/V read bandwidth (``2·B·Hkv·Tk·D`` elements read once) over
    the device copy bandwidth measured here. Each attnkit row is checked against SDPA's math
    backend first (relative error ≤ 2e-2 in bf16)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import attnkit as ak
    heads, heads_kv, dim = (64, 8, 128) if device.type == "cuda" else (8, 1, 32)
    big = torch.empty(1 << 28 if device.type == "cuda" else 1 << 16, dtype=torch.uint8, device=device)
    copy_gbs = 2 * big.numel() / bench(lambda: big.clone()) / 1e6  # read + write, GB/s
    rows, backends = [], {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
                          "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
                          "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    for spec in filter(None, args.decode.split(",")):
        batch, q_len = map(int, spec.split("x"))
        for kv_len in map(int, args.decode_lengths.split(",")):
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, heads, q_len, dim, device=device, dtype=dtype, generator=gen)
            k, v = (torch.randn(batch, heads_kv, kv_len, dim, device=device, dtype=dtype,
                                generator=gen) for _ in range(2))
            mask = ak.causal("bottom_right")
            fns = {"attnkit-auto": lambda: ak.attention(q, k, v, mask)}
            lower_right = causal_lower_right(q_len, kv_len) if q_len > 1 else None
            for name, which in backends.items():
                def sdpa(which=which):
                    with sdpa_kernel(which):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right,
                                                              enable_gqa=True)
                fns[name] = sdpa
            with sdpa_kernel(SDPBackend.MATH):
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                     attn_mask=lower_right, enable_gqa=True)
            ok = relative_error(fns["attnkit-auto"]().float(), ref) <= 2e-2
            kv_bytes = 2 * batch * heads_kv * kv_len * dim * q.element_size()
            row = dict(batch=batch, q_len=q_len, kv_len=kv_len, ok=ok, copy_gbs=copy_gbs)
            for name, fn in fns.items():
                try:
                    ms = bench(fn)
                    row[name] = dict(us=ms * 1e3, gbs=kv_bytes / ms / 1e6)
                except Exception as error:  # noqa: BLE001 - a backend that cannot run this
                    row[name] = dict(error=describe(error))
            rows.append(row)
            cells = "  ".join(f"{n} " + (f"{r['us']:.1f} µs {r['gbs'] / copy_gbs:.0%}" if "us" in r
                                         else "n/a") for n, r in row.items() if isinstance(r, dict))
            print(f"decode B{batch} Tq{q_len} Tk{kv_len} {'ok' if ok else 'WRONG'}  {cells}",
                  flush=True)
    return rows


def paged_rows(args, device, dtype, bench) -> list[dict]:
    """Decoding steps over an ``attnkit.nn.PagedKVCache`` (blocks of 16; 64 query heads, GQA
    8:1, D 128): ``cache.attend`` (the split-key kernel reading blocks through the table,
    the table made again as after every append) against SDPA's best backend on the same keys
    already gathered, as µs and K/V bandwidth (keys and values read once) over the copy
    bandwidth; and a decode step of B forks of one prompt (shared blocks) against B unshared
    copies. Each row is checked against SDPA's math backend first."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnkit.nn import PagedKVCache
    heads, heads_kv, dim, block = (64, 8, 128, 16) if device.type == "cuda" else (8, 1, 32, 16)
    big = torch.empty(1 << 28 if device.type == "cuda" else 1 << 16, dtype=torch.uint8,
                      device=device)
    copy_gbs = 2 * big.numel() / bench(lambda: big.clone()) / 1e6
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    def cache_of(prompt_k, prompt_v, lengths, new, forks=0):  # prompts, then one token each
        blocks = sum(-(-int(n) // block) + 2 for n in lengths) + 2 * forks + 4
        cache = PagedKVCache(blocks, block).append(prompt_k, prompt_v, lengths=lengths)
        for _ in range(forks):
            cache.fork(0)
        return cache.append(new, new)

    def attend(cache, q):  # a step's read: the cache changed since the last one
        cache._changed()
        return cache.attend(q)

    rows = []
    for spec in filter(None, args.paged.split(",")):
        batch, size = spec.split("x")
        batch = int(batch)
        q = rand(batch, heads, 1, dim)
        if "-" in size:  # ragged sequences, one cache
            low, high = map(int, size.split("-"))
            lengths = torch.linspace(low, high, batch).long().tolist()
            cache = cache_of(rand(batch, heads_kv, high, dim), rand(batch, heads_kv, high, dim),
                             lengths, rand(batch, heads_kv, 1, dim))
            keys, values = cache.keys, cache.values  # gathered once, for SDPA
            allowed = (torch.arange(keys.shape[2], device=device)[None]
                       < cache._state()[1][:, None])[:, None, None, :]
            with sdpa_kernel(SDPBackend.MATH):
                ref = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                                     attn_mask=allowed, enable_gqa=True)
            fns = {"attnkit-paged": lambda: attend(cache, q)}
            for name, which in (("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                                ("sdpa-math", SDPBackend.MATH)):
                def sdpa(which=which):
                    with sdpa_kernel(which):
                        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                                              enable_gqa=True)
                fns[name] = sdpa
            kv_elements = 2 * heads_kv * dim * sum(cache.lengths)
            label = f"paged decode B{batch} keys {low}..{high}"
        else:  # forks of one prompt
            prompt = int(size)
            one = [rand(1, heads_kv, prompt, dim) for _ in range(2)]
            new = rand(batch, heads_kv, 1, dim)
            shared = cache_of(*one, [prompt], new, forks=batch - 1)
            unshared = cache_of(*(t.expand(batch, -1, -1, -1) for t in one), [prompt] * batch,
                                new)
            with sdpa_kernel(SDPBackend.MATH):
                ref = F.scaled_dot_product_attention(q.float(), unshared.keys.float(),
                                                     unshared.values.float(), enable_gqa=True)
            fns = {"attnkit-shared": lambda: attend(shared, q),
                   "attnkit-unshared": lambda: attend(unshared, q)}
            kv_elements = 2 * heads_kv * dim * (prompt + 1) * batch
            label = f"shared prefix B{batch} prompt {prompt}"
        ok = all(relative_error(fn().float(), ref) <= 2e-2
                 for name, fn in fns.items() if name.startswith("attnkit"))
        row = dict(case=label, ok=ok, copy_gbs=copy_gbs)
        for name, fn in fns.items():
            try:
                ms = bench(fn)
                row[name] = dict(us=ms * 1e3, gbs=kv_elements * q.element_size() / ms / 1e6)
            except Exception as error:  # noqa: BLE001 - a backend that cannot run this
                row[name] = dict(error=describe(error))
        rows.append(row)
        cells = "  ".join(f"{n} " + (f"{r['us']:.1f} µs {r['gbs'] / copy_gbs:.0%}" if "us" in r
                                     else "n/a") for n, r in row.items() if isinstance(r, dict))
        print(f"{label} {'ok' if ok else 'WRONG'}  {cells}", flush=True)
    return rows


def ring_rows(args, device, dtype, bench) -> list[dict]:
    """One step of causal ring attention over a global length N on P ranks, as the last rank
    computes it: its queries against its own K/V shard (the diagonal, half masked) and against
    the shard before it (no mask), each of ``N/P`` rows, ``H = hidden / D`` heads, batch 1.
    The fused triton kernels (the ring's step on CUDA) against the tiled engine's step it
    replaces, forward and forward+backward, as µs, TFLOP/s (4·H·(N/P)²·D forward, ½ on the
    diagonal, backward 2.5×) and the ratio; each row's outputs are compared first (relative
    error ≤ 2e-2 in bf16)."""
    import attnkit as ak
    from attnkit.backends.tiled import uses_fused_kernel
    from attnkit.distributed.ring import Piece, pair_step
    from attnkit.masks import MaskSpace

    rows = []
    for spec in filter(None, args.ring.split(",")):
        n, world = map(int, spec.split("x"))
        d = int(args.dims.split(",")[0])
        heads, local = max(1, args.hidden // d), n // world
        space, mask, scale = MaskSpace(1, heads, n, n, device), ak.causal(), d ** -0.5
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, local, d, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))
        q_run = Piece(0, (world - 1) * local, local)
        for label, kv_rank, share in (("diagonal", world - 1, 0.5), ("below", world - 2, 1.0)):
            kv_run = Piece(0, kv_rank * local, local)
            steps = {name: pair_step(name, mask, space, scale, q_run, kv_run,
                                     fused=uses_fused_kernel(q, v, 0.0))[0]
                     for name in ("triton", "tiled")}
            outs = {name: step.forward(q, k, v) for name, step in steps.items()}
            ok = relative_error(outs["triton"][0].float(), outs["tiled"][0].float()) <= 2e-2
            out, lse = outs["triton"][0].to(dtype), outs["triton"][1].float().contiguous()
            flops = 4 * heads * local * local * d * share
            row = dict(step=label, n=n, world=world, d=d, heads=heads, ok=ok)
            for mode in args.modes.split(","):
                for name, step in steps.items():
                    def run(step=step, mode=mode):
                        step.forward(q, k, v)
                        if mode == "fwd+bwd":
                            step.backward(q, k, v, out, lse, dout, None)
                    try:
                        ms = bench(run)
                        work = flops * (3.5 if mode == "fwd+bwd" else 1.0)
                        row[f"{name} {mode}"] = dict(us=ms * 1e3, tflops=work / ms / 1e9)
                    except Exception as error:  # noqa: BLE001 - a step that cannot run here
                        row[f"{name} {mode}"] = dict(error=describe(error))
                pair = [row.get(f"{name} {mode}", {}).get("us") for name in ("tiled", "triton")]
                if all(pair):
                    row[f"speedup {mode}"] = pair[0] / pair[1]
            rows.append(row)
            cells = "  ".join(f"{key} {value['us']:.0f} µs" if isinstance(value, dict) and "us" in value
                              else f"{key} {value:.2f}×" for key, value in row.items()
                              if key.startswith(("tiled", "triton", "speedup")))
            print(f"ring N{n} P{world} {label} {'ok' if ok else 'WRONG'}  {cells}", flush=True)
    return rows


def modifier_rows(args, device, dtype, bench) -> list[dict]:
    """Causal attention with a score modifier (``--mods``: ALiBi with the paper's slopes, or a
    softcap of 30) at N = ``--mods-length``, B = tokens / N, H = hidden / D: ``attention``
    (the triton kernels) against FlexAttention compiled with the same ``score_mod`` and a
    causal block mask (on CUDA), forward and forward+backward, TFLOP/s (causal ½) and the
    ratio. Each row is checked first: out and dq against float32 math with the modifier (one
    head at a time), relative error ≤ 2e-2."""
    import attnkit as ak

    rows = []
    n, d = args.mods_length, int(args.dims.split(",")[0])
    batch, heads = max(1, args.tokens // n), max(1, args.hidden // d)
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)
    pos = torch.arange(n, device=device)
    for name in filter(None, args.mods.split(",")):
        if name == "alibi":
            mask = ak.causal() & ak.alibi(slopes)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)

            def modify(scores, h):  # [B, 1, N, N] of head h
                return scores + slopes[h] * (pos[None, :] - pos[:, None])
        elif name == "softcap":
            mask = ak.causal() & ak.softcap(30.0)

            def score_mod(score, b, h, q_idx, kv_idx):
                return 30.0 * torch.tanh(score / 30.0)

            def modify(scores, h):
                return 30.0 * torch.tanh(scores / 30.0)
        else:
            raise ValueError(f"--mods: unknown {name!r}; choose from alibi,softcap")
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))
        fns = {"attnkit-triton": lambda q, k, v: ak.attention(q, k, v, mask, backend="triton")}
        if device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            block = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n,
                                      device=device)
            flex = torch.compile(flex_attention)
            fns["flex-compiled"] = lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block)
        truth_out, _, truth_dq, _, _ = reference(q, k, v, dout, pos[None, :] <= pos[:, None],
                                                 d ** -0.5, modify)
        errors = {}
        for label, fn in fns.items():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            dq, = torch.autograd.grad(out, leaves[:1], dout)
            errors[label] = max(relative_error(out, truth_out), relative_error(dq, truth_dq))
        row = dict(modifier=name, n=n, d=d, batch=batch, heads=heads, errors=errors,
                   ok=all(e <= 2e-2 for e in errors.values()))
        flops = 4 * batch * heads * n * n * d * 0.5
        for mode in args.modes.split(","):
            for label, fn in fns.items():
                run = step(fn, mode, *(t.detach().requires_grad_(mode == "fwd+bwd")
                                       for t in (q, k, v)), dout)
                try:
                    ms = bench(run)
                    row[f"{label} {mode}"] = flops * (3.5 if mode == "fwd+bwd" else 1.0) / ms / 1e9
                except Exception as error:  # noqa: BLE001 - a competitor that cannot run this
                    row[f"{label} {mode}"] = describe(error)
            mine, theirs = row.get(f"attnkit-triton {mode}"), row.get(f"flex-compiled {mode}")
            if isinstance(mine, float) and isinstance(theirs, float):
                row[f"vs flex {mode}"] = mine / theirs
        rows.append(row)
        cells = "  ".join(f"{key} {value:.3g}" for key, value in row.items()
                          if isinstance(value, float) and key != "n")
        print(f"causal&{name} D{d} N{n} {'ok' if row['ok'] else 'WRONG'}  TFLOP/s {cells}", flush=True)
    return rows


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: the interpreter
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run (CPU interpreter)")
        return 2
    import triton

    dtype, bench, competitors = DTYPES[args.dtype], timer(device), args.competitors.split(",")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "args": vars(args)}
    print(f"device {info['device']}  torch {info['torch']}  triton {info['triton']}  {args.dtype}",
          flush=True)
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = "dry_run" if args.dry_run else datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    path = out_dir / f"gpu_bench_{stamp}.json"
    checks, results, skipped, profiles, decode, ring, mods, paged = [], [], [], {}, [], [], [], []

    def save() -> None:  # after every workload: a run cut short keeps what it measured
        info["elapsed_s"] = time.perf_counter() - started
        path.write_text(json.dumps({"info": info, "checks": checks, "skipped": skipped,
                                    "results": results, "profiles": profiles,
                                    "decode": decode, "ring": ring, "mods": mods,
                                    "paged": paged}, indent=1))
    if args.paged:  # first: never measured yet, a few seconds
        paged += paged_rows(args, device, dtype, bench)
        save()
    if args.decode:  # a few seconds, and what no other run measures
        decode += decode_rows(args, device, dtype, bench)
        save()
    if args.ring:
        ring += ring_rows(args, device, dtype, bench)
        save()
    if args.mods:
        mods += modifier_rows(args, device, dtype, bench)
        save()
    for index, w in enumerate(workloads(args)):
        if index and args.budget is not None and time.perf_counter() - started > args.budget:
            skipped.append(w.key)
            continue
        if not args.skip_check:
            checks += [check(w, name, dtype, device) for name in competitors if name in OURS]
        results += time_workload(w, competitors, args, device, dtype, bench, profiles)
        print(f"timed {w.key} [{time.perf_counter() - started:.0f} s]", flush=True)
        save()
    save()
    if skipped:
        print(f"over the --budget, not timed: {', '.join(skipped)}")
    print_profile(profiles, on_device=device.type == "cuda")
    print_table(results, competitors)
    print(f"JSON: {path}")
    failed = [f"{c['workload']} ({c['backend']})" for c in checks if not c["ok"]] + [
        f"decode B{r['batch']} Tq{r['q_len']} Tk{r['kv_len']}" for r in decode if not r["ok"]] + [
        f"ring N{r['n']} P{r['world']} {r['step']}" for r in ring if not r["ok"]] + [
        f"causal&{r['modifier']} N{r['n']}" for r in mods if not r["ok"]] + [
        r["case"] for r in paged if not r["ok"]]
    if failed:
        print(f"CORRECTNESS FAILED for {', '.join(failed)}: their timings are not to be trusted")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
