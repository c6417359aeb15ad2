"""The tiled engine as a backend: its autograd Function (double backward through the float64
reference), :func:`tiled_attention`, the softmax weights rebuilt from the LSE
(:func:`tiled_weights`) and :class:`TiledBackend`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...inputs import Inputs
from ...masks import (Mask, MaskSpace, cache_key, check_unwritten, key_starts, mask_tensors, memo,
                     tensor_versions)
from ...modifiers import Modifiers
from ...numerics import accum_dtype
from ..base import (Backend, BackendOutput, batched_gradient, bias_range_reasons,
                    check_backward_modifiers)
from ..reference import steps
from .backward import _biases, tiled_backward
from .forward import _bounded, _exp_, _scores, fused_kernel_takes, tiled_forward, uses_fused_kernel
from .plan import (BLOCK_K, FIXED_BLOCK_K, INVARIANT_MAX_HEAD_DIM, MODIFIED_TILE_KEYS, Problem,
                   TiledOptions, choose_block_q, make_plan, rows_anywhere)
from .positions import _position_tile, _positions
from .tiles import _BlockWork, _segment_mask, _tile_scores


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
        # the mask's tensors, which the backward reads again (none to watch where no input
        # requires grad: no backward runs)
        ctx.versions = (tensor_versions(problem.mask, _modifier_tensors(problem))
                        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
                        else ())

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        problem = ctx.problem
        check_unwritten(ctx.versions, "tiled")
        biases, params = _biases(problem.mask), _modifier_tensors(problem)
        wants = ctx.needs_input_grad[4:]
        wants_bias, wants_param = wants[:len(biases)], wants[len(biases):]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if torch.is_grad_enabled() or batched_gradient(grad_out, grad_lse):
            # create_graph=True (the backward itself is differentiated), or a vmapped backward
            # (is_grads_batched=True; jacobian(vectorize=True)), whose batching rules torch's
            # operations have and the tiled backward's in-place writes lack
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
    """The gradients of q, k, v and ``tensors`` (the biases, then the modifiers' tensors) from
    the reference recomputed with autograd (O(Tq·Tk) memory): recorded for a further backward
    under ``create_graph=True``, and the way a vmapped backward runs (batched gradients)."""
    inputs = Inputs(q=q, k=k, v=v, mask=problem.mask, scale=problem.scale, dropout_p=0.0,
                    generator=None, batch_shape=(), input_rank=4, modifiers=problem.modifiers)
    if (problem.dropout_p > 0 or problem.q_offset or problem.kv_offset
            or inputs.space != problem.space):
        raise RuntimeError("a double backward (create_graph=True) or a batched backward "
                           "(is_grads_batched=True, jacobian(vectorize=True)) through tiled "
                           "attention needs dropout_p=0 and unsharded positions: use "
                           "backend='reference'")
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        result = steps(inputs)
    outputs, grads = [result.out], [grad_out.to(result.out.dtype)]
    if grad_lse is not None:
        outputs.append(result.lse)
        grads.append(grad_lse.to(result.lse.dtype))
    wanted = [t for t, need in zip((q, k, v, *tensors), (*needed[:3], *needed[4:])) if need]
    found = iter(torch.autograd.grad(outputs, wanted, grads, create_graph=create_graph,
                                     allow_unused=True))
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
    INVARIANT_REFUSAL = None  # the fixed schedule (TiledOptions.fixed_blocks)
    SCORE_MODIFIERS = ("softcap", "alibi", "relative_bias", "score_function")
    DESCRIPTION = ("online-softmax tiles in PyTorch: O(T) memory, EMPTY tiles skipped, FULL tiles "
                   "unmasked; backward recomputes tiles")

    def __init__(self, options: TiledOptions = TiledOptions()):
        self.options = options

    def auto_reasons(self, inputs: Inputs) -> list[str]:
        """With dropout, auto passes over tiled wherever autograd would make it: a reentrant
        ``torch.utils.checkpoint`` runs the forward with grad mode off and its recompute with
        it on, and tiled and reference draw different dropout patterns, so the two runs must
        choose one backend (else the gradients belong to another pattern than the output)."""
        if inputs.dropout_p == 0:
            return []
        reasons = []
        if inputs.need_weights and not inputs.need_grad:  # (with autograd: extra_reasons)
            reasons.append("dropout with return_weights (auto runs it on reference in any grad "
                           "mode, as autograd needs: a reentrant checkpoint's forward and "
                           "recompute must draw one dropout pattern)")
        functions = inputs.modifiers is not None and inputs.modifiers.functions
        if functions and not torch.is_grad_enabled():
            # the tensors autograd would find (see extra_reasons), under inference_mode too
            # (which records no graph even with grad enabled)
            with torch.inference_mode(False), torch.enable_grad():
                hidden = inputs.modifiers.hidden_tensors(inputs.space, accum_dtype(inputs.q.dtype))
            if hidden:
                reasons.append(f"dropout with a score_function reading {hidden} tensor(s) that "
                               f"require grad outside its closure, defaults, named globals and "
                               f"modules (auto runs it on reference in any grad mode, as "
                               f"autograd needs: a reentrant checkpoint's forward and recompute "
                               f"must draw one dropout pattern)")
        return reasons

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
        reasons.extend(bias_range_reasons(inputs, accum_dtype(inputs.q.dtype), "tiled"))
        if inputs.invariant and inputs.dropout_p > 0:
            reasons.append("invariant=True with dropout (not supported by tiled: its fixed "
                           "schedule draws no dropout; apply dropout outside attention)")
        widest = max(inputs.q.shape[-1], inputs.v.shape[-1])
        if inputs.invariant and widest > INVARIANT_MAX_HEAD_DIM:
            reasons.append(f"invariant=True with head dim {widest} > {INVARIANT_MAX_HEAD_DIM} "
                           f"(not supported by tiled: BLAS blocks wider reductions differently "
                           f"for different row counts)")
        elif inputs.invariant and not rows_anywhere(
                inputs.q.shape[-1], inputs.v.shape[-1], accum_dtype(inputs.q.dtype),
                inputs.q.device):
            reasons.append(f"invariant=True with head dims {inputs.q.shape[-1]} (keys) and "
                           f"{inputs.v.shape[-1]} (values) (not supported by tiled on this "
                           f"machine: its BLAS rounds a row of these widths by the row's place "
                           f"in a call, measured; zero-padding q, k and v to a multiple of 8 "
                           f"features, with scale= of the unpadded width, then slicing the "
                           f"output, avoids it on common CPUs)")
        if inputs.invariant and _left_starts(inputs) is not None:
            batched = inputs.modifiers is not None and (inputs.modifiers.functions or any(
                part.slopes.dim() == 2 and part.slopes.shape[0] > 1
                for part in inputs.modifiers.alibi))
            if batched or inputs.bias_grad:
                reasons.append("invariant=True on left-padded keys with a score_function, "
                               "per-batch ALiBi slopes or a bias that requires grad (not "
                               "supported by tiled: its sequences then run in groups by first "
                               "key, which these cannot follow; pad on the right)")
        return reasons

    def _options(self, inputs: Inputs) -> TiledOptions:
        """The options a call runs with: the fixed schedule under the invariance contract."""
        if inputs.invariant and not self.options.fixed_blocks:
            return dataclasses.replace(self.options, fixed_blocks=True)
        return self.options

    def forward(self, inputs: Inputs) -> BackendOutput:
        seed = 0
        if inputs.dropout_p > 0:
            seed = int(torch.randint(0, 2**62, (1,), generator=inputs.generator,
                                     device=inputs.generator.device if inputs.generator else "cpu"))
        options = self._options(inputs)
        starts = _left_starts(inputs) if options.fixed_blocks else None
        # left-padded calls under the contract run in groups: no whole-call plan unless weights
        problem = (_problem(inputs, seed, options) if starts is None or inputs.need_weights
                   else None)
        if starts is not None:
            out, lse = _from_first_keys(inputs, options, starts)
        else:
            out, lse = _TiledAttention.apply(inputs.q, inputs.k, inputs.v, problem,
                                             *inputs.biases, *inputs.modifier_tensors)
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
                                    _problem(inputs, 0, self._options(inputs),
                                             bias_grad=any(want_bias)),
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
                     block_k=FIXED_BLOCK_K if options.fixed_blocks else BLOCK_K,
                     block_q=_modified_block_q(inputs.modifiers, fused, batch * heads_q,
                                               space.kv_len))
    return Problem(inputs.mask, inputs.scale, space, 0, 0, plan, inputs.dropout_p, seed,
                   inputs.modifiers)


def _left_starts(inputs: Inputs) -> Optional[list[int]]:
    """Where each batch element's keys begin (``[B]`` ints, one host read, kept on the mask
    while its starts are unchanged, :func:`~attnkit.masks.memo`) when some begin past
    position 0 (left padding: :func:`~attnkit.masks.key_starts`), else ``None``."""
    starts = key_starts(inputs.mask)
    if starts is None:
        return None
    batch = inputs.q.shape[0]
    values = memo(inputs.mask, ("left starts", batch), mask_tensors(inputs.mask),
                  lambda: starts.expand(batch).tolist())
    return values if any(values) else None


def _from_first_keys(inputs: Inputs, options: TiledOptions, starts: list[int],
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed schedule over left-padded keys: the batch elements whose keys begin at the
    same position ``s`` run as one call over keys ``[s, Tk)`` (``kv_offset`` s: the mask and
    the modifiers still see global positions), so every sequence's key blocks start at its
    first key, as they do for the sequence alone (no dropout: the contract refuses it).
    Differentiable; ``(out, lse)`` of the whole batch."""
    q, k, v = inputs.q, inputs.k, inputs.v
    by_start: dict[int, list[int]] = {}
    for b, start in enumerate(starts):
        by_start.setdefault(start, []).append(b)
    outs, lses, order = [], [], []
    for start, members in by_start.items():
        rows = torch.tensor(members, device=q.device)
        mask = None if inputs.mask is None else _BatchRows(inputs.mask, tuple(members), rows)
        out, lse = tiled_attention(
            q.index_select(0, rows), k.index_select(0, rows)[:, :, start:],
            v.index_select(0, rows)[:, :, start:], mask, scale=inputs.scale,
            space=inputs.space, kv_offset=start, block_k=FIXED_BLOCK_K, options=options,
            modifiers=inputs.modifiers)
        outs.append(out)
        lses.append(lse)
        order.extend(members)
    inverse = torch.argsort(torch.tensor(order, device=q.device))
    return torch.cat(outs).index_select(0, inverse), torch.cat(lses).index_select(0, inverse)


class _BatchRows(Mask):
    """``inner`` (over the whole batch) seen by the batch elements ``members`` alone: its tiles
    and block maps have one entry per member (or one for all, when ``inner``'s do). Biases
    are the inner mask's, as constants (no gradient reaches them through this view)."""

    def __init__(self, inner: Mask, members: tuple, rows: torch.Tensor):
        self.inner, self.members, self.rows = inner, members, rows
        self.has_bias = inner.has_bias

    def _select(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t if t is None or t.shape[0] == 1 else t.index_select(0, self.rows)

    def cache_key(self, keep):
        key = cache_key(self.inner, keep)
        return None if key is None else ("batch rows", key, self.members)

    def tile(self, q_idx, kv_idx, space):
        return self._select(self.inner.tile(q_idx, kv_idx, space))

    def tile_bias(self, q_idx, kv_idx, space):
        return self._select(self.inner.tile_bias(q_idx, kv_idx, space))

    def block_map(self, block_q, block_k, space, **window):
        return self._select(self.inner.block_map(block_q, block_k, space, **window))

    def __repr__(self):
        return f"batch_rows({self.inner!r}, {list(self.members)})"
