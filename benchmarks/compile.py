"""A training step under ``torch.compile`` against the same step run eagerly, per mask kind.

The step: a two-layer pre-norm transformer (attention through ``attnkit.attention`` with the
mask, an MLP), mean-square loss, backward, SGD update; the model and loss are compiled with
``fullgraph=True`` (forward and backward graphs), the optimizer runs eagerly. For each mask:
graph breaks of the model (``torch._dynamo.explain``), the first compiled step's time
(compilation included), then eager and compiled steps interleaved, medians and their ratio.

    python benchmarks/compile.py                 # B 2, T 1024, width 256, 4 heads; JSON to results/
    python benchmarks/compile.py --length 512 --reps 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo
from torch import nn

import attnkit as ak


class Block(nn.Module):
    """Pre-norm attention + MLP; q/k/v are views of one fused projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attended = ak.attention(q, k, v, mask)  # [B, H, T, D]
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.norm2(x))


def masks(batch: int, length: int, heads: int) -> dict:
    """The benchmark's masks: FlexAttention-style workloads at this length, and causal masking
    with score modifiers as models use them (Gemma 2's softcap 50, ALiBi's slopes
    ``2^(−8h/H)``, gpt-oss's sinks)."""
    lengths = torch.tensor([length * 3 // 4, length])[:batch]
    ids = torch.arange(length) // max(1, length // 8)
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    return {
        "causal&softcap": ak.causal() & ak.softcap(50.0),
        "causal&alibi": ak.causal() & ak.alibi(slopes),
        "causal&sinks": ak.causal() & ak.sinks(torch.zeros(heads)),
        "none": None,
        "causal": ak.causal(),
        "window": ak.sliding_window(length // 8),
        "padding": ak.padding(q_lengths=lengths, kv_lengths=lengths),
        "documents&causal": ak.documents(ids) & ak.causal(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7, help="timed steps of each kind per mask")
    parser.add_argument("--masks", default="none,causal,window,padding,documents&causal",
                        help="comma-separated masks to run, in this order")
    parser.add_argument("--out", default="results/compile.json")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = nn.ModuleList(Block(args.width, args.heads) for _ in range(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.length, args.width)
    target = torch.randn_like(x)

    def loss_of(x, target, mask):
        y = x
        for block in model:
            y = block(y, mask)
        return (y - target).pow(2).mean()

    def training_step(loss_fn):
        def step(x, target, mask):
            loss = loss_fn(x, target, mask)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    step = training_step(loss_of)
    rows = []
    workloads = masks(args.batch, args.length, args.heads)
    for name in args.masks.split(","):
        mask = workloads[name]
        torch._dynamo.reset()
        breaks = torch._dynamo.explain(loss_of)(x, target, mask).graph_break_count
        torch._dynamo.reset()
        compiled = training_step(torch.compile(loss_of, fullgraph=True))
        start = time.perf_counter()
        compiled(x, target, mask)
        first = time.perf_counter() - start
        step(x, target, mask)  # warm the eager path (plans, caches)
        eager_times, compiled_times = [], []
        for _ in range(args.reps):  # interleaved: the machine's drift hits both alike
            for fn, times in ((step, eager_times), (compiled, compiled_times)):
                start = time.perf_counter()
                fn(x, target, mask)
                times.append(time.perf_counter() - start)
        eager, fast = statistics.median(eager_times), statistics.median(compiled_times)
        rows.append(dict(mask=name, graph_breaks=breaks, first_call_s=first, eager_ms=eager * 1e3,
                         compiled_ms=fast * 1e3, speedup=eager / fast))
        print(f"{name:18s} breaks {breaks}  first call {first:6.1f} s  eager {eager * 1e3:8.1f} ms  "
              f"compiled {fast * 1e3:8.1f} ms  compiled/eager speed {eager / fast:5.2f}x", flush=True)

    info = dict(machine=platform.processor() or platform.machine(), torch=torch.__version__,
                threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"), **vars(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=2))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
