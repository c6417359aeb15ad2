"""Sequence parallelism on CPU: time, per-rank peak memory and bytes sent against world size
(gloo, local processes): ring attention in both layouts, Ulysses and their hybrid side by
side.

    python benchmarks/ring.py                          # P = 1, 2, 4 → results/ring.json
    python benchmarks/ring.py --worlds 1 2 --seq 2048  # any size; --help for the options
    python benchmarks/ring.py --mask documents --worlds 2 4   # packed documents, + balanced

Every world size runs in its own group of processes (``attnkit.distributed.spawn``); within it
the ring's two layouts, ``ulysses_attention`` (where P divides H) and ``hybrid_attention`` on
a (2, P/2) mesh (P ≥ 4) are measured on the same causal problem ``[B, H, T, D]`` (float32), the sequence sharded P ways. Per mode and world
size:

- time of the forward and of forward+backward: the median over ``--repeats`` of the slowest
  rank's time (ranks start together after a barrier), after one untimed warm-up call;
- per-rank peak memory: growth of the resident set over one forward+backward, the shards
  created inside the measurement (``attnkit.distributed.PeakMemory``: real pages, glibc made
  to hand big blocks back on free so nothing is reused unseen);
- tiles each rank computed (the ring's work balance) and the bytes it sent over forward and
  backward (the ring counts them as it sends; Ulysses' are ``ulysses_bytes`` and the
  hybrid's ``hybrid_bytes``, computed).

``--mask documents``: causal packed documents (log-normal lengths, ``packed_ids``) instead of
plain causal, and the ring also over ``plan_balance``'s layout for that mask (``balanced``),
whose work the zigzag layout does not even out.

The P = 1 run also times ``attnkit.attention(backend="tiled")`` on the whole sequence: the
same engine without the ring. Each rank uses ``--threads`` intra-op threads (default 1) and the
ranks share the machine's cores, so on a 2-core machine no run can be more than 2× faster
than one process, and P = 4 runs two ranks per core: this measures the ring's overhead and its
memory, not a cluster's speed-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import attnkit as ak
from attnkit.bench.workloads import packed_ids
from attnkit.distributed import (LAYOUTS, PeakMemory, RingStats, hybrid_attention, hybrid_bytes,
                                 plan_balance, ring_attention, spawn, ulysses_attention,
                                 ulysses_bytes)

RESULTS = Path(__file__).resolve().parent.parent / "results" / "ring.json"


def _timed(fn) -> float:
    """Seconds until the slowest rank finishes ``fn`` (all ranks start after a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _worker(rank: int, world: int, config: dict) -> dict:
    meter = PeakMemory()  # first, before any big allocation (see its docstring)
    b, h, t, d = config["batch"], config["heads"], config["seq"], config["dim"]
    gen = torch.Generator().manual_seed(rank)
    mask = _mask(config)

    def inputs(length):
        return [torch.randn(b, h, length, d, generator=gen, requires_grad=True) for _ in range(3)]

    results = {}
    layouts = {name: name for name in LAYOUTS}
    if config["mask"] == "documents":
        layouts["balanced"] = plan_balance(mask, t, world, tile=64)
    modes = {name: (lambda q, k, v, stats=None, layout=layout:
                    ring_attention(q, k, v, mask, layout=layout, stats=stats))
             for name, layout in layouts.items()}
    if h % world == 0:
        modes["ulysses"] = lambda q, k, v, stats=None: ulysses_attention(q, k, v, mask)
    mesh_shape = (2, world // 2)
    if world >= 4 and world % 2 == 0 and h % mesh_shape[1] == 0:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape)
        modes["hybrid"] = lambda q, k, v, stats=None: hybrid_attention(q, k, v, mask, mesh=mesh,
                                                                       stats=stats)
    for mode, attend in modes.items():
        q, k, v = inputs(t // world)
        grad = torch.randn(b, h, t // world, d, generator=gen)

        def forward():
            return attend(q, k, v)

        def forward_backward():
            forward().backward(grad)

        forward_backward()  # warm-up: kernels set up, library code paged in
        fwd = [_timed(forward) for _ in range(config["repeats"])]
        fwd_bwd = [_timed(forward_backward) for _ in range(config["repeats"])]
        del q, k, v, grad
        stats = RingStats()
        with meter:
            q, k, v = inputs(t // world)
            out = attend(q, k, v, stats)
            out.backward(torch.ones_like(out))
            del q, k, v, out
        shape = (b, h, t // world, d)
        if mode in ("ulysses", "hybrid"):
            sent = (ulysses_bytes(shape, shape, shape, world, 4) if mode == "ulysses"
                    else hybrid_bytes(shape, shape, shape, mesh_shape, 4))
            tiles, bytes_sent = None, sent["forward"] + sent["backward"]
        else:
            tiles, bytes_sent = stats.forward_tiles, stats.bytes_sent
        results[mode] = dict(forward_s=statistics.median(fwd),
                             forward_backward_s=statistics.median(fwd_bwd),
                             peak_bytes=meter.peak, tiles=tiles, bytes_sent=bytes_sent)
    if world == 1:  # the same engine on the whole sequence, no ring around it
        q, k, v = inputs(t)
        grad = torch.randn(b, h, t, d, generator=gen)

        def plain():
            ak.attention(q, k, v, mask, backend="tiled").backward(grad)

        plain()
        results["tiled"] = dict(forward_s=statistics.median(
            _timed(lambda: ak.attention(q, k, v, mask, backend="tiled")) for _ in range(config["repeats"])),
            forward_backward_s=statistics.median(_timed(plain) for _ in range(config["repeats"])))
    return results


def _mask(config: dict):
    """The benchmark's mask: causal, or causal packed documents of the whole sequence."""
    if config["mask"] == "causal":
        return ak.causal()
    ids = packed_ids(config["seq"], low=64, high=config["seq"] // 2, median=config["seq"] / 16,
                     sigma=1.0, seed=0)
    return ak.documents(ids[None], causal="top_left")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/ring.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per rank (default 1: on a shared machine extra "
                             "threads mostly wait for each other)")
    parser.add_argument("--mask", choices=("causal", "documents"), default="causal",
                        help="plain causal, or causal packed documents (adds the balanced "
                             "layout)")
    parser.add_argument("--out", default=None, help="JSON path (default results/ring.json, "
                        "results/ring_documents.json with --mask documents)")
    args = parser.parse_args(argv)
    config = dict(batch=args.batch, heads=args.heads, seq=args.seq, dim=args.dim, repeats=args.repeats,
                  threads_per_rank=args.threads, mask=args.mask)
    for world in args.worlds:
        if args.seq % (2 * world):
            parser.error(f"--seq {args.seq} must be a multiple of 2·P = {2 * world} (zigzag)")
    load_before = _load()
    runs = {}
    for world in args.worlds:
        started = time.perf_counter()
        runs[world] = spawn(_worker, world, config, threads=args.threads)
        print(f"P={world}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    rows = []
    for layout in (*LAYOUTS, "balanced", "ulysses", "hybrid"):
        for world in args.worlds:
            if layout not in runs[world][0]:
                continue
            per_rank = [r[layout] for r in runs[world]]
            rows.append(dict(
                layout=layout, world_size=world,
                forward_s=per_rank[0]["forward_s"], forward_backward_s=per_rank[0]["forward_backward_s"],
                peak_mib_per_rank=[round(r["peak_bytes"] / 2**20, 1) for r in per_rank],
                tiles_per_rank=[r["tiles"] for r in per_rank],
                mib_sent_per_rank=[round(r["bytes_sent"] / 2**20, 1) for r in per_rank]))
    baseline = runs[1][0]["tiled"] if 1 in runs else None

    header = (f"{'layout':<11} {'P':>2} {'fwd s':>7} {'fwd+bwd s':>10} {'peak MiB/rank (max)':>20} "
              f"{'P·peak / peak(P=1)':>19} {'tiles max/min':>14} {'MiB sent/rank':>14}")
    print(f"\nring attention, Ulysses and hybrid (mesh 2 × P/2), {args.mask}, float32 [B={args.batch}, H={args.heads}, T={args.seq}, "
          f"D={args.dim}], gloo on {os.cpu_count()} CPUs, {args.threads} thread(s) per rank; "
          f"load average {load_before}")
    print(header)
    print("-" * len(header))
    for row in rows:
        peak = max(row["peak_mib_per_rank"])
        one = next((r for r in rows if r["layout"] == row["layout"] and r["world_size"] == 1), None)
        scaled = f"{peak * row['world_size'] / max(one['peak_mib_per_rank']):.2f}" if one else "-"
        tiles = row["tiles_per_rank"]
        spread = "-" if None in tiles else f"{max(tiles) / max(1, min(tiles)):.2f}"
        print(f"{row['layout']:<11} {row['world_size']:>2} {row['forward_s']:>7.3f} "
              f"{row['forward_backward_s']:>10.3f} {peak:>20.1f} {scaled:>19} "
              f"{spread:>14} {max(row['mib_sent_per_rank']):>14.1f}")
    if baseline:
        print(f"{'(no ring)':<11} {1:>2} {baseline['forward_s']:>7.3f} {baseline['forward_backward_s']:>10.3f}"
              f"   ← attention(backend='tiled') on the whole sequence, same process count as P=1")

    document = dict(
        benchmark="ring attention, Ulysses and hybrid (attnkit.distributed), CPU, gloo",
        command=" ".join(["python", "benchmarks/ring.py", *(argv if argv is not None else sys.argv[1:])]),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), python=platform.python_version(),
                     torch=torch.__version__, cpus=os.cpu_count(),
                     cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                     load_average_before=load_before, load_average_after=_load()),
        config=dict(config, dtype="float32"), rows=rows, tiled_no_ring=baseline,
        notes="time: median over repeats of the slowest rank; peak: per-rank resident-set growth "
              "over one forward+backward with the shards created inside; shared machine: noisy")
    out = Path(args.out or (RESULTS if args.mask == "causal"
                            else RESULTS.with_name("ring_documents.json")))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
