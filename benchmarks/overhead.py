"""Per-call cost of ``attnkit.attention`` on small problems, and a decode loop, against torch SDPA.

    PYTHONPATH=src python benchmarks/overhead.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/overhead.py --quick    # a smoke run: the figures mean nothing

- **Tiny calls**: µs per call of ``attention(q, k, v, mask)`` and of
  ``F.scaled_dot_product_attention`` on the same tensors (B1 H1 T16 D64, and B2 H8 T128 D64),
  forward and forward+backward, without a mask, causal and a sliding window (SDPA: its dense
  bool mask). The two are timed interleaved, block by block, and the medians compared.
- **Work per call** (``--counts``: deterministic, unlike a time on a shared host): Python
  function calls (``cProfile``) and aten operations (a counting dispatch mode) per call of
  the tiny forward calls, attnkit against SDPA.
- **Decode loop**: a 4-layer model (E 256, 4 heads, pre-norm, no MLP) decodes 512 tokens one
  at a time after a 16-token prompt, with ``MultiHeadAttention`` and its ``KVCache``
  (``is_causal`` on and off), against the same weights in a loop on SDPA over a preallocated
  cache written in place: ms per token, medians of interleaved repeats.

One CPU thread (``torch.set_num_threads(1)``): the per-call overhead is Python and dispatch,
which more threads do not shorten; the ratios are what the script reports.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import attnkit as ak  # noqa: E402
from attnkit.bench.runner import interleaved as timed  # noqa: E402
from attnkit.nn import MultiHeadAttention  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def interleaved(fns: dict[str, Callable[[], object]], calls: int, blocks: int) -> dict[str, float]:
    """Median µs per call of each function, timed in alternating blocks of ``calls`` calls."""
    seconds = timed(fns, calls, blocks, warmup=max(calls // 4, 3))
    return {name: s * 1e6 for name, s in seconds.items()}


def tiny_calls(quick: bool) -> list[dict]:
    """µs per call, attnkit against SDPA, for each shape, mask and pass."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, heads, length in ((1, 1, 16), (2, 8, 128)):
        q, k, v = (torch.randn(batch, heads, length, 64, generator=gen) for _ in range(3))
        window = torch.ones(length, length, dtype=torch.bool).tril().triu(-4)
        masks = {"none": (None, {}), "causal": (ak.causal(), {"is_causal": True}),
                 "window": (ak.sliding_window(4), {"attn_mask": window})}
        for mask_name, (mask, sdpa_kwargs) in masks.items():
            for mode in ("fwd", "fwd+bwd"):
                grad = mode == "fwd+bwd"
                leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]

                def ours():
                    out = ak.attention(*leaves, mask)
                    if grad:
                        out.sum().backward()

                def sdpa():
                    out = F.scaled_dot_product_attention(*leaves, **sdpa_kwargs)
                    if grad:
                        out.sum().backward()
                us = interleaved({"attnkit": ours, "sdpa": sdpa}, calls=4 if quick else 300,
                                 blocks=2 if quick else 9)
                rows.append(dict(shape=f"B{batch} H{heads} T{length} D64", mask=mask_name, mode=mode,
                                 attnkit_us=us["attnkit"], sdpa_us=us["sdpa"],
                                 ratio=us["attnkit"] / us["sdpa"]))
    return rows


class _CountOps(TorchDispatchMode):
    """Counts the aten operations run under it (attnkit keeps its caches under such a mode:
    ``masks.keeping``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def work(call: Callable[[], object], calls: int = 50) -> dict:
    """Python function calls and aten operations per ``call()``, after warm-up calls."""
    for _ in range(5):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    with _CountOps() as ops:
        call()
    return dict(python_calls=pstats.Stats(profile).total_calls / calls, aten_ops=ops.count)


def work_per_call() -> list[dict]:
    """:func:`work` of the B1 H1 T16 D64 forward calls of :func:`tiny_calls`, without a grad."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 64, generator=gen) for _ in range(3))
    window = torch.ones(16, 16, dtype=torch.bool).tril().triu(-4)
    masks = {"none": (None, {}), "causal": (ak.causal(), {"is_causal": True}),
             "window": (ak.sliding_window(4), {"attn_mask": window}),
             "padding": (ak.padding(kv_lengths=torch.tensor([9])), {"attn_mask": window[:1]})}
    rows = []
    with torch.no_grad():
        for name, (mask, sdpa_kwargs) in masks.items():
            ours = work(lambda: ak.attention(q, k, v, mask))
            sdpa = work(lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs))
            rows.append(dict(shape="B1 H1 T16 D64", mask=name,
                             **{f"attnkit_{key}": value for key, value in ours.items()},
                             **{f"sdpa_{key}": value for key, value in sdpa.items()}))
    return rows


class SdpaLayer(torch.nn.Module):
    """One attention layer on SDPA with the projections of a ``MultiHeadAttention``, decoding
    into a preallocated cache ``[B, H, capacity, D]`` written in place."""

    def __init__(self, mha: MultiHeadAttention, capacity: int, batch: int):
        super().__init__()
        self.mha = mha
        shape = (batch, mha.num_kv_heads, capacity, mha.head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)

    def forward(self, x: torch.Tensor, position: int, causal: bool) -> torch.Tensor:
        mha, t = self.mha, x.shape[1]
        q = mha.q_proj(x).unflatten(-1, (mha.num_heads, mha.head_dim)).transpose(1, 2)
        k = mha.k_proj(x).unflatten(-1, (mha.num_kv_heads, mha.head_dim)).transpose(1, 2)
        v = mha.v_proj(x).unflatten(-1, (mha.num_kv_heads, mha.head_dim)).transpose(1, 2)
        self.keys[:, :, position:position + t] = k
        self.values[:, :, position:position + t] = v
        out = F.scaled_dot_product_attention(q, self.keys[:, :, :position + t],
                                             self.values[:, :, :position + t],
                                             is_causal=causal and t > 1)
        return mha.out_proj(out.transpose(1, 2).flatten(-2))


def decode_loop(quick: bool) -> list[dict]:
    """ms per decoded token: attnkit ``MultiHeadAttention`` with its cache against an SDPA loop
    with a preallocated cache, same weights; the outputs are checked equal first."""
    torch.manual_seed(0)
    layers, embed, heads, prompt, steps, batch = 4, 256, 4, 16, 8 if quick else 512, 1
    mhas = [MultiHeadAttention(embed, heads) for _ in range(layers)]
    norms = [torch.nn.LayerNorm(embed) for _ in range(layers)]
    tokens = torch.randn(batch, prompt + steps, embed)

    def run_attnkit(causal: bool) -> torch.Tensor:
        caches = [m.empty_cache() for m in mhas]
        outs = []
        for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + steps)]:
            x = tokens[:, start:stop]
            for i, (mha, norm) in enumerate(zip(mhas, norms)):
                out, _, caches[i] = mha(norm(x), cache=caches[i], is_causal=causal)
                x = x + out
            outs.append(x)
        return torch.cat(outs, 1)

    def run_sdpa(causal: bool) -> torch.Tensor:
        sdpa_layers = [SdpaLayer(m, prompt + steps, batch) for m in mhas]
        outs = []
        for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + steps)]:
            x = tokens[:, start:stop]
            for layer, norm in zip(sdpa_layers, norms):
                x = x + layer(norm(x), start, causal)
            outs.append(x)
        return torch.cat(outs, 1)

    rows = []
    with torch.no_grad():
        for causal in (True, False):
            torch.testing.assert_close(run_attnkit(causal), run_sdpa(causal), rtol=1e-4, atol=1e-5)
            ms = interleaved({"attnkit": lambda: run_attnkit(causal), "sdpa": lambda: run_sdpa(causal)},
                             calls=1, blocks=2 if quick else 7)
            per_token = {name: t / 1e3 / (steps + 1) for name, t in ms.items()}
            rows.append(dict(model=f"{layers} layers E{embed} H{heads}, {steps} tokens",
                             is_causal=causal, attnkit_ms=per_token["attnkit"],
                             sdpa_ms=per_token["sdpa"], ratio=ms["attnkit"] / ms["sdpa"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few repeats and tokens: checks the "
                        "script runs, its figures mean nothing")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    parser.add_argument("--counts", action="store_true", help="only the work per call "
                        "(Python calls, aten operations): deterministic, seconds to run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts = work_per_call()
    print(f"{'work per call, forward':28s} {'mask':7s} {'attnkit calls':>13s} {'SDPA calls':>10s} "
          f"{'attnkit ops':>11s} {'SDPA ops':>8s}")
    for r in counts:
        print(f"{r['shape']:28s} {r['mask']:7s} {r['attnkit_python_calls']:13.1f} "
              f"{r['sdpa_python_calls']:10.1f} {r['attnkit_aten_ops']:11d} {r['sdpa_aten_ops']:8d}")
    if args.counts:
        return 0
    tiny, decode = tiny_calls(args.quick), decode_loop(args.quick)
    print(f"{'shape':20s} {'mask':7s} {'pass':8s} {'attnkit µs':>11s} {'SDPA µs':>9s} {'ratio':>6s}")
    for r in tiny:
        print(f"{r['shape']:20s} {r['mask']:7s} {r['mode']:8s} {r['attnkit_us']:11.1f} "
              f"{r['sdpa_us']:9.1f} {r['ratio']:5.2f}×")
    print(f"\n{'decode loop':36s} {'is_causal':9s} {'attnkit ms/token':>16s} {'SDPA ms/token':>13s} {'ratio':>6s}")
    for r in decode:
        print(f"{r['model']:36s} {str(r['is_causal']):9s} {r['attnkit_ms']:16.3f} {r['sdpa_ms']:13.3f} "
              f"{r['ratio']:5.2f}×")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "overhead_quick.json" if args.quick else "overhead.json"
    (out / name).write_text(json.dumps(dict(
        torch=torch.__version__, machine=platform.machine(), processor=platform.processor(),
        threads=1, work=counts, tiny=tiny, decode=decode), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
