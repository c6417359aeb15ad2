"""Long-running processes: what attnkit keeps between calls stays bounded over thousands of
calls, and a caller's tensors die once the caller and the bounded caches let go of them.

Counts objects (live tensors, cache entries, weak references) and the bytes of the storages
the caches keep; no timing.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import attnkit as ak
from attnkit import call
from attnkit.backends.tiled import plan as tiled_plans
from attnkit.inputs import CallCache
from attnkit.masks import vouched_padding
from attnkit.nn import KVCache, MultiHeadAttention


def _randn(gen: torch.Generator, *shape, **kwargs) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, **kwargs)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)


def _live_bytes() -> int:
    """The bytes of the distinct storages behind every live tensor."""
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor:
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.fixture
def calls(monkeypatch) -> CallCache:
    """A fresh call cache of 32 entries and 4 MiB, in place of the process's."""
    cache = CallCache(entries=32, derived_bytes=4 << 20)
    monkeypatch.setattr(call, "CALLS", cache)
    return cache


def test_a_mask_keyed_by_shape_is_not_kept_by_its_call_cache_entry(calls):
    """A decoding step's vouched padding and a padding read from a [B, T] mask are keyed by
    their shapes, and a hit runs on the call's own mask: the entry keeps neither the first
    call's mask nor its tensors."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(gen, 2, 2, 1, 8), _randn(gen, 2, 2, 40, 8), _randn(gen, 2, 2, 40, 8)
    lengths = torch.tensor([40, 30])
    step = vouched_padding(None, lengths)
    real = torch.arange(40)[None] < torch.tensor([[40], [25]])
    read = ak.padding(kv_mask=real)
    expected = [ak.attention(q, k, v, m, backend="reference") for m in (step, read)]
    torch.testing.assert_close(ak.attention(q, k, v, step), expected[0])
    torch.testing.assert_close(ak.attention(q, k, v, read), expected[1])
    entries = len(calls._calls)
    refs = [weakref.ref(x) for x in (lengths, step, real, read)]
    del lengths, step, real, read
    gc.collect()
    assert [r() is not None for r in refs] == [False] * 4
    # a hit on a new mask of the same shapes runs that mask
    other = vouched_padding(None, torch.tensor([10, 40]))
    torch.testing.assert_close(ak.attention(q, k, v, other),
                               ak.attention(q, k, v, other, backend="reference"))
    assert len(calls._calls) == entries


@pytest.mark.parametrize("kind", ["causal documents", "key padding", "padding & causal"])
def test_the_call_cache_counts_the_bytes_its_entries_keep(calls, kind):
    """What the cache counts against its byte bound is what its entries keep alive (their
    derived values, every part's memos, causal documents' runs, the mask's tensors), each
    storage once, within a tenth: the byte bound is on what they keep."""
    gen = torch.Generator().manual_seed(1)
    calls.derived_bytes = 64 << 20  # (no entry evicted here)
    t = 2600 if kind == "causal documents" else 160  # (documents: no dense form kept)

    def mask(i: int):
        if kind == "causal documents":
            return ak.documents((torch.arange(t) * (i % 5 + 2) // t)[None], causal="top_left")
        padding = ak.padding(kv_lengths=torch.tensor([t - i, t // 2]))
        return padding & ak.causal() if "causal" in kind else padding

    for i in range(6):
        q = _randn(gen, 1 if kind == "causal documents" else 2, 1, t, 4)
        with torch.no_grad():
            ak.attention(q, q, q, mask(i))
    del q
    del calls._calls[calls._newest]  # not measured yet
    counted = sum(calls._sizes.values())
    tiled_plans._PLANS._entries.clear()  # (they hold the masks' tensors too)
    kept = _live_bytes()
    calls._calls.clear()
    kept -= _live_bytes()
    assert len(calls._sizes) == 5
    assert 0.9 * kept <= counted <= 1.1 * kept, (counted, kept)


def test_a_decode_loop_keeps_a_bounded_number_of_objects(calls):
    """2000+ decoding steps of MultiHeadAttention over a KVCache with per-sequence lengths
    (a new lengths tensor per step), and of plain attention with a new padding & causal mask
    per step: the live tensors and cache entries stop growing; the cache's buffers die with
    the last cache."""
    gen = torch.Generator().manual_seed(2)
    mha = MultiHeadAttention(16, 2).eval()
    counts = []
    with torch.no_grad():
        x = _randn(gen, 2, 5, 16)
        cache = mha(x, x, x, cache=KVCache.empty(), lengths=torch.tensor([5, 3]),
                    is_causal=True).cache
        for step in range(2000):
            x = _randn(gen, 2, 1, 16)
            cache = mha(x, x, x, cache=cache, lengths=torch.tensor([1, 1])).cache
            if step in (999, 1999):
                counts.append(_live_tensors())
    assert counts[0] == counts[1]
    store = weakref.ref(cache._store)
    del cache
    gc.collect()
    assert store() is None

    counts = []
    for step in range(1, 700):
        q, k = _randn(gen, 2, 2, 1, 8), _randn(gen, 2, 2, 1 + step % 97, 8)
        lengths = torch.tensor([k.shape[2], (k.shape[2] + 1) // 2])
        ak.attention(q, k, k, ak.padding(kv_lengths=lengths) & ak.causal("bottom_right"))
        if step in (300, 699):
            counts.append(_live_tensors())
            assert len(calls._calls) <= calls.entries
    assert counts[0] == counts[1]


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_training_loop_over_every_length_keeps_a_bounded_number_of_objects(calls,
                                                                             with_bias):
    """Forward and backward over every sequence length 1..96, twice, each step with its own
    padding & causal mask (and a bias made anew): the second pass leaves as many live
    tensors as the first; the last bias dies once dropped."""
    gen = torch.Generator().manual_seed(3)
    weight = _randn(gen, 4, 4, requires_grad=True)
    counts = []
    for _ in range(2):
        for t in range(1, 97):
            x = _randn(gen, 2, 1, t, 4)
            lengths = torch.tensor([t, (t + 1) // 2])
            mask = ak.padding(q_lengths=lengths, kv_lengths=lengths) & ak.causal()
            if with_bias:
                bias = _randn(gen, 1, 1, t, t)
                mask = mask & ak.bias(bias)
            ak.attention(x @ weight, x, x, mask).sum().backward()
        counts.append(_live_tensors())
    assert counts[0] == counts[1]
    assert len(calls._calls) <= calls.entries
    if with_bias:
        ref = weakref.ref(bias)
        del bias, mask
        gc.collect()
        assert ref() is None


def test_plans_and_masks_made_per_step_are_freed(calls):
    """A plan made per step and dropped, over a new mask each step: nothing of it stays but
    the call cache's bounded entries."""
    gen = torch.Generator().manual_seed(4)
    counts = []
    for step in range(400):
        q, k = _randn(gen, 1, 2, 4, 8), _randn(gen, 1, 2, 4 + step % 50, 8)
        lengths = torch.tensor([1 + step % 4])
        plan = ak.plan(q, k, k, ak.padding(kv_lengths=lengths) & ak.causal("bottom_right"))
        plan(q, k, k)
        if step in (199, 399):
            ref = weakref.ref(plan)
            del plan
            gc.collect()
            assert ref() is None
            counts.append(_live_tensors())
    assert counts[0] == counts[1]


@pytest.mark.parametrize("kind", ["q, k, v", "bias", "bool mask", "kv_lengths", "document ids",
                                  "function"])
def test_a_tensor_passed_once_is_freed(calls, kind):
    """q, k, v, a bias or bool mask tensor, the tensors of a function mask: freed once the
    caller drops them. kv_lengths and document ids (keyed by identity: the entry must hold
    them, so their id is not reused) are freed once the cache's entries move on."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_randn(gen, 2, 2, 8, 4, requires_grad=True) for _ in range(3))
    made = {
        "q, k, v": lambda: (None, []),
        "bias": lambda: (lambda b: (ak.bias(b) & ak.causal(), [b]))(_randn(gen, 2, 2, 8, 8)),
        "bool mask": lambda: (lambda m: (m, [m]))(_randn(gen, 8, 8) > 0),
        "kv_lengths": lambda: (lambda n: (ak.padding(kv_lengths=n), [n]))(torch.tensor([8, 5])),
        "document ids": lambda: (lambda i: (ak.documents(i, causal="top_left"), [i]))(
            torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])),
        "function": lambda: (lambda t: (ak.from_function(lambda b, h, i, j: t[i] == t[j]), [t]))(
            torch.arange(8) % 3),
    }
    mask, tensors = made[kind]()
    ak.attention(q, k, v, mask).sum().backward()
    refs = [weakref.ref(t) for t in (*tensors, q, k, v)]
    del mask, tensors, q, k, v
    gc.collect()
    if kind in ("kv_lengths", "document ids"):
        assert refs[0]() is not None  # held by its entry
        q = _randn(gen, 2, 2, 8, 4)
        for n in range(calls.entries):
            ak.attention(q, q, q, ak.padding(kv_lengths=torch.tensor([8, 1 + n % 8])))
        gc.collect()
    assert [r() is not None for r in refs] == [False] * len(refs)


def test_transformers_generate_keeps_a_bounded_number_of_entries(calls):
    """A tiny Llama generating for prompts of every length 3..12 with left padding, twice:
    the attention masks die; with the call cache full after the first round, the second
    leaves as many live tensors as the first."""
    transformers = pytest.importorskip("transformers")
    import attnkit.integrations.transformers as ak_hf

    ak_hf.register()
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng():  # (the model's initialisation draws from the global one)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="attnkit").eval()
    gen = torch.Generator().manual_seed(6)
    calls.entries = 8
    counts = []
    for _ in range(2):
        for n in range(3, 13):
            ids = torch.randint(3, 50, (2, n), generator=gen)
            attention_mask = torch.ones(2, n, dtype=torch.long)
            attention_mask[1, : n // 2] = 0
            with torch.no_grad():
                model.generate(ids, attention_mask=attention_mask, max_new_tokens=4,
                               do_sample=False, pad_token_id=0)
            ref = weakref.ref(attention_mask)
            del attention_mask
            gc.collect()
            assert ref() is None
        counts.append(_live_tensors())
    assert len(calls._calls) <= calls.entries
    assert counts[0] == counts[1]


def test_entries_measured_after_a_torch_func_transform(calls):
    """A mask used under ``vmap`` and ``grad`` memoises ``torch.func`` wrapper tensors, whose
    storage cannot be read: the call cache still measures the entries that hold the mask."""
    from torch.func import grad, vmap

    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(3, 3, 2, 8, 4, dtype=torch.float64, generator=gen).unbind(0)
    mask = ak.causal()
    vmap(lambda a, b, c: ak.attention(a, b, c, mask))(q, k, v)
    grad(lambda a: ak.attention(a, k, v, mask).sum())(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ak.attention(*leaves, mask, backend="reference").sum().backward()
    ak.attention(q[:1], k[:1], v[:1], mask)  # measures the entry before it
    assert len(calls._calls) >= 2
