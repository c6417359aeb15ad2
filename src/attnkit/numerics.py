"""Pure numerics shared by every backend: mask fill values, the stable masked softmax, LSE
merging. Small functions, each unit-tested alone (see docs/NUMERICS.md)."""

from __future__ import annotations

from typing import Optional

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics live in: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mask_value(dtype: torch.dtype) -> float:
    """A finite, very negative fill for masked scores in ``dtype`` (the dtype's lowest value).

    Used where a kernel needs a finite number (``-inf - (-inf)`` is NaN): ``exp(fill - max)``
    underflows to exactly 0 for any unmasked max, and two fills never sum to ``-inf``
    because masked scores are *replaced*, never added. fp16: -65504; fp32: -3.4e38.
    """
    return torch.finfo(dtype).min


def additive_mask(allowed: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype,
                  ) -> torch.Tensor:
    """A mask as one additive tensor in ``dtype``: ``bias`` (or 0) where ``allowed``, ``-inf``
    elsewhere (replaced, never added), broadcast to ``allowed``'s shape. For kernels that take
    an additive ``attn_mask``."""
    kept = torch.zeros((), dtype=dtype, device=allowed.device) if bias is None else bias.to(dtype)
    return torch.where(allowed, kept, torch.tensor(float("-inf"), dtype=dtype, device=allowed.device))


def masked_softmax(scores: torch.Tensor, allowed: Optional[torch.Tensor],
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable softmax over the last dim of ``scores`` [..., Tk], masked positions excluded.

    Returns ``(weights, lse)``: ``weights`` like ``scores`` and ``lse`` [...] (natural log).
    A row with no allowed key gets weights exactly 0 and ``lse = -inf`` (never NaN), and
    gradients of exactly 0. The row max is subtracted before ``exp`` (the max is detached: the
    softmax does not depend on it, so it carries no gradient).
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if scores.shape[-1] == 0:  # no keys at all: every row is fully masked
        return scores, torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype,
                                  device=scores.device)
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # [..., 1]
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - safe_max)  # masked: exp(-inf) = 0
    total = exp.sum(dim=-1, keepdim=True)  # [..., 1]
    empty = total == 0
    weights = exp / torch.where(empty, torch.ones_like(total), total)
    log_total = torch.log(torch.where(empty, torch.ones_like(total), total))
    lse = torch.where(empty, torch.full_like(total, float("-inf")), safe_max + log_total)
    return weights, lse.squeeze(-1)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
          alike: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    ``out_* [..., T, D]`` (each normalised over its own keys; rows with no key are 0),
    ``lse_* [..., T]``. Returns the result over the union, in the accumulation dtype (fp32, or
    fp64 for fp64)::

        out = sigmoid(lse_a - lse_b) * out_a + sigmoid(lse_b - lse_a) * out_b
        lse = log(exp(lse_a) + exp(lse_b))                         (logaddexp)

    Each side has its own weight, so a side that the other outweighs by far keeps its relative
    precision (the lerp form ``out_a + w·(out_b − out_a)`` gives exactly 0 once ``w`` rounds to
    1, as when a sink outweighs every key). A side with ``lse = -inf`` (no keys) gets weight
    exactly 0, so the other side passes through unchanged; both ``-inf`` gives ``(0, -inf)``.
    Only [..., T]-sized vectors need special cases. ``alike``: weights ``exp(lse − max)``
    instead, from operations that round alike wherever a row sits in its tensor (see
    :func:`merge_alike_into`), for the invariance contract.
    """
    dtype = accum_dtype(out_a.dtype)
    out_a, out_b = out_a.to(dtype), out_b.to(dtype)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    # Where both sides are empty, -inf - (-inf) would be NaN (in diff, and in logaddexp's
    # gradient exp(lse_a - lse)): use 0 there, restore -inf after; masked_fill passes no gradient.
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)  # [..., T]
    lse_a, lse_b = lse_a.masked_fill(both_empty, 0.0), lse_b.masked_fill(both_empty, 0.0)
    if alike:
        top = torch.maximum(lse_a, lse_b).detach()  # finite: both −inf was filled
        weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
        total = weight_a + weight_b
        out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / total[..., None]
        return out, (top + torch.log(total)).masked_fill(both_empty, float("-inf"))
    # Where exactly one side is empty, its weight is exactly 0 and the other's 1, and the
    # union's LSE is the other's: chosen by where(), so that logsigmoid and logaddexp never
    # see an infinite argument, whose second derivative (a double backward) is NaN.
    empty_a, empty_b = torch.isneginf(lse_a), torch.isneginf(lse_b)
    one_empty = empty_a | empty_b
    filled_a, filled_b = lse_a.masked_fill(one_empty, 0.0), lse_b.masked_fill(one_empty, 0.0)
    diff = filled_b - filled_a  # [..., T]
    # σ(±diff) as exp(logsigmoid): the same values, but autograd's derivative is then
    # σ(diff)·σ(−diff) from two precise factors, not y·(1 − y), which loses the small factor
    # once y rounds to 1
    weight_a = torch.exp(torch.nn.functional.logsigmoid(-diff))
    weight_b = torch.exp(torch.nn.functional.logsigmoid(diff))
    weight_a = torch.where(one_empty, (~empty_a).to(dtype), weight_a)[..., None]
    weight_b = torch.where(one_empty, (~empty_b).to(dtype), weight_b)[..., None]
    out = out_a * weight_a + out_b * weight_b
    lse = torch.where(empty_a, lse_b, torch.where(empty_b, lse_a,
                                                  torch.logaddexp(filled_a, filled_b)))
    return out, lse.masked_fill(both_empty, float("-inf"))


def merge_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
               lse_b: torch.Tensor) -> None:
    """:func:`merge` without autograd, in place on ``(out_a, lse_a)`` (results the caller
    owns, views included), both sides in the accumulation dtype: ``out_a [..., n, D]``
    becomes ``lerp(out_a, out_b, σ(lse_b − lse_a))`` and ``lse_a [..., n]`` the union's LSE.
    Rows empty on both sides (σ of NaN) get weight 0: both outputs are 0 there and
    ``logaddexp(−inf, −inf) = −inf``. Fewer operations than :func:`merge`, for engines that
    merge many pieces (the tiled forward, paged decoding)."""
    weight_b = torch.sub(lse_b, lse_a).sigmoid_().nan_to_num_(0.0)  # [..., n]
    out_a.lerp_(out_b, weight_b.unsqueeze(-1))
    torch.logaddexp(lse_a, lse_b, out=lse_a)


def merge_alike_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> None:
    """:func:`merge_into` from operations that round an element alike wherever it sits in its
    tensor (``exp``, ``log``, ``*``, ``+``, ``/``; torch's ``sigmoid``, ``logaddexp`` and
    ``exp2`` round their vectorised and scalar tails differently), for the fixed schedule
    (:mod:`attnkit.invariance`): a row's bits then never depend on its neighbours. A side with
    LSE −inf leaves the other exactly as it was; rows empty on both sides stay 0 and −inf
    (``out_a`` must hold 0 there). ``out_b`` is overwritten."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), 0.0, top)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    out_a.mul_(weight_a.unsqueeze(-1)).add_(out_b.mul_(weight_b.unsqueeze(-1)))
    out_a.div_(torch.where(total == 0, 1.0, total).unsqueeze(-1))
    lse_a.copy_(torch.where(total == 0, float("-inf"), top + torch.log(total)))


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with unit-stride rows, copied only where its last dim is strided: torch's
    fused CPU kernel, forward and backward, reads q, K and V rows as if unit-stride, and an
    elementwise op on overlapping memory (K from ``unfold`` or ``as_strided``, zeroed where no
    query sees it) returns a tensor whose last dim is not."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def query_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` laid out so that a tensor made like it (``empty_like``: torch's fused
    kernels make their output and gradients so, then write them as if unit-stride) has
    unit-stride rows: copied where its last dim is strided, or where another dim of more
    than one entry has a stride of 0 or 1 (rows that overlap or repeat, as ``unfold`` or an
    ``expand`` over positions make them), which ``empty_like`` may order after the last."""
    if x.is_contiguous():
        return x
    if ((x.shape[-1] > 1 and x.stride(-1) != 1)
            or any(size > 1 and stride <= 1 for size, stride in zip(x.shape[:-1], x.stride()))):
        return x.contiguous()
    return x


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x [..., n, D]`` with copies of its last row appended up to a multiple of ``multiple``
    rows (itself when ``n`` is one already, or 0): a product then computes each row as in
    any other call with that many rows (the invariance contract's row multiples)."""
    extra = -x.shape[-2] % multiple
    if not extra:
        return x
    return torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], extra, x.shape[-1])], dim=-2)


def dropout_keep(shape, p: float, generator: Optional[torch.Generator], device) -> torch.Tensor:
    """Bool keep-mask for dropout of probability ``p`` over ``shape`` (reproducible via
    ``generator``) on ``device``, from float32 draws whatever ``torch.set_default_dtype``
    says: another dtype draws another stream from the same seed. A generator of another
    device (a CPU one for CUDA inputs) draws on its own device: the same pattern as there.
    On ``meta`` (shapes only) nothing is drawn, whatever the generator's device."""
    device = torch.device(device)
    if generator is not None and device.type not in (generator.device.type, "meta"):
        draws = torch.rand(shape, generator=generator, dtype=torch.float32,
                           device=generator.device)
        return (draws >= p).to(device)
    return torch.rand(shape, generator=generator, dtype=torch.float32, device=device) >= p


def grouped(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[B, Hq, n, ...]`` → ``[B, Hkv, G·n, ...]``: the ``G = Hq / Hkv`` query heads of each
    K/V head stacked as its rows (a view where the layout allows)."""
    b, hq, n = x.shape[:3]
    return x.reshape(b, heads_kv, (hq // heads_kv) * n, *x.shape[3:])


def ungrouped(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Inverse of :func:`grouped`: ``[B, Hkv, G·n, ...]`` → ``[B, Hq, n, ...]``."""
    b, hkv, gn = x.shape[:3]
    return x.reshape(b, heads_q, gn // (heads_q // hkv), *x.shape[3:])
