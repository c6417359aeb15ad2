"""Work balance of ring attention's layouts on packed documents (no cluster needed).

    PYTHONPATH=src python benchmarks/balance.py               # 3 batches of 1M tokens
    PYTHONPATH=src python benchmarks/balance.py --help        # sizes, seeds, block

Each batch packs documents whose lengths are log-normal (``--median``, ``--sigma``) clipped to
``[--low, --high]`` into ``--length`` positions (the last document cut to fit), causal inside
each document: ``documents(ids, causal="top_left")``. For every world size P the table gives
max/mean per-rank work for the balanced layout (``plan_balance``) and for zigzag, both counted by
the same model (:mod:`attnkit.distributed.balance`: a rank's queries against all keys, the
non-EMPTY ``tile × tile`` tiles of the mask's block map): the mean and the worst over the
batches. Also the balanced layout's block and runs per rank (each run is one query piece of a
ring step) and the seconds ``plan_balance`` took (block map included).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import attnkit as ak
from attnkit.bench.workloads import packed_ids
from attnkit.distributed import plan_balance, rank_work


def imbalance(work: torch.Tensor) -> float:
    """max/mean of per-rank work ``[P]``."""
    return float(work.max()) * work.numel() / float(work.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=1 << 20, help="tokens per batch")
    parser.add_argument("--batches", type=int, default=3, help="batches (seeds 0, 1, ...)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--tile", type=int, default=128, help="positions per side of a tile")
    parser.add_argument("--block", type=int, default=None,
                        help="positions per query block (default: default_block())")
    parser.add_argument("--low", type=int, default=1024, help="shortest document")
    parser.add_argument("--high", type=int, default=131072, help="longest document")
    parser.add_argument("--median", type=float, default=8192, help="log-normal median")
    parser.add_argument("--sigma", type=float, default=1.5, help="log-normal sigma")
    args = parser.parse_args()

    results: dict[int, dict[str, list[float]]] = {
        world: {"balanced": [], "zigzag": [], "runs": [], "seconds": [], "block": []}
        for world in args.worlds}
    for seed in range(args.batches):
        ids = packed_ids(args.length, args.low, args.high, args.median, args.sigma, seed)
        mask = ak.documents(ids, causal="top_left")
        print(f"batch {seed}: {int(ids.max()) + 1} documents, longest "
              f"{int(torch.bincount(ids).max())}")
        for world in args.worlds:
            start = time.perf_counter()
            layout = plan_balance(mask, args.length, world, tile=args.tile, block=args.block)
            seconds = time.perf_counter() - start
            zigzag = rank_work(mask, args.length, "zigzag", world, args.tile)
            assert int(zigzag.sum()) == int(layout.work.sum()), "zigzag chunks must be whole tiles"
            row = results[world]
            row["balanced"].append(layout.imbalance)
            row["zigzag"].append(imbalance(zigzag))
            row["runs"].append(sum(len(runs) for runs in layout.runs) / world)
            row["seconds"].append(seconds)
            row["block"].append(layout.block)

    print(f"\n{args.batches} batches of {args.length} tokens, documents log-normal (median "
          f"{args.median:g}, sigma {args.sigma:g}) clipped to [{args.low}, {args.high}], causal "
          f"inside each; tile {args.tile}; max/mean per-rank work, mean (worst) over batches\n")
    print("| P | balanced | zigzag | block | runs per rank (balanced) | plan_balance() s |")
    print("|--:|--:|--:|--:|--:|--:|")
    for world, row in results.items():
        print(f"| {world} | {np.mean(row['balanced']):.4f} ({max(row['balanced']):.4f}) | "
              f"{np.mean(row['zigzag']):.2f} ({max(row['zigzag']):.2f}) | {row['block'][0]} | "
              f"{np.mean(row['runs']):.1f} | {np.mean(row['seconds']):.1f} |")


if __name__ == "__main__":
    main()
