"""The compiled operator (:mod:`attnkit.compiled`): the backend it picks for a bias that
trains, the checks of a softcap's cap whose value the trace does not hold, and a decoding
step with a ``KVCache`` compiled with dynamic shapes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (assert_within_2x, import_triton_interpreted, interpreted_triton_launch,
                      naive_attention, plain_attention)

import_triton_interpreted()  # before dynamo and attnkit: the triton cases run interpreted

import torch._dynamo  # noqa: E402

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.nn import KVCache, MultiHeadAttention  # noqa: E402

B, H, T, D = 2, 2, 40, 16


def _leaves(seed: int):
    """``q, k, v [B, H, T, D]`` and a bias ``[1, H, T, T]``, all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, H, T, T, generator=gen, requires_grad=True)
    return q, k, v, bias


def _out_and_grads(fn, leaves):
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out.sum(), leaves)


def test_a_trainable_bias_under_compile_runs_on_a_backend_that_gives_its_gradient(monkeypatch):
    """Where ``auto`` picks triton (a CUDA device; here its CPU interpreter, allowed for auto),
    eager attention passes over it for a bias that requires grad; the compiled call, whose
    operator sees no tensor requiring grad, must too: its gradients, the bias's included,
    equal eager attention's and keep the 2x rule against the float64 reference."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch.BACKENDS["triton"], "auto_reasons", lambda inputs: [])
    leaves = _leaves(0)
    q, k, v, bias = leaves

    def fn(q, k, v, bias):
        return ak.attention(q, k, v, ak.bias(bias) & ak.causal())

    torch._dynamo.reset()
    got, got_grads = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True),
                                    leaves)
    want, want_grads = _out_and_grads(fn, leaves)
    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad)

    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    wide = [t.detach().double().requires_grad_() for t in leaves]
    truth, truth_grads = _out_and_grads(
        lambda q, k, v, b: naive_attention(q, k, v, allowed, b)[0], wide)
    narrow = [t.detach().clone().requires_grad_() for t in leaves]
    plain, plain_grads = _out_and_grads(
        lambda q, k, v, b: plain_attention(q, k, v, allowed, b)[0], narrow)
    assert_within_2x("out", got, truth, plain, torch.float32)
    for name, got_grad, truth_grad, plain_grad in zip(("dq", "dk", "dv", "dbias"), got_grads,
                                                      truth_grads, plain_grads):
        assert_within_2x(name, got_grad, truth_grad, plain_grad, torch.float32)


def test_a_trainable_bias_on_triton_under_compile_is_refused_as_eagerly(monkeypatch):
    """An explicit ``backend='triton'`` (no bias gradient) with a bias that requires grad
    raises eager attention's ValueError in the compiled forward, not a RuntimeError in the
    backward."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, bias = _leaves(1)

    def fn(q, k, v):
        return ak.attention(q, k, v, ak.bias(bias) & ak.sliding_window(9), backend="triton")

    with pytest.raises(ValueError, match="a bias that requires grad") as eager:
        fn(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="a bias that requires grad") as compiled:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert str(compiled.value).split("\nInputs:")[0] == str(eager.value).split("\nInputs:")[0]


BAD_CAPS = [-1.0, 0.0, math.nan, math.inf, 1e-40]


@pytest.mark.parametrize("dynamic", [False, True], ids=["specialised", "symbolic"])
def test_a_compiled_softcap_refuses_the_caps_eager_refuses(dynamic):
    """A cap handed to a compiled function as a Python float (a constant, or a symbolic float
    with ``dynamic=True``) skips the checks while traced; the operator checks it where its
    value is known and raises eager's ValueError, message and all."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 24, 8, generator=gen) for _ in range(3))

    def fn(q, k, v, cap):
        return ak.attention(q, k, v, ak.causal() & ak.softcap(cap))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(compiled(q, k, v, 5.0), fn(q, k, v, 5.0))
    for cap in BAD_CAPS:
        with pytest.raises(ValueError) as eager:
            fn(q, k, v, cap)
        with pytest.raises(ValueError) as traced:
            compiled(q, k, v, cap)
        assert str(traced.value) == str(eager.value), cap


def test_decoding_steps_with_a_cache_compile_once_with_dynamic_shapes():
    """A compiled decoding step that takes and returns a ``KVCache`` with room for the steps
    (``capacity``), compiled with ``dynamic=True``: after the first decoding step no step
    compiles a new graph, and each equals the eager step."""
    gen = torch.Generator().manual_seed(3)
    module = MultiHeadAttention(32, 4).eval()

    def step(x, cache):
        out, _, cache = module(x, is_causal=True, cache=cache)
        return out, cache

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", dynamic=True)
    graphs = torch._dynamo.utils.counters["stats"]
    cache, eager_cache = KVCache.empty(capacity=32), KVCache.empty(capacity=32)
    with torch.no_grad():
        for i, width in enumerate([5, 1, 1, 1, 1, 1, 1, 1]):
            x = torch.randn(2, width, 32, generator=gen)
            before = graphs["unique_graphs"]
            out, cache = compiled(x, cache)
            want, eager_cache = step(x, eager_cache)
            torch.testing.assert_close(out, want)
            if i >= 2:  # the prefill and the first decoding step compile
                assert graphs["unique_graphs"] == before, f"step {i} recompiled"
