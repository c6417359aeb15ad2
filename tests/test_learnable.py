"""Training code's tensors: parameters everywhere a tensor goes, tensor subclasses,
activation checkpointing, gradient accumulation, non-contiguous upstream gradients, and
parametrized projections of ``MultiHeadAttention``. Every learnable piece's gradient is
compared with the float64 reference's (``torch.autograd.grad`` on both)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.utils.checkpoint import checkpoint

import attnkit as ak
from attnkit.nn import MultiHeadAttention

B, H, T, D = 2, 4, 6, 8


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pieces(seed: int = 0) -> dict:
    """q, k, v (GQA: two K/V heads) and every learnable piece, as parameters."""
    gen = _gen(seed)

    def param(*shape, scale=1.0):
        return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale)
    return dict(q=param(B, H, T, D), k=param(B, 2, T, D), v=param(B, 2, T, D),
                bias=param(1, H, T, T), slopes=param(H, scale=0.3), table=param(H, 8),
                sinks=param(H))


def _mask(p: dict) -> ak.masks.Mask:
    # padding lengths as a frozen integer parameter: no gradient, read as lengths
    lengths = torch.nn.Parameter(torch.tensor([T, T - 2]), requires_grad=False)
    return (ak.causal() & ak.padding(kv_lengths=lengths) & ak.bias(p["bias"])
            & ak.alibi(p["slopes"]) & ak.relative_bias(p["table"]) & ak.sinks(p["sinks"]))


def _grads(p: dict, backend: str, upstream: torch.Tensor) -> tuple:
    out = ak.attention(p["q"], p["k"], p["v"], _mask(p), backend=backend)
    return out, torch.autograd.grad(out, list(p.values()), upstream, allow_unused=True)


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_every_learnable_piece_gets_the_reference_gradient(backend):
    p = _pieces()
    upstream = torch.randn(B, H, T, D, generator=_gen(1))
    want_out, want = _grads(p, "reference", upstream)
    out, got = _grads(p, backend, upstream)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(p, got, want):
        assert a is not None and a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_backends_that_take_a_piece_as_constant_refuse_naming_it():
    p = _pieces()
    for mask, words in ((ak.alibi(p["slopes"]), "alibi or relative_bias tensors that require "
                         "grad"), (ak.bias(p["bias"]), "a bias that requires grad")):
        with pytest.raises(ValueError, match=words) as error:
            ak.attention(p["q"], p["k"], p["v"], mask, backend="torch")
        assert "tiled and reference give" in str(error.value)


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_non_contiguous_upstream_gradients(layout):
    p = _pieces()
    gen = _gen(2)
    upstream = (torch.randn(B, H, D, T, generator=gen).transpose(-1, -2) if layout == "transposed"
                else torch.randn(1, H, 1, D, generator=gen).expand(B, H, T, D))
    _, want = _grads(p, "reference", upstream.contiguous())
    _, got = _grads(p, "tiled", upstream)
    for name, a, b in zip(p, got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_gradients_accumulate_over_two_backward_calls_and_retain_graph():
    p = _pieces()
    out = ak.attention(p["q"], p["k"], p["v"], _mask(p), backend="tiled")
    out.sum().backward(retain_graph=True)
    first = {name: t.grad.clone() for name, t in p.items()}
    out.sum().backward()
    for name, t in p.items():
        torch.testing.assert_close(t.grad, 2 * first[name], msg=name)


class Logged(torch.Tensor):
    """A ``__torch_function__`` subclass that forwards everything (as logging wrappers do)."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Logged.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("backend", ["tiled", "torch", "auto"])
def test_torch_function_subclasses_for_qkv_and_bias(backend):
    gen = _gen(3)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    bias = torch.randn(B, H, T, T, generator=gen)
    want = ak.attention(q, k, v, ak.causal() & ak.bias(bias), backend="reference")
    leaves = [t.clone().as_subclass(Logged).requires_grad_() for t in (q, k, v)]
    got = ak.attention(*leaves, ak.causal() & ak.bias(bias.as_subclass(Logged)), backend=backend)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.sum(), leaves)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    want_grads = torch.autograd.grad(
        ak.attention(*plain, ak.causal() & ak.bias(bias), backend="reference").sum(), plain)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.as_subclass(torch.Tensor), b, atol=1e-5, rtol=1e-5)


MASKS = {
    "causal": lambda p: ak.causal(),
    "padding": lambda p: ak.padding(kv_lengths=torch.tensor([T, 3])),
    "documents": lambda p: ak.documents(torch.tensor([0, 0, 0, 1, 1, 1])),
    "from_function": lambda p: ak.from_function(lambda b, h, qi, ki: qi >= ki),
    "bias": lambda p: ak.bias(p["bias"]),
    "modifiers": lambda p: (ak.causal() & ak.softcap(3.0) & ak.alibi(p["slopes"])
                            & ak.relative_bias(p["table"]) & ak.sinks(p["sinks"])),
}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("kind", list(MASKS))
def test_checkpoint_gives_the_unchecked_gradients_bit_for_bit(kind, dropout, reentrant):
    """The recompute replays torch's RNG (attnkit's dropout draws from it without a
    generator), so a checkpointed call's gradients are the unchecked call's exactly."""
    def run(checked: bool) -> list:
        p = _pieces()
        torch.manual_seed(11)

        def call(q, k, v):
            return ak.attention(q, k, v, MASKS[kind](p), dropout_p=dropout, backend="tiled")
        out = (checkpoint(call, p["q"], p["k"], p["v"], use_reentrant=reentrant) if checked
               else call(p["q"], p["k"], p["v"]))
        out.sum().backward()
        return [out.detach()] + [t.grad for t in p.values()]
    for a, b in zip(run(False), run(True)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpointed_module_with_dropout_gives_the_unchecked_gradients(dropout):
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, num_kv_heads=2, dropout=dropout).train()
    x0 = torch.randn(2, 6, 16, generator=_gen(4))

    def run(checked):
        module.zero_grad()
        x = x0.clone().requires_grad_()
        torch.manual_seed(5)
        out = (checkpoint(lambda t: module(t, is_causal=True).out, x, use_reentrant=False)
               if checked else module(x, is_causal=True).out)
        out.sum().backward()
        return [out.detach(), x.grad] + [t.grad for t in module.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


class _Counted(torch.nn.Module):
    """An identity parametrization that counts its evaluations."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, weight):
        self.calls += 1
        return weight


@pytest.mark.parametrize("call", ["self", "cross", "unbatched"])
def test_parametrized_projection_weights_are_computed_once_per_forward(call):
    """Reading a parametrized weight computes it (a pass over the weight; spectral norm in
    training steps its power iteration each time): only the projection itself reads it."""
    module = MultiHeadAttention(16, 4)
    counters = []
    for layer in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
        counters.append(_Counted())
        parametrize.register_parametrization(layer, "weight", counters[-1])
    x = torch.randn(2, 5, 16, generator=_gen(5))
    args = {"self": (x,), "cross": (x, x[:, :3].clone()), "unbatched": (x[0],)}[call]
    for counter in counters:  # (registering evaluates a parametrization once)
        counter.calls = 0
    module(*args)
    assert [c.calls for c in counters] == [1, 1, 1, 1]


def test_spectral_norm_projections_step_as_their_layers_do():
    """A spectral-norm projection in training runs one power iteration per forward, as its
    layer called alone does: the module's output and estimates match the layers'."""
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4).train()
    for layer in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
        spectral_norm(layer)
    layers = copy.deepcopy(module)
    x = torch.randn(2, 5, 16, generator=_gen(6))
    for _ in range(2):
        out = module(x).out

        def heads(t):
            return t.unflatten(-1, (4, 4)).transpose(1, 2)
        attended = ak.attention(heads(layers.q_proj(x)), heads(layers.k_proj(x)),
                                heads(layers.v_proj(x)))
        want = layers.out_proj(attended.transpose(1, 2).flatten(-2))
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    for mine, theirs in zip(module.buffers(), layers.buffers()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("norm", ["weight_norm", "symmetric"])
def test_parametrized_and_shared_projections_get_their_gradients(norm):
    class Symmetric(torch.nn.Module):
        def forward(self, weight):
            return (weight + weight.T) / 2

    torch.manual_seed(0)
    first, second = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    for layer in (first.q_proj, first.k_proj, first.v_proj, first.out_proj):
        if norm == "weight_norm":
            weight_norm(layer)
        else:
            parametrize.register_parametrization(layer, "weight", Symmetric())
    second.q_proj = first.q_proj  # shared between the two modules
    x = torch.randn(2, 5, 16, generator=_gen(7))

    def by_hand(module, inputs):
        def heads(t):
            return t.unflatten(-1, (4, 4)).transpose(1, 2)
        attended = ak.attention(heads(module.q_proj(inputs)), heads(module.k_proj(inputs)),
                                heads(module.v_proj(inputs)), ak.causal(), backend="reference")
        return module.out_proj(attended.transpose(1, 2).flatten(-2))
    params = list(first.parameters()) + [t for t in second.parameters()
                                         if all(t is not s for s in first.parameters())]
    got = torch.autograd.grad(second(first(x, is_causal=True).out, is_causal=True).out.sum(),
                              params)
    want = torch.autograd.grad(by_hand(second, by_hand(first, x)).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [torch.nn.Parameter(torch.tensor(5.0)), torch.tensor(5.0)])
def test_softcap_refuses_a_tensor_naming_how_to_learn_a_cap(cap):
    with pytest.raises(TypeError, match=r"not learnable. Pass float\(cap\).*score_function"):
        ak.softcap(cap)


def test_a_learnable_cap_through_score_function_gets_the_reference_gradient():
    gen = _gen(8)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    cap = torch.nn.Parameter(torch.tensor(2.0))

    def capped(s, b, h, q_idx, kv_idx):
        return cap * torch.tanh(s / cap)
    grads = [torch.autograd.grad(ak.attention(q, k, v, ak.causal() & ak.score_function(capped),
                                              backend=backend).sum(), cap)[0]
             for backend in ("reference", "tiled")]
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)
_HOLDER = {"deep": {"deeper": {"deepest": [torch.nn.Parameter(torch.tensor([0.1, -0.2, 0.3, 0.4]))]}}}


def _hidden_bias(s, b, h, q_idx, kv_idx):
    """Reads a parameter deeper than score_function looks (so auto runs reference with grad)."""
    return s + _HOLDER["deep"]["deeper"]["deepest"][0][h] * (q_idx - kv_idx)


@pytest.mark.parametrize("case", ["weights", "hidden"])
def test_reentrant_checkpoint_with_dropout_returns_the_output_its_gradients_belong_to(case):
    """auto's choice with dropout does not follow grad mode: a reentrant checkpoint runs the
    forward with grad off and the recompute with it on, and both must draw one pattern."""
    gen = _gen(9)
    q0, k0, v0 = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))

    def call(q, k, v):
        if case == "weights":
            return ak.attention(q, k, v, ak.causal(), dropout_p=0.3, return_weights=True).out
        return ak.attention(q, k, v, ak.score_function(_hidden_bias), dropout_p=0.3)

    def run(checked):
        leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
        torch.manual_seed(12)
        out = (checkpoint(call, *leaves, use_reentrant=True) if checked else call(*leaves))
        out.sum().backward()
        return [out.detach()] + [t.grad for t in leaves]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_inference_mode_draws_the_dropout_pattern_of_the_other_grad_modes():
    """auto finds the parameters a score_function reads in inference mode too (which records
    no graph even with grad enabled), so it picks one backend, and one pattern, in every mode."""
    gen = _gen(1)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    outs = {}
    for name, mode in (("grad", torch.enable_grad), ("no_grad", torch.no_grad),
                       ("inference_mode", torch.inference_mode)):
        with mode():
            out = ak.attention(q, k, v, ak.score_function(_hidden_bias), dropout_p=0.3,
                               generator=_gen(5))
        outs[name] = out.detach().clone()
    assert torch.equal(outs["no_grad"], outs["grad"])
    assert torch.equal(outs["inference_mode"], outs["grad"])


with torch.inference_mode():
    _INFERENCE_SCALE = torch.full((1, H, 1, 1), 0.5)  # a constant made under inference_mode


def _scaled_by_inference_tensor(s, b, h, q_idx, kv_idx):
    return s * _INFERENCE_SCALE


@pytest.mark.parametrize("mode,dropout", [("grad", 0.0), ("no_grad", 0.3)])
def test_a_score_function_reading_an_inference_tensor_runs_on_auto(mode, dropout):
    """Nothing requires grad: auto's probe for hidden tensors does not raise autograd's
    'Inference tensors cannot be saved for backward' where the call itself runs."""
    gen = _gen(2)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    mask = ak.score_function(_scaled_by_inference_tensor)
    context = torch.no_grad if mode == "no_grad" else torch.enable_grad
    with context():
        want = ak.attention(q, k, v, mask, dropout_p=dropout, generator=_gen(3),
                            backend="reference")
        got = ak.attention(q, k, v, mask, dropout_p=dropout, generator=_gen(3))
    if not dropout:  # (with dropout, backends draw their own patterns)
        torch.testing.assert_close(got, want)


_BESIDE_INFERENCE = {"deep": {"deeper": {"deepest": [torch.nn.Parameter(torch.ones(H))]}}}


def _scaled_plus_hidden(s, b, h, q_idx, kv_idx):
    """An inference tensor times the scores, and a parameter deeper than score_function looks."""
    return s * _INFERENCE_SCALE + _BESIDE_INFERENCE["deep"]["deeper"]["deepest"][0][h] * (q_idx - kv_idx)


def test_a_hidden_parameter_beside_an_inference_tensor_gets_its_gradient():
    """The probe's scores need no grad: the inference tensor's product saves nothing, so the
    probe reaches the parameter, and auto runs a backend that gives it its gradient."""
    param = _BESIDE_INFERENCE["deep"]["deeper"]["deepest"][0]
    gen = _gen(6)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    mask = ak.score_function(_scaled_plus_hidden)
    grads = {}
    for backend in ("reference", "auto"):
        param.grad = None
        out = ak.attention(q, k, v, mask, backend=backend)
        assert out.requires_grad, backend
        out.sum().backward()
        grads[backend] = param.grad.clone()
    torch.testing.assert_close(grads["auto"], grads["reference"])


def test_the_module_dtype_is_read_from_the_first_parameter_torch_lists():
    """The input dtype comes from ``next(module.parameters())`` found without walking every
    module: the same tensor, for plain, parametrized, shared, nested and bias-free modules."""
    from attnkit.nn import _first_parameter

    plain = MultiHeadAttention(16, 2)
    normed = MultiHeadAttention(16, 2)
    weight_norm(normed.q_proj)
    spectral_norm(normed.out_proj)
    shared = MultiHeadAttention(16, 2, bias=False)
    shared.k_proj.weight = shared.q_proj.weight
    nested = torch.nn.Sequential(torch.nn.Sequential(), torch.nn.ReLU(),
                                 torch.nn.Sequential(torch.nn.Identity(), plain))
    empty = torch.nn.Sequential(torch.nn.ReLU())
    for module in (plain, normed, shared, nested, empty, normed.q_proj):
        assert _first_parameter(module) is next(module.parameters(), None)
