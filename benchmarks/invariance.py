"""What the invariance contract costs: ``attnkit.invariant()`` against the default, same calls.

    PYTHONPATH=src python benchmarks/invariance.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/invariance.py --quick    # a smoke run: figures mean nothing
    PYTHONPATH=src python benchmarks/invariance.py --device cuda

Rows (``backend="auto"`` both ways: the default picks torch's fused kernel where it can, the
contract the tiled engine's fixed schedule):

- **prefill**: causal B1 H8 T2048 D64, forward.
- **padded prefill**: causal & right padding, B4 H8 T1024 D64 (lengths 1024, 700, 300, 901).
- **forward+backward**: causal B1 H8 T1024 D64.
- **decoding step**: one query per sequence over a right-padded cache, B8 H8 Tk 1024 D64
  (lengths 64..1024), one ``attention`` call with the key padding a ``KVCache`` makes; and
  the same with grouped queries, Hq 32 over Hkv 8 (a K/V head's four query heads fill the
  rows a kernel call of the contract computes anyway).
- **ragged decode**: ``benchmarks/field.py``'s model (4 layers of ``MultiHeadAttention`` with
  ``KVCache(lengths=)``, 8 prompts of 2..60 tokens, 128 steps), ms per token.

Each pair is checked to agree first (within float32 rounding), then timed interleaved, block
by block; medians and the ratio invariant / default. One CPU thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import attnkit as ak  # noqa: E402
from attnkit.bench.runner import interleaved  # noqa: E402
from attnkit.masks import vouched_padding  # noqa: E402
from field import AttnkitDecode, ragged_workload  # noqa: E402

TARGETS = {"prefill": 1.10, "padded prefill": 1.10, "forward+backward": 1.10,
           "decoding step": 1.20, "ragged decode": 1.20}
"""The cost bounds on invariant / default: 10 % on prefill and training, 20 % on decoding."""


def _pair(case: str, unit: str, scale: float, run: Callable[[bool], torch.Tensor],
          blocks: int) -> dict:
    """Time ``run(invariant)`` both ways after checking they agree: a table row."""
    torch.testing.assert_close(run(True), run(False), rtol=2e-4, atol=2e-5,
                               msg=lambda m: f"{case}: invariant and default differ\n{m}")
    seconds = interleaved({"default": lambda: run(False), "invariant": lambda: run(True)},
                          calls=1, blocks=blocks)
    kind = case.split(",")[0]
    return dict(case=case, unit=unit, default=seconds["default"] * scale,
                invariant=seconds["invariant"] * scale,
                ratio=seconds["invariant"] / seconds["default"], target=TARGETS[kind])


def _sync(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        torch.cuda.synchronize()
    return x


def attention_rows(quick: bool, device: str) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    blocks = 2 if quick else 9
    short = 4 if quick else 1  # quick runs on shorter sequences

    def tensors(b, t, h=8, d=64, grad=False):
        return [torch.randn(b, h, t, d, generator=gen).to(device).requires_grad_(grad)
                for _ in range(3)]

    rows = []
    t = 2048 // short
    q, k, v = tensors(1, t)
    rows.append(_pair(f"prefill, causal B1 H8 T{t} D64", "ms", 1e3, lambda inv: _sync(
        ak.attention(q, k, v, ak.causal(), invariant=inv)), blocks))
    t = 1024 // short
    lengths = torch.tensor([t, t * 700 // 1024, t * 300 // 1024, t * 901 // 1024], device=device)
    q, k, v = tensors(4, t)
    mask = ak.causal() & ak.padding(lengths, lengths)
    rows.append(_pair(f"padded prefill, causal B4 H8 T{t} D64", "ms", 1e3, lambda inv: _sync(
        ak.attention(q, k, v, mask, invariant=inv)), blocks))
    q, k, v = tensors(1, t, grad=True)

    def train(inv: bool) -> torch.Tensor:
        out = ak.attention(q, k, v, ak.causal(), invariant=inv)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        return _sync(torch.cat([g.flatten() for g in grads]))
    rows.append(_pair(f"forward+backward, causal B1 H8 T{t} D64", "ms", 1e3, train, blocks))
    tk = 1024 // short
    keys = tensors(8, tk)
    query = keys[0][:, :, :1].clone()
    lengths = torch.linspace(64 // short, tk, 8, device=device).long()
    cache = vouched_padding(None, lengths, keys_everywhere=True)  # as a KVCache hands it over
    rows.append(_pair(f"decoding step, B8 H8 Tk{tk} D64", "µs", 1e6, lambda inv: _sync(
        ak.attention(query, keys[1], keys[2], cache, invariant=inv)), blocks * 3))
    grouped = torch.randn(8, 32, 1, 64, generator=gen).to(device)
    rows.append(_pair(f"decoding step, GQA B8 Hq32 Hkv8 Tk{tk} D64", "µs", 1e6,
                      lambda inv: _sync(ak.attention(grouped, keys[1], keys[2], cache,
                                                     invariant=inv)), blocks * 3))
    return rows


def ragged_decode(quick: bool, device: str) -> dict:
    layers, prompt, lengths, tokens, capacity, steps, embed = ragged_workload(quick, device)

    def decode(inv: bool) -> torch.Tensor:
        with ak.invariant(inv):
            model = AttnkitDecode(layers, prompt, lengths, capacity)
            return _sync(torch.cat([model.step(tokens[:, s:s + 1]) for s in range(steps)], 1))

    with torch.no_grad():
        return _pair(f"ragged decode, B8 prompts 2..60, {steps} steps, 4 layers E{embed}",
                     "ms/token", 1e3 / (steps + 1), decode, 2 if quick else 7)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: "
                        "checks the script runs, its figures mean nothing")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    rows = [*attention_rows(args.quick, args.device), ragged_decode(args.quick, args.device)]
    print("| case | unit | default | invariant | invariant / default | target |\n"
          "|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['unit']} | {r['default']:.3f} | {r['invariant']:.3f} | "
              f"{r['ratio']:.2f}× | ≤ {r['target']:.2f}× |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "invariance" + ("" if args.device == "cpu" else f"_{args.device}")
    (out / (f"{name}_quick.json" if args.quick else f"{name}.json")).write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
        processor=platform.processor(), torch=torch.__version__, threads=torch.get_num_threads(),
        device=args.device, quick=args.quick, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
