"""Packed variable-length batches against what a user would run instead, side by side.

    PYTHONPATH=src python benchmarks/serving.py            # table; JSON to $OUT or results/
    PYTHONPATH=src python benchmarks/serving.py --quick    # a smoke run: the figures mean nothing

- **varlen, 16 documents of 64..1,024 tokens** (H 8, D 64, causal inside each): packed
  ``[total, H, D]`` through ``ak.varlen_attention``, against torch SDPA on the padded batch
  ``[16, H, 1024, D]`` with a dense bool mask (causal & padding), and against the same packed
  row through ``ak.attention`` with ``ak.documents(ids, causal="top_left")`` directly.
  Forward and forward+backward, ms per call.
- **paged decode step, 8 sequences of 512..8,192 keys** (Hq 8, Hkv 2, D 64, block 16): one
  new token per sequence appended and attended, through ``attnkit.nn.PagedKVCache`` against
  the contiguous ``attnkit.nn.KVCache`` fed per-sequence ``lengths``. ms per step.
- **shared prefix decode step, 16 sequences forked from one 4,096-token prompt** (plus 8
  tokens each): the forked ``PagedKVCache`` (the prompt's blocks read once for all) against
  the same tokens in 16 unshared copies of the prompt. ms per step.

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


def checked_steps(step, names: list[str], quick: bool) -> dict[str, float]:
    """Median seconds of ``step(name)`` per name, interleaved, after checking every name's
    step gives the first one's result."""
    first = step(names[0])
    for name in names[1:]:
        torch.testing.assert_close(step(name), first)
    return interleaved({name: lambda n=name: step(n) for name in names},
                       calls=2 if quick else 10, blocks=2 if quick else 5)


def step_row(case: str, seconds: dict[str, float], ratio: str, over: str, under: str) -> dict:
    """A table row of decode steps: ms per step of each name in ``seconds``, and ``ratio`` =
    the time of ``over`` / the time of ``under``."""
    return dict(case=case, unit="ms/step", **{name: t * 1e3 for name, t in seconds.items()},
                **{ratio: seconds[over] / seconds[under]})


def paged_decode_row(quick: bool) -> dict:
    """The timing row of a decode step over a paged and a contiguous cache."""
    from attnkit.nn import KVCache, PagedKVCache

    count, longest, block, heads_kv = (4, 256, 16, 2) if quick else (8, 8192, 16, 2)
    lengths = torch.linspace(longest // 16, longest, count).long()
    gen = torch.Generator().manual_seed(1)
    prompt_k, prompt_v = (torch.randn(count, heads_kv, longest, HEAD_DIM, generator=gen)
                          for _ in range(2))
    q = torch.randn(count, HEADS, 1, HEAD_DIM, generator=gen)
    kv = torch.randn(count, heads_kv, 1, HEAD_DIM, generator=gen)
    steps = 8 if quick else 64  # the most steps timing takes, warm-up included
    caches = {"paged": PagedKVCache(count * (longest // block + steps + 2), block),
              "contiguous": KVCache.empty(longest + steps)}
    caches = {name: cache.append(prompt_k, prompt_v, lengths=lengths)
              for name, cache in caches.items()}

    def step(name: str) -> torch.Tensor:  # one new token per sequence, appended and attended
        cache = caches[name] = caches[name].append(kv, kv)
        if name == "paged":  # what MultiHeadAttention runs on a paged cache
            return cache.attend(q)
        # the public call over the cache's views (MultiHeadAttention runs KVCache.decode,
        # which gives the same bits at these sizes)
        return ak.attention(q, cache.keys, cache.values, cache.mask())

    return step_row(f"paged decode step, {count} sequences {int(lengths[0])}..{longest} keys, "
                    f"Hq{HEADS} Hkv{heads_kv} D{HEAD_DIM}, block {block}",
                    checked_steps(step, list(caches), quick), "ratio", "paged", "contiguous")


def shared_prefix_row(quick: bool) -> dict:
    """The timing row of a decode step over 16 forks of one prompt, shared and unshared."""
    from attnkit.nn import PagedKVCache

    count, prefix, block, heads_kv = (4, 256, 16, 2) if quick else (16, 4096, 16, 2)
    gen = torch.Generator().manual_seed(2)
    prompt = [torch.randn(1, heads_kv, prefix, HEAD_DIM, generator=gen) for _ in range(2)]
    own = [torch.randn(count, heads_kv, 8, HEAD_DIM, generator=gen) for _ in range(2)]
    q = torch.randn(count, HEADS, 1, HEAD_DIM, generator=gen)
    kv = torch.randn(count, heads_kv, 1, HEAD_DIM, generator=gen)
    steps = 8 if quick else 64
    blocks = count * (prefix // block + (8 + steps) // block + 4)
    shared = PagedKVCache(blocks, block).append(*prompt)
    for _ in range(count - 1):
        shared.fork(0)
    unshared = PagedKVCache(blocks, block).append(*(t.expand(count, -1, -1, -1) for t in prompt))
    caches = {"shared": shared.append(*own), "unshared": unshared.append(*own)}

    def step(name: str) -> torch.Tensor:
        return caches[name].append(kv, kv).attend(q)

    return step_row(f"shared prefix decode step, {count} forks of a {prefix}-token prompt, "
                    f"Hq{HEADS} Hkv{heads_kv} D{HEAD_DIM}, block {block}",
                    checked_steps(step, list(caches), quick), "speedup", "unshared", "shared")


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
    paged = paged_decode_row(args.quick)
    print(f"\n| case | unit | PagedKVCache | KVCache | paged / contiguous |"
          f"\n|---|---|---:|---:|---:|"
          f"\n| {paged['case']} | {paged['unit']} | {paged['paged']:.1f} | "
          f"{paged['contiguous']:.1f} | {paged['ratio']:.2f}× |")
    prefix = shared_prefix_row(args.quick)
    print(f"\n| case | unit | shared | unshared | unshared / shared |\n|---|---|---:|---:|---:|"
          f"\n| {prefix['case']} | {prefix['unit']} | {prefix['shared']:.2f} | "
          f"{prefix['unshared']:.2f} | {prefix['speedup']:.2f}× |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("serving_quick.json" if args.quick else "serving.json")).write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.platform(),
        processor=platform.processor(), torch=torch.__version__, threads=torch.get_num_threads(),
        quick=args.quick, rows=rows, paged=paged, shared_prefix=prefix), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
