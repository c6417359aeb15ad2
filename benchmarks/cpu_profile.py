"""Where the tiled engine's forward time goes, against compiled FlexAttention, in one process.

For each structured workload of issue 3 (B1 H4 N8192 D64 fp32, 1 thread): ``backend="tiled"``
and compiled FlexAttention timed interleaved (median of ``--rounds``), and the self time of
torch's fused CPU kernel inside tiled (``torch.profiler``, median of 3 profiled calls). Prints
the ratio to Flex, the kernel's share of tiled's time, and the ratio tiled would reach with no
overhead at all (Flex time / kernel time)::

    python benchmarks/cpu_profile.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import attnkit as ak  # noqa: E402

KERNEL = "flash_attention_for_cpu"


def cases(n: int):
    """Workload name → (attnkit mask, the same mask as a FlexAttention ``mask_mod``)."""
    ids = torch.arange(n) // 512
    real = n * 3 // 4
    return {
        "window": (ak.sliding_window(512), lambda b, h, q, kv: (q >= kv) & (q - kv <= 512)),
        "documents": (ak.documents(ids) & ak.causal(), lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)),
        "causal_padding": (ak.causal() & ak.padding(q_lengths=[real], kv_lengths=[real]),
                           lambda b, h, q, kv: (q >= kv) & (q < real) & (kv < real)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n", type=int, default=8192)
    args = parser.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, args.n, 64, generator=gen) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    for name, (mask, mask_mod) in cases(args.n).items():
        block_mask = create_block_mask(mask_mod, None, None, args.n, args.n, device="cpu")
        fns = {"tiled": lambda: ak.attention(q, k, v, mask, backend="tiled"),
               "flex": lambda: flex(q, k, v, block_mask=block_mask)}
        for fn in fns.values():  # compile, plan, warm
            fn()
            fn()
        times = {key: [] for key in fns}
        kernel = []
        for round_ in range(args.rounds):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
            if round_ < 3:
                with torch.profiler.profile() as prof:
                    fns["tiled"]()
                kernel.append(sum(e.self_cpu_time_total for e in prof.key_averages()
                                  if KERNEL in e.key) / 1e3)
        tiled_ms = statistics.median(times["tiled"]) * 1e3
        flex_ms = statistics.median(times["flex"]) * 1e3
        kernel_ms = statistics.median(kernel)
        print(f"{name:15s} tiled {tiled_ms:7.1f} ms  flex {flex_ms:7.1f} ms  -> {flex_ms / tiled_ms:.2f}x;"
              f"  torch kernel {kernel_ms:6.1f} ms ({100 * kernel_ms / tiled_ms:3.0f}% of tiled)"
              f"  -> {flex_ms / kernel_ms:.2f}x with no overhead", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
