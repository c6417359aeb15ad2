"""``attnkit info``: versions, device, backends (available or why not) and dispatch order."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys

HELP = "versions, device, registered backends and the auto-dispatch order"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def versions() -> dict[str, str]:
    """Name → version of attnkit, python, torch, numpy and triton ("not installed" when absent)."""
    import numpy
    import torch

    import attnkit

    found = {"attnkit": attnkit.__version__, "python": platform.python_version(),
             "torch": torch.__version__, "numpy": numpy.__version__}
    if importlib.util.find_spec("triton") is None:
        found["triton"] = "not installed"
    else:
        try:
            found["triton"] = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            found["triton"] = "installed (version unknown)"
    return found


def device_info() -> dict[str, str]:
    """CPU threads (torch's and the machine's) and CUDA availability with device names."""
    import torch

    info = {"cpu": f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs ({platform.machine()})",
            "cuda": "yes" if torch.cuda.is_available() else "no"}
    if torch.cuda.is_available():
        info["cuda"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return info


def capabilities(backend) -> str:
    """A backend's declared capabilities in one short line (devices, dtypes, options)."""
    dtypes = "/".join(str(d).replace("torch.", "").replace("float", "f").replace("bf16", "bf16")
                      for d in backend.DTYPES)
    flags = [label for label, ok in (("dropout", backend.SUPPORTS_DROPOUT),
                                     ("weights", backend.SUPPORTS_WEIGHTS),
                                     ("bias", backend.SUPPORTS_BIAS)) if ok]
    head = f", head dim <= {backend.MAX_HEAD_DIM}" if backend.MAX_HEAD_DIM else ""
    return f"{'/'.join(backend.DEVICES)}; {dtypes}; {', '.join(flags) or 'no dropout/weights/bias'}{head}"


def run(args: argparse.Namespace, console) -> int:
    from rich.table import Table

    from .. import dispatch

    table = Table(title="versions", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("package")
    table.add_column("version")
    for name, version in versions().items():
        table.add_row(name, version)
    console.print(table)
    for name, value in device_info().items():
        console.print(f"[bold]{name}:[/bold] {value}")
    console.print(f"[bold]executable:[/bold] {sys.executable}")

    table = Table(title="backends", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("name", "status", "supports", "description"):
        table.add_column(column, overflow="fold")
    for name, backend in dispatch.BACKENDS.items():
        reason = backend.unavailable_reason()
        status = "[green]available" if reason is None else f"[yellow]unavailable: {reason}"
        table.add_row(name, status, capabilities(backend), backend.DESCRIPTION)
    console.print(table)
    console.print("[bold]auto-dispatch order:[/bold] " + " → ".join(dispatch.PRIORITY))
    console.print("[bold]rules[/bold] (backend='auto' takes the first backend that can run the input):")
    for rule in dispatch.AUTO_RULES:
        console.print(f"  • {rule}")
    return 0
