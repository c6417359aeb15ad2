"""Build the triton backend's kernels for sm90 without a GPU and report what ptxas made of them.

    python tools/compile_sm90.py [--dims 64,128,256] [--mask causal|window|documents]
                                 [--mods softcap|alibi|relative|all] [--only attn_fwd,...]
                                 [--out results/]

For each kernel (forward; dQ; dK/dV; dK/dV storing dS; dQ from stored dS; the statistics) and
each autotune candidate of its head-dim bucket (``launch.CONFIGS``), and for the split-key
decoding kernel at 1 and 8 queries (GQA 8:1, 4096 keys): shared memory, registers,
spill bytes, whether it fits an H100/H200 block (227 KiB), whether it uses wgmma, and the
SASS instructions in each loop (a walk's loop: the per-thread work each tile issues besides
its wgmma). The kernels are specialized exactly as ``JITFunction`` would specialize the
launch (Triton's own binder on the launch's arguments), for a ``[1, 2, 512, D]`` bfloat16
problem under the chosen mask. Writes ``compile_sm90.json``. Runs in compiled mode: leave
``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

MASKS = ("causal", "window", "documents")
"""``--mask`` choices (documents not aligned to the blocks: aligned ones compile as causal)."""

SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/")  # nvdisasm's address column


def loop_sizes(sass: str, smallest: int = 20) -> list[int]:
    """Instructions in each loop of ``nvdisasm -c`` output (a label to the branch back to it),
    in order, without loops under ``smallest`` instructions (spin-waits)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\s*\.(L_x_\d+):", line))}
    sizes = []
    for i, line in enumerate(lines):
        back = re.search(r"\bBRA\b.*?\.(L_x_\d+)", line)
        if back and labels.get(back.group(1), i) < i:
            size = sum(1 for x in lines[labels[back.group(1)]:i + 1] if SASS_INSTRUCTION.search(x))
            if size >= smallest:
                sizes.append(size)
    return sizes


def sass_loops(compiled) -> Optional[list[int]]:
    """:func:`loop_sizes` of a compiled kernel, by the ``nvdisasm`` shipped with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        listing = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True)
    return loop_sizes(listing.stdout) if listing.returncode == 0 else None


MODS = ("", "softcap", "alibi", "relative", "all")
"""``--mods`` choices: the score modifiers the kernels are built with (``all``: the three, the
slopes' and the relative vector's gradients in dQ); with any, no stored-dS kernels."""


def score_mods(name: str, heads: int, length: int):
    """``launch.ScoreMods`` for ``--mods name`` over ``heads`` heads and ``length`` positions,
    and dQ's gradient buffers ``(dslope, ddiag)``."""
    from attnkit.backends.triton import launch

    on = {kind: name in (kind, "all") for kind in ("softcap", "alibi", "relative")}
    slopes = torch.zeros(1, heads) if on["alibi"] else None
    diag = torch.zeros(heads, 2 * length - 1) if on["relative"] else None
    mods = launch.ScoreMods(30.0 if on["softcap"] else None, slopes, 0, diag, length - 1)
    grads = [None if t is None else torch.zeros_like(t) for t in (slopes, diag)]
    return mods, grads


def calls(d: int, mask_name: str, mods_name: str = "") -> dict:
    """The launches of one forward and backward (both backwards; with ``mods_name``, the
    recomputing one) at head dim ``d``."""
    import attnkit as ak
    from attnkit.backends.triton import launch
    from attnkit.inputs import validate

    q = torch.zeros(1, 2, 512, d, dtype=torch.bfloat16)
    mask = {"causal": ak.causal(), "window": ak.sliding_window(170),
            "documents": ak.documents(torch.arange(512) // 170) & ak.causal()}[mask_name]
    plan = launch.make_plan(validate(q, q, q, mask))
    lse, delta = torch.zeros(1, 2, 512), torch.zeros(1, 2, 512)
    ds = launch.ds_buffer(q, plan)
    mods, (dslope, ddiag) = score_mods(mods_name, 2, 512)
    made = {"attn_fwd": launch.forward_call(q, q, q, q, lse, plan, mods),
            "attn_bwd_dq": launch.dq_call(q, q, q, q, q, lse, None, lse, delta, q, plan, mods,
                                          dslope, ddiag),
            "attn_bwd_dkdv": launch.dkdv_call(q, q, q, q, lse, delta, q, q, plan, mods=mods)}
    if not mods.any:
        made.update({"attn_bwd_dkdv+ds": launch.dkdv_call(q, q, q, q, lse, delta, q, q, plan, ds),
                     "attn_bwd_dq_stored": launch.dq_stored_call(q, q, q, ds, q, plan),
                     "attn_bwd_stats": launch.stats_call(q, q, lse, None, lse, delta, plan)})
    # as on sm90 (CPU tensors here): TMA allowed for the +tma candidates and the dS stores
    import triton.language as tl
    for call in made.values():
        if "TMA_OK" in call.args:
            call.args["TMA_OK"] = True
        if "stored" in call.args and call.args["stored"].STORE:
            call.args["stored"] = call.args["stored"]._replace(BY_TMA=tl.constexpr(True))
    return made


def decode_args(d: int, q_len: int) -> dict:
    """The split-key decoding kernel's arguments for Tq = ``q_len`` queries of 32 heads (GQA
    8:1) against 4096 keys under bottom-right causal and key lengths, head dim ``d``."""
    import attnkit as ak
    from attnkit.backends.triton import launch
    from attnkit.inputs import validate

    q = torch.zeros(2, 32, q_len, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 4, 4096, d, dtype=torch.bfloat16)
    inputs = validate(q, k, k, ak.causal("bottom_right") & ak.padding(kv_lengths=[4096, 3000]))
    form = launch.decode_form(inputs)
    return launch.decode_launch(inputs, *form, launch.TritonOptions(decode_splits=8))[0]


def build(fn, args: dict, warps: int, stages: int):
    """``fn`` compiled for sm90 with ``args``, specialized by Triton's own binder → (compiled,
    ptxas log)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature, find_paths_if, get_iterable_path

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(**args)
    names = [p.name for p in fn.params]
    kinds = [kind for kind, _ in specialization]
    constexprs = {path: get_iterable_path(list(bound.values()), path)
                  for path in find_paths_if(kinds, lambda _, kind: kind == "constexpr")}
    attrs = ["" if kind == "constexpr" else attr for kind, attr in specialization]
    attrs = {path: backend.parse_attr(get_iterable_path(attrs, path))
             for path in find_paths_if(attrs, lambda _, attr: isinstance(attr, str))}
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True
        triton.knobs.compilation.always_compile = True  # no cache hit: ptxas runs
        compiled = triton.compile(ASTSource(fn, dict(zip(names, kinds)), constexprs, attrs),
                                  target=target, options={"num_warps": warps, "num_stages": stages})
    return compiled, log.getvalue()


def measure(fn, values: dict, row: dict) -> dict:
    """``row`` (the kernel, its config) with what building ``fn`` on ``values`` gave: shared
    memory, registers, spills, whether it fits and uses wgmma, its loops' SASS sizes; or the
    error. Printed as it comes."""
    start = time.perf_counter()
    try:
        compiled, log = build(fn, values, row["warps"], row["stages"])
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        row.update(shared_kib=compiled.metadata.shared / 1024,
                   registers=int(regs.group(1)) if regs else None,
                   spill_bytes=int(spill.group(1)) if spill else None,
                   fits=compiled.metadata.shared <= 227 * 1024,
                   wgmma="wgmma" in compiled.asm["ptx"], loops=sass_loops(compiled))
    except Exception as error:  # noqa: BLE001 - reported and counted
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    row["seconds"] = round(time.perf_counter() - start, 2)
    print(line(row), flush=True)
    return row


def line(row: dict) -> str:
    head = (f"{row['kernel']:18s} {row['d']:3d} {row['block_m']:4d}{row['block_n']:4d} "
            f"{row['warps']:2d} {row['stages']} {row['walk']:12s}")
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    loops = "/".join(map(str, row.get("loops") or [])) or "?"
    return (f"{head} {row['shared_kib']:7.1f} {row['registers'] or '?':>5} {row['spill_bytes'] or 0:6d}"
            f"  {'yes' if row['fits'] else 'NO':4s} {'yes' if row['wgmma'] else 'no':5s} {loops}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--mask", choices=MASKS, default="causal")
    parser.add_argument("--mods", choices=MODS, default="", help="score modifiers to build with")
    parser.add_argument("--only", default="", help="kernels to build, comma separated")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)

    import triton

    from attnkit.backends.triton import launch
    if launch.interpreting():
        print("compile_sm90 needs compiled mode: unset TRITON_INTERPRET")
        return 2
    only = set(filter(None, args.only.split(",")))
    rows = []
    print("kernel               D   BM  BN  w s walk          KiB  regs  spill  fits wgmma loops")
    for d in (int(x) for x in args.dims.split(",")):
        for label, call in calls(d, args.mask, args.mods).items():
            if only and label not in only:
                continue
            fn = getattr(launch.kernels(), call.name)
            for m, n, warps, stages, walk in launch.CONFIGS[call.name][launch.head_bucket(d)]:
                meta = launch.kernel_meta(fn, dict(BLOCK_M=m, BLOCK_N=n, **launch.WALKS[walk]))
                rows.append(measure(fn, {**call.args, **meta}, dict(
                    kernel=label, d=d, block_m=m, block_n=n, warps=warps, stages=stages,
                    walk=walk)))
    decode = launch.kernels().attn_decode
    for d in (int(x) for x in args.dims.split(",")):
        for q_len in (1, 8):
            if not only or "attn_decode" in only:
                values = decode_args(d, q_len)
                rows.append(measure(decode, values, dict(
                    kernel="attn_decode", d=d, block_m=values["BLOCK_R"],
                    block_n=values["BLOCK_N"], warps=4, stages=3, walk=f"Tq{q_len}")))
    failures = sum("error" in row for row in rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_sm90.json").write_text(json.dumps(
        {"triton": triton.__version__, "target": "sm90 (offline, no device)", "mask": args.mask,
         "mods": args.mods, "rows": rows}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
