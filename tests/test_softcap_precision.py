"""Softcap on the tiled engine at the ends of its range: caps from 1e-3 (scores crushed to
about ±cap) to 1e30 (no cap at all), with the default scale and with scale 1000 (scores in the
hundreds of thousands, every row's weight on one key or spread over the saturated keys).
Forward (out, LSE) and the gradients of q, k and v against a float64 definition written out
here, by the 2x rule of plain float32 math, with two error floors that any float32
implementation pays (see :func:`score_rounding_floors` and :func:`delta_form_floors`).
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak

from conftest import assert_within_2x

SHAPE = (1, 2, 65, 19)  # [B, H, T, D]: one tile of 65 keys, an odd head size
EPS = torch.finfo(torch.float32).eps


def capped_attention(q, k, v, cotangent, *, cap, scale, dtype, noise=None):
    """``softmax(cap · tanh(q kᵀ · scale / cap)) v`` computed in ``dtype`` → ``(out [B, H, T,
    D], lse [B, H, T], (dq, dk, dv))`` for the loss ``Σ out · cotangent``. ``noise [B, H, T,
    T]``: added to the scaled scores before the cap (float64 only: the floors' perturbation)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, T, T]
    if noise is not None:
        scores = scores + noise
    capped = cap * torch.tanh(scores / cap)
    out = torch.softmax(capped, dim=-1) @ v
    lse = torch.logsumexp(capped, dim=-1)
    grads = torch.autograd.grad((out.double() * cotangent).sum(), (q, k, v))
    return out, lse, grads


def score_rounding_floors(q, k, v, cotangent, *, cap, scale, draws=4) -> list:
    """Floors for ``(out, lse, dq, dk, dv)`` from rounding the scaled scores to float32, which
    every float32 implementation does in its own order: each score moved by ``eps · scale ·
    Σ_d |q_d k_d|`` (about a float32 dot product's rounding), with random signs; the largest
    change of each result over a few draws, in float64. Scale 1000 makes this the error's main
    source: the scores' rounding is then about 1e-3 at softcap 30, where ``tanh`` still moves."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (t.double() for t in (q, k, v))
    size = EPS * abs(scale) * (q.abs() @ k.abs().transpose(-1, -2))  # [B, H, T, T]
    exact = capped_attention(q, k, v, cotangent, cap=cap, scale=scale, dtype=torch.float64)
    floors = [0.0] * 5
    for _ in range(draws):
        signs = torch.randint(0, 2, size.shape, generator=gen, dtype=torch.float64) * 2 - 1
        moved = capped_attention(q, k, v, cotangent, cap=cap, scale=scale,
                                 dtype=torch.float64, noise=size * signs)
        for i, (a, b) in enumerate(zip((*moved[:2], *moved[2]), (*exact[:2], *exact[2]))):
            floors[i] = max(floors[i], float((a - b).detach().abs().max()))
    return floors


def delta_form_floors(q, k, v, cotangent, *, cap, scale) -> tuple[float, float]:
    """Floors for dq and dk from the backward's Δ form, ``dS = P ∘ (dP − Δ)`` with ``P``
    recomputed from the LSE (as ``conftest.delta_form_floors``, through the cap's derivative
    ``1 − tanh²``): four float32 ulps of ``P · (|dP| + |Δ|)`` per score, carried by ``|k|``
    into dq and ``|q|`` into dk, in quadrature. Autograd's softmax backward cancels a row's dS
    exactly where all its weight is on one key; the Δ form cannot. In float64."""
    q, k, v, cotangent = (t.double() for t in (q, k, v, cotangent))
    tanh = torch.tanh((q @ k.transpose(-1, -2)) * scale / cap)
    weights = torch.softmax(cap * tanh, dim=-1)  # [B, H, T, T]
    out = weights @ v
    dp = cotangent @ v.transpose(-1, -2)
    delta = (cotangent * out).sum(-1, keepdim=True)
    term = (weights * (dp.abs() + delta.abs()) * (1 - tanh ** 2) * abs(scale)) ** 2
    dq = (term @ k ** 2).sqrt()
    dk = (term.transpose(-1, -2) @ q ** 2).sqrt()
    return 4 * EPS * float(dq.max()), 4 * EPS * float(dk.max())


@pytest.mark.parametrize("scale", [None, 1000.0])
@pytest.mark.parametrize("cap", [1e-3, 30.0, 1e30, 3.4e38])
def test_tiled_softcap_extremes_within_2x_plain_math(cap, scale):
    """Tiled softcap, forward and backward, within 2x of plain float32 math's error (float64
    truth), at tiny, common and huge caps, default and large scales. A huge cap with scale
    1000 puts each row's weight on one key: the backward then recomputes each weight as 1 or 0,
    and dV is the cotangent of that key's query alone."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (10 * torch.randn(SHAPE, generator=gen, dtype=torch.float64).float()
               for _ in range(3))
    cotangent = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    used = scale if scale is not None else SHAPE[-1] ** -0.5

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = ak.attention(*leaves, ak.softcap(cap), scale=scale, backend="tiled", return_lse=True)
    grads = torch.autograd.grad((result.out.double() * cotangent).sum(), leaves)

    truth = capped_attention(q, k, v, cotangent, cap=cap, scale=used, dtype=torch.float64)
    plain = capped_attention(q, k, v, cotangent, cap=cap, scale=used, dtype=torch.float32)
    rounding = score_rounding_floors(q, k, v, cotangent, cap=cap, scale=used)
    delta_q, delta_k = delta_form_floors(q, k, v, cotangent, cap=cap, scale=used)
    floors = [rounding[0], rounding[1], rounding[2] + delta_q, rounding[3] + delta_k, rounding[4]]
    names = ("out", "lse", "dq", "dk", "dv")
    for name, actual, t, p, floor in zip(names, (result.out, result.lse, *grads),
                                         (*truth[:2], *truth[2]), (*plain[:2], *plain[2]), floors):
        assert torch.isfinite(actual).all(), name
        assert_within_2x(f"{name} (cap {cap}, scale {scale})", actual, t, p, torch.float32, floor)
