"""Host side of the triton backend: what the kernels are told, and how they are launched.

Built once per mask and shapes (:class:`Layout`, cached) and kept for the backward:

- :class:`MaskProgram`: the mask as the kernels evaluate it in PARTIAL tiles. The parts of
  its ``&`` chain that have a :class:`~attnkit.masks.Structure` become arithmetic (one band,
  per-batch lengths, per-row ranges or document ids, a bias); the rest is materialised once
  as an int8 ``[B, H, Tq, Tk]`` view and loaded per tile.
- :class:`BlockLists`: the mask's block map at the sparse granularity as per-row lists,
  PARTIAL blocks first then FULL ones (FlexAttention's ``kv_indices``/``full_kv_indices``);
  EMPTY blocks are never listed. Forward and dQ walk rows, dK/dV the transposed lists.

Kernel blocks are autotuned on a GPU (:data:`CONFIGS`) inside fixed 128×128 sparse blocks, so
the lists do not depend on the config; the interpreter runs one small fixed config.

Interpreter or compiler is a per-process choice: Triton reads ``TRITON_INTERPRET`` when
``@triton.jit`` decorates a function, its own library included (at triton's first import), and
an interpreted kernel cannot call a compiled library function. So :func:`interpreting` reads
the mode off the library and :func:`kernels` loads ``kernels.py`` decorated in that mode.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import operator
import os
import sys
import threading
from collections import namedtuple
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Optional

import torch

from ...inputs import Inputs
from ...masks import EMPTY, FULL, PARTIAL, Mask, MaskCache, MaskSpace, key_starts

LOG2E = 1.4426950408889634

_FLAVOURS: dict[bool, ModuleType] = {}
_MODE: list[bool] = []
_TUNED: dict[tuple, object] = {}
_TUNING = threading.Lock()
"""Held while a template tunes (its first compiled launch): ``triton.autotune`` keeps a run's
state on the tuner (its ``best_config``, the arguments), which a thread tuning another
template at the same time would overwrite."""
_TEMPLATES = threading.Lock()
"""Guards the insertion and eviction of a layout's launch templates (:func:`_template`)."""
_LOADING = threading.Lock()
"""Held while :func:`kernels` loads a mode's module: threads calling first at once share one
(each module's kernels compile on their own)."""


# ---- interpreter or compiler --------------------------------------------------------------------
def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (as Triton itself reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether this process runs Triton kernels through the interpreter: fixed when triton was
    first imported (importing it now, under the current environment, if nobody has yet)."""
    if not _MODE:
        import triton
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        probe = getattr(tl, "zeros", None)  # a @jit function of triton's own library
        if not isinstance(probe, (InterpretedFunction, JITFunction)):
            return bool(triton.knobs.runtime.interpret)
        _MODE.append(isinstance(probe, InterpretedFunction))
    return _MODE[0]


def cpu_problem() -> Optional[str]:
    """What CPU tensors need to run here, the end of a reason that says why they cannot
    (``None`` when the interpreter is on), without importing triton when it is not imported
    yet."""
    if not interpreter_requested():
        return "set TRITON_INTERPRET=1 to run its kernels on the CPU interpreter for testing"
    if "triton.language" in sys.modules and not interpreting():
        return ("set TRITON_INTERPRET=1 before triton is first imported to run its kernels on "
                "the CPU interpreter for testing (triton was imported without it)")
    return None


def kernels() -> ModuleType:
    """``kernels.py`` decorated in this process's mode, loaded once per mode."""
    interpret = interpreting()
    module = _FLAVOURS.get(interpret)
    if module is not None:
        return module
    import triton

    with _LOADING:
        if interpret not in _FLAVOURS:
            name = f"{__package__}._kernels_{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(os.path.dirname(__file__), "kernels.py"))
            module = importlib.util.module_from_spec(spec)
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = interpret
                spec.loader.exec_module(module)
            _FLAVOURS[interpret] = module
    return _FLAVOURS[interpret]


# ---- options, tiles, candidates ------------------------------------------------------------------
WALKS = {"flat": dict(ONE_LOOP=False, TMA=False), "one_loop": dict(ONE_LOOP=True, TMA=False),
         "flat+tma": dict(ONE_LOOP=False, TMA=True), "one_loop+tma": dict(ONE_LOOP=True, TMA=True)}
"""How a kernel walks its block lists (``kernels._walk``): a loop over the row's PARTIAL blocks
then one over its FULL ones (``flat``), or one loop testing per block whether to mask
(``one_loop``: one software pipeline per row, for short rows); ``+tma``: walked tiles by TMA
copies where the host allows it (:func:`_tma_ok`; else the same kernel loads by pointers)."""

BACKWARDS = ("recompute", "stored_ds", "auto")


@dataclass(frozen=True)
class Tiles:
    """Sparse-block sizes (the block-map granularity) and the interpreter's fixed kernel blocks
    ``(BLOCK_M, BLOCK_N)`` per kernel (on a GPU they are autotuned)."""

    sparse_q: int
    sparse_k: int
    fwd: tuple[int, int] = (32, 32)
    dkdv: tuple[int, int] = (32, 32)
    dq: tuple[int, int] = (32, 32)

    def __post_init__(self):
        # a kernel walks SPARSE // BLOCK kernel blocks per sparse block: a block that does not
        # divide it would skip rows or keys
        for name, (block_m, block_n) in (("fwd", self.fwd), ("dkdv", self.dkdv), ("dq", self.dq)):
            if self.sparse_q % block_m or self.sparse_k % block_n:
                raise ValueError(f"Tiles(sparse_q={self.sparse_q}, sparse_k={self.sparse_k}, "
                                 f"{name}={(block_m, block_n)}): the sparse blocks must be "
                                 f"multiples of each kernel's (BLOCK_M, BLOCK_N)")

    def fit_gpu(self) -> None:
        """A ``ValueError`` unless the sparse blocks are multiples of every block size the
        GPU autotuner may pick (:data:`CONFIGS`)."""
        largest = max(max(config[0], config[1]) for configs in CONFIGS.values()
                      for shapes in configs.values() for config in shapes)
        if self.sparse_q % largest or self.sparse_k % largest:
            raise ValueError(f"Tiles(sparse_q={self.sparse_q}, sparse_k={self.sparse_k}) on a "
                             f"GPU: the sparse blocks must be multiples of {largest}, the "
                             f"largest kernel block its autotuner may pick")


GPU_TILES = Tiles(sparse_q=128, sparse_k=128)
INTERPRETER_TILES = Tiles(sparse_q=32, sparse_k=32)
"""Interpreted, a block operation costs about the same at any size: 32×32 tiles keep tests fast
while 40–80 positions still span several blocks."""


@dataclass(frozen=True)
class TritonOptions:
    """How the triton backend runs (FlexAttention's ``kernel_options``), carried by the plan.

    ``backward``: ``"recompute"`` (dQ recomputes each tile's scores and dP, three matmuls a
    tile), ``"stored_ds"`` (dK/dV also stores each tile's dS, one slot per listed sparse
    block, and dQ is ``dS·K``, one matmul a tile), or ``"auto"``: stored for sparse masks (no
    row lists more than half the key blocks) whose buffer fits ``stored_ds_max_bytes``.
    ``tiles``, ``walk``: sparse blocks, and the interpreter's kernel blocks and walk.
    ``candidate``: on a GPU, run candidate ``i`` of each kernel's :data:`CONFIGS` list (the
    last where there are fewer) instead of autotuning (under the invariance contract, candidate
    0 unless given: a config that follows timings would follow the machine's load).
    ``tma``: use the TMA unit where the device has one. ``autotune_cache``: keep the
    autotuner's timings on disk.
    ``direct_launch``: call a kernel's binary directly after its first launches (:class:`Call`).
    ``decode_splits``: the key chunks of a decoding step (:func:`decode`; default: about two
    programs per SM)."""

    backward: str = "auto"
    stored_ds_max_bytes: int = 2 << 30
    tiles: Optional[Tiles] = None
    walk: str = "flat"
    candidate: Optional[int] = None
    tma: bool = True
    autotune_cache: bool = True
    direct_launch: bool = True
    decode_splits: Optional[int] = None

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward={self.backward!r}: use one of {', '.join(BACKWARDS)}")
        if self.walk not in WALKS:
            raise ValueError(f"walk={self.walk!r}: use one of {', '.join(WALKS)}")


def _configs(shapes: list[tuple[int, int, int, int]], walks=("flat",)) -> list[tuple]:
    """Every ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` shape in every walk."""
    return [(*shape, walk) for shape in shapes for walk in walks]


BOTH, ALL = ("flat", "one_loop"), tuple(WALKS)
CONFIGS: dict[str, dict[int, list[tuple[int, int, int, int, str]]]] = {
    "attn_fwd": {
        64: _configs([(128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)], BOTH),
        128: _configs([(128, 128, 8, 3), (128, 64, 8, 3)], ALL)
        + _configs([(128, 64, 8, 4), (64, 32, 4, 2)]),
        256: _configs([(64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)]),
    },
    "attn_bwd_dkdv": {  # BLOCK_N key rows per program, BLOCK_M query rows per step
        64: _configs([(32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)], BOTH),
        128: _configs([(32, 64, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2)])
        + _configs([(64, 128, 8, 2)], ("one_loop",)),
        256: _configs([(16, 32, 4, 2), (16, 64, 8, 2), (32, 64, 8, 2)]),
    },
    "attn_bwd_dq": {
        64: _configs([(128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)], BOTH),
        128: _configs([(128, 64, 8, 3)], ALL)
        + _configs([(128, 64, 8, 4), (128, 64, 16, 3), (64, 32, 4, 2)]),
        256: _configs([(64, 32, 8, 2), (32, 32, 4, 2)]),
    },
    "attn_bwd_dq_stored": {  # always one loop; the walk only says whether by TMA
        64: _configs([(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)], ("one_loop", "one_loop+tma")),
        128: _configs([(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)], ("one_loop+tma",))
        + _configs([(64, 64, 4, 3)], ("one_loop",)),
        256: _configs([(64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)], ("one_loop",)),
    },
    "attn_bwd_stats": {bucket: [(32, 32, 4, 1, "flat")] for bucket in (64, 128, 256)},
}
"""Autotune candidates per kernel and head-dim bucket (the larger padded head dim):
``(BLOCK_M, BLOCK_N, num_warps, num_stages, walk)``, blocks dividing the sparse blocks. At
D = 128: those within a few percent of the fastest on some timed workload
(docs/BENCHMARKS.md), and one small shape for small problems. D = 256: small flat tiles
(larger ones exceed shared memory or spill)."""


def head_bucket(head: int) -> int:
    """The :data:`CONFIGS` bucket of a padded head dim."""
    return 64 if head <= 64 else 128 if head <= 128 else 256


def head_pad(dim: int) -> int:
    """Head dim rounded up to a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, 1 << (dim - 1).bit_length())


# ---- the mask program -----------------------------------------------------------------------------
MaskArgs = namedtuple("MaskArgs", [
    "band_lo", "band_hi", "q_lens", "s_qlen", "kv_lens", "s_kvlen",
    "q_docs", "s_qdoc", "kv_docs", "s_kvdoc", "dense", "s_dense", "bias", "s_bias",
    "HAS_LO", "HAS_HI", "HAS_QLEN", "HAS_KVLEN", "HAS_DOCS", "DOC_RANGES", "HAS_DENSE",
    "HAS_BIAS"])
Lists = namedtuple("Lists", ["num_partial", "num_full", "index", "s_n", "s_i", "starts",
                             "s_start", "PARTIAL_STRIDED", "FULL_STRIDED", "SHIFTED"])
Stored = namedtuple("Stored", ["ds", "slots", "s_ds", "rows", "STORE", "BY_TMA"])
ModArgs = namedtuple("ModArgs", [
    "cap", "slopes", "s_slopes", "shift", "diag", "s_diag", "diag_off", "diag_len", "dslope",
    "s_dslope", "ddiag", "s_ddiag", "HAS_CAP", "HAS_ALIBI", "HAS_DIAG", "GRAD_SLOPE",
    "GRAD_DIAG", "ANY"])
"""Kernel arguments, one tuple each; upper-case fields are ``tl.constexpr``. ``MaskArgs``
(:meth:`MaskProgram.args`): the band bounds, lengths ``[B]`` with their batch stride,
documents (ids ``[B, T]`` or ranges ``[B, T, 2]``) with ``(batch, position)`` strides, the
dense int8 and bias views with their four strides; unused tensors are placeholders.
``Lists`` (:meth:`BlockLists.args`): counts ``[B, H, R]`` and entries ``[B, H, R, C]`` with
their strides, and the first keys ``[B]`` of shifted lists with their stride. ``Stored``
(:func:`_stored`): the dS buffer (:func:`ds_buffer`), the slots (:attr:`Layout.slots`),
the buffer's first four strides and its size over ``SPARSE_Q``,
whether dK/dV stores dS and by TMA. ``ModArgs`` (:meth:`ScoreMods.args`): the score
modifiers and, for dQ, the buffers their parameters' gradients are added into."""


@dataclass(frozen=True)
class ScoreMods:
    """Score modifiers as the kernels apply them, to the scaled scores ``s`` (natural units)
    of query ``q`` and key ``k`` (local positions), in this order: ``cap·tanh(s/cap)``
    (``cap``), ``+ slopes[b, h]·(k − q − shift)`` (``slopes`` float ``[1|B, H]``), ``+
    diag[h, k − q + diag_off]`` (``diag`` float ``[H, L]``: a relative-position bias looked up
    per distance; distances outside ``[0, L)`` add 0). Their gradients (:func:`dq_call`):
    ``dslope`` shaped as ``slopes`` (or with a slot per dQ program, :func:`slope_slots`) and
    ``ddiag`` as ``diag``, float32, added into."""

    cap: Optional[float] = None
    slopes: Optional[torch.Tensor] = None
    shift: int = 0
    diag: Optional[torch.Tensor] = None
    diag_off: int = 0

    @property
    def any(self) -> bool:
        return self.cap is not None or self.slopes is not None or self.diag is not None

    def flags(self) -> tuple[bool, bool, bool]:
        return self.cap is not None, self.slopes is not None, self.diag is not None

    def args(self, placeholder: torch.Tensor, dslope: Optional[torch.Tensor] = None,
             ddiag: Optional[torch.Tensor] = None) -> ModArgs:
        """The kernels' :data:`ModArgs`; unused tensors are ``placeholder`` with zero strides."""
        import triton.language as tl

        def given(t):  # a dim of size 1 is broadcast (slopes [1, H] over the batch)
            return (placeholder, (0, 0)) if t is None else (
                t, tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())))
        diag_len = 0 if self.diag is None else self.diag.shape[-1]
        slope_grad, s_slope_grad = given(dslope)  # a third dim: a slot per program (slope_slots)
        return ModArgs(float(self.cap or 0.0), *given(self.slopes), self.shift, *given(self.diag),
                       self.diag_off, diag_len, slope_grad, (*s_slope_grad, 0)[:3], *given(ddiag),
                       *(tl.constexpr(flag) for flag in (*self.flags(), dslope is not None,
                                                         ddiag is not None, self.any)))


NO_MODS = ScoreMods()


@dataclass
class MaskProgram:
    """What a PARTIAL tile evaluates: ``band_lo ≤ kv − q ≤ band_hi`` (``None``: unbounded);
    lengths int32 ``[B]``; ``q_docs``/``kv_docs`` int32 ids ``[B, T]``, or with ``doc_ranges``
    int32 ``[B, T, 2]`` ranges (:class:`~attnkit.masks.Structure`); ``allowed`` int8 and
    ``bias`` float ``[B, H, Tq, Tk]`` views (``-inf`` = masked). Unset features cost nothing."""

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

    def flags(self) -> list[bool]:
        return [self.band_lo is not None, self.band_hi is not None, self.q_lengths is not None,
                self.kv_lengths is not None, self.q_docs is not None, self.doc_ranges,
                self.allowed is not None, self.bias is not None]

    def args(self, placeholder: torch.Tensor) -> MaskArgs:
        """The kernels' :data:`MaskArgs`; unused tensors are ``placeholder`` with zero strides."""
        def given(t, dims):
            return (placeholder, (0,) * dims) if t is None else (t, tuple(t.stride()[:dims]))
        (ql, s_ql), (kl, s_kl) = given(self.q_lengths, 1), given(self.kv_lengths, 1)
        import triton.language as tl
        return MaskArgs(self.band_lo or 0, self.band_hi or 0, ql, s_ql[0], kl, s_kl[0],
                        *given(self.q_docs, 2), *given(self.kv_docs, 2), *given(self.allowed, 4),
                        *given(self.bias, 4), *(tl.constexpr(flag) for flag in self.flags()))


def _as_ids(q_ids: torch.Tensor, kv_ids: torch.Tensor, space: MaskSpace) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids as int32 ``[B, Tq]`` and ``[B, Tk]`` (the kernels compare 32 bits); ids
    outside the int32 range are renumbered by rank, which keeps every equality."""
    limits = torch.iinfo(torch.int32)
    if any(ids.dtype.itemsize > 4 and ids.numel() and (ids.min() < limits.min or ids.max() > limits.max)
           for ids in (q_ids, kv_ids)):
        _, ranks = torch.unique(torch.cat([q_ids.flatten(), kv_ids.flatten()]), return_inverse=True)
        q_ids, kv_ids = ranks[:q_ids.numel()].view(q_ids.shape), ranks[q_ids.numel():].view(kv_ids.shape)
    return tuple(ids.to(torch.int32).reshape(-1, length).expand(space.batch, length)
                 for ids, length in ((q_ids, space.q_len), (kv_ids, space.kv_len)))


def _leaf_needs(mask: Optional[Mask], codes: torch.Tensor, space: MaskSpace,
                tiles: Tiles) -> list[torch.Tensor]:
    """Per part of ``mask``'s ``&`` chain (none for a mask of one part), whether a PARTIAL
    tile needs it: bool 0-d tensors, not read (:func:`_kept` keeps those read true). Not
    needed: a structured part whose own block map is FULL wherever ``codes``
    (:func:`block_codes`) is PARTIAL, which forbids nothing such a tile must check (EMPTY and
    FULL blocks already carry it); e.g. documents aligned to the sparse blocks under causal,
    whose PARTIAL tiles evaluate causal alone. Dense parts and biases are always needed."""
    leaves = mask.leaves() if mask is not None else []
    if len(leaves) < 2:
        return []
    partial = codes == PARTIAL

    def needed(leaf: Mask) -> torch.Tensor:
        form = leaf.structure(space)
        if form is None or form.bias is not None:
            return torch.ones((), dtype=torch.bool, device=codes.device)
        own = leaf.block_map(tiles.sparse_q, tiles.sparse_k, space)
        return (partial & (own != FULL)).any()
    return [needed(leaf) for leaf in leaves]


def _kept(mask: Optional[Mask], needs: list) -> Optional[Mask]:
    """``mask`` with the parts of its ``&`` chain whose ``needs`` (read :func:`_leaf_needs`)
    are true; ``mask`` itself without ``needs``."""
    if not needs:
        return mask
    kept = [leaf for leaf, need in zip(mask.leaves(), needs) if need]
    return functools.reduce(operator.and_, kept) if kept else None


def compile_mask(mask: Optional[Mask], space: MaskSpace) -> MaskProgram:
    """``mask`` as a :class:`MaskProgram` over ``space`` (the inputs' ``[B, H, Tq, Tk]``): bands
    intersect into one, lengths take their minimum, the first ranges or ids take the document
    slot; anything else (and a second ranges/ids part) is loaded as a dense mask."""
    program, loaded, biases = MaskProgram(), [], []
    for leaf in (mask.leaves() if mask is not None else []):
        form = leaf.structure(space)
        if form is not None and form.diagonals is not None:
            lo, hi = form.diagonals
            if lo is not None:
                program.band_lo = lo if program.band_lo is None else max(program.band_lo, lo)
            if hi is not None:
                program.band_hi = hi if program.band_hi is None else min(program.band_hi, hi)
        elif form is not None and form.lengths is not None:
            for name, lengths in zip(("q_lengths", "kv_lengths"), form.lengths):
                if lengths is not None:
                    lengths = lengths.reshape(-1).to(space.device, torch.int32).expand(space.batch)
                    now = getattr(program, name)
                    setattr(program, name, lengths if now is None else torch.minimum(now, lengths))
        elif form is not None and (form.ranges or form.ids) and program.q_docs is None:
            program.doc_ranges = form.ranges is not None
            program.q_docs, program.kv_docs = form.ranges or _as_ids(*form.ids, space)
        elif form is not None and form.bias is not None:
            biases.append(form.bias.to(space.device))
        else:
            loaded.append(leaf.to_dense(space))
    # beyond [-Tq, Tk] a bound changes nothing; clamped, the kernels' sums cannot overflow
    program.band_lo, program.band_hi = (None if x is None else min(max(x, -space.q_len), space.kv_len)
                                        for x in (program.band_lo, program.band_hi))
    full = (space.batch, space.heads, space.q_len, space.kv_len)
    if loaded:
        program.allowed = functools.reduce(operator.and_, loaded).view(torch.int8).expand(full)
    if biases:
        program.bias = functools.reduce(operator.add, biases).expand(full)
    return program


# ---- block lists -----------------------------------------------------------------------------------
@dataclass
class BlockLists:
    """Per (batch, head, row): ``num_partial``/``num_full`` int32 ``[B, H, R]`` and the listed
    blocks ``index`` int32 ``[B, H, R, C]``, PARTIAL first (entries past the counts unused;
    broadcast dims have stride 0). ``partial_strided``/``full_strided``: every row's PARTIAL
    (FULL) blocks are evenly spaced, so the kernels compute their positions. ``starts``
    int32 ``[B]`` (shifted lists): block ``j`` of batch element ``b`` covers keys
    ``starts[b] + j·SPARSE …`` instead of ``j·SPARSE …``."""

    num_partial: torch.Tensor
    num_full: torch.Tensor
    index: torch.Tensor
    partial_strided: bool = False
    full_strided: bool = False
    starts: Optional[torch.Tensor] = None

    def args(self) -> Lists:
        import triton.language as tl
        starts = self.num_partial if self.starts is None else self.starts
        return Lists(self.num_partial, self.num_full, self.index, self.num_partial.stride(),
                     self.index.stride()[:3], starts,
                     0 if self.starts is None else self.starts.stride(0),
                     tl.constexpr(self.partial_strided), tl.constexpr(self.full_strided),
                     tl.constexpr(self.starts is not None))

    def visited(self) -> int:
        """Number of (batch, head, block) tiles a kernel walking these lists visits."""
        return int((self.num_partial.long() + self.num_full.long()).sum())


def block_lists(codes: torch.Tensor, batch: int, heads: int) -> BlockLists:
    """Block codes ``[Bm, Hm, R, C]`` → :class:`BlockLists` over rows R (one host read: its
    spacing flags)."""
    return _read_flags([_block_lists(codes, batch, heads)])[0][0]


def _read_flags(lists: list[BlockLists], more: list[torch.Tensor] = ()
                ) -> tuple[list[BlockLists], list[bool]]:
    """``lists`` (from :func:`_block_lists`) with their spacing flags, and the bool 0-d
    tensors ``more``, read in one host read."""
    flags = [flag for each in lists for flag in (each.partial_strided, each.full_strided)]
    values = torch.stack([torch.as_tensor(flag, device=lists[0].index.device)
                          for flag in [*flags, *more]]).tolist()
    read = [dataclasses.replace(each, partial_strided=values[2 * i],
                                full_strided=values[2 * i + 1]) for i, each in enumerate(lists)]
    return read, values[len(flags):]


def _block_lists(codes: torch.Tensor, batch: int, heads: int) -> BlockLists:
    """:func:`block_lists` with its spacing flags as bool 0-d tensors, not read."""
    rank = torch.where(codes == PARTIAL, 0, torch.where(codes == FULL, 1, 2))
    index = torch.sort(rank, dim=-1, stable=True).indices.to(torch.int32).contiguous()
    num_partial = (codes == PARTIAL).sum(-1, dtype=torch.int32)
    num_full = (codes == FULL).sum(-1, dtype=torch.int32)
    rows, cols = codes.shape[-2:]
    return BlockLists(num_partial.expand(batch, heads, rows), num_full.expand(batch, heads, rows),
                      index.expand(batch, heads, rows, cols),
                      _strided(index, torch.zeros_like(num_partial), num_partial),
                      _strided(index, num_partial, num_full))


def key_order_lists(codes: torch.Tensor, space: MaskSpace, sparse_k: int,
                    starts: Optional[torch.Tensor] = None) -> BlockLists:
    """The lists of the invariance contract from block codes ``[Bm, Hm, R, C]``: every block a
    row may see, in key order, all PARTIAL (the mask program runs in each, so a block gives a
    row the same bits whether or not it is whole). With ``starts`` (``[Bm]``, left padding)
    batch element ``b``'s blocks begin at its first key, as the sequence's own do when it
    runs alone; a shifted block is listed where either aligned block it overlaps is
    non-EMPTY. Its spacing flag is a bool 0-d tensor, not read (:func:`_read_flags`)."""
    batch, heads = space.batch, space.heads
    if starts is not None:
        starts = starts.to(codes.device, torch.int32).reshape(-1).expand(batch).contiguous()
        cols = codes.shape[-1]
        first = (starts.long() // sparse_k)[:, None] + torch.arange(cols, device=codes.device)
        ragged = (starts.long() % sparse_k > 0)[:, None, None, None]
        inside = starts.long()[:, None] + torch.arange(cols, device=codes.device) * sparse_k
        wide = codes.expand(batch, *codes.shape[1:])

        def seen(block: torch.Tensor) -> torch.Tensor:
            at = block.clamp(max=cols - 1)[:, None, None, :].expand_as(wide)
            return (wide.gather(-1, at) != EMPTY) & (block < cols)[:, None, None, :]
        visible = ((seen(first) | (ragged & seen(first + 1)))
                   & (inside < space.kv_len)[:, None, None, :])
    else:
        visible = codes != EMPTY
    index = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
    index = index.to(torch.int32).contiguous()
    count = visible.sum(-1, dtype=torch.int32)
    rows = codes.shape[-2]
    shape = (batch, heads, rows)
    return BlockLists(count.expand(shape), torch.zeros_like(count).expand(shape),
                      index.expand(*shape, codes.shape[-1]),
                      _strided(index, torch.zeros_like(count), count), True, starts)


def _strided(index: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Whether in every row of ``index [..., R, C]`` the ``count [..., R]`` entries from
    ``first [..., R]`` on are evenly spaced (the kernels' step: the first two's difference):
    a bool 0-d tensor, not read."""
    cols = index.shape[-1]
    if cols == 0:
        return torch.ones((), dtype=torch.bool, device=index.device)
    start = first.long().unsqueeze(-1)
    offset = torch.arange(cols, device=index.device) - start
    inside = (offset >= 0) & (offset < count.long().unsqueeze(-1))
    entries = index.long()
    base = entries.gather(-1, start.clamp(max=cols - 1))
    step = entries.gather(-1, (start + 1).clamp(max=cols - 1)) - base
    step = torch.where(count.long().unsqueeze(-1) > 1, step, 1)
    return ((entries == base + offset * step) | ~inside).all()


def block_codes(mask: Optional[Mask], space: MaskSpace, tiles: Tiles) -> torch.Tensor:
    """The block map at the sparse granularity ``[Bm, Hm, R, C]`` int8, FULL blocks that reach
    past the end of either sequence downgraded to PARTIAL (they need bounds checks)."""
    rows, cols = math.ceil(space.q_len / tiles.sparse_q), math.ceil(space.kv_len / tiles.sparse_k)
    if mask is None:
        codes = torch.full((1, 1, rows, cols), FULL, dtype=torch.int8, device=space.device)
    else:
        codes = mask.block_map(tiles.sparse_q, tiles.sparse_k, space).to(torch.int8).clone()
    if space.q_len % tiles.sparse_q and rows:
        codes[..., -1, :][codes[..., -1, :] == FULL] = PARTIAL
    if space.kv_len % tiles.sparse_k and cols:
        codes[..., -1][codes[..., -1] == FULL] = PARTIAL
    return codes


# ---- plans ----------------------------------------------------------------------------------------------
@dataclass
class Layout:
    """What depends on the mask and shapes alone, cached between calls (:func:`layout`) so a
    training step that reuses a mask pays for its block map once."""

    program: MaskProgram
    codes: torch.Tensor  # [Bm, Hm, R, C] sparse block codes
    batch: int
    heads: int
    rows: BlockLists  # query rows → key blocks (forward, dQ)
    _cols: Optional[BlockLists] = field(default=None, repr=False)
    _slots: Optional[tuple[torch.Tensor, int]] = field(default=None, repr=False)
    calls: dict = field(default_factory=dict, repr=False)  # launch templates (see _template)

    @property
    def cols(self) -> BlockLists:
        """Key columns → query blocks (dK/dV), built on first use."""
        if self._cols is None:
            self._cols = block_lists(self.codes.transpose(-1, -2), self.batch, self.heads)
        return self._cols

    @property
    def slots(self) -> tuple[torch.Tensor, int]:
        """For the stored-dS backward: ``(slots, entries)``. ``slots`` int32, shaped and strided
        as ``cols.index``: for entry ``j`` of key column ``c`` (query row ``r``), the place of
        ``c`` in row ``r``'s forward list (where dK/dV stores that tile's dS and dQ reads it).
        ``entries``: the most blocks a row lists."""
        if self._slots is None:
            rows, cols = _unexpanded(self.rows.index).long(), _unexpanded(self.cols.index).long()
            place = torch.empty_like(rows)
            place.scatter_(-1, rows, torch.arange(rows.shape[-1], device=rows.device).expand_as(rows))
            slots = place.transpose(-1, -2).gather(-1, cols).to(torch.int32).expand(self.cols.index.shape)
            entries = int((self.rows.num_partial + self.rows.num_full).max()) if rows.numel() else 0
            self._slots = (slots, entries)
        return self._slots


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, ...]`` without the batch and head broadcast an ``expand`` gave it."""
    return t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride()[:2])]


@dataclass
class Plan:
    """Everything the kernels need besides the tensors: scale, mode, options and the layout;
    ``invariant``: the invariance contract (its lists, fixed kernel configs, no stored dS on
    shifted lists)."""

    scale: float
    interpret: bool
    tiles: Tiles
    layout: Layout
    options: TritonOptions = TritonOptions()
    invariant: bool = False

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
    def tune_key(self) -> int:
        """Batch × heads and the block-list sizes (powers of two: the grid's size), the mask
        features and the lists' spacing, in one int the autotuner keys on."""
        flags = [*self.program.flags(), self.rows.partial_strided, self.rows.full_strided]
        key = sum(int(on) << i for i, on in enumerate(flags))
        sizes = (self.codes.shape[-1], self.codes.shape[-2], self.layout.batch * self.layout.heads)
        for i, size in enumerate(sizes):
            key |= max(size, 1).bit_length() << (len(flags) + 6 * i)
        return key


_LAYOUTS = MaskCache(32)


def layout(mask: Optional[Mask], space: MaskSpace, tiles: Tiles, invariant: bool = False,
           ) -> Layout:
    """The :class:`Layout` of ``mask`` over ``space``, cached per mask (same tensors,
    unmodified), shapes, tiles and ``invariant`` (the contract's lists,
    :func:`key_order_lists`, where every tile runs the whole mask program)."""
    def build() -> Layout:  # one host read: the lists' spacing, the parts the tiles need
        codes = block_codes(mask, space, tiles)
        if invariant:
            (rows,), _ = _read_flags([key_order_lists(codes, space, tiles.sparse_k,
                                                      key_starts(mask))])
            return Layout(compile_mask(mask, space), codes, space.batch, space.heads, rows)
        needs = _leaf_needs(mask, codes, space, tiles)
        (rows, cols), needs = _read_flags(
            [_block_lists(codes, space.batch, space.heads),
             _block_lists(codes.transpose(-1, -2), space.batch, space.heads)], needs)
        return Layout(compile_mask(_kept(mask, needs), space), codes, space.batch,
                      space.heads, rows, cols)
    return _LAYOUTS.get(mask, (space, tiles, invariant), build)


def make_plan(inputs: Inputs, options: TritonOptions = TritonOptions()) -> Plan:
    """The plan of one call: its scale, mode and options, and the mask's (cached) layout."""
    return build_plan(inputs.mask, inputs.space, inputs.scale, options, inputs.invariant)


def build_plan(mask: Optional[Mask], space: MaskSpace, scale: float,
               options: TritonOptions = TritonOptions(), invariant: bool = False) -> Plan:
    """The plan of attention under ``mask`` over ``space`` (``[B, H, Tq, Tk]``) with ``scale``
    (ring attention's steps build theirs from a window of the whole mask); ``invariant``:
    under the invariance contract."""
    interpret = interpreting()
    tiles = options.tiles or (INTERPRETER_TILES if interpret else GPU_TILES)
    if not interpret:
        tiles.fit_gpu()
    return Plan(scale, interpret, tiles, layout(mask, space, tiles, invariant), options,
                invariant)


def stores_ds(q: torch.Tensor, plan: Plan, mods: "ScoreMods" = None) -> bool:
    """Whether this backward stores dS (:attr:`TritonOptions.backward`); never with score
    modifiers (:class:`ScoreMods`: dQ adds their parameters' gradients as it recomputes) or
    shifted lists (their slots would not match dK/dV's aligned ones)."""
    if mods is not None and mods.any or plan.rows.starts is not None:
        return False
    if plan.options.backward != "auto":
        return plan.options.backward == "stored_ds"
    sparse = 2 * plan.layout.slots[1] <= plan.codes.shape[-1]
    return sparse and ds_bytes(q, plan) <= plan.options.stored_ds_max_bytes


def _ds_shape(q: torch.Tensor, plan: Plan) -> tuple[int, ...]:
    """``[B, H, R, E, SPARSE_K, SPARSE_Q]``: R query block rows, E the most blocks a row lists."""
    return (*q.shape[:2], plan.codes.shape[-2], plan.layout.slots[1], plan.tiles.sparse_k,
            plan.tiles.sparse_q)


def ds_bytes(q: torch.Tensor, plan: Plan) -> int:
    """Size of :func:`ds_buffer` for ``q [B, H, Tq, D]``."""
    return math.prod(_ds_shape(q, plan)) * q.element_size()


def ds_buffer(q: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The stored-dS buffer in q's dtype, uninitialised (dK/dV writes every slot dQ reads)."""
    return torch.empty(_ds_shape(q, plan), dtype=q.dtype, device=q.device)


# ---- launches ---------------------------------------------------------------------------------------
@dataclass
class Call:
    """One kernel launch: kernel ``name``, its arguments but the config's, ``grid(meta)``.

    Compiled, a template's (:func:`_template`) first launch goes through ``triton.autotune``,
    the second through ``JITFunction`` with the chosen config, whose binary is kept and then
    called directly with every argument in order: binding and specializing the arguments in
    ``JITFunction`` costs host time the GPU waits for on short kernels (docs/BENCHMARKS.md).
    A template fixes shapes, strides, dtypes and the non-tensor arguments, and a binary is
    kept per alignment of the swapped tensors (what else Triton specializes on)."""

    name: str
    args: dict
    grid: Callable[[dict], tuple[int, int]]
    fixed: tuple[int, int]  # the interpreter's (BLOCK_M, BLOCK_N)
    shared: dict = field(default_factory=dict)  # with the template: "config", "direct"
    swapped: tuple = ()  # the tensors swapped into the template

    def run(self, plan: Plan) -> None:
        fn = getattr(kernels(), self.name)
        if plan.interpret:
            meta = kernel_meta(fn, dict(BLOCK_M=self.fixed[0], BLOCK_N=self.fixed[1],
                                        **WALKS[plan.options.walk]))
            fn[self.grid(meta)](**self.args, **meta)
            return
        if self.args.get("TMA_OK") or getattr(self.args.get("stored"), "BY_TMA", False):
            _scratch_allocator()
        options = plan.options
        if options.candidate is not None or plan.invariant:  # the contract: never tuned
            candidates = CONFIGS[self.name][_bucket(self.args)]
            chosen = min(options.candidate or 0, len(candidates) - 1)
            m, n, warps, stages, walk = candidates[chosen]
            meta = kernel_meta(fn, dict(BLOCK_M=m, BLOCK_N=n, **WALKS[walk]))
            fn[self.grid(meta)](**self.args, **meta, num_warps=warps, num_stages=stages)
            return
        config = self.shared.get("config")
        if config is None:
            with _TUNING:
                config = self.shared.get("config")  # (tuned by another thread meanwhile)
                if config is None:
                    tuner = _tuned(self.name, options.autotune_cache)
                    tuner[self.grid](**self.args)
                    self.shared["config"] = tuner.best_config
                    return
        grid = self.grid(config.kwargs)
        key = tuple(_specialized(self.args[name]) for name in self.swapped)
        direct = self.shared.setdefault("direct", {})
        if options.direct_launch and self.swapped and key in direct:
            binary, values, swaps = direct[key]
            values = list(values)
            for i, name in swaps:
                values[i] = self.args[name]
            binary[(*grid, 1)](*values)
            return
        binary = fn[grid](**self.args, **config.all_kwargs())
        if self.swapped and hasattr(binary, "__getitem__"):  # kept without this call's tensors
            merged, names = {**self.args, **config.kwargs}, _arg_names(fn)
            direct[key] = (binary, [None if name in self.swapped else merged[name] for name in names],
                           [(i, name) for i, name in enumerate(names) if name in self.swapped])


def _specialized(value) -> object:
    """What Triton specializes a per-call argument on: a tensor's 16-byte alignment; a tuple's
    parts; anything else by value."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    if isinstance(value, tuple):
        return tuple(_specialized(part) for part in value)
    return getattr(value, "value", value)


def kernel_meta(fn, meta: dict) -> dict:
    """The config's meta-parameters this kernel takes."""
    return {name: value for name, value in meta.items() if name in _arg_names(fn)}


def _tuned(name: str, cache: bool):
    """The compiled kernel ``name`` wrapped in ``triton.autotune`` over its candidates of the
    launch's head-dim bucket (made once, under :data:`_TUNING`; ``cache``: timings kept on
    disk)."""
    if (name, cache) not in _TUNED:
        import triton

        fn = getattr(kernels(), name)
        every = sorted({c for bucket in CONFIGS[name].values() for c in bucket})
        configs = [triton.Config(kernel_meta(fn, dict(BLOCK_M=m, BLOCK_N=n, **WALKS[walk])),
                                 num_warps=w, num_stages=s) for m, n, w, s, walk in every]
        candidate = {id(config): c for config, c in zip(configs, every)}

        def prune(configs, named_args, **kwargs):
            wanted = set(CONFIGS[name][_bucket(kwargs)])
            return [config for config in configs if candidate[id(config)] in wanted]
        _TUNED[name, cache] = triton.autotune(
            configs=configs, key=[k for k in ("DK_PAD", "DV_PAD", "TUNE_KEY") if k in _arg_names(fn)],
            prune_configs_by={"early_config_prune": prune}, cache_results=cache)(fn)
    return _TUNED[name, cache]


def _bucket(args: dict) -> int:
    return head_bucket(max(args.get("DK_PAD", 0), args.get("DV_PAD", 0)))


def _arg_names(fn) -> list[str]:
    """A kernel's parameters in order (compiled or interpreted)."""
    import inspect
    return list(inspect.signature(fn.fn).parameters)


def _scratch_allocator() -> None:
    """Give Triton an allocator for in-kernel tensor descriptors' scratch memory, unless this
    thread's context has one already (a user's is kept)."""
    import triton

    try:
        from triton.runtime import _allocation
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):
        unset = True
    if unset:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(
            size, dtype=torch.int8, device=torch.cuda.current_device()))


CALLS_PER_LAYOUT = 16


def _template(plan: Plan, name: str, tensors: dict, build: Callable[[], dict],
              grid: Callable[[dict], tuple[int, int]], fixed: tuple[int, int],
              extra: tuple = ()) -> Call:
    """The launch ``name`` for these tensors: arguments built once per (layout, scale, options,
    shapes, strides, dtypes and ``extra``) and kept on the layout without the tensors, which
    each call swaps in. ``build()`` may give more than the kernel takes (:func:`_common`); each
    tensor ``X`` passes its strides as ``s_x`` where the kernel takes them."""
    key = (name, plan.scale, plan.interpret, plan.tiles, plan.options, *extra,
           *((t.shape, t.stride(), t.dtype) for t in tensors.values()))
    calls = plan.layout.calls
    template = calls.get(key)
    if template is None:
        args = {**build(), **{f"s_{n.lower()}": t.stride() for n, t in tensors.items()}}
        names = _arg_names(getattr(kernels(), name))
        made = Call(name, {n: v for n, v in args.items() if n in names}, grid, fixed)
        with _TEMPLATES:  # (threads sharing the layout: one template per key, the oldest out)
            template = calls.get(key)
            if template is None:
                while len(calls) >= CALLS_PER_LAYOUT:
                    calls.pop(next(iter(calls)))
                template = calls[key] = made
    return dataclasses.replace(template, args={**template.args, **tensors}, swapped=tuple(tensors))


def _per_call(call: Call, **values) -> Call:
    """``call`` with arguments that read this call's pointers (TMA eligibility, the stored-dS
    buffer), swapped in like its tensors."""
    call.args.update(values)
    call.swapped = (*call.swapped, *values)
    return call


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(length: int, block: str, programs: int) -> Callable[[dict], tuple[int, int]]:
    """``grid(meta)``: ``length`` positions in kernel blocks of ``meta[block]``, one row of
    programs per (batch, head)."""
    return lambda meta: (cdiv(length, meta[block]), programs)


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> dict:
    """Sizes, scales, tiles, dtype switches, the mask program and the forward lists: what the
    kernels take (each its own part of it)."""
    dk, dv, heads = q.shape[-1], v.shape[-1], q.shape[1]
    return dict(heads=heads, heads_kv=k.shape[1], group=heads // k.shape[1], q_len=q.shape[2],
                kv_len=k.shape[2], head_dk=dk, head_dv=dv, qk_scale=plan.scale * LOG2E,
                sm_scale=plan.scale, lists=plan.rows.args(),
                mask=plan.program.args(plan.rows.num_partial), TUNE_KEY=plan.tune_key,
                SPARSE_Q=plan.tiles.sparse_q, SPARSE_K=plan.tiles.sparse_k, DK_PAD=head_pad(dk),
                DV_PAD=head_pad(dv), EVEN_DK=dk == head_pad(dk), EVEN_DV=dv == head_pad(dv),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=plan.interpret and q.dtype == torch.bfloat16, TMA_OK=False,
                BOUNDS=bool(q.shape[2] % plan.tiles.sparse_q or k.shape[2] % plan.tiles.sparse_k
                            or plan.rows.starts is not None))


def _tma_ok(plan: Plan, *tensors: torch.Tensor) -> bool:
    """Whether the ``+tma`` walks may describe these tensors to the TMA unit: allowed by the
    options and the device, unit stride along the last dim, 16-byte aligned base pointers and
    other strides."""
    if not (plan.options.tma and _has_tma(tensors[0].device, plan.interpret)):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device, interpret: bool) -> bool:
    """Whether kernels may make tensor descriptors on ``device`` (the interpreter emulates them)."""
    return interpret or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def forward_call(q, k, v, out, lse, plan: Plan, mods: ScoreMods = NO_MODS) -> Call:
    """The forward filling ``out [B, H, Tq, Dv]`` and ``lse [B, H, Tq]`` (float32)."""
    call = _template(plan, "attn_fwd", dict(Q=q, K=k, V=v, Out=out, Lse=lse),
                     lambda: _common(q, k, v, plan), _grid(q.shape[2], "BLOCK_M", q.shape[0] * q.shape[1]),
                     plan.tiles.fwd, extra=(mods.flags(),))
    return _per_call(call, TMA_OK=_tma_ok(plan, k, v), mods=mods.args(plan.rows.num_partial))


def dq_call(q, k, v, dout, out, lse, dlse, lse2, delta, dq, plan: Plan,
            mods: ScoreMods = NO_MODS, dslope: Optional[torch.Tensor] = None,
            ddiag: Optional[torch.Tensor] = None) -> Call:
    """dQ ``[B, H, Tq, Dk]``, and first the row statistics for :func:`dkdv_call`: ``delta
    [B, H, Tq]`` = rowsum(dout ∘ out) − ``dlse`` (``None``: no LSE gradient) and ``lse2`` =
    ``lse`` in base 2 (``+inf`` where ``-inf``); ``lse``, ``dlse``, ``lse2``, ``delta``:
    float32, contiguous. The modifiers' gradients are added into ``dslope``/``ddiag``
    (:class:`ScoreMods`; ``None``: not wanted)."""
    tensors = dict(Q=q, K=k, V=v, dOut=dout, Out=out, Lse=lse, dLse=lse if dlse is None else dlse,
                   Lse2=lse2, Delta=delta, dQ=dq)
    call = _template(plan, "attn_bwd_dq", tensors, lambda: dict(_common(q, k, v, plan),
                                                                 HAS_DLSE=dlse is not None),
                     _grid(q.shape[2], "BLOCK_M", q.shape[0] * q.shape[1]), plan.tiles.dq,
                     extra=(dlse is not None, mods.flags(), dslope is not None, ddiag is not None))
    return _per_call(call, TMA_OK=_tma_ok(plan, k, v),
                     mods=mods.args(plan.rows.num_partial, dslope, ddiag))


def slope_slots(q: torch.Tensor) -> torch.Tensor:
    """Zeros ``[B, H, ⌈Tq/16⌉]`` float32: the ALiBi-slope gradient with one slot per dQ program
    (query blocks are multiples of 16 rows), each added into by its own program in walk order,
    then summed by :func:`sum_slots`: a fixed order, where one shared slot takes the programs'
    atomics in whatever order they land."""
    return torch.zeros(*q.shape[:2], cdiv(q.shape[2], 16), dtype=torch.float32, device=q.device)


def sum_slots(slots: torch.Tensor, dslope: torch.Tensor) -> None:
    """Add :func:`slope_slots` into ``dslope [1|B, H]`` (summed over the batch where it is 1)."""
    total = slots.sum(2)
    dslope += total.sum(0, keepdim=True) if dslope.shape[0] == 1 else total


def _stored(plan: Plan, ds: Optional[torch.Tensor]) -> Stored:
    """The :data:`Stored` argument of dK/dV and dQ-stored (placeholders without ``ds``)."""
    import triton.language as tl
    if ds is None:
        none = plan.rows.num_partial
        return Stored(none, none, (0, 0, 0, 0), 0, tl.constexpr(False), tl.constexpr(False))
    by_tma = plan.options.tma and _has_tma(ds.device, plan.interpret)
    return Stored(ds, plan.layout.slots[0], ds.stride()[:4], ds.numel() // plan.tiles.sparse_q,
                  tl.constexpr(True), tl.constexpr(by_tma))


def dkdv_call(q, k, v, dout, lse2, delta, dk, dv, plan: Plan,
              ds: Optional[torch.Tensor] = None, mods: ScoreMods = NO_MODS) -> Call:
    """dK ``[B, Hkv, Tk, Dk]`` and dV ``[B, Hkv, Tk, Dv]`` from the row statistics ``lse2``,
    ``delta`` (written before it), and given ``ds`` (:func:`ds_buffer`) every tile's dS there.
    Storing dS changes which config is fastest: its own tunings (bit 30 of ``TUNE_KEY``)."""
    def build() -> dict:
        args = dict(_common(q, k, v, plan), lists=plan.cols.args())
        return dict(args, TUNE_KEY=args["TUNE_KEY"] | (ds is not None) << 30)
    call = _template(plan, "attn_bwd_dkdv", dict(Q=q, K=k, V=v, dOut=dout, Lse2=lse2, Delta=delta,
                                                 dK=dk, dV=dv),
                     build, _grid(k.shape[2], "BLOCK_N", k.shape[0] * k.shape[1]), plan.tiles.dkdv,
                     extra=(None if ds is None else (ds.shape, ds.dtype), mods.flags()))
    # with GQA the kernel would remake the descriptors per query head: pointers there
    return _per_call(call, stored=_stored(plan, ds), mods=mods.args(plan.rows.num_partial),
                     TMA_OK=q.shape[1] == k.shape[1] and _tma_ok(plan, q, dout, lse2, delta))


def stats_call(out, dout, lse, dlse, lse2, delta, plan: Plan) -> Call:
    """The stored-dS backward's first launch: the row statistics, as :func:`dq_call` writes them."""
    tensors = dict(dOut=dout, Out=out, Lse=lse, dLse=lse if dlse is None else dlse, Lse2=lse2,
                   Delta=delta)
    return _template(plan, "attn_bwd_stats", tensors,
                     lambda: dict(heads=out.shape[1], q_len=out.shape[2], head_dv=out.shape[3],
                                  DV_PAD=head_pad(out.shape[3]), HAS_DLSE=dlse is not None),
                     _grid(out.shape[2], "BLOCK_M", out.shape[0] * out.shape[1]), plan.tiles.dq,
                     extra=(dlse is not None,))


def dq_stored_call(q, k, v, ds, dq, plan: Plan) -> Call:
    """The stored-dS backward's last launch: ``dq [B, H, Tq, Dk]`` = scale · dS·K."""
    call = _template(plan, "attn_bwd_dq_stored", dict(K=k, dQ=dq), lambda: _common(q, k, v, plan),
                     _grid(q.shape[2], "BLOCK_M", q.shape[0] * q.shape[1]), plan.tiles.dq,
                     extra=((ds.shape, ds.dtype),))
    return _per_call(call, stored=_stored(plan, ds), TMA_OK=_tma_ok(plan, k))


# ---- decoding -------------------------------------------------------------------------------------
DECODE_MAX_ROWS, DECODE_MAX_QUERIES = 64, 16
"""Query rows (query heads of a kv head × queries) and queries the split-key decoding kernel
takes; it runs where the keys are at least 4× the queries (a cache, not a prefill)."""


def decode_form(inputs: Inputs) -> Optional[tuple[Optional[torch.Tensor], bool,
                                                   Optional[torch.Tensor]]]:
    """``(kv_lengths, causal, ranges)`` when ``inputs`` is a decoding step the split-key kernel
    runs (``kernels.attn_decode``): no gradients, at most :data:`DECODE_MAX_QUERIES` queries and
    :data:`DECODE_MAX_ROWS` query rows per kv head against at least 4× as many keys, and a mask
    whose parts are bottom-right causal, lengths of the keys, or one mask of per-query key runs
    (``ranges [B, Tq, 2]``: a :class:`~attnkit.masks.Structure`; per-sequence causal, left
    padding, causal documents), no score modifier but sinks, and not under the invariance
    contract (its splits follow the batch; the forward kernel computes each row as a prefill
    does); else ``None``."""
    q, k = inputs.q, inputs.k
    if inputs.invariant or inputs.modifiers is not None and inputs.modifiers.changes_scores:
        return None
    if (inputs.need_grad or q.shape[2] > DECODE_MAX_QUERIES or k.shape[2] < 4 * q.shape[2]
            or inputs.group_size * q.shape[2] > DECODE_MAX_ROWS or not (q.shape[2] and k.shape[2])):
        return None
    lengths, causal, ranges = None, False, None
    for leaf in inputs.mask.leaves() if inputs.mask is not None else []:
        form = leaf.structure(inputs.space)
        if form is not None and form.diagonals == (None, k.shape[2] - q.shape[2]):
            causal = True
        elif form is not None and form.lengths is not None and form.lengths[0] is None:
            kv = form.lengths[1].reshape(-1).to(q.device, torch.int32).expand(q.shape[0])
            lengths = kv if lengths is None else torch.minimum(lengths, kv)
        elif form is not None and form.ranges is not None and ranges is None:
            ranges = form.ranges[0].to(q.device)
        else:
            return None
    return lengths, causal, ranges


def decode(inputs: Inputs, kv_lengths: Optional[torch.Tensor], causal: bool,
           ranges: Optional[torch.Tensor], options: TritonOptions = TritonOptions(),
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step by the split-key kernel (:func:`decode_form`'s ``kv_lengths``,
    ``causal`` and ``ranges``) → ``out [B, H, Tq, Dv]`` (q's dtype), ``lse [B, H, Tq]``
    (float32)."""
    args, grid, merge = decode_launch(inputs.q, inputs.k, inputs.v, inputs.scale, kv_lengths,
                                      causal, ranges, options)
    kernels().attn_decode[grid](**args)
    return merge_splits(*merge)


def paged_decode(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                 table: torch.Tensor, seqlens: torch.Tensor, ranges: torch.Tensor, scale: float,
                 options: TritonOptions = TritonOptions()) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over paged keys by the split-key kernel, each key tile's blocks read through
    the table (nothing gathered): ``q [B, Hq, Tq, Dk]`` (a decoding step, or a prefill: its
    query rows in blocks of :data:`DECODE_MAX_ROWS`, a program each), pools
    ``[num_blocks, page, Hkv, D]``, ``table [B, max_blocks]`` (int32 or int64), ``seqlens
    [B]`` int32 (each sequence's keys), ``ranges [B, Tq, 2]`` int32 (query i of sequence b
    sees its keys ``[lo, hi)``, within ``seqlens[b]``) → ``out [B, Hq, Tq, Dv]`` (q's dtype),
    ``lse [B, Hq, Tq]`` (float32; 0 and −inf where no key is seen). No value is read on the
    host."""
    args, grid, merge = decode_launch(q, key_pool, value_pool, scale, seqlens, False, ranges,
                                      options, table)
    kernels().attn_decode[grid](**args)
    return merge_splits(*merge)


def decode_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  kv_lengths: Optional[torch.Tensor], causal: bool,
                  ranges: Optional[torch.Tensor], options: TritonOptions,
                  table: Optional[torch.Tensor] = None) -> tuple[dict, tuple[int, int], tuple]:
    """The split-key kernel's arguments (meta-parameters included), grid, and what
    :func:`merge_splits` takes after it, for ``k``/``v`` ``[B, Hkv, Tk, D]`` or, with a block
    ``table``, pools ``[num_blocks, page, Hkv, D]`` (Tk: the table's capacity). The keys are
    split into chunks so that about two programs per SM run (a handful of query rows per kv
    head would otherwise leave most of the GPU idle; ``options.decode_splits`` overrides).
    More than :data:`DECODE_MAX_ROWS` query rows per kv head are held by several programs,
    :data:`DECODE_MAX_ROWS` each."""
    batch, heads, q_len, dk = q.shape
    dv = v.shape[-1]
    if table is None:
        heads_kv, kv_len, s_k, s_v = k.shape[1], k.shape[2], k.stride(), v.stride()
    else:  # strides as the kernel takes them: block, head, slot, dim
        heads_kv, kv_len = k.shape[2], table.shape[1] * k.shape[1]
        s_k, s_v = ([t.stride(i) for i in (0, 2, 1, 3)] for t in (k, v))
    interpret = interpreting()
    block_n = 32 if interpret else 64
    rows = max(16, head_pad(heads // heads_kv * q_len))
    row_blocks = 1
    if rows > DECODE_MAX_ROWS:  # a prefill: blocks of rows, each its own program
        row_blocks, rows = cdiv(heads // heads_kv * q_len, DECODE_MAX_ROWS), DECODE_MAX_ROWS
    programs = 2 * (torch.cuda.get_device_properties(q.device).multi_processor_count
                    if q.device.type == "cuda" else 2)
    splits = options.decode_splits or cdiv(programs, batch * heads_kv * row_blocks)
    splits = max(1, min(splits, cdiv(kv_len, block_n)))
    chunk = cdiv(cdiv(kv_len, splits), block_n) * block_n  # whole key tiles a chunk
    splits = cdiv(kv_len, chunk)
    part_acc = torch.empty(batch, heads_kv, splits, rows * row_blocks, head_pad(dv),
                           dtype=torch.float32, device=q.device)
    part_m = torch.empty(batch, heads_kv, splits, rows * row_blocks, dtype=torch.float32,
                         device=q.device)
    part_l = torch.empty_like(part_m)
    lengths = kv_lengths if kv_lengths is not None else part_m
    args = dict(Q=q, K=k, V=v, PartAcc=part_acc, PartM=part_m, PartL=part_l, s_q=q.stride(),
                s_k=s_k, s_v=s_v, heads_kv=heads_kv, group=heads // heads_kv,
                q_len=q_len, kv_len=kv_len, head_dk=dk, head_dv=dv, kv_lens=lengths,
                s_kvlen=lengths.stride(0) if kv_lengths is not None else 0,
                ranges=part_m if ranges is None else ranges,
                s_ranges=(0, 0) if ranges is None else ranges.stride()[:2], chunk=chunk,
                qk_scale=scale * LOG2E, table=part_m if table is None else table,
                s_table=0 if table is None else table.stride(0),
                page=1 if table is None else k.shape[1], BLOCK_R=rows, BLOCK_N=block_n,
                DK_PAD=head_pad(dk), DV_PAD=head_pad(dv),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=interpret and q.dtype == torch.bfloat16,
                HAS_KVLEN=kv_lengths is not None, CAUSAL=causal, HAS_RANGES=ranges is not None,
                PAGED=table is not None)
    merge = (part_acc, part_m, part_l, heads // heads_kv, q_len, dv, q.dtype)
    return args, (batch * heads_kv, splits, row_blocks), merge


def merge_splits(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, group: int,
                 q_len: int, dv: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' partial softmaxes (``m``, ``l`` in base 2, ``acc`` unnormalised; ``[B, Hkv,
    splits, R(, DV_PAD)]``) merged into ``out [B, H, Tq, Dv]`` and ``lse [B, H, Tq]`` (0 and −inf
    where no key was allowed)."""
    top = part_m.amax(2, keepdim=True)
    weight = torch.exp2(part_m - torch.where(top == float("-inf"), 0.0, top))  # [B, Hkv, S, R]
    total = (weight * part_l).sum(2)  # [B, Hkv, R]
    acc = (weight[..., None] * part_acc).sum(2)  # [B, Hkv, R, DV_PAD]
    empty = total == 0
    out = acc / torch.where(empty, 1.0, total)[..., None]
    lse = torch.where(empty, float("-inf"), (top[:, :, 0] + torch.log2(torch.where(empty, 1.0, total)))
                      * math.log(2))
    batch, heads_kv = part_m.shape[:2]
    rows = group * q_len  # row r: query r % q_len of query head h_kv · group + r // q_len
    out = out[:, :, :rows, :dv].reshape(batch, heads_kv * group, q_len, dv).to(dtype)
    return out, lse[:, :, :rows].reshape(batch, heads_kv * group, q_len)
