"""The ``attnkit`` command line: one module per subcommand, listed in :data:`COMMANDS`.

Each command module defines three things::

    HELP = "one line for `attnkit --help`"
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace, console: rich.console.Console) -> int: ...   # exit code

A user's mistake (bad argument, unusable output path, unreadable input file) raises
:class:`~attnkit.cli._common.UsageError`; :func:`main` reports it on stderr as one line and
returns 2. Commands check their output paths with :func:`~attnkit.cli._common.check_output`
before starting any work. Ctrl-C ends any command with one line on stderr and exit code 130.

Adding a command (e.g. ``bench``) is one module plus one entry in :data:`COMMANDS`.
Plotting modules import matplotlib inside their plotting functions only, so
``import attnkit`` never pulls in matplotlib.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from typing import Optional, Sequence

COMMANDS: dict[str, str] = {
    "explain": "attnkit.cli.explain",
    "scale-study": "attnkit.cli.scale_study",
    "check": "attnkit.cli.check",
    "info": "attnkit.cli.info",
    "demo": "attnkit.cli.demo",
    "bench": "attnkit.cli.bench",
}
"""Subcommand name → module implementing it (``HELP``, ``add_arguments``, ``run``), in help order."""


def command_module(name: str):
    """The module implementing subcommand ``name``."""
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`COMMANDS`."""
    from attnkit import __version__

    parser = argparse.ArgumentParser(
        prog="attnkit", description="Scaled dot-product attention: explain it, study its scale, "
                                    "check every backend against the float64 reference.")
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = command_module(name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def make_console():
    """A rich console on stdout; wide enough for the check table when output is not a terminal."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=140)
    return console


@contextlib.contextmanager
def tolerate_encoding(stream):
    """While the block runs, let ``stream`` (stdout) write ``?`` for the characters its
    encoding lacks (√, →, the table rules) instead of raising ``UnicodeEncodeError``: an ASCII
    or cp1252 console or pipe gets readable output. Its error handler is put back on exit
    (:func:`main` may run inside a larger program). A UTF-8 stream, or one that cannot be
    reconfigured, is left as is."""
    encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "").replace("_", "")
    if encoding == "utf8" or not hasattr(stream, "reconfigure"):
        yield
        return
    errors = stream.errors
    stream.reconfigure(errors="replace")
    try:
        yield
    finally:
        stream.reconfigure(errors=errors)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``attnkit`` console script; returns the exit code: 0, 1 when a
    check fails, 2 for a usage error (one line on stderr), 130 when interrupted (Ctrl-C)."""
    command = "attnkit"
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.command is None:
            parser.print_help()
            return 0
        command = f"attnkit {args.command}"
        from ._common import UsageError

        try:
            with tolerate_encoding(sys.stdout):
                return int(args._module.run(args, make_console()) or 0)
        except UsageError as error:
            print(f"{command}: error: {error}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
