"""``attnkit demo``: explain (with a weights heatmap), a quick check, and the scale study."""

from __future__ import annotations

import argparse

from ._common import check_output

HELP = "run explain, check --quick and scale-study, writing PNGs to --out"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="attnkit-out", metavar="DIR",
                        help="folder for the PNGs (default: attnkit-out)")


def run(args: argparse.Namespace, console) -> int:
    from . import command_module

    out = check_output("--out", args.out, "explain_weights.png", "scale_study.png")
    steps = (("explain", ["--plot", str(out / "explain_weights.png")]),
             ("check", ["--quick"]),
             ("scale-study", ["--out", str(out)]))
    codes = {}
    for name, argv in steps:
        console.rule(f"[bold cyan]attnkit {name} {' '.join(argv)}")
        module = command_module(name)
        parser = argparse.ArgumentParser(prog=f"attnkit {name}")
        module.add_arguments(parser)
        codes[name] = int(module.run(parser.parse_args(argv), console) or 0)
    console.rule("[bold cyan]demo done")
    console.print(f"PNGs written to {out}/: explain_weights.png, scale_study.png")
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        console.print(f"[bold red]failed: {', '.join(failed)}")
        return 1
    return 0
