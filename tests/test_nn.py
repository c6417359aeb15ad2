"""Tests of attnkit.nn: MultiHeadAttention (vs torch.nn.MultiheadAttention, GQA, KV cache,
weights, dropout, gradients) and AdditiveAttention (vs a hand-written float64 computation)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch.autograd import gradcheck

import attnkit as ak
from attnkit.nn import AdditiveAttention, KVCache, MultiHeadAttention
from attnkit.paged import PagedKVCache

F64 = torch.float64


def _rand(*shape, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _torch_mha(embed_dim, num_heads, *, bias=True, kdim=None, vdim=None, batch_first=True, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=batch_first, dtype=F64)
    if bias:  # torch initialises biases to 0: make them count
        with torch.no_grad():
            module.in_proj_bias.normal_()
            module.out_proj.bias.normal_()
    return module.eval()


# ---- from_torch -------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_from_torch_self_attention(bias, batch_first, need_weights):
    src = _torch_mha(12, 3, bias=bias, batch_first=batch_first)
    assert src._qkv_same_embed_dim  # the packed in_proj_weight layout
    mha = MultiHeadAttention.from_torch(src)
    assert mha.batch_first == batch_first
    x = _rand(2, 5, 12)  # [B, T, E]
    x_src = x if batch_first else x.transpose(0, 1)  # torch's [T, B, E] layout
    expected, expected_w = src(x_src, x_src, x_src, need_weights=need_weights,
                               average_attn_weights=False)
    out, weights, _ = mha(x_src, need_weights=need_weights)  # the source's layout
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    if need_weights:
        assert weights.shape == (2, 3, 5, 5)
        torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-12)
    else:
        assert weights is None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_cross_attention_kdim_vdim(bias, batch_first):
    src = _torch_mha(8, 2, bias=bias, kdim=5, vdim=3, batch_first=batch_first, seed=1)
    assert not src._qkv_same_embed_dim  # the separate q/k/v_proj_weight layout
    mha = MultiHeadAttention.from_torch(src)
    assert (mha.kdim, mha.vdim) == (5, 3)
    query, key, value = _rand(2, 4, 8, seed=1), _rand(2, 6, 5, seed=2), _rand(2, 6, 3, seed=3)
    args = (query, key, value) if batch_first else tuple(t.transpose(0, 1) for t in (query, key, value))
    expected, expected_w = src(*args, average_attn_weights=False)
    out, weights, _ = mha(*args, need_weights=True)  # the source's layout
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-12)


def test_batch_first_false_is_the_batch_first_module_transposed():
    """[T, B, E] in and out; masks, key_valid, lengths, weights and the cache batch first."""
    first = MultiHeadAttention(8, 2, num_kv_heads=1, kdim=5, vdim=7, dtype=F64)
    second = MultiHeadAttention(8, 2, num_kv_heads=1, kdim=5, vdim=7, batch_first=False,
                                dtype=F64)
    second.load_state_dict(first.state_dict())
    assert "batch_first=False" in repr(second) and "batch_first" not in repr(first)
    query, key, value = _rand(3, 4, 8, seed=1), _rand(3, 6, 5, seed=2), _rand(3, 6, 7, seed=3)
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] * 2 + [False] * 4])
    t = lambda x: x.transpose(0, 1)  # noqa: E731
    expected = first(query, key, value, key_valid=valid, mask=ak.causal(), need_weights=True)
    out = second(t(query), t(key), t(value), key_valid=valid, mask=ak.causal(), need_weights=True)
    assert out.out.shape == (4, 3, 8)
    torch.testing.assert_close(t(out.out), expected.out, rtol=0, atol=0)
    torch.testing.assert_close(out.weights, expected.weights, rtol=0, atol=0)
    # a ragged decoding loop: prompt chunk with lengths, then steps
    first = MultiHeadAttention(8, 2, num_kv_heads=1, dtype=F64)
    second = MultiHeadAttention(8, 2, num_kv_heads=1, batch_first=False, dtype=F64)
    second.load_state_dict(first.state_dict())
    x = _rand(3, 5, 8, seed=4)
    lengths = torch.tensor([5, 3, 1])
    a = first(x, is_causal=True, cache=first.empty_cache(), lengths=lengths)
    b = second(t(x), is_causal=True, cache=second.empty_cache(), lengths=lengths)
    torch.testing.assert_close(t(b.out), a.out, rtol=0, atol=0)
    for step in range(2):
        x = _rand(3, 1, 8, seed=10 + step)
        a = first(x, cache=a.cache)
        b = second(t(x), cache=b.cache)
        assert b.out.shape == (1, 3, 8)
        torch.testing.assert_close(t(b.out), a.out, rtol=0, atol=0)
    unbatched = second(x[0])  # [T, E]: no batch dimension to move
    torch.testing.assert_close(unbatched.out, first(x[0]).out, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"batch size \(dim 1, \[T, B, ·\]\)"):
        second(t(query)[..., :8], t(query)[:, :2], t(query)[:, :2])
    with pytest.raises(ValueError, match=r"same length Tk \(dim 0\)"):
        second(t(query), t(query), t(query)[:3])
    with pytest.raises(TypeError, match="batch_first"):
        MultiHeadAttention(8, 2, batch_first="no")


def test_batch_first_false_output_is_contiguous_as_torchs():
    src = torch.nn.MultiheadAttention(8, 2, dtype=F64)  # torch's [T, B, E] default
    mha = MultiHeadAttention.from_torch(src)
    x = _rand(5, 3, 8, seed=1)
    expected = src(x, x, x, need_weights=False)[0]
    out = mha(x).out
    assert expected.is_contiguous() and out.is_contiguous()
    torch.testing.assert_close(out.view(15, 8), expected.view(15, 8))  # torch-style reshapes


def test_a_torch_state_dict_error_builds_a_copy_of_the_modules_layout():
    """The conversion the error gives copies the layout of the module it was loaded into."""
    source = torch.nn.MultiheadAttention(8, 2)
    module = MultiHeadAttention(8, 2, batch_first=False)
    with pytest.raises(RuntimeError, match=r"from_torch\(src\)") as error:
        module.load_state_dict(source.state_dict())
    assert "batch_first=False" in str(error.value)


def test_from_torch_with_attn_mask_and_key_padding_mask():
    batch, heads, tq, tk = 3, 2, 4, 6
    src = _torch_mha(8, heads, kdim=5, vdim=7, seed=2)
    mha = MultiHeadAttention.from_torch(src)
    query, key, value = _rand(batch, tq, 8, seed=4), _rand(batch, tk, 5, seed=5), _rand(batch, tk, 7, seed=6)
    gen = torch.Generator().manual_seed(7)
    torch_attn_mask = torch.rand(tq, tk, generator=gen) < 0.3  # True = NOT allowed (torch)
    torch_attn_mask[:, 0] = False  # keep a key for every row: torch gives NaN on empty rows
    torch_padding = torch.tensor([[False] * tk, [False] * 4 + [True] * 2, [False] * 3 + [True] * 3])
    assert torch_attn_mask.any() and torch_padding.any()
    expected, expected_w = src(query, key, value, attn_mask=torch_attn_mask,
                               key_padding_mask=torch_padding, average_attn_weights=False)
    out, weights, _ = mha(query, key, value, mask=~torch_attn_mask, key_valid=~torch_padding,
                       need_weights=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-12)
    # The conversion matters: passing torch's masks unchanged gives another answer.
    wrong, _, _ = mha(query, key, value, mask=~torch_attn_mask, key_valid=torch_padding)
    assert (wrong - expected).abs().max() > 1e-3

    # A per-head bool mask [B*H, Tq, Tk] (torch) is [B, H, Tq, Tk] here.
    per_head = torch.rand(batch * heads, tq, tk, generator=gen) < 0.4
    per_head[..., 1] = False
    expected, _ = src(query, key, value, attn_mask=per_head)
    out, _, _ = mha(query, key, value, mask=~per_head.reshape(batch, heads, tq, tk))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)

    # A float attn_mask is an additive bias in both.
    bias = _rand(tq, tk, seed=8)
    expected, _ = src(query, key, value, attn_mask=bias)
    out, _, _ = mha(query, key, value, mask=bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_is_causal_matches_torch_causal_attn_mask():
    src = _torch_mha(8, 2, seed=3)
    mha = MultiHeadAttention.from_torch(src)
    x = _rand(2, 5, 8, seed=9)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)  # torch: True = not allowed
    expected, _ = src(x, x, x, attn_mask=future)
    out, _, _ = mha(x, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out_mask, _, _ = mha(x, mask=ak.causal())
    torch.testing.assert_close(out_mask, expected, rtol=0, atol=1e-12)


def test_fully_masked_row_gives_zero_attention_not_nan():
    mha = MultiHeadAttention(8, 2, dtype=F64)
    with torch.no_grad():
        mha.out_proj.bias.normal_()
    x = _rand(2, 4, 8, seed=10)
    padding = torch.tensor([[True] * 4, [False] * 4])  # batch 1 has no real key
    out, weights, _ = mha(x, key_valid=padding, need_weights=True)
    assert not out.isnan().any()
    # attention output 0 → the module's output is the out_proj bias alone.
    torch.testing.assert_close(out[1], mha.out_proj.bias.expand(4, 8), rtol=0, atol=0)
    assert (weights[1] == 0).all()
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 4, dtype=F64))


def test_from_torch_refuses_extra_key_value_bias():
    src = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(src)


@pytest.mark.parametrize("drop", ["in_proj_bias", "out_proj.bias"])
def test_from_torch_copies_biases_where_the_source_has_them(drop):
    """A source with biases on its input projections only (or its output one only) is
    copied as it is, and a frozen parameter stays frozen."""
    src = _torch_mha(8, 2, bias=True, batch_first=True)
    if drop == "in_proj_bias":
        src.in_proj_bias = None
    else:
        src.out_proj.bias = None
    src.out_proj.weight.requires_grad_(False)
    mha = MultiHeadAttention.from_torch(src)
    assert (mha.q_proj.bias is None) == (drop == "in_proj_bias")
    assert (mha.out_proj.bias is None) == (drop == "out_proj.bias")
    assert not mha.out_proj.weight.requires_grad and mha.q_proj.weight.requires_grad
    x = _rand(2, 5, 8)
    expected, _ = src(x, x, x, need_weights=False)
    torch.testing.assert_close(mha(x).out, expected, rtol=0, atol=1e-12)


def test_from_torch_refuses_the_quantizable_module():
    """torch.ao.nn.quantizable.MultiheadAttention (a subclass that eager-mode quantization
    puts in place) projects with its own layers and computes otherwise: refused by name."""
    src = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    src.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizable = torch.ao.nn.quantizable.MultiheadAttention.from_float(src)
    with pytest.raises(TypeError, match="linear_Q/K/V"):
        MultiHeadAttention.from_torch(quantizable)


# ---- GQA / MQA ----------------------------------------------------------------------------------
def _manual_mha(mha: MultiHeadAttention, query, key, value, mask=None):
    """Projections written out, K/V heads repeated explicitly, attention by the reference."""
    b, tq, _ = query.shape
    tk = key.shape[1]
    h, hkv, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q = (query @ mha.q_proj.weight.T + mha.q_proj.bias).reshape(b, tq, h, d).transpose(1, 2)
    k = (key @ mha.k_proj.weight.T + mha.k_proj.bias).reshape(b, tk, hkv, d).transpose(1, 2)
    v = (value @ mha.v_proj.weight.T + mha.v_proj.bias).reshape(b, tk, hkv, d).transpose(1, 2)
    k = k.repeat_interleave(h // hkv, dim=1)  # [B, H, Tk, D]: query head i reads kv head i // G
    v = v.repeat_interleave(h // hkv, dim=1)
    heads = ak.attention(q, k, v, mask, backend="reference")  # [B, H, Tq, D]
    return heads.transpose(1, 2).reshape(b, tq, h * d) @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gqa_matches_repeated_heads(num_kv_heads, backend):
    torch.manual_seed(11)
    mha = MultiHeadAttention(24, 6, num_kv_heads, kdim=5, vdim=7, backend=backend, dtype=F64)
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(std=0.5)
    assert mha.k_proj.weight.shape == (num_kv_heads * 4, 5)
    query, key, value = _rand(2, 4, 24, seed=12), _rand(2, 7, 5, seed=13), _rand(2, 7, 7, seed=14)
    out, _, _ = mha(query, key, value)
    torch.testing.assert_close(out, _manual_mha(mha, query, key, value), rtol=0, atol=1e-12)
    mask = ak.sliding_window(2, 1) & ak.padding(kv_lengths=[7, 5])
    out, _, _ = mha(query, key, value, mask=mask)
    torch.testing.assert_close(out, _manual_mha(mha, query, key, value, mask), rtol=0, atol=1e-12)


# ---- KV cache -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,atol", [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_kv_cache_matches_one_causal_pass(dtype, atol, chunk, num_kv_heads):
    torch.manual_seed(15)
    mha = MultiHeadAttention(16, 4, num_kv_heads, dtype=dtype).eval()
    x = _rand(2, 7, 16, dtype=dtype, seed=16)  # [B, T, E]; 7 = 3 + 3 + 1 for chunks of 3
    full, full_w, _ = mha(x, is_causal=True, need_weights=True)
    cache = mha.empty_cache()
    outs = []
    for start in range(0, 7, chunk):
        step = x[:, start:start + chunk]
        before = cache
        out, weights, cache = mha(step, cache=cache, is_causal=True, need_weights=True)
        assert before.length == start  # the cache given in is never modified
        assert cache.length == start + step.shape[1]
        assert cache.keys.shape == (2, num_kv_heads, cache.length, 4)
        # weights of the new queries over every key so far = the last rows of the full weights
        torch.testing.assert_close(weights, full_w[:, :, start:start + chunk, :cache.length],
                                   rtol=0, atol=atol)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=atol)
    # the cache holds exactly the projected keys/values
    expected_k = mha.k_proj(x).unflatten(-1, (num_kv_heads, 4)).transpose(1, 2)
    torch.testing.assert_close(cache.keys, expected_k, rtol=0, atol=atol)


def test_kv_cache_chunk_uses_bottom_right_causal():
    """Without bottom-right alignment a 3-token chunk after 4 cached tokens would see the wrong keys."""
    torch.manual_seed(17)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(1, 7, 8, seed=18)
    _, _, cache = mha(x[:, :4], cache=KVCache.empty(), is_causal=True)
    out, weights, _ = mha(x[:, 4:], cache=cache, is_causal=True, need_weights=True)
    allowed = ak.causal(align="bottom_right").to_dense(ak.masks.MaskSpace(1, 1, 3, 7))[0, 0]
    assert ((weights > 0) == allowed).all()
    expected, _, _ = mha(x, is_causal=True)
    torch.testing.assert_close(out, expected[:, 4:], rtol=0, atol=1e-12)


def test_kv_cache_decodes_position_biases_aligned_bottom_right():
    """A relative bias (and ALiBi with sinks) aligned bottom-right decodes the rows of one
    causal pass; top-left, which would count the new queries from 0, is refused, as is a
    cache whose sequences hold different lengths (positions of its buffer, not theirs)."""
    torch.manual_seed(21)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 7, 8, seed=22)
    table, slopes, sink = (torch.randn(2, 32, dtype=F64), torch.rand(2, dtype=F64),
                           torch.zeros(2, dtype=F64))
    for make in (lambda align: ak.relative_bias(table, align=align),
                 lambda align: ak.alibi(slopes, align=align) & ak.sinks(sink)):
        expected, _, _ = mha(x, mask=make("top_left"), is_causal=True)
        _, _, cache = mha(x[:, :4], mask=make("bottom_right"), cache=KVCache.empty(),
                          is_causal=True)
        outs = [mha(x[:, :4], mask=make("bottom_right"), is_causal=True).out]
        for t in range(4, 7):
            out, _, cache = mha(x[:, t:t + 1], mask=make("bottom_right"), cache=cache,
                                is_causal=True)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 1), expected, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="pass align='bottom_right'"):
            mha(x[:, 4:5], mask=make("top_left"), cache=cache, is_causal=True)
        _, _, ragged = mha(x[:, :4], mask=make("bottom_right"), cache=KVCache.empty(),
                           is_causal=True, lengths=torch.tensor([4, 2]))
        with pytest.raises(ValueError, match="different numbers of keys"):
            mha(x[:, 4:5], mask=make("bottom_right"), cache=ragged, is_causal=True)


def test_masks_that_read_positions_over_caches_of_ragged_sequences_are_refused():
    """A window aligned bottom-right over a KVCache whose sequences hold different numbers of
    keys would align to the buffer, not to each sequence (the shorter one saw no key): refused
    at the step that would read it; a ragged prefill into an empty cache, whose positions are
    the chunk's own, runs, and so does a cache of equal sequences. A PagedKVCache aligns the
    window to each sequence (PagedKVCache.attend): each row is its sequence's alone."""
    torch.manual_seed(23)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 8, 8, seed=24)
    window = ak.sliding_window(2, align="bottom_right")
    _, _, ragged = mha(x[:, :6], mask=window, cache=KVCache.empty(), is_causal=True,
                       lengths=torch.tensor([6, 3]))
    with pytest.raises(ValueError, match="different numbers of keys"):
        mha(x[:, 6:7], mask=window, cache=ragged, is_causal=True)
    with pytest.raises(ValueError, match="different numbers of keys"):  # causal as a mask too
        mha(x[:, 6:7], mask=ak.causal("bottom_right"), cache=ragged)
    mha(x[:, 6:7], cache=ragged, is_causal=True)  # the cache's own causal: per sequence
    _, _, equal = mha(x[:, :6], mask=window, cache=KVCache.empty(), is_causal=True)
    out, _, _ = mha(x[:, 6:7], mask=window, cache=equal, is_causal=True)
    expected, _, _ = mha(x[:, :7], mask=ak.sliding_window(2), is_causal=True)
    torch.testing.assert_close(out, expected[:, 6:], rtol=0, atol=1e-12)
    _, _, paged = mha(x[:, :6], mask=window, cache=PagedKVCache(16, 4), is_causal=True,
                      lengths=torch.tensor([6, 3]))
    step = torch.stack([x[0, 6:7], x[1, 3:4]])
    out, _, _ = mha(step, mask=window, cache=paged, is_causal=True)
    for b, n in enumerate([7, 4]):
        alone = torch.cat([x[b:b + 1, :n - 1], step[b:b + 1]], 1)
        want = mha(alone, mask=ak.sliding_window(2), is_causal=True).out[:, -1:]
        torch.testing.assert_close(out[b:b + 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask", [
    lambda: ak.sliding_window(1, 0, align="bottom_right"),
    lambda: ak.alibi(torch.tensor([0.5, 0.2], dtype=F64), "bottom_right")
    & ak.sinks(torch.zeros(2, dtype=F64))], ids=["window", "alibi with sinks"])
def test_masks_that_read_positions_over_a_padded_buffer_end_are_refused(mask):
    """Equal sequences whose buffer runs past them (a right-padded chunk): a mask aligned to
    the buffer's end would be off for every row; refused, and the cache's own causal runs."""
    torch.manual_seed(25)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(1, 3, 8, seed=26)
    _, _, padded = mha(x[:, :2], cache=KVCache.empty(), is_causal=True,
                       lengths=torch.tensor([1]))
    assert padded.length == 2 and padded.lengths.tolist() == [1]
    with pytest.raises(ValueError, match="hold 1 keys in a buffer of 2 positions"):
        mha(x[:, 2:], mask=mask(), cache=padded, is_causal=True)
    out = mha(x[:, 2:], cache=padded, is_causal=True).out
    want = mha(torch.cat([x[:, :1], x[:, 2:]], 1), is_causal=True).out[:, -1:]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_a_top_left_mask_after_a_chunk_of_padding_alone_runs_as_the_first_append():
    """Sequences that hold no key yet (a chunk all padding): top-left positions are the
    new chunk's own and run; bottom-right ones would align to the buffer and are refused."""
    torch.manual_seed(27)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 5, 8, seed=28)
    _, _, empty = mha(x[:, :2], cache=KVCache.empty(), is_causal=True,
                      lengths=torch.tensor([0, 0]))
    out = mha(x[:, 2:], mask=ak.sliding_window(1), cache=empty).out
    want = mha(x[:, 2:], mask=ak.sliding_window(1)).out
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="hold 0 keys in a buffer of 2 positions"):
        mha(x[:, 2:], mask=ak.sliding_window(1, align="bottom_right"), cache=empty)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_a_cache_keeps_its_lengths_when_the_callers_tensor_is_rewritten(kind):
    import numpy as np

    keys = torch.randn(2, 1, 2, 4, dtype=F64)
    lengths = torch.tensor([2, 1]) if kind == "tensor" else np.array([2, 1], dtype=np.int64)
    cache = KVCache.empty().append(keys, keys, lengths)
    mask_before = cache.mask(True).to_dense(ak.masks.MaskSpace(2, 1, 1, 2))
    lengths[:] = lengths[::-1].copy() if kind == "numpy" else lengths.flip(0)  # reused buffer
    assert cache.lengths.tolist() == [2, 1] and cache.appended.tolist() == [2, 1]
    assert torch.equal(cache.mask(True).to_dense(ak.masks.MaskSpace(2, 1, 1, 2)), mask_before)


def test_a_paged_cache_takes_queries_other_than_its_last_append():
    """Cross-attention into cached encoder states (no new keys, or another count): the
    gathered keys, as with a KVCache."""
    torch.manual_seed(31)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    memory, x = _rand(2, 6, 8, seed=32), _rand(2, 1, 8, seed=33)
    _, _, paged = mha(x, memory, cache=PagedKVCache(8, 4))
    _, _, contiguous = mha(x, memory, cache=KVCache.empty())
    torch.testing.assert_close(mha(x, memory[:, :0], cache=paged).out,
                               mha(x, memory[:, :0], cache=contiguous).out, rtol=0, atol=1e-12)


def test_kv_cache_with_key_padding_mask_and_unbatched():
    torch.manual_seed(19)
    mha = MultiHeadAttention(8, 2, 1, dtype=F64)
    x = _rand(5, 8, seed=20)  # unbatched [T, E]
    real = torch.tensor([True, False, True, True, True])
    full, _, _ = mha(x, is_causal=True, key_valid=real)
    cache = mha.empty_cache()
    outs = []
    for t in range(5):
        out, _, cache = mha(x[t:t + 1], cache=cache, is_causal=True, key_valid=real[:t + 1])
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-12)
    assert cache.keys.shape == (1, 1, 5, 4)


def test_kv_cache_rejects_mismatched_batch():
    mha = MultiHeadAttention(8, 2)
    _, _, cache = mha(torch.randn(2, 3, 8), cache=mha.empty_cache())
    with pytest.raises(ValueError, match="batch size"):
        mha(torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="length"):
        KVCache(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 2)


# ---- weights, dropout -----------------------------------------------------------------------------
def test_need_weights_shape_and_rows_sum_to_one():
    torch.manual_seed(21)
    mha = MultiHeadAttention(12, 3, dtype=F64)
    query, memory = _rand(2, 4, 12, seed=22), _rand(2, 6, 12, seed=23)
    real = torch.tensor([[True] * 6, [True] * 2 + [False] * 4])
    out, weights, _ = mha(query, memory, key_valid=real, need_weights=True)
    assert out.shape == (2, 4, 12) and weights.shape == (2, 3, 4, 6)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 4, dtype=F64))
    assert (weights[1, :, :, 2:] == 0).all()  # padded keys get no weight
    # unbatched input gives the unbatched shapes and the same numbers
    out0, weights0, _ = mha(query[0], memory[0], need_weights=True)
    assert out0.shape == (4, 12) and weights0.shape == (3, 4, 6)
    torch.testing.assert_close(out0, out[0], rtol=0, atol=1e-12)


def test_dropout_reproducible_in_train_and_off_in_eval():
    torch.manual_seed(24)
    mha = MultiHeadAttention(8, 2, dropout=0.5, dtype=F64)
    plain = MultiHeadAttention(8, 2, dropout=0.0, dtype=F64)
    plain.load_state_dict(mha.state_dict())
    x = _rand(2, 6, 8, seed=25)

    mha.train()
    torch.manual_seed(0)
    first, _, _ = mha(x)
    torch.manual_seed(0)
    second, _, _ = mha(x)
    torch.manual_seed(1)
    third, _, _ = mha(x)
    assert torch.equal(first, second)
    assert not torch.allclose(first, third)
    # the same seed drives attnkit.attention's dropout (same inputs → same backend): by hand
    q = mha.q_proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
    k = mha.k_proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
    v = mha.v_proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
    torch.manual_seed(0)
    heads = ak.attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(first, mha.out_proj(heads.transpose(1, 2).flatten(-2)),
                               rtol=0, atol=1e-12)
    # returned weights are taken before dropout: rows still sum to 1
    _, weights, _ = mha(x, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 6, dtype=F64))

    mha.eval()
    expected = plain(x).out
    assert not torch.allclose(first, expected)
    torch.manual_seed(0)
    eval_a, _, _ = mha(x)
    torch.manual_seed(1)
    eval_b, _, _ = mha(x)
    torch.testing.assert_close(eval_a, expected, rtol=0, atol=1e-12)
    assert torch.equal(eval_a, eval_b)


# ---- configuration errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    (dict(embed_dim=10, num_heads=3), ["embed_dim=10", "num_heads=3"]),
    (dict(embed_dim=12, num_heads=4, num_kv_heads=3), ["num_heads=4", "num_kv_heads=3"]),
    (dict(embed_dim=0, num_heads=1), ["embed_dim=0"]),
    (dict(embed_dim=8, num_heads=-2), ["num_heads=-2"]),
    (dict(embed_dim=8, num_heads=2, num_kv_heads=0), ["num_kv_heads=0"]),
    (dict(embed_dim=8, num_heads=2, kdim=0), ["kdim=0"]),
    (dict(embed_dim=8, num_heads=2, dropout=1.0), ["dropout=1.0"]),
])
def test_bad_config_raises(kwargs, words):
    with pytest.raises(ValueError) as info:
        MultiHeadAttention(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_inputs_raise():
    mha = MultiHeadAttention(8, 2, kdim=5)
    with pytest.raises(ValueError, match="kdim"):
        mha(torch.randn(2, 3, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="batch"):
        mha(torch.randn(2, 3, 8), torch.randn(3, 4, 5), torch.randn(3, 4, 8))
    with pytest.raises(TypeError, match="True = real"):
        mha(torch.randn(2, 3, 8), torch.randn(2, 4, 5), torch.randn(2, 4, 8),
            key_valid=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="key_valid"):
        mha(torch.randn(2, 3, 8), torch.randn(2, 4, 5), torch.randn(2, 4, 8),
            key_valid=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_valid=~key_padding_mask"):  # torch's inverted name
        mha(torch.randn(2, 3, 8), torch.randn(2, 4, 5), torch.randn(2, 4, 8),
            key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="hidden_dim=0"):
        AdditiveAttention(4, 4, 0)
    with pytest.raises(TypeError, match="True = real"):  # unbatched: the same message
        mha(torch.randn(3, 8), torch.randn(4, 5), torch.randn(4, 8), key_valid=[True] * 4)
    with pytest.raises(ValueError, match=r"unbatched keys take \[Tk\] = \[4\]"):
        mha(torch.randn(3, 8), torch.randn(4, 5), torch.randn(4, 8),
            key_valid=torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("values, error", [
    (torch.randint(1, 9, (2, 5, 3)), "floating-point dtype"),  # integer weights would be 0
    (torch.randn(2, 5, 3).half(), "floating-point dtype"),  # weights silently fp16
    ([[0.0] * 3] * 5, "values must be a torch.Tensor"),
])
def test_additive_attention_refuses_values_it_cannot_weigh(values, error):
    module = AdditiveAttention(4, 6, 8)
    with pytest.raises(TypeError, match=error):
        module(torch.randn(2, 3, 4), torch.randn(2, 5, 6), values)


# ---- gradients --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gradcheck_tiny_mha(backend):
    torch.manual_seed(26)
    mha = MultiHeadAttention(4, 2, 1, kdim=3, backend=backend, dtype=F64)
    query = _rand(1, 3, 4, seed=27).requires_grad_()
    key = _rand(1, 4, 3, seed=28).requires_grad_()
    value = _rand(1, 4, 4, seed=29).requires_grad_()
    real = torch.tensor([[True, True, True, False]])

    def fn(q, k, v):
        return mha(q, k, v, key_valid=real, mask=ak.sliding_window(2, 1))[0]

    assert gradcheck(fn, (query, key, value))
    fn(query, key, value).square().sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert (value.grad[0, 3] == 0).all()  # a padded value never reaches the output


# ---- AdditiveAttention -----------------------------------------------------------------------------
def _additive_by_hand(module: AdditiveAttention, query, keys, values, allowed):
    """vᵀ tanh(W_q q + W_k k + b), masked softmax over keys, written out in float64."""
    w_q, w_k = module.query_proj.weight.detach().double(), module.key_proj.weight.detach().double()
    b, v = module.key_proj.bias.detach().double(), module.score_proj.weight.detach().double()[0]
    out = torch.zeros(query.shape[0], query.shape[1], values.shape[-1], dtype=F64)
    weights = torch.zeros(query.shape[0], query.shape[1], keys.shape[1], dtype=F64)
    for bi in range(query.shape[0]):
        for i in range(query.shape[1]):
            scores = [float(v @ torch.tanh(w_q @ query[bi, i] + w_k @ keys[bi, j] + b))
                      for j in range(keys.shape[1])]
            live = [j for j in range(keys.shape[1]) if allowed[bi, i, j]]
            if not live:
                continue  # fully masked: weights and output stay 0
            top = max(scores[j] for j in live)
            total = sum(math.exp(scores[j] - top) for j in live)
            for j in live:
                weights[bi, i, j] = math.exp(scores[j] - top) / total
            out[bi, i] = weights[bi, i] @ values[bi].double()
    return out, weights


def test_additive_attention_matches_hand_computation():
    torch.manual_seed(30)
    module = AdditiveAttention(query_dim=3, key_dim=5, hidden_dim=4, value_dim=2).double()
    with torch.no_grad():
        module.key_proj.bias.normal_()
    query, keys, values = _rand(2, 3, 3, seed=31), _rand(2, 4, 5, seed=32), _rand(2, 4, 2, seed=33)
    allowed = torch.ones(2, 3, 4, dtype=torch.bool)
    allowed[0, 1, 2] = False
    allowed[1, 2] = False  # a fully masked row
    expected_out, expected_w = _additive_by_hand(module, query, keys, values, allowed)
    out, weights = module(query, keys, values, mask=allowed)
    assert out.shape == (2, 3, 2) and weights.shape == (2, 3, 4)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-12)
    assert (out[1, 2] == 0).all() and (weights[1, 2] == 0).all()
    assert not out.isnan().any()

    # fully masked rows have zero gradients (and no NaN anywhere)
    q = query.clone().requires_grad_()
    module(q, keys, values, mask=allowed)[0].sum().backward()
    assert not q.grad.isnan().any() and (q.grad[1, 2] == 0).all() and q.grad[1, 1].abs().sum() > 0

    # no mask: every row sums to 1
    _, unmasked_w = module(query, keys, values)
    torch.testing.assert_close(unmasked_w.sum(-1), torch.ones(2, 3, dtype=F64))


def test_additive_attention_accepts_attnkit_masks():
    torch.manual_seed(34)
    module = AdditiveAttention(4, 4, 6).double()
    query, keys, values = _rand(2, 3, 4, seed=35), _rand(2, 5, 4, seed=36), _rand(2, 5, 3, seed=37)
    mask = ak.padding(kv_lengths=[5, 0]) | ak.causal()  # batch 1: causal keys only
    allowed = mask.to_dense(ak.masks.MaskSpace(2, 1, 3, 5))[:, 0]
    expected_out, expected_w = _additive_by_hand(module, query, keys, values, allowed)
    out, weights = module(query, keys, values, mask=mask)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-12)
    # padding every key of batch 1 empties its rows
    out, weights = module(query, keys, values, mask=ak.padding(kv_lengths=[5, 0]))
    assert (out[1] == 0).all() and (weights[1] == 0).all()
    # float32 too, and unbatched input
    module32 = AdditiveAttention(4, 4, 6)
    module32.load_state_dict(module.state_dict())
    out32, _ = module32(query[0].float(), keys[0].float(), values[0].float(), mask=allowed[0])
    torch.testing.assert_close(out32.double(), expected_out[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["padding", "bool", "bool [Tk]"])
def test_additive_attention_never_reads_padded_keys_or_values(form):
    """NaN in the keys and values no query may attend (padding) reaches no output and no
    weight: the result equals that of zeros there."""
    module = AdditiveAttention(4, 4, 6).double()
    query, keys, values = _rand(2, 3, 4, seed=40), _rand(2, 5, 4, seed=41), _rand(2, 5, 3, seed=42)
    lengths = torch.tensor([5, 3]) if form != "bool [Tk]" else torch.tensor([3, 3])
    real = torch.arange(5) < lengths[:, None]  # [B, Tk]
    mask = {"padding": ak.padding(kv_lengths=lengths), "bool": real[:, None, :],
            "bool [Tk]": real[0]}[form]
    clean = module(query, keys, values, mask=mask)
    dirty = module(query, keys.masked_fill(~real[..., None], float("nan")),
                   values.masked_fill(~real[..., None], float("nan")), mask=mask)
    for got, want in zip(dirty, clean):
        assert torch.equal(got, want)


def test_combined_mask_object_is_reusable():
    """Regression (core fix in inputs._fit_mask): validating a call must not rewrite the parts
    of the caller's combined mask, or a reused mask fails in the next call (rank-3 inputs)."""
    x = _rand(2, 4, 8, seed=38)
    mask = ak.causal() & ak.dense(torch.tensor([True, True, False, True]).expand(2, 4, 4))
    first = ak.attention(x, x, x, mask=mask)
    second = ak.attention(x, x, x, mask=mask)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    # and the module path: a mask object shared by many decoding steps
    mha = MultiHeadAttention(8, 2, dtype=F64)
    shared = ak.dense(torch.ones(4, 4, dtype=torch.bool)) & ak.causal()
    torch.testing.assert_close(mha(x, mask=shared)[0], mha(x, mask=shared)[0], rtol=0, atol=0)


def test_key_padding_in_one_run_per_row_becomes_a_padding_mask():
    """Left/right key padding is a structured mask (tiles skipped); other patterns stay dense,
    and both give the same result as an element mask."""
    torch.manual_seed(0)
    mha = ak.nn.MultiHeadAttention(32, 4)
    x = torch.randn(2, 10, 32)
    runs = torch.ones(2, 10, dtype=torch.bool)
    runs[0, :3] = False  # left padding
    runs[1, 7:] = False  # right padding
    holes = runs.clone()
    holes[1, 2] = False  # not one run
    for real, kind in ((runs, "padding"), (holes, "dense")):
        combined = mha._combine_masks(None, real, False, cache=None, batch=2, kv_len=10)
        assert repr(combined).startswith(kind)
        out, _, _ = mha(x, key_valid=real)
        want, _, _ = mha(x, mask=real[:, None, None, :])
        torch.testing.assert_close(out, want)


def test_forward_returns_one_named_tuple_with_or_without_a_cache():
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = torch.randn(2, 3, 8, dtype=F64)
    plain = mha(x)
    assert plain.weights is None and plain.cache is None
    cached = mha(x, cache=mha.empty_cache(), need_weights=True)
    assert cached.cache.length == 3 and cached.weights.shape == (2, 2, 3, 3)
    torch.testing.assert_close(cached.out, plain.out)


# ---- the preallocated cache --------------------------------------------------------------------

def test_kv_cache_writes_in_place_and_grows_geometrically():
    """Decoding 100 tokens one at a time fills a few buffers (capacity doubling), each step
    writing its one position in place; a preallocated capacity takes one buffer."""
    cache, stores = KVCache.empty(), set()
    for t in range(100):
        cache = cache.append(torch.full((1, 2, 1, 4), float(t)), torch.full((1, 2, 1, 3), -float(t)))
        stores.add(id(cache._store))
    assert cache.length == 100 and len(stores) <= 8  # 1, 2, 4, ..., 128
    assert torch.equal(cache.keys[0, 1, :, 0], torch.arange(100.0))
    assert torch.equal(cache.values[0, 0, :, 2], -torch.arange(100.0))
    fixed = KVCache.empty(capacity=64)
    first = fixed.append(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 3))
    last = first
    for _ in range(50):
        last = last.append(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 3))
    assert last._store is first._store and first._store.capacity == 64


def test_kv_cache_never_changes_a_cache_given_out():
    """Extending an older cache again (beam search) copies it: neither branch sees the other's
    tokens, and the older cache keeps its contents."""
    base = KVCache.empty().append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    left = base.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    right = base.append(torch.full((1, 1, 1, 2), 2.0), torch.full((1, 1, 1, 2), 2.0))
    assert left.keys[0, 0, 3, 0] == 1 and right.keys[0, 0, 3, 0] == 2
    assert base.length == 3 and bool((base.keys == 0).all())
    assert right._store is not left._store


def test_plain_attention_over_the_cache_views(gen):
    """``cache.keys``/``cache.values`` (strided views of the buffers) and ``cache.mask()`` serve
    plain ``attention``: chunked prefill then decoding equals one causal pass."""
    q, k, v = (torch.randn(2, 4, 11, 8, generator=gen) for _ in range(3))
    full = ak.attention(q, k, v, ak.causal())
    cache, outs = KVCache.empty(), []
    for start, stop in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11)):
        cache = cache.append(k[:, :, start:stop], v[:, :, start:stop])
        outs.append(ak.attention(q[:, :, start:stop], cache.keys, cache.values, cache.mask()))
    torch.testing.assert_close(torch.cat(outs, 2), full)


def test_batched_decoding_of_sequences_of_different_lengths(gen):
    """Three prompts of lengths 5, 2 and 4 in one right-padded batch, then 4 decode steps
    (``lengths``): each sequence's outputs equal decoding it alone; padded queries give 0."""
    mha = MultiHeadAttention(16, 4, num_kv_heads=2)
    prompts = [torch.randn(n, 16, generator=gen) for n in (5, 2, 4)]
    steps = [torch.randn(3, 1, 16, generator=gen) for _ in range(4)]
    batch = torch.zeros(3, 5, 16)
    for b, p in enumerate(prompts):
        batch[b, :p.shape[0]] = p
    lengths = torch.tensor([5, 2, 4])
    out, _, cache = mha(batch, cache=mha.empty_cache(), is_causal=True, lengths=lengths)
    assert cache.lengths.tolist() == [5, 2, 4] and cache.length == 5
    assert bool((out[1, 2:] == mha.out_proj.bias).all())  # padded queries: 0 before out_proj
    outs = [out]
    for step in steps:
        o, _, cache = mha(step, cache=cache, is_causal=True, lengths=torch.ones(3, dtype=torch.long))
        outs.append(o)
    assert cache.lengths.tolist() == [9, 6, 8]
    for b, p in enumerate(prompts):
        alone = torch.cat([p] + [s[b] for s in steps])[None]
        expected, _, _ = mha(alone, is_causal=True)
        torch.testing.assert_close(outs[0][b, :p.shape[0]], expected[0, :p.shape[0]])
        torch.testing.assert_close(torch.cat([o[b] for o in outs[1:]]), expected[0, p.shape[0]:])


def test_an_appended_cache_is_the_cache_its_fields_describe(gen):
    """``append`` builds its result without the dataclass's checks: every field is set, and
    the result equals (field by field) a cache built from them; ``appended`` of a step with no
    ``lengths`` counts its positions."""
    k = torch.randn(2, 2, 3, 4, generator=gen)
    for lengths in (None, torch.tensor([3, 1])):
        cache = KVCache.empty(capacity=8).append(k, k, lengths).append(k[:, :, :1], k[:, :, :1])
        assert set(vars(cache)) == {f.name for f in dataclasses.fields(KVCache)}
        rebuilt = KVCache(**{f.name: getattr(cache, f.name) for f in dataclasses.fields(KVCache)})
        assert rebuilt.length == cache.length == cache.keys.shape[2] == 4
        if lengths is not None:
            assert cache.appended.tolist() == [1, 1] and cache.lengths.tolist() == [4, 2]


def test_lengths_need_a_cache_and_must_fit():
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="needs a cache"):
        mha(torch.randn(2, 3, 8), lengths=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match=r"lie in \[0, 3\]"):
        mha(torch.randn(2, 3, 8), cache=mha.empty_cache(), lengths=torch.tensor([4, 1]))


def _decode_caches(dtype, heads_kv):
    """Caches one new token past a prefill: ragged lengths, equal lengths, a window, and 8
    keys (where torch's kernel gives a NaN query row output 0: the flags must catch it)."""
    gen = torch.Generator().manual_seed(5)
    prompt = [torch.randn(8, heads_kv, 40, 64, generator=gen, dtype=dtype) for _ in range(2)]
    step = [torch.randn(8, heads_kv, 1, 64, generator=gen, dtype=dtype) for _ in range(2)]
    lengths = torch.tensor([1, 5, 9, 17, 23, 30, 38, 40])
    return {"ragged": KVCache.empty(64).append(*prompt, lengths=lengths).append(*step),
            "equal": KVCache.empty().append(*prompt).append(*step),
            "window": KVCache.empty(window=24).append(*prompt).append(*step),
            "short": KVCache.empty().append(*(t[:, :, :7] for t in prompt)).append(*step)}


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize("kind", ["ragged", "equal", "window", "short"])
def test_a_decoding_step_equals_attention_on_the_cache_mask(kind, heads_kv, dtype):
    """KVCache.decode, what MultiHeadAttention runs for one new token per sequence, gives
    attention() over the cache's mask bit for bit, non-finite inputs included (a NaN query
    row is NaN, an infinite key reaches its rows as attention() lets it); with gradients, another backend, several new tokens or a small
    cache it declines (None) and attention() runs."""
    cache = _decode_caches(dtype, heads_kv)[kind]
    q = torch.randn(8, 4, 1, 64, generator=torch.Generator().manual_seed(6), dtype=dtype)
    q[3, 1, 0, 2] = float("nan")
    cache.keys[5, 0, 2, 1] = float("inf")  # a key sequence 5 sees
    with torch.no_grad():
        got = cache.decode(q)
        want = ak.attention(q, cache.keys, cache.values, cache.mask())
    assert got is not None and torch.isnan(got[3, 1]).all()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    with ak.use_backend("reference"):
        assert cache.decode(q) is None
    assert cache.decode(q, backend="tiled") is None
    assert cache.decode(q.detach().requires_grad_()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # attention() would cast q, K and V
        assert cache.decode(q) is None
    assert cache.decode(torch.cat([q, q], 2)) is None
    small = KVCache.empty().append(cache.keys[:1, :, :4], cache.values[:1, :, :4])
    assert small.decode(q[:1]) is None  # attention() looks at its keys


def test_multi_head_attention_decodes_through_the_cache():
    """A ragged decoding loop of MultiHeadAttention (which takes KVCache.decode) equals the
    loop on the tiled backend (which takes attention())."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=F64)
    tiled = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=F64, backend="tiled")
    tiled.load_state_dict(mha.state_dict())
    lengths = torch.tensor([3, 7, 1])
    x = torch.randn(3, 7, 32, dtype=F64)
    caches = [KVCache.empty(), KVCache.empty()]
    with torch.no_grad():
        outs = [[], []]
        for i, module in enumerate((mha, tiled)):
            out, _, caches[i] = module(x, cache=caches[i], is_causal=True, lengths=lengths)
            for step in range(5):
                out, _, caches[i] = module(out[:, -1:] if step else out[:, :1], cache=caches[i],
                                           is_causal=True)
                outs[i].append(out)
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), rtol=1e-12,
                               atol=1e-12)


def test_modules_propagate_shapes_on_meta():
    """Shape-only calls on meta (no autocast state there), as torch's own modules take them."""
    mha = MultiHeadAttention(32, 4, device="meta")
    x, memory = torch.empty(2, 5, 32, device="meta"), torch.empty(2, 7, 32, device="meta")
    assert mha(x, memory).out.shape == (2, 5, 32)  # cross-attention
    assert mha(x[0]).out.shape == (5, 32)  # unbatched
    additive = AdditiveAttention(8, 8, 16, device="meta")
    out, weights = additive(torch.empty(2, 3, 8, device="meta"), torch.empty(2, 4, 8, device="meta"),
                            torch.empty(2, 4, 8, device="meta"))
    assert out.shape == (2, 3, 8) and weights.shape == (2, 3, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_additive_attention_adds_a_float32_bias_in_float32(dtype):
    """A bias beyond float16's range stays a finite bias (no inf − inf NaN), and a row of
    float32's lowest stays what it is in float32: weights summing to 1."""
    torch.manual_seed(25)
    additive = AdditiveAttention(8, 8, 16).to(dtype)
    q, k, v = (torch.randn(1, n, 8, dtype=dtype) for n in (2, 3, 3))
    bias = torch.tensor([[[1e5, 0.0, 0.0]], [[torch.finfo(torch.float32).min] * 3]]).reshape(1, 2, 3)
    out, weights = additive(q, k, v, mask=bias)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(1, 2), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("make", [lambda: KVCache.empty(capacity=16), KVCache.empty,
                                  lambda: PagedKVCache(8, 4)])
def test_backward_through_a_chain_of_cache_appends(make):
    """Training through cached steps (a prompt, then tokens one by one, with grad): appends
    with room copy rather than write into a buffer an earlier step's backward still reads;
    the gradients are those of one causal pass."""
    torch.manual_seed(27)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 5, 8, seed=28).requires_grad_()
    out, _, cache = mha(x[:, :3], cache=make(), is_causal=True)
    outs = [out]
    for t in (3, 4):
        out, _, cache = mha(x[:, t:t + 1], cache=cache, is_causal=True)
        outs.append(out)
    (grad,) = torch.autograd.grad(torch.cat(outs, 1).square().sum(), x)
    (want,) = torch.autograd.grad(mha(x, is_causal=True).out.square().sum(), x)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", [lambda: KVCache.empty(capacity=16), KVCache.empty,
                                  lambda: PagedKVCache(8, 4)])
def test_a_cache_prefilled_in_inference_mode_decodes_outside_it(make):
    torch.manual_seed(29)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 5, 8, seed=30)
    with torch.inference_mode():
        _, _, cache = mha(x[:, :4], cache=make(), is_causal=True)
    with torch.no_grad():
        out, _, _ = mha(x[:, 4:], cache=cache, is_causal=True)
        want = mha(x, is_causal=True).out[:, 4:]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_ragged_cache_from_inference_mode_takes_a_step_with_gradients(invariant):
    """A one-token step with grad on a cache whose lengths were made under inference_mode:
    its scatter index is a copy (an inference tensor cannot be saved for backward)."""
    torch.manual_seed(31)
    mha = MultiHeadAttention(8, 2, dtype=F64, invariant=invariant)
    x = _rand(2, 5, 8, seed=32).requires_grad_()
    with torch.inference_mode():
        _, _, cache = mha(x[:, :4].detach(), cache=KVCache.empty(), is_causal=True,
                          lengths=torch.tensor([4, 4]))
    out, _, _ = mha(x[:, 4:], cache=cache, is_causal=True, lengths=torch.tensor([1, 1]))
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (want,) = torch.autograd.grad(mha(x, is_causal=True).out[:, 4:].square().sum(), x)
    torch.testing.assert_close(out, mha(x, is_causal=True).out[:, 4:], rtol=0, atol=1e-12)
    torch.testing.assert_close(grad[:, 4:], want[:, 4:], rtol=0, atol=1e-12)


class _LoRA(torch.nn.Module):
    """A wrapped projection, as adapter libraries replace a Linear: base(x) + x·A·B."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(base.in_features, 2, dtype=base.weight.dtype))
        self.b = torch.nn.Parameter(torch.randn(2, base.out_features, dtype=base.weight.dtype))

    def forward(self, x):
        return self.base(x) + x @ self.a @ self.b


def test_invariant_projections_run_wrappers_and_hooks():
    """Under the contract the projections are row-wise; a wrapped projection (LoRA), a weight
    recomputed by a pre-hook (old-style weight_norm) and a forward hook still run, and a
    sequence's rows stay the same bits alone and in a batch."""
    torch.manual_seed(35)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    mha.q_proj = _LoRA(mha.q_proj)
    torch.nn.utils.weight_norm(mha.k_proj)
    with torch.no_grad():
        mha.k_proj.weight_g.mul_(1.5)
    mha.v_proj.register_forward_hook(lambda module, args, out: out * 2)
    x = _rand(3, 5, 8, seed=36)
    loose = mha(x, is_causal=True).out
    with ak.invariant():
        strict = mha(x, is_causal=True).out
        alone = mha(x[1:2], is_causal=True).out
    torch.testing.assert_close(strict, loose, rtol=0, atol=1e-12)
    assert torch.equal(alone, strict[1:2])


def test_torch_s_keywords_get_their_attnkit_spelling():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with pytest.raises(TypeError, match=r"attn_mask: pass mask=.*mask=~attn_mask"):
        mha(x, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"average_attn_weights: .*weights\.mean\(1\)"):
        mha(x, need_weights=True, average_attn_weights=True)
    with pytest.raises(TypeError, match="'foo'; it takes mask, key_valid"):
        mha(x, foo=1)


def test_a_paged_step_with_a_top_left_band_or_top_left_alibi_and_sinks_is_refused():
    """Only bottom-right bands run per sequence on a paged cache; the others read the
    gathered keys, checked as a KVCache's (bottom-right ALiBi with sinks runs there)."""
    torch.manual_seed(37)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(1, 5, 8, seed=38)
    sink = ak.sinks(torch.zeros(2, dtype=F64))
    slopes = torch.rand(2, dtype=F64)
    for mask in (ak.causal(), ak.sliding_window(2), ak.alibi(slopes) & sink):
        _, _, cache = mha(x[:, :3], mask=mask, cache=PagedKVCache(8, 4), is_causal=True)
        with pytest.raises(ValueError, match="pass align='bottom_right'"):
            mha(x[:, 3:4], mask=mask, cache=cache, is_causal=True)
    mask = ak.alibi(slopes, align="bottom_right") & sink
    _, _, cache = mha(x[:, :3], mask=mask, cache=PagedKVCache(8, 4), is_causal=True)
    out, _, _ = mha(x[:, 3:4], mask=mask, cache=cache, is_causal=True)
    torch.testing.assert_close(out, mha(x[:, :4], mask=ak.alibi(slopes) & sink,
                                        is_causal=True).out[:, 3:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("cache_kind", ["kv", "paged"])
def test_every_band_of_a_mask_is_checked_against_the_cache(cache_kind):
    """A top-left band is refused over a cache that holds keys wherever it sits in an `&`
    chain, not only first."""
    torch.manual_seed(40)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(1, 6, 8, seed=41)
    make = (lambda: KVCache.empty()) if cache_kind == "kv" else (lambda: PagedKVCache(8, 4))
    _, _, cache = mha(x[:, :5], cache=make(), is_causal=True)
    for mask in (ak.sliding_window(2) & ak.causal("bottom_right"),
                 ak.causal("bottom_right") & ak.sliding_window(2)):
        with pytest.raises(ValueError, match=r"sliding_window\(2\) with a cache that holds 5"):
            mha(x[:, 5:], mask=mask, cache=cache)
    with pytest.raises(ValueError, match=r"causal\(\) with a cache that holds 5"):  # inside |
        mha(x[:, 5:], mask=ak.causal() | ak.from_function(lambda b, h, i, j: j < 2), cache=cache)
    bottom_right = ak.causal("bottom_right") & ak.sliding_window(2, align="bottom_right")
    out, _, _ = mha(x[:, 5:], mask=bottom_right, cache=cache)
    torch.testing.assert_close(out, mha(x, mask=ak.sliding_window(2)).out[:, 5:],
                               rtol=0, atol=1e-12)


def test_a_ragged_paged_step_takes_an_and_of_bottom_right_bands():
    """flash-attn's causal=True with window_size=(w, 0), spelled as two bands, runs per
    sequence as the one band it is."""
    torch.manual_seed(42)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 6, 8, seed=43)
    outs = []
    for mask in (ak.sliding_window(2, 0, "bottom_right"),
                 ak.causal("bottom_right") & ak.sliding_window(2, 0, "bottom_right")):
        cache = PagedKVCache(16, 4)
        mha(x[:, :4], cache=cache, is_causal=True, lengths=torch.tensor([4, 2]))
        outs.append(mha(x[:, 4:5], mask=mask, cache=cache).out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_training_queries_alone_through_a_cache_and_reading_older_caches():
    """Frozen K/V projections (a query-only adapter): the attention saves the cache's keys for
    q's gradient, so later appends copy; and an append with grad leaves an older cache's
    views (made under no_grad) readable."""
    torch.manual_seed(39)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    for proj in (mha.k_proj, mha.v_proj):
        proj.requires_grad_(False)
    x = _rand(2, 5, 8, seed=40)
    out, _, cache = mha(x[:, :3], cache=KVCache.empty(capacity=16), is_causal=True)
    outs = [out]
    for t in (3, 4):
        out, _, cache = mha(x[:, t:t + 1], cache=cache, is_causal=True)
        outs.append(out)
    grads = torch.autograd.grad(torch.cat(outs, 1).sum(), mha.q_proj.weight)
    want = torch.autograd.grad(mha(x, is_causal=True).out.sum(), mha.q_proj.weight)
    torch.testing.assert_close(grads[0], want[0], rtol=0, atol=1e-12)
    with torch.no_grad():
        older = KVCache.empty(capacity=8).append(*(_rand(1, 2, 3, 4, seed=41),) * 2)
    keys = _rand(1, 2, 1, 4, seed=42).requires_grad_()
    older.append(keys, keys)
    assert torch.isfinite(older.keys * 1).all()  # still readable, with grad on


class _Adapter(torch.nn.Linear):
    """An adapter written as a Linear subclass with its own forward (loralib's pattern)."""

    def forward(self, x):
        return super().forward(x) + 0.5 * x[..., :1]


def test_invariant_projections_run_a_linear_subclass_s_own_forward():
    torch.manual_seed(43)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    adapter = _Adapter(8, 8, dtype=F64)
    adapter.load_state_dict(mha.q_proj.state_dict())
    mha.q_proj = adapter
    x = _rand(2, 5, 8, seed=44)
    loose = mha(x, is_causal=True).out
    with ak.invariant():
        torch.testing.assert_close(mha(x, is_causal=True).out, loose, rtol=0, atol=1e-12)
    with ak.invariance.rowwise_linears(mha):
        torch.testing.assert_close(adapter(x), super(_Adapter, adapter).forward(x)
                                   + 0.5 * x[..., :1], rtol=0, atol=1e-12)


def test_invariant_refuses_dynamically_quantized_projections_and_attend_names_autocast():
    mha = torch.ao.quantization.quantize_dynamic(MultiHeadAttention(8, 2),
                                                 {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(2, 3, 8)
    assert mha(x).out.shape == (2, 3, 8)
    with ak.invariant(), pytest.raises(ValueError, match="dynamically quantized"):
        mha(x)
    cache = PagedKVCache(8, 4)
    cache.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match="under torch.autocast computes in torch.bfloat16"):
        cache.attend(torch.randn(1, 2, 5, 4))


def test_a_decode_loop_with_grad_on_keeps_its_cache_the_size_of_its_tokens():
    """Generating without no_grad (a trainable module): each append copies (autograd reads the
    store), into a store of the old one's size while it has room, never doubling per step."""
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(1, 30, 16)
    _, _, cache = mha(x[:, :8], cache=KVCache.empty(), is_causal=True)
    for t in range(8, 30):
        _, _, cache = mha(x[:, t:t + 1], cache=cache, is_causal=True)
    assert cache._store.capacity <= 64


def test_a_soft_prompt_trains_through_a_cache_of_frozen_projections():
    """The cached keys require grad (a learned prompt), the decoded tokens' do not: the store
    they sit in is not written in place again."""
    torch.manual_seed(45)
    mha = MultiHeadAttention(8, 2, dtype=F64).requires_grad_(False)
    prompt = _rand(1, 3, 8, seed=46).requires_grad_()
    tokens = _rand(1, 3, 8, seed=47)
    out, _, cache = mha(prompt, cache=KVCache.empty(capacity=16), is_causal=True)
    outs = [out]
    for t in range(3):
        out, _, cache = mha(tokens[:, t:t + 1], cache=cache, is_causal=True)
        outs.append(out)
    (grad,) = torch.autograd.grad(torch.cat(outs, 1).sum(), prompt)
    (want,) = torch.autograd.grad(mha(torch.cat([prompt, tokens], 1), is_causal=True).out.sum(),
                                  prompt)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


def test_a_paged_chunk_no_sequence_fills_refuses_bottom_right_alone():
    """Gathered keys end where the longest sequence does: top-left masks on a first prefill
    keep the chunk's own positions; bottom-right ones would shift, refused by name."""
    torch.manual_seed(48)
    mha = MultiHeadAttention(8, 2, dtype=F64)
    x = _rand(2, 4, 8, seed=49)
    table = torch.randn(2, 32, dtype=F64)
    out, _, _ = mha(x, mask=ak.relative_bias(table), cache=PagedKVCache(8, 4),
                    lengths=torch.tensor([3, 3]))
    want = mha(x[:, :3], mask=ak.relative_bias(table)).out
    torch.testing.assert_close(out[:, :3], want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="chunk of 4 positions that no sequence fills"):
        mha(x, mask=ak.relative_bias(table, align="bottom_right"), cache=PagedKVCache(8, 4),
            lengths=torch.tensor([3, 3]))
    # a bottom-right band after a top-left one, lengths as a list (as append takes them)
    window = ak.sliding_window(1, align="bottom_right")
    with pytest.raises(ValueError, match=r"sliding_window\(1, align='bottom_right'\) over a "
                                         r"PagedKVCache chunk of 4 positions"):
        mha(x, mask=ak.causal() & window & ak.alibi(torch.ones(2, dtype=F64)),
            cache=PagedKVCache(8, 4), lengths=[3, 3])


def test_copies_under_autograd_are_sized_by_their_tokens():
    """A store that autograd keeps (one per step until the backward) is as large as its
    tokens, not the cache's capacity."""
    mha = MultiHeadAttention(16, 2).requires_grad_(False)
    prompt = torch.randn(1, 4, 16, requires_grad=True)
    _, _, cache = mha(prompt, cache=KVCache.empty(capacity=512), is_causal=True)
    for t in range(5):
        _, _, cache = mha(torch.randn(1, 1, 16), cache=cache, is_causal=True)
    assert cache._store.capacity == cache.length == 9


def test_a_paged_cache_propagates_shapes_on_meta():
    """Its tables and lengths are host integers: shape-only prefill and decode run."""
    mha = MultiHeadAttention(32, 4, device="meta")
    cache = PagedKVCache(16, 4)
    out, _, cache = mha(torch.empty(2, 5, 32, device="meta"), cache=cache, is_causal=True)
    assert out.shape == (2, 5, 32)
    out, _, _ = mha(torch.empty(2, 1, 32, device="meta"), cache=cache, is_causal=True)
    assert out.shape == (2, 1, 32)


_FSDP_MIXED_PRECISION = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import attnkit as ak
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
plain = ak.nn.MultiHeadAttention(16, 4)
sharded = ak.nn.MultiHeadAttention(16, 4)
sharded.load_state_dict(plain.state_dict())
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
    fully_shard(getattr(sharded, name), mp_policy=policy)
fully_shard(sharded, mp_policy=policy)
x = torch.randn(2, 6, 16)
out = sharded(x, is_causal=True).out
want = plain.to(torch.bfloat16)(x.to(torch.bfloat16), is_causal=True).out
assert out.dtype == torch.bfloat16 and torch.equal(out, want), (out - want).abs().max()
out.float().sum().backward()
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
mesh = init_device_mesh("cpu", (1,))
q = DTensor.from_local(torch.randn(1, 2, 4, 8), mesh, [Shard(1)])
try:
    ak.attention(q, q, q)
except TypeError as error:
    assert "DTensor" in str(error) and "to_local()" in str(error), error
else:
    raise AssertionError("a DTensor was taken")
dist.destroy_process_group()
print("ok")
"""


def test_fsdp_mixed_precision_with_projections_sharded_one_by_one():
    """FSDP2 with a bf16 ``param_dtype`` and each projection its own unit: the module's
    parameters are still sharded fp32 ``DTensor``s when its forward begins (each unit casts
    its weights and input when it runs), so they are not read as the module's dtype. And
    ``attention`` refuses DTensors by name, with the local-tensor route."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", _FSDP_MIXED_PRECISION], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PORT": str(port)})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_projections_sharded_by_heads_give_their_heads(gen):
    """A tensor-parallel rank's projections give a share of the heads (column-sharded q, k, v
    and row-sharded out): the module splits what they give into heads of ``head_dim``."""
    torch.manual_seed(0)
    full = MultiHeadAttention(16, 4, num_kv_heads=2)
    part = MultiHeadAttention(16, 4, num_kv_heads=2)
    part.load_state_dict(full.state_dict())
    # the first half of the heads: query heads 0-1 read key/value head 0
    part.q_proj, part.k_proj, part.v_proj = (_rows_of(p, n) for p, n in (
        (full.q_proj, 8), (full.k_proj, 4), (full.v_proj, 4)))
    part.out_proj = torch.nn.Linear(8, 16, bias=False)
    part.out_proj.weight.data = full.out_proj.weight.data[:, :8].clone()
    x = torch.randn(2, 5, 16, generator=gen)
    q = full.q_proj(x).unflatten(-1, (4, 4)).transpose(1, 2)[:, :2]
    k, v = (p(x).unflatten(-1, (2, 4)).transpose(1, 2)[:, :1] for p in (full.k_proj, full.v_proj))
    heads = ak.attention(q, k, v, ak.causal()).transpose(1, 2).flatten(-2)
    torch.testing.assert_close(part(x, is_causal=True).out, part.out_proj(heads))


def _rows_of(layer: torch.nn.Linear, rows: int) -> torch.nn.Linear:
    part = torch.nn.Linear(layer.in_features, rows)
    part.weight.data, part.bias.data = layer.weight.data[:rows].clone(), layer.bias.data[:rows].clone()
    return part


def test_projections_of_another_width_are_refused():
    """K/V projections giving more heads than ``num_kv_heads`` (weights from another layout)
    are refused, never read as another GQA grouping."""
    mha = MultiHeadAttention(32, 8, num_kv_heads=2)
    mha.k_proj, mha.v_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match="gave 8 query, 8 key and 8 value heads.*num_kv_heads=2"):
        mha(torch.randn(1, 5, 32))


def test_a_parameter_subclass_keeps_the_dtype_error():
    """A module whose weights are a ``Parameter`` subclass still names a dtype mismatch (only
    FSDP's sharded parameters are not read)."""
    class Tagged(torch.nn.Parameter):
        pass

    mha = MultiHeadAttention(16, 4)
    mha.q_proj.weight = Tagged(mha.q_proj.weight.data)
    with pytest.raises(TypeError, match="query has dtype torch.bfloat16"):
        mha(torch.randn(1, 5, 16, dtype=torch.bfloat16))
