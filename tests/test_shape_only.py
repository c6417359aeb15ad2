"""Calls on meta and fake tensors propagate shapes: every mask kind and score modifier, forward
and backward (meta-device initialisation, dry runs, memory estimators)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention

B, H, T, D = 2, 2, 16, 8


def _masks(device) -> dict:
    lens = torch.tensor([T, T // 2], device=device)
    ids = torch.arange(T, device=device) // 4
    return {
        "none": None,
        "causal": ak.causal(),
        "bottom_right": ak.causal("bottom_right"),
        "window": ak.sliding_window(4),
        "padding": ak.padding(kv_lengths=lens),
        "left padding": ak.padding(kv_starts=T - lens),
        "causal & padding": ak.causal() & ak.padding(q_lengths=lens, kv_lengths=lens),
        "kv_mask": ak.padding(kv_mask=torch.ones(B, T, dtype=torch.bool, device=device)),
        "causal(sequences)": ak.causal(sequences=ak.padding(q_lengths=lens, kv_lengths=lens)),
        "documents": ak.documents(ids),
        "documents(causal)": ak.documents(ids, causal="top_left"),
        "documents & causal": ak.documents(ids) & ak.causal(),
        "window(sequences=documents)": ak.sliding_window(
            2, 1, "bottom_right", sequences=ak.documents(ids, torch.arange(T, device=device) // 5)),
        "dense": ak.dense(torch.ones(T, T, dtype=torch.bool, device=device)),
        "bias": ak.bias(torch.zeros(T, T, device=device)),
        "not | or": ~ak.sliding_window(2) | ak.causal(),
        "from_function": ak.from_function(lambda b, h, q, k: k <= q),
        "softcap": ak.causal() & ak.softcap(20.0),
        "alibi": ak.causal() & ak.alibi(torch.ones(H, device=device)),
        "relative_bias": ak.causal() & ak.relative_bias(torch.zeros(H, 32, device=device)),
        "sinks": ak.causal() & ak.sinks(torch.zeros(H, device=device)),
        "score_function": ak.causal() & ak.score_function(lambda s, b, h, q, k: s * 0.5),
    }


def _run(make_tensor, mask):
    q, k, v = (make_tensor().requires_grad_() for _ in range(3))
    result = ak.attention(q, k, v, mask, return_lse=True)
    (result.out.sum() + result.lse.sum()).backward()
    return result, q.grad


@pytest.mark.parametrize("name", list(_masks("cpu")))
def test_meta_tensors_propagate_shapes(name):
    result, grad = _run(lambda: torch.empty(B, H, T, D, device="meta"), _masks("meta")[name])
    assert result.out.shape == (B, H, T, D) and result.out.device.type == "meta"
    assert result.lse.shape == (B, H, T) and result.lse.dtype == torch.float32
    assert grad.shape == (B, H, T, D)


@pytest.mark.parametrize("name", list(_masks("cpu")))
def test_fake_tensors_propagate_shapes(name):
    with FakeTensorMode():
        result, grad = _run(lambda: torch.empty(B, H, T, D), _masks("cpu")[name])
        assert result.out.shape == (B, H, T, D) and result.lse.shape == (B, H, T)
        assert grad.shape == (B, H, T, D)


def test_explain_dispatch_names_the_backend_a_shape_only_call_runs_on():
    q = torch.empty(B, H, T, D, device="meta")
    assert ak.explain_dispatch(q, q, q, ak.causal()).backend == "reference"
    with FakeTensorMode():
        q = torch.empty(B, H, T, D)
        assert ak.explain_dispatch(q, q, q).backend == "reference"


def test_a_module_decodes_on_meta():
    """Meta-device initialisation and a dry run of prefill and decode with a ragged cache."""
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, device="meta")
    x = torch.empty(3, 5, 32, device="meta")
    out, _, cache = mha(x, cache=KVCache.empty(), is_causal=True,
                        lengths=torch.tensor([5, 2, 4], device="meta"))
    out, _, cache = mha(x[:, :1], cache=cache, is_causal=True)
    assert out.shape == (3, 1, 32) and cache.keys.shape == (3, 2, 6, 8)


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_packed_and_paged_calls_propagate_shapes(where):
    """``varlen_attention`` and ``paged_attention`` with meta or fake tensors: their boundaries
    and tables are real values (read to lay the call out), everything else shapes only."""
    from attnkit.paged import paged_attention

    cu = torch.tensor([0, 5, 12, 16])
    table, seqlens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([7, 3])

    def run(make):
        q, k, v = (make(16, H, D).requires_grad_() for _ in range(3))
        out = ak.varlen_attention(q, k, v, cu, mask=ak.sliding_window(3, align="bottom_right"))
        out.sum().backward()
        assert out.shape == (16, H, D) and q.grad.shape == (16, H, D)
        pool = make(4, 4, 1, D)
        paged = paged_attention(make(2, H, 1, D), pool, pool, table, seqlens,
                                mask=ak.causal("bottom_right"))
        assert paged.shape == (2, H, 1, D)

    if where == "meta":
        run(lambda *shape: torch.empty(*shape, device="meta"))
    else:
        with FakeTensorMode():
            run(torch.empty)


def test_a_fake_call_leaves_no_fake_tensor_for_real_calls():
    """The non-finite flags' zero column, kept per size for real calls, is made anew for a
    fake ``x``: a real call after a fake one of the same head size gets a real tensor."""
    from attnkit import finite

    with FakeTensorMode():
        fake = finite._zeros(torch.randn(3, 53))
    real = finite._zeros(torch.randn(2, 53))
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor)
    assert torch.equal(real, torch.zeros(53, 1))


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_meta_dropout_with_a_cpu_generator_draws_nothing(backend):
    """Shapes only with dropout and a CPU generator: no draws on the CPU (no ``[B, H, Tq, Tk]``
    tensor made there), and the generator's stream is the next real call's."""
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    q = torch.empty(2, 4, 64, 16, device="meta")
    out = ak.attention(q, q, q, dropout_p=0.25, generator=generator, backend=backend)
    assert out.device.type == "meta" and out.shape == q.shape
    assert torch.equal(generator.get_state(), state)
