"""Memory-efficient tiled attention in PyTorch (FlashAttention's algorithm, CPU and CUDA).

The score matrix is never built: queries are processed ``block_q`` rows at a time and keys in
*segments* (runs of ``block_k``-wide blocks that the mask's block map classifies alike):

- EMPTY blocks are never computed,
- FULL runs apply no mask,
- PARTIAL runs evaluate ``mask.tile`` (and ``tile_bias``) for that run only, except, with
  torch's fused CPU kernel, square tiles the mask knows to be lower/upper triangles
  (``Mask.tile_structure``): those are never evaluated and run as *staircase* segments (a
  sliding-window row: upper triangle, full keys, lower triangle) in strips of
  ``TiledOptions.triangle_strip`` query rows that each see only their allowed keys.

Query blocks that see the same keys relative to their rows and need no element mask (every
block of a sliding window, every other block of equal documents) run as one kernel call over
strided views of all of them (``Plan.runs``).

An online softmax (running max ``m``, running sum ``l``, rescaled accumulator) in fp32 (fp64 for
fp64 input) merges the segments, in place in the output where its rows are a view of it. The backward pass recomputes every tile from
``(q, k, v, out, lse)``; nothing of size Tq×Tk is saved. Peak extra memory is a few tiles of
``TILE_ELEMENTS`` scores plus O(T·D) accumulators.

GQA keeps K/V un-repeated: a query block of all G heads sharing one K/V head is laid out as
``[B, Hkv, G·n, D]`` so one batched matmul serves the whole group; a run executes once per
member of the group instead (query heads ``g, g+G, …`` against all K/V heads).

Score modifiers (:mod:`attnkit.modifiers`), in the order :meth:`Modifiers.apply` defines:

- ALiBi and relative biases depend on ``j − i`` alone: each call builds them once, one vector
  per head over the relative positions (O((Tq + Tk)·H), :meth:`Modifiers.position_bias`), and
  every tile reads its bias from it. Alone (no softcap, no score function) they go through
  the fused kernel as its additive mask: a segment without element mask runs over its keys in
  reverse order (K and V reversed once per call, O(T·D)), so that its bias is a view of the
  reversed vector with unit strides (nothing built; see :class:`Positions`); strips, causal
  squares and additive tiles get the bias added (at most a tile); runs execute block by block
  (reversed keys do not shift with a run's blocks). The backward is torch's fused one,
  unless the slopes or tables need gradients or the biases span more than :data:`WIDE_BIAS`:
  then the matmul path, which forms dS, sums it along diagonals into the vector's gradient,
  and the slopes' and tables' come from the vector's construction.
- Softcap and score functions run on the matmul path (the fused kernel takes no change of its
  scores): the softcap with its derivative written out (``dS · (1 − tanh²)``), score functions
  recomputed per tile with autograd enabled locally (``torch.autograd.grad`` of the tile gives
  dS before them and the gradients of the tensors they read, accumulated over tiles).

Nothing of size Tq×Tk is built for them either. The matmul path exponentiates in base 2 and
counts weights below ``2^FLUSH_BELOW`` as 0, so that no tile holds subnormal floats.

Positions may be offset (``q_offset``, ``kv_offset``: global positions of the first local
query/key) so one shard of a longer sequence is computed against another with the global mask,
as ring attention does.

How the engine schedules its tiles (fused kernel or matmul, runs, shared prefixes, staircases)
is set by a :class:`TiledOptions` value, carried by the plan (and so part of its cache key):
``TiledBackend(options)``, ``tiled_attention(..., options=...)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from ..inputs import Inputs
from ..masks import EMPTY, FULL, Mask, MaskCache, MaskSpace
from ..modifiers import Modifiers
from ..numerics import accum_dtype, additive_mask
from .base import Backend, BackendOutput, check_backward_modifiers
from .reference import steps

BLOCK_K = 128
"""Key-block width of the block map: the granularity at which tiles are skipped."""

TILE_ELEMENTS = 1 << 21
"""Score elements per tile (8 MiB in fp32): bounds memory and sets ``block_q``."""

FUSED_BLOCK_Q = 256
"""Query rows per block when tiles go through torch's fused CPU kernel."""

_FOLD_LIMIT = 2.0 ** 64
"""The largest ``|scale| / cap`` folded into the queries (:meth:`TileScores.scores`)."""

MODIFIED_TILE_KEYS = 1024
"""Keys per tile that the matmul path sizes its query blocks for when softcap or score
functions run on it (:func:`choose_block_q`): taller tiles than its default measured faster
in their backward."""

FLUSH_BELOW = -100.0
"""The matmul path counts a weight below ``2^FLUSH_BELOW`` of its row's largest (forward) or
of its row's sum (backward) as 0, so that no tile holds subnormal floats (CPUs take a slow
path on them, and ALiBi makes long runs of keys decay through that range). float32 resolves
``2^-24`` of a row: such a key changes no result unless its value is ``2^76`` times the
others'."""

WIDE_BIAS = 64.0
"""Position biases (ALiBi, relative) whose values span more than this take the matmul path's
backward even on a fused plan: torch's fused backward then forms subnormal weights (keys about
``e^-87`` below their row's sum), on which CPUs take a slow path; the matmul path flushes them
(:data:`FLUSH_BELOW`)."""

LOG2E = 1.4426950408889634
"""``exp(x) = exp2(x · log2 e)``: the matmul path exponentiates in base 2, because torch's CPU
``exp`` takes a slow path for arguments below about −87 (where ALiBi puts far keys) and
``exp2`` does not."""


@dataclass(frozen=True)
class TiledOptions:
    """How the tiled engine schedules its work (the results agree within rounding for every
    choice). Hashable: a plan is cached per options value."""

    fused_tiles: bool = True
    """Tiles go through torch's fused CPU kernel where it applies (see
    :func:`uses_fused_kernel`); ``False`` takes the matmul path everywhere."""

    batch_runs: bool = True
    """Run evenly spaced query blocks with equal relative structure (sliding windows, documents)
    as one kernel call over a strided view (see :func:`_find_runs`)."""

    prefix_blocks: int = 4
    """Most query blocks that run a shared FULL prefix as one call (see
    ``Plan._shared_prefix``); below 2, never."""

    staircase_max_keys: int = 1024
    """Widest run ``upper triangle, full…, [lower triangle]`` merged into one staircase segment
    (one set of strips, no merges: measured faster for sliding windows). A lower triangle is
    not merged with the full keys before it: those run better as one call of the whole query
    block (causal measured slower merged)."""

    triangle_strip: int = 64
    """Query rows per kernel call inside a staircase segment. The fused kernel skips no key of a
    tile narrower than its 512-key blocks, so a 256-wide triangle run whole computes its masked
    half too; run as strips, each strip sees only the keys it may (measured faster per
    tile)."""


@dataclass(frozen=True)
class Segment:
    """Keys ``[start, stop)`` (local) computed together; ``partial``: apply the element mask.

    ``structure`` (fused plans only): the segment's mask, known without evaluating it (see
    :meth:`~attnkit.masks.Mask.tile_structure`), as a *staircase* over the query block's ``n``
    rows: ``"lower"``: its last ``n`` keys are a lower triangle, every key before them allowed;
    ``"upper"``: its first ``n`` keys are an upper triangle, every key after them allowed;
    ``"band"``: both. A square triangle tile is the case ``stop - start == n``. ``None``: the
    element mask is evaluated (partial) or not needed (full)."""

    start: int
    stop: int
    partial: bool
    structure: Optional[str] = None


class Group(NamedTuple):
    """A unit of execution: query block ``block`` (rows ``[rows[0], rows[1])``, keys
    ``segments``), and, when ``count > 1``, the query blocks ``block + step·j`` (j < count) too,
    which see the same keys relative to their rows (a *run*: one kernel call serves them all)."""

    block: int
    rows: tuple[int, int]
    segments: tuple[Segment, ...]
    step: int = 0
    count: int = 1
    fresh: bool = True
    """False: the rows already hold a partial result (a shared prefix ran before); every
    segment merges into it."""


@dataclass(frozen=True)
class Plan:
    """Which key segments each query block visits. ``rows[i]`` lists block i's segments;
    ``runs`` lists ``(first, step, count)``: query blocks ``first + step·j`` whose segments are
    the same up to the shift ``step·j·block_q`` and need no element mask (full or staircase).
    ``options``: the options it was built with, which its execution follows too."""

    block_q: int
    block_k: int
    rows: tuple[tuple[Segment, ...], ...]
    fused: bool = False
    runs: tuple[tuple[int, int, int], ...] = ()
    options: TiledOptions = TiledOptions()

    def groups(self, tq: int, *, runs: bool = False, shared_prefix: bool = False,
               dense: bool = False):
        """Yield :class:`Group` s for execution. With ``runs``, each run is one group. With
        ``dense`` (the fused kernel executes: it tiles internally), consecutive query blocks
        (outside runs) whose segments are identical and all FULL run as one call (a dense row
        range is a single kernel launch); with ``shared_prefix``, consecutive blocks that start
        with the same FULL keys run those as one call too (see :meth:`_shared_prefix`);
        otherwise one query block at a time."""
        in_run = {}
        if runs:
            for first, step, count in self.runs:
                in_run.update({first + step * j: (first, step, count) for j in range(count)})
        i = 0
        while i < len(self.rows):
            if i in in_run:
                first, step, count = in_run[i]
                if i == first:
                    yield Group(i, (i * self.block_q, (i + 1) * self.block_q), self.rows[i], step,
                                count)
                i += 1
                continue
            end = i + 1
            if dense and not any(s.partial for s in self.rows[i]):
                while (end < len(self.rows) and end not in in_run
                       and self.rows[end] == self.rows[i]):
                    end += 1
            shared = self._shared_prefix(i, in_run, tq) if shared_prefix and end == i + 1 else None
            if shared is not None:
                end = shared[-1].block + 1
                yield from shared
            else:
                yield Group(i, (i * self.block_q, min(end * self.block_q, tq)), self.rows[i])
            i = end

    def _shared_prefix(self, i: int, in_run: dict, tq: int) -> Optional[list]:
        """Query blocks ``i…j−1`` (at most ``options.prefix_blocks``, outside runs) whose first
        segment is FULL, starts where block i's does and reaches at least as far, as groups:
        block i's first segment for all their rows in one kernel call (torch's CPU kernel
        measured faster per pair, forward and backward, on 1024 query rows than on 256), then
        each block's remaining keys, merged into that (``fresh=False``). ``None`` when fewer
        than two blocks qualify or block i's first segment is shorter than two blocks of keys.
        (Causal: the keys below the first block's diagonal are shared.)"""
        head = self.rows[i][0] if self.rows[i] else None
        if head is None or head.partial or head.stop - head.start < 2 * self.block_q:
            return None
        j = i + 1
        while (j < len(self.rows) and j - i < self.options.prefix_blocks and j not in in_run
               and self.rows[j] and not self.rows[j][0].partial
               and self.rows[j][0].start == head.start and self.rows[j][0].stop >= head.stop):
            j += 1
        if j - i < 2:
            return None
        groups = [Group(i, (i * self.block_q, min(j * self.block_q, tq)), (head,))]
        for block in range(i, j):
            first, *rest = self.rows[block]
            remainder = ((Segment(head.stop, first.stop, False),) if first.stop > head.stop
                         else ()) + tuple(rest)
            if remainder:
                groups.append(Group(block, (block * self.block_q, min((block + 1) * self.block_q, tq)),
                                    remainder, fresh=False))
        return groups

    def tiles_computed(self) -> int:
        """Number of ``block_q × block_k`` tiles the plan computes (skipped ones excluded)."""
        return sum(math.ceil((s.stop - s.start) / self.block_k) for row in self.rows for s in row)


def _find_runs(rows: list, block_q: int, q_count: int) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(first, step, count ≥ 2)`` of whole query blocks, evenly spaced, whose segments
    are equal relative to the block's first row and are all full or staircases (their masks
    move with the block, so one strided view of the blocks runs them in one call)."""
    by_pattern: dict = {}
    for i, row in enumerate(rows):
        if not row or (i + 1) * block_q > q_count or any(
                s.partial and s.structure is None for s in row):
            continue
        shift = i * block_q
        pattern = tuple((s.start - shift, s.stop - shift, s.partial, s.structure) for s in row)
        by_pattern.setdefault(pattern, []).append(i)
    runs = []
    for blocks in by_pattern.values():
        j = 0
        while j + 1 < len(blocks):
            step, end = blocks[j + 1] - blocks[j], j + 1
            while end + 1 < len(blocks) and blocks[end + 1] - blocks[end] == step:
                end += 1
            runs.append((blocks[j], step, end - j + 1))
            j = end + 1
    return tuple(sorted(runs))


def choose_block_q(rows_of_work: int, kv_len: int, max_keys: int = 4096) -> int:
    """Query rows per block so that one tile ``[rows_of_work · block_q, min(kv_len,
    max_keys)]`` fits ``TILE_ELEMENTS`` (a power of two in [16, 512])."""
    per_row = max(1, rows_of_work * min(kv_len, max_keys))
    block = 1 << max(4, min(9, int(math.log2(max(1, TILE_ELEMENTS // per_row)))))
    return block


_PLANS = MaskCache(64)


def make_plan(mask: Optional[Mask], space: MaskSpace, *, batch: int, heads: int,
              q_offset: int, q_count: int, kv_offset: int, kv_count: int,
              block_q: Optional[int] = None, block_k: int = BLOCK_K, fused: bool = False,
              options: TiledOptions = TiledOptions()) -> Plan:
    """Per-query-block key segments for ``mask`` (see :func:`build_plan`), cached per mask
    (same tensors, unmodified) and arguments, ``options`` included: a loop that reuses a mask
    plans it once."""
    extra = (space, batch, heads, q_offset, q_count, kv_offset, kv_count, block_q, block_k, fused,
             options)
    return _PLANS.get(mask, extra, lambda: build_plan(
        mask, space, batch=batch, heads=heads, q_offset=q_offset, q_count=q_count,
        kv_offset=kv_offset, kv_count=kv_count, block_q=block_q, block_k=block_k, fused=fused,
        options=options))


def build_plan(mask: Optional[Mask], space: MaskSpace, *, batch: int, heads: int,
               q_offset: int, q_count: int, kv_offset: int, kv_count: int,
               block_q: Optional[int] = None, block_k: int = BLOCK_K, fused: bool = False,
               options: TiledOptions = TiledOptions()) -> Plan:
    """Turn the mask's block map into per-query-block key segments.

    A block counts as EMPTY only when it is empty for every batch element and head, and as
    FULL only when it is full for all of them; otherwise it is PARTIAL (the element mask, which
    varies per batch/head, is applied). Consecutive blocks of one kind merge into one segment
    of at most ``TILE_ELEMENTS`` scores (FULL runs are unbounded with the ``fused`` kernel, which
    tiles internally and never materialises them). ``options`` decide the staircase merges
    (``staircase_max_keys``) and runs (``batch_runs``); the plan carries them.
    """
    block_q = block_q or (FUSED_BLOCK_Q if fused else choose_block_q(batch * heads, kv_count))
    nq, nk = math.ceil(q_count / block_q), math.ceil(kv_count / block_k)
    if mask is None:
        codes = [[FULL] * nk for _ in range(nq)]
    else:
        per_bh = mask.block_map(block_q, block_k, space, q_offset=q_offset, q_count=q_count,
                                kv_offset=kv_offset, kv_count=kv_count)  # [Bm, Hm, nq, nk]
        all_empty = (per_bh == EMPTY).flatten(0, 1).all(0)
        all_full = (per_bh == FULL).flatten(0, 1).all(0)
        union = torch.where(all_empty, EMPTY, torch.where(all_full, FULL, 1))
        codes = union.tolist()
    max_blocks = max(1, TILE_ELEMENTS // (max(1, batch * heads) * block_q * block_k))
    rows = []
    for i, row in enumerate(codes):
        segments, j = [], 0
        while j < nk:
            code = row[j]
            if code == EMPTY:
                j += 1
                continue
            end = j + 1
            while end < nk and row[end] == code and (
                    end - j < max_blocks or (fused and code == FULL)):
                end += 1
            segments.append(Segment(j * block_k, min(end * block_k, kv_count), code != FULL))
            j = end
        if fused and mask is not None:
            segments = _with_structure(mask, space, segments, q_offset + i * block_q,
                                       q_offset + min((i + 1) * block_q, q_count), kv_offset,
                                       options.staircase_max_keys)
        rows.append(tuple(segments))
    runs = _find_runs(rows, block_q, q_count) if fused and options.batch_runs else ()
    return Plan(block_q, block_k, tuple(rows), fused, runs, options)


def _with_structure(mask: Mask, space: MaskSpace, segments: list, q_start: int, q_stop: int,
                    kv_offset: int, max_keys: int) -> list:
    """Mark the partial square segments of one query block (global queries ``[q_start,
    q_stop)``) that the mask knows to be lower or upper triangles (a partial run of several
    squares, all known, is split into them), and merge each adjacent run ``upper, full…,
    [lower]`` into one staircase segment of at most ``max_keys`` keys (see
    :class:`Segment`). The element mask of these segments is never evaluated."""
    n = q_stop - q_start
    marked = []
    for seg in segments:
        width = seg.stop - seg.start
        if not seg.partial or width % n:
            marked.append(seg)
            continue
        # A partial run of whole squares (e.g. the upper and lower triangle of a window as wide
        # as the block): known when every square is known.
        squares = []
        for start in range(seg.start, seg.stop, n):
            structure = mask.tile_structure(q_start, q_stop, kv_offset + start,
                                            kv_offset + start + n, space)
            if structure not in ("lower", "upper", "full"):
                break
            squares.append(Segment(start, start + n, structure != "full",
                                   None if structure == "full" else structure))
        marked.extend(squares if len(squares) == width // n else [seg])

    def adjacent(j: int) -> bool:
        return marked[j].start == marked[j - 1].stop

    merged, i = [], 0
    while i < len(marked):
        j = i + 1
        if marked[i].structure == "upper":  # with the full segments and lower triangle after it
            while j < len(marked) and adjacent(j) and not marked[j].partial:
                j += 1
            if j < len(marked) and adjacent(j) and marked[j].structure == "lower":
                j += 1
        run = marked[i:j]
        if len(run) > 1 and run[-1].stop - run[0].start <= max_keys:
            structure = "band" if run[-1].structure == "lower" else "upper"
            merged.append(Segment(run[0].start, run[-1].stop, True, structure))
        else:
            merged.extend(run)
        i = j
    return merged


@dataclass(frozen=True)
class Problem:
    """Everything about one tiled computation except the tensors."""

    mask: Optional[Mask]
    scale: float
    space: MaskSpace
    q_offset: int
    kv_offset: int
    plan: Plan
    dropout_p: float = 0.0
    seed: int = 0
    modifiers: Optional[Modifiers] = None
    """Score modifiers applied per tile (a plan with the fused kernel takes ALiBi and relative
    biases alone, see :meth:`Modifiers.by_position`); sinks are not the engine's: they join
    its result (``Sinks.join``)."""

    @property
    def modifies_scores(self) -> bool:
        return self.modifiers is not None and self.modifiers.changes_scores

    def position_vector(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The ALiBi and relative biases by relative position, ``[1|B, H, Tq + Tk − 1]`` in
        ``dtype`` without a graph (see :meth:`Modifiers.position_bias`), or ``None``."""
        if self.modifiers is None:
            return None
        with torch.no_grad():
            return self.modifiers.position_bias(self.space, dtype)


def _grouped(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[B, Hq, n, ...]`` → ``[B, Hkv, G·n, ...]`` (query heads of one K/V head stacked as rows)."""
    b, hq, n = x.shape[:3]
    return x.reshape(b, heads_kv, (hq // heads_kv) * n, *x.shape[3:])


def _ungrouped(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Inverse of :func:`_grouped` for ``[B, Hkv, G·n, ...]``."""
    b, hkv, gn = x.shape[:3]
    return x.reshape(b, heads_q, gn // (heads_q // hkv), *x.shape[3:])


class _BlockWork:
    """Where one query block (or dense row range) reads and writes: rows ``[start, stop)`` of a
    ``[B, H, T, ...]`` tensor as ``[B, Hkv, G·n, ...]`` (see :func:`_grouped`). ``views``: the
    query-side tensors it takes are views (no GQA), so results can be written in place;
    ``mask_heads``: the query heads a segment mask is laid out for."""

    def __init__(self, heads_q: int, heads_kv: int):
        self.heads_kv, self.mask_heads = heads_kv, heads_q
        self.views = heads_q == heads_kv

    def take(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return _grouped(x[:, :, start:stop], self.heads_kv)

    def put(self, dest: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        dest[:, :, start:stop] = _ungrouped(value, dest.shape[1])

    def add(self, dest: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        dest[:, :, start:stop].add_(value)  # in place: `+=` on a slice copies back

    def positions(self, vector: torch.Tensor, batch: int) -> torch.Tensor:
        """A position vector ``[1|B, Hq, L]`` in this layout: ``[1|B, Hkv, G, L]``."""
        return vector.view(vector.shape[0], self.heads_kv, -1, vector.shape[-1])


def _run_view(x: torch.Tensor, start: int, step: int, count: int, width: int, head: int = 0,
              every: int = 1) -> torch.Tensor:
    """``[B, H, T, ...]`` → the view ``[count, B·H/every, width, ...]`` whose j-th entry is rows
    ``[start + step·j, start + step·j + width)`` (windows may overlap) of the heads ``head,
    head + every, …``. Needs :func:`_runs_fit`."""
    b, h = x.shape[0], x.shape[1] // every
    heads_stride = x.stride(1) * every if h > 1 else x.stride(0)
    return x.as_strided((count, b * h, width, *x.shape[3:]),
                        (step * x.stride(2), heads_stride, x.stride(2), *x.stride()[3:]),
                        x.storage_offset() + start * x.stride(2) + head * x.stride(1))


def _runs_fit(*tensors: torch.Tensor) -> bool:
    """Whether every ``[B, H, T, ...]`` tensor has B and H mergeable into one dimension and
    unit-stride rows, as :func:`_run_view` needs."""
    return all((x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
               and (x.dim() == 3 or x.stride(-1) == 1) for x in tensors)


class _RunWork:
    """Where a run of ``count`` query blocks ``step`` rows apart reads and writes: the rows of
    every block at once as ``[count, B·Hkv, n, ...]`` views (see :func:`_run_view`); a
    segment's keys too, shifted with their block. With GQA (``group`` G > 1) a run executes G
    times, each with the query heads ``member, member + G, …`` (one per K/V head)."""

    def __init__(self, step: int, count: int, heads_q: int, group: int = 1, member: int = 0):
        self.step, self.count = step, count
        self.heads_q, self.group, self.member = heads_q, group, member
        self.views, self.mask_heads = True, heads_q // group

    def take(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.group > 1 and x.shape[1] == self.heads_q:  # a query-side tensor
            return _run_view(x, start, self.step, self.count, stop - start, self.member, self.group)
        return _run_view(x, start, self.step, self.count, stop - start)

    def put(self, dest: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        self.take(dest, start, stop).copy_(value)

    def add(self, dest: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        """Add ``value [count, B·H, width, ...]`` into the blocks' windows of ``dest``. Windows
        wider than the step overlap, so they are added in interleaved sets that do not."""
        sets = min(self.count, math.ceil((stop - start) / self.step))
        for first in range(sets):
            _run_view(dest, start + first * self.step, self.step * sets,
                      len(range(first, self.count, sets)), stop - start).add_(value[first::sets])


@functools.lru_cache(maxsize=8)
def _lower_triangle(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool, True on and below the diagonal (cached: every causal diagonal tile asks)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def _staircase(structure: str, n: int, width: int, device: torch.device) -> torch.Tensor:
    """The allowed keys ``[n, width]`` (bool) of a staircase segment (see :class:`Segment`)."""
    rows = torch.arange(n, device=device)[:, None]  # [n, 1]
    cols = torch.arange(width, device=device)[None, :]  # [1, width]
    allowed = torch.ones(n, width, dtype=torch.bool, device=device)
    if structure in ("upper", "band"):
        allowed &= cols >= rows
    if structure in ("lower", "band"):
        allowed &= cols - (width - n) <= rows
    return allowed


@functools.lru_cache(maxsize=8)
def _staircase_additive(structure: str, n: int, width: int, group: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """The additive mask ``[1, 1, G·n, width]`` of a staircase segment (0 where allowed, −inf
    elsewhere), repeated for the G query heads stacked as rows (cached: a workload has a handful
    of shapes, each at most G·256 × ``staircase_max_keys`` keys; every row keeps a key, its
    diagonal)."""
    allowed = _staircase(structure, n, width, device)
    return additive_mask(allowed.repeat(group, 1), None, dtype)[None, None]


@functools.lru_cache(maxsize=8)
def _staircase_strips(structure: str, n: int, width: int, strip: int, dtype: torch.dtype,
                      device: torch.device) -> tuple:
    """How a staircase segment (``n`` rows × ``width`` keys) runs in strips of ``strip`` rows:
    ``(rows, keys, additive)`` per strip, ``rows``/``keys`` slices of the segment and
    ``additive [1, 1, rows, keys]`` (0 where allowed, −inf elsewhere). Each strip's keys start
    at its first row's first allowed key and end at its last row's last one."""
    allowed = _staircase(structure, n, width, device)
    strips = []
    for start in range(0, n, strip):
        stop = min(start + strip, n)
        first = start if structure in ("upper", "band") else 0
        last = width - n + stop if structure in ("lower", "band") else width
        keys = slice(first, last)
        piece = additive_mask(allowed[start:stop, keys], None, dtype)[None, None]  # [1, 1, r, k]
        strips.append((slice(start, stop), keys, piece))
    return tuple(strips)


class Positions(NamedTuple):
    """A call's position biases (ALiBi, relative): ``vector [1|B, Hq, L]``, the bias of each
    relative position (:meth:`Problem.position_vector`), and, for the fused kernel,
    ``backwards`` (the vector reversed along L) with ``keys``/``values`` ``[B, Hkv, Tk, D]``
    in reverse order: a segment without element mask runs over its keys last to first, so
    its bias is a view of ``backwards`` with unit strides (:meth:`PositionTile.backwards`),
    and a causal row meets its nearest keys first (torch's CPU kernel slows down when a
    row's running maximum keeps climbing by much, as ALiBi makes it over keys in order)."""

    vector: torch.Tensor
    backwards: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


def _positions(problem: Problem, dtype: torch.dtype, fused: bool = False,
               keys: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
               vector: Optional[torch.Tensor] = None, rows: int = 0) -> Optional[Positions]:
    """The :class:`Positions` of a call, or ``None`` without ALiBi and relative biases.
    ``vector``: the position vector, when the caller has it already. With ``fused``,
    ``keys`` and ``values`` ``[B, Hkv, Tk, D]`` are reversed too when the call has at least
    ``Dk + Dv`` query ``rows`` per K/V head (G·Tq): building every segment's bias then costs
    more than reversing K/V once (a decoding step builds its small bias instead)."""
    vector = problem.position_vector(dtype) if vector is None else vector
    if vector is None or not fused or rows < keys.shape[-1] + values.shape[-1]:
        return None if vector is None else Positions(vector)
    return Positions(vector, vector.flip(-1), keys.flip(2), values.flip(2))


class PositionTile(NamedTuple):
    """The ALiBi and relative biases of one segment, read from the call's vectors by relative
    position (:class:`Positions`), never built as a ``Tq × Tk`` tensor. ``vector`` and
    ``reverse`` ``[V0, V1, G, L]``: the vector and its reverse in the work's layout (see
    ``_BlockWork.positions``), G query heads stacked as rows of ``rows`` each; ``first``: the
    index in ``vector`` of row 0's bias for key 0 (row i's bias for key j is at ``first + j −
    i``); ``span``: the keys."""

    vector: torch.Tensor
    reverse: Optional[torch.Tensor]
    first: int
    rows: int
    span: int

    def natural(self, rows: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor:
        """The bias of rows ``rows`` (of each head's ``rows``) and keys ``keys``, built:
        ``[V0, V1, G·r, k]``. Read as a view with rows reversed (row r is query row ``rows −
        1 − r``, entry ``(r, j)`` at ``first − (rows − 1) + r + j``), then put in order."""
        v, n = self.vector, self.rows
        start, stop, _ = rows.indices(n)
        skewed = v.as_strided((*v.shape[:3], n, self.span), (*v.stride()[:3], 1, 1),
                              v.storage_offset() + self.first - (n - 1))  # [V0, V1, G, n, span]
        return skewed[..., n - stop:n - start, keys].flip(3).flatten(2, 3)  # [V0, V1, G·r, k]

    def backwards(self, member: int) -> torch.Tensor:
        """The bias of head ``member`` (of the G stacked) with the keys in reverse order, as a
        view ``[V0, V1, rows, span]`` of the reversed vector: key ``j'`` is key ``span − 1 −
        j'``, so entry ``(i, j')`` is ``reverse[L − first − span + i + j']``, strides 1 and 1
        (which torch's fused kernel takes as its additive mask as is)."""
        v = self.reverse
        return v.as_strided((v.shape[0], v.shape[1], self.rows, self.span),
                            (v.stride(0), v.stride(1), 1, 1),
                            v.storage_offset() + member * v.stride(2)
                            + v.shape[-1] - self.first - self.span)


def _spread(vector: torch.Tensor) -> float:
    """The largest range (max − min) of a position vector ``[1|B, Hq, L]`` over one head."""
    if vector.shape[-1] == 0:
        return 0.0
    return float((vector.amax(-1) - vector.amin(-1)).max())


def _position_tile(problem: Problem, work, positions: Optional[Positions], batch: int,
                   rows: tuple[int, int], seg: Segment) -> Optional[PositionTile]:
    """The :class:`PositionTile` of query rows ``rows`` (local) over segment ``seg``, or
    ``None`` without position biases."""
    if positions is None:
        return None
    first = (problem.kv_offset + seg.start) - (problem.q_offset + rows[0]) + problem.space.q_len - 1
    reverse = None if positions.backwards is None else work.positions(positions.backwards, batch)
    return PositionTile(work.positions(positions.vector, batch), reverse, first, rows[1] - rows[0],
                        seg.stop - seg.start)


def _with_positions(tile: Optional["TileMask"], positions: PositionTile) -> "TileMask":
    """A fused segment's mask with the position biases joined: a segment without element mask
    keeps them as :class:`PositionTile` when the call's keys are reversed (read as views, its
    keys in reverse order, see :func:`_positions`), else gets them built; a strip, a causal
    square or an additive tile gets them added to its additive mask (built, at most a tile)."""
    if tile is None:
        if positions.reverse is not None:
            return TileMask(None, None, positions=positions)
        return TileMask(positions.natural(), None)
    if tile.strips is not None:
        return tile._replace(strips=tuple((rows, keys, additive + positions.natural(rows, keys))
                                          for rows, keys, additive in tile.strips))
    if tile.causal:
        lower = _lower_triangle(positions.rows, positions.vector.device)
        return TileMask(positions.natural().masked_fill_(~lower, float("-inf")), None)
    return tile._replace(additive=tile.additive + positions.natural())


class TileMask(NamedTuple):
    """How one PARTIAL segment is masked: an additive tile ``[Bm, Hkv|1, G·n, span]`` (−inf where
    forbidden, + bias) with per-row "has a key" flags ``[Bm, Hkv|1, G·n]``; or, when the tile is
    exactly a lower triangle on its own diagonal, ``causal=True`` and nothing materialised; or,
    for a staircase run in strips (see :func:`_staircase_strips`), ``strips``.
    ``has_key`` is ``None`` when every row has a key. On the matmul path with score modifiers
    every segment has one: ``scores`` (:class:`TileScores`) changes its scores first (before
    the mask's bias too when it holds score functions; ``additive`` then holds only 0/−inf).
    With the fused kernel, position biases (ALiBi, relative) are in ``additive`` or the strips,
    or, on a segment without element mask, in ``positions``: its keys and values then come in
    reverse order, and the bias is read as views (:meth:`PositionTile.backwards`)."""

    additive: Optional[torch.Tensor]
    has_key: Optional[torch.Tensor]
    causal: bool = False
    strips: Optional[tuple] = None
    scores: Optional["TileScores"] = None
    positions: Optional[PositionTile] = None


def _segment_mask(problem: Problem, rows: tuple[int, int], seg: Segment, heads_q: int,
                  heads_kv: int, dtype: torch.dtype, fused: bool, with_bias: bool = True,
                  ) -> TileMask:
    """Evaluate the mask on one segment (see :class:`TileMask`). The fused kernel's
    ``is_causal`` is used only for a positive scale (it gives NaN for a scale ≤ 0). Without
    ``with_bias`` the additive tile leaves out the mask's bias (score modifiers add it among
    theirs, see :class:`TileScores`)."""
    n = rows[1] - rows[0]
    group = heads_q // heads_kv
    if fused and seg.structure is not None:  # a known staircase: nothing to evaluate
        width, device = seg.stop - seg.start, problem.space.device
        strip = problem.plan.options.triangle_strip
        if group == 1 and n >= 2 * strip:
            return TileMask(None, None, strips=_staircase_strips(
                seg.structure, n, width, strip, dtype, device))
        if group == 1 and seg.structure == "lower" and width == n and problem.scale > 0:
            return TileMask(None, None, causal=True)
        return TileMask(_staircase_additive(seg.structure, n, width, group, dtype, device), None)
    device = problem.space.device
    q_idx = torch.arange(problem.q_offset + rows[0], problem.q_offset + rows[1], device=device)
    kv_idx = torch.arange(problem.kv_offset + seg.start, problem.kv_offset + seg.stop, device=device)

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [Bm, Hm, n, span] → [Bm, Hkv|1, G·n, span]
        if t.shape[1] == 1:
            return t.expand(t.shape[0], group, n, t.shape[-1]).reshape(t.shape[0], 1, group * n, -1)
        return t.reshape(t.shape[0], heads_kv, group * n, t.shape[-1])

    allowed = grouped(problem.mask.tile(q_idx, kv_idx, problem.space))
    values = problem.mask.tile_bias(q_idx, kv_idx, problem.space) if with_bias else None
    additive = additive_mask(allowed, None if values is None else grouped(values), dtype)
    return TileMask(additive, allowed.any(dim=-1))


class Traced(NamedTuple):
    """One tile's modified scores with their graph (:meth:`TileScores.trace`): ``raw`` (the
    scaled scores, a leaf), ``biased`` (after softcap and the additive biases) and ``final``
    (after the score functions), each ``[B, Hq, n, span]``."""

    raw: torch.Tensor
    biased: torch.Tensor
    final: torch.Tensor


class TileScores(NamedTuple):
    """The score modifiers of one segment on the matmul path: ``modifiers`` at queries
    ``q_idx`` and keys ``kv_idx`` (global positions) of ``space``, the position biases
    ``positions`` (:class:`PositionTile`, or ``None`` without ALiBi and relative biases) and,
    only when score functions follow, the mask's bias tile ``bias [Bm, Hm, n, span]`` (without
    them it is in the additive mask). Scores come in the engine's ``[B, Hkv, G·n, span]``
    layout; score functions see them per query head, ``[B, Hq, n, span]``.

    Softcap and position biases have hand-written derivatives (:func:`_segment_backward_matmul`);
    score functions are differentiated by autograd (:meth:`trace`, :meth:`grads`)."""

    modifiers: Modifiers
    q_idx: torch.Tensor
    kv_idx: torch.Tensor
    space: MaskSpace
    bias: Optional[torch.Tensor]
    heads_q: int
    positions: Optional[PositionTile] = None

    @property
    def traced(self) -> bool:
        """Whether the backward goes through autograd (score functions are present)."""
        return bool(self.modifiers.functions)

    @property
    def capped_alone(self) -> bool:
        """Whether a softcap is all there is (no position biases, no score functions)."""
        return (self.modifiers.softcap is not None and self.positions is None
                and not self.modifiers.functions)

    def scores(self, q_block: torch.Tensor, k_seg: torch.Tensor, scale: float) -> torch.Tensor:
        """What :meth:`apply` takes: ``q·kᵀ·scale`` ``[B, Hkv, G·n, span]``, divided by the cap
        with a softcap. The division is folded into the queries while ``|scale| / cap`` leaves
        float32 room (≤ 2^64); past that, ``q · (scale / cap)`` could overflow to inf and the
        matmul give NaN (inf·0, inf − inf), so the scores are divided instead (``±inf`` there
        is a saturated ``tanh``, ±1)."""
        softcap = self.modifiers.softcap
        if softcap is None:
            return (q_block * scale) @ k_seg.transpose(-1, -2)
        if abs(scale) / softcap.cap <= _FOLD_LIMIT:
            return (q_block * (scale / softcap.cap)) @ k_seg.transpose(-1, -2)
        return ((q_block * scale) @ k_seg.transpose(-1, -2)).div_(softcap.cap)

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores from :meth:`scores` ``[B, Hkv, G·n, span]`` (overwritten) → the
        modified scores, same layout, before masking."""
        softcap = self.modifiers.softcap
        if softcap is not None:
            scores.tanh_().mul_(softcap.cap)
        if self.positions is not None:
            scores.add_(self.positions.natural())
        if not self.modifiers.functions:
            return scores
        per_head = _ungrouped(scores, self.heads_q)  # [B, Hq, n, span]
        if self.bias is not None:
            per_head = per_head + self.bias.to(per_head.dtype)
        modified = self.modifiers.call_functions(per_head, self.q_idx, self.kv_idx)
        return _grouped(modified.contiguous(), scores.shape[1])

    def trace(self, scores: torch.Tensor) -> Traced:
        """:meth:`apply` recorded by autograd from a leaf copy of the scaled scores ``q·kᵀ·scale
        [B, Hkv, G·n, span]`` (not divided by the cap: :meth:`Modifiers.cap` divides), for
        :meth:`grads`."""
        with torch.enable_grad():
            raw = _ungrouped(scores, self.heads_q).detach().requires_grad_()  # [B, Hq, n, span]
            biased = self.modifiers.cap(raw)
            if self.positions is not None:
                biased = biased + _ungrouped(self.positions.natural(), self.heads_q)
            if self.bias is not None:
                biased = biased + self.bias.to(biased.dtype)
            return Traced(raw, biased, self.modifiers.call_functions(biased, self.q_idx,
                                                                     self.kv_idx))

    def grads(self, traced: Traced, grad_final: torch.Tensor, params: Sequence[torch.Tensor],
              want_biased: bool) -> tuple:
        """Backward of :meth:`trace` for ``grad_final`` (dS of the final scores, ``[B, Hkv,
        G·n, span]``) → ``(grad_raw [B, Hkv, G·n, span], grad_biased [B, Hq, n, span] or
        None, [d param or None for each of params])``. ``grad_biased`` (``want_biased``): the
        gradient where biases are added (the mask's bias and the position biases get it);
        ``params`` get what flows to them through the score functions."""
        heads_kv = grad_final.shape[1]
        grad_final = _ungrouped(grad_final, self.heads_q)
        if not traced.final.requires_grad:  # score functions that ignore the scores
            zeros = torch.zeros_like(grad_final)
            return (_grouped(zeros, heads_kv), zeros if want_biased else None,
                    [None] * len(params))
        wanted = [traced.raw, traced.biased, *params]
        found = torch.autograd.grad(traced.final, wanted, grad_final, allow_unused=True)
        grad_raw = found[0] if found[0] is not None else torch.zeros_like(traced.raw)
        grad_biased = found[1] if found[1] is not None else torch.zeros_like(traced.raw)
        return _grouped(grad_raw, heads_kv), grad_biased if want_biased else None, list(found[2:])


def _tile_scores(problem: Problem, rows: tuple[int, int], seg: Segment, heads_q: int,
                 positions: Optional[PositionTile] = None) -> Optional[TileScores]:
    """The :class:`TileScores` of one segment on the matmul path, or ``None`` when nothing
    changes scores."""
    if not problem.modifies_scores:
        return None
    device = problem.space.device
    q_idx = torch.arange(problem.q_offset + rows[0], problem.q_offset + rows[1], device=device)
    kv_idx = torch.arange(problem.kv_offset + seg.start, problem.kv_offset + seg.stop, device=device)
    bias = None
    if (problem.modifiers.functions and seg.partial and problem.mask is not None
            and problem.mask.has_bias):
        bias = problem.mask.tile_bias(q_idx, kv_idx, problem.space)  # [Bm, Hm, n, span]
    return TileScores(problem.modifiers, q_idx, kv_idx, problem.space, bias, heads_q, positions)


def _dropout_keep(problem: Problem, block_row: int, seg: Segment, shape, device) -> torch.Tensor:
    """Keep-mask ``[B, Hkv, G·n, span]`` for one segment, drawn per (query block, key block) from
    a generator seeded by (seed, block_row, key block), so forward and backward agree."""
    b, hkv, gn, span = shape
    pieces = []
    for start in range(seg.start, seg.stop, problem.plan.block_k):
        width = min(start + problem.plan.block_k, seg.stop) - start
        gen = torch.Generator(device=device)
        gen.manual_seed((problem.seed * 1_000_003 + block_row * 65_537 + start // problem.plan.block_k)
                        % (2**63 - 1))
        pieces.append(torch.rand((b, hkv, gn, width), generator=gen, device=device))
    return torch.cat(pieces, dim=-1) >= problem.dropout_p


def uses_fused_kernel(q: torch.Tensor, v: torch.Tensor, dropout_p: float,
                      options: TiledOptions = TiledOptions()) -> bool:
    """Tiles go through torch's fused CPU flash kernel (which returns the LSE) for fp32/fp64 CPU
    inputs with Dk == Dv and no dropout, unless ``options.fused_tiles`` is off; everything else
    uses the matmul path below."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and q.shape[-1] == v.shape[-1] and dropout_p == 0 and options.fused_tiles)


def fused_kernel_takes(modifiers: Optional[Modifiers]) -> bool:
    """Whether tiles with these score modifiers can go through torch's fused kernel: none that
    change scores, or ALiBi and relative biases alone (:attr:`Modifiers.by_position`), passed
    as its additive mask. Softcap and score functions change the scores themselves, which the
    kernel cannot: they take the matmul path."""
    return modifiers is None or not modifiers.changes_scores or modifiers.by_position


def _segment_pieces(q_block, k_seg, v_seg, tile: Optional[TileMask], scale, fused, keep=None,
                    dropout_p=0.0):
    """Attention of one query block over one key segment, as ``(rows, out, lse)`` pieces (the
    strips of a staircase; the rows of each stacked query head for position biases read as
    views, the keys then last to first; else one piece with ``rows = slice(None)``), each
    normalised over the segment alone. ``q_block [B, Hkv, G·n, Dk]``, ``k_seg/v_seg [B, Hkv,
    span, D]`` → ``out [B, Hkv, rows, Dv]``, ``lse [B, Hkv, rows]``."""
    if fused and tile is not None and tile.strips is not None:
        for rows, keys, strip_mask in tile.strips:
            yield (rows, *torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_block[:, :, rows], k_seg[:, :, keys], v_seg[:, :, keys], 0.0, False,
                attn_mask=strip_mask, scale=scale))
        return
    if fused and tile is not None and tile.positions is not None:
        # keys in reverse order (see Positions), the bias a view; one call per stacked head
        for member, rows in enumerate(_member_rows(tile.positions)):
            yield (rows, *torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_block[:, :, rows], k_seg, v_seg, 0.0, False,
                attn_mask=tile.positions.backwards(member), scale=scale))
        return
    yield (slice(None), *_segment_forward(q_block, k_seg, v_seg, tile, scale, fused, keep,
                                          dropout_p))


def _member_rows(positions: PositionTile) -> list[slice]:
    """The rows of each of the G query heads stacked in a block (``[B, Hkv, G·n, ...]``)."""
    n = positions.rows
    return [slice(g * n, (g + 1) * n) for g in range(positions.vector.shape[2])]


def _segment_forward(q_block, k_seg, v_seg, tile: Optional[TileMask], scale, fused, keep=None,
                     dropout_p=0.0):
    """One piece of :func:`_segment_pieces` (not strips) → ``(out, lse)``."""
    additive = tile.additive if tile is not None else None
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_block, k_seg, v_seg, 0.0, tile is not None and tile.causal, attn_mask=additive,
            scale=scale)
        if additive is not None and tile.has_key is not None:  # out 0 but lse 0 on rows with no key
            lse = lse.masked_fill(~tile.has_key, float("-inf"))
        return out, lse
    modified = tile.scores if tile is not None else None
    scores = _scores(q_block, k_seg, scale, modified)  # [B, Hkv, G·n, span]
    units = 1.0  # what one unit of `scores` is worth in scores
    if modified is not None and additive is None and modified.capped_alone:
        scores.tanh_()  # the cap's factor joins the exponent's below
        units = modified.modifiers.softcap.cap
    elif modified is not None:
        scores = modified.apply(scores)  # softcap, biases, score functions
    if additive is not None:
        scores.add_(additive)
    row_max = scores.amax(dim=-1)  # [B, Hkv, G·n]
    safe_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    probs = _exp_(scores.sub_(safe_max[..., None]), units)
    row_sum = probs.sum(dim=-1)
    if keep is not None:
        probs.masked_fill_(~keep, 0.0).div_(1.0 - dropout_p)
    empty = row_sum == 0
    out = (probs @ v_seg) / torch.where(empty, 1.0, row_sum)[..., None]
    lse = torch.where(empty, float("-inf"),
                      safe_max * units + torch.log(torch.where(empty, 1.0, row_sum)))
    return out, lse


def _exp_(x: torch.Tensor, units: float = 1.0) -> torch.Tensor:
    """``exp(x · units)`` in place of scores less their row's maximum or LSE (``x ≤ 0``), as
    ``exp2(x · units · log2 e)`` (see :data:`LOG2E`), with weights below ``2^FLUSH_BELOW``
    made exactly 0."""
    return torch.nn.functional.threshold_(x.mul_(units * LOG2E), FLUSH_BELOW,
                                          float("-inf")).exp2_()


def _bounded(segments, rows_of_work: int, block_k: int, fused: bool):
    """Segments as computed: the fused kernel tiles internally and takes them whole; the matmul
    path materialises ``[rows_of_work, span]`` scores, so long segments are cut into pieces of at
    most ``TILE_ELEMENTS`` scores (block-aligned, so dropout keys and masks are unchanged)."""
    if fused:
        yield from segments
        return
    max_span = max(block_k, TILE_ELEMENTS // max(1, rows_of_work) // block_k * block_k)
    for seg in segments:
        for start in range(seg.start, seg.stop, max_span):
            yield Segment(start, min(start + max_span, seg.stop), seg.partial)


def _segment_inputs(problem, work, q_block, keys, values, block, rows, seg, fused,
                    positions: Optional[Positions] = None):
    """A segment's keys and values (in ``work``'s layout; in reverse order when the mask has
    ``positions``, see :class:`Positions`), mask (with the score modifiers: see
    :class:`TileMask`; ``positions``: the call's position biases) and dropout keep-mask."""
    heads_kv, kv_len = keys.shape[1], keys.shape[2]
    tile = keep = None
    position_tile = _position_tile(problem, work, positions, keys.shape[0], rows, seg)
    modified = None if fused else _tile_scores(problem, rows, seg, work.mask_heads, position_tile)
    if seg.partial:
        tile = _segment_mask(problem, rows, seg, work.mask_heads, heads_kv, keys.dtype, fused,
                             with_bias=modified is None or not modified.traced)
    if modified is not None:
        tile = (tile or TileMask(None, None))._replace(scores=modified)
    elif position_tile is not None:
        tile = _with_positions(tile, position_tile)
    if tile is not None and tile.positions is not None:  # keys last to first
        k_seg = work.take(positions.keys, kv_len - seg.stop, kv_len - seg.start)
        v_seg = work.take(positions.values, kv_len - seg.stop, kv_len - seg.start)
    else:
        k_seg, v_seg = work.take(keys, seg.start, seg.stop), work.take(values, seg.start, seg.stop)
    if problem.dropout_p > 0:
        shape = (*q_block.shape[:3], seg.stop - seg.start)
        keep = _dropout_keep(problem, block, seg, shape, keys.device)
    return k_seg, v_seg, tile, keep


def _scores(q_block: torch.Tensor, k_seg: torch.Tensor, scale: float,
            modified: Optional[TileScores]) -> torch.Tensor:
    """A segment's scores ``q·kᵀ·scale`` ``[B, Hkv, G·n, span]``, as ``modified``'s
    :meth:`~TileScores.apply` takes them (divided by a softcap's cap) when there is one."""
    if modified is None:
        return (q_block * scale) @ k_seg.transpose(-1, -2)
    return modified.scores(q_block, k_seg, scale)


def _merge_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> None:
    """:func:`attnkit.numerics.merge` without autograd, in place on ``(out_a, lse_a)`` (views
    of results this engine owns): ``out_a [..., n, D]`` becomes ``lerp(out_a, out_b, σ(lse_b −
    lse_a))`` and ``lse_a [..., n]`` the union's LSE. Rows empty on both sides (σ of NaN) get
    weight 0: both outputs are 0 there and ``logaddexp(−inf, −inf) = −inf``."""
    weight_b = torch.sub(lse_b, lse_a).sigmoid_().nan_to_num_(0.0)  # [..., n]
    out_a.lerp_(out_b, weight_b.unsqueeze(-1))
    torch.logaddexp(lse_a, lse_b, out=lse_a)


def _schedule(problem: Problem, tq: int, heads_q: int, heads_kv: int, fused: bool,
              tensors: tuple, positions: Optional[Positions] = None):
    """Yield ``(group, work)``: the plan's groups, each with where it reads and writes. Runs
    execute as one group (:class:`_RunWork`; G times with GQA) when the fused kernel serves them,
    every tensor the pass views fits :func:`_run_view` and there are no ``positions`` (their
    reversed keys shift against the blocks of a run); otherwise block by block."""
    block_work = _BlockWork(heads_q, heads_kv)
    runs = fused and positions is None and _runs_fit(*tensors)
    shared_prefix = fused and heads_q == heads_kv  # results are then written in place
    group_size = heads_q // heads_kv
    for group in problem.plan.groups(tq, runs=runs, shared_prefix=shared_prefix, dense=fused):
        if group.count == 1:
            yield group, block_work
        else:
            for member in range(group_size):
                yield group, _RunWork(group.step * problem.plan.block_q, group.count, heads_q,
                                      group_size, member)


def tiled_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass. ``q [B, Hq, Tq, Dk]``, ``k [B, Hkv, Tk, Dk]``, ``v [B, Hkv, Tk, Dv]`` →
    ``out [B, Hq, Tq, Dv]`` (q's dtype) and ``lse [B, Hq, Tq]`` (fp32, fp64 for fp64)."""
    batch, heads_q, tq, _ = q.shape
    heads_kv, dv = k.shape[1], v.shape[-1]
    acc = accum_dtype(q.dtype)
    fused = problem.plan.fused
    if fused and problem.modifies_scores and not problem.modifiers.by_position:
        raise ValueError("tiled_forward: softcap and score functions need a plan built with "
                         "fused=False (the fused kernel takes ALiBi and relative biases alone)")
    queries, keys, values = q.to(acc), k.to(acc), v.to(acc)  # no copy when already acc
    positions = _positions(problem, acc, fused, keys, values, rows=heads_q // heads_kv * tq)
    out = torch.empty(batch, heads_q, tq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads_q, tq), float("-inf"), dtype=acc, device=q.device)
    for group, work in _schedule(problem, tq, heads_q, heads_kv, fused, (queries, keys, values),
                                 positions):
        start, stop = group.rows
        q_block = work.take(queries, start, stop)  # [B, Hkv, G·n, Dk] or [count, B·Hkv, n, Dk]
        direct = out.dtype == acc and work.views
        # Results go straight into `out` and `lse` where the work's rows are views of them.
        block_out = work.take(out, start, stop) if direct else None
        block_lse = work.take(lse, start, stop) if direct else None
        first = group.fresh
        for seg in _bounded(group.segments, q_block.numel() // q_block.shape[-1],
                            problem.plan.block_k, fused):
            k_seg, v_seg, tile, keep = _segment_inputs(problem, work, q_block, keys, values,
                                                       group.block, group.rows, seg, fused,
                                                       positions)
            for rows, seg_out, seg_lse in _segment_pieces(q_block, k_seg, v_seg, tile,
                                                          problem.scale, fused, keep,
                                                          problem.dropout_p):
                if block_out is None:
                    block_out = q_block.new_empty((*q_block.shape[:-1], dv), dtype=acc)
                    block_lse = q_block.new_empty(q_block.shape[:-1], dtype=acc)
                if first:
                    block_out[:, :, rows] = seg_out
                    block_lse[:, :, rows] = seg_lse
                else:
                    _merge_into(block_out[:, :, rows], block_lse[:, :, rows], seg_out.to(acc),
                                seg_lse.to(acc))
            first = False
        if first:  # no key for any of these rows (a single fresh block: runs have keys)
            out[:, :, start:stop] = 0
        elif not direct:
            work.put(out, start, stop, block_out.to(q.dtype))
            work.put(lse, start, stop, block_lse)
    return out, lse


def _write_or_add(dest: torch.Tensor, value: torch.Tensor, write: bool) -> None:
    """``dest = value`` (``write``) or ``dest += value``, in place."""
    if write:
        dest.copy_(value)
    else:
        dest.add_(value)


def _segment_grads(q_block, k_seg, v_seg, do_block, lse_block, tile: Optional[TileMask], scale,
                   fused, *, out_block=None, delta_block=None, keep=None, dropout_p=0.0,
                   want_grad_scores=False, params=()):
    """Gradients of one query block over one key segment, as ``(rows, keys, dq, dk, dv,
    grad_scores, param_grads)`` pieces, the backward of :func:`_segment_pieces`: the strips of
    a staircase (``rows``/``keys``: slices of the block's rows and the segment's keys); the
    rows of each stacked query head for position biases read as views (``keys = slice(None)``,
    dK/dV in the reversed key order of ``k_seg``); else one piece with ``rows = keys =
    slice(None)``. ``q_block [B, Hkv, G·n, Dk]``, ``do_block
    [B, Hkv, G·n, Dv]``,
    ``lse_block [B, Hkv, G·n]`` (+inf on rows with no key), ``k_seg/v_seg [B, Hkv, span, D]``
    (or the ``[count, B·Hkv, ...]`` views of a run) → ``dq [B, Hkv, rows, Dk]``, ``dk/dv [B,
    Hkv, keys, D]``. The fused kernel needs ``out_block [B, Hkv, G·n, Dv]``; the matmul path
    needs ``delta_block [B, Hkv, G·n]`` (see :func:`_segment_backward_matmul`) and gives
    ``grad_scores`` (dS) with ``want_grad_scores``, else ``None``, and ``param_grads``: the
    gradients of the score modifiers' tensors ``params`` (``None`` where unused; empty
    without modifiers)."""
    if fused and tile is not None and tile.strips is not None:
        for rows, keys, strip_mask in tile.strips:
            yield (rows, keys, *_segment_backward_fused(
                q_block[:, :, rows], k_seg[:, :, keys], v_seg[:, :, keys], do_block[:, :, rows],
                out_block[:, :, rows], lse_block[:, :, rows], scale, additive=strip_mask), None, [])
        return
    if fused and tile is not None and tile.positions is not None:  # keys reversed, as forward
        for member, rows in enumerate(_member_rows(tile.positions)):
            yield (rows, slice(None), *_segment_backward_fused(
                q_block[:, :, rows], k_seg, v_seg, do_block[:, :, rows], out_block[:, :, rows],
                lse_block[:, :, rows], scale, additive=tile.positions.backwards(member)),
                None, [])
        return
    additive = tile.additive if tile is not None else None
    if fused:
        yield (slice(None), slice(None), *_segment_backward_fused(
            q_block, k_seg, v_seg, do_block, out_block, lse_block, scale,
            causal=tile is not None and tile.causal, additive=additive), None, [])
        return
    yield (slice(None), slice(None), *_segment_backward_matmul(
        q_block, k_seg, v_seg, do_block, lse_block, delta_block, additive, scale, keep, dropout_p,
        want_grad_scores, tile.scores if tile is not None else None, params))


def _segment_backward_fused(q_block, k_seg, v_seg, do_block, out_block, lse_block, scale, *,
                            causal=False, additive=None):
    """One piece of :func:`_segment_grads` through torch's fused CPU kernel, which forms
    ``rowsum(dO ∘ O)`` from ``out_block`` itself → ``(dq, dk, dv)``; shapes as there."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do_block, q_block, k_seg, v_seg, out_block, lse_block, 0.0, causal, attn_mask=additive,
        scale=scale)


def _segment_backward_matmul(q_block, k_seg, v_seg, do_block, lse_block, delta_block,
                             additive: Optional[torch.Tensor], scale, keep=None, dropout_p=0.0,
                             want_grad_scores=False, modified: Optional[TileScores] = None,
                             params: Sequence[torch.Tensor] = ()):
    """One piece of :func:`_segment_grads` by matmuls, the scores ``[B, Hkv, G·n, span]``
    recomputed from ``lse_block [B, Hkv, G·n]``: ``dS = P ∘ (dP − Δ)`` with ``delta_block [B,
    Hkv, G·n]`` = Δ (``rowsum(dO ∘ O)``, less ``grad_lse``) → ``(dq, dk, dv, grad_scores,
    param_grads)``, ``grad_scores`` = dS ``[B, Hkv, G·n, span]`` where biases are added, with
    ``want_grad_scores``, else ``None``. ``keep [B, Hkv, G·n, span]``: the dropout keep-mask
    of the forward, if any.

    ``modified``: the segment's score modifiers, recomputed. Softcap's derivative is written
    out (``dS_raw = dS · (1 − tanh²(s/c))``) and position biases pass dS on unchanged; score
    functions go through autograd (:meth:`TileScores.trace`), which also gives
    ``param_grads``, what reaches ``params`` through them (empty without functions)."""
    q_scaled = q_block * scale
    by_autograd = modified is not None and modified.traced
    softcap = None if modified is None or by_autograd else modified.modifiers.softcap
    if softcap is not None:
        scores = modified.scores(q_block, k_seg, scale)  # s / cap
    else:
        scores = q_scaled @ k_seg.transpose(-1, -2)  # [B, Hkv, G·n, span]
    traced = tanh = None
    if by_autograd:
        traced = modified.trace(scores)
        # a copy to work on in place (autograd may have saved `final` itself)
        scores = _grouped(traced.final.detach().clone(memory_format=torch.contiguous_format),
                          scores.shape[1])
    elif softcap is not None:
        tanh = scores.tanh_()  # kept for the cap's derivative
        # tanh · cap rounds a row's largest score as the forward's LSE did (its row maximum
        # times the cap, plus log of the row's sum), so a row whose weight is all on one key
        # gets exactly 1 there. (tanh − lse / cap) · cap would carry the rounding of lse / cap,
        # eps·|lse|, into every weight: ±10% once |lse| nears 1e6 (a huge cap, a large scale).
        scores = tanh * softcap.cap
    if modified is not None and not by_autograd and modified.positions is not None:
        scores.add_(modified.positions.natural())
    if additive is not None:
        scores.add_(additive)
    probs = _exp_(scores.sub_(lse_block[..., None]))  # softmax weights, recomputed
    grad_probs = do_block @ v_seg.transpose(-1, -2)  # [B, Hkv, G·n, span]
    kept = probs
    if keep is not None:
        kept = probs.masked_fill(~keep, 0.0).div_(1.0 - dropout_p)
        grad_probs.masked_fill_(~keep, 0.0).div_(1.0 - dropout_p)
    dv = kept.transpose(-1, -2) @ do_block  # [B, Hkv, span, Dv]
    grad_scores = grad_probs.sub_(delta_block[..., None]).mul_(probs)  # dS = P ∘ (dP − Δ)
    grad_biased, param_grads = grad_scores, []
    if traced is not None:  # dS through the score functions: to the raw scores, biases, params
        grad_scores, grad_biased, param_grads = modified.grads(traced, grad_scores, params,
                                                               want_grad_scores)
        if grad_biased is not None:
            grad_biased = _grouped(grad_biased, grad_scores.shape[1])
    elif tanh is not None:  # through the cap, in tanh's buffer: dS · (1 − tanh²)
        grad_scores = tanh.square_().neg_().add_(1.0).mul_(grad_biased)
    dq = (grad_scores @ k_seg).mul_(scale)  # [B, Hkv, G·n, Dk]
    dk = grad_scores.transpose(-1, -2) @ q_scaled  # [B, Hkv, span, Dk]
    return dq, dk, dv, grad_biased if want_grad_scores else None, param_grads


def _add_position_grad(grad_vector: torch.Tensor, grad_scores: torch.Tensor, first: int) -> None:
    """Add one segment's score gradient ``[B, Hq, n, span]`` (where biases are added) into the
    position vector's gradient ``[1|B, Hq, L]``, summed along each diagonal ``j − i``: row i's
    key j goes to index ``first + j − i`` (``first``: see :class:`PositionTile`). The rows
    are laid out skewed in a zero buffer ``[B, Hq, n, n + span]`` (one spare column keeps
    them apart) so that each diagonal becomes a column, then summed over the rows."""
    batch, heads, n, span = grad_scores.shape
    width = n + span
    skewed = grad_scores.new_zeros(batch, heads, n, width)
    skewed.as_strided((batch, heads, n, span), (heads * n * width, n * width, width - 1, 1),
                      n - 1).copy_(grad_scores)  # row i, key j → column j − i + n − 1
    sums = skewed.sum(2)[..., :width - 1]  # [B, Hq, n + span − 1]
    if grad_vector.shape[0] == 1:
        sums = sums.sum(0, keepdim=True)
    grad_vector[..., first - (n - 1):first + span] += sums


def tiled_backward(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, *,
                   accumulate: bool = False, dbias: Sequence[Optional[torch.Tensor]] = (),
                   dparams: Sequence[Optional[torch.Tensor]] = (),
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward pass, recomputing tiles. ``grad_out [B, Hq, Tq, Dv]``, ``grad_lse [B, Hq, Tq]``
    or ``None`` → ``(dq, dk, dv)`` in the input dtypes, or with ``accumulate`` in the
    accumulation dtype (fp32 for fp16/bf16: a caller summing several calls, as ring attention
    does, rounds once at the end). dK/dV of a K/V head sum over its group.

    ``dbias``: one accumulator per bias of the mask (``problem.mask.biases()``, same shapes,
    accumulation dtype) or ``None`` where no gradient is wanted; each gets ``dBias = dS`` (the
    scores' gradient) summed over the bias's broadcast dims, tile by tile. Needs a plan
    without the fused kernel (which never forms dS).

    ``dparams``: one accumulator per tensor of the score modifiers (``problem.modifiers.
    tensors``, same shapes) or ``None`` where no gradient is wanted; each gets its gradient
    summed over the tiles. ALiBi slopes and relative tables get theirs from the gradient of
    the position vector (:meth:`Problem.position_vector`, dS summed along diagonals, see
    :func:`_add_position_grad`), which the matmul path forms: with them a fused plan runs its
    backward by matmuls, as it does for a differentiated LSE."""
    batch, heads_q, tq, _ = q.shape
    heads_kv, tk = k.shape[1], k.shape[2]
    acc = accum_dtype(q.dtype)
    wanted = [(t, d) for t, d in zip(_biases(problem.mask), dbias) if d is not None]
    modifier_tensors = problem.modifiers.tensors if problem.modifiers is not None else ()
    params = [(t, d) for t, d in zip(modifier_tensors, dparams) if d is not None]
    by_position = {id(t) for t in problem.modifiers.position_tensors} if params else set()
    slopes_or_tables = any(id(t) in by_position for t, _ in params)
    fused = problem.plan.fused and grad_lse is None and not slopes_or_tables
    if wanted and fused:
        raise ValueError("tiled_backward: dbias needs a plan built with fused=False")
    queries, keys, values = q.to(acc), k.to(acc), v.to(acc)
    vector = problem.position_vector(acc)  # [1|B, Hq, Tq + Tk − 1] or None
    if fused and vector is not None and _spread(vector) > WIDE_BIAS:
        fused = False  # subnormal weights in torch's fused backward: see WIDE_BIAS
    positions = _positions(problem, acc, fused, keys, values, vector,
                           rows=heads_q // heads_kv * tq)
    # the position vector's gradient [1|B, Hq, L], for the slopes and tables: in float64, as
    # the sum over every tile of terms of both signs (each row's dS sums to its dLSE)
    grad_vector = (torch.zeros_like(positions.vector, dtype=torch.float64) if slopes_or_tables
                   else None)
    grad_out, out = grad_out.to(acc), out.to(acc)
    if not fused:  # the fused kernel forms rowsum(dO ∘ O) itself
        delta = (grad_out * out).sum(dim=-1)  # [B, Hq, Tq]  rowsum(dO ∘ O)
        if grad_lse is not None:
            delta = delta - grad_lse.to(acc)  # d lse / d score = p, folded into the same term
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse.to(acc))  # p = 0 on empty rows
    dq = torch.empty_like(queries)  # every query block writes its rows below
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    # dK/dV of segments run with their keys reversed (see Positions), in that order
    reversed_dk, reversed_dv = ((torch.zeros_like(dk), torch.zeros_like(dv))
                                if positions is not None and positions.keys is not None
                                else (None, None))
    viewed = (queries, keys, values, grad_out, out, lse_safe, dq, dk, dv)
    for group, work in _schedule(problem, tq, heads_q, heads_kv, fused, viewed, positions):
        start, stop = group.rows
        if not group.segments:
            dq[:, :, start:stop] = 0
            continue
        q_block = work.take(queries, start, stop)  # [B, Hkv, G·n, Dk] or [count, B·Hkv, n, Dk]
        do_block = work.take(grad_out, start, stop)  # [..., n, Dv]
        lse_block = work.take(lse_safe, start, stop)  # [..., n]
        out_block = work.take(out, start, stop) if fused else None  # [..., n, Dv]
        delta_block = None if fused else work.take(delta, start, stop)  # [..., n]
        # dQ of the rows: straight into `dq` where the work's rows are a view of it; the first
        # segment's pieces are written, the later ones added.
        dq_block = work.take(dq, start, stop) if work.views else torch.empty_like(q_block)
        first = group.fresh
        for seg in _bounded(group.segments, q_block.numel() // q_block.shape[-1],
                            problem.plan.block_k, fused):
            k_seg, v_seg, tile, keep = _segment_inputs(problem, work, q_block, keys, values,
                                                       group.block, group.rows, seg, fused,
                                                       positions)
            backwards = tile is not None and tile.positions is not None
            for (rows, piece_keys, dq_piece, dk_piece, dv_piece, grad_scores,
                 param_grads) in _segment_grads(
                    q_block, k_seg, v_seg, do_block, lse_block, tile, problem.scale, fused,
                    out_block=out_block, delta_block=delta_block, keep=keep,
                    dropout_p=problem.dropout_p,
                    want_grad_scores=bool(wanted) or grad_vector is not None,
                    params=[t for t, _ in params]):
                _write_or_add(dq_block[:, :, rows], dq_piece, first)
                if backwards:  # the segment's keys, last to first
                    work.add(reversed_dk, tk - seg.stop, tk - seg.start, dk_piece)
                    work.add(reversed_dv, tk - seg.stop, tk - seg.start, dv_piece)
                else:
                    key_range = range(seg.start, seg.stop)[piece_keys]
                    work.add(dk, key_range.start, key_range.stop, dk_piece)
                    work.add(dv, key_range.start, key_range.stop, dv_piece)
                if grad_scores is not None:
                    per_head = _ungrouped(grad_scores, heads_q)  # [B, Hq, n, span]
                    _add_bias_grad(wanted, per_head, group.rows, seg)
                    if grad_vector is not None:
                        _add_position_grad(grad_vector, per_head, tile.scores.positions.first)
                for (_, total), grad in zip(params, param_grads):
                    if grad is not None:
                        total += grad
            first = False
        if not work.views:
            work.put(dq, start, stop, dq_block)
    if reversed_dk is not None:
        dk.add_(reversed_dk.flip(2))
        dv.add_(reversed_dv.flip(2))
    if grad_vector is not None:
        _add_position_param_grads(problem, grad_vector, [(t, d) for t, d in params
                                                         if id(t) in by_position])
    if accumulate:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_position_param_grads(problem: Problem, grad_vector: torch.Tensor, params: list) -> None:
    """Add the slopes' and tables' gradients into their accumulators (``params``: ``(tensor,
    accumulator)`` pairs) from the position vector's gradient ``[1|B, Hq, L]``, through the
    vector's construction (:meth:`Modifiers.pull_back`, O((Tq + Tk)·H))."""
    modifiers = problem.modifiers
    wanted = {id(t) for t, _ in params}
    found = modifiers.pull_back(lambda m: (m.position_bias(problem.space, grad_vector.dtype),),
                                (grad_vector,), [id(t) in wanted for t in modifiers.tensors])
    by_id = {id(t): grad for t, grad in zip(modifiers.tensors, found)}
    for tensor, total in params:
        if by_id.get(id(tensor)) is not None:
            total += by_id[id(tensor)]


def _add_bias_grad(wanted, grad_scores: torch.Tensor, rows: tuple[int, int], seg: Segment) -> None:
    """Add one segment's score gradient ``[B, Hq, n, span]`` into each bias accumulator
    ``[Bm, Hm, Tq|1, Tk|1]``, summed over the dims the bias broadcasts."""
    for bias, grad in wanted:
        part = grad_scores
        for dim in range(4):
            if bias.shape[dim] == 1 and part.shape[dim] != 1:
                part = part.sum(dim, keepdim=True)
        q_rows = slice(*rows) if bias.shape[2] != 1 else slice(0, 1)
        keys = slice(seg.start, seg.stop) if bias.shape[3] != 1 else slice(0, 1)
        grad[:, :, q_rows, keys] += part


class _TiledAttention(torch.autograd.Function):
    """``(q, k, v, problem, *tensors) → (out, lse)``; ``tensors`` are the mask's biases
    (``problem.mask.biases()``) then the score modifiers' tensors (``problem.modifiers.tensors``),
    inputs so that a learnable bias, ALiBi slopes, a relative table or what a score function
    reads gets its gradient. Its backward is differentiable through the float64 reference
    when ``create_graph=True`` (double backward)."""

    @staticmethod
    def forward(q, k, v, problem: Problem, *tensors):
        return tiled_forward(q, k, v, problem)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, problem, *_ = inputs
        ctx.set_materialize_grads(False)  # an unused lse gives grad_lse None, not zeros
        ctx.save_for_backward(q, k, v, *output)
        ctx.problem = problem

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        problem = ctx.problem
        biases, params = _biases(problem.mask), _modifier_tensors(problem)
        wants = ctx.needs_input_grad[4:]
        wants_bias, wants_param = wants[:len(biases)], wants[len(biases):]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if torch.is_grad_enabled():  # create_graph=True: the backward itself is differentiated
            grads = _differentiable_grads(q, k, v, [*biases, *params], problem, grad_out,
                                          grad_lse, ctx.needs_input_grad)
            return (*grads[:3], None, *grads[3:])
        acc = accum_dtype(q.dtype)
        dbias = [torch.zeros(t.shape, dtype=acc, device=t.device) if want else None
                 for t, want in zip(biases, wants_bias)]
        dparams = [torch.zeros(t.shape, dtype=accum_dtype(t.dtype), device=t.device) if want
                   else None for t, want in zip(params, wants_param)]
        with torch.autocast(q.device.type, enabled=False):  # a backward run inside autocast
            dq, dk, dv = tiled_backward(q, k, v, out, lse, grad_out, grad_lse, problem,
                                        dbias=dbias, dparams=dparams)
        return (dq, dk, dv, None,
                *(None if d is None else d.to(t.dtype) for d, t in zip([*dbias, *dparams],
                                                                       [*biases, *params])))


def _modifier_tensors(problem: Problem) -> tuple:
    """The score modifiers' tensors of ``problem`` (see :class:`~attnkit.modifiers.Modifiers`)."""
    return problem.modifiers.tensors if problem.modifiers is not None else ()


def _differentiable_grads(q, k, v, tensors, problem: Problem, grad_out, grad_lse, needed):
    """The gradients of q, k, v and ``tensors`` (the biases, then the modifiers' tensors),
    recorded for a further backward: the float64 reference recomputed with autograd
    (O(Tq·Tk) memory, for double backward only)."""
    inputs = Inputs(q=q, k=k, v=v, mask=problem.mask, scale=problem.scale, dropout_p=0.0,
                    generator=None, batch_shape=(), input_rank=4, modifiers=problem.modifiers)
    if problem.dropout_p > 0 or problem.q_offset or problem.kv_offset or inputs.space != problem.space:
        raise RuntimeError("double backward (create_graph=True) through tiled attention needs "
                           "dropout_p=0 and unsharded positions: use backend='reference'")
    result = steps(inputs)
    outputs, grads = [result.out], [grad_out.to(result.out.dtype)]
    if grad_lse is not None:
        outputs.append(result.lse)
        grads.append(grad_lse.to(result.lse.dtype))
    wanted = [t for t, need in zip((q, k, v, *tensors), (*needed[:3], *needed[4:])) if need]
    found = iter(torch.autograd.grad(outputs, wanted, grads, create_graph=True, allow_unused=True))
    return [next(found) if need else None for need in (*needed[:3], *needed[4:])]


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask] = None,
                    *, scale: float, space: Optional[MaskSpace] = None, q_offset: int = 0,
                    kv_offset: int = 0, dropout_p: float = 0.0, seed: int = 0,
                    block_q: Optional[int] = None, block_k: int = BLOCK_K,
                    options: TiledOptions = TiledOptions(),
                    modifiers: Optional[Modifiers] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable tiled attention on ``[B, H, T, D]`` tensors → ``(out, lse)``.

    ``q``'s rows sit at global positions ``q_offset…`` and ``k``'s at ``kv_offset…`` of a
    sequence described by ``space`` (default: these tensors alone), and ``mask`` is evaluated
    at those global positions. Inputs are not validated: call through ``attention()`` unless
    you build :class:`~attnkit.inputs.Inputs` yourself (ring attention does). ``options``:
    how the engine schedules its tiles (see :class:`TiledOptions`). ``modifiers``: score
    modifiers applied per tile (ALiBi and relative biases alone on the fused kernel too, see
    :func:`fused_kernel_takes`; sinks are not applied here: join them to the result with
    :meth:`~attnkit.modifiers.Sinks.join`).
    """
    batch, heads_q, tq, _ = q.shape
    tk = k.shape[2]
    space = space or MaskSpace(batch, heads_q, tq, tk, q.device)
    fused = uses_fused_kernel(q, v, dropout_p, options) and fused_kernel_takes(modifiers)
    plan = make_plan(mask, space, batch=batch, heads=heads_q, q_offset=q_offset, q_count=tq,
                     kv_offset=kv_offset, kv_count=tk,
                     block_q=block_q or _modified_block_q(modifiers, fused, batch * heads_q, tk),
                     block_k=block_k, fused=fused, options=options)
    problem = Problem(mask, scale, space, q_offset, kv_offset, plan, dropout_p, seed, modifiers)
    return _TiledAttention.apply(q, k, v, problem, *_biases(mask), *_modifier_tensors(problem))


def _modified_block_q(modifiers: Optional[Modifiers], fused: bool, rows_of_work: int,
                      kv_len: int) -> Optional[int]:
    """The query block of a matmul plan with score modifiers (see :data:`MODIFIED_TILE_KEYS`),
    or ``None``: the plan's default."""
    if fused or modifiers is None or not modifiers.changes_scores:
        return None
    return choose_block_q(rows_of_work, kv_len, MODIFIED_TILE_KEYS)


def _biases(mask: Optional[Mask]) -> list:
    """The mask's bias tensors (see :meth:`~attnkit.masks.Mask.biases`); none without a mask."""
    return mask.biases() if mask is not None else []


def tiled_weights(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, problem: Problem,
                  ) -> torch.Tensor:
    """The softmax weights ``[B, Hq, Tq, Tk]`` rebuilt tile by tile from the LSE (O(Tq·Tk)
    memory: only when asked for; not differentiable)."""
    batch, heads_q, tq, _ = q.shape
    heads_kv, tk = k.shape[1], k.shape[2]
    acc = accum_dtype(q.dtype)
    weights = torch.zeros(batch, heads_q, tq, tk, dtype=q.dtype, device=q.device)
    queries, keys = q.detach().to(acc), k.detach().to(acc)
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse.detach().to(acc))
    positions = _positions(problem, acc)
    work = _BlockWork(heads_q, heads_kv)
    for group in problem.plan.groups(tq):
        start, stop = group.rows
        q_block = work.take(queries, start, stop)  # [B, Hkv, G·n, Dk]
        lse_block = work.take(lse_safe, start, stop)[..., None]  # [B, Hkv, G·n, 1]
        for seg in _bounded(group.segments, q_block.numel() // q_block.shape[-1],
                            problem.plan.block_k, False):
            position_tile = _position_tile(problem, work, positions, batch, group.rows, seg)
            modified = _tile_scores(problem, group.rows, seg, heads_q, position_tile)
            scores = _scores(q_block, keys[:, :, seg.start:seg.stop], problem.scale, modified)
            if modified is not None:
                with torch.no_grad():
                    scores = modified.apply(scores)  # softcap, biases, score functions
            if seg.partial:
                with_bias = modified is None or not modified.traced
                scores.add_(_segment_mask(problem, group.rows, seg, heads_q, heads_kv, acc,
                                          False, with_bias=with_bias).additive)
            work.put(weights[..., seg.start:seg.stop], start, stop,
                     _exp_(scores.sub_(lse_block)).to(q.dtype))
    return weights


class TiledBackend(Backend):
    """The tiled engine behind ``attention``; ``options`` set how it schedules its tiles (the
    registry's instance uses the defaults)."""

    NAME = "tiled"
    SUPPORTS_BIAS_GRAD = DOUBLE_BACKWARD = LSE_BACKWARD = True
    SCORE_MODIFIERS = ("softcap", "alibi", "relative_bias", "score_function")
    DESCRIPTION = ("online-softmax tiles in PyTorch: O(T) memory, EMPTY tiles skipped, FULL tiles "
                   "unmasked; backward recomputes tiles")

    def __init__(self, options: TiledOptions = TiledOptions()):
        self.options = options

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        if inputs.need_weights and inputs.need_grad:
            reasons.append("return_weights with autograd (not supported by tiled: weights are "
                           "rebuilt without a graph)")
        if inputs.modifiers is not None and inputs.modifiers.functions:
            hidden = inputs.modifiers.hidden_tensors(inputs.space, accum_dtype(inputs.q.dtype))
            if hidden:
                reasons.append(f"a score_function reading {hidden} tensor(s) that require grad "
                               f"outside its closure, defaults, named globals and modules (not "
                               f"supported by tiled: it could not give them their gradient; "
                               f"list them in score_function(fn, tensors=[...]))")
        return reasons

    def forward(self, inputs: Inputs) -> BackendOutput:
        seed = 0
        if inputs.dropout_p > 0:
            seed = int(torch.randint(0, 2**62, (1,), generator=inputs.generator,
                                     device=inputs.generator.device if inputs.generator else "cpu"))
        problem = _problem(inputs, seed, self.options)
        out, lse = _TiledAttention.apply(inputs.q, inputs.k, inputs.v, problem, *inputs.biases,
                                         *inputs.modifier_tensors)
        weights = tiled_weights(inputs.q, inputs.k, lse, problem) if inputs.need_weights else None
        return BackendOutput(out, lse, weights)

    def backward(self, inputs, out, lse, dout, dlse, want_bias, want_params=()):
        if inputs.dropout_p > 0:
            raise ValueError("tiled backward outside autograd needs dropout_p=0 (the forward's "
                             "dropout seed is not kept)")
        check_backward_modifiers(inputs, self.NAME)
        q = inputs.q
        dbias = [torch.zeros(t.shape, dtype=accum_dtype(q.dtype), device=t.device) if want else None
                 for t, want in zip(inputs.biases, want_bias)]
        params = inputs.modifiers.tensors if inputs.modifiers is not None else ()
        dparams = [torch.zeros(t.shape, dtype=accum_dtype(t.dtype), device=t.device) if want
                   else None for t, want in zip(params, want_params)]
        dq, dk, dv = tiled_backward(q, inputs.k, inputs.v, out, lse, dout, dlse,
                                    _problem(inputs, 0, self.options, bias_grad=any(want_bias)),
                                    dbias=dbias, dparams=dparams)
        dparams += [None] * (len(params) - len(dparams))
        return dq, dk, dv, dbias, [None if d is None else d.to(t.dtype)
                                   for d, t in zip(dparams, params)]


def _problem(inputs: Inputs, seed: int, options: TiledOptions,
             bias_grad: Optional[bool] = None) -> Problem:
    """The tiled problem (plan included, built with ``options``) of a whole ``attention`` call;
    ``bias_grad`` (default: ``inputs.bias_grad``) takes the matmul path, which forms dS for
    dBias; so do softcap and score functions, which the fused kernel cannot apply (see
    :func:`fused_kernel_takes`)."""
    batch, heads_q, tq, _ = inputs.q.shape
    space = inputs.space
    bias_grad = inputs.bias_grad if bias_grad is None else bias_grad
    fused = (uses_fused_kernel(inputs.q, inputs.v, inputs.dropout_p, options)
             and not bias_grad and fused_kernel_takes(inputs.modifiers))
    plan = make_plan(inputs.mask, space, batch=batch, heads=heads_q, q_offset=0, q_count=tq,
                     kv_offset=0, kv_count=space.kv_len, fused=fused, options=options,
                     block_q=_modified_block_q(inputs.modifiers, fused, batch * heads_q,
                                               space.kv_len))
    return Problem(inputs.mask, inputs.scale, space, 0, 0, plan, inputs.dropout_p, seed,
                   inputs.modifiers)
