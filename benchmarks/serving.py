"""Packed variable-length batches against what a user would run instead, side by side.

    PYTHONPATH=src python benchmarks/serving.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/serving.py --quick    # a smoke run: the figures mean nothing

- **varlen, 16 documents of 64..1,024 tokens** (H 8, D 64, causal inside each): packed
  ``[total, H, D]`` through ``ak.varlen_attention``, against torch SDPA on the padded batch
  ``[16, H, 1024, D]`` with a dense bool mask (causal & padding), and against the same packed
  row through ``ak.attention`` with ``ak.documents(ids, causal="top_left")`` directly.
  Forward and forward+backward, ms per call.

Every method is checked against ``varlen_attention`` on the real tokens first, then timed
interleaved, block by block, and the medians compared. One CPU thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import attnkit as ak  # noqa: E402
from attnkit.bench.runner import interleaved  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def varlen_rows(quick: bool) -> list[dict]:
    """Timing rows of the packed batch, forward and forward+backward."""
    count, longest = (4, 128) if quick else (16, 1024)
    lengths = torch.linspace(64, longest, count).long().tolist()
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))
    documents = ak.documents(ids, causal="top_left")
    # the padded batch SDPA needs: [B, H, T, D] and a [B, 1, T, T] bool mask
    real = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
    allowed = (torch.ones(longest, longest, dtype=torch.bool).tril()[None]
               & real[:, None, :] & real[:, :, None])[:, None]
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        grad = mode == "fwd+bwd"
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]

        def packed():
            return ak.varlen_attention(*leaves, cu, mask=ak.causal())

        def direct():
            out = ak.attention(*(t.transpose(0, 1)[None] for t in leaves), documents)
            return out[0].transpose(0, 1)

        def padded():
            qp, kp, vp = (torch.zeros(count, longest, HEADS, HEAD_DIM).index_put((real,), t)
                          for t in leaves)  # [B, T, H, D], differentiable
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qp, kp, vp)),
                                                 attn_mask=allowed)
            return out.transpose(1, 2)[real]  # [total, H, D]: the real tokens

        methods = {"varlen": packed, "documents": direct, "sdpa padded": padded}
        want = packed().detach()
        for name, fn in methods.items():
            torch.testing.assert_close(fn().detach(), want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, n=name: f"{n} differs from varlen\n{m}")

        def timed(fn):
            def call():
                out = fn()
                if grad:
                    out.sum().backward()
            return call
        seconds = interleaved({name: timed(fn) for name, fn in methods.items()},
                              calls=1, blocks=2 if quick else 7)
        rows.append(dict(case=f"varlen {mode}, {count} documents {lengths[0]}..{lengths[-1]}, "
                              f"H{HEADS} D{HEAD_DIM}, causal",
                         unit="ms/call", **{n: s * 1e3 for n, s in seconds.items()},
                         vs_padded=seconds["sdpa padded"] / seconds["varlen"],
                         vs_documents=seconds["varlen"] / seconds["documents"]))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: checks "
                        "the script runs, its figures mean nothing")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = varlen_rows(args.quick)
    print("| case | unit | varlen | ak.documents | SDPA padded + dense mask | padded / varlen "
          "| varlen / documents |\n|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['unit']} | {r['varlen']:.1f} | {r['documents']:.1f} | "
              f"{r['sdpa padded']:.1f} | {r['vs_padded']:.2f}× | {r['vs_documents']:.2f}× |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("serving_quick.json" if args.quick else "serving.json")).write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
        processor=platform.processor(), torch=torch.__version__, threads=torch.get_num_threads(),
        quick=args.quick, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
