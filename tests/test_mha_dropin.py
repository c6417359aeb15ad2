"""MultiHeadAttention.from_torch as a drop-in for torch.nn.MultiheadAttention: a differential
sweep against torch's own module (constructor options, masks in torch's conventions and their
attnkit spelling, is_causal, unbatched input, gradients, dropout, dtypes, state_dict) and the
errors for what is spelled otherwise or refused."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.nn import MultiHeadAttention, _unexpected

F64, F32 = torch.float64, torch.float32
B, TQ, TK, E, H = 3, 4, 6, 8, 2


def _rand(*shape, dtype=F64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _torch_mha(*, seed=0, dtype=F64, **options) -> torch.nn.MultiheadAttention:
    """torch's module in eval mode, every parameter (biases too) drawn from ``seed``."""
    module = torch.nn.MultiheadAttention(E, H, dtype=dtype, **options)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=F64))
    return module.eval()


def _close(actual, expected):
    """float64: within 1e-12; float32: within 1e-5 of the largest |expected|."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype == F64:
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    else:
        err = (actual - expected).abs().max() / expected.abs().max()
        assert err <= 1e-5, f"relative error {err.item():.3g}"


def _masks(dtype):
    """torch's masks for [B, TQ, TK] with H heads, each with its attnkit spelling."""
    gen = torch.Generator().manual_seed(5)
    banned = torch.rand(TQ, TK, generator=gen) < 0.4  # torch: True = NOT allowed
    banned[:, 0] = False
    banned3 = torch.rand(B * H, TQ, TK, generator=gen) < 0.4
    banned3[..., 1] = False
    bias, bias3 = _rand(TQ, TK, dtype=dtype, seed=6), _rand(B * H, TQ, TK, dtype=dtype, seed=7)
    pad = torch.tensor([[False] * TK, [False] * 4 + [True] * 2, [True] + [False] * 5])
    pad_bias = _rand(B, TK, dtype=dtype, seed=8)
    return {
        "none": ({}, {}),
        "bool 2-D": ({"attn_mask": banned}, {"mask": ~banned}),
        "bool 3-D": ({"attn_mask": banned3}, {"mask": ~banned3.view(B, H, TQ, TK)}),
        "float 2-D": ({"attn_mask": bias}, {"mask": bias}),
        "float 3-D": ({"attn_mask": bias3}, {"mask": bias3.view(B, H, TQ, TK)}),
        "padding bool": ({"key_padding_mask": pad}, {"key_valid": ~pad}),
        "padding float": ({"key_padding_mask": pad_bias}, {"mask": pad_bias[:, None, None]}),
        "padding bool, bool 2-D": ({"key_padding_mask": pad, "attn_mask": banned},
                                   {"key_valid": ~pad, "mask": ~banned}),
        "padding float, float 3-D": ({"key_padding_mask": pad_bias, "attn_mask": bias3},
                                     {"mask": bias3.view(B, H, TQ, TK) + pad_bias[:, None, None]}),
    }


# ---- outputs and weights ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", list(_masks(F64)))
@pytest.mark.parametrize("weights", ["none", "averaged", "per head"])
def test_cross_attention_with_torch_masks_matches_torch(dtype, case, weights):
    src = _torch_mha(kdim=5, vdim=7, batch_first=True, dtype=dtype, seed=1)
    mha = MultiHeadAttention.from_torch(src)
    q, k, v = (_rand(B, TQ, E, dtype=dtype, seed=1), _rand(B, TK, 5, dtype=dtype, seed=2),
               _rand(B, TK, 7, dtype=dtype, seed=3))
    torch_kw, attnkit_kw = _masks(dtype)[case]
    need = weights != "none"
    expected, expected_w = src(q, k, v, need_weights=need,
                               average_attn_weights=weights == "averaged", **torch_kw)
    out, w, _ = mha(q, k, v, need_weights=need, **attnkit_kw)
    _close(out, expected)
    if need:
        _close(w.mean(1) if weights == "averaged" else w, expected_w)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_options_match_torch(dtype, batch_first, bias):
    src = _torch_mha(batch_first=batch_first, bias=bias, dtype=dtype, seed=2)
    mha = MultiHeadAttention.from_torch(src)
    assert (mha.q_proj.bias is None) == (not bias) and mha.q_proj.weight.dtype == dtype
    x = _rand(B, TQ, E, dtype=dtype, seed=4)
    x_src = x if batch_first else x.transpose(0, 1)  # torch's [T, B, E]
    expected, expected_w = src(x_src, x_src, x_src, average_attn_weights=False)
    out, w, _ = mha(x_src, need_weights=True)  # from_torch keeps the source's layout
    _close(out, expected)
    _close(w, expected_w)


def test_is_causal_matches_torch_s_hint():
    """torch needs attn_mask with its is_causal hint; here is_causal=True alone is that mask,
    and with the mask as well gives the same (Tq != Tk: top left, as torch's triu(1))."""
    src = _torch_mha(batch_first=True, seed=3)
    mha = MultiHeadAttention.from_torch(src)
    q, k = _rand(B, TQ, E, seed=5), _rand(B, TK, E, seed=6)
    future = torch.ones(TQ, TK, dtype=torch.bool).triu(1)
    for need in (True, False):
        expected, _ = src(q, k, k, attn_mask=future, is_causal=True, need_weights=need)
        _close(mha(q, k, is_causal=True).out, expected)
        _close(mha(q, k, mask=~future, is_causal=True).out, expected)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        src(q, k, k, is_causal=True)


def test_unbatched_input_matches_torch():
    src = _torch_mha(batch_first=True, seed=4)
    mha = MultiHeadAttention.from_torch(src)
    q, k = _rand(TQ, E, seed=7), _rand(TK, E, seed=8)
    pad = torch.tensor([False] * 4 + [True] * 2)
    banned = torch.rand(H, TQ, TK, generator=torch.Generator().manual_seed(9)) < 0.4
    banned[..., 0] = False
    pad_bias = _rand(TK, seed=10)
    for torch_kw, attnkit_kw in (({"key_padding_mask": pad}, {"key_valid": ~pad}),
                                 ({"attn_mask": banned}, {"mask": ~banned}),
                                 ({"key_padding_mask": pad_bias}, {"mask": pad_bias})):
        expected, expected_w = src(q, k, k, average_attn_weights=False, **torch_kw)
        out, w, _ = mha(q, k, need_weights=True, **attnkit_kw)
        _close(out, expected)
        _close(w, expected_w)


def test_fully_masked_rows_give_the_output_bias_not_nan():
    src = _torch_mha(batch_first=True, seed=5)
    mha = MultiHeadAttention.from_torch(src)
    x = _rand(B, TQ, E, seed=11)
    pad = torch.zeros(B, TQ, dtype=torch.bool)
    pad[1] = True  # sequence 1 has no key: torch's weights path gives NaN there
    expected, _ = src(x, x, x, key_padding_mask=pad)
    out, w, _ = mha(x, key_valid=~pad, need_weights=True)
    _close(out[[0, 2]], expected[[0, 2]])
    assert (out[1] == mha.out_proj.bias).all() and (w[1] == 0).all()


# ---- gradients, dropout, dtypes, devices, state_dict -------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("layout", ["packed", "separate"])
def test_gradients_of_inputs_and_parameters_match_torch(dtype, layout):
    kdim = None if layout == "packed" else 5
    src = _torch_mha(kdim=kdim, vdim=kdim, batch_first=True, dtype=dtype, seed=6)
    mha = MultiHeadAttention.from_torch(src)
    q = _rand(B, TQ, E, dtype=dtype, seed=12).requires_grad_()
    k = _rand(B, TK, kdim or E, dtype=dtype, seed=13).requires_grad_()
    pad = torch.tensor([[False] * TK, [False] * 4 + [True] * 2, [True] + [False] * 5])
    grad_out = _rand(B, TQ, E, dtype=dtype, seed=14)
    expected, _ = src(q, k, k, key_padding_mask=pad, need_weights=False)
    names, params = zip(*src.named_parameters())
    torch_grads = dict(zip(("q", "k") + names,
                           torch.autograd.grad(expected, (q, k) + params, grad_out)))
    out = mha(q, k, key_valid=~pad).out
    names, params = zip(*mha.named_parameters())
    grads = dict(zip(("q", "k") + names, torch.autograd.grad(out, (q, k) + params, grad_out)))
    for name in ("q", "k", "out_proj.weight", "out_proj.bias"):
        _close(grads[name], torch_grads[name])
    if layout == "packed":
        _close(torch.cat([grads[f"{p}_proj.weight"] for p in "qkv"]), torch_grads["in_proj_weight"])
    else:
        for p in "qkv":
            _close(grads[f"{p}_proj.weight"], torch_grads[f"{p}_proj_weight"])
    _close(torch.cat([grads[f"{p}_proj.bias"] for p in "qkv"]), torch_grads["in_proj_bias"])


def test_dropout_is_off_in_eval_and_unbiased_in_training():
    src = _torch_mha(batch_first=True, dropout=0.3, seed=7)
    mha = MultiHeadAttention.from_torch(src)
    assert mha.dropout == 0.3 and not mha.training
    x = _rand(1, TQ, E, seed=15)
    _close(mha(x).out, src(x, x, x)[0])
    calls = 300
    mha.train(), src.train()
    with torch.random.fork_rng():  # the layers' dropout draws from the global generator
        torch.manual_seed(0)
        ours = torch.stack([mha(x).out for _ in range(calls)])
        theirs = torch.stack([src(x, x, x, need_weights=False)[0] for _ in range(calls)])
    evaluated = mha.eval()(x).out
    spread = ours.std(0)
    assert (spread > 0).all()  # every output moves with the dropped weights
    # E[out] is the eval output (inverted dropout): within 5 standard errors everywhere
    assert ((ours.mean(0) - evaluated).abs() <= 5 * spread / calls ** 0.5).all()
    ratio = spread.mean() / theirs.std(0).mean()  # same drop rate → about the same spread
    assert 0.8 < ratio < 1.25, ratio


def test_bfloat16_is_as_close_to_float64_as_torch_s():
    src = _torch_mha(batch_first=True, dtype=torch.bfloat16, seed=8)
    exact = _torch_mha(batch_first=True, seed=8)
    exact.load_state_dict({n: t.double() for n, t in src.state_dict().items()})
    mha = MultiHeadAttention.from_torch(src)
    q, k = _rand(B, TQ, E, seed=16).bfloat16(), _rand(B, TK, E, seed=17).bfloat16()
    truth = exact(q.double(), k.double(), k.double())[0]
    out, theirs = mha(q, k).out, src(q, k, k)[0]
    assert out.dtype == torch.bfloat16
    assert (out.double() - truth).abs().max() <= 2 * (theirs.double() - truth).abs().max()


def test_the_copy_keeps_the_source_s_device():
    src = torch.nn.MultiheadAttention(E, H, kdim=5, device="meta")
    mha = MultiHeadAttention.from_torch(src)
    assert all(p.device.type == "meta" for p in mha.parameters())


def test_a_torch_state_dict_loads_through_the_torch_module():
    """The documented way: load torch's state_dict into its module, then copy that."""
    state = _torch_mha(kdim=5, vdim=7, batch_first=True, seed=9).state_dict()
    with pytest.raises(RuntimeError, match="in_proj_bias"):  # torch's keys: not these
        MultiHeadAttention(E, H, kdim=5, vdim=7, dtype=F64).load_state_dict(state)
    src = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=7, batch_first=True, dtype=F64).eval()
    src.load_state_dict(state)
    mha = MultiHeadAttention.from_torch(src)
    q, k, v = _rand(B, TQ, E, seed=18), _rand(B, TK, 5, seed=19), _rand(B, TK, 7, seed=20)
    _close(mha(q, k, v).out, src(q, k, v)[0])


# ---- torch's spellings: refused with attnkit's --------------------------------------------------
def test_torch_s_keywords_get_the_spelling_for_their_value():
    mha = MultiHeadAttention.from_torch(_torch_mha(batch_first=True, seed=10))
    x = _rand(B, TQ, E, seed=21)
    banned3 = torch.zeros(B * H, TQ, TQ, dtype=torch.bool)
    for keywords, hint in (
            ({"attn_mask": None}, "attn_mask: drop it"),
            ({"attn_mask": banned3}, rf"mask=~attn_mask\.view\(-1, num_heads, {TQ}, {TQ}\)"),
            ({"attn_mask": banned3.double()}, r"mask=attn_mask\.view\(-1, num_heads"),
            ({"attn_mask": torch.zeros(TQ, TQ)}, r"\(a float mask is added .*\): mask=attn_mask$"),
            ({"average_attn_weights": False}, "average_attn_weights: drop it"),
            ({"average_attn_weights": True}, r"weights\.mean\(1\)")):
        with pytest.raises(TypeError, match=hint):
            mha(x, **keywords)
    # torch's key_padding_mask: a float one is a bias over the keys, not key_valid=~mask
    # (forward raises its own message for it; this is the hint _unexpected gives)
    as_bool, as_float = (str(_unexpected({"key_padding_mask": pad}))
                         for pad in (x[..., 0] > 0, x[..., 0]))
    assert "key_valid=~key_padding_mask" in as_bool
    assert "mask=key_padding_mask[:, None, None]" in as_float


def test_add_zero_attn_is_refused_with_its_sinks_spelling():
    """add_zero_attn (a zero key and value per head) is a sink of logit 0: following the
    error's recipe gives torch's outputs, its weights but the last column, and gradients."""
    src = _torch_mha(batch_first=True, add_zero_attn=True, seed=11)
    with pytest.raises(ValueError, match=r"mask=attnkit\.sinks\(torch\.zeros\(2\)\)"):
        MultiHeadAttention.from_torch(src)
    src.add_zero_attn = False
    mha = MultiHeadAttention.from_torch(src)
    src.add_zero_attn = True
    q = _rand(B, TQ, E, seed=22).requires_grad_()
    k = _rand(B, TK, E, seed=23)
    pad = torch.tensor([[False] * TK, [False] * 4 + [True] * 2, [True] * TK])  # 2: all padding
    future = torch.ones(TQ, TK, dtype=torch.bool).triu(1)
    expected, expected_w = src(q, k, k, key_padding_mask=pad, attn_mask=future,
                               average_attn_weights=False)
    out, w, _ = mha(q, k, key_valid=~pad, mask=ak.sinks(torch.zeros(H)) & ~future,
                    need_weights=True)
    _close(out, expected)
    _close(w, expected_w[..., :TK])
    _close(*(torch.autograd.grad(o.sum(), q)[0] for o in (out, expected)))


def test_add_bias_kv_is_refused_by_name():
    with pytest.raises(ValueError, match=r"add_bias_kv=True appends a learned key and value "
                                         r"\(bias_k, bias_v\)"):
        MultiHeadAttention.from_torch(_torch_mha(add_bias_kv=True, add_zero_attn=True))


def test_key_padding_mask_gets_the_spelling_for_its_value():
    """torch's ``key_padding_mask`` is refused with the spelling for its dtype (a float one
    has no ``~``), and with any other torch keyword of the same call."""
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"mask=key_padding_mask\[:, None, None\]"):
        mha(x, key_padding_mask=torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"(?s)key_valid=~key_padding_mask.*attn_mask: pass mask="):
        mha(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool),
            attn_mask=torch.zeros(3, 3, dtype=torch.bool))


def test_torch_s_positional_arguments_are_named_with_their_spelling():
    """torch's ``forward(query, key, value, key_padding_mask, need_weights, attn_mask, ...)``
    called positionally: each argument after ``value`` named in torch's order, with its
    attnkit keyword, never Python's bare count of arguments."""
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"got 1 more.*order they are key_padding_mask;"
                                        r"(?s:.*)key_valid=~key_padding_mask"):
        mha(x, x, x, pad)
    with pytest.raises(TypeError, match=r"(?s)key_padding_mask: drop it.*need_weights: pass "
                                        r"need_weights=False by keyword.*attn_mask: pass mask="):
        mha(x, x, x, None, False, torch.zeros(3, 3, dtype=torch.bool))
