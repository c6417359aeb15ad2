"""Where the tiled engine's forward time goes, against compiled FlexAttention, in one process.

For each structured workload of ``attnkit bench`` (``bench.workloads``: B1 H4 N8192 D64 fp32;
1 thread): ``backend="tiled"``
and compiled FlexAttention timed interleaved (median of ``--rounds``), and the self time of
torch's fused CPU kernel inside tiled (``torch.profiler``, median of 3 profiled calls). Prints
the ratio to Flex, the kernel's share of tiled's time, and the ratio tiled would reach with no
overhead at all (Flex time / kernel time)::

    python benchmarks/cpu_profile.py [--rounds 10]

``--vs-sdpa`` instead bounds the ratio to SDPA with the dense mask: tiled and SDPA-dense timed
interleaved with torch's fused kernel at its best time per score pair (no mask, one square call
of the workload's B, H, D at N 4096; the fastest of three such calls per round) — no engine built on
that kernel can beat SDPA-dense by more than ``t_sdpa_dense / (allowed pairs × best time per
pair)`` = (N² / allowed pairs) × (SDPA-dense's time per pair / the kernel's best).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnkit import attention  # noqa: E402
from attnkit.bench.workloads import standard_workloads  # noqa: E402

KERNEL = "flash_attention_for_cpu"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--vs-sdpa", action="store_true",
                        help="bound the ratio to SDPA with a dense mask by the kernel's best speed")
    args = parser.parse_args(argv)
    if args.vs_sdpa:
        return vs_sdpa(args.rounds)
    from torch.nn.attention.flex_attention import flex_attention

    torch.set_num_threads(1)
    flex = torch.compile(flex_attention, dynamic=False)
    for workload in standard_workloads():
        if workload.kind not in ("window", "documents", "causal_padding"):
            continue
        q, k, v = workload.inputs()
        mask, block_mask = workload.attnkit_mask(), workload.block_mask()
        fns = {"tiled": lambda: attention(q, k, v, mask, backend="tiled"),
               "flex": lambda: flex(q, k, v, block_mask=block_mask)}
        for fn in fns.values():  # compile, plan, warm
            fn()
            fn()
        times = {key: [] for key in fns}
        kernel = []
        for round_ in range(args.rounds):
            for key, fn in fns.items():
                times[key].append(_timed(fn))
            if round_ < 3:
                with torch.profiler.profile() as prof:
                    fns["tiled"]()
                kernel.append(sum(e.self_cpu_time_total for e in prof.key_averages()
                                  if KERNEL in e.key) / 1e3)
        tiled_ms = statistics.median(times["tiled"]) * 1e3
        flex_ms = statistics.median(times["flex"]) * 1e3
        kernel_ms = statistics.median(kernel)
        print(f"{workload.name:15s} tiled {tiled_ms:7.1f} ms  flex {flex_ms:7.1f} ms  -> {flex_ms / tiled_ms:.2f}x;"
              f"  torch kernel {kernel_ms:6.1f} ms ({100 * kernel_ms / tiled_ms:3.0f}% of tiled)"
              f"  -> {flex_ms / kernel_ms:.2f}x with no overhead", flush=True)
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def vs_sdpa(rounds: int) -> int:
    """Per structured workload: tiled vs SDPA with the dense mask (interleaved medians), and the
    ratio an engine running every allowed pair at torch's best per-pair speed would reach."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    for workload in standard_workloads():
        if workload.kind not in ("window", "documents", "causal_padding"):
            continue
        q, k, v = workload.inputs()
        mask, dense = workload.attnkit_mask(), workload.dense_mask()
        probe = min(workload.seq_len, 4096)
        small = [t[:, :, :probe] for t in (q, k, v)]

        def best():
            return min(_timed(lambda: F.scaled_dot_product_attention(*small)) for _ in range(3))
        fns = {"tiled": lambda: attention(q, k, v, mask, backend="tiled"),
               "sdpa_dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
               "best": best}
        times = {key: [] for key in fns}
        for fn in fns.values():
            fn()
        for _ in range(max(3, rounds // 3)):
            for key, fn in fns.items():
                times[key].append(fn() if key == "best" else _timed(fn))
        ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        batch, heads, n, _ = workload.shape
        allowed = int(dense.sum()) * batch * heads
        best_ns = ms["best"] * 1e6 / (batch * heads * probe * probe)
        bound = ms["sdpa_dense"] / (allowed * best_ns * 1e-6)
        print(f"{workload.name:15s} tiled {ms['tiled']:7.1f} ms  SDPA dense {ms['sdpa_dense']:7.1f} ms"
              f"  -> {ms['sdpa_dense'] / ms['tiled']:.2f}x;  allowed pairs {allowed / 1e6:.1f} M;"
              f" ns/pair: tiled {ms['tiled'] * 1e6 / allowed:.2f}, SDPA dense"
              f" {ms['sdpa_dense'] * 1e6 / (batch * heads * n * n):.2f}, kernel at best {best_ns:.2f}"
              f"  -> at most {bound:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
