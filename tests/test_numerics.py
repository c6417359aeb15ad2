"""Pure numerics (masked_softmax, merge, mask_value) and the numerics contract of every backend:
fully masked rows, huge logits, fp16 with masks, causal & padding — never NaN."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import dispatch
from attnkit.inputs import validate
from attnkit.numerics import accum_dtype, mask_value, masked_softmax, merge

from conftest import (ALL_DTYPES, assert_within_2x, dense_causal, dense_padding, naive_attention,
                      plain_attention)

BACKEND_NAMES = list(dispatch.BACKENDS)


# ---- masked_softmax ---------------------------------------------------------------------------

def reference_softmax(scores: torch.Tensor, allowed: torch.Tensor):
    """float64 softmax over allowed entries, 0 on rows with none; LSE −inf there."""
    s = scores.double().masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    return torch.softmax(s, -1).masked_fill(empty, 0.0), torch.logsumexp(s, -1)


def test_masked_softmax_matches_definition(gen):
    scores = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    allowed = torch.rand(3, 5, 7, generator=gen) < 0.6
    allowed[0, 1] = False  # a fully masked row
    weights, lse = masked_softmax(scores, allowed)
    want_w, want_lse = reference_softmax(scores, allowed)
    assert torch.allclose(weights, want_w, atol=1e-15, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], atol=1e-13)
    assert (weights[0, 1] == 0).all() and torch.isneginf(lse[0, 1])
    # without a mask it is the plain softmax
    weights, lse = masked_softmax(scores, None)
    assert torch.allclose(weights, torch.softmax(scores, -1), atol=1e-15)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("big", [1e4, 1e30])
def test_masked_softmax_huge_scores_stay_finite(dtype, big):
    """Without max subtraction exp(1e4) overflows; with it the row is exactly one-hot."""
    scores = torch.tensor([[big, -big, 0.0, big / 2], [-big, -big, -big, -big]], dtype=dtype)
    allowed = torch.ones(2, 4, dtype=torch.bool)
    weights, lse = masked_softmax(scores, allowed)
    assert torch.isfinite(weights).all() and torch.isfinite(lse).all()
    assert weights[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(weights[1], torch.full((4,), 0.25, dtype=dtype))
    assert lse[0] == torch.tensor(big, dtype=dtype)  # log(e^big) = big: exact after the shift
    want = torch.logsumexp(scores.double(), -1)
    assert torch.allclose(lse.double(), want, rtol=1e-6)


def test_masked_softmax_fp16_inputs(gen):
    """fp16 scores up to ±6e4 (near fp16's max 65504): finite, and close to float64."""
    scores = (torch.rand(4, 9, generator=gen) * 12e4 - 6e4).half()
    allowed = torch.rand(4, 9, generator=gen) < 0.7
    allowed[:, 0] = True
    allowed[3] = False
    weights, lse = masked_softmax(scores, allowed)
    assert weights.dtype == torch.float16
    assert not torch.isnan(weights).any() and not torch.isnan(lse).any()
    want_w, want_lse = reference_softmax(scores, allowed)
    # one fp16 ulp of a weight ≤ 1 is ≤ 2^-11 ≈ 4.9e-4 (rounding of the result): allow two
    assert torch.allclose(weights.double(), want_w, atol=1e-3, rtol=0)
    assert (weights[3] == 0).all() and torch.isneginf(lse[3])
    # fp16 scores around 6e4 have an ulp of 32: the LSE is within a couple of ulps of the truth
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=64, rtol=0)


def test_masked_softmax_gradients_zero_on_empty_rows(gen):
    scores = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(3, 6, dtype=torch.bool)
    allowed[1] = False
    allowed[2, 3:] = False
    weights, lse = masked_softmax(scores, allowed)
    (weights * torch.randn(3, 6, generator=gen, dtype=torch.float64)).sum().backward(retain_graph=True)
    assert not torch.isnan(scores.grad).any()
    assert (scores.grad[1] == 0).all() and (scores.grad[2, 3:] == 0).all()
    scores.grad = None
    lse[torch.isfinite(lse)].sum().backward()
    assert not torch.isnan(scores.grad).any() and (scores.grad[1] == 0).all()
    # d lse / d scores = softmax weights
    assert torch.allclose(scores.grad[0], weights[0].detach(), atol=1e-15)


# ---- merge ------------------------------------------------------------------------------------

def _halves(gen, dtype=torch.float64, allowed=None, split=4):
    q = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 6, generator=gen, dtype=torch.float64)
    allowed = torch.ones(5, 9, dtype=torch.bool) if allowed is None else allowed
    whole = naive_attention(q, k, v, allowed)
    a = naive_attention(q, k[..., :split, :], v[..., :split, :], allowed[:, :split])
    b = naive_attention(q, k[..., split:, :], v[..., split:, :], allowed[:, split:])
    cast = lambda t: t.to(dtype)  # noqa: E731
    return whole, (cast(a[0]), a[1].to(dtype)), (cast(b[0]), b[1].to(dtype))


def test_merge_two_halves_equals_whole(gen):
    whole, (out_a, lse_a), (out_b, lse_b) = _halves(gen)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert torch.allclose(out, whole[0], atol=1e-13, rtol=0)
    assert torch.allclose(lse, whole[1], atol=1e-13, rtol=0)
    out_swapped, lse_swapped = merge(out_b, lse_b, out_a, lse_a)  # order does not matter
    assert torch.allclose(out_swapped, out, atol=1e-14) and torch.allclose(lse_swapped, lse, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_merge_keeps_the_relative_precision_of_an_outweighed_side(dtype):
    """A side outweighed by e^70 (a sink's empty partial result (0, sink) against keys far
    below it) keeps its relative precision: out = e^-70 · out_a, not 0 (the lerp form
    out_a + w·(0 − out_a) rounds w to 1 and gives exactly 0)."""
    out_a = torch.tensor([[1.0, -2.0]], dtype=dtype)
    lse_a, lse_b = torch.tensor([0.0], dtype=dtype), torch.tensor([70.0], dtype=dtype)
    out, lse = merge(out_a, lse_a, torch.zeros_like(out_a), lse_b)
    expected = torch.tensor([[1.0, -2.0]], dtype=torch.float64) * math.exp(-70.0)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=0)
    assert torch.allclose(lse.double(), torch.tensor([70.0], dtype=torch.float64), rtol=1e-6)


def test_merge_with_one_side_or_both_fully_masked(gen):
    allowed = torch.ones(5, 9, dtype=torch.bool)
    allowed[0, :4] = False  # row 0: first half empty
    allowed[1, 4:] = False  # row 1: second half empty
    allowed[2, :] = False  # row 2: both empty
    whole, (out_a, lse_a), (out_b, lse_b) = _halves(gen, allowed=allowed)
    assert torch.isneginf(lse_a[..., 0]).all() and torch.isneginf(lse_b[..., 1]).all()
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.allclose(out, whole[0], atol=1e-13, rtol=0)
    assert (out[..., 2, :] == 0).all() and torch.isneginf(lse[..., 2]).all()
    assert torch.equal(out[..., 0, :], out_b[..., 0, :])  # the empty side contributes nothing
    assert torch.equal(out[..., 1, :], out_a[..., 1, :])
    finite = torch.isfinite(whole[1])
    assert torch.allclose(lse[finite], whole[1][finite], atol=1e-13)


def test_merge_both_empty_gives_zero_and_neginf():
    out_a = torch.zeros(3, 2)
    lse_a = torch.full((3,), float("-inf"))
    out, lse = merge(out_a, lse_a, out_a.clone(), lse_a.clone())
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_merge_gradients_finite_with_empty_side(gen):
    allowed = torch.ones(5, 9, dtype=torch.bool)
    allowed[0, :4] = False
    allowed[2, :] = False
    _, (out_a, lse_a), (out_b, lse_b) = _halves(gen, allowed=allowed)
    leaves = [t.clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge(*leaves)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for leaf in leaves:
        assert not torch.isnan(leaf.grad).any()


def test_merge_gradcheck(gen):
    """Exact gradients through merge, also where one or both sides are empty (their −inf
    inputs get gradient 0, and the −inf output row is compared as 0)."""
    allowed = torch.ones(5, 9, dtype=torch.bool)
    allowed[0, :4] = False
    allowed[1, 4:] = False
    allowed[2, :] = False
    _, (out_a, lse_a), (out_b, lse_b) = _halves(gen, allowed=allowed)
    leaves = tuple(t[:1, :1].clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b))

    def fn(*args):
        out, lse = merge(*args)
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_low_precision_produces_fp32(dtype, gen):
    whole, (out_a, lse_a), (out_b, lse_b) = _halves(gen, dtype=dtype)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    # inputs were rounded to dtype (relative error ≤ eps/2 each); the fp32 merge adds nothing
    # comparable, so the merged result is within a few input ulps of the float64 whole
    eps = torch.finfo(dtype).eps
    assert torch.allclose(out.double(), whole[0], atol=4 * eps * float(whole[0].abs().max()), rtol=0)
    assert torch.allclose(lse.double(), whole[1], atol=4 * eps * float(whole[1].abs().max()), rtol=0)


@pytest.mark.parametrize("dtype,accum", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                         (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_accum_dtype(dtype, accum):
    assert accum_dtype(dtype) == accum


# ---- mask_value -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,expected", [
    (torch.float16, -65504.0),
    (torch.bfloat16, -3.3895313892515355e38),
    (torch.float32, -3.4028234663852886e38),
    (torch.float64, -1.7976931348623157e308),
])
def test_mask_value(dtype, expected):
    fill = mask_value(dtype)
    assert fill == expected
    fill_t = torch.tensor(fill, dtype=dtype)
    assert torch.isfinite(fill_t)
    # exp(fill − max) underflows to exactly 0 for any ordinary row max, in the dtype itself
    for row_max in (0.0, -10.0, 10.0):
        assert torch.exp(fill_t - torch.tensor(row_max, dtype=dtype)) == 0
    # why scores are *replaced* by the fill, never added to: two fills overflow to −inf, and a
    # row of −inf minus its max (−inf) is NaN
    assert torch.isneginf(fill_t + fill_t)
    scores = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    replaced = scores.masked_fill(torch.tensor([False, True, True]), fill)
    assert torch.softmax(replaced.float(), -1).tolist() == [1.0, 0.0, 0.0]


# ---- the contract, through attention(), for every backend that runs the input ---------------------

def _runnable(backend: str, q, k, v, mask=None, **kwargs):
    """Skip (with the backend's reasons) unless ``backend`` can run this call."""
    reasons = dispatch.BACKENDS[backend].not_supported_reasons(validate(q, k, v, mask, **kwargs))
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))


def _call(backend, q, k, v, mask, **kwargs):
    """attention() asking for LSE and weights when the backend supports them (else None)."""
    flags = {}
    for flag, need in (("return_lse", "need_lse"), ("return_weights", "need_weights")):
        inputs = validate(q, k, v, mask, **{need: True})
        if not dispatch.BACKENDS[backend].not_supported_reasons(inputs):
            flags[flag] = True
    result = ak.attention(q, k, v, mask=mask, backend=backend, **flags, **kwargs)
    if isinstance(result, torch.Tensor):
        return ak.AttentionResult(result, None, None)
    return result


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fully_masked_rows(backend, dtype, gen):
    """Padded queries, a batch element with no keys, and bottom-right causal rows before the
    first key: output exactly 0, LSE −inf, weights 0, gradients exactly 0, no NaN anywhere."""
    batch, heads, tq, tk, d = 3, 2, 6, 4, 8
    q, k, v = (torch.randn(batch, heads, t, d, generator=gen).to(dtype).requires_grad_()
               for t in (tq, tk, tk))
    q_lengths, kv_lengths = [6, 3, 6], [4, 4, 0]
    mask = ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths) & ak.causal("bottom_right")
    _runnable(backend, q, k, v, mask)
    result = _call(backend, q, k, v, mask)
    allowed = dense_padding(tq, tk, q_lengths, kv_lengths, batch) & dense_causal(tq, tk, "bottom_right")
    empty = ~allowed.any(-1).expand(batch, heads, tq)  # [B, H, Tq]
    assert empty.sum() > 0 and (~empty).sum() > 0
    assert not torch.isnan(result.out).any()
    assert (result.out[empty] == 0).all()
    if result.lse is not None:
        assert not torch.isnan(result.lse).any()
        assert torch.isneginf(result.lse[empty]).all() and torch.isfinite(result.lse[~empty]).all()
    if result.weights is not None:
        assert (result.weights[empty] == 0).all()
        assert torch.allclose(result.weights[~empty].float().sum(-1), torch.ones(()), atol=1e-2)
    loss = (result.out.float() * torch.randn(result.out.shape, generator=gen)).sum()
    if result.lse is not None:
        loss = loss + result.lse.masked_fill(empty, 0.0).sum()
    loss.backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert not torch.isnan(t.grad).any(), f"NaN in d{name}"
    assert (q.grad[empty] == 0).all(), "dq of a fully masked row must be exactly 0"
    never_attended = ~allowed.any(-2).expand(batch, heads, tk)  # keys no query may see
    assert (k.grad[never_attended] == 0).all() and (v.grad[never_attended] == 0).all()
    assert (k.grad[2] == 0).all() and (v.grad[2] == 0).all()  # batch element with no keys


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_huge_logits_stay_finite(backend, dtype):
    """Logits ±1e4 (q·k with q, k of size 100, scale 1): the max-subtracted softmax is exact."""
    q = torch.tensor([[[100.0], [-100.0], [1.0]]]).to(dtype).requires_grad_()  # [1, 3, 1]
    k = torch.tensor([[[100.0], [-100.0], [50.0]]]).to(dtype).requires_grad_()
    v = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]]).to(dtype).requires_grad_()
    _runnable(backend, q, k, v, scale=1.0)
    result = _call(backend, q, k, v, None, scale=1.0)
    assert torch.isfinite(result.out).all()
    truth, lse_truth, _ = naive_attention(q.double(), k.double(), v.double(), scale=1.0)
    plain = plain_attention(q.detach(), k.detach(), v.detach(), scale=1.0)
    assert_within_2x("out", result.out, truth, plain[0], dtype)
    # query 0 (scores 1e4, -1e4, 5e3) attends only key 0; query 1 only key 1
    assert result.out[0, 0].tolist() == [1.0, 0.0] and result.out[0, 1].tolist() == [0.0, 1.0]
    if result.lse is not None:
        assert torch.isfinite(result.lse).all()
        assert torch.allclose(result.lse.double(), lse_truth, rtol=1e-3, atol=0)
    result.out.float().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_low_precision_with_masks_never_nan(backend, dtype, gen):
    """fp16/bf16 with large-ish scores and random dense / bias / causal masks: no NaN, no inf."""
    batch, heads, tq, tk, d = 2, 2, 9, 11, 16
    q, k, v = (4 * torch.randn(batch, heads, t, d, generator=gen) for t in (tq, tk, tk))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    allowed = torch.rand(batch, 1, tq, tk, generator=gen) < 0.4
    allowed[0, 0, 3] = False  # one fully masked row
    values = torch.randn(batch, heads, tq, tk, generator=gen).to(dtype)
    values[torch.rand(values.shape, generator=gen) < 0.3] = float("-inf")
    reasons = []
    for mask in (allowed, ak.dense(allowed) & ak.causal(), values, ak.bias(values) & ak.sliding_window(3)):
        reasons = dispatch.BACKENDS[backend].not_supported_reasons(validate(q, k, v, mask))
        if reasons:
            continue
        out = ak.attention(q, k, v, mask=mask, backend=backend)
        assert not torch.isnan(out).any() and torch.isfinite(out).all()
        out.float().sum().backward()
        for t in (q, k, v):
            assert not torch.isnan(t.grad).any() and torch.isfinite(t.grad).all()
            t.grad = None
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_causal_and_padding_never_nan(backend, dtype, gen):
    """A classic pitfall: combining causal and padding masks must never give NaN — also with a
    batch element of length 0 and padded queries — and must match the float64 truth."""
    batch, heads, t, d = 4, 2, 7, 8
    q, k, v = (torch.randn(batch, heads, t, d, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    lengths = [7, 3, 0, 1]
    mask = ak.causal() & ak.padding(q_lengths=lengths, kv_lengths=lengths)
    _runnable(backend, q, k, v, mask)
    out = ak.attention(q, k, v, mask=mask, backend=backend)
    assert not torch.isnan(out).any()
    allowed = dense_causal(t, t) & dense_padding(t, t, lengths, lengths, batch)
    truth = naive_attention(q.double(), k.double(), v.double(), allowed)[0]
    plain = plain_attention(q.detach(), k.detach(), v.detach(), allowed)[0]
    assert_within_2x("out", out, truth, plain, dtype)
    out.float().sum().backward()
    for t_ in (q, k, v):
        assert not torch.isnan(t_.grad).any()
    assert (q.grad[2] == 0).all() and (k.grad[2] == 0).all() and (v.grad[2] == 0).all()


def test_position_biases_beyond_float32_s_range_run_on_the_reference():
    """float64 ALiBi slopes or a relative-bias table past float32's range would overflow where
    the backends add them in float32 (all-NaN output): auto runs the reference."""
    q = torch.randn(1, 2, 4, 8)
    for modifier in (ak.alibi(torch.full((2,), 1e38, dtype=torch.float64)),
                     ak.relative_bias(torch.full((2, 32), 1e39, dtype=torch.float64))):
        assert ak.explain_dispatch(q, q, q, modifier).backend == "reference"
        out = ak.attention(q, q, q, modifier)
        torch.testing.assert_close(out, ak.attention(q.double(), q.double(), q.double(),
                                                     modifier).float())
