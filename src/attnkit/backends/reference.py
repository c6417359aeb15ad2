"""The exact reference: float64, materialised, every intermediate kept.

This is the definition the other backends are tested against, written as the math reads::

    scores = q @ kᵀ                     [B, Hq, Tq, Tk]
    scaled = scores * scale
    modified = softcap(scaled) + bias + alibi + relative, then score functions
               (attnkit.modifiers.Modifiers.apply; scaled + bias without modifiers)
    masked = modified, −inf where the mask forbids
    weights, lse = stable softmax(masked)   (a fully masked row: weights 0, lse −inf)
    out = dropout(weights) @ v          [B, Hq, Tq, Dv]

It costs O(Tq·Tk) memory per head and computes in float64 whatever the input dtype, rounding
once at the end. Sinks join the result after any backend (``attnkit.modifiers.Sinks.join``),
this one included: with sinks its out, LSE and weights stay float64, and the join rounds them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..inputs import Inputs
from ..numerics import dropout_keep, masked_softmax
from .base import Backend, BackendOutput


class Steps(NamedTuple):
    """Every intermediate of one reference computation (float64), for ``attnkit explain``."""

    scores: torch.Tensor  # [B, Hq, Tq, Tk]  q @ kᵀ
    scaled: torch.Tensor  # [B, Hq, Tq, Tk]  scores * scale
    modified: torch.Tensor  # [B|Bm, Hq|Hm, Tq, Tk]  scaled + bias, through the score modifiers
    allowed: Optional[torch.Tensor]  # [Bm, Hm, Tq, Tk] bool, or None without a mask
    masked: torch.Tensor  # [B, Hq, Tq, Tk]  modified, −inf where masked
    weights: torch.Tensor  # [B, Hq, Tq, Tk]  softmax rows (0 on fully masked rows)
    lse: torch.Tensor  # [B, Hq, Tq]
    out: torch.Tensor  # [B, Hq, Tq, Dv]


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``a [B, Hq, T, X] @ b [B, Hkv, X, Y]`` with Hq = G·Hkv, broadcasting b over each group
    (GQA without repeating K/V in memory) → ``[B, Hq, T, Y]``."""
    batch, heads_q, t, x = a.shape
    grouped = a.reshape(batch, heads_kv, heads_q // heads_kv, t, x)  # [B, Hkv, G, T, X]
    return (grouped @ b[:, :, None]).reshape(batch, heads_q, t, b.shape[-1])


def steps(inputs: Inputs) -> Steps:
    """Run the reference computation in float64 and keep every intermediate.

    Non-finite inputs follow docs/NUMERICS.md without a data-dependent branch (so under
    ``torch.func`` and compile too): q rows and K/V rows holding NaN/inf are zeroed before use
    (:class:`_Zeroed`), so nothing a mask excludes reaches a result or a gradient (no
    ``NaN + −inf``, no ``0 · NaN``), and the rows that may see one (a zeroed query row with an
    allowed key, or a row whose scores may reach a zeroed key) are multiplied by NaN, the
    others by 1. Their NaN gradients go back through the zeroing into the non-finite rows
    themselves, as on the other backends (:func:`_zeroed`)."""
    q, k, v = (t.to(torch.float64) for t in (inputs.q, inputs.k, inputs.v))
    bad_q = ~torch.isfinite(q).all(-1, keepdim=True)  # [B, Hq, Tq, 1]
    bad_kv = ~(torch.isfinite(k).all(-1, keepdim=True) & torch.isfinite(v).all(-1, keepdim=True))
    q, k, v = _zeroed(q, bad_q), _zeroed(k, bad_kv), _zeroed(v, bad_kv)
    heads_kv = k.shape[1]
    scores = grouped_matmul(q, k.transpose(-1, -2), heads_kv)  # [B, Hq, Tq, Tk]
    scaled = scores * inputs.scale
    allowed = bias = None
    if inputs.mask is not None:
        space = inputs.space
        allowed = inputs.mask.to_dense(space)  # [Bm, Hm, Tq, Tk]
        bias = inputs.mask.dense_bias(space)
    if bias is not None:
        bias = bias.to(torch.float64)
    modifiers = inputs.modifiers
    if modifiers is not None and modifiers.changes_scores:
        space = inputs.space
        modified = modifiers.apply(scaled, torch.arange(space.q_len, device=q.device),
                                   torch.arange(space.kv_len, device=q.device), space, bias)
    else:
        modified = scaled if bias is None else scaled + bias
    masked = modified
    if allowed is not None:
        masked = masked.masked_fill(~allowed, float("-inf"))
    weights, lse = masked_softmax(masked, None)
    applied = weights
    if inputs.dropout_p > 0:
        keep = dropout_keep(weights.shape, inputs.dropout_p, inputs.generator, weights.device)
        applied = weights * keep / (1.0 - inputs.dropout_p)
    out = grouped_matmul(applied, v, heads_kv)  # [B, Hq, Tq, Dv]
    seen = (~torch.isneginf(masked)).to(q.dtype)  # [B, Hq, Tq, Tk]: 1 where a key counts
    poisoned = ((grouped_matmul(seen, bad_kv.to(q.dtype), heads_kv) > 0)
                | (bad_q & (seen.sum(-1, keepdim=True) > 0)))[..., 0]  # [B, Hq, Tq]
    out, weights, lse = (_poison(t, poisoned) for t in (out, weights, lse))
    return Steps(scores, scaled, modified, allowed, masked, weights, lse, out)


def _zeroed(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``x [..., n, D]`` with the rows ``bad [..., n, 1]`` set to 0, whose gradient passes
    through unchanged (:class:`_Zeroed`); traced by dynamo, which refuses a custom ``jvp``,
    :class:`_ZeroedRows`, the same without forward-mode AD."""
    return (_ZeroedRows if torch.compiler.is_compiling() else _Zeroed).apply(x, bad)


class _ZeroedRows(torch.autograd.Function):
    """``x [..., n, D]`` with the rows ``bad [..., n, 1]`` set to 0, whose gradient passes
    through unchanged, zeroed rows included: a row that held NaN/inf gets the gradient that
    reached its zeroed stand-in (NaN from a poisoned row, 0 where no row may see it), where
    ``masked_fill`` would send back 0 always."""

    generate_vmap_rule = True  # torch.func: vmap, grad, jacrev

    @staticmethod
    def forward(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(bad, 0.0)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Zeroed(_ZeroedRows):
    """:class:`_ZeroedRows` with its tangent passed through too (``torch.func.jvp``)."""

    @staticmethod
    def jvp(ctx, x_tangent: torch.Tensor, bad_tangent) -> torch.Tensor:
        return x_tangent


def _poison(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [B, Hq, Tq, ...]`` with ``rows [B, Hq, Tq]`` set to NaN, as ``x · (NaN or 1)``: a
    gradient reaching a poisoned row goes back as NaN; every other row is unchanged."""
    where = rows.reshape(*rows.shape, *([1] * (x.dim() - rows.dim())))
    return x * torch.where(where, float("nan"), 1.0).to(x.dtype)


class ReferenceBackend(Backend):
    NAME = "reference"
    EXACT_NONFINITE = True
    SCORE_MODIFIERS = ("softcap", "alibi", "relative_bias", "score_function")
    SUPPORTS_BIAS_GRAD = SUPPORTS_FUNC = DOUBLE_BACKWARD = True
    INVARIANT_REFUSAL = ("its float64 sums run over whole rows, in an order the call's shapes "
                         "set")
    DESCRIPTION = "float64, materialised O(Tq·Tk), keeps every step; the definition others are tested against"

    def forward(self, inputs: Inputs) -> BackendOutput:
        """:func:`steps` rounded to the input dtype (LSE float32, float64 for float64 input);
        with sinks all float64, for :meth:`~attnkit.modifiers.Sinks.join` to round once."""
        s = steps(inputs)
        sinks = inputs.modifiers is not None and inputs.modifiers.sinks is not None
        dtype = torch.float64 if sinks else inputs.q.dtype
        lse = s.lse if dtype == torch.float64 else s.lse.to(torch.float32)
        weights = s.weights.to(dtype) if inputs.need_weights else None
        return BackendOutput(s.out.to(dtype), lse, weights)
