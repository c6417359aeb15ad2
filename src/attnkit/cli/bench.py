"""``attnkit bench``: time attnkit against torch SDPA, FlexAttention and naive attention, side by
side in one run, and measure peak memory against N; writes JSON and PNGs (see
docs/BENCHMARKS.md for the method and the numbers)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ._common import UsageError, check_output

HELP = "benchmark attnkit vs torch SDPA, FlexAttention and naive attention (time, memory)"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, 1-2 rounds, no Flex compile unless --flex (a smoke test)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="folder for cpu.json and the PNGs (default: results/, "
                             "results/quick/ with --quick)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="only these workloads (dense, causal, window, documents, causal_padding)")
    parser.add_argument("--methods", nargs="+", metavar="NAME",
                        help="only these methods (tiled, auto, sdpa, sdpa_mask, flex, naive); "
                             "tiled is always needed: outputs are checked against it")
    parser.add_argument("--reps", type=int, metavar="N",
                        help="timed rounds per method and cell, at most (default 10; fewer when a "
                             "cell's 20 s budget runs out, never under 2 unless N is 1)")
    flex = parser.add_mutually_exclusive_group()
    flex.add_argument("--flex", dest="flex", action="store_true", default=None,
                      help="include compiled FlexAttention even with --quick")
    flex.add_argument("--no-flex", dest="flex", action="store_false",
                      help="leave out FlexAttention (its compile takes ~30 s per workload)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch.set_num_threads(N) for the run (default: torch's own default, "
                             "recorded in the JSON)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak-memory measurements and the sweep against N")


def options_from(args: argparse.Namespace, command: str = ""):
    """The :class:`attnkit.bench.Options` of parsed arguments; raises :class:`UsageError` for
    bad counts, unknown workloads or methods, and an ``--out`` folder it cannot write in."""
    from ..bench import Options, plots, runner
    from ..bench.workloads import select

    for name in ("reps", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} {value}: give at least 1")
    if args.out is not None and not args.out.strip():
        raise UsageError(f"--out {args.out!r}: empty; give a folder path such as results/ (it "
                         f"is created if missing), or leave --out out for the default")
    if args.flex and args.methods and "flex" not in args.methods:
        raise UsageError(f"--flex with --methods {' '.join(args.methods)}: FlexAttention runs "
                         f"only as a method; add flex to --methods, or leave --flex out")
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > cores:
        raise UsageError(f"--threads {args.threads}: this machine has {cores} cores; give at "
                         f"most {cores}")
    options = Options(quick=args.quick, out=args.out, workloads=args.workloads,
                      methods=args.methods, reps=args.reps, flex=args.flex, memory=args.memory,
                      threads=args.threads, command=command or "attnkit bench")
    try:
        select(runner.quick_workloads() if args.quick else runner.standard_workloads(),
               args.workloads)
    except ValueError as error:
        raise UsageError(f"--workloads: {error}") from None
    try:
        options.settings()
    except ValueError as error:
        message = str(error)
        raise UsageError(message if message.startswith("--") else f"--methods: {message}") from None
    check_output("--out", options.out_dir(), "cpu.json", *plots.FIGURES)
    return options


def run(args: argparse.Namespace, console) -> int:
    from rich.markup import escape

    from ..bench import plots, runner

    command = "attnkit " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == [
        "bench"] else "attnkit bench"
    options = options_from(args, command)
    results = runner.run_benchmark(options, console=console)
    runner.print_report(results, console)
    out_dir = options.out_dir()
    path = runner.write_results(results, out_dir)
    left_out = plots.left_out(results)
    stale = [name for name in left_out if os.path.isfile(os.path.join(out_dir, name))]
    figures = plots.write_all(results, out_dir)  # removes the stale ones
    console.print(escape(f"results: {path}; figures: {', '.join(figures) or 'none'}"))
    for name, reason in left_out.items():
        removed = f"; removed {name} from an earlier run in {out_dir}" if name in stale else ""
        console.print(escape(f"not written: {name}: {reason}{removed}"))
    mismatched = [f"{r['workload']}/{r['pass']}/{r['method']}" for r in results["results"]
                  if r["status"] == "mismatch"]
    if mismatched:
        console.print(f"[bold red]outputs that disagree with attnkit tiled:[/bold red] "
                      f"{', '.join(mismatched)}")
    return 0
