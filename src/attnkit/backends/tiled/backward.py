"""The tiled backward: one segment's gradients, recomputed through torch's fused CPU kernel or
by matmuls (which form dS, through softcap and score functions), and :func:`tiled_backward`,
which accumulates dQ, dK/dV and the gradients of the mask's biases and the modifiers'
tensors."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...masks import Mask
from ...numerics import accum_dtype, grouped, query_rows, ungrouped
from .forward import _exp_, _group_segments, _masked_add_, _member_rows, _schedule
from .plan import WIDE_BIAS, Problem, Segment
from .positions import _add_position_grad, _add_position_param_grads, _positions, _spread
from .tiles import TileMask, TileScores


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
        for rows, keys, strip_mask, _ in tile.strips:
            if strip_mask is None:  # a piece without keys: no gradient
                yield (rows, keys, torch.zeros_like(q_block[:, :, rows]), k_seg[:, :, keys],
                       v_seg[:, :, keys], None, [])
                continue
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
        scores = grouped(traced.final.detach().clone(memory_format=torch.contiguous_format),
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
        _masked_add_(scores, additive, modified)
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
            grad_biased = grouped(grad_biased, grad_scores.shape[1])
    elif tanh is not None:  # through the cap, in tanh's buffer: dS · (1 − tanh²)
        grad_scores = tanh.square_().neg_().add_(1.0).mul_(grad_biased)
    dq = (grad_scores @ k_seg).mul_(scale)  # [B, Hkv, G·n, Dk]
    dk = grad_scores.transpose(-1, -2) @ q_scaled  # [B, Hkv, span, Dk]
    return dq, dk, dv, grad_biased if want_grad_scores else None, param_grads


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
    # the fused kernel's gradients are made like q, K and V
    queries, keys, values = map(query_rows, (q.to(acc), k.to(acc), v.to(acc)))
    vector = problem.position_vector(acc)  # [1|B, Hq, Tq + Tk − 1] or None
    if fused and vector is not None and _spread(vector) > WIDE_BIAS:
        fused = False  # subnormal weights in torch's fused backward: see WIDE_BIAS
    positions = _positions(problem, acc, fused, keys, values, vector,
                           rows=heads_q // heads_kv * tq)
    # the position vector's gradient [1|B, Hq, L], for the slopes and tables: in float64, as
    # the sum over every tile of terms of both signs (each row's dS sums to its dLSE)
    grad_vector = (torch.zeros_like(positions.vector, dtype=torch.float64) if slopes_or_tables
                   else None)
    grad_out, out = query_rows(grad_out.to(acc)), query_rows(out.to(acc))
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
        for seg, k_seg, v_seg, tile, keep in _group_segments(problem, work, group, q_block,
                                                             keys, values, fused, positions):
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
                    per_head = ungrouped(grad_scores, heads_q)  # [B, Hq, n, span]
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


def _biases(mask: Optional[Mask]) -> list:
    """The mask's bias tensors (see :meth:`~attnkit.masks.Mask.biases`); none without a mask."""
    return mask.biases() if mask is not None else []
