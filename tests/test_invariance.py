"""The invariance contract (``attnkit.invariant()``, docs/NUMERICS.md): bits, not tolerances.

Every comparison is ``torch.equal`` (NaN only where both have NaN). The cases: a sequence alone
against the same sequence inside right- and left-padded batches at a random place, with NaN in
its padding; chunked prefills and decoding steps against one prefill; run to run with
gradients; every mask kind and score modifier on both paths of the tiled engine (torch's
fused kernel per tile, the matmul path); float32 and float64; GQA. Tests that make the
schedule depend on the call's shapes (the mutations the contract guards against) must break
the checks, and the default mode is shown not invariant on the same cases, so the checks can
fail.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import dispatch, invariance
from attnkit.backends.tiled import backend as tiled_backend
from attnkit.backends.tiled import forward, plan
from attnkit.inputs import validate
from attnkit.masks import MaskCache

D = 16
KINDS = ("none", "causal", "window", "softcap", "alibi", "relative", "score_function", "sinks",
         "bias", "dense", "documents", "sequence causal", "sequence window")
"""Masks and modifiers of the batch cases, all in relative positions (a left-padded sequence
keeps its relations): ``bias`` is a learnable-looking additive tensor of the sequence's own
size, placed at its positions in the batch."""


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return invariance.first_difference("x", got, want) is None


def _tensors(gen, batch, heads, length, dtype, dim=D):
    return torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64).to(dtype)


def _mask(kind: str, heads: int, gen, length: int, pad: int, width: int):
    """``(mask of the sequence alone, the same mask in a batch where the sequence's positions
    start at pad, in a tensor of width positions)``."""
    if kind == "none":
        return None, None
    if kind in ("causal", "sequence causal"):  # the batch's per-sequence form: see below
        return ak.causal(), ak.causal()
    if kind == "sequence window":
        return ak.sliding_window(7, 3), ak.sliding_window(7, 3)
    if kind == "window":
        return ak.sliding_window(7, 3), ak.sliding_window(7, 3)
    if kind == "softcap":
        m = ak.causal() & ak.softcap(2.0)
        return m, m
    if kind == "alibi":
        m = ak.causal() & ak.alibi(torch.linspace(0.1, 1.0, heads))
        return m, m
    if kind == "relative":
        m = ak.relative_bias(torch.randn(heads, 9, generator=gen),
                             buckets=lambda r: r.clamp(-4, 4) + 4)
        return m, m
    if kind == "score_function":
        m = ak.causal() & ak.score_function(lambda s, b, h, i, j: s - 0.05 * (i - j).abs())
        return m, m
    if kind == "sinks":
        m = ak.causal() & ak.sinks(torch.randn(heads, generator=gen))
        return m, m
    if kind == "documents":  # two documents, causal, the second from a random point
        cut = int(torch.randint(0, length + 1, (1,), generator=gen))
        ids = (torch.arange(length) >= cut).long()
        wide = torch.full((width,), 3, dtype=torch.long)  # each side's padding: its own document
        wide[:pad] = 2
        wide[pad:pad + length] = ids
        return ak.documents(ids[None], causal="top_left"), ak.documents(wide[None],
                                                                        causal="top_left")
    small = torch.randn(1, 1, length, length, generator=gen)
    if kind == "dense":
        small = small > -0.5
    big = torch.zeros(1, 1, width, width, dtype=small.dtype)
    big[..., pad:pad + length, pad:pad + length] = small
    if kind == "dense":
        return ak.dense(small), ak.dense(big)
    assert kind == "bias"
    return ak.bias(small), ak.bias(big)


def _alone_and_in_batch(kind, length, batch, place, pad_left, pad_right, heads_kv, group, dim,
                        dtype, seed, backend="auto"):
    """The sequence alone and its rows from a padded batch: ``(alone, within)`` results."""
    gen = torch.Generator().manual_seed(seed)
    heads = heads_kv * group
    width = length + pad_left + pad_right
    q1, k1, v1 = (_tensors(gen, 1, h, length, dtype, dim) for h in (heads, heads_kv, heads_kv))
    alone_mask, batch_mask = _mask(kind, heads, gen, length, pad_left, width)
    alone = ak.attention(q1, k1, v1, alone_mask, return_lse=True, invariant=True,
                         backend=backend)
    q, k, v = (_tensors(gen, batch, t.shape[1], width, dtype, dim) for t in (q1, k1, v1))
    for big, small in zip((q, k, v), (q1, k1, v1)):
        big[place] = float("nan")  # garbage in its padding: never read
        big[place, :, pad_left:pad_left + length] = small[0]
    starts = torch.randint(0, width, (batch,), generator=gen)
    if kind == "score_function":  # refused on left padding (see the test below)
        starts.zero_()
    lengths = torch.randint(0, width + 1, (batch,), generator=gen).minimum(width - starts)
    starts[place], lengths[place] = pad_left, length
    runs = ak.padding(lengths, lengths, starts, starts)
    for t in (q, k, v):  # the others' padding holds garbage too
        t.masked_fill_(torch.isnan(t), 0.0)
        t[place].nan_to_num_(float("nan"))
    mask = runs if batch_mask is None else batch_mask & runs
    if kind == "sequence causal":
        mask = ak.causal(sequences=runs)
    elif kind == "sequence window":
        mask = ak.sliding_window(7, 3, sequences=runs)
    within = ak.attention(q, k, v, mask, return_lse=True, invariant=True, backend=backend)
    rows = slice(pad_left, pad_left + length)
    return alone, (within.out[place:place + 1, :, rows], within.lse[place:place + 1, :, rows])


@settings(max_examples=80)
@given(kind=st.sampled_from(KINDS), length=st.integers(1, 560), batch=st.integers(1, 4),
       place=st.integers(0, 3), pad_left=st.sampled_from([0, 0, 1, 37, 300]),
       pad_right=st.sampled_from([0, 5, 256]), heads_kv=st.integers(1, 2),
       group=st.sampled_from([1, 2]), dim=st.sampled_from([16, 64, 128]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_a_sequence_alone_and_in_any_padded_batch_gives_the_same_bits(
        kind, length, batch, place, pad_left, pad_right, heads_kv, group, dim, dtype, seed):
    place = place % batch
    if kind == "score_function":
        pad_left = 0
    alone, (out, lse) = _alone_and_in_batch(kind, length, batch, place, pad_left, pad_right,
                                            heads_kv, group, dim, dtype, seed)
    assert _equal(out, alone.out), invariance.first_difference("out", out, alone.out)
    assert _equal(lse, alone.lse), invariance.first_difference("lse", lse, alone.lse)


CHUNK_KINDS = ("none", "causal", "window", "softcap", "alibi", "sinks")


def _chunk_mask(kind: str, heads: int, gen):
    """Masks and modifiers aligned bottom-right, so a chunk of queries keeps its positions."""
    causal = ak.causal("bottom_right")
    return {
        "none": None,
        "causal": causal,
        "window": ak.sliding_window(40, 0, align="bottom_right"),
        "softcap": causal & ak.softcap(3.0),
        "alibi": causal & ak.alibi(torch.linspace(0.1, 1.0, heads), align="bottom_right"),
        "sinks": causal & ak.sinks(torch.randn(heads, generator=gen)),
    }[kind]


@settings(max_examples=60)
@given(kind=st.sampled_from(CHUNK_KINDS), length=st.integers(2, 600),
       cuts=st.lists(st.integers(1, 599), max_size=4), steps=st.integers(0, 3),
       group=st.sampled_from([1, 3]), dim=st.sampled_from([16, 64, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_chunked_prefill_and_decoding_give_the_prefill_bits(kind, length, cuts, steps, group,
                                                            dim, dtype, seed):
    _chunks_against_one_prefill(kind, length, cuts, steps, group, dim, dtype, seed)


def _chunks_against_one_prefill(kind, length, cuts, steps, group, dim, dtype, seed,
                                backend="auto"):
    """A prefill in chunks cut at ``cuts``, its last ``steps`` rows as decoding steps, against
    one prefill: every row's out and LSE bits."""
    gen = torch.Generator().manual_seed(seed)
    q = _tensors(gen, 1, 2 * group, length, dtype, dim)
    k, v = (_tensors(gen, 1, 2, length, dtype, dim) for _ in range(2))
    mask = _chunk_mask(kind, 2 * group, gen)
    whole = ak.attention(q, k, v, mask, return_lse=True, invariant=True, backend=backend)
    last = max(1, length - steps)  # the last `steps` rows as one-token decoding steps
    bounds = sorted({0, last, *range(last, length + 1), *(c for c in cuts if c < last)})
    for start, stop in zip(bounds, bounds[1:]):
        keys = length if mask is None else stop  # without a mask every row sees every key
        part = ak.attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys], mask,
                            return_lse=True, invariant=True, backend=backend)
        assert _equal(part.out, whole.out[:, :, start:stop]), (start, stop)
        assert _equal(part.lse, whole.lse[:, :, start:stop]), (start, stop)


@pytest.mark.parametrize("kind", ["causal", "softcap", "alibi", "relative", "bias"])
def test_run_to_run_gives_the_same_bits_with_gradients(kind):
    gen = torch.Generator().manual_seed(3)
    mask, _ = _mask(kind, 4, gen, 300, 0, 300)
    q, k, v = (_tensors(gen, 2, h, 300, torch.float32) for h in (4, 2, 2))
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        result = ak.attention(*leaves, mask, return_lse=True, invariant=True)
        (result.out.square().sum() + result.lse.sum()).backward()
        runs.append([result.out, result.lse, *(t.grad for t in leaves)])
    for got, want in zip(*runs):
        assert torch.equal(got, want)


def test_the_checks_hold_on_tiled_and_others_refuse():
    findings = invariance.check(["tiled", "torch", "reference"],
                                checks=("run to run", "batch", "chunking"))
    assert {f.status for f in findings if f.backend == "tiled"} == {"holds"}
    refused = [f for f in findings if f.backend != "tiled"]
    assert refused and all(f.status == "refused" and f.detail for f in refused)


def test_the_ring_is_deterministic_run_to_run():
    assert invariance.check_ring("tiled") is None


def test_threads_do_not_change_the_bits():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_tensors(gen, 2, 4, 700, torch.float32, 64) for _ in range(3))
    mask = ak.causal() & ak.softcap(4.0)
    results = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            plain = ak.attention(q, k, v, ak.causal(), return_lse=True, invariant=True)
            capped = ak.attention(q, k, v, mask, return_lse=True, invariant=True)
        finally:
            torch.set_num_threads(before)
        results.append([plain.out, plain.lse, capped.out, capped.lse])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_auto_picks_a_backend_that_keeps_it_and_explicit_ones_refuse():
    q = torch.randn(1, 2, 8, D)
    inputs = validate(q, q, q, ak.causal(), invariant=True)
    assert dispatch.select(inputs, "auto").NAME == "tiled"
    assert ak.explain_dispatch(q, q, q, ak.causal(), invariant=True).backend == "tiled"
    for name in ("torch", "reference"):
        with pytest.raises(ValueError, match="invariant=True"):
            ak.attention(q, q, q, ak.causal(), backend=name, invariant=True)
    with ak.invariant():
        assert torch.equal(ak.attention(q, q, q, ak.causal()),
                           ak.attention(q, q, q, ak.causal(), invariant=True))
        with ak.invariant(False):
            assert not invariance.active()
        assert invariance.active() and not invariance.active(False)
    assert not invariance.active()
    with pytest.raises(TypeError, match="invariant"):
        ak.attention(q, q, q, invariant="yes")


def test_left_padding_with_a_score_function_is_refused_clearly():
    q = torch.randn(2, 2, 8, D)
    mask = ak.padding(kv_starts=[0, 3]) & ak.score_function(lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="pad on the right"):
        ak.attention(q, q, q, mask, backend="tiled", invariant=True)


def test_kernel_calls_bound_their_masks_and_their_rows_change_no_bits(monkeypatch):
    """The kernel path cuts a query block into calls of fewer rows when the batch times the
    keys would make its additive mask too large; each row keeps its bits whatever its call."""
    gen = torch.Generator().manual_seed(5)
    q = _tensors(gen, 3, 4, 700, torch.float32)
    k, v = (_tensors(gen, 3, 2, 700, torch.float32) for _ in range(2))
    mask = ak.causal() & ak.padding(kv_lengths=torch.tensor([700, 513, 90]))
    whole = ak.attention(q, k, v, mask, return_lse=True, invariant=True, backend="tiled")
    calls = []
    real = forward._kernel_calls

    def counted(*args):
        found = list(real(*args))
        calls.append(found)
        return iter(found)
    monkeypatch.setattr(forward, "_kernel_calls", counted)
    monkeypatch.setattr(forward, "KERNEL_CALL_SCORES", 3 * 2 * 1024 * 24)  # 24 rows a call
    monkeypatch.setattr(plan, "_PLANS", MaskCache(64))
    cut = ak.attention(q, k, v, mask, return_lse=True, invariant=True, backend="tiled")
    assert calls and all(r1 - r0 <= 24 for r0, r1, _, _ in calls[0])
    assert _equal(cut.out, whole.out) and _equal(cut.lse, whole.lse)


@pytest.mark.parametrize("q_len,kv_len", [(600, 300), (300, 600), (512, 512), (70, 40)])
def test_top_left_causal_of_any_lengths_is_exact(q_len, kv_len):
    """Top-left causal with more queries than keys: rows past the last key see every key and
    never the zero keys the kernel path pads with (against the float64 reference)."""
    gen = torch.Generator().manual_seed(6)
    q = _tensors(gen, 1, 2, q_len, torch.float32)
    k, v = (_tensors(gen, 1, 2, kv_len, torch.float32) for _ in range(2))
    got = ak.attention(q, k, v, ak.causal(), return_lse=True, invariant=True)
    want = ak.attention(q.double(), k.double(), v.double(), ak.causal(), return_lse=True,
                        backend="reference")
    torch.testing.assert_close(got.out, want.out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse, want.lse.float(), rtol=1e-5, atol=1e-5)


def test_widened_keys_past_the_bound_are_not_kept(monkeypatch):
    """Keys widened to whole splits are held for reuse only up to a size: a long prefill's
    are made for its call alone, with the same bits."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_tensors(gen, 1, 2, 700, torch.float32) for _ in range(3))
    kept = ak.attention(q, k, v, ak.causal(), return_lse=True, invariant=True)
    monkeypatch.setattr(forward._WIDE, "buffers", collections.OrderedDict())
    monkeypatch.setattr(forward, "WIDE_BUFFER_ELEMENTS", 1024)
    monkeypatch.setattr(plan, "_PLANS", MaskCache(64))
    alone = ak.attention(q, k, v, ak.causal(), return_lse=True, invariant=True)
    assert not forward._WIDE.buffers
    assert _equal(alone.out, kept.out) and _equal(alone.lse, kept.lse)


# ---- the checks can fail ---------------------------------------------------------------------

def test_the_default_schedule_is_not_invariant_on_the_same_cases():
    """The default mode (torch's kernel, merged segments) differs somewhere on these cases:
    the checks above would catch a contract that held only by accident."""
    broken = 0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (_tensors(gen, 1, 2, 600, torch.float32, 64) for _ in range(3))
        whole = ak.attention(q, k, v, ak.causal("bottom_right"), return_lse=True)
        for start in (1, 100, 299, 599):
            part = ak.attention(q[:, :, start:], k, v, ak.causal("bottom_right"),
                                return_lse=True)
            broken += not _equal(part.out, whole.out[:, :, start:])
    assert broken


@pytest.mark.parametrize("mutation", ["no widened keys", "kernel splits cut by the call",
                                      "no row quantum", "lerp merge",
                                      "block width set by the batch",
                                      "key order varying by call"])
def test_a_schedule_that_follows_the_call_shapes_breaks_the_checks(monkeypatch, mutation):
    if mutation == "no widened keys":  # nor whole kernel splits
        monkeypatch.setattr(forward, "_widened_keys", lambda x, role, width=None: x)
        monkeypatch.setattr(forward, "_widened", lambda x, fill: x)
        monkeypatch.setattr(forward, "KV_SPLIT", 1)
    elif mutation == "kernel splits cut by the call":  # keys from the first a call needs
        monkeypatch.setattr(forward, "KV_SPLIT", 1)
    elif mutation == "no row quantum":
        monkeypatch.setattr(forward, "pad_rows", lambda x, rows: x)
    elif mutation == "lerp merge":
        monkeypatch.setattr(forward, "merge_alike_into", forward.merge_into)
    elif mutation == "block width set by the batch":  # a split size that varies with the batch
        problem = tiled_backend._problem

        def sized(inputs, *args, **kwargs):
            width = 128 if inputs.q.shape[0] > 1 else 256
            for module in (plan, forward, tiled_backend):
                monkeypatch.setattr(module, "FIXED_BLOCK_K", width)
            return problem(inputs, *args, **kwargs)
        monkeypatch.setattr(tiled_backend, "_problem", sized)
    else:  # key blocks merged in an order that changes from call to call (as atomics would)
        calls = iter(range(10**6))

        def varying(visits):
            ordered = sorted(visits.items())
            return ordered if next(calls) % 2 else ordered[::-1]
        monkeypatch.setattr(forward, "_in_key_order", varying)
    monkeypatch.setattr(plan, "_PLANS", MaskCache(64))  # plans made under the mutation
    found = [invariance.check_batch("tiled", seed=s) or invariance.check_chunking("tiled", seed=s)
             for s in range(3)]
    assert any(found), mutation


# ---- modules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("step_lengths", [True, False], ids=["steps with lengths",
                                                            "steps without"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_multi_head_attention_decodes_a_sequence_alone_as_in_a_ragged_batch(step_lengths,
                                                                             kv_heads):
    """Three prompts in one right-padded batch with a KVCache, then decoding steps (each
    passing ``lengths`` of ones, or none: the cache's own decoding call): each sequence's
    outputs equal, bit for bit, one forward of it alone over all its tokens (a prefill,
    chunks and steps give the same rows)."""
    from attnkit.nn import MultiHeadAttention
    gen = torch.Generator().manual_seed(0)
    mha = MultiHeadAttention(64, 4, num_kv_heads=kv_heads, invariant=True)
    sizes = (300, 2, 41)
    prompts = [torch.randn(n, 64, generator=gen) for n in sizes]
    steps = [torch.randn(3, 1, 64, generator=gen) for _ in range(3)]
    batch = torch.zeros(3, max(sizes), 64)
    for b, p in enumerate(prompts):
        batch[b, :p.shape[0]] = p
    with torch.no_grad():
        out, _, cache = mha(batch, cache=mha.empty_cache(), is_causal=True,
                            lengths=torch.tensor(sizes))
        outs = [out]
        for step in steps:
            o, _, cache = mha(step, cache=cache, is_causal=True,
                              lengths=torch.ones(3, dtype=torch.long) if step_lengths else None)
            outs.append(o)
        for b, p in enumerate(prompts):
            alone = torch.cat([p] + [s[b] for s in steps])[None]
            expected, _, _ = mha(alone, is_causal=True)
            assert torch.equal(outs[0][b, :p.shape[0]], expected[0, :p.shape[0]])
            assert torch.equal(torch.cat([o[b] for o in outs[1:]]), expected[0, p.shape[0]:])


@pytest.mark.parametrize("ragged", [False, True])
def test_a_cache_in_whole_splits_decodes_in_place_with_attentions_bits(ragged):
    """Under the contract ``KVCache.decode`` reads a store of whole key splits in place and
    gives the bits ``attention()`` gives over the cache's keys and mask; a store without room
    for whole splits declines (the caller runs ``attention()``)."""
    from attnkit.nn import KVCache

    gen = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(3, 2, 600, 16, generator=gen) for _ in range(2))
    lengths = torch.tensor([600, 37, 511]) if ragged else None
    step_k, step_v = (torch.randn(3, 2, 1, 16, generator=gen) for _ in range(2))
    q = torch.randn(3, 4, 1, 16, generator=gen)
    whole = KVCache.empty()._append(keys, values, lengths, 512)._append(step_k, step_v, None,
                                                                       512)
    assert whole._store.capacity % 512 == 0
    out = whole.decode(q, invariant=True)
    assert out is not None
    want = ak.attention(q, whole.keys, whole.values, whole.mask(), invariant=True)
    assert torch.equal(out, want)
    short = KVCache.empty(capacity=601).append(keys, values, lengths).append(step_k, step_v)
    assert short._store.capacity < 1024 and short.decode(q, invariant=True) is None


def test_a_transformers_model_generates_the_same_bits_alone_and_in_a_left_padded_batch():
    """A tiny Llama on attnkit, greedy: each prompt alone and inside a left-padded batch of
    three gives the same tokens and the same logits at every step, bit for bit, with its
    linear layers row-wise (rowwise_linears); without the contract the logits differ."""
    transformers = pytest.importorskip("transformers")
    import attnkit.integrations.transformers as ak_hf
    ak_hf.register()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    model.eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (n,), generator=gen) for n in (10, 4, 7)]
    ids = torch.zeros(3, 10, dtype=torch.long)
    real = torch.zeros(3, 10, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 10 - len(p):], real[b, 10 - len(p):] = p, 1

    def generate(ids, real):
        return model.generate(input_ids=ids, attention_mask=real, max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)

    def same(batch, b, alone):
        return (torch.equal(alone.sequences[0, -8:], batch.sequences[b, -8:])
                and all(torch.equal(a[0], s[b]) for a, s in zip(alone.logits, batch.logits)))

    with torch.no_grad():
        with ak.invariant(), invariance.rowwise_linears(model):
            batch = generate(ids, real)
            for b, p in enumerate(prompts):
                assert same(batch, b, generate(p[None], torch.ones(1, len(p), dtype=torch.long)))
        batch = generate(ids, real)  # the default: equal tokens here, logits not bit for bit
        assert not all(same(batch, b, generate(p[None], torch.ones(1, len(p), dtype=torch.long)))
                       for b, p in enumerate(prompts))


@pytest.mark.parametrize("kind", ["causal", "window", "softcap", "alibi", "sinks"])
def test_a_packed_varlen_batch_gives_each_sequence_its_bits_alone(kind):
    gen = torch.Generator().manual_seed(2)
    lengths = [300, 1, 57, 260]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = (torch.randn(sum(lengths), h, 64, generator=gen) for h in (4, 2, 2))
    mask = _chunk_mask(kind, 4, gen)
    packed = ak.varlen_attention(q, k, v, cu, mask=mask, return_lse=True, invariant=True)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = ak.attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), mask,
                             return_lse=True, invariant=True)
        assert torch.equal(packed.out[rows], alone.out[0].transpose(0, 1))
        assert torch.equal(packed.lse[:, rows], alone.lse[0])


def test_a_compiled_call_keeps_the_contract():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=gen, requires_grad=True) for _ in range(3))
    mask = ak.sliding_window(64, 0, align="bottom_right") & ak.softcap(5.0)

    def step(q, k, v):
        result = ak.attention(q, k, v, mask, return_lse=True, invariant=True)
        return result.out, result.lse

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    chunk = torch.compile(step, fullgraph=True)(q[:, :, 250:], k[:, :, :300], v[:, :, :300])
    assert torch.equal(chunk[0], eager[0][:, :, 250:])
    grads = torch.autograd.grad(compiled[0].sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(
        grads, torch.autograd.grad(step(q, k, v)[0].sum(), (q, k, v))))


def test_rowwise_linears_give_a_row_the_same_bits_for_any_row_count():
    """Wide layers: torch's own product gives one row different bits alone and among many
    (the test shows it), the row-wise one the same, with several threads too."""
    gen = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(1024, 512)
    x = torch.randn(300, 1024, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with invariance.rowwise_linears(layer):
                whole = layer(x)
                assert all(torch.equal(layer(x[:n]), whole[:n]) for n in (1, 2, 5, 16, 100))
            assert not all(torch.equal(layer(x[:n]), layer(x)[:n]) for n in (1, 2, 5, 16, 100))
    finally:
        torch.set_num_threads(before)
    assert "forward" not in vars(layer)  # restored on exit


def test_rowwise_linears_keep_a_forward_set_on_the_layer():
    """A hook that replaces ``layer.forward`` (accelerate's device hooks do) still runs inside
    the block, per chunk, and is the layer's forward again after it; ``input=`` still binds."""
    gen = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(64, 32)
    seen = []

    def hooked(x):
        seen.append(x.shape[0])
        return torch.nn.Linear.forward(layer, x)
    layer.forward = hooked
    x = torch.randn(40, 64, generator=gen)
    with invariance.rowwise_linears(layer):
        inside = layer(input=x)
        assert seen and len(set(seen)) == 1  # products of a fixed number of rows
        assert all(torch.equal(layer(x[:n]), inside[:n]) for n in (1, 3, 17))
    assert vars(layer)["forward"] is hooked
    seen.clear()
    torch.testing.assert_close(layer(x), inside)
    assert seen == [40]


def test_rowwise_linears_on_a_copy_made_inside_a_block_and_hooks_set_inside():
    """A copy of a model made inside a block carries the block's forward: a later block on
    the copy runs it as the layer's own (no recursion); a hook set inside a block stays."""
    import copy
    gen = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(32, 16)
    x = torch.randn(5, 32, generator=gen)
    with invariance.rowwise_linears(layer):
        clone = copy.deepcopy(layer)
        layer.forward = hook = functools.partial(torch.nn.Linear.forward, layer)
    assert vars(layer)["forward"] is hook
    with invariance.rowwise_linears(clone):
        torch.testing.assert_close(clone(x), torch.nn.Linear.forward(layer, x))


def test_rowwise_linears_hold_per_thread():
    """Threads sharing one model: those inside a block (some nested) compute row-wise, the
    others torch's own product, and the layer is restored when the last block ends."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from attnkit.nn import _rowwise

    gen = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64, generator=gen)  # few rows: BLAS's own path differs from row-wise
    rowwise, own = _rowwise(layer, x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    barrier = threading.Barrier(4, timeout=60)  # a thread that fails breaks it: no hang

    def work(i: int) -> bool:
        ok = True
        for _ in range(50):
            barrier.wait()
            if i % 2:
                with invariance.rowwise_linears(layer):
                    if i == 3:
                        with invariance.rowwise_linears(layer):
                            ok &= torch.equal(layer(x), rowwise)
                    ok &= torch.equal(layer(x), rowwise)
            else:
                ok &= torch.equal(layer(x), own)
        return ok
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
    assert "forward" not in vars(layer)


def test_rowwise_linears_take_transformers_conv1d_too():
    """GPT-2's projections (transformers' ``Conv1D``: ``x @ weight + bias``) run row-wise as
    well, with the layer's own result."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    gen = torch.Generator().manual_seed(7)
    layer = pytorch_utils.Conv1D(512, 1024)  # nf (out), nx (in)
    torch.nn.init.normal_(layer.bias, generator=gen)
    x = torch.randn(300, 1024, generator=gen)
    own = layer(x)
    with invariance.rowwise_linears(torch.nn.Sequential(layer)):
        whole = layer(x)
        assert "forward" in vars(layer)
        assert all(torch.equal(layer(x[:n]), whole[:n]) for n in (1, 2, 5, 16, 100))
    torch.testing.assert_close(whole, own)
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("what", ["dropout", "head dim"])
def test_what_the_fixed_schedule_cannot_promise_is_refused(what):
    q = torch.randn(1, 2, 8, 320 if what == "head dim" else D)
    with pytest.raises(ValueError, match="invariant=True with " + what):
        ak.attention(q, q, q, dropout_p=0.1 if what == "dropout" else 0.0, backend="tiled",
                     invariant=True)


def test_a_reused_key_buffer_never_leaks_an_earlier_calls_keys():
    """The widened last key block lives in a buffer reused across calls: keys of an earlier,
    longer block (NaN here) must not reach a later, shorter one."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 300, D, generator=gen) for _ in range(3))
    poisoned = [t.clone() for t in (k, v)]
    for t in poisoned:
        t[:, :, 280:] = float("nan")
    ak.attention(q, *poisoned, invariant=True)  # block [256, 300) holds NaN in its buffer
    short = ak.attention(q[:, :, :5], k[:, :, :270], v[:, :, :270], return_lse=True,
                         invariant=True)
    forward._WIDE.buffers.clear()
    fresh = ak.attention(q[:, :, :5], k[:, :, :270], v[:, :, :270], return_lse=True,
                         invariant=True)
    assert not short.out.isnan().any()
    assert torch.equal(short.out, fresh.out) and torch.equal(short.lse, fresh.lse)


def test_left_padding_named_by_several_parts_keeps_the_bits(backend="tiled"):
    """Per-sequence bands and paddings built apart (their starts are different tensors of
    equal values): the keys still begin at the sequence's start, as alone."""
    gen = torch.Generator().manual_seed(7)
    length, pad = 300, 37
    q, k, v = (_tensors(gen, 1, 2, length, torch.float64) for _ in range(3))
    alone = ak.attention(q, k, v, ak.causal() & ak.sliding_window(40, 0), return_lse=True,
                         invariant=True, backend=backend)
    wide = [torch.cat([torch.full((1, 2, pad, D), float("nan"), dtype=torch.float64), t], 2)
            for t in (q, k, v)]
    runs = lambda: ak.padding(q_starts=[pad], kv_starts=[pad])  # noqa: E731 (a new tensor each)
    mask = ak.causal(sequences=runs()) & ak.sliding_window(40, 0, sequences=runs()) & runs()
    within = ak.attention(*wide, mask, return_lse=True, invariant=True, backend=backend)
    assert _equal(within.out[:, :, pad:], alone.out)
    assert _equal(within.lse[:, :, pad:], alone.lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [3, 5, 7, 8])
def test_head_dims_whose_rows_round_by_place_are_refused_or_hold(dim, dtype):
    """Where this machine's BLAS rounds a row by its place in a call (measured), the contract
    is refused by name; elsewhere decoding step by step gives the prefill's bits."""
    from attnkit.backends.tiled.plan import rows_anywhere

    gen = torch.Generator().manual_seed(11)
    q, k, v = (_tensors(gen, 1, 2, 300, dtype, dim) for _ in range(3))
    rows_anywhere.cache_clear()
    with torch.device("meta"):  # measured on the CPU whatever the default device
        rows_anywhere(dim, dim, dtype)
    if not rows_anywhere(dim, dim, dtype):
        with pytest.raises(ValueError, match="by the row's place in a call"):
            ak.attention(q, k, v, ak.causal(), invariant=True)
        return
    full = ak.attention(q, k, v, ak.causal(), invariant=True)
    for row in range(284, 300):
        step = ak.attention(q[:, :, row:row + 1], k[:, :, :row + 1], v[:, :, :row + 1],
                            ak.causal("bottom_right"), invariant=True)
        assert _equal(step, full[:, :, row:row + 1]), row
