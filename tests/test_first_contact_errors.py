"""The mistakes of a first call get a message that says what is wrong and how to fix it.

Habits carried over from ``torch.nn.functional.scaled_dot_product_attention`` (``attn_mask=``,
``is_causal=``, ``enable_gqa=``, ``[B, T, H, D]`` layouts), a mask factory passed without
calling it, nested tensors, and what :meth:`attnkit.nn.KVCache.append` is handed: each raises
a ``TypeError``/``ValueError`` naming the shapes and the fix, never an internal error.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention


def _qkv(gen, q_heads=4, kv_heads=2):
    q = torch.randn(2, q_heads, 8, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, 8, 16, generator=gen) for _ in range(2))
    return q, k, v


# ---- torch's keyword arguments ------------------------------------------------------------------

@pytest.mark.parametrize("name, value, hint", [
    ("is_causal", True, r"mask=ak\.causal\(\)"),
    ("attn_mask", torch.ones(8, 8, dtype=torch.bool), r"mask=attn_mask"),
    ("enable_gqa", True, r"GQA is automatic"),
])
def test_torch_keywords_get_the_attnkit_spelling(gen, name, value, hint):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=hint) as error:
        ak.attention(q, k, v, **{name: value})
    assert f"'{name}'" in str(error.value)


def test_several_torch_keywords_are_all_named(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=r"is_causal.*enable_gqa|enable_gqa.*is_causal") as error:
        ak.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert "mask=ak.causal()" in str(error.value) and "GQA is automatic" in str(error.value)


def test_an_unknown_keyword_is_still_a_plain_type_error(gen):
    """Keywords that are not torch's get Python's message, with the list of attnkit's."""
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'causal'.*return_lse"):
        ak.attention(q, k, v, causal=True)


@pytest.mark.parametrize("entry", ["plan", "explain_dispatch"])
def test_plan_and_explain_dispatch_spell_torch_keywords_as_attention_does(gen, entry):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=rf"(?s){entry}\(\) got unexpected keyword argument "
                                        r"'is_causal'.*mask=ak\.causal\(\)"):
        getattr(ak, entry)(q, k, v, is_causal=True)


@pytest.mark.parametrize("name, value, hint", [
    ("causal", True, r"mask=ak\.causal\(\"bottom_right\"\)"),
    ("softmax_scale", 0.5, r"`scale=`"),
    ("window_size", (4, 0), r"ak\.sliding_window\(left, right, \"bottom_right\"\)"),
    ("softcap", 30.0, r"ak\.softcap\(cap\)"),
    ("alibi_slopes", torch.ones(2), r"ak\.alibi\(slopes, \"bottom_right\"\)"),
    ("attn_mask", None, r"mask=attn_mask"),
])
def test_flash_attn_keywords_of_the_packed_and_paged_calls_get_the_attnkit_spelling(
        gen, name, value, hint):
    q = torch.randn(6, 2, 8, generator=gen)
    with pytest.raises(TypeError, match=rf"(?s)varlen_attention\(\).*'{name}'.*{hint}"):
        ak.varlen_attention(q, q, q, [0, 2, 6], **{name: value})
    pool = torch.randn(4, 4, 2, 8, generator=gen)
    with pytest.raises(TypeError, match=rf"(?s)paged_attention\(\).*'{name}'.*{hint}"):
        ak.paged_attention(q[None, :, :1], pool, pool, torch.tensor([[0, 1]]), [6],
                           **{name: value})


@pytest.mark.parametrize("name, hint", [
    ("block_mask", r"mask=ak\.from_function\(block_mask\.mask_mod\)"),
    ("score_mod", r"mask=ak\.score_function\(score_mod\)"),
])
def test_flex_attention_keywords_get_the_attnkit_spelling(gen, name, hint):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=rf"(?s)'{name}'.*FlexAttention's.*{hint}"):
        ak.attention(q, k, v, **{name: None})


def test_a_flex_block_mask_names_its_mask_function(gen):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    block_mask = create_block_mask(mask_mod, None, None, 8, 8, device="cpu")
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=r"BlockMask.*ak\.from_function\(block_mask\.mask_mod\)"):
        ak.attention(q, k, v, block_mask)
    torch.testing.assert_close(ak.attention(q, k, v, ak.from_function(block_mask.mask_mod)),
                               ak.attention(q, k, v, ak.causal()))


def test_a_mask_function_and_a_score_function_swapped_name_the_other():
    """FlexAttention's mask_mod and score_mod differ by the leading score argument."""
    with pytest.raises(TypeError, match=r"from_function\(\) takes fn\(b, h, q_idx, kv_idx\).*"
                                        r"ak\.score_function"):
        ak.from_function(lambda score, b, h, q_idx, kv_idx: score)
    with pytest.raises(TypeError, match=r"score_function\(\) takes fn\(score, b, h, q_idx, "
                                        r"kv_idx\).*ak\.from_function"):
        ak.score_function(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    ak.from_function(lambda *indices: indices[2] >= indices[3])  # any signature that binds


# ---- a mask factory passed uncalled -------------------------------------------------------------

@pytest.mark.parametrize("factory, call", [
    (ak.causal, r"ak\.causal\(\)"),
    (ak.padding, r"ak\.padding\("),  # padding() then says which lengths it needs
    (ak.sliding_window, r"ak\.sliding_window\(\.\.\.\)"),
    (ak.softcap, r"ak\.softcap\(\.\.\.\)"),
    (ak.masks.causal, r"ak\.causal\(\)"),
])
def test_a_mask_factory_passed_without_calling_it(gen, factory, call):
    q, k, v = _qkv(gen)
    for how in ("positional", "keyword"):
        with pytest.raises(TypeError, match=rf"call it.*{call}"):
            if how == "positional":
                ak.attention(q, k, v, factory)
            else:
                ak.attention(q, k, v, mask=factory)


def test_a_plain_function_as_the_mask_gets_the_wrapping_hint(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=r"ak\.from_function\(fn\).*ak\.score_function\(fn\)"):
        ak.attention(q, k, v, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


# ---- [B, T, H, D] layouts -----------------------------------------------------------------------

def test_a_batch_time_heads_layout_gets_the_transpose_hint(gen):
    """torch's ``[B, T, H, D]`` (as a projection's ``view`` gives it): dim -3 holds the lengths
    7 and 5, which do not divide, while dim -2 holds 8 and 2 heads."""
    q = torch.randn(2, 7, 8, 16, generator=gen)
    k, v = (torch.randn(2, 5, 2, 16, generator=gen) for _ in range(2))
    with pytest.raises(ValueError, match=r"\[B, H, T, D\].*x\.transpose\(1, 2\)") as error:
        ak.attention(q, k, v)
    assert "(2, 7, 8, 16)" in str(error.value) and "(2, 5, 2, 16)" in str(error.value)
    ak.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # the fix works
    q = torch.randn(2, 6, 8, 16, generator=gen)  # 6 heads over 4, 8 queries, 5 keys: no hint
    k, v = (torch.randn(2, 4, 5, 16, generator=gen) for _ in range(2))
    with pytest.raises(ValueError, match="multiple of key/value heads") as error:
        ak.attention(q, k, v)
    assert "transpose" not in str(error.value)


# ---- nested tensors -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_nested_tensors_are_refused_with_the_packing_and_padding_hints(gen, layout):
    seqs = [torch.randn(4, n, 16, generator=gen) for n in (3, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        nested = torch.nested.nested_tensor(seqs, layout=layout)
    for args in ((nested, nested, nested), (seqs[0], nested, nested)):
        with pytest.raises(TypeError, match=r"nested.*ak\.documents.*ak\.padding\(kv_lengths="):
            ak.attention(*args)
    with pytest.raises(TypeError, match="nested"):
        ak.explain_dispatch(nested, nested, nested)


def test_a_jagged_tensor_gets_the_varlen_route_and_the_route_runs(gen):
    seqs = [torch.randn(n, 2, 8, generator=gen) for n in (3, 5)]
    q = torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)  # [B, H, j, D]
    with pytest.raises(TypeError, match=r"varlen_attention\(x\.transpose\(1, 2\)\.values\(\)"):
        ak.attention(q, q, q)
    with pytest.raises(TypeError, match=r"q\.values\(\) and q\.offsets\(\)"):
        ak.varlen_attention(q, q, q, q.offsets())
    packed = q.transpose(1, 2).values()
    out = ak.varlen_attention(packed, packed, packed, q.offsets())
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).values()
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("make", [lambda t: ak.documents(t % 3),
                                  lambda t: ak.padding(kv_lengths=t[:2])])
def test_a_mask_built_on_meta_is_refused_with_real_inputs(gen, make):
    with torch.device("meta"):
        mask = make(torch.arange(6))
    q = torch.randn(2, 1, 6, 4, generator=gen)
    with pytest.raises(ValueError, match=r"meta tensor .* but q is on cpu: build the mask"):
        ak.attention(q, q, q, mask)


def test_an_sdpa_kernel_context_without_a_kernel_for_the_call_names_the_route(gen):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 2, 6, 8, generator=gen)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        with pytest.raises(RuntimeError, match=r"sdpa_kernel allowing EFFICIENT_ATTENTION.*"
                                               r"backend='tiled'"):
            ak.attention(q, q, q, ak.causal(), backend="torch")
        out = ak.attention(q, q, q, ak.causal(), backend="tiled")
    torch.testing.assert_close(out, ak.attention(q, q, q, ak.causal(), backend="reference"))


def test_another_error_inside_an_sdpa_kernel_context_keeps_its_type(gen, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", out_of_memory)
    q = torch.randn(1, 2, 6, 8, generator=gen)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            ak.attention(q, q, q, ak.causal(), backend="torch")


# ---- KVCache.append -----------------------------------------------------------------------------

def _caches():
    return {"empty": KVCache.empty(),
            "filled": KVCache.empty().append(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))}


def _z(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("which", ["empty", "filled"])
@pytest.mark.parametrize("keys, values, error, match", [
    (_z(2, 3, 4), _z(2, 3, 4), ValueError, r"\[B, Hkv, t, D\].*keys \(2, 3, 4\).*unsqueeze\(1\)"),
    ([[[[0.0] * 4]]] * 2, [[[[0.0] * 4]]] * 2, TypeError, r"torch\.Tensor.*list"),
    (_z(2, 1, 2, 4), _z(2, 1, 3, 4), ValueError, r"keys \(2, 1, 2, 4\).*values \(2, 1, 3, 4\).*t"),
    (_z(2, 1, 2, 4), _z(1, 1, 2, 4), ValueError, r"keys \(2, 1, 2, 4\).*values \(1, 1, 2, 4\)"),
    (_z(2, 1, 2, 4), _z(2, 2, 2, 4), ValueError, r"keys \(2, 1, 2, 4\).*values \(2, 2, 2, 4\)"),
    (_z(2, 1, 2, 4), _z(2, 1, 2, 4, dtype=torch.float64), TypeError, r"float32.*float64.*\.to\("),
    (_z(2, 1, 2, 4, dtype=torch.long), _z(2, 1, 2, 4, dtype=torch.long), TypeError, r"floating-point dtype.*int64"),
], ids=["3-D", "lists", "t differs", "B differs", "Hkv differs", "dtype differs", "integer"])
def test_kv_cache_append_refuses_keys_and_values_that_do_not_fit(which, keys, values, error, match):
    with pytest.raises(error, match=match):
        _caches()[which].append(keys, values)


@pytest.mark.parametrize("which", ["empty", "filled"])
@pytest.mark.parametrize("lengths, match", [
    ("12", r"lengths.*integer.*\[B\] = \[2\].*str"),
    (torch.tensor([True, False]), r"lengths.*torch\.bool.*sum\(-1\)"),
    ([True, False], r"lengths.*torch\.bool.*sum\(-1\)"),
    (torch.tensor([1.0, 2.0]), r"lengths.*torch\.float32.*\.long\(\)"),
    ([1.5, 2.0], r"lengths.*torch\.float32.*\.long\(\)"),
], ids=["str", "bool tensor", "bool list", "float tensor", "float list"])
def test_kv_cache_append_refuses_lengths_that_are_not_integers(which, lengths, match):
    with pytest.raises(TypeError, match=match):
        _caches()[which].append(_z(2, 1, 2, 4), _z(2, 1, 2, 4), lengths=lengths)


def test_kv_cache_lengths_are_integers_as_a_list_or_tensor_and_through_the_module():
    for lengths in ([1, 2], torch.tensor([1, 2], dtype=torch.int32)):
        cache = KVCache.empty().append(_z(2, 1, 2, 4), _z(2, 1, 2, 4), lengths=lengths)
        assert cache.lengths.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"\[B\] = \[2\].*\(1, 2\)"):
        KVCache.empty().append(_z(2, 1, 2, 4), _z(2, 1, 2, 4), lengths=[[1, 2]])
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"lengths.*torch\.bool"):
        mha(torch.randn(2, 3, 8), cache=mha.empty_cache(), lengths=torch.tensor([True, True]))


def test_an_optional_mask_and_tensors_on_the_left_combine():
    """``mask & None`` is the mask (an optional user mask); ``| None`` says why not; a bool
    tensor on the left of & or | becomes a dense mask."""
    q = torch.randn(1, 1, 4, 8)
    assert (ak.causal() & None) is not None
    torch.testing.assert_close(ak.attention(q, q, q, ak.causal() & None),
                               ak.attention(q, q, q, ak.causal()))
    with pytest.raises(TypeError, match="None is no mask"):
        ak.causal() | None
    assert repr(None & ak.causal()) == "causal()"  # built up from `mask = None`
    with pytest.raises(TypeError, match="None is no mask"):
        None | ak.causal()
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(ak.attention(q, q, q, allowed & ak.causal()),
                               ak.attention(q, q, q, ak.causal()))
    torch.testing.assert_close(ak.attention(q, q, q, allowed | ak.causal()),
                               ak.attention(q, q, q, ak.causal()))


@pytest.mark.parametrize("side", ["kv", "q"])
def test_a_padding_read_from_a_mask_of_another_batch_is_refused(side):
    q = torch.randn(2, 2, 6, 8)
    real = torch.ones(3, 6, dtype=torch.bool)
    mask = ak.padding(**{f"{side}_mask": real})
    for backend in ("auto", "torch", "tiled", "reference"):
        with pytest.raises(ValueError, match=f"{side}_mask has 3 rows but the batch has 2"):
            ak.attention(q, q, q, mask, backend=backend)


def test_misused_arguments_get_clear_errors():
    """A module given another dtype than its weights, a plan given a non-tensor, a scale past
    float32's range with float32 inputs, and flags that are not bools: each a clear error;
    numpy scalars are numbers; a bool scale is refused whatever the calls before it."""
    import numpy as np

    mha = MultiHeadAttention(16, 2)
    with pytest.raises(TypeError, match="weights are torch.float32"):
        mha(torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating point"):
        mha(torch.ones(1, 3, 16, dtype=torch.long))
    q = torch.randn(1, 2, 4, 8)
    plan = ak.plan(q, q, q)
    with pytest.raises(TypeError, match="got ndarray for q"):
        plan(q.numpy(), q, q)
    with pytest.raises(ValueError, match="beyond float32's range"):
        ak.attention(q, q, q, scale=1e39)
    ak.attention(q.double(), q.double(), q.double(), scale=1e39)  # float64 scores hold it
    for flag in ("return_lse", "return_weights"):
        with pytest.raises(TypeError, match=f"{flag}='False'"):
            ak.attention(q, q, q, **{flag: "False"})
    torch.testing.assert_close(ak.attention(q, q, q, scale=np.float32(0.5)),
                               ak.attention(q, q, q, scale=0.5))
    ak.attention(q, q, q, scale=1)
    with pytest.raises(TypeError, match="scale must be a float"):
        ak.attention(q, q, q, scale=True)


def test_a_cache_of_the_callers_tensors_checks_what_append_would():
    k = v = torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match="not supported with a window"):
        KVCache(k, v, 5, lengths=torch.tensor([5, 4]), window=2)
    with pytest.raises(ValueError, match="offset=-3"):
        KVCache(k, v, 5, offset=-3)
    with pytest.raises(ValueError, match="appended=\\[5, 5\\] outside"):
        KVCache(k, v, 5, lengths=torch.tensor([1, 2]), appended=torch.tensor([5, 5]))
    with pytest.raises(TypeError, match="appended="):
        KVCache(k, v, 5, lengths=torch.tensor([1, 2]), appended=[1, 1])
    KVCache(k, v, 5, lengths=torch.tensor([1, 2]), appended=torch.tensor([1, 2]))


def test_serving_calls_refuse_what_they_cannot_take():
    q = torch.randn(6, 2, 8)
    with pytest.raises(TypeError, match="max_seqlen_q=7.9"):
        ak.varlen_attention(q, q, q, torch.tensor([0, 2, 6]), max_seqlen_q=7.9)
    ak.varlen_attention(q, q, q, torch.tensor([0, 2, 6]), max_seqlen_q=torch.tensor(4))
    with pytest.raises(TypeError, match="floating point"):
        ak.varlen_attention(q.long(), q, q, torch.tensor([0, 2, 6]))
    with pytest.raises(TypeError, match="seqused_k must be integers"):
        ak.varlen_attention(q, q, q, torch.tensor([0, 2, 6]), seqused_k="ab")
    pool = torch.randn(4, 4, 2, 8)
    with pytest.raises(TypeError, match="floating point"):
        ak.paged_attention(torch.ones(1, 2, 1, 8, dtype=torch.long), pool, pool,
                           torch.tensor([[0]]), [3])
