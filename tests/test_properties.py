"""Properties of attention that hold for any input (hypothesis), on every backend that runs it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import dispatch
from attnkit.inputs import validate

from conftest import usable_backends

BACKENDS = usable_backends()
FEW = settings(max_examples=15, deadline=None)


@st.composite
def problems(draw, min_len=1):
    """A float64 problem: q [B, Hq, Tq, Dk], k/v [B, Hkv, Tk, Dk|Dv] and a bool mask
    [B, 1, Tq, Tk] with some fully masked rows, built from a drawn seed."""
    seed = draw(st.integers(0, 2**31 - 1))
    batch = draw(st.integers(1, 2))
    heads_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2]))
    tq, tk = draw(st.integers(min_len, 7)), draw(st.integers(1, 9))
    dk, dv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_kv * group, tq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, tk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, tk, dv, generator=gen, dtype=torch.float64)
    allowed = torch.rand(batch, 1, tq, tk, generator=gen) < density
    return q, k, v, allowed, gen


def run(backend, q, k, v, mask, **flags):
    """attention() on ``backend``; skips the example (not the test) when it cannot run it."""
    need = {"need_lse": flags.get("return_lse", False), "need_weights": flags.get("return_weights", False)}
    reasons = dispatch.BACKENDS[backend].not_supported_reasons(validate(q, k, v, mask, **need))
    if reasons:
        return None
    return ak.attention(q, k, v, mask=mask, backend=backend, **flags)


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(problem=problems())
def test_weights_nonnegative_rows_sum_to_one_or_zero(backend, problem):
    q, k, v, allowed, _ = problem
    result = run(backend, q, k, v, allowed, return_weights=True)
    if result is None:  # this backend never returns weights: nothing to check on it
        assert "return_weights" in " ".join(dispatch.BACKENDS[backend].not_supported_reasons(
            validate(q, k, v, allowed, need_weights=True)))
        return
    weights = result.weights
    assert (weights >= 0).all()
    assert (weights[~allowed.expand_as(weights)] == 0).all()
    sums = weights.sum(-1)  # [B, Hq, Tq]
    has_key = allowed.any(-1).expand_as(sums)
    assert torch.allclose(sums[has_key], torch.ones((), dtype=sums.dtype), atol=1e-12)
    assert (sums[~has_key] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(problem=problems(), data=st.data())
def test_query_permutation_equivariance(backend, problem, data):
    q, k, v, allowed, _ = problem
    perm = torch.tensor(data.draw(st.permutations(range(q.shape[2]))), dtype=torch.long)
    out = run(backend, q, k, v, allowed, return_lse=True)
    out_perm = run(backend, q[:, :, perm], k, v, allowed[:, :, perm], return_lse=True)
    if out is None:
        out = run(backend, q, k, v, allowed)
        out_perm = run(backend, q[:, :, perm], k, v, allowed[:, :, perm])
        if out is None:
            return
        out, out_perm = ak.AttentionResult(out, None, None), ak.AttentionResult(out_perm, None, None)
    assert torch.allclose(out_perm.out, out.out[:, :, perm], atol=1e-12, rtol=0)
    if out.lse is not None:
        assert torch.equal(torch.isneginf(out_perm.lse), torch.isneginf(out.lse[:, :, perm]))
        finite = torch.isfinite(out_perm.lse)
        assert torch.allclose(out_perm.lse[finite], out.lse[:, :, perm][finite], atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(problem=problems(), magnitude=st.sampled_from([1.0, 1e3, 1e6]))
def test_masked_key_values_never_matter(backend, problem, magnitude):
    """Changing v (and k) at keys no query may attend to leaves the output unchanged."""
    q, k, v, allowed, gen = problem
    never = ~allowed.any(-2)[:, 0]  # [B, Tk]: keys masked for every query
    out = run(backend, q, k, v, allowed)
    if out is None:
        return
    v2, k2 = v.clone(), k.clone()
    noise_v = magnitude * torch.randn(v.shape, generator=gen, dtype=torch.float64)
    noise_k = magnitude * torch.randn(k.shape, generator=gen, dtype=torch.float64)
    where = never[:, None, :, None]  # [B, 1, Tk, 1]
    v2 = torch.where(where, v + noise_v, v)
    k2 = torch.where(where, k + noise_k, k)
    out2 = run(backend, q, k2, v2, allowed)
    assert torch.allclose(out2, out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(problem=problems(), c=st.sampled_from([-3.0, 0.5, 2.0, 1e3]))
def test_scaling_v_scales_output(backend, problem, c):
    q, k, v, allowed, _ = problem
    out = run(backend, q, k, v, allowed)
    if out is None:
        return
    out_c = run(backend, q, k, c * v, allowed)
    assert torch.allclose(out_c, c * out, rtol=1e-10, atol=1e-12 * abs(c))


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(problem=problems(), data=st.data())
def test_row_constant_bias_changes_nothing(backend, problem, data):
    """softmax is shift-invariant per row: a bias constant along each row (zero elsewhere is
    irrelevant: masked keys stay masked) leaves the output unchanged and shifts the LSE by it."""
    q, k, v, allowed, gen = problem
    b, _, tq, tk = allowed.shape
    shift = data.draw(st.sampled_from([1.0, 100.0]))
    per_row = shift * torch.randn(b, 1, tq, 1, generator=gen, dtype=torch.float64)  # [B, 1, Tq, 1]
    bias = per_row.expand(b, 1, tq, tk).clone()
    mask_plain = ak.dense(allowed)
    mask_bias = ak.bias(bias) & ak.dense(allowed)
    flags = {"return_lse": True}
    base = run(backend, q, k, v, mask_plain, **flags)
    shifted = run(backend, q, k, v, mask_bias, **flags)
    if base is None or shifted is None:
        flags = {}
        base, shifted = run(backend, q, k, v, mask_plain), run(backend, q, k, v, mask_bias)
        if base is None or shifted is None:
            return
        base, shifted = ak.AttentionResult(base, None, None), ak.AttentionResult(shifted, None, None)
    assert torch.allclose(shifted.out, base.out, atol=1e-10, rtol=0)
    if base.lse is not None:
        want = base.lse + per_row[..., 0]  # [B, Hq, Tq]; −inf stays −inf
        assert torch.equal(torch.isneginf(shifted.lse), torch.isneginf(want))
        finite = torch.isfinite(want)
        assert torch.allclose(shifted.lse[finite], want[finite], atol=1e-10, rtol=0)
