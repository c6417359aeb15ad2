"""The tiled forward: whether tiles go through torch's fused CPU kernel
(:func:`uses_fused_kernel`, :func:`fused_kernel_takes`), one segment's attention through it or by
matmuls, the schedule of a plan's groups, and :func:`tiled_forward`, which merges the segments
with an online softmax."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch

from ...masks import KeyRanges, keeping, key_ranges
from ...modifiers import Modifiers
from ...numerics import (accum_dtype, additive_mask, merge_alike_into, merge_into, pad_rows,
                         query_rows, unit_rows)
from ..torch_sdpa import is_plain_causal
from .plan import (FIXED_BLOCK_K, FLUSH_BELOW, FUSED_MIN_KEYS, LOG2E, TILE_ELEMENTS, Problem,
                   Segment, TiledOptions, row_quantum)
from .positions import PositionTile, Positions, _position_tile, _positions
from .tiles import (TileMask, TileScores, _BlockWork, _dropout_keep, _evaluated, _RunWork,
                    _runs_fit, _segment_mask, _stacked, _tile_scores, _with_positions,
                    scores_product)


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
        for rows, keys, strip_mask, has_key in tile.strips:
            q_rows = q_block[:, :, rows]
            if strip_mask is None:  # a piece without keys: output 0, LSE −inf
                yield (rows, q_rows.new_zeros((*q_rows.shape[:-1], v_seg.shape[-1])),
                       q_rows.new_full(q_rows.shape[:-1], float("-inf")))
                continue
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_rows, k_seg[:, :, keys], v_seg[:, :, keys], 0.0, False, attn_mask=strip_mask,
                scale=scale)[:2]
            if has_key is not None:  # out 0 but lse 0 on rows with no key
                lse = lse.masked_fill(~has_key, float("-inf"))
            yield rows, out, lse
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


def _widened(x: torch.Tensor, fill: float) -> torch.Tensor:
    """``x [..., span]`` with ``fill`` columns appended up to :data:`FIXED_BLOCK_K`."""
    extra = FIXED_BLOCK_K - x.shape[-1]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], extra), fill)], dim=-1)


WIDE_BUFFERS = 4
"""Buffers :func:`_widened_keys` keeps per thread (by role, shape, dtype, device and inference
mode; the least recently used goes): a decoding step widens its last key block in every
layer, and a fresh buffer each time (allocated, its pages faulted in) costs more than the
copy."""

WIDE_BUFFER_ELEMENTS = 1 << 24
"""The largest buffer :func:`_widened_keys` keeps (elements): a longer prefill's widened keys
are made for the call alone, not held after it."""

_WIDE = threading.local()


def _widened_keys(x: torch.Tensor, role: str, width: int = FIXED_BLOCK_K) -> torch.Tensor:
    """Keys or values ``[..., span, D]`` (``role`` ``"k"`` or ``"v"``) with zero rows appended
    up to ``width`` rows, in a buffer reused across calls (:data:`WIDE_BUFFERS`) up to
    :data:`WIDE_BUFFER_ELEMENTS`, else a new one (also under a mode that keeps nothing:
    :func:`~attnkit.masks.keeping`)."""
    if x[..., :1, :].numel() * width > WIDE_BUFFER_ELEMENTS or not keeping():
        # out of place: a checkpoint's policy may hold what an allocation returned
        return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[-2]))
    buffers = getattr(_WIDE, "buffers", None)
    if buffers is None:
        buffers = _WIDE.buffers = OrderedDict()
    key = (role, tuple(x.shape[:-2]), width, x.shape[-1], x.dtype, x.device,
           torch.is_inference_mode_enabled())
    entry = buffers.get(key)  # [buffer, rows past which it holds zeros]
    if entry is None:
        entry = buffers[key] = [x.new_zeros(*x.shape[:-2], width, x.shape[-1]), 0]
        if len(buffers) > WIDE_BUFFERS:
            buffers.popitem(last=False)
    else:
        buffers.move_to_end(key)
    wide, written = entry
    span = x.shape[-2]
    wide[..., :span, :].copy_(x)
    if written > span:  # an earlier, longer block's keys: zero again
        wide[..., span:written, :].zero_()
    entry[1] = span
    return wide


def _whole_block(k_seg: torch.Tensor, v_seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-schedule key block as every call of it has it: a block narrower than
    :data:`FIXED_BLOCK_K` (the last one) widened with zero keys (the caller forbids them).
    Torch's kernels reduce fewer keys in another order."""
    if k_seg.shape[-2] == FIXED_BLOCK_K:
        return k_seg, v_seg
    return _widened_keys(k_seg, "k"), _widened_keys(v_seg, "v")


def _masked_add_(scores: torch.Tensor, additive: torch.Tensor, modified) -> torch.Tensor:
    """``scores += additive`` in place; with score functions, whose values may be inf or NaN
    where the mask forbids (``log`` of a distance that only causal keys keep positive), the
    forbidden scores are then set to −inf: the mask replaces them, as ``reference`` does."""
    scores.add_(additive)
    if modified is not None and modified.modifiers.functions:
        scores.masked_fill_(torch.isneginf(additive), float("-inf"))
    return scores


def _fixed_shapes(q_block, k_seg, v_seg, additive, rows: int):
    """A fixed-schedule segment for torch's fused kernel at the shapes every call of it has:
    query rows (and ``additive``'s) padded to a multiple of ``rows`` (:func:`row_quantum`,
    :func:`~attnkit.numerics.pad_rows`), the key block whole (:func:`_whole_block`) with
    ``additive`` forbidding the added keys (an additive tile is built for an unmasked
    segment). Torch's kernels take other code paths for fewer rows, which round
    differently."""
    span = k_seg.shape[-2]
    if span < FIXED_BLOCK_K:
        k_seg, v_seg = _whole_block(k_seg, v_seg)
        if additive is None:
            additive = q_block.new_zeros(1, 1, 1, span)
        additive = _widened(additive, float("-inf"))
    if additive is not None and additive.shape[-2] != 1:  # one row of it per query row
        additive = pad_rows(additive, rows)
    return pad_rows(q_block, rows), k_seg, v_seg, additive


def _segment_forward(q_block, k_seg, v_seg, tile: Optional[TileMask], scale, fused, keep=None,
                     dropout_p=0.0, fixed=False):
    """One piece of :func:`_segment_pieces` (not strips) → ``(out, lse)``. ``fixed``: the
    fixed schedule's shapes (:func:`_fixed_shapes`, whole key blocks)."""
    additive = tile.additive if tile is not None else None
    n = q_block.shape[-2]
    if fused and not fixed and k_seg.shape[-2] < FUSED_MIN_KEYS and (
            tile is None or not tile.causal):  # (short causal tiles are additive: see tiles)
        fused = False
    rows = row_quantum(q_block.shape[-1], q_block.dtype, q_block.device) if fixed else 1
    if fused:
        queries = q_block
        if fixed:
            queries, k_seg, v_seg, additive = _fixed_shapes(q_block, k_seg, v_seg, additive,
                                                            rows)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, k_seg, v_seg, 0.0, tile is not None and tile.causal, attn_mask=additive,
            scale=scale)
        out, lse = out[..., :n, :], lse[..., :n]
        if tile is not None and additive is not None and tile.has_key is not None:
            # out 0 but lse 0 on rows with no key
            lse = lse.masked_fill(~tile.has_key, float("-inf"))
        return out, lse
    modified = tile.scores if tile is not None else None
    span = k_seg.shape[-2]
    if fixed:  # scores over the whole key block, the extra keys' −inf
        k_seg, v_seg = _whole_block(k_seg, v_seg)
        whole = _scores(pad_rows(q_block, rows), k_seg, scale, modified)[..., :n, :]
        scores = whole[..., :span]
    else:
        scores = _scores(q_block, k_seg, scale, modified)  # [B, Hkv, G·n, span]
    units = 1.0  # what one unit of `scores` is worth in scores
    if modified is not None and additive is None and modified.capped_alone and not fixed:
        scores.tanh_()  # the cap's factor joins the exponent's below
        units = modified.modifiers.softcap.cap
    elif modified is not None:
        applied = modified.apply(scores)  # softcap, biases, score functions
        if not fixed:
            scores = applied
        elif applied is not scores:  # keep writing into the whole block
            scores.copy_(applied)
    if additive is not None:
        _masked_add_(scores, additive, modified)
    if fixed:
        whole[..., span:] = float("-inf")
        scores = whole
        if keep is not None:
            keep = torch.cat([keep, keep.new_zeros(*keep.shape[:-1], scores.shape[-1] - span)], -1)
    row_max = scores.amax(dim=-1)  # [B, Hkv, G·n]
    safe_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    probs = _exp_(scores.sub_(safe_max[..., None]), units, natural=fixed)
    row_sum = probs.sum(dim=-1)
    if keep is not None:
        probs.masked_fill_(~keep, 0.0).div_(1.0 - dropout_p)
    empty = row_sum == 0
    weighted = (pad_rows(probs, rows) @ v_seg)[..., :n, :] if fixed else probs @ v_seg
    out = weighted / torch.where(empty, 1.0, row_sum)[..., None]
    lse = torch.where(empty, float("-inf"),
                      safe_max * units + torch.log(torch.where(empty, 1.0, row_sum)))
    return out, lse


def _exp_(x: torch.Tensor, units: float = 1.0, natural: bool = False) -> torch.Tensor:
    """``exp(x · units)`` in place of scores less their row's maximum or LSE (``x ≤ 0``), as
    ``exp2(x · units · log2 e)`` (see :data:`LOG2E`), with weights below ``2^FLUSH_BELOW``
    made exactly 0. ``natural``: as ``exp`` itself (the fixed schedule: torch's ``exp2``
    rounds its vectorised and scalar tails differently, so a weight's bits would depend on
    where it sits in the tensor)."""
    if natural:
        return torch.nn.functional.threshold_(x.mul_(units), FLUSH_BELOW / LOG2E,
                                              float("-inf")).exp_()
    factor = units * LOG2E
    if factor > torch.finfo(x.dtype).max:  # a softcap near the dtype's limit: 0 · inf is NaN
        x.mul_(units)
        factor = LOG2E
    return torch.nn.functional.threshold_(x.mul_(factor), FLUSH_BELOW, float("-inf")).exp2_()


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


def _group_segments(problem, work, group, q_block, keys, values, fused,
                    positions: Optional[Positions]):
    """The segments of ``group`` as computed (:func:`_bounded`), each with its inputs
    (:func:`_segment_inputs`): ``(seg, k_seg, v_seg, tile, keep)``, the walk the forward and
    the backward share."""
    for seg in _bounded(group.segments, q_block.numel() // q_block.shape[-1],
                        problem.plan.block_k, fused):
        yield (seg, *_segment_inputs(problem, work, q_block, keys, values, group.block,
                                     group.rows, seg, fused, positions))


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
        return scores_product(q_block * scale, k_seg)
    return modified.scores(q_block, k_seg, scale)


def _schedule(problem: Problem, tq: int, heads_q: int, heads_kv: int, fused: bool,
              tensors: tuple, positions: Optional[Positions] = None):
    """Yield ``(group, work)``: the plan's groups, each with where it reads and writes. Runs
    execute as one group (:class:`_RunWork`; G times with GQA) when the fused kernel serves them,
    every tensor the pass views fits :func:`_run_view` and there are no ``positions`` (their
    reversed keys shift against the blocks of a run); otherwise block by block."""
    block_work = _BlockWork(heads_q, heads_kv)
    runs = fused and positions is None and _runs_fit(*tensors)
    # results are then written in place; the fixed schedule merges every key block alike
    shared_prefix = fused and heads_q == heads_kv and not problem.plan.options.fixed_blocks
    group_size = heads_q // heads_kv
    for group in problem.plan.groups(tq, runs=runs, shared_prefix=shared_prefix, dense=fused):
        if group.count == 1:
            yield group, block_work
        else:
            for member in range(group_size):
                yield group, _RunWork(group.step * problem.plan.block_q, group.count, heads_q,
                                      group_size, member)


def _empty_like_rows(q: torch.Tensor, dv: int) -> torch.Tensor:
    """An empty ``[B, Hq, Tq, Dv]`` output in q's dtype whose leading dims lie in memory in
    q's order: contiguous for a contiguous q, ``[B, Tq, Hq, Dv]`` for a token-major view (a
    packed or BSHD caller's tensor, transposed back without a copy), ``[Tq, B, Hq, Dv]`` for
    a sequence-first one. Runs (:func:`~.tiles._run_view`) then view out as they view q."""
    if any(q.stride(dim) == 0 and q.shape[dim] > 1 for dim in range(3)):  # an expanded view
        return q.new_empty(*q.shape[:3], dv)
    order = sorted(range(3), key=lambda dim: -q.stride(dim) if q.shape[dim] > 1 else 0)
    stored = q.new_empty(*(q.shape[dim] for dim in order), dv)
    return stored.permute(*sorted(range(3), key=order.__getitem__), 3)


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
    # the fused kernel's output is made like the queries, K and V are only read
    queries, keys, values = query_rows(q.to(acc)), unit_rows(k.to(acc)), unit_rows(v.to(acc))
    positions = _positions(problem, acc, fused, keys, values, rows=heads_q // heads_kv * tq)
    if problem.plan.options.fixed_blocks:
        whole = fused and positions is None  # the kernel takes the mask as its additive mask
        out, lse = (_kernel_forward(problem, queries, keys, values) if whole
                    else _fixed_forward(problem, queries, keys, values, positions))
        return out.to(q.dtype), lse
    out = _empty_like_rows(q, dv)
    lse = torch.full((batch, heads_q, tq), float("-inf"), dtype=acc, device=q.device)
    for group, work in _schedule(problem, tq, heads_q, heads_kv, fused,
                                 (queries, keys, values, out), positions):
        start, stop = group.rows
        q_block = work.take(queries, start, stop)  # [B, Hkv, G·n, Dk] or [count, B·Hkv, n, Dk]
        direct = out.dtype == acc and work.views
        # Results go straight into `out` and `lse` where the work's rows are views of them.
        block_out = work.take(out, start, stop) if direct else None
        block_lse = work.take(lse, start, stop) if direct else None
        first = group.fresh
        for seg, k_seg, v_seg, tile, keep in _group_segments(problem, work, group, q_block,
                                                             keys, values, fused, positions):
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
                    merge_into(block_out[:, :, rows], block_lse[:, :, rows], seg_out.to(acc),
                               seg_lse.to(acc))
            first = False
        if first:  # no key for any of these rows (a single fresh block: runs have keys)
            out[:, :, start:stop] = 0
        elif not direct:
            work.put(out, start, stop, block_out.to(q.dtype))
            work.put(lse, start, stop, block_lse)
    return out, lse


FIXED_CALL_ROWS = 4096
"""Most query rows (per query head) in one kernel call of the fixed schedule: bounds the
masks and, on the matmul path, the scores a call materialises (with :data:`TILE_ELEMENTS`)."""


def _fixed_forward(problem: Problem, queries: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, positions: Optional[Positions],
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the fixed schedule (:attr:`TiledOptions.fixed_blocks`), key block by key
    block in key order: each block runs as one kernel call per run of consecutive query blocks
    that visit it alike (unmasked, or masked), and is merged into every row's running result
    (:func:`~attnkit.numerics.merge_alike_into`, from 0 and −inf: a row's first block then
    passes through exactly). A row thus sees its key blocks in key order, each computed at the
    same shapes, whatever the call's other rows. Inputs in the accumulation dtype; ``out [B,
    Hq, Tq, Dv]`` and ``lse [B, Hq, Tq]`` in it too."""
    plan, fused = problem.plan, problem.plan.fused
    batch, heads_q, tq, _ = queries.shape
    heads_kv, dv = keys.shape[1], values.shape[-1]
    group = heads_q // heads_kv
    work = _BlockWork(heads_q, heads_kv)
    out = queries.new_zeros(batch, heads_kv, group, tq, dv)  # the G heads of a K/V head apart
    lse = queries.new_full((batch, heads_kv, group, tq), float("-inf"))
    visits: dict[tuple[int, int], list[tuple[int, bool]]] = {}
    for block, row in enumerate(plan.rows):
        for seg in row:
            visits.setdefault((seg.start, seg.stop), []).append((block, seg.partial))
    seen = [False] * len(plan.rows)  # query blocks holding a result
    rows_per_call = FIXED_CALL_ROWS if fused else TILE_ELEMENTS // (
        batch * heads_q * FIXED_BLOCK_K)
    blocks_per_call = max(1, rows_per_call // plan.block_q)
    for (start, stop), blocks in _in_key_order(visits):
        for first, last, partial in _alike_runs(blocks, blocks_per_call):
            rows = (first * plan.block_q, min((last + 1) * plan.block_q, tq))
            q_block = work.take(queries, *rows)  # [B, Hkv, G·n, Dk]
            seg = Segment(start, stop, partial)
            if partial and _lower_square(problem, rows, seg, group, positions):
                # torch's kernel masks it itself (is_causal), bit for bit as the additive
                # mask does, skipping what lies above the diagonal
                k_seg, v_seg = work.take(keys, start, stop), work.take(values, start, stop)
                tile, keep = TileMask(None, None, causal=True), None
            else:
                k_seg, v_seg, tile, keep = _segment_inputs(problem, work, q_block, keys, values,
                                                           first, rows, seg, fused, positions)
            seg_out, seg_lse = _segment_forward(q_block, k_seg, v_seg, tile, problem.scale,
                                                fused, keep, problem.dropout_p, fixed=True)
            n = rows[1] - rows[0]
            block_out, block_lse = out[:, :, :, rows[0]:rows[1]], lse[:, :, :, rows[0]:rows[1]]
            seg_out = seg_out.view(batch, heads_kv, group, n, dv)
            seg_lse = seg_lse.view(batch, heads_kv, group, n)
            if any(seen[first:last + 1]):
                merge_alike_into(block_out, block_lse, seg_out, seg_lse)
            else:  # what merging into (0, −inf) gives, bit for bit
                block_out.copy_(seg_out)
                block_lse.copy_(seg_lse)
            seen[first:last + 1] = [True] * (last + 1 - first)
    return out.view(batch, heads_q, tq, dv), lse.view(batch, heads_q, tq)


KV_SPLIT = 512
"""The key split of torch's fused CPU kernel: it reduces a call's keys in splits of this many
from the call's first key (the last split holds the rest; a call of fewer keys, one split),
merging the splits itself. :func:`_kernel_forward` gives every call whole splits of the
sequence's keys: BLAS reduces a narrower split's keys in an order of its own (even one that
ends in forbidden zero keys)."""

KERNEL_CALL_SCORES = 1 << 23
"""Most mask entries (batch elements × query rows × keys) one call of :func:`_kernel_forward`
evaluates: bounds its additive mask; the whole-causal call evaluates none."""

KERNEL_CALL_ROWS = 256
"""Most query rows per query head in one masked call of :func:`_kernel_forward`: the kernel
computes every split of a call's keys for every row of it, so shorter calls skip more of
what a causal mask forbids."""


def _kernel_forward(problem: Problem, queries: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed schedule on torch's fused kernel, without merges of ours: each run of query
    blocks is one kernel call over whole splits of keys (:data:`KV_SPLIT`, counted from the
    sequence's first key, the last padded with zero keys the mask forbids), from the split of
    its first allowed key to that of its last, with a multiple of :func:`row_quantum` rows. A
    row's bits are then those of its own splits, merged by the kernel in key order, whatever
    the call's other rows, its padding or how the queries were chunked (a fully masked split
    changes no row: skipped or computed, alike). A plain top-left causal mask from position 0
    runs as one call with the kernel's own causal mask, nothing materialised, where no row
    reaches a padding key. Inputs in the accumulation dtype; ``out [B, Hq, Tq, Dv]`` and
    ``lse [B, Hq, Tq]`` in it too."""
    plan = problem.plan
    batch, heads_q, tq, head_dim = queries.shape
    heads_kv, kv_len, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    group = heads_q // heads_kv
    width = -(-kv_len // KV_SPLIT) * KV_SPLIT
    if width != kv_len:  # zero keys up to whole splits, in buffers reused across calls
        keys, values = _widened_keys(keys, "k", width), _widened_keys(values, "v", width)
    if (group == 1 and problem.q_offset == problem.kv_offset == 0
            and is_plain_causal(problem.mask, problem.scale)
            and problem.modifiers is None and (tq <= kv_len or width == kv_len)):
        # (rows past the keys would reach the padding keys under the kernel's causal mask)
        return kernel_call(queries, keys, values, None, problem.scale, causal=True)
    work = _BlockWork(heads_q, heads_kv)
    out = queries.new_zeros(batch, heads_kv, group, tq, dv)
    lse = queries.new_full((batch, heads_kv, group, tq), float("-inf"))
    ranges = key_ranges(problem.mask, problem.space)
    if ranges is not None and ranges.exact is not None:  # documents: evaluated, as planned
        ranges = None
    for r0, r1, lo, hi in _kernel_calls(plan, tq, batch * group, width):
        n = r1 - r0
        additive = has_key = None
        if ranges is not None:
            additive, has_key = _ranges_tile(problem, ranges, (r0, r1), (lo, min(hi, kv_len)),
                                             queries.dtype, _stacked(group, heads_kv, n))
        elif problem.mask is not None:
            tile = _evaluated(problem, (r0, r1), (lo, min(hi, kv_len)), queries.dtype, True,
                              _stacked(group, heads_kv, n))
            additive, has_key = tile.additive, tile.has_key
        if hi > kv_len:  # the padding keys: forbidden
            if additive is None:
                additive = queries.new_zeros(1, 1, 1, kv_len - lo)
            additive = torch.nn.functional.pad(additive, (0, hi - kv_len), value=float("-inf"))
        seg_out, seg_lse = kernel_call(work.take(queries, r0, r1), keys[:, :, lo:hi],
                                       values[:, :, lo:hi], additive, problem.scale)
        if has_key is not None:  # out 0 but lse 0 on rows with no key
            seg_lse = seg_lse.masked_fill(~has_key, float("-inf"))
        out[:, :, :, r0:r1] = seg_out.view(batch, heads_kv, group, n, dv)
        lse[:, :, :, r0:r1] = seg_lse.view(batch, heads_kv, group, n)
    return out.view(batch, heads_q, tq, dv), lse.view(batch, heads_q, tq)


def kernel_call(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                additive: Optional[torch.Tensor], scale: float, causal: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of torch's fused kernel as the fixed schedule makes it: ``queries [B, Hkv, n,
    Dk]`` (a K/V head's query heads stacked as rows, :class:`~.tiles._BlockWork`) padded to
    a multiple of :func:`row_quantum` rows, over ``keys``/``values [B, Hkv, S, D]`` that
    start at a split of the sequence's keys and hold whole splits (:data:`KV_SPLIT`; keys
    past the sequence's own are finite and forbidden by ``additive``), with ``additive [Bm,
    1|Hkv, 1|n, S]`` (0 or −inf; ``None``: every key) or the kernel's own ``causal`` mask.
    A row's bits then depend on its own query and allowed keys alone. Inputs in the
    accumulation dtype; returns ``out [B, Hkv, n, Dv]`` and ``lse [B, Hkv, n]`` (a row with
    no allowed key gets out 0 and lse 0: the caller marks it)."""
    rows = row_quantum(queries.shape[-1], queries.dtype, queries.device)
    if additive is not None and additive.shape[-2] != 1:
        additive = pad_rows(additive, rows)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        pad_rows(queries, rows), keys, values, 0.0, causal, attn_mask=additive, scale=scale)[:2]
    n = queries.shape[-2]
    return out[:, :, :n], lse[:, :, :n]


def _kernel_calls(plan, tq: int, rows_each: int, width: int):
    """``(r0, r1, lo, hi)`` per call of :func:`_kernel_forward`: query rows ``[r0, r1)`` and the
    whole splits ``[lo, hi)`` of keys their blocks' segments reach; consecutive query blocks
    that reach the same splits share a call, of at most :data:`KERNEL_CALL_ROWS` rows and
    :data:`KERNEL_CALL_SCORES` mask entries (``rows_each``: entries per query row and key, the
    batch elements times the stacked query heads). Query blocks without a segment get no
    call: their rows stay 0 and −inf."""
    most = max(1, min(KERNEL_CALL_ROWS, KERNEL_CALL_SCORES // max(1, rows_each * width)))
    runs: list[list[int]] = []  # [r0, r1, lo, hi]
    for block, segments in enumerate(plan.rows):
        if not segments:
            continue
        lo = min(seg.start for seg in segments) // KV_SPLIT * KV_SPLIT
        hi = min(width, -(-max(seg.stop for seg in segments) // KV_SPLIT) * KV_SPLIT)
        r0, r1 = block * plan.block_q, min((block + 1) * plan.block_q, tq)
        if runs and runs[-1][1] == r0 and runs[-1][2:] == [lo, hi]:
            runs[-1][1] = r1
        else:
            runs.append([r0, r1, lo, hi])
    for r0, r1, lo, hi in runs:
        for start in range(r0, r1, most):
            yield start, min(start + most, r1), lo, hi


def _ranges_tile(problem: Problem, ranges: KeyRanges, rows: tuple[int, int],
                 keys: tuple[int, int], dtype: torch.dtype, layout,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(additive, has_key)`` of the local queries ``rows`` over the local keys ``keys`` from
    each row's one run of keys (:func:`~attnkit.masks.key_ranges`, exact: no documents),
    laid out by ``layout`` as :func:`~.tiles._evaluated` lays out its tile."""
    first = problem.q_offset + rows[0]
    lo = ranges.lo[:, first:first + rows[1] - rows[0], None] - problem.kv_offset  # [Bm, n, 1]
    hi = ranges.hi[:, first:first + rows[1] - rows[0], None] - problem.kv_offset
    positions = torch.arange(keys[0], keys[1], device=lo.device)
    allowed = (positions >= lo) & (positions < hi)  # [Bm, n, span]
    additive = additive_mask(allowed[:, None], None, dtype)
    return layout(additive), layout((hi > lo)[:, None])[..., 0]


def _lower_square(problem: Problem, rows: tuple[int, int], seg: Segment, group: int,
                  positions: Optional[Positions]) -> bool:
    """Whether a fixed-schedule tile is a whole key block whose mask is exactly the lower
    triangle on its diagonal (a causal diagonal), for torch's fused kernel without GQA,
    position biases or other modifiers of the scores, at a positive scale."""
    n = rows[1] - rows[0]
    return (problem.plan.fused and group == 1 and positions is None and problem.scale > 0
            and not problem.modifies_scores and n == FIXED_BLOCK_K
            and seg.stop - seg.start == n and rows[0] % problem.plan.block_q == 0
            and problem.plan.structure(rows[0] // problem.plan.block_q, n,
                                       problem.kv_offset + seg.start,
                                       problem.kv_offset + seg.stop) == "lower")


def _in_key_order(visits: dict) -> list:
    """The key blocks of :func:`_fixed_forward` with the query blocks visiting each, in key
    order: the order every row's blocks merge in."""
    return sorted(visits.items())


def _alike_runs(blocks: list[tuple[int, bool]], most: int):
    """``(first, last, partial)`` for each run of consecutive query blocks (``(block,
    partial)`` pairs in order) that visit a key block alike, at most ``most`` blocks each."""
    run_start = 0
    for i in range(1, len(blocks) + 1):
        if (i == len(blocks) or blocks[i][0] != blocks[i - 1][0] + 1
                or blocks[i][1] != blocks[run_start][1] or i - run_start == most):
            yield blocks[run_start][0], blocks[i - 1][0], blocks[run_start][1]
            run_start = i
