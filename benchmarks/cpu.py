"""The full CPU benchmark: ``python benchmarks/cpu.py`` runs ``attnkit bench`` (same options),
writes ``results/cpu.json`` and the PNGs, and rewrites the results section of
docs/BENCHMARKS.md (between ``<!-- results:start -->`` and ``<!-- results:end -->``) with the
tables, the machine, the date, the thread count and the exact command.

    python benchmarks/cpu.py                 # full run (~10 min on 2 cores)
    python benchmarks/cpu.py --no-docs ...   # any `attnkit bench` option; leave the docs alone

A partial run (``--quick``, ``--workloads``, ``--methods``, ``--no-memory``) leaves the docs
alone too: the published tables come from full runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from attnkit.bench import plots, report, runner
from attnkit.cli import bench as bench_cli
from attnkit.cli import make_console
from attnkit.cli._common import UsageError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="benchmarks/cpu.py", description=__doc__.split("\n\n")[0])
    bench_cli.add_arguments(parser)
    parser.add_argument("--no-docs", action="store_true",
                        help=f"do not rewrite the results section of {DOCS.name}")
    parser.add_argument("--docs", default=str(DOCS), help="the markdown file to update")
    args = parser.parse_args(argv)
    console = make_console()
    command = " ".join(["python", "benchmarks/cpu.py", *map(shlex.quote, argv)])
    try:
        options = bench_cli.options_from(args, command)
    except UsageError as error:
        parser.error(str(error))
    results = runner.run_benchmark(options, console=console)
    runner.print_report(results, console)
    out_dir = options.out_dir()
    path = runner.write_results(results, out_dir)
    figures = plots.write_all(results, out_dir)
    console.print(f"results: {path}; figures: {', '.join(figures) or 'none'}")
    for name, reason in plots.left_out(results).items():
        console.print(f"not written: {name}: {reason}")
    partial = [flag for flag, given in (("--quick", args.quick), ("--workloads", args.workloads),
                                        ("--methods", args.methods), ("--no-memory", not args.memory))
               if given]
    if partial and not args.no_docs:  # the published tables come from full runs only
        console.print(f"{', '.join(partial)}: a partial run; the results section of "
                      f"{Path(args.docs).name} is left alone")
    elif not args.no_docs:
        docs = Path(args.docs)
        docs.write_text(report.replace_section(docs.read_text(), report.markdown(results)))
        console.print(f"updated the results section of {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
