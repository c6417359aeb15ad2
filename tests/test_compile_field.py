"""``torch.compile`` as models use it: the non-finite contract of a compiled backward, a
training step of a small model on ``MultiHeadAttention`` with masks and learnable score
modifiers, a decoding loop over a ``KVCache`` with per-sequence ``lengths``, and masks whose
tensors change between calls. Each compiled result equals eager attnkit's, and no call after
the first compiles a new graph for new values.

Compiled with ``backend="aot_eager"`` (dynamo and AOT autograd, without inductor's code
generation time); graphs are counted by ``torch._dynamo.utils.counters``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _out_and_grads(fn, *tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out.sum(), leaves)]


@pytest.mark.parametrize("mask", [None, "causal"])
def test_compiled_reference_sends_nan_gradients_into_non_finite_keys_and_values(mask):
    """docs/NUMERICS.md: a gradient reaching a row that sees a non-finite key or value goes
    back as NaN, into that key and value rows too. The reference's math traced into a graph
    (no mask, causal) keeps it: its zeroing of the non-finite rows passes their gradient
    through, as eagerly."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    k[0, 0, 3, 1] = float("nan")
    v[0, 1, 5, 0] = float("inf")

    def fn(q, k, v):
        return ak.attention(q, k, v, None if mask is None else ak.causal(), backend="reference")

    want = _out_and_grads(fn, q, k, v)
    got = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v)
    assert want[2][0, 0, 3].isnan().all() and want[3][0, 1, 5].isnan().all()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m: f"{name}: {m}")


def test_compiled_backward_gives_zero_gradients_where_the_guard_zeroed():
    """Garbage in padded queries and outside a sequence's real keys never reaches a
    gradient (docs/NUMERICS.md), also when a real key or query holds NaN/inf: the compiled
    backward gives 0 there, as autograd through eager attention's zeroing does, not what the
    backend computed from the zeroed stand-ins (NaN from ``0 · inf``)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=gen) for _ in range(3))
    lengths = torch.tensor([6, 10])
    k[0, 1, 2, 0] = float("nan")  # inside sequence 0's real keys
    q[1, 0, 9, 3] = float("inf")  # a real query of sequence 1
    q[0, :, 8] = float("nan")  # sequence 0's padded queries
    k[0, :, 7], v[0, :, 9] = float("inf"), float("nan")  # outside its real keys

    def fn(q, k, v):
        return ak.attention(q, k, v, ak.causal() & ak.padding(q_lengths=lengths,
                                                              kv_lengths=lengths))

    want = _out_and_grads(fn, q, k, v)
    got = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v)
    for grad in want[1:]:  # 0 past sequence 0's length, eagerly
        assert (grad[0, :, 6:] == 0).all()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m: f"{name}: {m}")


E, HEADS = 16, 2


class _Model(nn.Module):
    """``MultiHeadAttention`` and a feed-forward layer; the mask holds learnable modifiers."""

    def __init__(self, kind: str):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.kind = kind
        self.attn = MultiHeadAttention(E, HEADS)
        with torch.no_grad():
            for p in self.attn.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.ff = nn.Linear(E, E)
        self.slopes = nn.Parameter(torch.tensor([0.5, 0.25]))
        self.sinks = nn.Parameter(torch.tensor([0.1, -0.2]))
        self.table = nn.Parameter(torch.randn(HEADS, 32, generator=gen) * 0.1)

    def forward(self, x, lengths, ids):
        if self.kind == "padding&alibi&sinks":
            mask = (ak.causal() & ak.padding(q_lengths=lengths, kv_lengths=lengths)
                    & ak.alibi(self.slopes) & ak.sinks(self.sinks))
        else:
            mask = ak.documents(ids, causal="top_left") & ak.relative_bias(self.table) & \
                ak.softcap(5.0)
        return self.ff(self.attn(x, mask=mask).out)


@pytest.mark.parametrize("kind", ["padding&alibi&sinks", "documents&relative_bias&softcap"])
def test_a_training_step_compiles_once_and_equals_eager(kind):
    """Forward and loss compiled whole (``fullgraph=True``), backward and SGD around it: new
    lengths or document ids every step compile nothing new, and the parameters after each
    step, the modifiers' included, equal eager training's."""
    eager_model = _Model(kind)
    model = copy.deepcopy(eager_model)

    def loss_of(model):
        def loss(x, lengths, ids):
            return (model(x, lengths, ids) ** 2).mean()
        return loss

    compiled = torch.compile(loss_of(model), backend="aot_eager", fullgraph=True)
    eager = loss_of(eager_model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager_model)]
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(2, 9, E, generator=gen)
        lengths = torch.randint(1, 10, (2,), generator=gen)
        ids = torch.randint(0, 3, (2, 9), generator=gen).sort(-1).values
        before = _graphs()
        for loss, opt in zip((compiled(x, lengths, ids), eager(x, lengths, ids)), optimizers):
            opt.zero_grad()
            loss.backward()
            opt.step()
        if step:
            assert _graphs() == before, f"step {step} compiled a new graph"
        for (name, got), want in zip(model.named_parameters(), eager_model.parameters()):
            torch.testing.assert_close(got, want, msg=lambda m: f"step {step} {name}: {m}")


def test_decoding_with_lengths_stays_compiled_and_equals_eager():
    """A decoding loop over a ``KVCache`` whose sequences advance by different counts each
    step (``lengths`` of 0 or 1), compiled with ``dynamic=True``: after the prefill and the
    first decoding steps no step compiles a new graph, and each equals the eager step."""
    module = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def step(x, cache, lengths):
        out, _, cache = module(x, cache=cache, lengths=lengths, is_causal=True,
                               mask=ak.alibi(slopes, align="bottom_right"))
        return out, cache

    compiled = torch.compile(step, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(4)
    cache, eager_cache = KVCache.empty(capacity=40), KVCache.empty(capacity=40)
    with torch.no_grad():
        for i in range(30):
            x = torch.randn(3, 6 if i == 0 else 1, 32, generator=gen)
            lengths = torch.tensor([6, 4, 5]) if i == 0 else torch.randint(0, 2, (3,),
                                                                          generator=gen)
            before = _graphs()
            out, cache = compiled(x, cache, lengths)
            want, eager_cache = step(x, eager_cache, lengths)
            torch.testing.assert_close(out, want, msg=lambda m: f"step {i}: {m}")
            assert torch.equal(cache.lengths, eager_cache.lengths)
            if i >= 3:
                assert _graphs() == before, f"step {i} compiled a new graph"


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("how", ["new", "in_place"])
def test_mask_tensors_that_change_between_calls_are_read_fresh(context, how):
    """Lengths and document ids that change every call, as new tensors or written in place,
    under ``no_grad`` or ``inference_mode``: one graph, and every call computes with the
    values it was given (nothing kept from an earlier call)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=gen) for _ in range(3))

    def fn(q, k, v, lengths, ids):
        return ak.attention(q, k, v, ak.causal() & ak.padding(kv_lengths=lengths)
                            & ak.documents(ids))

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with context():
        lengths, ids = torch.full((2,), 12), torch.zeros(2, 12, dtype=torch.long)
        for call in range(5):
            new_lengths = torch.randint(1, 13, (2,), generator=gen)
            new_ids = torch.randint(0, 4, (2, 12), generator=gen).sort(-1).values
            if how == "new":
                lengths, ids = new_lengths, new_ids
            else:
                lengths.copy_(new_lengths)
                ids.copy_(new_ids)
            got = compiled(q, k, v, lengths, ids)
            torch.testing.assert_close(got, fn(q, k, v, new_lengths, new_ids),
                                       msg=lambda m: f"call {call}: {m}")
    assert _graphs() == 1


def test_a_mask_made_outside_a_checkpointed_region_compiles_whole():
    """Activation checkpointing inside a ``fullgraph=True`` compile, with a mask object built
    once outside (a bare ``causal()``, which holds no tensor): tracing must not write into
    the mask (a side effect the checkpoint's region refuses)."""
    gen = torch.Generator().manual_seed(4)
    mha = MultiHeadAttention(32, 4)
    x = torch.randn(2, 6, 32, generator=gen)
    mask = ak.causal()

    def fn(x):
        return torch.utils.checkpoint.checkpoint(lambda x: mha(x, mask=mask).out, x,
                                                 use_reentrant=False)

    want = _out_and_grads(fn, x)
    got = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dynamic", [True, None])
def test_masks_from_python_lists_compile_for_new_values(dynamic):
    """Lengths and document ids given as Python lists (a data loader's) are graph inputs,
    not constants: new values of the same length reuse the graph (``dynamic=None``: after
    the one recompile that marks the changed ints dynamic), and read fresh. (Every id
    changes here, and none is 0 or 1: dynamo keeps those two values constant.)"""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen) for _ in range(3))

    def fn(q, k, v, lengths, ids):
        return ak.attention(q, k, v, ak.padding(kv_lengths=lengths) & ak.documents(ids))

    compiled = torch.compile(fn, backend="aot_eager", dynamic=dynamic)
    for step in range(5):
        lengths = [3 + step, 8 - step]
        ids = [5 + step] * (2 + step % 3) + [9 + step] * (6 - step % 3)
        torch.testing.assert_close(compiled(q, k, v, lengths, ids), fn(q, k, v, lengths, ids))
    assert _graphs() <= (1 if dynamic else 2)
