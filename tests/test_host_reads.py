"""Reads of tensor values on the host per call (each a device sync on CUDA, and a call that
makes one cannot be captured in a CUDA graph), counted on CPU by
:class:`attnkit.bench.hostreads.HostReads`: a call with a mask seen before reads none, a new
mask at most two, a decode step of a model at most two whatever its layer count."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.bench.hostreads import HostReads
from attnkit.nn import KVCache, MultiHeadAttention

B, H, T, D = 2, 4, 64, 16


def _masks() -> dict:
    lens = torch.tensor([40, T])
    ids = torch.arange(T) // 8
    return {
        "none": lambda: None,
        "causal": lambda: ak.causal(),
        "sliding_window": lambda: ak.sliding_window(8),
        "padding": lambda: ak.padding(kv_lengths=lens),
        "left padding": lambda: ak.padding(kv_starts=T - lens),
        "causal & padding": lambda: ak.causal() & ak.padding(kv_lengths=lens),
        "causal(sequences)": lambda: ak.causal(sequences=ak.padding(q_lengths=lens,
                                                                    kv_lengths=lens)),
        "padding(kv_mask)": lambda: ak.padding(kv_mask=torch.arange(T) < lens[:, None]),
        "documents": lambda: ak.documents(ids),
        "documents & causal": lambda: ak.documents(ids) & ak.causal(),
        "documents(causal)": lambda: ak.documents(ids, causal="top_left"),
        "causal & softcap": lambda: ak.causal() & ak.softcap(20.0),
        "causal & alibi": lambda: ak.causal() & ak.alibi(torch.rand(H)),
        "causal & relative_bias": lambda: ak.causal() & ak.relative_bias(torch.rand(H, 32)),
        "causal & sinks": lambda: ak.causal() & ak.sinks(torch.zeros(H)),
    }


def _qkv():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=gen) for _ in range(3)]


def _reads(fn) -> int:
    with HostReads() as reads:
        fn()
    return reads.count


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("name", list(_masks()))
def test_a_mask_seen_before_reads_no_value(name, backend, invariant):
    """Also under the invariance contract (the fixed schedule, left padding in groups by
    first key)."""
    q, k, v = _qkv()
    mask = _masks()[name]()
    ak.attention(q, k, v, mask, backend=backend, invariant=invariant)
    assert _reads(lambda: ak.attention(q, k, v, mask, backend=backend,
                                       invariant=invariant)) == 0


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("name", list(_masks()))
def test_a_new_mask_reads_at_most_two_values(name, backend):
    """Validation and planning (the tiled engine's block codes, squares and pieces) of a new
    mask read at most two values."""
    q, k, v = _qkv()
    ak.attention(q, k, v, _masks()[name](), backend=backend)  # the backend's first-call work
    with HostReads() as reads:
        mask = _masks()[name]()  # new tensors: nothing cached from the call before
        built = reads.count
        ak.attention(q, k, v, mask, backend=backend)
    assert reads.count - built <= 2
    if backend == "auto":  # the mask's construction too
        assert reads.count <= 2


def test_a_decode_step_over_a_ragged_cache_reads_no_value():
    """Every layer of a step appends one token per sequence and attends over its own ragged
    cache; the cache's masks come from lengths it made itself."""
    torch.manual_seed(0)
    layers = [MultiHeadAttention(32, 4, num_kv_heads=2) for _ in range(3)]
    prompt = torch.randn(3, 7, 32)
    lengths = torch.tensor([2, 7, 5])
    caches = [KVCache.empty() for _ in layers]
    with torch.no_grad():
        x = prompt
        for i, layer in enumerate(layers):
            x, _, caches[i] = layer(x, cache=caches[i], is_causal=True, lengths=lengths)

        def step():
            h = torch.randn(3, 1, 32)
            for i, layer in enumerate(layers):
                h, _, caches[i] = layer(h, cache=caches[i], is_causal=True)
        step()
        assert _reads(step) == 0


def test_chunk_lengths_are_validated_once_while_unchanged():
    """A chunked loop passing one lengths tensor every step (int32 here: converted once) reads
    it on the first append only; written in place, it is read and checked again."""
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    cache = KVCache.empty(capacity=64)

    def append():
        nonlocal cache
        cache = cache.append(torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), lengths)

    append()
    assert _reads(append) == 0
    assert cache.lengths.tolist() == [6, 2] and cache.appended.dtype == torch.long
    lengths[0] = 5  # more than the chunk's 4 positions
    with pytest.raises(ValueError, match=r"lie in \[0, 4\]"):
        append()


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("padded", [True, False])
def test_a_transformers_decode_step_reads_once(padded, grad_mode):
    """The mask function runs once per forward pass and reads the padding's runs (and whether
    every key is real) in one read; every layer then calls attention with that mask, reading
    nothing. Under inference mode too, where tensors have no version counter to key by."""
    transformers = pytest.importorskip("transformers")
    import attnkit.integrations.transformers as akhf
    akhf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.tensor([[0 if padded else 1] * 2 + [1] * 4, [1] * 6])
    with grad_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        for _ in range(2):  # a warm-up step, then the counted one
            mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
            with HostReads() as reads:
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask,
                            cache=out.cache, use_cache=True)
    assert reads.count == 1
