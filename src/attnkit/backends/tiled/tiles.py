"""One segment's tile on the tiled engine: where a group reads and writes (a query block with
the G query heads of a K/V head stacked as rows, or a run's strided views), how the segment is
masked (:class:`TileMask`: an additive tile, a causal square, staircase strips, position
biases), its score modifiers on the matmul path (:class:`TileScores`) and its dropout
keep-mask."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch

from ...masks import MaskSpace, keeping
from ...modifiers import Modifiers
from ...numerics import additive_mask, grouped, ungrouped
from .plan import _FOLD_LIMIT, FUSED_MIN_KEYS, Problem, Segment
from .positions import PositionTile


class _BlockWork:
    """Where one query block (or dense row range) reads and writes: rows ``[start, stop)`` of a
    ``[B, H, T, ...]`` tensor as ``[B, Hkv, G·n, ...]`` (see
    :func:`~attnkit.numerics.grouped`). ``views``: the
    query-side tensors it takes are views (no GQA), so results can be written in place;
    ``mask_heads``: the query heads a segment mask is laid out for."""

    def __init__(self, heads_q: int, heads_kv: int):
        self.heads_kv, self.mask_heads = heads_kv, heads_q
        self.views = heads_q == heads_kv

    def take(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return grouped(x[:, :, start:stop], self.heads_kv)

    def put(self, dest: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        dest[:, :, start:stop] = ungrouped(value, dest.shape[1])

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


def _cached(function, *args):
    """``function(*args)`` through its ``lru_cache``, or made afresh under a mode that keeps
    nothing (:func:`~attnkit.masks.keeping`: a checkpoint's recompute runs what its forward
    ran, and nothing fake is kept)."""
    return function(*args) if keeping() else function.__wrapped__(*args)


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
    ``(rows, keys, additive, None)`` per strip, ``rows``/``keys`` slices of the segment and
    ``additive [1, 1, rows, keys]`` (0 where allowed, −inf elsewhere; every row has a key).
    Each strip's keys start at its first row's first allowed key and end at its last row's
    last one."""
    allowed = _staircase(structure, n, width, device)
    strips = []
    for start in range(0, n, strip):
        stop = min(start + strip, n)
        first = start if structure in ("upper", "band") else 0
        last = width - n + stop if structure in ("lower", "band") else width
        keys = slice(first, last)
        piece = additive_mask(allowed[start:stop, keys], None, dtype)[None, None]  # [1, 1, r, k]
        strips.append((slice(start, stop), keys, piece, None))
    return tuple(strips)


def scores_product(q_block: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """``q_block @ k_segᵀ`` ``[..., n, span]`` written into a new tensor, for the forward to
    overwrite in place (modifiers, mask, exponent). ``matmul``'s own result would not do: a
    caller's dispatch mode may hold it (selective activation checkpointing with a policy that
    saves ``aten.bmm`` replays it in the recompute), and ``matmul`` returns it through a view
    whose version counter does not see the writes, so nothing would notice them."""
    shape = (*torch.broadcast_shapes(q_block.shape[:-2], k_seg.shape[:-2]), q_block.shape[-2],
             k_seg.shape[-2])
    out = torch.empty(shape, dtype=q_block.dtype, device=q_block.device)
    return torch.matmul(q_block, k_seg.transpose(-1, -2), out=out)


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
        return tile._replace(strips=tuple(
            (rows, keys, additive if additive is None else additive + positions.natural(rows, keys),
             has_key) for rows, keys, additive, has_key in tile.strips))
    if tile.causal:
        lower = _cached(_lower_triangle, positions.rows, positions.vector.device)
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
    if fused and seg.pieces is not None and group == 1:
        return TileMask(None, None, strips=_piece_strips(problem, rows, seg, dtype, with_bias))
    if fused and seg.structure is not None:  # a known staircase: nothing to evaluate
        width, device = seg.stop - seg.start, problem.space.device
        strip = problem.plan.options.triangle_strip
        if group == 1 and n >= 2 * strip:
            return TileMask(None, None, strips=_cached(
                _staircase_strips, seg.structure, n, width, strip, dtype, device))
        if (group == 1 and seg.structure == "lower" and width == n and problem.scale > 0
                and width >= FUSED_MIN_KEYS):
            return TileMask(None, None, causal=True)
        return TileMask(_cached(_staircase_additive, seg.structure, n, width, group, dtype,
                                device), None)

    return _evaluated(problem, rows, (seg.start, seg.stop), dtype, with_bias,
                      _stacked(group, heads_kv, n))


def _stacked(group: int, heads_kv: int, n: int):
    """A mask tile ``[Bm, Hm, n, span]`` → ``[Bm, Hkv|1, G·n, span]``: the rows of the G query
    heads of a K/V head stacked, as :class:`_BlockWork` takes queries."""
    def layout(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == 1:
            return t.expand(t.shape[0], group, n, t.shape[-1]).reshape(
                t.shape[0], 1, group * n, -1)
        return t.reshape(t.shape[0], heads_kv, group * n, t.shape[-1])
    return layout


def _evaluated(problem: Problem, rows: tuple[int, int], keys: tuple[int, int],
               dtype: torch.dtype, with_bias: bool, layout=lambda t: t) -> TileMask:
    """The mask evaluated over the local queries ``rows`` and keys ``keys`` (``(start,
    stop)`` each, the problem's offsets added): the additive tile (with the mask's bias when
    ``with_bias``) and each row's "has a key" flags, laid out by ``layout``."""
    device = problem.space.device
    q_idx = torch.arange(problem.q_offset + rows[0], problem.q_offset + rows[1], device=device)
    kv_idx = torch.arange(problem.kv_offset + keys[0], problem.kv_offset + keys[1],
                          device=device)
    allowed = layout(problem.mask.tile(q_idx, kv_idx, problem.space))
    values = problem.mask.tile_bias(q_idx, kv_idx, problem.space) if with_bias else None
    additive = additive_mask(allowed, None if values is None else layout(values), dtype)
    return TileMask(additive, allowed.any(dim=-1))


def _piece_strips(problem: Problem, rows: tuple[int, int], seg: Segment, dtype: torch.dtype,
                  with_bias: bool) -> tuple:
    """A segment's :attr:`~attnkit.backends.tiled.plan.Segment.pieces` as strips ``(rows, keys,
    additive, has_key)``, each piece's mask evaluated on its own rows and keys (``additive
    [Bm, Hm, r, k]``, ``has_key [Bm, Hm, r]``); a piece without keys as ``(rows, keys, None,
    None)`` with ``keys`` empty. Without GQA (the rows are the query heads' own)."""
    strips = []
    for r0, r1, k0, k1 in seg.pieces:
        if k0 == k1:
            strips.append((slice(r0, r1), slice(k0, k0), None, None))
            continue
        tile = _evaluated(problem, (rows[0] + r0, rows[0] + r1),
                          (seg.start + k0, seg.start + k1), dtype, with_bias)
        strips.append((slice(r0, r1), slice(k0, k1), tile.additive, tile.has_key))
    return tuple(strips)


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
            return scores_product(q_block * scale, k_seg)
        if abs(scale) / softcap.cap <= _FOLD_LIMIT:
            return scores_product(q_block * (scale / softcap.cap), k_seg)
        return scores_product(q_block * scale, k_seg).div_(softcap.cap)

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
        per_head = ungrouped(scores, self.heads_q)  # [B, Hq, n, span]
        if self.bias is not None:
            per_head = per_head + self.bias.to(per_head.dtype)
        modified = self.modifiers.call_functions(per_head, self.q_idx, self.kv_idx)
        return grouped(modified.contiguous(), scores.shape[1])

    def trace(self, scores: torch.Tensor) -> Traced:
        """:meth:`apply` recorded by autograd from a leaf copy of the scaled scores ``q·kᵀ·scale
        [B, Hkv, G·n, span]`` (not divided by the cap: :meth:`Modifiers.cap` divides), for
        :meth:`grads`."""
        with torch.enable_grad():
            raw = ungrouped(scores, self.heads_q).detach().requires_grad_()  # [B, Hq, n, span]
            biased = self.modifiers.cap(raw)
            if self.positions is not None:
                biased = biased + ungrouped(self.positions.natural(), self.heads_q)
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
        grad_final = ungrouped(grad_final, self.heads_q)
        if not traced.final.requires_grad:  # score functions that ignore the scores
            zeros = torch.zeros_like(grad_final)
            return (grouped(zeros, heads_kv), zeros if want_biased else None,
                    [None] * len(params))
        wanted = [traced.raw, traced.biased, *params]
        found = torch.autograd.grad(traced.final, wanted, grad_final, allow_unused=True)
        grad_raw = found[0] if found[0] is not None else torch.zeros_like(traced.raw)
        grad_biased = found[1] if found[1] is not None else torch.zeros_like(traced.raw)
        return grouped(grad_raw, heads_kv), grad_biased if want_biased else None, list(found[2:])


def _tile_scores(problem: Problem, rows: tuple[int, int], seg: Segment, heads_q: int,
                 positions: Optional[PositionTile] = None) -> Optional[TileScores]:
    """The :class:`TileScores` of one segment on the matmul path, or ``None`` when nothing
    changes scores."""
    if not problem.modifies_scores:
        return None
    device = problem.space.device
    q_idx = torch.arange(problem.q_offset + rows[0], problem.q_offset + rows[1], device=device)
    kv_idx = torch.arange(problem.kv_offset + seg.start, problem.kv_offset + seg.stop,
                          device=device)
    bias = None
    if (problem.modifiers.functions and seg.partial and problem.mask is not None
            and problem.mask.has_bias):
        bias = problem.mask.tile_bias(q_idx, kv_idx, problem.space)  # [Bm, Hm, n, span]
    return TileScores(problem.modifiers, q_idx, kv_idx, problem.space, bias, heads_q, positions)


def _dropout_keep(problem: Problem, block_row: int, seg: Segment, shape, device) -> torch.Tensor:
    """Keep-mask ``[B, Hkv, G·n, span]`` for one segment, drawn per (query block, key block) from
    a generator seeded by (seed, block_row, key block), so forward and backward agree. The
    draws are float32 whatever ``torch.set_default_dtype`` says: another dtype draws another
    stream from the same seed."""
    b, hkv, gn, span = shape
    pieces = []
    for start in range(seg.start, seg.stop, problem.plan.block_k):
        width = min(start + problem.plan.block_k, seg.stop) - start
        gen = torch.Generator(device=device)
        gen.manual_seed((problem.seed * 1_000_003 + block_row * 65_537
                         + start // problem.plan.block_k) % (2**63 - 1))
        pieces.append(torch.rand((b, hkv, gn, width), generator=gen, dtype=torch.float32,
                                 device=device))
    return torch.cat(pieces, dim=-1) >= problem.dropout_p
