"""``torch.autograd.gradcheck`` in float64 through every backend that runs the input.

The loop is over ``attnkit.dispatch.BACKENDS``, so a backend registered later is checked too;
a backend that refuses an input is skipped with its own reasons.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import dispatch
from attnkit.inputs import validate

BACKEND_NAMES = list(dispatch.BACKENDS)


def _case(name: str, gen: torch.Generator):
    """(q, k, v, mask, wants_bias_grad) for one named case; small so gradcheck stays fast."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if name == "no_mask":
        return rand(1, 2, 4, 3), rand(1, 2, 5, 3), rand(1, 2, 5, 3), None
    if name == "causal":
        return rand(1, 2, 5, 3), rand(1, 2, 5, 3), rand(1, 2, 5, 3), ak.causal()
    if name == "padding_fully_masked_row":
        # batch 0: query 3 is padding (fully masked row); batch 1: no keys at all
        mask = ak.padding(q_lengths=[3, 4], kv_lengths=[4, 0])
        return rand(2, 1, 4, 3), rand(2, 1, 5, 3), rand(2, 1, 5, 3), mask
    if name == "gqa":
        return rand(1, 4, 3, 2), rand(1, 2, 4, 2), rand(1, 2, 4, 2), ak.causal("bottom_right")
    if name == "dv_ne_dk":
        return rand(1, 1, 4, 3), rand(1, 1, 5, 3), rand(1, 1, 5, 2), ak.sliding_window(1, 1)
    if name == "bias":
        values = rand(1, 2, 4, 5)
        values[0, 0, 1, 2] = float("-inf")
        return rand(1, 2, 4, 3), rand(1, 2, 5, 3), rand(1, 2, 5, 3), ak.bias(values)
    raise KeyError(name)


CASES = ["no_mask", "causal", "padding_fully_masked_row", "gqa", "dv_ne_dk", "bias"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_gradcheck(backend, case, gen):
    q, k, v, mask = _case(case, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    impl = dispatch.BACKENDS[backend]
    reasons = impl.not_supported_reasons(validate(q, k, v, mask))
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    # the LSE is checked too wherever the backend offers it with gradients
    with_lse = not impl.not_supported_reasons(validate(q, k, v, mask, need_lse=True))

    def fn(q, k, v):
        result = ak.attention(q, k, v, mask=mask, backend=backend, return_lse=with_lse)
        if not with_lse:
            return result
        # −inf LSE rows (fully masked) have no derivative to check: compare them as 0
        return result.out, result.lse.masked_fill(torch.isneginf(result.lse), 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_lse_is_differentiable_or_refused(backend, gen):
    """A backend either refuses return_lse for inputs that need gradients, or its LSE carries
    them: a silently constant LSE would drop that part of the loss (ring attention's merge
    differentiates through the LSE)."""
    q, k, v, _ = _case("no_mask", gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    impl = dispatch.BACKENDS[backend]
    reasons = impl.not_supported_reasons(validate(q, k, v, None, need_lse=True))
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    result = ak.attention(q, k, v, backend=backend, return_lse=True)
    assert result.lse.requires_grad, f"{backend} returned an LSE without gradients"
    dq, dk = torch.autograd.grad(result.lse.sum(), (q, k))
    # d lse_i / d q_i = scale · Σ_j w_ij k_j (the softmax-weighted mean key), independently:
    scale = q.shape[-1] ** -0.5
    weights = torch.softmax(q.detach() @ k.detach().transpose(-1, -2) * scale, -1)
    assert torch.allclose(dq, scale * weights @ k.detach(), atol=1e-12)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_vectorized_jacobian_equals_the_looped_one_or_is_refused(backend, gen):
    """``jacobian(vectorize=True)`` (a backward with batched gradients,
    ``is_grads_batched=True``) gives the looped jacobian, or a backend refuses it by name."""
    from torch.autograd.functional import jacobian
    q, k, v, _ = _case("causal", gen)
    impl = dispatch.BACKENDS[backend]
    ran = 0
    for mask in (ak.causal(), ak.causal() & ak.softcap(5.0)):
        if impl.not_supported_reasons(validate(q.requires_grad_(), k, v, mask)):
            continue

        def fn(q, k, v):
            return ak.attention(q, k, v, mask, backend=backend)

        looped = jacobian(fn, (q.detach(), k, v))
        try:
            vectorized = jacobian(fn, (q.detach(), k, v), vectorize=True)
        except RuntimeError as error:
            assert backend == "triton" and "batched backward" in str(error), error
            return
        ran += 1
        for got, want in zip(vectorized, looped):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if not ran:
        pytest.skip(f"{backend} runs neither mask with gradients")
