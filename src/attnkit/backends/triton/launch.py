"""Host side of the triton backend: what the kernels are told, and how they are launched.

Three pieces, each built once per ``attention()`` call and kept for the backward:

- :class:`MaskProgram`: the mask as the kernels see it. Structured parts of an ``&`` chain
  become parameters evaluated from indices inside PARTIAL tiles (one band ``lo ≤ kv − q ≤ hi``
  that every causal/sliding-window part intersects into, per-batch query/key lengths, one pair
  of document-id vectors, or per-position key/query ranges for left padding); everything else (dense bool masks, ``from_function``, ``|``, ``~``,
  a second ``documents``) is materialised once as a ``[B, H, Tq, Tk]`` view and loaded per
  tile, and additive biases are loaded the same way (``-inf`` = masked). Each feature is a
  ``tl.constexpr`` flag, so one kernel source serves every mask.
- :class:`BlockLists`: the mask's ``block_map`` at the sparse-block granularity turned into
  compact per-row lists, PARTIAL blocks first then FULL ones (FlexAttention's
  ``kv_num_blocks``/``kv_indices``/``full_kv_num_blocks``). EMPTY blocks are never listed.
  The forward and dQ walk rows (query blocks → key blocks); dK/dV walk the transposed lists.
- :class:`Tiles`: sparse-block and kernel-block sizes. On a GPU the kernel blocks are
  autotuned (``triton.autotune``) inside fixed 128×128 sparse blocks, so the block lists do not
  depend on the chosen config; under the interpreter one small fixed config is used.

Interpreter or compiler is a per-process choice. Triton reads ``TRITON_INTERPRET`` when
``@triton.jit`` decorates a function, and its own library (``tl.zeros``, ``tl.max``, ``tl.sum``)
is decorated when triton is first imported; an interpreted kernel cannot call a compiled
library function, nor the reverse. So :func:`interpreting` reads the mode off the imported
library, and :func:`kernels` loads ``kernels.py`` decorated in that same mode, whatever the
environment says by then. CPU tensors therefore need ``TRITON_INTERPRET=1`` set before triton
is first imported (``cpu_problem`` says so when it was not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import operator
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Optional

import torch

from ...inputs import Inputs
from ...masks import (FULL, PARTIAL, Mask, MaskCache, MaskSpace, _And, _Band, _Bias, _Documents,
                      _Intervals, _Padding)

LOG2E = 1.4426950408889634

_FLAVOURS: dict[bool, ModuleType] = {}
_MODE: list[bool] = []  # interpreting(), once known
_TUNED: dict[str, object] = {}


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (as Triton itself reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether this process runs Triton kernels through the interpreter: fixed when triton was
    first imported (importing it now, under the current environment, if nobody has yet)."""
    if _MODE:
        return _MODE[0]
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    probe = getattr(tl, "zeros", None)  # a @jit function of triton's own library
    if isinstance(probe, InterpretedFunction):
        _MODE.append(True)  # fixed for the life of the process
    elif isinstance(probe, JITFunction):
        _MODE.append(False)
    else:
        return bool(triton.knobs.runtime.interpret)
    return _MODE[0]


def cpu_problem() -> Optional[str]:
    """Why CPU tensors cannot run here (``None`` when the interpreter is on), without importing
    triton when it is not imported yet."""
    if not interpreter_requested():
        return "CPU tensors need TRITON_INTERPRET=1"
    if "triton.language" in sys.modules and not interpreting():
        return ("CPU tensors need TRITON_INTERPRET=1 set before triton is first imported "
                "(triton was imported without it)")
    return None


def kernels() -> ModuleType:
    """``kernels.py`` decorated in this process's mode (interpreted or compiled), loaded once
    per mode with Triton's knob set explicitly."""
    interpret = interpreting()
    if interpret not in _FLAVOURS:
        import triton

        name = f"{__package__}._kernels_{'interpreted' if interpret else 'compiled'}"
        path = os.path.join(os.path.dirname(__file__), "kernels.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
        _FLAVOURS[interpret] = module
    return _FLAVOURS[interpret]


# ---- tile sizes and autotuning ------------------------------------------------------------------
@dataclass(frozen=True)
class Tiles:
    """Sparse-block sizes (the block-map granularity) and, under the interpreter, the fixed
    kernel blocks ``(BLOCK_M, BLOCK_N)`` of each kernel (``None``: autotuned on a GPU)."""

    sparse_q: int
    sparse_k: int
    fwd: Optional[tuple[int, int]] = None
    dkdv: Optional[tuple[int, int]] = None
    dq: Optional[tuple[int, int]] = None
    walk: str = "partial_first"  # under the interpreter (see WALKS)


GPU_TILES = Tiles(sparse_q=128, sparse_k=128)
INTERPRETER_TILES = Tiles(sparse_q=32, sparse_k=32, fwd=(32, 32), dkdv=(32, 32), dq=(32, 32))
"""Under the interpreter each block op costs about the same whatever its size (Python overhead
dominates), so 32×32 tiles run the tests about twice as fast as 16×16 while sequences of
40–80 positions still span several blocks. Tests swap in other tiles (e.g. 32×32 sparse blocks
walked by 16-wide kernel blocks) to cover the sub-tile loops the GPU configs use."""


def _walk_flags(name: str) -> dict:
    order, *extras = name.split("+")
    return dict(FULL_FIRST=order == "full_first", FLAT="flat" in extras, MERGED=order == "one_loop",
                ORDERED="lpt" in extras, TMA="tma" in extras)


WALKS = {name: _walk_flags(name) for name in (
    [order + flat + lpt for order in ("partial_first", "full_first") for flat in ("", "+flat")
     for lpt in ("", "+lpt")] + ["one_loop", "one_loop+lpt"]
    + ["partial_first+tma", "partial_first+flat+tma", "full_first+flat+tma", "one_loop+tma"])}
"""How a kernel walks its block lists (``kernels.py``), each a ``tl.constexpr`` autotuned with
the block sizes: ``partial_first``/``full_first``, a loop over the row's PARTIAL blocks and
one over its FULL blocks, in that order or the other; ``one_loop``, one loop over both, which
tests per block whether to mask (one software pipeline to fill per row instead of two: for
short rows such as 1024-token documents, where each fill is a sizeable share of the row);
``+flat``, one kernel block per loop iteration instead of one sparse block with its sub-tiles
unrolled (FlexAttention's loop shape; the same when the kernel block is the sparse block;
``one_loop`` is always flat); ``+lpt``, the programs of a head start heaviest row first
(:attr:`BlockLists.order`: longest-processing-time-first, so the light rows fill the tail);
``+tma``, the walked tiles (K/V in the forward and dQ, Q/dO in dK/dV) by TMA copies
through tensor descriptors made in the kernel, where the host allows it (:func:`_tma_ok`;
otherwise the same kernel loads by pointers)."""

P, F = "partial_first", "full_first"
P_FLAT, F_FLAT, P_LPT, F_LPT = P + "+flat", F + "+flat", P + "+lpt", F + "+lpt"
F_FLAT_LPT, M = F + "+flat+lpt", "one_loop"
P_TMA, P_FLAT_TMA, F_FLAT_TMA, M_TMA = P + "+tma", P + "+flat+tma", F + "+flat+tma", M + "+tma"

# Autotune candidates per kernel and head-dim bucket (the larger of the padded Dk, Dv):
# (BLOCK_M, BLOCK_N, num_warps, num_stages, walk); blocks divide the 128×128 sparse blocks.
#
# Measured (three H200 runs, docs/BENCHMARKS.md): at D = 128 the autotuner picked 128×128
# (forward), 32×128 (dK/dV) and 128×64 (dQ) for every mask. FULL-first ties with
# PARTIAL-first (0.96–1.05× over 36 tunings); one loop that masks every tile lost 72 of 73
# tunings (by up to 2.5×) and was removed. Dropped at D = 128, never the fastest: forward
# 128×64 with 2 stages, 64×128 with 4 warps and 64×64; dQ 128×32 and 64×64; dK/dV 32×64 and
# 64×64 (which spill 132–184 bytes) and 16×64 (1.7× the winner's time). The smallest forward
# and dQ configs stay for small problems.
#
# Not yet timed on a GPU, built offline for sm90 (``benchmarks/gpu.py --compile-only``):
# - ``+flat``: dK/dV 32×128 and dQ 128×64 need 96/128 KiB of shared memory instead of
#   193/192 and do not spill (unrolled dK/dV: 4–12 bytes); dK/dV 64×128 fits only flat
#   (255 registers; with 3 stages, FlexAttention's Hopper shape for its dK/dV loop, it spills
#   16–116 bytes, a candidate all the same);
# - 16 warps (FlexAttention's newer Hopper pick for its backward): the flat forward 128×64
#   and dQ 128×64 fit in 128 registers without spilling; dK/dV would spill 350–630 bytes;
# - ``one_loop``: the forward 128×128 fits in 203 registers (split walks: 222) at 12 % more
#   operations per FULL tile;
# - ``+lpt`` on the winners' shapes;
# - D = 256 (129–256), flat walks only: unrolled, every forward candidate needed 288–292 KiB
#   of shared memory (over the 227 KiB an H100/H200 block may have: they could not launch)
#   and the backward spilled 0.2–21 KiB; flat, the forward takes 96–192 KiB without spills,
#   dK/dV 16×32 49 KiB without spills (16×64 and 32×64: 52 and 104 bytes), dQ 64×32 none
#   (32×32: 4 bytes).
# - ``+tma``: the forward's FULL loop (128×128) drops from 537 to 470 operations per thread
#   and tile (no address arithmetic; 237 registers, ``one_loop+tma`` 199), dQ's (128×64,
#   flat) from 305 to 264, dK/dV's (32×128, flat; its LSE and Δ rows by 1-D descriptors)
#   from 345 to 269; dK/dV 64×128 with TMA spills and is left out.
# - 3 and 4 stages on the winners' shapes: until the FULL loops computed their positions
#   (``FULL_STRIDED``), every loop's K/V (or Q/dO) address came from a load made in the
#   loop, and Triton 3.6 then waited for every outstanding copy at the loop head whatever
#   ``num_stages`` said (PTX: ``cp.async.wait_group 0``): a 3-stage candidate prefetched no
#   further than a 2-stage one. Now 3 stages wait with 2 tiles in flight (forward
#   128×128: 224 KiB of shared memory, 252 registers, no spill; dK/dV 32×128 flat with 4
#   stages: 128 KiB; dQ 128×64 flat with 4 stages: 192 KiB). The one-loop walk pipelines
#   too when both kinds are evenly spaced (its position is a select between two
#   progressions): 3-stage ``one_loop`` candidates, for short rows such as 1024-token
#   documents.
#
# - dK/dV with 64 keys a program, flat (32×64 with 4 warps: 255 registers × 128 threads and
#   64–81 KiB, so two programs share an SM and one's prologue and epilogue, the loads of K/V
#   and the stores of dK/dV, can overlap the other's loop: for short columns such as
#   1024-token documents and causal N 1024, where dK/dV ran at ~350 TFLOP/s against ~450 on
#   the window's longer ones (run A); also heaviest columns first; 64×64 with 8 warps).
#   Offline (documents, causal): 32×64 never spills, 64×64 0–40 bytes; storing dS, 12–36
#   and 12–108. Unrolled, 32×64 and 64×64 had spilled 132–184 bytes and lost.
#
# Tried offline for sm90 (Triton 3.6) and left out:
# - automatic warp specialization (``tl.range(warp_specialize=True)``: a producer warp group
#   feeding two consumer ones, FlashAttention-3's layout). It specializes a plain forward
#   loop at 4 warps (12 with the producer), but on these kernels Triton's Hopper pass fails
#   (an MLIR assertion) whenever a kernel has two loops (the split walks) and on the one-loop
#   forward without a mask, and leaves the causal one-loop forward unspecialized;
# - a persistent forward (each program looping over query blocks, ``tl.range(flatten=True)``
#   to overlap one block's epilogue with the next one's loads): Triton fuses the two loops
#   only when the inner trip count is the same for every block, which no mask's is;
# - dK/dV issuing dP = V·dOᵀ before its exponentials, so that the tensor cores run during
#   them (the dQ loop's schedule already does this): up to 8 more registers, and spills
#   grew by up to 28 bytes in most 32×128 candidates.
CONFIGS: dict[str, dict[int, list[tuple[int, int, int, int, str]]]] = {
    "attn_fwd": {
        64: [(128, 128, 8, 2, P), (128, 64, 8, 3, P), (128, 32, 4, 3, P), (64, 64, 4, 3, P),
             (64, 64, 4, 3, P_FLAT), (64, 64, 4, 3, P_LPT), (64, 64, 4, 3, M), (64, 32, 4, 2, P)],
        128: [(128, 128, 8, 2, P), (128, 128, 8, 2, F), (128, 128, 8, 2, P_LPT),
              (128, 128, 8, 2, M), (128, 128, 8, 2, P_TMA), (128, 128, 8, 2, M_TMA),
              (128, 128, 8, 3, P), (128, 128, 8, 3, P_TMA), (128, 64, 8, 3, M),
              (128, 64, 8, 3, P), (128, 64, 8, 3, P_FLAT), (128, 64, 8, 3, P_FLAT_TMA),
              (128, 64, 8, 4, P_FLAT), (128, 64, 16, 3, P_FLAT), (64, 32, 4, 2, P)],
        256: [(64, 64, 8, 2, P_FLAT), (64, 32, 4, 2, P_FLAT), (64, 32, 4, 3, P_FLAT),
              (128, 64, 8, 2, P_FLAT)],
    },
    "attn_bwd_dkdv": {  # BLOCK_N key rows per program, BLOCK_M query rows per step
        64: [(32, 128, 8, 2, P), (64, 128, 8, 2, P), (64, 128, 8, 2, P_FLAT),
             (64, 128, 8, 3, P_FLAT), (64, 128, 8, 2, P_LPT), (64, 128, 8, 2, M), (32, 64, 4, 3, P),
             (16, 64, 4, 2, P)],
        128: [(32, 128, 8, 2, P), (32, 128, 8, 2, F), (32, 128, 8, 2, F_FLAT),
              (32, 128, 8, 3, F_FLAT), (64, 128, 8, 2, F_FLAT), (64, 128, 8, 3, F_FLAT),
              (32, 128, 8, 2, F_LPT), (32, 128, 8, 2, F_FLAT_LPT), (32, 128, 8, 2, M),
              (64, 128, 8, 2, M), (32, 128, 8, 2, F_FLAT_TMA), (32, 128, 8, 4, F_FLAT),
              (32, 128, 8, 3, F_FLAT_TMA), (32, 128, 8, 3, M), (32, 64, 4, 2, F_FLAT),
              (32, 64, 4, 3, F_FLAT), (32, 64, 4, 2, F_FLAT_LPT), (64, 64, 8, 2, F_FLAT)],
        256: [(16, 32, 4, 2, P_FLAT), (16, 64, 8, 2, P_FLAT), (32, 64, 8, 2, P_FLAT)],
    },
    "attn_bwd_dq": {
        64: [(128, 64, 8, 2, P), (64, 64, 4, 3, P), (64, 64, 4, 3, P_FLAT), (64, 64, 4, 3, P_LPT),
             (64, 64, 4, 3, M), (64, 32, 4, 2, P)],
        128: [(128, 64, 8, 2, P), (128, 64, 8, 2, F), (128, 64, 8, 2, F_FLAT),
              (128, 64, 8, 3, F_FLAT), (128, 64, 8, 2, F_LPT), (128, 64, 8, 2, F_FLAT_LPT),
              (128, 64, 16, 3, F_FLAT), (128, 64, 8, 2, M), (128, 64, 8, 2, F_FLAT_TMA),
              (128, 64, 8, 2, M_TMA), (128, 64, 8, 4, F_FLAT), (128, 64, 8, 3, F_FLAT_TMA),
              (128, 64, 8, 3, M), (64, 32, 4, 2, P)],
        256: [(64, 32, 8, 2, P_FLAT), (32, 32, 4, 2, P_FLAT)],
    },
    # the stored-dS backward (:data:`BACKWARD`), not yet timed on a GPU: dQ = dS·K (one
    # matmul a tile, its dS tiles read from memory; always one loop, of the walk switches
    # only ``+lpt`` applies) and the statistics before dK/dV (one config in all: Triton's
    # autotuner then times nothing)
    "attn_bwd_dq_stored": {
        64: [(128, 64, 4, 3, P), (128, 128, 8, 3, P), (64, 64, 4, 3, P), (64, 32, 4, 2, P)],
        128: [(128, 64, 8, 3, P), (128, 64, 8, 4, P), (128, 64, 8, 3, P_LPT),
              (128, 128, 8, 2, P), (128, 128, 8, 3, P), (64, 128, 4, 3, P), (64, 64, 4, 3, P),
              (128, 32, 4, 3, P), (128, 64, 8, 3, P_TMA), (128, 64, 8, 4, P_TMA),
              (128, 128, 8, 3, P_TMA)],
        256: [(64, 64, 8, 2, P), (64, 32, 4, 2, P), (32, 32, 4, 2, P)],
    },
    "attn_bwd_stats": {bucket: [(32, 32, 4, 1, P)] for bucket in (64, 128, 256)},
}


_PINNED: list[int] = []


@contextlib.contextmanager
def pinned(index: int = 0):
    """Inside this block, compiled launches run candidate ``index`` of their kernel's head-dim
    bucket in ``CONFIGS`` (the last one where the bucket has fewer), without autotuning and
    without recording a choice. ``benchmarks/gpu.py`` checks many mask kinds at candidate 0
    (each kind is its own set of ``tl.constexpr`` flags: autotuning would compile every
    candidate for every kind) and every candidate in turn on the workloads' masks."""
    _PINNED.append(index)
    try:
        yield
    finally:
        _PINNED.pop()


def pinned_config(name: str, head: int, index: int) -> tuple[int, int, int, int, str]:
    """The candidate :func:`pinned` runs for kernel ``name`` at padded head dim ``head``."""
    candidates = CONFIGS[name][head_bucket(head)]
    return candidates[min(index, len(candidates) - 1)]


def head_bucket(head: int) -> int:
    """The ``CONFIGS`` bucket for a padded head dim."""
    return 64 if head <= 64 else 128 if head <= 128 else 256


def _config_key(config) -> tuple[int, int, int, int, str]:
    walk = next(name for name, flags in WALKS.items()
                if all(config.kwargs[k] == v for k, v in flags.items()))
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages, walk


def _pruner(name: str):
    def prune(configs, named_args, **kwargs):
        """Keep the candidates of this head-dim bucket (the autotuner then times them)."""
        bucket = head_bucket(max(kwargs["DK_PAD"], kwargs["DV_PAD"]))
        wanted = set(CONFIGS[name][bucket])
        return [c for c in configs if _config_key(c) in wanted]
    return prune


AUTOTUNE_CACHE = True
"""Keep the autotuner's timings on disk (``triton.autotune(cache_results=True)``: Triton's cache
directory, keyed by Triton's version, the GPU target, the kernel source, the candidates and the
tune key), so a new process meeting the same shapes and mask kinds skips timing every candidate
again (~15 per kernel). Read when the tuners are made; ``benchmarks/gpu.py`` turns it off, as it
reports the timings of its own run."""


def _tuned(name: str):
    """The compiled kernel ``name`` wrapped in ``triton.autotune`` (created once)."""
    if name not in _TUNED:
        import triton

        every = sorted({c for bucket in CONFIGS[name].values() for c in bucket})
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **WALKS[walk]}, num_warps=w,
                                 num_stages=s) for m, n, w, s, walk in every]
        _TUNED[name] = triton.autotune(configs=configs, key=["DK_PAD", "DV_PAD", "TUNE_KEY"],
                                       prune_configs_by={"early_config_prune": _pruner(name)},
                                       cache_results=AUTOTUNE_CACHE,
                                       )(getattr(kernels(), name))
    return _TUNED[name]


def head_pad(dim: int) -> int:
    """Head dim rounded up to a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, 1 << (dim - 1).bit_length())


# ---- the mask program -----------------------------------------------------------------------
def and_leaves(mask: Optional[Mask]) -> list[Mask]:
    """The parts of an ``&`` chain, flattened (``a & (b & c)`` → ``[a, b, c]``)."""
    if mask is None:
        return []
    if isinstance(mask, _And):
        return [leaf for part in mask.parts for leaf in and_leaves(part)]
    return [mask]


@dataclass
class MaskProgram:
    """What a PARTIAL tile must evaluate, in the form the kernels take.

    ``band_lo``/``band_hi``: ``lo ≤ kv − q ≤ hi`` (``None`` = unbounded); ``q_lengths``/
    ``kv_lengths`` int32 ``[B]``; ``q_docs`` ``[B, Tq]``/``kv_docs`` ``[B, Tk]`` int32 ids, or
    with ``doc_ranges`` int32 ``[B, Tq, 2]``/``[B, Tk, 2]``: each query's key range and each
    key's query range (see :func:`_doc_ranges`; a padding mask with starts takes this form
    too, :func:`_padding_ranges`, and so do per-sequence bands and causal documents, whose
    rows are runs too: ``masks._Intervals.ranges``);
    ``allowed`` int8 ``[B, H, Tq, Tk]`` (a view: broadcast dims have stride 0); ``bias`` float
    ``[B, H, Tq, Tk]`` with ``-inf`` = masked. Unset features cost nothing in the kernels.
    """

    band_lo: Optional[int] = None
    band_hi: Optional[int] = None
    q_lengths: Optional[torch.Tensor] = None
    kv_lengths: Optional[torch.Tensor] = None
    q_docs: Optional[torch.Tensor] = None
    kv_docs: Optional[torch.Tensor] = None
    doc_ranges: bool = False
    allowed: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None

    def features(self) -> list[str]:
        """Names of the features that are on (for tests and error messages)."""
        names = [("band_lo", self.band_lo), ("band_hi", self.band_hi), ("q_lengths", self.q_lengths),
                 ("kv_lengths", self.kv_lengths), ("documents", self.q_docs),
                 ("dense", self.allowed), ("bias", self.bias)]
        return [name for name, value in names if value is not None]

    def flags(self) -> dict[str, bool]:
        return dict(HAS_LO=self.band_lo is not None, HAS_HI=self.band_hi is not None,
                    HAS_QLEN=self.q_lengths is not None, HAS_KVLEN=self.kv_lengths is not None,
                    HAS_DOCS=self.q_docs is not None, DOC_RANGES=self.doc_ranges,
                    HAS_DENSE=self.allowed is not None,
                    HAS_BIAS=self.bias is not None)

    def args(self, placeholder: torch.Tensor) -> dict:
        """Kernel arguments; unused pointers get ``placeholder`` and strides 0."""
        def vec(t):
            return (placeholder, 0) if t is None else (t, t.stride(0))

        def mat(t):  # [B, T] ids or [B, T, 2] ranges: the batch and position strides
            return (placeholder, 0, 0) if t is None else (t, *t.stride()[:2])

        def grid4(t):
            return (placeholder, 0, 0, 0, 0) if t is None else (t, *t.stride())

        a = dict(band_lo=self.band_lo or 0, band_hi=self.band_hi or 0)
        a.update(zip(("q_lens", "s_qlen_b"), vec(self.q_lengths)))
        a.update(zip(("kv_lens", "s_kvlen_b"), vec(self.kv_lengths)))
        a.update(zip(("q_docs", "s_qdoc_b", "s_qdoc_t"), mat(self.q_docs)))
        a.update(zip(("kv_docs", "s_kvdoc_b", "s_kvdoc_t"), mat(self.kv_docs)))
        a.update(zip(("dense", "s_dense_b", "s_dense_h", "s_dense_q", "s_dense_k"), grid4(self.allowed)))
        a.update(zip(("bias", "s_bias_b", "s_bias_h", "s_bias_q", "s_bias_k"), grid4(self.bias)))
        return a


def _as_lengths(lengths: torch.Tensor, batch: int, device) -> torch.Tensor:
    return lengths.reshape(-1).to(device=device, dtype=torch.int32).expand(batch)


def _as_ids(q_ids: torch.Tensor, kv_ids: torch.Tensor, space: MaskSpace,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids as int32 ``[B, Tq]`` and ``[B, Tk]``: the kernels compare them in 32 bits.
    Ids outside the int32 range are renumbered by rank, which keeps every equality."""
    q_ids, kv_ids = q_ids.to(space.device), kv_ids.to(space.device)
    limits = torch.iinfo(torch.int32)
    if any(ids.dtype.itemsize > 4 and ids.numel() and (ids.min() < limits.min or ids.max() > limits.max)
           for ids in (q_ids, kv_ids)):
        _, ranks = torch.unique(torch.cat([q_ids.flatten(), kv_ids.flatten()]), return_inverse=True)
        q_ids, kv_ids = ranks[:q_ids.numel()].view(q_ids.shape), ranks[q_ids.numel():].view(kv_ids.shape)

    def fit(ids: torch.Tensor, length: int) -> torch.Tensor:
        ids = ids.to(torch.int32)
        return (ids if ids.dim() == 2 else ids[None]).expand(space.batch, length)
    return fit(q_ids, space.q_len), fit(kv_ids, space.kv_len)


def _doc_ranges(own: torch.Tensor, other: torch.Tensor, batch: int) -> Optional[torch.Tensor]:
    """For each position of ``own`` (ids ``[T]`` or ``[B, T]``), the positions ``[lo, hi)`` of
    ``other`` (ids ``[S]`` or ``[B, S]``) that hold the same id (``[0, 0)`` when none do) →
    int32 ``[B, T, 2]``; ``None`` when an id's positions in ``other`` are not one contiguous
    run (the kernels then compare ids)."""
    rows = max(own.shape[0] if own.dim() == 2 else 1, other.shape[0] if other.dim() == 2 else 1)
    own, other = (ids.to(torch.int64) if ids.dim() == 2 else ids.to(torch.int64)[None]
                  for ids in (own, other))
    result = []
    for row in range(rows):
        mine, theirs = own[min(row, own.shape[0] - 1)], other[min(row, other.shape[0] - 1)]
        span = torch.zeros(mine.shape[0], 2, dtype=torch.int64, device=mine.device)
        if theirs.numel():
            change = torch.ones(theirs.shape[0], dtype=torch.bool, device=theirs.device)
            change[1:] = theirs[1:] != theirs[:-1]
            starts = change.nonzero().flatten()  # [R] first position of each run
            stops = torch.cat([starts[1:], starts.new_tensor([theirs.shape[0]])])
            run_ids, order = theirs[starts].sort()
            if bool((run_ids[1:] == run_ids[:-1]).any()):  # an id in two runs
                return None
            at = torch.searchsorted(run_ids, mine).clamp_(max=run_ids.shape[0] - 1)  # [T]
            found = (run_ids[at] == mine)[:, None]  # [T, 1]
            run_spans = torch.stack([starts, stops], dim=-1)[order]  # [R, 2] in id order
            span = torch.where(found, run_spans[at], 0)
        result.append(span)
    return torch.stack(result).to(torch.int32).expand(batch, -1, 2)


def _padding_ranges(leaf: _Padding, space: MaskSpace) -> tuple[torch.Tensor, torch.Tensor]:
    """A padding mask with starts (left padding) in the form of document ranges (see
    :func:`_doc_ranges`): each real query's key range ``[kv_lo, kv_hi)`` and each real key's
    query range ``[q_lo, q_hi)`` of its batch element, ``[0, 0)`` for padded positions → int32
    ``[B, Tq, 2]`` and ``[B, Tk, 2]``. A query and key then match exactly when both are real."""
    q_lo, q_hi, kv_lo, kv_hi = (t.expand(space.batch) for t in leaf._bounds(space))  # [B] each

    def ranges(lo, hi, length, other_lo, other_hi):
        pos = torch.arange(length, device=space.device)[None, :]  # [1, T]
        real = ((pos >= lo[:, None]) & (pos < hi[:, None]))[..., None]  # [B, T, 1]
        span = torch.stack([other_lo, other_hi], dim=-1)[:, None, :]  # [B, 1, 2]
        return torch.where(real, span, 0).to(torch.int32)  # [B, T, 2]
    return (ranges(q_lo, q_hi, space.q_len, kv_lo, kv_hi),
            ranges(kv_lo, kv_hi, space.kv_len, q_lo, q_hi))


def needed_leaves(mask: Optional[Mask], codes: torch.Tensor, space: MaskSpace,
                  tiles: Tiles) -> Optional[Mask]:
    """``mask`` without the parts of its ``&`` chain that allow everything in every PARTIAL
    block of ``codes`` (``[Bm, Hm, R, C]``, :func:`block_codes`): a part whose own block map is
    FULL wherever ``codes`` is PARTIAL forbids nothing a PARTIAL tile must check, so those
    tiles evaluate the rest alone (EMPTY and FULL blocks already carry it). Documents aligned
    to the sparse blocks under causal: every PARTIAL block is a diagonal one inside one
    document, and the tiles evaluate causal alone. Only structured parts (bands, padding,
    documents: block maps in O(blocks)) are considered; the others are kept (a dense part's map
    would evaluate every element again, and a bias is added, not only tested)."""
    leaves = and_leaves(mask)
    if len(leaves) < 2:
        return mask
    partial = codes == PARTIAL

    def needed(leaf: Mask) -> bool:
        if not isinstance(leaf, (_Band, _Padding, _Documents)):
            return True
        own = leaf.block_map(tiles.sparse_q, tiles.sparse_k, space)
        return bool((partial & (own != FULL)).any())
    kept = [leaf for leaf in leaves if needed(leaf)]
    return functools.reduce(operator.and_, kept) if kept else None


def compile_mask(mask: Optional[Mask], space: MaskSpace) -> MaskProgram:
    """Turn ``mask`` into a :class:`MaskProgram` for ``space`` (the inputs' ``[B, H, Tq, Tk]``)."""
    program = MaskProgram()
    full = (space.batch, space.heads, space.q_len, space.kv_len)
    loaded, biases = [], []
    for leaf in and_leaves(mask):
        if isinstance(leaf, _Band):
            shift = leaf._shift(space)
            if leaf.left is not None:
                lo = shift - leaf.left
                program.band_lo = lo if program.band_lo is None else max(program.band_lo, lo)
            if leaf.right is not None:
                hi = shift + leaf.right
                program.band_hi = hi if program.band_hi is None else min(program.band_hi, hi)
        elif isinstance(leaf, _Padding) and leaf.has_starts():
            if program.q_docs is None:  # the document-range slot: each row's range on the other side
                program.q_docs, program.kv_docs = _padding_ranges(leaf, space)
                program.doc_ranges = True
            else:  # the slot is taken by documents(): evaluated once, loaded per tile
                loaded.append(leaf.to_dense(space))
        elif isinstance(leaf, _Padding):
            for name, lengths in (("q_lengths", leaf.q_lengths), ("kv_lengths", leaf.kv_lengths)):
                if lengths is None:
                    continue
                lengths = _as_lengths(lengths, space.batch, space.device)
                current = getattr(program, name)
                setattr(program, name, lengths if current is None else torch.minimum(current, lengths))
        elif isinstance(leaf, _Documents) and program.q_docs is None:
            q_ids, kv_ids = leaf.q_ids.to(space.device), leaf.kv_ids.to(space.device)
            q_ranges = _doc_ranges(q_ids, kv_ids, space.batch)
            kv_ranges = _doc_ranges(kv_ids, q_ids, space.batch) if q_ranges is not None else None
            if kv_ranges is not None:
                program.q_docs, program.kv_docs, program.doc_ranges = q_ranges, kv_ranges, True
            else:
                program.q_docs, program.kv_docs = _as_ids(q_ids, kv_ids, space)
        elif isinstance(leaf, _Intervals) and program.q_docs is None:
            # per-sequence bands, causal documents: each query's key run, each key's query run
            program.q_docs, program.kv_docs = leaf.ranges(space)
            program.doc_ranges = True
        elif isinstance(leaf, _Bias):
            biases.append(leaf.values.to(space.device))
        else:  # dense, from_function, |, ~, a second documents(): evaluated once, loaded per tile
            loaded.append(leaf.to_dense(space))
    # beyond [-Tq, Tk] a band bound changes nothing (kv - q lies in [1 - Tq, Tk - 1]): clamped
    # there, the kernels' position + bound sums cannot overflow
    if program.band_lo is not None:
        program.band_lo = min(max(program.band_lo, -space.q_len), space.kv_len)
    if program.band_hi is not None:
        program.band_hi = min(max(program.band_hi, -space.q_len), space.kv_len)
    if loaded:
        allowed = loaded[0]
        for more in loaded[1:]:
            allowed = allowed & more
        program.allowed = allowed.view(torch.int8).expand(full)
    if biases:
        total = biases[0]
        for more in biases[1:]:
            total = total + more
        program.bias = total.expand(full)
    return program


# ---- block lists ------------------------------------------------------------------------------
@dataclass
class BlockLists:
    """Per (batch, head, row): the listed blocks of that row, PARTIAL first then FULL.

    ``num_partial``/``num_full`` int32 ``[B, H, R]`` and ``index`` int32 ``[B, H, R, C]``
    (entries past ``num_partial + num_full`` are unused); broadcast dims have stride 0.
    ``order`` int32 ``[R]``: the rows by decreasing work (summed over batch and heads; a
    PARTIAL block weighs 5/4 of a FULL one), ties in row order; the ``+lpt`` walks launch them
    in that order. ``order_kind``: 0 when that is the rows' own order, 1 when it is the
    reverse (causal rows), 2 otherwise: the kernels compute the first two and load the third.
    ``partial_strided``/``full_strided``: every row's PARTIAL (FULL) blocks are evenly spaced
    (consecutive, or any one or two blocks), so the kernels compute their positions instead
    of loading each (``PARTIAL_STRIDED``, ``FULL_STRIDED`` in ``kernels.py``).
    """

    num_partial: torch.Tensor
    num_full: torch.Tensor
    index: torch.Tensor
    order: torch.Tensor
    order_kind: int = 2
    partial_strided: bool = False
    full_strided: bool = False

    def args(self) -> dict:
        sn, si = self.num_partial.stride(), self.index.stride()
        return dict(num_partial=self.num_partial, num_full=self.num_full, index=self.index,
                    order=self.order, ORDER_KIND=self.order_kind,
                    PARTIAL_STRIDED=self.partial_strided, FULL_STRIDED=self.full_strided,
                    s_n_b=sn[0], s_n_h=sn[1], s_n_r=sn[2], s_i_b=si[0], s_i_h=si[1], s_i_r=si[2])

    def visited(self) -> int:
        """Number of (batch, head, block) tiles a kernel walking these lists visits."""
        return int((self.num_partial.long() + self.num_full.long()).sum())


def block_lists(codes: torch.Tensor, batch: int, heads: int) -> BlockLists:
    """Block codes ``[Bm, Hm, R, C]`` (EMPTY/PARTIAL/FULL) → :class:`BlockLists` over rows R."""
    rank = torch.where(codes == PARTIAL, 0, torch.where(codes == FULL, 1, 2))  # list order
    index = torch.sort(rank, dim=-1, stable=True).indices.to(torch.int32).contiguous()
    num_partial = (codes == PARTIAL).sum(-1, dtype=torch.int32)
    num_full = (codes == FULL).sum(-1, dtype=torch.int32)
    rows, cols = codes.shape[-2:]
    work = (5 * num_partial.long() + 4 * num_full.long()).sum((0, 1))  # [R]
    order = torch.sort(work, descending=True, stable=True).indices.to(torch.int32)
    own = torch.arange(rows, dtype=torch.int32, device=order.device)
    kind = 0 if torch.equal(order, own) else 1 if torch.equal(order, own.flip(0)) else 2
    return BlockLists(num_partial.expand(batch, heads, rows), num_full.expand(batch, heads, rows),
                      index.expand(batch, heads, rows, cols), order, kind,
                      _strided(index, torch.zeros_like(num_partial), num_partial),
                      _strided(index, num_partial, num_full))


def _strided(index: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> bool:
    """Whether in every row of ``index [..., R, C]`` the ``count [..., R]`` entries from
    position ``first [..., R]`` on (ascending) are evenly spaced blocks: the kernels' step
    is the first two entries' difference."""
    cols = index.shape[-1]
    if cols == 0:
        return True
    start = first.long().unsqueeze(-1)  # [..., R, 1]
    offset = torch.arange(cols, device=index.device) - start  # place within the entries
    inside = (offset >= 0) & (offset < count.long().unsqueeze(-1))
    entries = index.long()
    base = entries.gather(-1, start.clamp(max=cols - 1))
    step = entries.gather(-1, (start + 1).clamp(max=cols - 1)) - base
    step = torch.where(count.long().unsqueeze(-1) > 1, step, 1)
    return bool(((entries == base + offset * step) | ~inside).all())


def block_codes(mask: Optional[Mask], space: MaskSpace, tiles: Tiles) -> torch.Tensor:
    """The mask's block map at the sparse granularity, ``[Bm, Hm, R, C]`` int8, with FULL blocks
    that reach past the end of either sequence downgraded to PARTIAL (they need bounds checks)."""
    rows, cols = math.ceil(space.q_len / tiles.sparse_q), math.ceil(space.kv_len / tiles.sparse_k)
    if mask is None:
        codes = torch.full((1, 1, rows, cols), FULL, dtype=torch.int8, device=space.device)
    else:
        codes = mask.block_map(tiles.sparse_q, tiles.sparse_k, space).to(torch.int8).clone()
    if space.q_len % tiles.sparse_q and rows:
        last = codes[..., -1, :]
        last[last == FULL] = PARTIAL
    if space.kv_len % tiles.sparse_k and cols:
        last = codes[..., -1]
        last[last == FULL] = PARTIAL
    return codes


# ---- one call's plan ----------------------------------------------------------------------------
@dataclass
class Layout:
    """What depends on the mask and the shapes alone: the mask program and the block lists.
    Cached between calls (:func:`layout`), so a training step that reuses a mask pays for its
    block map once, as FlexAttention's ``create_block_mask`` is paid once."""

    program: MaskProgram
    codes: torch.Tensor  # [Bm, Hm, R, C] sparse block codes
    batch: int
    heads: int
    rows: BlockLists  # query rows → key blocks (forward, dQ)
    _cols: Optional[BlockLists] = field(default=None, repr=False)
    _slots: Optional[tuple[torch.Tensor, int]] = field(default=None, repr=False)
    calls: dict = field(default_factory=dict, repr=False)  # launch templates (see _reuse)

    @property
    def cols(self) -> BlockLists:
        """Key columns → query blocks (dK/dV), built on first use (the backward)."""
        if self._cols is None:
            self._cols = block_lists(self.codes.transpose(-1, -2), self.batch, self.heads)
        return self._cols

    @property
    def slots(self) -> tuple[torch.Tensor, int]:
        """For the stored-dS backward (:data:`BACKWARD`), built on first use: ``(slots,
        entries)``. ``slots`` int32, shaped and strided as ``cols.index`` ``[B, H, C, R]``: for
        entry ``j`` of key column ``c`` (query row ``r``), the place ``e`` of ``c`` in row ``r``'s
        forward list, the slot dK/dV stores that tile's dS in and dQ reads it from.
        ``entries``: the most blocks any row lists (the buffer's ``E``)."""
        if self._slots is None:
            rows, cols = _unexpanded(self.rows.index).long(), _unexpanded(self.cols.index).long()
            place = torch.empty_like(rows)  # [Bm, Hm, R, C]: column c's place in row r's list
            place.scatter_(-1, rows, torch.arange(rows.shape[-1], device=rows.device).expand_as(rows))
            slots = place.transpose(-1, -2).gather(-1, cols).to(torch.int32)  # [Bm, Hm, C, R]
            slots = slots.expand(self.cols.index.shape)
            assert slots.stride() == self.cols.index.stride()  # the kernel reuses index's strides
            entries = int((self.rows.num_partial + self.rows.num_full).max()) if rows.numel() else 0
            self._slots = (slots, entries)
        return self._slots


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, ...]`` without the batch and head broadcast an ``expand`` gave it."""
    return t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride()[:2])]


@dataclass
class Plan:
    """Everything the kernels need besides the tensors: the call's scale and mode, the tiles,
    and the (possibly shared) :class:`Layout`."""

    scale: float
    interpret: bool
    tiles: Tiles
    layout: Layout
    backward: str = "recompute"  # :data:`BACKWARD` when the call was planned

    @property
    def program(self) -> MaskProgram:
        return self.layout.program

    @property
    def codes(self) -> torch.Tensor:
        return self.layout.codes

    @property
    def rows(self) -> BlockLists:
        return self.layout.rows

    @property
    def cols(self) -> BlockLists:
        return self.layout.cols

    @property
    def slots(self) -> tuple[torch.Tensor, int]:
        return self.layout.slots

    @property
    def tune_key(self) -> int:
        """Batch × heads and lengths (as powers of two: the grid's size), the mask features and
        whether the PARTIAL and FULL blocks are evenly spaced, packed into one int for the
        autotuner (6 bits per size, the 10 flags below them: 28 bits)."""
        flags = [*self.program.flags().values(), self.rows.partial_strided, self.rows.full_strided]
        key = sum(int(on) << i for i, on in enumerate(flags))
        sizes = (self.codes.shape[-1], self.codes.shape[-2], self.layout.batch * self.layout.heads)
        for i, size in enumerate(sizes):
            key |= max(size, 1).bit_length() << (len(flags) + 6 * i)
        return key


_LAYOUTS = MaskCache(32)


def layout(mask: Optional[Mask], space: MaskSpace, tiles: Tiles) -> Layout:
    """The :class:`Layout` of ``mask`` over ``space``, from the cache when this mask (same
    tensors, unmodified) was planned for the same shapes before."""
    def build() -> Layout:
        codes = block_codes(mask, space, tiles)
        program = compile_mask(needed_leaves(mask, codes, space, tiles), space)
        return Layout(program=program, codes=codes, batch=space.batch, heads=space.heads,
                      rows=block_lists(codes, space.batch, space.heads))
    return _LAYOUTS.get(mask, (space, tiles), build)


def make_plan(inputs: Inputs, tiles: Optional[Tiles] = None) -> Plan:
    """The plan of one call: its scale and mode, and the mask's (cached) layout."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"launch.BACKWARD={BACKWARD!r}: use one of {', '.join(BACKWARDS)}")
    interpret = interpreting()
    tiles = tiles or (INTERPRETER_TILES if interpret else GPU_TILES)
    return Plan(scale=inputs.scale, interpret=interpret, tiles=tiles,
                layout=layout(inputs.mask, inputs.space, tiles), backward=BACKWARD)


# ---- launches ------------------------------------------------------------------------------------
def _strides(prefix: str, t: torch.Tensor) -> dict:
    return {f"s_{prefix}_{axis}": s for axis, s in zip("bhtd", t.stride())}


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> dict:
    """Arguments every attention kernel takes: :func:`_shapes` and the mask program."""
    args = _shapes(q, k, v, plan)
    args.update(plan.program.args(plan.rows.num_partial))
    args.update(plan.program.flags())
    return args


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> dict:
    """Shapes, scale, tiles and dtype switches (what :func:`_common` passes besides the mask)."""
    dk, dv = q.shape[-1], v.shape[-1]
    return dict(q_len=q.shape[2], kv_len=k.shape[2], head_dk=dk, head_dv=dv,
                qk_scale=plan.scale * LOG2E, TUNE_KEY=plan.tune_key,
                SPARSE_Q=plan.tiles.sparse_q, SPARSE_K=plan.tiles.sparse_k,
                DK_PAD=head_pad(dk), DV_PAD=head_pad(dv),
                EVEN_DK=dk == head_pad(dk), EVEN_DV=dv == head_pad(dv),
                BOUNDS=bool(q.shape[2] % plan.tiles.sparse_q or k.shape[2] % plan.tiles.sparse_k),
                TMA_OK=False,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=plan.interpret and q.dtype == torch.bfloat16)


@dataclass
class Call:
    """One kernel launch as data: kernel ``name``, its arguments (without ``BLOCK_M``/``BLOCK_N``),
    ``grid(BLOCK_M, BLOCK_N, ORDERED)``, and the fixed blocks used under the interpreter. Kept
    separate from running it so ``benchmarks/gpu.py --compile-only`` can build each kernel
    offline."""

    name: str
    args: dict
    grid: Callable[[int, int, bool], tuple[int, int]]
    fixed: Optional[tuple[int, int]]
    walk: str = "partial_first"  # under the interpreter
    tuned: dict = field(default_factory=dict)
    """``{"config": triton.Config}`` once the autotuner has chosen for these arguments, and
    ``"direct"``: the compiled kernels kept for direct launches (see :data:`DIRECT_LAUNCH`);
    shared by a template and the calls made from it (see :func:`_reuse`)."""
    swapped: tuple = ()
    """The tensor arguments this call swapped into its template (:func:`_reuse`): all that may
    differ between the template's calls besides ``TMA_OK`` (empty: not made from a template,
    no direct launch)."""

    def run(self, interpret: bool) -> None:
        """A fixed config under the interpreter. Compiled: ``triton.autotune`` over the configs
        the first time, then the chosen config through ``JITFunction`` (the autotuner's own
        lookup costs ~120 µs of host time per launch with this many arguments), whose compiled
        kernel is kept and launched directly from then on (:data:`DIRECT_LAUNCH`)."""
        if interpret:
            self._launch(*self.fixed, self.walk)
            return
        if self.args.get("TMA_OK") or self.args.get("DS_TMA"):  # descriptors made in-kernel
            _scratch_allocator()
        if _PINNED:
            block_m, block_n, warps, stages, walk = pinned_config(
                self.name, max(self.args["DK_PAD"], self.args["DV_PAD"]), _PINNED[-1])
            self._launch(block_m, block_n, walk, num_warps=warps, num_stages=stages)
            return
        tuner = _tuned(self.name)
        config = self.tuned.get("config")
        if config is None:
            tuner[lambda meta: self.grid(meta["BLOCK_M"], meta["BLOCK_N"], meta["ORDERED"])](**self.args)
            self.tuned["config"] = tuner.best_config  # the config this call ran with
        else:
            meta = config.kwargs
            grid = self.grid(meta["BLOCK_M"], meta["BLOCK_N"], meta["ORDERED"])
            # only a template's calls (their swapped tensors known) launch directly
            key = _direct_key(self.args, self.swapped) if self.swapped else None
            direct = self.tuned.setdefault("direct", {})  # key → (kernel, values, swaps)
            if DIRECT_LAUNCH and key in direct:
                kernel, values, swaps = direct[key]
                values = list(values)
                for i, name in swaps:
                    values[i] = self.args[name]
                kernel[(*grid, 1)](*values)  # a compiled kernel's launcher takes all three axes
                return
            kernel = tuner.fn[grid](**self.args, **config.all_kwargs())
            python_fn = getattr(tuner.fn, "fn", None)  # the kernel's Python function
            slots = _slots(python_fn, self.args, meta) if python_fn is not None else None
            if key is not None and slots is not None and hasattr(kernel, "__getitem__"):
                # this call's tensors left out: the layout's cache must not keep them alive
                values = [None if name in self.swapped else self.args.get(name, value)
                          for name, value in slots]
                swaps = [(i, name) for i, (name, _) in enumerate(slots) if name in self.swapped]
                direct[key] = (kernel, values, swaps)


    def _launch(self, block_m: int, block_n: int, walk: str, **options) -> None:
        """This kernel with one config, no autotuner (``options``: ``num_warps`` etc.)."""
        flags = WALKS[walk]
        getattr(kernels(), self.name)[self.grid(block_m, block_n, flags["ORDERED"])](
            BLOCK_M=block_m, BLOCK_N=block_n, **flags, **options, **self.args)


DIRECT_LAUNCH = True
"""Launch a template's compiled kernel directly once ``JITFunction`` has launched it
(``CompiledKernel[grid](*args)``, every parameter in order): this skips Triton's per-launch
argument binding and specialization of the ~90 parameters here, which the GPU waits for when
the kernels are short: on an H200's host (triton 3.6) a forward launch took 213–260 µs
through ``JITFunction`` and 25–37 µs directly. ``benchmarks/gpu.py`` checks the direct
launches against the ``JITFunction`` ones and turns this off if they differ."""


def _direct_key(args: dict, swapped: tuple) -> tuple:
    """What a compiled kernel was specialized on that can change between calls of one template
    (:func:`_reuse` fixes shapes, strides and dtypes, and every argument but the ``swapped``
    tensors): the TMA switch and each swapped tensor's 16-byte alignment, the property Triton
    specializes pointers on."""
    return args.get("TMA_OK"), tuple(args[name].data_ptr() % 16 == 0 for name in swapped)


def _slots(fn: Callable, args: dict, meta: dict) -> Optional[list[tuple[str, object]]]:
    """The kernel function ``fn``'s parameters in order, each with its value when not in the
    call's ``args``: the config's (``meta``: blocks and walk flags) or the default. ``None``
    when a parameter has neither (no direct launch then)."""
    import inspect

    slots = []
    for name, param in inspect.signature(fn).parameters.items():
        if name in meta:
            slots.append((name, meta[name]))
        elif name in args or param.default is not inspect.Parameter.empty:
            slots.append((name, None if name in args else param.default))
        else:
            return None
    return slots


def _scratch_allocator() -> None:
    """Give Triton an allocator for the global scratch memory in-kernel tensor descriptors live
    in (``+tma`` walks), unless this thread's context has one already (the user's is kept)."""
    import triton

    try:
        from triton.runtime import _allocation
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


CALLS_PER_LAYOUT = 16


def _reuse(plan: Plan, name: str, tensors: dict, build: Callable[[], "Call"],
           extra: tuple = ()) -> "Call":
    """The launch ``name`` for these tensors: built once per (layout, scale, shapes, strides,
    dtypes, and the ``extra`` switches ``build`` reads) and kept on the layout, then only the
    tensors are swapped in (the ~75 arguments are otherwise rebuilt on every call: host time
    the GPU waits for on small problems)."""
    key = (name, plan.scale, plan.interpret, plan.tiles, *extra,
           *((t.shape, t.stride(), t.dtype) for t in tensors.values()))
    calls = plan.layout.calls
    template = calls.get(key)
    if template is None:
        built = build()
        if len(calls) >= CALLS_PER_LAYOUT:
            calls.pop(next(iter(calls)))
        # kept without this call's tensors: the cache must not hold activations alive
        calls[key] = dataclasses.replace(
            built, args={name: value for name, value in built.args.items() if name not in tensors})
        return built
    return Call(template.name, {**template.args, **tensors}, template.grid, template.fixed,
                template.walk, template.tuned, tuple(tensors))


def _grid(length: int, sparse: int, axis: int, heads: int) -> Callable[[int, int, bool], tuple[int, int]]:
    """``grid(BLOCK_M, BLOCK_N, ORDERED)`` of a kernel whose programs split ``length`` positions
    into kernel blocks (``BLOCK_M`` for ``axis`` 0, ``BLOCK_N`` for 1), one row of programs per
    (batch, head). Ordered launches cover whole sparse blocks (each program's block comes from
    the order); programs past the end return at once."""
    def grid(block_m: int, block_n: int, ordered: bool) -> tuple[int, int]:
        block = (block_m, block_n)[axis]
        return (cdiv(length, sparse) * (sparse // block) if ordered else cdiv(length, block), heads)
    return grid


def forward_call(q, k, v, out, lse, plan: Plan) -> Call:
    """The forward launch filling ``out [B, H, Tq, Dv]`` and ``lse [B, H, Tq]`` (float32)."""
    tensors = dict(Q=q, K=k, V=v, Out=out, Lse=lse)

    def build() -> Call:
        batch, heads, q_len, _ = q.shape
        args = dict(tensors, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                    **_strides("o", out),
                    s_l_b=lse.stride(0), s_l_h=lse.stride(1), s_l_t=lse.stride(2),
                    heads=heads, group=heads // k.shape[1], **_common(q, k, v, plan),
                    **plan.rows.args())
        return Call("attn_fwd", args, _grid(q_len, plan.tiles.sparse_q, 0, batch * heads),
                    plan.tiles.fwd, plan.tiles.walk)
    call = _reuse(plan, "attn_fwd", tensors, build)
    call.args["TMA_OK"] = _tma_ok(k, v)  # per call: the strides are the template's, not the pointers
    return call


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the ``+tma`` walks may describe these ``[B, H, T, D]`` (or ``[B, H, T]``) tensors
    to the TMA unit (made per (batch, head) in the kernel, a ``[T, D]`` or ``[T]`` descriptor):
    unit stride along the last dim, 16-byte aligned base pointers and other strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


def dkdv_call(q, k, v, dout, lse2, delta_, dk, dv, plan: Plan,
              ds: Optional[torch.Tensor] = None) -> Call:
    """The launch filling ``dk [B, Hkv, Tk, Dk]`` and ``dv [B, Hkv, Tk, Dv]`` (``lse2``, ``delta_``:
    the ``[B, H, Tq]`` row statistics, written before it by :func:`dq_call`'s kernel or
    :func:`stats_call`'s), and, given ``ds`` (:func:`ds_buffer`), every tile's dS there for
    :func:`dq_stored_call`."""
    # without ds, DS is a placeholder the kernel never touches (STORE_DS off)
    tensors = dict(Q=q, K=k, V=v, dOut=dout, Lse2=lse2, Delta=delta_, dK=dk, dV=dv,
                   DS=dk if ds is None else ds)

    def build() -> Call:
        batch, heads, _, _ = q.shape
        heads_kv, kv_len = k.shape[1], k.shape[2]
        args = dict(tensors, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                    **_strides("do", dout), **_strides("dk", dk), **_strides("dv", dv),
                    heads=heads, heads_kv=heads_kv, group=heads // heads_kv, sm_scale=plan.scale,
                    **_common(q, k, v, plan), **plan.cols.args())
        # storing dS changes which config is fastest: its own tunings (bit 30 of TUNE_KEY)
        args.update(_ds_args(ds, plan), STORE_DS=ds is not None,
                    TUNE_KEY=plan.tune_key | (ds is not None) << 30,
                    slots=plan.slots[0] if ds is not None else plan.cols.index,
                    DS_TMA=ds is not None and DS_BY_TMA and _has_tma(ds.device, plan.interpret))
        return Call("attn_bwd_dkdv", args, _grid(kv_len, plan.tiles.sparse_k, 1, batch * heads_kv),
                    plan.tiles.dkdv, plan.tiles.walk)
    call = _reuse(plan, "attn_bwd_dkdv", tensors, build, extra=(ds is not None,))
    # the walked query rows and their stats; with GQA the kernel would remake the descriptors
    # per query head inside its loop over them, a path no GPU has run yet: pointers there
    call.args["TMA_OK"] = q.shape[1] == k.shape[1] and _tma_ok(q, dout, lse2, delta_)
    return call


DS_BY_TMA = True
"""dK/dV stores its dS tiles by TMA where the device has it (sm90 on, and the interpreter), in
every walk: in offline sm90 builds of the flat 32×128 loops that adds ~45 SASS instructions a
tile (258/299 → 301/344, ``results/compile_sm90.json``), where a pointer store (through a
blocked layout: a shuffle through shared memory) added ~110. Off: pointer stores."""


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device, interpret: bool) -> bool:
    """Whether kernels may make tensor descriptors for ``device`` (the interpreter emulates
    them); asked per call, answered once."""
    return interpret or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def _ds_args(ds: Optional[torch.Tensor], plan: Plan) -> dict:
    """The stored-dS buffer's strides and rows of ``SPARSE_Q`` (``ds_rows``, its TMA view's
    height), for dK/dV and dQ-stored (0 without a buffer)."""
    strides = ds.stride()[:4] if ds is not None else (0, 0, 0, 0)
    return dict(zip(("s_ds_b", "s_ds_h", "s_ds_r", "s_ds_e"), strides),
                ds_rows=0 if ds is None else ds.numel() // plan.tiles.sparse_q)


def dq_call(q, k, v, dout, out, lse, dlse, lse2, delta_, dq, plan: Plan) -> Call:
    """The launch filling ``dq [B, H, Tq, Dk]``, and first the backward's row statistics for
    :func:`dkdv_call`, which runs after it: ``delta_ [B, H, Tq]`` = rowsum(dout ∘ out) − ``dlse``
    (the LSE's gradient, ``None`` for none), and ``lse2`` = ``lse`` in base 2 (``+inf`` where
    ``lse`` is ``-inf``). ``out``: the forward's; ``lse``, ``dlse``, ``lse2``, ``delta_``:
    float32, contiguous."""
    # without an LSE gradient, dLse is a placeholder the kernel never reads (HAS_DLSE off)
    tensors = dict(Q=q, K=k, V=v, dOut=dout, Out=out, Lse=lse, dLse=lse if dlse is None else dlse,
                   Lse2=lse2, Delta=delta_, dQ=dq)

    def build() -> Call:
        batch, heads, q_len, _ = q.shape
        args = dict(tensors, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                    **_strides("do", dout), **_strides("o", out), **_strides("dq", dq),
                    heads=heads, group=heads // k.shape[1], sm_scale=plan.scale,
                    **_common(q, k, v, plan), **plan.rows.args(), HAS_DLSE=dlse is not None)
        return Call("attn_bwd_dq", args, _grid(q_len, plan.tiles.sparse_q, 0, batch * heads),
                    plan.tiles.dq, plan.tiles.walk)
    call = _reuse(plan, "attn_bwd_dq", tensors, build, extra=(dlse is not None,))
    call.args["TMA_OK"] = _tma_ok(k, v)
    return call


BACKWARD = "auto"
"""How the backward computes dQ:

- ``"recompute"``: dQ's programs recompute each tile's scores and dP (three matmuls a tile, as
  FlexAttention's backward; seven a tile with dK/dV's four), no atomics and no buffer; dQ
  runs first and writes the row statistics dK/dV reads.
- ``"stored_ds"``: a small kernel writes the row statistics, dK/dV also stores each tile's dS
  (q's dtype) in a buffer of one slot per listed sparse block (:func:`ds_buffer`), and dQ is
  ``dS·K`` from there (one matmul a tile: five in all, as FlashAttention-2/3's atomic dQ, yet
  deterministic). Costs the buffer (``B·H·R·E`` slots of 128×128) and its write and read.
- ``"auto"``: ``"stored_ds"`` for sparse masks (no query row lists more than half the key
  blocks) whose buffer fits :data:`STORED_DS_MAX_BYTES`, else ``"recompute"``.

``"auto"`` is the default: the stored path took less device time than the recomputing one
on every workload profiled on a GPU (docs/BENCHMARKS.md), and its buffer grows with the
listed blocks, so it is taken where that stays small against the work (sparse masks) and
bounded. A call's backward follows the value when its forward was planned
(:attr:`Plan.backward`; :func:`backward_path` sets it for a block)."""
BACKWARDS = ("recompute", "stored_ds", "auto")

STORED_DS_MAX_BYTES = 2 << 30


@contextlib.contextmanager
def backward_path(mode: str):
    """Inside this block, calls plan their backward as ``mode`` (:data:`BACKWARD`)."""
    global BACKWARD
    before, BACKWARD = BACKWARD, mode
    try:
        yield
    finally:
        BACKWARD = before


def stores_ds(q: torch.Tensor, plan: Plan) -> bool:
    """Whether this backward takes the stored-dS path (:attr:`Plan.backward`)."""
    if plan.backward != "auto":
        return plan.backward == "stored_ds"
    _, entries = plan.slots
    sparse = 2 * entries <= plan.codes.shape[-1]
    return sparse and ds_bytes(q, plan) <= STORED_DS_MAX_BYTES


def _ds_shape(q: torch.Tensor, plan: Plan) -> tuple[int, ...]:
    """``[B, H, R, E, SPARSE_K, SPARSE_Q]``: R query block rows, E the most blocks a row lists
    (:attr:`Layout.slots`)."""
    return (*q.shape[:2], plan.codes.shape[-2], plan.slots[1], plan.tiles.sparse_k,
            plan.tiles.sparse_q)


def ds_bytes(q: torch.Tensor, plan: Plan) -> int:
    """Size of :func:`ds_buffer` for ``q [B, H, Tq, D]``."""
    return math.prod(_ds_shape(q, plan)) * q.element_size()


def ds_buffer(q: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The stored-dS buffer (:func:`_ds_shape`) in q's dtype; uninitialised, as dK/dV writes
    every slot dQ reads."""
    return torch.empty(_ds_shape(q, plan), dtype=q.dtype, device=q.device)


def stats_call(out, dout, lse, dlse, lse2, delta_, plan: Plan) -> Call:
    """The stored-dS backward's first launch: the row statistics ``delta_`` and ``lse2`` (as
    :func:`dq_call` writes them) for dK/dV."""
    tensors = dict(dOut=dout, Out=out, Lse=lse, dLse=lse if dlse is None else dlse, Lse2=lse2,
                   Delta=delta_)

    def build() -> Call:
        batch, heads, q_len, dv = out.shape
        args = dict(tensors, **_strides("do", dout), **_strides("o", out), heads=heads,
                    q_len=q_len, head_dv=dv, TUNE_KEY=0, DK_PAD=head_pad(dv),
                    DV_PAD=head_pad(dv), HAS_DLSE=dlse is not None)
        return Call("attn_bwd_stats", args, _grid(q_len, plan.tiles.sparse_q, 0, batch * heads),
                    plan.tiles.dq, "partial_first")
    return _reuse(plan, "attn_bwd_stats", tensors, build, extra=(dlse is not None,))


def dq_stored_call(q, k, v, ds, dq, plan: Plan) -> Call:
    """The stored-dS backward's last launch: ``dq [B, H, Tq, Dk]`` = scale · dS·K from the
    buffer :func:`dkdv_call` filled."""
    tensors = dict(K=k, DS=ds, dQ=dq)

    def build() -> Call:
        batch, heads, q_len, _ = q.shape
        args = dict(tensors, **_strides("k", k), **_strides("dq", dq), heads=heads,
                    group=heads // k.shape[1], sm_scale=plan.scale, **_shapes(q, k, v, plan),
                    **plan.rows.args())
        args.update(_ds_args(ds, plan))
        return Call("attn_bwd_dq_stored", args, _grid(q_len, plan.tiles.sparse_q, 0, batch * heads),
                    plan.tiles.dq, plan.tiles.walk)
    call = _reuse(plan, "attn_bwd_dq_stored", tensors, build)
    call.args["TMA_OK"] = _tma_ok(k) and _has_tma(k.device, plan.interpret)
    return call


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
