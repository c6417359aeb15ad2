"""``torch.compile`` with an explicit backend and with masks whose Python numbers change between
calls: one graph (``fullgraph=True``), forward and backward equal to the float64 reference.

Compiled with ``backend="aot_eager"`` (dynamo and AOT autograd: the graph capture, the fake
implementations and the registered autograd, without inductor's code generation time).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from conftest import assert_within_2x

import attnkit as ak

B, H, T, D = 2, 2, 40, 8


def _qkv(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, requires_grad=True) for _ in range(3)]


def _out_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad((out * out).sum(), (q, k, v))]


def _assert_like_reference(name, got, mask, q, k, v):
    """``got`` (out and the gradients of Σ out²) within 2× the error of the reference's float32
    math from the float64 reference."""
    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return _out_and_grads(lambda *x: ak.attention(*x, mask, backend="reference"), *leaves)
    truths, plains = reference(torch.float64), reference(torch.float32)
    for what, g, truth, plain in zip(("out", "dq", "dk", "dv"), got, truths, plains):
        assert_within_2x(f"{name} {what}", g, truth, plain, torch.float32)


@pytest.mark.parametrize("backend, mask_name", [
    ("tiled", "none"), ("tiled", "causal"), ("tiled", "causal&padding"), ("reference", "none"),
    ("reference", "causal")])
def test_an_explicit_backend_compiles_to_one_graph(backend, mask_name):
    """No mask and causal masking trace as torch's kernel under ``backend="auto"``; a backend
    that plans on the host (tiled) runs as attnkit's operator instead, in the same single
    graph, with its own backward."""
    lengths = torch.tensor([25, 40])
    make = {"none": lambda: None, "causal": ak.causal,
            "causal&padding": lambda: ak.causal() & ak.padding(kv_lengths=lengths)}[mask_name]

    def fn(q, k, v):
        return ak.attention(q, k, v, make(), backend=backend)

    torch._dynamo.reset()
    q, k, v = _qkv(1)
    got = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v)
    _assert_like_reference(f"{backend} {mask_name}", got, make(), q, k, v)


def test_auto_with_a_differentiated_lse_compiles_without_a_mask():
    """``auto`` sends a call whose LSE is differentiated to tiled (torch's kernel gives no LSE
    gradient): that compiles as the operator too."""
    def fn(q, k, v):
        result = ak.attention(q, k, v, return_lse=True)
        return result.out + result.lse[..., None]

    torch._dynamo.reset()
    q, k, v = _qkv(2)
    got = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v)
    want = _out_and_grads(fn, q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("kind, values", [
    ("sliding_window", (2, 6, 3)),
    ("softcap", (1.0, 20.0, 5.0)),
    ("window_and_softcap", ((2, 1.0), (6, 20.0), (3, 5.0))),
])
def test_a_compiled_function_takes_masks_with_other_numbers(kind, values):
    """One compiled function called with masks that differ in a Python number (a window, a
    cap): each call computes with its own numbers, forward and backward, in one graph."""
    def make(value):
        if kind == "sliding_window":
            return ak.sliding_window(value)
        if kind == "softcap":
            return ak.causal() & ak.softcap(value)
        return ak.sliding_window(value[0]) & ak.softcap(value[1])

    def fn(q, k, v, mask):
        return ak.attention(q, k, v, mask)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(3)
    for value in values:
        got = _out_and_grads(lambda *x: compiled(*x, make(value)), q, k, v)
        _assert_like_reference(f"{kind}({value})", got, make(value), q, k, v)


@pytest.mark.parametrize("window", [np.int64(3), torch.tensor(3)], ids=["numpy", "tensor"])
def test_a_compiled_function_takes_a_window_as_a_numpy_or_tensor_integer(window):
    """A window handed over as numpy or torch hands out integers (a config read with numpy, a
    0-d index tensor): dynamo traces them as tensors, and the window still compiles."""
    def fn(q, k, v, left):
        return ak.attention(q, k, v, ak.sliding_window(left))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(4)
    got = _out_and_grads(lambda *x: compiled(*x, window), q, k, v)
    _assert_like_reference(f"sliding_window({window!r})", got, ak.sliding_window(3), q, k, v)


@pytest.mark.parametrize("q_len, kv_len", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_empty_sequences_compile_with_zero_gradients(backend, q_len, kv_len):
    """Empty calls under ``torch.compile`` (the operator's forward and backward) give what
    eager gives: an empty or zero output and zero gradients, learnable slopes included."""
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)

    def fn(q, k, v):
        return ak.attention(q, k, v, ak.causal() & ak.softcap(5.0) & ak.alibi(slopes),
                            backend=backend)

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, n, 4, requires_grad=True) for n in (q_len, kv_len, kv_len))
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert out.shape == (1, 2, q_len, 4) and (out == 0).all()
    out.sum().backward()
    for t in (q, k, v, slopes):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4), (3, 1, 2, 6, 4)], ids=str)
def test_a_mask_function_compiles_for_queries_of_any_rank(shape):
    """The dense mask a ``from_function`` mask becomes in the graph has the caller's rank."""
    def below(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (b >= 0)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    def fn(q, k, v):
        return ak.attention(q, k, v, ak.from_function(below))
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, ak.attention(q, k, v, ak.causal()))


def test_a_tensor_softcap_is_refused_as_eagerly():
    """A cap given as a tensor is refused, as eagerly, not run with a zero gradient."""
    q, k, v = _qkv(8)
    cap = torch.tensor(5.0, requires_grad=True)
    def fn(q, k, v, cap):
        return ak.attention(q, k, v, ak.causal() & ak.softcap(cap))
    with pytest.raises(TypeError, match="cap must be a float"):
        fn(q, k, v, cap)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cap must be a float"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, cap)


def test_a_bias_held_twice_gets_the_sum_of_both_gradients():
    q, k, v = _qkv(9)
    bias = torch.randn(T, T, generator=torch.Generator().manual_seed(10), requires_grad=True)
    def fn(q, k, v):
        return ak.attention(q, k, v, ak.bias(bias) & ak.bias(bias) & ak.causal())
    want, = torch.autograd.grad(fn(q, k, v).square().sum(), bias)
    torch._dynamo.reset()
    got, = torch.autograd.grad(
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v).square().sum(), bias)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("kind", ["documents(causal=)", "causal(sequences=)",
                                  "sliding_window(sequences=)"])
def test_a_band_per_document_evaluated_in_the_graph(kind, fullgraph):
    """A band inside each document evaluated by the compiled code itself (a mask's
    ``to_dense``, as :class:`~attnkit.nn.AdditiveAttention` makes it): the eager values, for
    ids the graph was not traced with too (nothing derived from traced ids is kept)."""
    from attnkit.nn import AdditiveAttention
    make = {"documents(causal=)": lambda ids: ak.documents(ids, causal="bottom_right"),
            "causal(sequences=)": lambda ids: ak.causal(sequences=ak.documents(ids)),
            "sliding_window(sequences=)": lambda ids: ak.sliding_window(
                1, sequences=ak.documents(ids))}[kind]
    gen = torch.Generator().manual_seed(11)
    module = AdditiveAttention(4, 4, 8)
    x = torch.randn(2, 6, 4, generator=gen)

    def fn(x, ids):
        return module(x, x, x, mask=make(ids))[0]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
    for ids in (torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]]),
                torch.tensor([[0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1]])):
        torch.testing.assert_close(compiled(x, ids), fn(x, ids))
    torch._dynamo.reset()
