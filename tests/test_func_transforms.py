"""Attention under ``torch.func`` and higher-order autograd, as research code runs it:
per-sample gradients (``vmap(grad(...))``), ``jacrev``/``jacfwd``/``jvp``/``hessian``,
forward-mode dual tensors, Hessian-vector products through ``create_graph=True``,
``functional_call`` of :class:`attnkit.nn.MultiHeadAttention`, ``vmap`` over a batch of
biases, bool masks, lengths or document ids, and ``vmap(randomness=...)`` with dropout.

Every value is checked against :func:`_math`, plain PyTorch ``softmax(q kᵀ · scale + bias) v``
written here (differentiable by every transform), or against a Python loop over the vmapped
dimension. A backend that refuses a transform must say which backend runs it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap

import attnkit as ak
from attnkit.modifiers import t5_buckets
from attnkit.nn import MultiHeadAttention

T = 5


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _math(q, k, v, bias=None, allowed=None, cap=None, sink=None):
    """``softmax(cap·tanh(q kᵀ·scale / cap) + bias, −inf where not allowed) v`` with an
    optional sink logit per head in the denominator; fully masked rows give 0.
    q ``[..., H, Tq, D]``, k/v ``[..., H, Tk, D]``, bias broadcastable to
    ``[..., H, Tq, Tk]``, sink ``[H]``."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        column = sink[:, None, None].expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


def _positions(tq: int = T, tk: int = T):
    return torch.arange(tq)[:, None], torch.arange(tk)[None, :]


def _cases():
    """name → (mask factory over its learnable tensor, the same as `_math` keywords, tensor)."""
    i, j = _positions()
    causal = j <= i
    window = (i - j).abs() <= 1
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    table = torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(2, 32)
    sink = torch.tensor([0.3, -0.7], dtype=torch.float64)
    buckets = t5_buckets(j - i, 32)
    return {
        "causal": (lambda t: ak.causal(), lambda t: {"allowed": causal}, None),
        "sliding_window": (lambda t: ak.sliding_window(1, 1), lambda t: {"allowed": window}, None),
        "softcap": (lambda t: ak.causal() & ak.softcap(2.0),
                    lambda t: {"allowed": causal, "cap": 2.0}, None),
        "alibi": (lambda t: ak.causal() & ak.alibi(t),
                  lambda t: {"allowed": causal, "bias": t[:, None, None] * (j - i)}, slopes),
        "relative_bias": (lambda t: ak.relative_bias(t), lambda t: {"bias": t[:, buckets]},
                          table),
        "sinks": (lambda t: ak.causal() & ak.sinks(t),
                  lambda t: {"allowed": causal, "sink": t}, sink),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_per_sample_gradients_match_plain_math(case, gen):
    """``vmap(grad(loss))`` over the batch (Opacus-style per-example gradients) of q, k, v and
    of the modifier's learnable tensor equals the same transform of plain math."""
    mask, keywords, param = _cases()[case]
    q, k, v = (_rand(gen, 3, 2, T, 4) for _ in range(3))
    param = torch.zeros((), dtype=torch.float64) if param is None else param

    def per_sample(fn):
        loss = lambda p, a, b, c: fn(p, a[None], b[None], c[None]).pow(2).sum()  # noqa: E731
        return vmap(grad(loss, argnums=(0, 1, 2, 3)), in_dims=(None, 0, 0, 0))(param, q, k, v)

    ours = per_sample(lambda p, a, b, c: ak.attention(a, b, c, mask(p)))
    want = per_sample(lambda p, a, b, c: _math(a, b, c, **keywords(p)))
    for got, expected in zip(ours, want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_forward_mode_and_hessians_match_plain_math(case, gen):
    """``jacfwd``, ``jvp``, forward-mode dual tensors and ``hessian`` (forward over reverse)
    through attention equal the same transforms of plain math."""
    mask, keywords, param = _cases()[case]
    q, k, v = (_rand(gen, 1, 2, T, 3) for _ in range(3))
    param = torch.zeros((), dtype=torch.float64) if param is None else param

    def ours(a, b, c, p):
        return ak.attention(a, b, c, mask(p))

    def plain(a, b, c, p):
        return _math(a, b, c, **keywords(p))

    for argnum in range(4):
        torch.testing.assert_close(jacfwd(ours, argnums=argnum)(q, k, v, param),
                                   jacfwd(plain, argnums=argnum)(q, k, v, param),
                                   rtol=1e-10, atol=1e-12)
    tangents = tuple(_rand(gen, *t.shape) for t in (q, k, v, param))
    torch.testing.assert_close(jvp(ours, (q, k, v, param), tangents),
                               jvp(plain, (q, k, v, param), tangents), rtol=1e-10, atol=1e-12)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, d) for t, d in zip((q, k, v, param), tangents)]
        got = fwAD.unpack_dual(ours(*duals)).tangent
    torch.testing.assert_close(got, jvp(plain, (q, k, v, param), tangents)[1],
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hessian(lambda a: ours(a, k, v, param).pow(2).sum())(q),
                               hessian(lambda a: plain(a, k, v, param).pow(2).sum())(q),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_hessian_vector_products_match_plain_math(backend, gen):
    """``grad(create_graph=True)`` then again (a Hessian-vector product) on the backends that
    have a second derivative, for q and a learnable bias."""
    q, k, v = (_rand(gen, 2, 2, T, 3) for _ in range(3))
    values = _rand(gen, 2, 2, T, T)
    vector = _rand(gen, 2, 2, T, 3)

    def hvp(fn):
        a, b = q.clone().requires_grad_(), values.clone().requires_grad_()
        dq, = torch.autograd.grad(fn(a, b).pow(2).sum(), a, create_graph=True)
        return torch.autograd.grad((dq * vector).sum(), (a, b))

    ours = hvp(lambda a, b: ak.attention(a, k, v, ak.causal() & ak.bias(b), backend=backend))
    want = hvp(lambda a, b: _math(a, k, v, bias=b, allowed=torch.ones(T, T).tril().bool()))
    for got, expected in zip(ours, want):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_double_backward_refusal_names_the_backends_that_have_one(gen):
    """A backward recorded for a second derivative through a backend without one raises
    before it runs, naming the backend and those that have one."""
    q, k, v = (_rand(gen, 1, 1, 4, 3) for _ in range(3))
    q.requires_grad_()
    out = ak.attention(q, k, v, backend="torch").sum()
    with pytest.raises(RuntimeError, match="backend='reference'") as error:
        torch.autograd.grad(out, q, create_graph=True)
    assert "backend 'torch'" in str(error.value) and "backend='tiled'" in str(error.value)


@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_gradgradcheck_with_learnable_bias_and_modifiers(backend, gen):
    q, k, v = (_rand(gen, 1, 2, 3, 2).requires_grad_() for _ in range(3))
    values = _rand(gen, 1, 2, 3, 3).requires_grad_()
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    sink = torch.tensor([0.1, -0.2], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, values, slopes, sink):
        mask = ak.causal() & ak.bias(values) & ak.alibi(slopes) & ak.sinks(sink)
        return ak.attention(q, k, v, mask, backend=backend)

    assert torch.autograd.gradgradcheck(fn, (q, k, v, values, slopes, sink), eps=1e-6,
                                        atol=1e-6)


def test_vmap_over_a_batch_of_biases(gen):
    """``vmap`` with in_dims on the bias alone (q, k, v shared): ``auto`` runs it (no backend's
    range check reads the batched values on the host) and equals plain math."""
    q, k, v = (_rand(gen, 2, 2, T, 3) for _ in range(3))
    biases = _rand(gen, 4, 2, T, T)
    want = vmap(lambda b: _math(q, k, v, bias=b))(biases)
    torch.testing.assert_close(vmap(lambda b: ak.attention(q, k, v, ak.bias(b)))(biases), want,
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(vmap(lambda b: ak.attention(q, k, v, b))(biases), want,
                               rtol=1e-10, atol=1e-12)


def _batched_masks(gen):
    """name → (mask factory, the batch of tensors vmap runs it over)."""
    bools = torch.rand(3, T, T, generator=gen) > 0.5
    bools[..., 0] = True
    return {
        "bool": (lambda m: m, bools),
        "dense": (ak.dense, bools),
        "padding": (lambda n: ak.padding(kv_lengths=n), torch.tensor([[1], [3], [5]])),
        "documents": (ak.documents, torch.tensor([[[0, 0, 1, 1, 1]], [[0, 1, 1, 2, 2]]])),
    }


@pytest.mark.parametrize("kind", ["bool", "dense", "padding", "documents"])
def test_vmap_over_mask_tensors(kind, gen):
    """``vmap`` over the mask's own tensors (bool masks, lengths, document ids) with q, k, v
    shared: ``auto`` equals a loop over the batch, and a backend whose kernels read the mask on
    the host refuses by name, saying which backend runs it."""
    make, batch = _batched_masks(gen)[kind]
    q, k, v = (_rand(gen, 1, 2, T, 3) for _ in range(3))
    looped = torch.stack([ak.attention(q, k, v, make(m), backend="reference") for m in batch])
    torch.testing.assert_close(vmap(lambda m: ak.attention(q, k, v, make(m)))(batch), looped,
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="torch.func.*reference supports them"):
        vmap(lambda m: ak.attention(q, k, v, make(m), backend="tiled"))(batch)


def test_vmap_over_lengths_beyond_the_dense_size(gen):
    """Per-example lengths under ``vmap`` at a length where ``auto`` would otherwise take the
    tiled engine, and a ``from_function`` mask reading a vmapped tensor of its own: ``auto``
    equals a loop over the batch."""
    n = 300  # Tq·Tk above DENSE_MAX_SCORES: auto would take the tiled engine
    q, k, v = (_rand(gen, 1, 1, n, 4) for _ in range(3))
    lengths = torch.tensor([5, 200])
    looped = torch.stack([ak.attention(q, k, v, ak.padding(kv_lengths=n_[None]))
                          for n_ in lengths])
    got = vmap(lambda n_: ak.attention(q, k, v, ak.padding(kv_lengths=n_[None])))(lengths)
    torch.testing.assert_close(got, looped, rtol=1e-10, atol=1e-12)
    got = vmap(lambda n_: ak.attention(q, k, v, ak.from_function(lambda b, h, i, j: j < n_)))(
        lengths)
    torch.testing.assert_close(got, looped, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="reference supports them"):
        vmap(lambda n_: ak.attention(q, k, v, ak.from_function(lambda b, h, i, j: j < n_),
                                     backend="tiled"))(lengths)


@pytest.mark.parametrize("kind", ["causal top_left", "causal bottom_right", "window",
                                  "causal(sequences=)"])
def test_vmap_over_causal_document_ids(gen, kind):
    """A band inside each document (``documents(causal=)``, ``sliding_window(sequences=)``,
    ``causal(sequences=)``) under ``vmap`` over the ids: each example's own band, as a loop
    gives it (the runs are found on the device, without reading the batched ids)."""
    _, batch = _batched_masks(gen)["documents"]
    q, k, v = (_rand(gen, 1, 2, T, 3) for _ in range(3))
    make = {"causal top_left": lambda ids: ak.documents(ids, causal="top_left"),
            "causal bottom_right": lambda ids: ak.documents(ids, causal="bottom_right"),
            "window": lambda ids: ak.sliding_window(1, sequences=ak.documents(ids)),
            "causal(sequences=)": lambda ids: ak.causal(sequences=ak.documents(ids))}[kind]
    looped = torch.stack([ak.attention(q, k, v, make(ids)) for ids in batch])
    torch.testing.assert_close(vmap(lambda ids: ak.attention(q, k, v, make(ids)))(batch), looped)


def _mha(gen, **kwargs) -> MultiHeadAttention:
    module = MultiHeadAttention(8, 2, **kwargs).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(_rand(gen, *p.shape) * 0.3)
    return module


def _plain_mha(params: dict, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """MultiHeadAttention's forward (self-attention, causal, key padding) in plain math."""
    def heads(name):
        y = x @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        return y.reshape(*y.shape[:-1], 2, 4).transpose(-2, -3)
    i, j = _positions(x.shape[-2], x.shape[-2])
    out = _math(heads("q_proj"), heads("k_proj"), heads("v_proj"),
                allowed=(j <= i) & valid[..., None, None, :])
    out = out.transpose(-2, -3).reshape(x.shape)
    return out @ params["out_proj.weight"].T + params["out_proj.bias"]


def test_functional_call_per_sample_gradients_of_multi_head_attention(gen):
    """``vmap(grad(...))`` of ``functional_call(mha, params, ...)`` (per-example parameter
    gradients, swapped parameters) with per-example key padding equals plain math."""
    mha = _mha(gen)
    params = {name: p.detach() for name, p in mha.named_parameters()}
    x = _rand(gen, 3, T, 8)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)

    def loss(p, xi, vi):
        return functional_call(mha, p, (xi[None],), {"key_valid": vi[None], "is_causal": True}
                               ).out.pow(2).sum()

    ours = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, valid)
    want = vmap(grad(lambda p, xi, vi: _plain_mha(p, xi[None], vi[None]).pow(2).sum()),
                in_dims=(None, 0, 0))(params, x, valid)
    assert ours.keys() == want.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], want[name], rtol=1e-10, atol=1e-12)


def test_vmap_randomness_of_dropout(gen):
    """``randomness="same"`` drops the same weights in every vmapped example, ``"different"``
    others; the default refuses with torch's message (no random draw slips through)."""
    q, k, v = (_rand(gen, 1, 2, 6, 4) for _ in range(3))
    batch = q.expand(3, *q.shape).contiguous()

    def run(a):
        return ak.attention(a, k, v, dropout_p=0.5)

    same = vmap(run, randomness="same")(batch)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2])
    different = vmap(run, randomness="different")(batch)
    assert not torch.equal(different[0], different[1])
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(run)(batch)


@pytest.mark.parametrize("side", ["q_ids", "kv_ids"])
@pytest.mark.parametrize("nested", [False, True])
def test_vmap_over_causal_document_ids_in_two_runs_is_refused(gen, side, nested):
    """Ids whose document lies in two runs on one side, which ``documents(causal=)`` refuses
    eagerly, are refused under ``vmap`` over the ids too (nested ``vmap`` included), naming
    the side, on ``auto`` and ``reference`` alike: not evaluated as some other mask."""
    q, k, v = (_rand(gen, 1, 2, T, 3) for _ in range(3))
    good = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    bad = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 1, 1]])  # example 1: document 0 twice
    q_ids, kv_ids = (bad, good) if side == "q_ids" else (good, bad)
    with pytest.raises(ValueError, match="not one contiguous run"):
        ak.attention(q, k, v, ak.documents(q_ids[1], kv_ids[1], causal="top_left"))
    for backend in ("auto", "reference"):
        def call(a, b):
            return ak.attention(q, k, v, ak.documents(a, b, causal="top_left"), backend=backend)
        run = vmap(vmap(call)) if nested else vmap(call)
        with pytest.raises(ValueError, match=f"vmapped example.*{side}.*not one contiguous run"):
            run(*((q_ids, kv_ids) if not nested else (q_ids[None], kv_ids[None])))
    looped = torch.stack([ak.attention(q, k, v, ak.documents(a, causal="top_left"))
                          for a in good])
    torch.testing.assert_close(
        vmap(lambda a: ak.attention(q, k, v, ak.documents(a, causal="top_left")))(good), looped)
