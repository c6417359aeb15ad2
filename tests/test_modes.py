"""attnkit under the modes users wrap around training and inference code: selective activation
checkpointing (its caching dispatch modes), ``FakeTensorMode`` shape propagation,
``FlopCounterMode``, and a default-device context.

What they need: every call runs the same operations whether or not it was seen before (a
checkpoint's recompute meets its forward's), nothing computed under a mode is kept for later
calls, and the operations attnkit writes in place are its own tensors.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnkit as ak

# torch.utils.checkpoint and torch.utils.flop_counter import triton: imported in the tests, so
# that collecting this module leaves triton to be imported in interpreter mode (conftest).


def _saving(*ops):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


def _block(x, qkv, mask, backend):
    """A fused-QKV attention block: q, k, v are transposed views ``[B, H, T, D]``."""
    q, k, v = qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
    out = ak.attention(q, k, v, mask, backend=backend)
    return out / out.abs().max()


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
@pytest.mark.parametrize("saved", ["mm", "max"])
def test_selective_checkpointing_keeps_the_gradients(saved, backend, gen):
    """Policies that save matrix products (``aten.mm``) or maxima (``aten.max``, as training
    frameworks do) around attention: the gradients equal those without checkpointing, also on
    a mask's first call (its validation runs operations a later call does not)."""
    from torch.utils.checkpoint import checkpoint
    ops = {"mm": (torch.ops.aten.mm.default, torch.ops.aten.addmm.default),
           "max": (torch.ops.aten.max.default,)}[saved]
    torch.manual_seed(0)
    qkv = torch.nn.Linear(16, 48)
    x = torch.randn(2, 12, 16, generator=gen)

    def grads(checkpointed: bool):
        mask = ak.causal() & ak.padding(kv_lengths=torch.tensor([12, 7]))  # new for each run
        inputs = x.clone().requires_grad_()
        if checkpointed:
            out = checkpoint(_block, inputs, qkv, mask, backend, use_reentrant=False,
                             context_fn=_saving(*ops))
        else:
            out = _block(inputs, qkv, mask, backend)
        return torch.autograd.grad(out.square().sum(), (inputs, *qkv.parameters()))

    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mask", [ak.sliding_window(8), ak.causal() & ak.softcap(5.0)],
                         ids=["window", "softcap"])
def test_a_mask_used_under_fake_tensors_still_runs_for_real(mask, gen):
    """A dry run under ``FakeTensorMode`` keeps nothing on the mask or in the call cache:
    the same mask object then runs for real, and again under another fake mode."""
    with FakeTensorMode():
        fake = torch.empty(2, 2, 64, 16)
        assert ak.attention(fake, fake, fake, mask).shape == (2, 2, 64, 16)
    q, k, v = torch.randn(3, 2, 2, 64, 16, generator=gen).unbind(0)
    torch.testing.assert_close(ak.attention(q, k, v, mask),
                               ak.attention(q, k, v, mask, backend="reference"))
    with FakeTensorMode():
        fake = torch.empty(2, 2, 64, 16)
        assert ak.attention(fake, fake, fake, mask).shape == (2, 2, 64, 16)


@pytest.mark.parametrize("lengths", ["tensor", "list"])
def test_padding_propagates_shapes_under_a_fake_mode_with_real_inputs(lengths):
    """``FakeTensorMode(allow_non_fake_inputs=True)`` (memory estimators run a real model in
    it): the padding's real lengths meet fake results, so their values are not read."""
    kv_lengths = torch.tensor([64, 40]) if lengths == "tensor" else [64, 40]
    mask = ak.causal() & ak.padding(kv_lengths=kv_lengths)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 2, 64, 16)
        assert ak.attention(q, q, q, mask).shape == (2, 2, 64, 16)


def test_a_default_device_context_leaves_the_inputs_device(gen):
    """Inside ``with torch.device("meta")`` (or ``set_default_device``), calls on CPU tensors,
    with masks built there from lists, make their own tensors on the inputs' device."""
    q, k, v = torch.randn(3, 2, 2, 16, 8, generator=gen).unbind(0)
    with torch.device("meta"):
        mask = ak.causal() & ak.padding(kv_lengths=[16, 9])
        got = {backend: ak.attention(q, k, v, mask, backend=backend)
               for backend in ("torch", "tiled", "reference")}
        window = ak.attention(q, k, v, ak.sliding_window(4), backend="tiled")
    for backend, out in got.items():
        torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"),
                                   msg=backend)
    torch.testing.assert_close(window, ak.attention(q, k, v, ak.sliding_window(4),
                                                   backend="reference"))


def test_flop_counter_counts_the_exported_operator(gen):
    """A structured mask runs as the ``attnkit::attention`` operator in an exported program;
    the flop counter counts it as torch counts SDPA (the dense product, forward and
    backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return ak.attention(q, k, v, ak.causal() & ak.softcap(20.0))

    q, k, v = torch.randn(3, 1, 2, 32, 8, generator=gen).unbind(0)
    program = torch.export.export(Attend(), (q, k, v)).module()
    counter = FlopCounterMode(display=False)
    with counter:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        program(*leaves).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.attnkit.attention] == 4 * 2 * 32 * 32 * 8
    assert counts[torch.ops.attnkit.attention_backward] == 10 * 2 * 32 * 32 * 8


def test_a_transformers_model_propagates_shapes_under_fake_tensors():
    """A tiny Llama on attnkit's attention, run under ``FakeTensorMode`` without an
    attention mask (a dry run of memory or shapes): position ids hold no values there, so
    the mask is not read from them."""
    transformers = pytest.importorskip("transformers")
    from attnkit.integrations.transformers import register
    register()
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=50)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.randint(3, 50, (2, 10))
        logits = model(input_ids=ids, use_cache=False).logits
        logits.sum().backward()
    assert logits.shape == (2, 10, 50)


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("make_mask", [
    lambda: ak.documents(torch.tensor([0] * 6 + [1] * 10), causal="top_left"),
    lambda: ak.causal(),
], ids=["causal_documents", "causal"])
def test_selective_checkpointing_that_saves_where(make_mask, backend, gen):
    """A policy saving ``aten.where`` around a mask's first use (a new mask per batch) and a
    process's first staircase tile: what attnkit keeps between calls (document runs, tile
    masks) is made afresh under the checkpoint, so the recompute runs the forward's ops."""
    from torch.utils.checkpoint import checkpoint
    from attnkit.backends.tiled import tiles
    tiles._staircase_additive.cache_clear()
    q, k, v = torch.randn(3, 1, 4, 16, 8, generator=gen).unbind(0)
    k, v = k[:, :2], v[:, :2]  # GQA: the staircase tiles stack two query heads

    def fn(q, mask):
        out = ak.attention(q, k, v, mask, backend=backend)
        return torch.where(out > 0, out, 0.5 * out)

    leaf = q.clone().requires_grad_()
    out = checkpoint(fn, leaf, make_mask(), use_reentrant=False,
                     context_fn=_saving(torch.ops.aten.where.self))
    (got,) = torch.autograd.grad(out.sum(), leaf)
    leaf = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(fn(leaf, make_mask()).sum(), leaf)
    assert torch.equal(got, want)


def test_a_fake_run_on_real_inputs_leaves_real_calls_real(gen):
    """Real q, k, v in ``FakeTensorMode(allow_non_fake_inputs=True)`` make fake results; no
    constant made there (the non-finite flags' zero column) reaches a later real call."""
    q, k, v = torch.randn(3, 1, 2, 8, 4, generator=gen).unbind(0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ak.attention(q.requires_grad_(), k, v)
    out = ak.attention(q, k, v)
    out.sum().backward()
    assert type(out) is torch.Tensor and type(q.grad) is torch.Tensor
    torch.testing.assert_close(out, ak.attention(q, k, v, backend="reference"))


def test_selective_checkpointing_that_saves_new_zeros_under_the_contract(gen):
    """The invariant schedule widens its last key block with zero rows: made out of place
    under a checkpoint, so a policy saving ``aten.new_zeros`` holds nothing it writes."""
    from torch.utils.checkpoint import checkpoint
    q, k, v = torch.randn(3, 1, 2, 300, 16, generator=gen).unbind(0)

    def fn(q):
        return ak.attention(q, k, v, ak.causal(), backend="tiled", invariant=True)

    leaf = q.clone().requires_grad_()
    out = checkpoint(fn, leaf, use_reentrant=False,
                     context_fn=_saving(torch.ops.aten.new_zeros.default,
                                        torch.ops.aten.zeros.default))
    (got,) = torch.autograd.grad(out.square().sum(), leaf)
    leaf = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(fn(leaf).square().sum(), leaf)
    assert torch.equal(got, want)
