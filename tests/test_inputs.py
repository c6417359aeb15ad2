"""Every bad input raises ValueError/TypeError from validation — never AssertionError, never a
RuntimeError from deep inside torch — with a message that names the shapes and a fix."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks import MaskSpace
from conftest import naive_attention


def qkv(q_shape=(2, 4, 5, 8), k_shape=(2, 4, 6, 8), v_shape=None, dtype=torch.float32):
    v_shape = v_shape or k_shape
    return tuple(torch.randn(s, dtype=dtype) for s in (q_shape, k_shape, v_shape))


def raises(exc, call, *words):
    """Run ``call``; it must raise exactly ``exc`` (not a subclass of AssertionError or a bare
    RuntimeError) whose message contains every word (case-insensitive)."""
    with pytest.raises((ValueError, TypeError, AssertionError, RuntimeError)) as info:
        call()
    assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in message:\n{message}"
    return message


def test_dk_mismatch():
    q, k, v = qkv((2, 4, 5, 8), (2, 4, 6, 7))
    raises(ValueError, lambda: ak.attention(q, k, v), "Dk", "(2, 4, 5, 8)", "(2, 4, 6, 7)")


def test_kv_length_mismatch():
    q, k, v = qkv((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 7, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "length", "(2, 4, 6, 8)", "(2, 4, 7, 8)")


def test_kv_heads_mismatch():
    q, k, v = qkv((2, 4, 5, 8), (2, 2, 6, 8), (2, 4, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "k and v", "(2, 2, 6, 8)", "(2, 4, 6, 8)")


def test_heads_not_a_multiple():
    q, k, v = qkv((2, 8, 5, 8), (2, 3, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "multiple", "3 heads", "8", "(2, 8, 5, 8)")


def test_batch_mismatch():
    q, k, v = qkv((2, 4, 5, 8), (3, 4, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "batch", "(2, 4, 5, 8)", "(3, 4, 6, 8)")
    q, k, v = qkv((2, 5, 8), (3, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "batch", "(2, 5, 8)", "(3, 6, 8)")


def test_rank_mismatch():
    q, k, v = qkv((2, 4, 5, 8), (4, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v), "dims", "(2, 4, 5, 8)", "(4, 6, 8)")


@pytest.mark.parametrize("mask_shape", [(5, 7), (3, 1, 5, 6), (2, 4, 5, 6, 1), (4, 6, 5)])
def test_mask_not_broadcastable(mask_shape):
    q, k, v = qkv()
    for mask in (torch.ones(mask_shape, dtype=torch.bool), torch.zeros(mask_shape)):
        raises(ValueError, lambda: ak.attention(q, k, v, mask=mask), "broadcast", str(mask_shape))
        combined = ak.causal() & ak.masks.as_mask(mask)
        raises(ValueError, lambda: ak.attention(q, k, v, mask=combined), "broadcast", str(mask_shape))


def test_mask_broadcast_to_3d_inputs():
    q, k, v = qkv((2, 5, 8), (2, 6, 8))
    raises(ValueError, lambda: ak.attention(q, k, v, mask=torch.ones(3, 5, 6, dtype=torch.bool)),
           "broadcast", "(3, 5, 6)")


@pytest.mark.parametrize("kwargs,words", [
    (dict(kv_lengths=[7, 2]), ["kv_lengths", "[7, 2]", "[0, 6]"]),
    (dict(kv_lengths=[-1, 2]), ["kv_lengths", "[-1, 2]", "range"]),
    (dict(q_lengths=[6, 2]), ["q_lengths", "[6, 2]", "[0, 5]"]),
    (dict(kv_lengths=[1, 2, 3]), ["kv_lengths", "3 entries", "batch has 2"]),
    (dict(q_lengths=[]), ["q_lengths", "0 entries"]),
])
def test_padding_lengths(kwargs, words):
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, mask=ak.padding(**kwargs)), *words)
    raises(ValueError, lambda: ak.attention(q, k, v, mask=ak.causal() & ak.padding(**kwargs)), *words)


def test_padding_float_lengths():
    raises(TypeError, lambda: ak.padding(kv_lengths=torch.tensor([2.0, 3.0])), "integer")
    raises(ValueError, lambda: ak.padding(), "q_lengths or kv_lengths")


def test_window_arguments():
    raises(ValueError, lambda: ak.sliding_window(-2), "negative", "left=-2")
    raises(ValueError, lambda: ak.sliding_window(2, -1), "negative", "right=-1")
    raises(TypeError, lambda: ak.sliding_window(2.0), "int", "left=2.0")
    raises(TypeError, lambda: ak.sliding_window(True), "int")
    raises(TypeError, lambda: ak.sliding_window(None), "int")
    raises(ValueError, lambda: ak.causal("top"), "align", "bottom_right")


def test_dtype_mismatch():
    q = torch.randn(2, 5, 8)
    k = v = torch.randn(2, 6, 8, dtype=torch.float64)
    raises(TypeError, lambda: ak.attention(q, k, v), "dtype", "float32", "float64", "(2, 5, 8)")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_inputs(dtype):
    q = torch.ones(2, 5, 8, dtype=dtype)
    k = v = torch.ones(2, 6, 8, dtype=dtype)
    raises(TypeError, lambda: ak.attention(q, k, v), "floating point", str(dtype), ".float()")


def test_non_tensor_inputs():
    k = v = torch.randn(6, 8)
    raises(TypeError, lambda: ak.attention([[1.0] * 8], k, v), "q must be a torch.Tensor", "list")


@pytest.mark.parametrize("shape", [(8,), ()])
def test_1d_inputs(shape):
    q = torch.randn(shape)
    k = v = torch.randn(6, 8)
    raises(ValueError, lambda: ak.attention(q, k, v), "at least 2 dims", str(tuple(shape)), "q[None]")


def test_empty_feature_dim():
    q, k, v = qkv((5, 0), (6, 0))
    raises(ValueError, lambda: ak.attention(q, k, v), "empty feature dim")


def test_device_mismatch_with_meta():
    """Two devices can be fabricated with the meta device; validation must catch the mix
    before torch raises from inside a matmul."""
    q = torch.randn(2, 5, 8, device="meta")
    k = v = torch.randn(2, 6, 8)
    raises(ValueError, lambda: ak.attention(q, k, v), "device", "meta", "cpu", ".to(")


def test_meta_inputs_propagate_shapes_on_any_backend():
    """Meta tensors hold no values: every backend name gives the shapes (tests/test_shape_only.py
    covers the mask kinds)."""
    q, k, v = (t.to("meta") for t in qkv())
    for backend in ("auto", "tiled", "reference"):
        out = ak.attention(q, k, v, backend=backend)
        assert out.device.type == "meta" and out.shape == q.shape


def test_mask_on_another_device():
    q, k, v = qkv()
    mask = torch.ones(5, 6, dtype=torch.bool, device="meta")
    raises(ValueError, lambda: ak.attention(q, k, v, mask=mask), "mask", "meta", "cpu")


@pytest.mark.parametrize("name", ["flash", "Reference", "", None, 0])
def test_unknown_backend(name):
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, backend=name), "unknown backend", "auto", "reference")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_bad_scale_value(scale):
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, scale=scale), "scale", "finite")


@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5), [1.0]])
def test_bad_scale_type(scale):
    q, k, v = qkv()
    raises(TypeError, lambda: ak.attention(q, k, v, scale=scale), "scale")


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, float("nan"), "0.1", True])
def test_bad_dropout(p):
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, dropout_p=p), "dropout_p", "[0, 1)")


def test_bad_generator():
    q, k, v = qkv()
    raises(TypeError, lambda: ak.attention(q, k, v, dropout_p=0.1, generator=123), "generator")


def test_documents_wrong_length():
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, mask=ak.documents([0, 0, 1, 1])),
           "documents", "q_ids", "(4,)", "5 positions")
    raises(ValueError, lambda: ak.attention(q, k, v, mask=ak.documents([0, 0, 1, 1, 1], [0, 1])),
           "documents", "kv_ids", "(2,)", "6 positions")
    raises(ValueError, lambda: ak.attention(q, k, v, mask=ak.documents(torch.zeros(3, 5, dtype=torch.long),
                                                                          torch.zeros(3, 6, dtype=torch.long))),
           "documents", "3 rows", "batch has 2")
    raises(TypeError, lambda: ak.documents(torch.zeros(2, 2, 5, dtype=torch.long)), "documents", "[B, T]")


def test_float_mask_to_dense_and_bool_to_bias():
    raises(TypeError, lambda: ak.dense(torch.zeros(5, 6)), "bool", "bias")
    raises(TypeError, lambda: ak.bias(torch.ones(5, 6, dtype=torch.bool)), "float", "dense")
    raises(TypeError, lambda: ak.bias(torch.ones(5, 6, dtype=torch.long)), "float")


@pytest.mark.parametrize("mask", [[[True] * 6] * 5, "causal", 1.0, torch.ones(5, 6, dtype=torch.long)])
def test_mask_of_wrong_type(mask):
    q, k, v = qkv()
    raises(TypeError, lambda: ak.attention(q, k, v, mask=mask), "mask", "bool tensor")


def test_bias_dtype_mismatch():
    q, k, v = qkv(dtype=torch.bfloat16)
    raises(TypeError, lambda: ak.attention(q, k, v, mask=torch.zeros(5, 6, dtype=torch.float16)),
           "bias", "float16", "bfloat16")


def test_valid_edge_inputs_do_not_raise():
    """The validation is not over-eager: broadcastable masks, GQA, bias in fp32 for fp16 inputs."""
    q, k, v = qkv((2, 8, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3), dtype=torch.float16)
    for mask in (None, torch.ones(5, 6, dtype=torch.bool), torch.zeros(2, 1, 5, 6),
                 torch.zeros(1, 8, 1, 6, dtype=torch.float32), ak.causal() & ak.padding(kv_lengths=[6, 0])):
        out = ak.attention(q, k, v, mask=mask)
        assert out.shape == (2, 8, 5, 3) and out.dtype == torch.float16


# ---- the call cache: validation and dispatch once per signature ---------------------------------

def test_repeated_calls_validate_once(validations):
    """Identical calls (new tensors of the same signature) validate and dispatch once, with the
    same results as a validated call; a mask object equal by value (a band) hits too."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
        out = ak.attention(q, k, v, ak.causal())
        torch.testing.assert_close(out, ak.attention(q, k, v, ak.causal(), backend="reference"))
    assert len(validations) == 2  # one auto, one reference
    q3 = torch.randn(5, 8, generator=gen)  # [T, D]: its own layout
    ak.attention(q3, q3, q3)
    ak.attention(q3 + 1, q3, q3)
    assert len(validations) == 3


def test_the_cache_sees_what_changes_the_answer(validations):
    """Another shape, dtype, requires_grad, grad mode, option, or a mask tensor written in place
    validates again; masks without a cache key (dense) and dropout always do."""
    q = torch.randn(1, 2, 6, 8)
    lengths = torch.tensor([4])
    mask = ak.padding(kv_lengths=lengths)
    ak.attention(q, q, q, mask)
    ak.attention(q, q, q, mask)
    assert len(validations) == 1
    lengths[0] = 2  # in place: the next call sees the new lengths
    out = ak.attention(q, q, q, mask)
    torch.testing.assert_close(out, ak.attention(q, q, q, ak.padding(kv_lengths=[2]), backend="reference"))
    assert len(validations) == 3
    before = len(validations)
    for call in (lambda: ak.attention(q.double(), q.double(), q.double()),
                 lambda: ak.attention(q.requires_grad_(), q, q),
                 lambda: ak.attention(q, q, q, scale=0.5),
                 lambda: ak.attention(q, q, q, return_lse=True)):
        call()
        call()
    with torch.no_grad():
        ak.attention(q, q, q)
    assert len(validations) == before + 5
    dense = torch.ones(6, 6, dtype=torch.bool)
    ak.attention(q, q, q, dense)
    ak.attention(q, q, q, dense)
    ak.attention(q, q, q, dropout_p=0.1)
    ak.attention(q, q, q, dropout_p=0.1)
    assert len(validations) == before + 9


def test_bad_calls_still_raise_after_good_ones(validations):
    q = torch.randn(1, 2, 6, 8)
    ak.attention(q, q, q)
    with pytest.raises(ValueError, match="feature dim"):
        ak.attention(q, torch.randn(1, 2, 6, 4), q)
    with pytest.raises(TypeError, match="scale must be a float"):
        ak.attention(q, q, q, scale=[0.5])  # unhashable: validation says what is wrong


def test_decode_steps_over_a_concatenated_cache_validate_once(validations):
    """A cache grown by ``torch.cat`` (transformers' dynamic cache) is a new contiguous tensor
    each step, its strides changing with its length: the steps after the first still hit,
    and compute the step they are given."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    before = None
    for _ in range(4):
        new = torch.randn(2, 2, 1, 8, generator=gen)
        k, v = torch.cat([k, new], 2), torch.cat([v, 2 * new], 2)
        q = torch.randn(2, 1, 4, 8, generator=gen).transpose(1, 2)  # [B, H, 1, D], a view
        out = ak.attention(q, k, v, scale=0.5)
        want = naive_attention(q.double(), k.double(), v.double(), scale=0.5)[0]
        torch.testing.assert_close(out, want.float())
        before = len(validations) if before is None else before
    assert len(validations) == before == 1


def test_decode_steps_over_a_growing_cache_validate_once(validations):
    """One query under bottom-right causal (or no mask) over a cache that grows by a position
    a step: the key length does not change the validation or the backend, so the steps after
    the first reuse them (the cache's views keep their strides while its buffer has room)."""
    from attnkit.nn import KVCache

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 30, 8, generator=gen), torch.randn(2, 2, 30, 8, generator=gen)
    q = torch.randn(2, 4, 30, 8, generator=gen)
    full = ak.attention(q, k, v, ak.causal())
    before = len(validations)
    cache = KVCache.empty(capacity=32).append(k[:, :, :8], v[:, :, :8])
    outs = [ak.attention(q[:, :, :8], cache.keys, cache.values, cache.mask())]
    for t in range(8, 30):
        cache = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        outs.append(ak.attention(q[:, :, t:t + 1], cache.keys, cache.values, cache.mask()))
    torch.testing.assert_close(torch.cat(outs, 2), full)
    assert len(validations) - before == 2  # the prefill chunk, then the first decode step


def test_ragged_decode_validates_once_and_runs_each_layer_on_its_own_lengths(validations):
    """A ragged cache's step mask is new in every layer (each layer's cache has its own
    lengths); it is keyed by shapes alone, the cache's growing length included, so only the
    first call validates, and each layer still runs on its own lengths (a stale mask would
    let a sequence see keys past its length)."""
    from attnkit.nn import KVCache

    gen = torch.Generator().manual_seed(1)
    batch, steps, layers = 3, 4, 3
    prompt = torch.randn(batch, 2, 5, 8, generator=gen)
    starts = [torch.tensor([2, 5, 3]), torch.tensor([4, 1, 5]), torch.tensor([1, 2, 3])]
    caches = [KVCache.empty(capacity=16).append(prompt, prompt, lengths) for lengths in starts]
    before = len(validations)
    for step in range(steps):
        for layer in range(layers):
            new = torch.randn(batch, 2, 1, 8, generator=gen)
            caches[layer] = cache = caches[layer].append(new, new)
            q = torch.randn(batch, 2, 1, 8, generator=gen)
            out = ak.attention(q, cache.keys, cache.values, cache.mask())
            allowed = ak.padding(kv_lengths=starts[layer] + step + 1).to_dense(
                MaskSpace(batch, 2, 1, cache.keys.shape[2]))
            want = naive_attention(q, cache.keys, cache.values, allowed)[0]
            torch.testing.assert_close(out, want.float())
    assert len(validations) - before == 1  # the first call: later steps key alike


def test_left_padded_decode_masks_read_from_key_masks_validate_once(validations):
    """transformers makes a new padding from its ``attention_mask`` every decoding step, the
    keys one longer each time: the runs are read and checked when the mask is made, so the
    call is keyed by shapes and validates once; each step still runs on its own runs.
    Whether runs start past 0 (left padding) and whether the widths are the call's are
    keyed: a mask of the wrong width still raises, and right padding validates anew."""
    gen = torch.Generator().manual_seed(4)
    starts = torch.tensor([3, 0, 5])
    before = len(validations)
    for length in range(8, 12):
        q = torch.randn(3, 2, 1, 8, generator=gen)
        k, v = (torch.randn(3, 2, length, 8, generator=gen) for _ in range(2))
        real = torch.arange(length) >= starts[:, None]  # [B, Tk], left padding
        for _ in range(2):  # two layers, each with its own plan
            out = ak.plan(q, k, v, ak.padding(kv_mask=real))(q, k, v)
            want = naive_attention(q.double(), k.double(), v.double(),
                                   real[:, None, None, :])[0]
            torch.testing.assert_close(out, want.float())
    assert len(validations) - before == 1
    with pytest.raises(ValueError, match="columns"):
        ak.attention(q, k, v, ak.padding(kv_mask=real[:, 1:]))
    ak.attention(q, k, v, ak.padding(kv_mask=torch.arange(length) < 9 - starts[:, None]))
    assert len(validations) - before == 3


def test_known_keys_everywhere_skips_the_row_flags():
    """A decoding step's mask vouches that every row has a key, a key mask's runs show it:
    no per-row flags are made."""
    from attnkit.inputs import validate
    from attnkit.masks import every_row_has_key, vouched_padding

    q = torch.randn(2, 1, 1, 4)
    k = torch.randn(2, 1, 6, 4)
    lengths = torch.tensor([3, 6])
    everywhere = vouched_padding(None, lengths, keys_everywhere=True)
    assert every_row_has_key(everywhere) and every_row_has_key(None)
    assert not every_row_has_key(vouched_padding(None, lengths))
    assert not every_row_has_key(ak.padding(kv_lengths=lengths))
    # a key mask's runs are read once when the mask is made: whether a row is empty with them
    real = torch.tensor([[False, True, True], [True, True, True]])
    assert every_row_has_key(ak.padding(kv_mask=real))
    assert not every_row_has_key(ak.padding(kv_mask=real & torch.tensor([True, True, False]),
                                            q_mask=real))
    empty_row = torch.tensor([[False, False, False], [True, True, True]])
    assert not every_row_has_key(ak.padding(kv_mask=empty_row, allow_empty_rows=True))
    assert validate(q, k, k, everywhere).has_key() is None
    from attnkit.masks import _walk_tensors, mask_tensors  # given by the producer, as found
    for made in (everywhere, vouched_padding(lengths, lengths)):
        assert [id(t) for t in mask_tensors(made)] == [id(t) for t in _walk_tensors(made)[0]]
    assert validate(q, k, k, ak.padding(kv_lengths=lengths)).has_key().all()
    torch.testing.assert_close(ak.attention(q, k, k, everywhere),
                               ak.attention(q, k, k, ak.padding(kv_lengths=lengths),
                                            backend="reference"))
    with pytest.raises(ValueError, match="q_lengths=None"):
        vouched_padding(lengths, lengths, keys_everywhere=True)


def test_a_mask_keyed_by_shapes_still_keys_the_dense_bias_limit():
    """A decoding step's mask is keyed without the cache length, but not across the length
    beyond which ``auto`` stops materialising the mask (a hit there would keep the torch
    backend's dense bias for a cache of any length)."""
    from attnkit import call
    from attnkit.masks import DENSE_MAX_SCORES, vouched_padding

    q = torch.randn(1, 1, 1, 4)
    for kv_len, name in ((8, "torch"), (DENSE_MAX_SCORES + 1, "tiled"), (9, "torch")):
        k = torch.randn(1, 1, kv_len, 4)
        mask = vouched_padding(None, torch.tensor([kv_len - 1]), keys_everywhere=True)
        _, chosen = call.validated(q, k, k, mask, scale=None, dropout_p=0.0, generator=None,
                                   backend="auto", return_lse=False, return_weights=False,
                                   compiling=False)
        assert chosen.NAME == name, kv_len
        want = naive_attention(q, k, k, mask.to_dense(MaskSpace(1, 1, 1, kv_len)))[0]
        torch.testing.assert_close(ak.attention(q, k, k, mask), want.float())


def test_documents_over_one_ids_tensor_need_no_row_or_key_flags():
    """Documents whose queries and keys are one ids tensor: each token sees itself, so every
    row has a key and every key a row, known without a read; other ids tensors (equal in
    value or not) are unknown."""
    from attnkit.masks import every_key_seen, every_row_has_key

    ids = torch.tensor([0, 0, 1, 2, 2])
    for mask in (ak.documents(ids), ak.documents(ids, causal="top_left"),
                 ak.documents(ids, causal="bottom_right")):
        assert every_row_has_key(mask) and every_key_seen(mask)
    for mask in (ak.documents(ids, ids.clone()), ak.documents(ids, causal="top_left") & ak.causal(),
                 ak.padding(kv_lengths=[3])):
        assert not every_key_seen(mask)
    assert not every_row_has_key(ak.documents(ids, torch.tensor([0, 1, 1, 2, 2])))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_a_band_knows_its_rows_and_keys_from_the_shapes(align):
    """Causal masks and windows: whether every row has a key and every key a row, known from
    the call's shapes, equals the evaluated mask on every shape tried (never claimed wrongly,
    and claimed where it holds)."""
    from attnkit.masks import MaskSpace, _Band, every_key_seen, every_row_has_key

    windows = [(None, 0), (None, None), (2, 0), (0, 0), (3, 1), (0, 2), (None, 1), (1, None)]
    claimed = 0
    for tq in (1, 2, 5, 8):
        for tk in (1, 3, 5, 9):
            space = MaskSpace(batch=1, heads=1, q_len=tq, kv_len=tk, device=torch.device("cpu"))
            for left, right in windows:
                mask = _Band(left, right, align)  # (None, 0): causal
                allowed = mask.to_dense(space)[0, 0]
                rows, keys = bool(allowed.any(1).all()), bool(allowed.any(0).all())
                assert every_row_has_key(mask, space) == rows, (tq, tk, left, right)
                assert every_key_seen(mask, space) == keys, (tq, tk, left, right)
                claimed += rows + keys
    assert claimed > 50
    assert not every_row_has_key(ak.causal()) and not every_key_seen(ak.causal())  # no space


def test_a_validated_call_derives_once_and_shares_only_what_its_mask_keys(validations):
    """Validation gives a call its own store of derived values (the backend's choice and its
    run ask alike: computed once); a hit shares it when the mask is keyed by its tensors, not
    when it is keyed by shape (each hit then brings a new mask)."""
    from attnkit import call
    from attnkit.inputs import derived
    from attnkit.masks import vouched_padding

    q = torch.randn(2, 1, 1, 8)
    k = torch.randn(2, 1, 6, 8)

    def validated(mask):
        return call.validated(q, k, k, mask, scale=None, dropout_p=0.0, generator=None,
                              backend="auto", return_lse=False, return_weights=False,
                              compiling=False)[0]

    padding = ak.padding(kv_lengths=torch.tensor([3, 6]))
    first, computed = validated(padding), []
    for _ in range(2):
        assert derived(first, "value", lambda: computed.append(1) or len(computed)) == 1
    assert validated(padding).derived is first.derived and len(validations) == 1
    lengths = torch.tensor([3, 6])
    alone = validated(vouched_padding(None, lengths))
    hit = validated(vouched_padding(None, lengths.clone()))
    assert len(validations) == 2 and isinstance(alone.derived, dict) and hit.derived is None


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("name", ["q", "k", "v", "mask", "bool mask", "ids", "slopes"])
def test_sparse_tensors_are_refused_naming_the_argument_and_the_fix(name, layout):
    """A sparse tensor as q, k, v or in the mask is refused by validation, with its name, its
    layout and `.to_dense()` (not torch's error about strides or a missing sparse kernel)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 8, generator=gen), torch.randn(2, 6, 8, generator=gen),
               torch.randn(2, 6, 8, generator=gen))

    def sparse(t):
        return t.to_sparse() if layout == "coo" else t.to_sparse_csr()

    tensors, mask, words = dict(q=q, k=k, v=v), None, [name]
    if name in tensors:
        tensors[name] = sparse(tensors[name])
    elif name in ("mask", "bool mask"):
        bias = torch.randn(5, 6, generator=gen)
        mask, words = sparse(bias if name == "mask" else bias > 0), ["mask"]
    elif name == "ids":
        ids = torch.tensor([[0, 0, 1, 1, 1, 1]]).expand(2, 6)
        tensors = dict(q=k, k=k, v=v)
        mask, words = ak.documents(sparse(ids)), ["documents mask's q_ids"]
    else:  # ALiBi slopes (a CSR tensor has 2 dims at least)
        slopes = torch.tensor([0.5, 0.25])
        mask = ak.alibi(slopes.to_sparse() if layout == "coo" else slopes[None].to_sparse_csr())
        words = ["alibi mask's slopes"]
    raises(TypeError, lambda: ak.attention(tensors["q"], tensors["k"], tensors["v"], mask=mask),
           *words, f"sparse_{layout}", ".to_dense()")


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "triton"])
def test_negative_views_attend_as_the_values_they_read_as(backend, monkeypatch):
    """``torch._neg_view(t)`` reads as ``-t`` with ``t``'s memory: q, k, v, a bias and ALiBi
    slopes given as such views give what ``-t`` materialised gives (float64 reference), on
    every backend, with a padding mask too (whose rows without keys zero by bits)."""
    from conftest import import_triton_interpreted, interpreted_triton_launch

    if backend == "triton":
        import_triton_interpreted()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        interpreted_triton_launch()  # skips where triton runs compiled
    gen = torch.Generator().manual_seed(0)
    tensors = dict(q=torch.randn(2, 2, 5, 8, generator=gen),
                   k=torch.randn(2, 2, 6, 8, generator=gen),
                   v=torch.randn(2, 2, 6, 8, generator=gen),
                   bias=torch.randn(5, 6, generator=gen), slopes=torch.tensor([0.5, -0.25]))
    lengths = torch.tensor([0, 4])  # the first sequence has no key

    def call(t, backend):
        mask = ak.padding(kv_lengths=lengths) & ak.bias(t["bias"]) & ak.alibi(t["slopes"])
        return ak.attention(t["q"], t["k"], t["v"], mask=mask, backend=backend)

    for name in tensors:
        given = dict(tensors, **{name: torch._neg_view(tensors[name])})
        assert given[name].is_neg()
        truth = call({n: (-t if n == name else t).double() for n, t in tensors.items()},
                     "reference")
        torch.testing.assert_close(call(given, backend).double(), truth, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name} as a negative view: {m}")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_inputs_say_dequantize():
    """A quantized tensor has no ``.float()``: the error says ``.dequantize()``."""
    if not hasattr(torch, "quantize_per_tensor"):
        pytest.skip("this torch has no quantized tensors")
    q, k, v = qkv()
    quantized = torch.quantize_per_tensor(q, 0.1, 0, torch.qint8)
    message = raises(TypeError, lambda: ak.attention(quantized, k, v), "qint8", "q.dequantize()")
    assert ".float()" not in message


def test_mask_tensor_device_and_bias_dtype_errors_name_the_shapes():
    """A mask tensor on another device and a bias of a narrower dtype than q are named by
    their shapes, with the fix."""
    q, k, v = qkv()
    raises(ValueError, lambda: ak.attention(q, k, v, mask=torch.zeros(5, 6, device="meta")),
           "(5, 6)", "meta", "cpu", ".to(q.device)")
    q, k, v = qkv(dtype=torch.float32)
    raises(TypeError, lambda: ak.attention(q, k, v, mask=torch.zeros(1, 5, 6, dtype=torch.float16)),
           "(1, 5, 6)", "float16", "float32", ".to(q.dtype)")


@pytest.mark.parametrize("name", ["kv_lengths", "q_starts", "kv_mask"])
def test_sparse_padding_tensors_are_refused_where_the_mask_is_built(name):
    """padding reads its lengths and 2-D masks when built: a sparse one is refused there, by
    name, with `.to_dense()` (not torch's error about a missing sparse kernel)."""
    dense = torch.ones(2, 6, dtype=torch.bool) if name == "kv_mask" else torch.tensor([3, 6])
    raises(TypeError, lambda: ak.padding(**{name: dense.to_sparse()}), name, "sparse_coo",
           ".to_dense()")
