"""Capture paths beside ``torch.compile``: ``torch.export`` (strict and not, static and
dynamic dims, lowered to core ATen), ``make_fx`` with symbolic sizes, and ``torch.jit.trace``,
which attnkit refuses (a trace fixes its shape-dependent decisions).

Each exported program is run on new inputs, at other lengths where its dims are dynamic, and
compared with the eager call.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.export import Dim, export

import attnkit as ak


class _Attend(torch.nn.Module):
    def __init__(self, make_mask):
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q, k, v):
        return ak.attention(q, k, v, self.make_mask(q.shape[-2]))


def _qkv(seq: int, *lead, gen=None, dim: int = 4):
    return tuple(torch.randn(*lead, seq, dim, generator=gen) for _ in range(3))


@pytest.mark.parametrize("lead", [(2, 2), (2,)], ids=["4d", "3d"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_an_exported_call_lowers_to_core_aten(mask, lead, gen):
    """``run_decompositions()`` (the lowering ExecuTorch and other back ends take) keeps the
    program runnable: the non-finite flags read the kernel's output in any layout."""
    module = _Attend(lambda t: None if mask == "none" else ak.causal())
    lowered = export(module, _qkv(8, *lead, gen=gen)).run_decompositions()
    args = _qkv(8, *lead, gen=gen)
    torch.testing.assert_close(lowered.module()(*args), module(*args))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_a_program_exported_without_gradients_is_differentiable(mask, gen):
    """Exported from inputs that need no gradient, run on inputs that do: the graph holds no
    in-place write to a tensor autograd saves."""
    module = _Attend(lambda t: None if mask == "none" else ak.causal())
    program = export(module, _qkv(8, 2, 2, gen=gen)).module()
    args = [t.requires_grad_() for t in _qkv(8, 2, 2, gen=gen)]
    got = torch.autograd.grad(program(*args).square().sum(), args)
    want = torch.autograd.grad(module(*args).square().sum(), args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_dynamic_length_export_covers_short_and_long_sequences(gen):
    """One program for every length: no size-dependent choice bounds the dim (the keys' flag
    is always taken when traced)."""
    module = _Attend(lambda t: ak.causal())
    program = export(module, _qkv(8, 1, 2, gen=gen), dynamic_shapes=({2: Dim.AUTO},) * 3)
    for seq in (8, 100):
        args = _qkv(seq, 1, 2, gen=gen)
        torch.testing.assert_close(program.module()(*args), module(*args))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("make_mask", [
    lambda t: ak.sliding_window(t // 2),
    lambda t: ak.from_function(lambda b, h, i, j: (i - j).abs() <= 2),
], ids=["window_of_the_length", "from_function"])
def test_masks_of_a_dynamic_length_export(make_mask, strict, gen):
    """A window computed from the traced length (a symbolic int) and a mask function's
    index vectors stay symbolic: the program runs at another length."""
    module = _Attend(make_mask)
    seq = Dim("seq", min=2, max=60)
    program = export(module, _qkv(8, 2, 2, gen=gen), dynamic_shapes=({2: seq},) * 3,
                     strict=strict).module()
    args = _qkv(11, 2, 2, gen=gen)
    torch.testing.assert_close(program(*args), module(*args))


def test_a_ragged_cache_built_in_the_graph_keeps_a_dynamic_length(gen):
    """A ``KVCache`` with per-sequence ``lengths`` made from the traced tensors: its length
    stays symbolic (strict export over a dynamic cache length), one graph for every length."""
    mha = ak.nn.MultiHeadAttention(16, 4, num_kv_heads=2).eval()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x, keys, values, lengths):
            cache = ak.nn.KVCache(keys=keys, values=values, length=keys.shape[2], lengths=lengths)
            return self.mha(x, is_causal=True, cache=cache, lengths=torch.ones_like(lengths)).out

    def args(tokens):
        return (torch.randn(3, 1, 16, generator=gen), torch.randn(3, 2, tokens, 4, generator=gen),
                torch.randn(3, 2, tokens, 4, generator=gen), torch.tensor([tokens, 3, 5]))

    tokens = Dim("tokens", min=6, max=40)
    program = export(Step(), args(6), dynamic_shapes=(None, {2: tokens}, {2: tokens}, None),
                     strict=True).module()
    with torch.no_grad():
        for length in (6, 9):
            inputs = args(length)
            torch.testing.assert_close(program(*inputs), Step()(*inputs))


@pytest.mark.parametrize("mask", [None, ak.causal(), ak.sliding_window(2)],
                         ids=["none", "causal", "window"])
def test_make_fx_with_symbolic_sizes(mask, gen):
    """``make_fx(tracing_mode="symbolic")``: a mask's kept values are keyed by sizes, which
    are symbolic there: computed, not kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(q, k, v):
        return ak.attention(q, k, v, mask)

    graph = make_fx(fn, tracing_mode="symbolic")(*_qkv(8, 1, 2, gen=gen))
    args = _qkv(12, 1, 2, gen=gen)
    torch.testing.assert_close(graph(*args), fn(*args))


def test_jit_trace_is_refused_by_name(gen):
    """``torch.jit.trace`` would record attnkit's shape-dependent decisions as constants (a
    bottom-right band traced at one length is wrong at another): every entry point refuses
    it and names the capture paths that work."""
    with pytest.raises(RuntimeError, match="torch.jit.trace.*torch.compile or torch.export"):
        torch.jit.trace(_Attend(lambda t: ak.causal("bottom_right")), _qkv(8, 1, 2, gen=gen))
    mha = ak.nn.MultiHeadAttention(16, 4)
    with pytest.raises(RuntimeError, match="MultiHeadAttention cannot be recorded"):
        torch.jit.trace(mha, torch.randn(1, 4, 16, generator=gen))
    plan = ak.plan(*_qkv(8, 1, 2, gen=gen), ak.causal())
    with pytest.raises(RuntimeError, match="plan cannot be recorded"):
        torch.jit.trace(lambda q, k, v: plan(q, k, v), _qkv(8, 1, 2, gen=gen))


def test_a_program_exported_without_gradients_gives_a_bias_its_gradient(gen):
    """The operator's gradient flags are traced; a bias that trains only when the program
    runs still gets its gradient."""
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, bias):
            return ak.attention(q, k, v, ak.bias(bias) & ak.sliding_window(3))

    q, k, v = _qkv(8, 2, 2, gen=gen)
    bias = torch.randn(1, 2, 8, 8, generator=gen)
    program = export(Attend(), (q, k, v, bias)).module()
    args = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    got = torch.autograd.grad(program(*args).square().sum(), args, allow_unused=True)
    want = torch.autograd.grad(Attend()(*args).square().sum(), args)
    assert got[3] is not None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _Additive(torch.nn.Module):
    """:class:`~attnkit.nn.AdditiveAttention`, which evaluates its mask in the graph, over
    a band inside each document."""

    def __init__(self):
        super().__init__()
        from attnkit.nn import AdditiveAttention
        self.attend = AdditiveAttention(4, 4, 8)

    def forward(self, x, ids):
        return self.attend(x, x, x, mask=ak.documents(ids, causal="top_left"))[0]


@pytest.mark.parametrize("capture", ["export strict", "export", "make_fx"])
def test_a_band_per_document_evaluated_in_a_captured_graph(capture, gen):
    """Captured with fake ids, the band inside each document is traced as computed from the
    ids (not shapes alone): the program equals the eager module on other ids."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _Additive()
    x = torch.randn(2, 6, 4, generator=gen)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])
    if capture == "make_fx":
        params = dict(module.named_parameters())
        traced = make_fx(lambda p, x, ids: torch.func.functional_call(module, p, (x, ids)),
                         tracing_mode="symbolic")(params, x, ids)
        program = lambda x, ids: traced(params, x, ids)  # noqa: E731
    else:
        torch._dynamo.reset()
        program = export(module, (x, ids), strict=capture == "export strict").module()
    for other in (ids, torch.tensor([[0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1]])):
        torch.testing.assert_close(program(x, other), module(x, other))
