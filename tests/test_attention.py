"""``attnkit.attention`` against an independent float64 computation, per backend, dtype, shape
and mask; refusals, scale, dropout, and classic worked examples computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import dispatch

from conftest import (ALL_DTYPES, MASK_KINDS, assert_within_2x, dense_causal, mask_case,
                      naive_attention, plain_attention)

BACKENDS = ("reference", "torch", "auto")

# (name, q shape, k shape, v shape): Tq ≠ Tk everywhere; Dv ≠ Dk, GQA 8/2 and MQA 4/1 included.
SHAPES = [
    ("2d", (5, 8), (7, 8), (7, 6)),
    ("3d", (2, 6, 4), (2, 4, 4), (2, 4, 4)),
    ("4d", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    ("4d_gqa", (2, 8, 5, 4), (2, 2, 7, 4), (2, 2, 7, 4)),
    ("4d_mqa_dv", (1, 4, 6, 8), (1, 1, 5, 8), (1, 1, 5, 3)),
    ("5d", (2, 2, 2, 5, 4), (2, 2, 1, 7, 4), (2, 2, 1, 7, 4)),
]


def make_qkv(shape, dtype, gen, requires_grad=False):
    _, q_shape, k_shape, v_shape = shape
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in (q_shape, k_shape, v_shape)]
    if requires_grad:
        tensors = [t.requires_grad_() for t in tensors]
    return tensors


def lse_supported(backend: str, q, v) -> bool:
    """torch's fused CPU kernel returns the LSE only when Dk == Dv (tested below)."""
    return backend != "torch" or q.shape[-1] == v.shape[-1]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_matches_float64(backend, dtype, shape, kind, gen):
    check_against_float64(backend, dtype, shape, kind, gen)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_matches_float64(dtype, shape, kind, gen):
    """auto runs whichever backend fits (torch, tiled, reference …): same contract, fewer dtypes."""
    check_against_float64("auto", dtype, shape, kind, gen)


def check_against_float64(backend, dtype, shape, kind, gen):
    """out / LSE / weights of one call against the float64 truth, by the 2× plain-math rule."""
    q, k, v = make_qkv(shape, dtype, gen)
    rank = q.dim()
    batch_shape = tuple(q.shape[:-3]) if rank >= 4 else (q.shape[:1] if rank == 3 else ())
    mask, allowed, bias = mask_case(kind, batch_shape, rank, q.shape[-2], k.shape[-2], gen)
    want_lse = lse_supported(backend, q, v)
    want_weights = backend != "torch"
    if backend == "torch" and bias is not None and dtype in (torch.float16, torch.bfloat16):
        # its kernel would round the float32 bias to q's dtype: refused (auto runs it)
        with pytest.raises(ValueError, match="would round the bias"):
            ak.attention(q, k, v, mask=mask, backend=backend)
        return
    result = ak.attention(q, k, v, mask=mask, backend=backend, return_lse=want_lse,
                          return_weights=want_weights)
    if isinstance(result, torch.Tensor):  # neither flag: attention() returns the tensor itself
        result = ak.AttentionResult(result, None, None)

    out_true, lse_true, weights_true = naive_attention(q.double(), k.double(), v.double(), allowed, bias)
    out_plain, lse_plain, weights_plain = plain_attention(q, k, v, allowed, bias)

    assert result.out.dtype == dtype and result.out.shape == out_true.shape
    assert not torch.isnan(result.out).any()
    assert_within_2x("out", result.out, out_true, out_plain, dtype)
    empty_rows = torch.isneginf(lse_true)  # [..., Hq, Tq]
    assert (result.out[empty_rows.expand(result.out.shape[:-1])] == 0).all(), "fully masked rows must be 0"
    if want_lse:
        assert result.lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert result.lse.shape == lse_true.shape
        assert torch.equal(torch.isneginf(result.lse), empty_rows), "LSE −inf exactly on fully masked rows"
        assert_within_2x("lse", result.lse, lse_true, lse_plain, dtype)
    else:
        assert result.lse is None
    if want_weights:
        assert result.weights.dtype == dtype and result.weights.shape == weights_true.shape
        assert_within_2x("weights", result.weights, weights_true, weights_plain, dtype)
    else:
        assert result.weights is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_tensor_return_without_flags(backend, gen):
    q, k, v = make_qkv(SHAPES[2], torch.float32, gen)
    out = ak.attention(q, k, v, backend=backend)
    assert isinstance(out, torch.Tensor)
    assert torch.allclose(out.double(), naive_attention(q.double(), k.double(), v.double())[0], atol=1e-5)


# ---- refusals and backend names ---------------------------------------------------------------

def test_torch_refuses_dropout_and_weights(gen):
    q, k, v = make_qkv(SHAPES[2], torch.float32, gen)
    with pytest.raises(ValueError, match="not supported by torch") as info:
        ak.attention(q, k, v, dropout_p=0.1, backend="torch")
    assert "dropout_p=0.1" in str(info.value)
    with pytest.raises(ValueError, match="not supported by torch") as info:
        ak.attention(q, k, v, return_weights=True, backend="torch")
    assert "return_weights" in str(info.value)


def test_torch_refuses_lse_when_dk_differs_from_dv(gen):
    q, k, v = make_qkv(SHAPES[4], torch.float32, gen)
    with pytest.raises(ValueError, match="not supported by torch"):
        ak.attention(q, k, v, return_lse=True, backend="torch")
    result = ak.attention(q, k, v, return_lse=True, backend="auto")  # auto finds one that can
    assert result.lse.shape == q.shape[:-1]


@pytest.mark.parametrize("name", ["nope", "Torch", "", None, 3])
def test_unknown_backend_raises(name, gen):
    q, k, v = make_qkv(SHAPES[0], torch.float32, gen)
    with pytest.raises(ValueError, match="unknown backend") as info:
        ak.attention(q, k, v, backend=name)
    assert "reference" in str(info.value)  # the message lists the valid names


def test_backends_listing():
    listing = ak.available_backends()
    assert {"reference", "torch"} <= set(listing)
    assert set(listing) == set(dispatch.BACKENDS)
    assert listing["reference"] == ""


def test_auto_finds_a_backend_for_dropout_and_weights(gen):
    """torch refuses weights and dropout; auto must still run them (on whichever backend)."""
    q, k, v = make_qkv(SHAPES[2], torch.float64, gen)
    auto = ak.attention(q, k, v, return_weights=True, backend="auto")
    truth = naive_attention(q, k, v)
    assert torch.allclose(auto.weights, truth[2], atol=1e-12, rtol=0)
    assert torch.allclose(auto.out, truth[0], atol=1e-12, rtol=0)
    dropped = ak.attention(q, k, v, dropout_p=0.5, backend="auto")
    assert dropped.shape == q.shape and torch.isfinite(dropped).all()


# ---- scale ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [None, 0.1, 3.0, 1])
def test_scale(backend, scale, gen):
    q, k, v = make_qkv(SHAPES[2], torch.float64, gen)
    out = ak.attention(q, k, v, mask=ak.causal(), scale=scale, backend=backend)
    allowed = dense_causal(q.shape[-2], k.shape[-2])
    expected = naive_attention(q, k, v, allowed, scale=scale)[0]
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    if scale is None:  # the default is 1/sqrt(Dk), written out here independently
        explicit = naive_attention(q, k, v, allowed, scale=1 / math.sqrt(q.shape[-1]))[0]
        assert torch.allclose(out, explicit, atol=1e-12, rtol=0)


def test_temperature_changes_the_result(gen):
    """A test that cannot fail is a defect: scale really reaches the softmax."""
    q, k, v = make_qkv(SHAPES[2], torch.float64, gen)
    assert not torch.allclose(ak.attention(q, k, v, scale=0.1), ak.attention(q, k, v, scale=3.0))


# ---- dropout ----------------------------------------------------------------------------------

def test_dropout_reproducible_with_generator(gen):
    q, k, v = make_qkv(SHAPES[2], torch.float32, gen)

    def run(seed):
        return ak.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))
    no_dropout = ak.attention(q, k, v)
    assert not torch.allclose(run(7), no_dropout)


def test_dropout_reproducible_with_global_seed(gen):
    q, k, v = make_qkv(SHAPES[2], torch.float32, gen)
    torch.manual_seed(3)
    first = ak.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(first, ak.attention(q, k, v, dropout_p=0.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zero_is_no_dropout(backend, gen):
    q, k, v = make_qkv(SHAPES[3], torch.float32, gen)
    assert torch.equal(ak.attention(q, k, v, dropout_p=0.0, backend=backend),
                       ak.attention(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_dropout_weights_are_before_dropout(backend, gen):
    q, k, v = make_qkv(SHAPES[2], torch.float64, gen)
    with_dropout = ak.attention(q, k, v, dropout_p=0.5, return_weights=True, backend=backend,
                                generator=torch.Generator().manual_seed(0))
    truth = naive_attention(q, k, v)[2]
    assert torch.allclose(with_dropout.weights, truth, atol=1e-12, rtol=0)
    assert not torch.allclose(with_dropout.out, naive_attention(q, k, v)[0], atol=1e-3)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_mean_matches_expectation(p, gen):
    """Dropout keeps each weight with probability 1-p and rescales it by 1/(1-p), so the
    expected output is the no-dropout output. Over N independent batch copies of one problem,
    out_i = Σ_j w_ij·keep_ij/(1-p)·v_j has variance Σ_j w_ij²·v_j²·p/(1-p), so the mean over N
    copies has standard deviation σ = sqrt(that/N). We allow 5σ per element: with 24 elements
    a correct implementation fails with probability < 24·6e-7 (and the seed is fixed anyway),
    while a missing 1/(1-p) rescale is off by a factor (1-p) — many σ at N = 4000."""
    n_copies, tq, tk, d = 4000, 4, 6, 6
    q1, k1, v1 = (torch.randn(1, s, d, generator=gen, dtype=torch.float64) for s in (tq, tk, tk))
    q, k, v = q1.expand(n_copies, tq, d), k1.expand(n_copies, tk, d), v1.expand(n_copies, tk, d)
    out = ak.attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(11))
    expected, _, weights = naive_attention(q1, k1, v1)  # [1, tq, d], [1, tq, tk]
    variance = (weights[0, :, :, None] ** 2 * v1[0, None, :, :] ** 2).sum(1) * p / (1 - p)  # [tq, d]
    sigma = (variance / n_copies).sqrt()
    deviation = (out.mean(0) - expected[0]).abs()
    assert (deviation <= 5 * sigma).all(), f"max deviation in σ: {float((deviation / sigma).max()):.2f}"


# ---- classic worked examples, computed by hand ---------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_three_token_causal_example(backend):
    """Q = K = V = [[1,0],[2,0],[3,0]], causal, d_k = 2. Scores S = Q Kᵀ/√2:
    row 1: [√2, 2√2] = [1.41421, 2.82843]; e^1.41421 = 4.11325, e^2.82843 = 16.91883, sum 21.03208
           → A[1] = [0.19557, 0.80443, 0];  O[1] = 0.19557·1 + 0.80443·2 = 1.80443.
    row 2: [3/√2, 6/√2, 9/√2] = [2.12132, 4.24264, 6.36396]; e^… = 8.34214, 69.59138, 580.54135,
           sum 658.47487 → A[2] = [0.012669, 0.105686, 0.881645];
           O[2] = 0.012669 + 2·0.105686 + 3·0.881645 = 2.868977.
    A printed version of this example gives row 2 as [0.063, 0.262, 0.675], which is not the
    softmax of row 2 by any reading (docs/NUMERICS.md); the test makes sure of the difference."""
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    result = ak.attention(x, x, x, mask=ak.causal(), backend=backend, return_lse=True,
                          return_weights=backend != "torch")
    expected_out = torch.tensor([[1.0, 0.0], [1.80443, 0.0], [2.86898, 0.0]], dtype=torch.float64)
    assert torch.allclose(result.out, expected_out, atol=1e-3, rtol=0)
    # LSE = log of the sums above: row 0 e^0.70711 → 0.70711; row 1 log 21.03208; row 2 log 658.47487
    expected_lse = torch.tensor([0.70711, math.log(21.03208), math.log(658.47487)], dtype=torch.float64)
    assert torch.allclose(result.lse, expected_lse, atol=1e-3, rtol=0)
    if backend != "torch":
        expected_weights = torch.tensor([[1.0, 0.0, 0.0], [0.19557, 0.80443, 0.0],
                                         [0.012669, 0.105686, 0.881645]], dtype=torch.float64)
        assert torch.allclose(result.weights, expected_weights, atol=1e-3, rtol=0)
        assert not torch.allclose(result.weights[2], torch.tensor([0.063, 0.262, 0.675], dtype=torch.float64),
                                  atol=1e-2)


@pytest.mark.parametrize("divisor,expected", [
    # scores s = [0, 64, 128] (d_k = 64), divided by:
    # 1: softmax ∝ [e^-128, e^-64, 1] = [2.57221e-56, 1.60381e-28, 1]: saturated
    (1.0, [2.57221e-56, 1.60381e-28, 1.0]),
    # √d_k = 8 → [0, 8, 16]: e^8 = 2980.958, e^16 = 8886110.52, sum 8889092.48
    #   → [1.12497e-7, 3.35350e-4, 0.999665]
    (8.0, [1.12497e-7, 3.35350e-4, 0.999665]),
    # d_k = 64 → [0, 1, 2]: e = 2.71828, e² = 7.38906, sum 11.10734 → [0.090031, 0.244728, 0.665241]
    (64.0, [0.090031, 0.244728, 0.665241]),
])
def test_softmax_saturation_example(divisor, expected):
    """One query q = [1] against keys [[0], [64], [128]] gives the scores [0, 64, 128] exactly."""
    q = torch.tensor([[1.0]], dtype=torch.float64)
    k = torch.tensor([[0.0], [64.0], [128.0]], dtype=torch.float64)
    v = torch.eye(3, dtype=torch.float64)
    result = ak.attention(q, k, v, scale=1.0 / divisor, return_weights=True, backend="reference")
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(result.weights[0], expected, rtol=1e-4, atol=0)
    assert torch.allclose(result.out[0], expected, rtol=1e-4, atol=0)  # v = I returns the weights


# ---- mask reuse -------------------------------------------------------------------------------

def test_mask_object_reusable_across_layouts(gen):
    """A combined mask holding a tensor is fitted to each call's layout without being changed:
    the same object used with 4-D inputs (the [2, Tq, Tk] tensor means [H, Tq, Tk]) and then
    with 3-D inputs (where it means [B, Tq, Tk]) must give the right answer both times."""
    allowed = torch.rand(2, 4, 4, generator=gen) < 0.7
    mask = ak.dense(allowed) & ak.causal()
    q4, k4, v4 = (torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    out4 = ak.attention(q4, k4, v4, mask=mask, backend="reference")
    expected4 = naive_attention(q4, k4, v4, allowed & dense_causal(4, 4))[0]
    assert torch.allclose(out4, expected4, atol=1e-12)
    q3, k3, v3 = q4[0], k4[0], v4[0]  # [B=2, T, D]
    out3 = ak.attention(q3, k3, v3, mask=mask, backend="reference")
    expected3 = naive_attention(q3, k3, v3, allowed & dense_causal(4, 4))[0]
    assert torch.allclose(out3, expected3, atol=1e-12)


def test_backend_modules_import_by_dotted_name():
    """``attnkit.backends`` is the subpackage (the listing is ``available_backends()``), so
    dotted imports of a backend module reach it."""
    import attnkit.backends.tiled as tiled_module

    assert tiled_module.TiledBackend.NAME == "tiled"
