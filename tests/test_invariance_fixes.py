"""MultiHeadAttention's projections under the invariance contract: a forward set on a
projection's instance and its hooks run as outside the contract, and row-wise products keep
a row's bits for every input width."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.nn import MultiHeadAttention, _rowwise

F64 = torch.float64


def _rand(*shape, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _mha(*args, seed: int, **kwargs) -> MultiHeadAttention:
    """A float64 MultiHeadAttention whose parameters come from a seeded generator."""
    mha = MultiHeadAttention(*args, dtype=F64, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
    return mha


def test_invariant_projections_run_an_instance_forward_and_hooks_see_the_whole_input():
    """A forward set on a projection's instance (accelerate's device hooks replace it) runs
    under the contract too, per chunk of rows; forward hooks and pre-hooks registered on the
    projections see the call's whole input, as outside the contract; the instance forward
    is the layer's own again afterwards, and a row keeps its bits alone and in a batch."""
    mha = _mha(8, 2, seed=1)
    chunks, seen = [], []
    q_proj = mha.q_proj

    def instance_forward(x):  # what a hook that wraps the forward does: runs, changes things
        chunks.append(tuple(x.shape))
        return torch.nn.Linear.forward(q_proj, x) * 1.5
    q_proj.forward = instance_forward
    mha.k_proj.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))

    def double(module, args, out):
        seen.append(("post", args[0].shape))
        return out * 2
    mha.v_proj.register_forward_hook(double)
    x = _rand(3, 5, 8, seed=2)
    loose = mha(x, is_causal=True).out
    assert chunks == [(3, 5, 8)]
    assert seen == [("pre", (3, 5, 8)), ("post", (3, 5, 8))]
    chunks.clear(), seen.clear()
    with ak.invariant():
        strict = mha(x, is_causal=True).out
        assert chunks and set(chunks) == {(16, 8)}  # products of a fixed number of rows
        assert seen == [("pre", (3, 5, 8)), ("post", (3, 5, 8))]
        alone = mha(x[1:2], is_causal=True).out
    torch.testing.assert_close(strict, loose, rtol=0, atol=1e-12)
    assert torch.equal(alone, strict[1:2])
    assert vars(q_proj)["forward"] is instance_forward
    assert all("forward" not in vars(p) for p in (mha.k_proj, mha.v_proj, mha.out_proj))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_products_keep_a_row_s_bits_for_every_width(dtype):
    """Every input width from 1 to 130: each row of a row-wise product alone gives the bits
    it gets among 20 rows (BLAS rounds a row by its address's alignment, which a row's place
    in a product of rows of an odd width changes)."""
    gen = torch.Generator().manual_seed(3)
    broken = []
    for width in range(1, 131):
        layer = torch.nn.Linear(width, 8, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(8, width, generator=gen, dtype=dtype))
            layer.bias.copy_(torch.randn(8, generator=gen, dtype=dtype))
        x = torch.randn(20, width, generator=gen, dtype=dtype)
        whole = _rowwise(layer, x)
        alone = torch.cat([_rowwise(layer, x[i:i + 1]) for i in range(len(x))])
        if not torch.equal(alone, whole):
            broken.append(width)
    assert broken == []


def test_invariant_mha_with_odd_key_and_value_widths_keeps_a_sequence_s_bits():
    """Cross-attention with key and value widths 17 and 33 (float64): a sequence's output
    rows hold the same bits alone and second of three in a batch."""
    mha = _mha(16, 2, kdim=17, vdim=33, seed=4)
    query, key, value = _rand(3, 5, 16, seed=5), _rand(3, 7, 17, seed=6), _rand(3, 7, 33, seed=7)
    with ak.invariant():
        batch = mha(query, key, value).out
        alone = mha(query[1:2], key[1:2], value[1:2]).out
    assert torch.equal(alone, batch[1:2])


def test_rowwise_gives_gradients_and_takes_strided_and_empty_inputs():
    """The aligned copy keeps autograd (the gradients of ``F.linear``), reads a strided input
    and an input of no rows."""
    gen = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(17, 5, dtype=F64)
    x = torch.randn(6, 17, generator=gen, dtype=F64, requires_grad=True)
    out = _rowwise(layer, x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (want,) = torch.autograd.grad(
        torch.nn.functional.linear(x, layer.weight, layer.bias).square().sum(), x)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
    strided = torch.randn(6, 34, generator=gen, dtype=F64)[:, ::2]
    torch.testing.assert_close(_rowwise(layer, strided), layer(strided), rtol=0, atol=1e-12)
    assert _rowwise(layer, torch.zeros(2, 0, 17, dtype=F64)).shape == (2, 0, 5)


def test_a_compiled_invariant_module_is_one_graph_equal_to_eager():
    """Compiled, the projections take their row-wise products without the patching (which
    dynamo cannot trace): one graph, the eager bits."""
    module = MultiHeadAttention(32, 4, invariant=True, dtype=torch.float32)
    x = _rand(2, 5, 32, dtype=torch.float32)
    want = module(x).out
    torch._dynamo.reset()
    got = torch.compile(module, fullgraph=True, backend="eager")(x).out
    assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["instance forward", "hook over the rows"])
def test_a_compiled_invariant_module_runs_its_projections_as_eagerly(how):
    """A projection that is not a plain Linear (an instance forward, a hook reading every
    row) runs outside the graph, as eagerly: never per chunk of rows inside it."""
    module = MultiHeadAttention(32, 4, invariant=True, dtype=torch.float32)
    layer = module.q_proj
    if how == "instance forward":
        plain = layer.forward
        layer.forward = lambda x: plain(x) * 3
    else:
        layer.register_forward_hook(lambda _, args, out: out - out.mean(dim=-2, keepdim=True))
    x = _rand(2, 5, 32, dtype=torch.float32)
    want = module(x).out
    torch._dynamo.reset()
    assert torch.equal(torch.compile(module, backend="eager")(x).out, want)
