"""Score modifiers on CPU: ALiBi, T5 relative biases and softcap under causal masking, attnkit
against the alternatives.

    PYTHONPATH=src python benchmarks/modifiers.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/modifiers.py --quick    # a smoke run: the figures mean nothing
    PYTHONPATH=src python benchmarks/modifiers.py --decode   # few queries, no mask: tiled vs torch

- **Time** (float32, B1 H8 D64, N 4096 and 8192; forward, and forward+backward of q, k and v):
  ``attention(q, k, v, causal() & alibi(slopes))``, ``causal() & relative_bias(table)`` and
  ``causal() & softcap(30)`` (``backend="auto"``; slopes and table fixed, as constants) against
  FlexAttention compiled with the same ``score_mod`` and a causal block mask (the relative bias
  read, as attnkit reads it, from one precomputed vector per head indexed by ``kv − q``;
  forward only: FlexAttention has no backward on CPU) and, for ALiBi and the relative bias,
  SDPA with the bias and the causal mask materialised as one float ``[H, N, N]`` tensor (built
  before timing). SDPA cannot express a softcap: for its forward+backward the comparison is
  plain PyTorch math on the materialised scores (N 4096 only: it holds several ``H·N²``
  tensors). Each method runs once untimed (compiling, and the agreement check: the largest
  difference from attnkit's output, and of q's gradient for forward+backward), then the
  methods run in turn, ``repeats`` rounds; medians, and each method's time over attnkit's
  (above 1: attnkit is faster).
- **Memory** (N 8192 and 16384, one forward, no grad, each in a fresh process): the peak resident set
  during the call over the resident set before it (the kernel's peak counter reset first, by
  writing 5 to ``/proc/self/clear_refs``; the output, ``H·N·D·4`` bytes, included), for
  causal alone, causal & ALiBi and causal & relative_bias, against the ``H·N²·4`` bytes a
  materialised bias would take.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import attnkit as ak  # noqa: E402

HEADS, DIM, CAP, BUCKETS = 8, 64, 30.0, 32
MODIFIERS = ("alibi", "relative", "softcap")


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for ``heads`` heads (a power of two): ``2^(−8·h/heads)``."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


def relative_table(heads: int) -> torch.Tensor:
    """A T5 relative-bias table ``[H, BUCKETS]`` with values of a trained model's size."""
    return torch.randn(heads, BUCKETS, generator=torch.Generator().manual_seed(3)) * 2.0


def methods(modifier: str, n: int, backward: bool,
            ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each competitor's attention of ``x`` (as q, k and v) under causal & ``modifier``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pos = torch.arange(n)
    if modifier == "alibi":
        slopes = alibi_slopes(HEADS)
        mask = ak.causal() & ak.alibi(slopes)
        by_distance = slopes[:, None] * torch.arange(-(n - 1), n).float()  # [H, 2N − 1]
    elif modifier == "relative":
        table = relative_table(HEADS)
        mask = ak.causal() & ak.relative_bias(table)
        by_distance = table[:, ak.t5_buckets(torch.arange(-(n - 1), n), BUCKETS)]  # [H, 2N − 1]
    else:
        mask = ak.causal() & ak.softcap(CAP)
        by_distance = None

    if modifier == "alibi":
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
    elif modifier == "relative":
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + by_distance[h, kv_idx - q_idx + n - 1]
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return CAP * torch.tanh(score / CAP)
    found = {"attnkit": lambda x: ak.attention(x, x, x, mask)}
    if not backward:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                       n, n, device="cpu")
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        found["flex"] = lambda x: flex(x, x, x, score_mod=score_mod, block_mask=block_mask)
    if by_distance is not None:
        bias = by_distance[:, pos[None, :] - pos[:, None] + n - 1]  # [H, N, N]
        bias = bias.masked_fill(pos[None, :] > pos[:, None], -math.inf)
        found["sdpa+bias"] = lambda x: F.scaled_dot_product_attention(x, x, x, attn_mask=bias)
    elif backward and n <= 4096:
        future = pos[None, :] > pos[:, None]  # [N, N]

        def math_softcap(x):
            scores = CAP * torch.tanh(x @ x.transpose(-1, -2) / (math.sqrt(DIM) * CAP))
            return torch.softmax(scores.masked_fill(future, -math.inf), -1) @ x
        found["math"] = math_softcap
    return found


def _call(fn: Callable, q: torch.Tensor, grad: Optional[torch.Tensor]):
    """One timed call: the forward under no_grad, or forward and backward of ``grad`` →
    ``(out, dq)``."""
    if grad is None:
        with torch.no_grad():
            return fn(q), None
    x = q.detach().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


def time_rows(lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    for modifier in MODIFIERS:
        for n in lengths:
            q = torch.randn(1, HEADS, n, DIM, generator=torch.Generator().manual_seed(n))
            for backward in (False, True):
                grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) \
                    if backward else None
                fns = methods(modifier, n, backward)
                row = dict(modifier=modifier, n=n, pass_="fwd+bwd" if backward else "fwd",
                           errors={}, first_s={})
                reference = None
                for name, fn in fns.items():  # first calls: compile, and the agreement check
                    start = time.perf_counter()
                    out, dq = _call(fn, q, grad)
                    row["first_s"][name] = time.perf_counter() - start
                    if reference is None:
                        reference = (out, dq)
                    row["errors"][name] = max(
                        float((out - reference[0]).abs().max()),
                        0.0 if dq is None else float((dq - reference[1]).abs().max()))
                samples = {name: [] for name in fns}
                for _ in range(repeats):
                    for name, fn in fns.items():
                        start = time.perf_counter()
                        _call(fn, q, grad)
                        samples[name].append(time.perf_counter() - start)
                row["ms"] = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
                row["speedup"] = {name: row["ms"][name] / row["ms"]["attnkit"]
                                  for name in fns if name != "attnkit"}
                rows.append(row)
                cells = "  ".join(f"{name} {ms:.0f} ms" for name, ms in row["ms"].items())
                ratios = "  ".join(f"vs {name} {x:.2f}×" for name, x in row["speedup"].items()) \
                    or "no other method"
                errors = " ".join(f"{e:.1e}" for e in row["errors"].values())
                print(f"causal&{modifier:8s} N{n:6d} {row['pass_']:7s}  {cells}  |  {ratios}  "
                      f"|  diff {errors}", flush=True)
    return rows


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_child(kind: str, n: int, conn) -> None:
    """In a fresh process: the peak growth of the resident set (bytes) during one forward under
    ``kind``."""
    torch.set_num_threads(1)
    small = torch.randn(1, HEADS, 256, DIM)
    masks = {"causal": ak.causal(), "causal&alibi": ak.causal() & ak.alibi(alibi_slopes(HEADS)),
             "causal&relative_bias": ak.causal() & ak.relative_bias(relative_table(HEADS))}
    with torch.no_grad():
        ak.attention(small, small, small, masks[kind])  # warm-up: thread pools, lazy kernels
        q = torch.randn(1, HEADS, n, DIM)
        Path("/proc/self/clear_refs").write_text("5")  # the peak counter restarts here
        before = _status_kib("VmRSS")
        out = ak.attention(q, q, q, masks[kind])
        after = _status_kib("VmHWM")
        del out
    conn.send((after - before) * 1024)


def memory_rows(lengths: list[int]) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for n, kind in ((n, kind) for n in lengths
                    for kind in ("causal", "causal&alibi", "causal&relative_bias")):
        parent, child = context.Pipe()
        process = context.Process(target=_peak_child, args=(kind, n, child))
        process.start()
        grown = parent.recv()
        process.join()
        rows.append(dict(mask=kind, n=n, extra_mib=grown / 2**20,
                         dense_bias_mib=HEADS * n * n * 4 / 2**20))
        print(f"memory {kind:22s} N{n}: +{grown / 2**20:.1f} MiB (a materialised bias: "
              f"{HEADS * n * n * 4 / 2**20:.0f} MiB)", flush=True)
    return rows


def decode_rows(key_lengths: list[int], query_counts: list[int], repeats: int) -> list[dict]:
    """Few queries against many keys, no mask (a decoding step, or a short chunk of one), with
    ALiBi (bottom-right) or a T5 relative bias, fixed: the tiled engine against the torch
    backend (the bias built), and what ``auto`` picks. B1 H8 D64, float32, forward."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    modifiers = {"alibi": ak.alibi(alibi_slopes(HEADS), "bottom_right"),
                 "relative": ak.relative_bias(relative_table(HEADS))}
    for kind, modifier in modifiers.items():
        for tk in key_lengths:
            for tq in query_counts:
                q = torch.randn(1, HEADS, tq, DIM, generator=gen)
                k, v = (torch.randn(1, HEADS, tk, DIM, generator=gen) for _ in range(2))
                calls = {b: (lambda b=b: ak.attention(q, k, v, modifier, backend=b))
                         for b in ("tiled", "torch")}
                diff = float((calls["tiled"]() - calls["torch"]()).abs().max())
                times = {b: [] for b in calls}
                for _ in range(repeats):
                    for b, call in calls.items():
                        start = time.perf_counter()
                        call()
                        times[b].append(time.perf_counter() - start)
                us = {b: statistics.median(t) * 1e6 for b, t in times.items()}
                picked = ak.explain_dispatch(q, k, v, modifier).backend
                rows.append(dict(modifier=kind, tq=tq, tk=tk, us=us, auto=picked, diff=diff,
                                 torch_speedup=us["tiled"] / us["torch"]))
                print(f"decode {kind:8s} Tq {tq:4d} Tk {tk:5d}  tiled {us['tiled']:8.0f} us  "
                      f"torch {us['torch']:8.0f} us  torch/tiled speed "
                      f"{us['tiled'] / us['torch']:5.2f}x  auto: {picked}  diff {diff:.1e}",
                      flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script only")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    parser.add_argument("--decode", action="store_true",
                        help="only the decoding rows (few queries, no mask): tiled against torch")
    args = parser.parse_args(argv)
    lengths, repeats, memory_n = (([256], 2, [1024]) if args.quick
                                  else ([4096, 8192], args.repeats, [8192, 16384]))
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "quick": args.quick, "repeats": repeats,
            "command": " ".join(["python", "benchmarks/modifiers.py", *(argv or sys.argv[1:])])}
    print(f"{info['date']}  torch {info['torch']}  {info['threads']} threads", flush=True)
    if args.decode:
        keys, queries = ([256], [1, 32]) if args.quick else ([2048, 8192], [1, 4, 16, 64, 256])
        result = {"info": info, "decode": decode_rows(keys, queries, max(repeats, 3) * 4)}
        name = "modifiers_decode"
    else:
        result = {"info": info, "time": time_rows(lengths, repeats),
                  "memory": memory_rows(memory_n)}
        name = "modifiers"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"{name}_quick.json" if args.quick else f"{name}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
