"""Paged KV caches: ``ak.paged.paged_attention`` and ``attnkit.nn.PagedKVCache`` against
contiguous caches and the float64 truth; forks, beam-search reorders, frees, a full pool."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks import MaskSpace
from attnkit.nn import KVCache, MultiHeadAttention, PagedKVCache
from attnkit.paged import paged_attention
from conftest import naive_attention

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def _pools(lengths, block_size, heads_kv=2, dk=8, dv=6, spare=3, seed=0):
    """Random sequences written to a NaN-filled pool in shuffled blocks: ``(key_pool,
    value_pool, table, keys, values)`` with ``keys[b] [Hkv, lengths[b], D]`` the truth."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_pool = torch.full((num_blocks, block_size, heads_kv, dk), NAN, dtype=F64)
    value_pool = torch.full((num_blocks, block_size, heads_kv, dv), NAN, dtype=F64)
    width = max(needed) + 1
    table = torch.full((len(lengths), width), num_blocks + 7)  # garbage past the live blocks
    keys, values = [], []
    for b, n in enumerate(lengths):
        blocks, order = order[:needed[b]], order[needed[b]:]
        table[b, :needed[b]] = torch.tensor(blocks, dtype=torch.long)
        k = torch.randn(heads_kv, n, dk, generator=gen, dtype=F64)
        v = torch.randn(heads_kv, n, dv, generator=gen, dtype=F64)
        for p in range(n):
            key_pool[blocks[p // block_size], p % block_size] = k[:, p]
            value_pool[blocks[p // block_size], p % block_size] = v[:, p]
        keys.append(k)
        values.append(v)
    return key_pool, value_pool, table, keys, values


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "softcap", "alibi"])
def test_paged_attention_equals_each_sequence_alone(block_size, mask):
    lengths = [5, 1, 17, 0]
    tq = 1 if mask == "alibi" else 2
    key_pool, value_pool, table, keys, values = _pools(lengths, block_size)
    q = torch.randn(len(lengths), 4, tq, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    made = {"none": None, "causal": ak.causal("bottom_right"),
            "window": ak.sliding_window(3, align="bottom_right"),
            "softcap": ak.causal("bottom_right") & ak.softcap(2.0),
            "alibi": ak.alibi(torch.linspace(0.1, 0.5, 4, dtype=F64))}[mask]
    got = paged_attention(q, key_pool, value_pool, table, torch.tensor(lengths), mask=made,
                          return_lse=True)
    for b, n in enumerate(lengths):
        if n == 0:  # no key: output 0, LSE −inf
            assert (got.out[b] == 0).all() and torch.isneginf(got.lse[b]).all()
            continue
        want = ak.attention(q[b:b + 1], keys[b][None], values[b][None], made,
                            backend="reference", return_lse=True)
        torch.testing.assert_close(got.out[b:b + 1], want.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.lse[b:b + 1], want.lse, rtol=1e-12, atol=1e-12)


def test_paged_attention_refuses_a_relative_bias():
    """A relative bias would read a decoding query at position 0 of the call, not at its
    position in its sequence: the last row of a prefill differs (ALiBi, whose alignment adds a
    constant per row, runs)."""
    key_pool, value_pool, table, keys, values = _pools([7], 4)
    q = torch.randn(1, 4, 1, 8, dtype=F64)
    with pytest.raises(ValueError, match="does not take relative_bias"):
        paged_attention(q, key_pool, value_pool, table, [7],
                        mask=ak.relative_bias(torch.randn(4, 32, dtype=F64)))
    cache = PagedKVCache.from_tables(key_pool, value_pool, table, [6])
    cache.append(keys[0][None, :, 6:], values[0][None, :, 6:])  # the 7th token
    with pytest.raises(ValueError, match="does not take relative_bias"):
        cache.attend(q, mask=ak.relative_bias(torch.randn(4, 32, dtype=F64)))
    alibi = ak.alibi(torch.linspace(0.1, 0.5, 4, dtype=F64))
    torch.testing.assert_close(cache.attend(q, mask=alibi, is_causal=False),
                               paged_attention(q, key_pool, value_pool, table, [7], mask=alibi))


def test_paged_attention_refuses_bottom_right_alibi_where_its_row_constant_shows():
    """Bottom-right ALiBi aligns each query with the last gathered key, not its sequence's: a
    constant per row, refused with sinks or the LSE (which it would change)."""
    key_pool, value_pool, table, keys, values = _pools([5, 9], 4)
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    alibi = ak.alibi(torch.linspace(0.1, 0.5, 4, dtype=F64), align="bottom_right")
    for mask, lse in ((alibi & ak.sinks(torch.zeros(4, dtype=F64)), False), (alibi, True)):
        with pytest.raises(ValueError, match="does not take alibi.align='bottom_right'. with"):
            paged_attention(q, key_pool, value_pool, table, [5, 9], mask=mask, return_lse=lse)
    got = paged_attention(q, key_pool, value_pool, table, [5, 9], mask=alibi)  # out alone runs
    for b, n in enumerate([5, 9]):
        torch.testing.assert_close(got[b:b + 1], ak.attention(
            q[b:b + 1], keys[b][None], values[b][None], alibi, backend="reference"))


def test_paged_attention_gradients_reach_q():
    key_pool, value_pool, table, keys, values = _pools([4, 9], 4)
    q = torch.randn(2, 4, 3, 8, dtype=F64, requires_grad=True)
    out = paged_attention(q, key_pool, value_pool, table, [4, 9], mask=ak.causal("bottom_right"))
    (grad,) = torch.autograd.grad(out.sum(), q)
    for b, n in enumerate([4, 9]):
        qb = q[b:b + 1].detach().requires_grad_()
        allowed = ak.causal("bottom_right").to_dense(MaskSpace(1, 4, 3, n))
        want = naive_attention(qb, keys[b][None].repeat_interleave(2, 1),
                               values[b][None].repeat_interleave(2, 1), allowed)[0]
        torch.testing.assert_close(grad[b:b + 1], torch.autograd.grad(want.sum(), qb)[0])


@pytest.mark.parametrize("table, seqlens, words", [
    ([[0, 1], [2, 99]], [8, 8], "block 99, outside the pool"),
    ([[0, 1], [2, 2]], [8, 8], "block 2 twice"),
    ([[0, 1], [2, 3]], [8, 9], "seqlens[1] = 9"),
    ([[0, 1]], [8, 8], "one row per sequence"),
])
def test_paged_attention_refuses_bad_tables_by_sequence(table, seqlens, words):
    pool = torch.zeros(4, 4, 2, 8)
    q = torch.zeros(2, 2, 1, 8)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        paged_attention(q, pool, pool, table, seqlens)


def test_paged_attention_refuses_mixed_dtypes():
    pool = torch.zeros(4, 4, 2, 8)
    with pytest.raises(TypeError, match="one dtype"):
        paged_attention(torch.zeros(1, 2, 1, 8, dtype=F64), pool, pool, [[0]], [3])


# ---- the cache -----------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, num_kv_heads=2).eval()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_ragged_decoding_equals_the_contiguous_cache(block_size):
    mha, lengths = _model(), torch.tensor([3, 7, 1, 5])
    prompt = torch.randn(4, 7, 32)
    with torch.no_grad():
        a = mha(prompt, cache=KVCache.empty(), is_causal=True, lengths=lengths)
        p = mha(prompt, cache=PagedKVCache(64, block_size), is_causal=True, lengths=lengths)
        real = torch.arange(7)[None] < lengths[:, None]
        torch.testing.assert_close(p.out[real], a.out[real])
        contiguous, paged = a.cache, p.cache
        for step in range(5):
            x = torch.randn(4, 1 + step % 2, 32)  # one token, then two, ...
            a, p = mha(x, cache=contiguous, is_causal=True), mha(x, cache=paged, is_causal=True)
            torch.testing.assert_close(p.out, a.out)
            contiguous, paged = a.cache, p.cache
        assert paged.lengths == contiguous.lengths.tolist()


def _appended(cache: PagedKVCache, gen, steps=3, heads_kv=2, dim=8):
    """``steps`` random tokens appended to every sequence; the keys written ``[B, Hkv, s, D]``."""
    new = torch.randn(cache.batch, heads_kv, steps, dim, generator=gen, dtype=F64)
    cache.append(new, -new)
    return new


def test_a_fork_shares_blocks_and_copies_on_write():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(8, 4)
    cache.add(1)
    first = _appended(cache, gen, steps=6)  # 6 tokens: a full block and half of one
    free = cache.free_blocks
    twin = cache.fork(0)
    assert twin == 1 and cache.free_blocks == free  # shared, nothing copied
    mine = _appended(cache, gen, steps=1)  # both write into the shared half block: copied
    assert cache.tables[0][0] == cache.tables[1][0]  # the full block stays shared
    assert cache.tables[0][1] != cache.tables[1][1]
    for row in (0, 1):
        torch.testing.assert_close(cache.keys[row], torch.cat([first[0], mine[row]], dim=1))
        torch.testing.assert_close(cache.values[row], -torch.cat([first[0], mine[row]], dim=1))


def test_reorder_keeps_hypotheses_as_a_beam_search_does():
    gen = torch.Generator().manual_seed(1)
    paged = PagedKVCache(20, 2)
    contiguous = KVCache.empty()
    for _ in range(2):
        new = torch.randn(3, 2, 3, 8, generator=gen, dtype=F64)
        paged.append(new, new * 2)
        contiguous = contiguous.append(new, new * 2)
    for index in ([2, 2, 0], [1, 0, 0]):
        paged.reorder(index)
        contiguous = contiguous.reorder(torch.tensor(index))
        new = torch.randn(3, 2, 1, 8, generator=gen, dtype=F64)
        paged.append(new, new * 2)
        contiguous = contiguous.append(new, new * 2)
        torch.testing.assert_close(paged.keys, contiguous.keys)
        torch.testing.assert_close(paged.values, contiguous.values)
    held = {b for table in paged.tables for b in table}
    assert paged.free_blocks == paged.num_blocks - len(held)  # nothing leaked


def test_free_returns_blocks_and_new_requests_reuse_them():
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(6, 4)
    cache.add(2)
    _appended(cache, gen, steps=8)  # two sequences of 2 blocks
    assert cache.free_blocks == 2
    cache.free([0])
    assert cache.batch == 1 and cache.free_blocks == 4
    cache.add(1)
    new = torch.randn(2, 2, 8, 8, generator=gen, dtype=F64)
    cache.append(new, new, lengths=[0, 8])  # the old row waits, the new one prefills
    assert cache.lengths == [8, 8] and cache.free_blocks == 2
    torch.testing.assert_close(cache.keys[1], new[1])


def test_a_full_pool_refuses_and_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(3, 2)
    cache.add(2)
    _appended(cache, gen, steps=2)
    before = (cache.tables, cache.lengths, cache.free_blocks, cache.key_pool.clone())
    with pytest.raises(ValueError, match="full"):
        _appended(cache, gen, steps=2)  # needs 2 blocks, 1 free
    assert (cache.tables, cache.lengths, cache.free_blocks) == before[:3]
    assert torch.equal(cache.key_pool.nan_to_num(), before[3].nan_to_num())


@pytest.mark.parametrize("refusal", ["full", "lengths"])
def test_a_refused_first_append_starts_no_sequences(refusal):
    cache = PagedKVCache(1, 2)
    new = torch.zeros(2, 1, 3, 4)
    with pytest.raises(ValueError, match=refusal):
        cache.append(new, new, lengths=None if refusal == "full" else [5, 0])
    assert cache.batch == 0 and cache.lengths == [] and cache.free_blocks == 1
    cache.append(new[:1, :, :2], new[:1, :, :2])  # another batch size is welcome
    assert cache.lengths == [2]


def test_a_step_refused_after_its_append_leaves_the_paged_cache_as_it_was():
    gen = torch.Generator().manual_seed(4)
    mha = MultiHeadAttention(8, 2, dtype=F64).eval()
    cache = PagedKVCache(8, 2)
    mha(torch.randn(2, 3, 8, generator=gen, dtype=F64), cache=cache, is_causal=True)
    before = (cache.tables, cache.lengths, cache.free_blocks)
    step = torch.randn(2, 1, 8, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match="not broadcastable"):
        mha(step, cache=cache, is_causal=True, mask=torch.ones(1, 3, dtype=torch.bool))
    assert (cache.tables, cache.lengths, cache.free_blocks) == before
    out = mha(step, cache=cache, is_causal=True).out
    assert cache.lengths == [4, 4]
    first = PagedKVCache(8, 2)  # a refused first step leaves no pools of its dtype either
    with pytest.raises(ValueError, match="not broadcastable"):
        mha(step, cache=first, mask=torch.ones(1, 9, dtype=torch.bool))
    assert first.batch == 0 and first.key_pool is None
    full = PagedKVCache(8, 2)
    mha(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(4), dtype=F64),
        cache=full, is_causal=True)
    torch.testing.assert_close(out, mha(step, cache=full, is_causal=True).out)


def test_bad_rows_and_lengths_are_refused():
    cache = PagedKVCache(4, 2)
    cache.append(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match="row 5"):
        cache.fork(5)
    with pytest.raises(ValueError, match="lengths"):
        cache.append(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), lengths=[2, 0])
    with pytest.raises(ValueError, match="3 sequences but the cache has 2"):
        cache.append(torch.zeros(3, 1, 1, 4), torch.zeros(3, 1, 1, 4))
    with pytest.raises(ValueError, match="fit the pools"):
        cache.append(torch.zeros(2, 1, 1, 5), torch.zeros(2, 1, 1, 5))
    with pytest.raises(ValueError, match="positive int"):
        PagedKVCache(0, 4)


def test_contiguous_cache_reorder_follows_rows():
    cache = KVCache.empty().append(torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 1),
                                   torch.zeros(3, 1, 2, 1), lengths=torch.tensor([1, 2, 2]))
    again = cache.reorder([2, 0])
    assert again.keys[:, 0, 0, 0].tolist() == [2.0, 0.0]
    assert again.lengths.tolist() == [2, 1]
    with pytest.raises(ValueError, match="outside"):
        cache.reorder([3])


# ---- decoding by runs of blocks (the pool read in place) ---------------------------------
def _forked_cache(dtype=torch.float32, block_size=4, prompt=47, seed=4):
    """Two prompts, each forked twice and reordered once, then decoded a few steps: runs of
    blocks shared by several sequences, copied-on-write last blocks, scattered new blocks;
    more keys than ``attention`` looks at for non-finite values, so that a decoding step
    reads the pool by runs (:func:`attnkit.paged.decode_spans`)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(64, block_size)
    first = torch.randn(2, 2, prompt, 8, generator=gen, dtype=dtype)
    cache.append(first, first.flip(-1), lengths=[prompt, prompt - 5])
    cache.fork(0), cache.fork(1), cache.fork(0)
    cache.reorder([0, 2, 4, 1, 3, 3])
    for _ in range(3):
        new = torch.randn(cache.batch, 2, 1, 8, generator=gen, dtype=dtype)
        cache.append(new, new * 3)
    return cache, gen


def test_runs_kept_between_steps_equal_runs_found_anew(monkeypatch):
    """A decoding loop over forks (new blocks, copy-on-write, a fork, a free and a reorder on
    the way): each step's runs, updated from the last step's where only the sequences' ends
    moved, equal the runs found anew, and the update is what most steps take."""
    from attnkit import paged

    cache, gen = _forked_cache(block_size=16)
    found = []
    real = paged._shared_runs
    monkeypatch.setattr(paged, "_shared_runs", lambda *a: found.append(1) or real(*a))
    q = torch.randn(cache.batch, 4, 1, 8, generator=gen)
    for step in range(24):
        if step == 9:
            cache.fork(2)
        if step == 15:
            cache.free([1])
        if step == 19:
            cache.reorder([0, 0, 2, 3, 4, 5])
        new = torch.randn(cache.batch, 2, 1, 8, generator=gen)
        cache.append(new, new * 2)
        q = torch.randn(cache.batch, 4, 1, 8, generator=gen)
        got = cache.attend(q, return_lse=True)
        spans = [(0, n) for n in cache.lengths]
        assert cache._runs.runs == real(cache.tables, spans, cache.block_size)[0]
        assert list(cache._runs.runs) == list(real(cache.tables, spans, cache.block_size)[0])
        want = cache.attend(q, backend="reference", return_lse=True)
        torch.testing.assert_close(got.out, want.out, rtol=1e-5, atol=1e-5)
    assert 0 < len(found) < 24 // 2  # most steps lengthen the last step's runs


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("mask", [None, "window"])
def test_a_decode_step_by_runs_equals_the_gathered_call(dtype, mask):
    cache, gen = _forked_cache(dtype)
    new = torch.randn(cache.batch, 2, 1, 8, generator=gen, dtype=dtype)
    cache.append(new, -new)
    q = torch.randn(cache.batch, 4, 1, 8, generator=gen, dtype=dtype)
    made = None if mask is None else ak.sliding_window(5, align="bottom_right")
    got = cache.attend(q, made, return_lse=True)
    per_sequence = ak.sliding_window(5, align="bottom_right",
                                     sequences=ak.padding(kv_lengths=cache.lengths))
    step = cache.mask() if made is None else cache.mask() & per_sequence
    want = ak.attention(q, cache.keys, cache.values, step, backend="reference", return_lse=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else {}
    torch.testing.assert_close(got.out, want.out, **tol)
    torch.testing.assert_close(got.lse, want.lse.to(got.lse.dtype), **tol)
    gathered = cache.attend(q, made, backend="reference")  # the gathered path, mask per sequence
    torch.testing.assert_close(gathered, want.out, **tol)


def test_decoding_by_runs_reads_a_shared_run_once():
    """A run of blocks held by several sequences (a forked prompt) is one kernel call."""
    from attnkit import paged

    cache, gen = _forked_cache(block_size=4)
    calls = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def counting(q, *args, **kwargs):
        calls.append(q.shape[2])  # query rows of the call
        return real(q, *args, **kwargs)

    q = torch.randn(cache.batch, 4, 1, 8, generator=gen)
    runs = paged.shared_runs(cache.tables, [(0, n) for n in cache.lengths], cache.block_size)
    own = [paged.shared_runs([t], [(0, n)], cache.block_size)
           for t, n in zip(cache.tables, cache.lengths)]
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu = counting
        cache.attend(q)
    finally:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu = real
    long = [run for run, seqs in runs.items() if len(seqs) > 1 or run[1] - run[0] >= 256]
    assert len(calls) == len(long) + 1 < sum(len(r) for r in own)  # + 1: the short runs
    assert max(calls) > 2  # a shared run: the query rows of several sequences at once


def test_shared_runs_cover_each_sequence_once():
    """Every sequence's runs are exactly the slots of its span, each slot once; a run two
    sequences list is the same slots in both."""
    from attnkit import paged

    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        size = int(torch.randint(1, 5, (1,), generator=gen))
        common = torch.randperm(40, generator=gen)[:6].tolist()
        tables, spans = [], []
        for b in range(4):
            own = (torch.randperm(40, generator=gen)[:5] + 40 + 10 * b).tolist()
            table = common[:int(torch.randint(0, 7, (1,), generator=gen))] + own
            stop = int(torch.randint(0, len(table) * size + 1, (1,), generator=gen))
            first = int(torch.randint(0, stop + 1, (1,), generator=gen))
            tables.append(table)
            spans.append((first, stop))
        runs = paged.shared_runs(tables, spans, size)
        for b, (table, (first, stop)) in enumerate(zip(tables, spans)):
            want = [table[p // size] * size + p % size for p in range(first, stop)]
            got = [s for (a, z), seqs in runs.items() if b in seqs for s in range(a, z)]
            assert sorted(got) == sorted(want)


def test_decoding_by_runs_in_place_shared_and_short_runs():
    """A step whose keys are long runs read in place (a shared prompt, one sequence's own
    long run) and short runs read together equals the reference on the gathered keys."""
    from attnkit import paged

    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(200, 8)
    prompt = torch.randn(2, 2, 600, 8, generator=gen, dtype=F64)
    cache.append(prompt, prompt.flip(-1), lengths=[600, 300])
    cache.fork(0), cache.fork(0)
    for _ in range(3):
        new = torch.randn(cache.batch, 2, 1, 8, generator=gen, dtype=F64)
        cache.append(new, new * 2)
    runs = paged.shared_runs(cache.tables, [(0, n) for n in cache.lengths], 8)
    assert any(len(seqs) > 1 for seqs in runs.values())  # the forked prompt
    assert any(len(seqs) == 1 and z - a >= paged.SHORT_RUN for (a, z), seqs in runs.items())
    assert any(len(seqs) == 1 and z - a < paged.SHORT_RUN for (a, z), seqs in runs.items())
    q = torch.randn(cache.batch, 4, 1, 8, generator=gen, dtype=F64)
    for mask in (None, ak.sliding_window(400, align="bottom_right")):
        got = cache.attend(q, mask, return_lse=True)
        want = cache.attend(q, mask, backend="reference", return_lse=True)
        torch.testing.assert_close(got.out, want.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.lse, want.lse.to(got.lse.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prompt_length", [64, 61])
def test_forks_whose_every_piece_covers_every_sequence(prompt_length):
    """Forks of one prompt, each with tokens of its own: the prompt's run and the batch of own
    runs each cover every sequence (merged piece by piece), equal to the reference; a row
    with NaN in its query is NaN."""
    from attnkit import paged

    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(64, 8)
    prompt = torch.randn(1, 2, prompt_length, 8, generator=gen, dtype=F64)
    cache.append(prompt, prompt.flip(-1))
    for _ in range(3):
        cache.fork(0)
    for _ in range(2):
        new = torch.randn(cache.batch, 2, 1, 8, generator=gen, dtype=F64)
        cache.append(new, new * 2)
    runs = paged.shared_runs(cache.tables, [(0, n) for n in cache.lengths], 8)
    shared = [seqs for seqs in runs.values() if len(seqs) > 1]
    own = sorted(seqs[0] for seqs in runs.values() if len(seqs) == 1)
    assert shared and all(seqs == [0, 1, 2, 3] for seqs in shared) and own == [0, 1, 2, 3]
    q = torch.randn(cache.batch, 4, 1, 8, generator=gen, dtype=F64)
    got = cache.attend(q, return_lse=True)
    want = cache.attend(q, backend="reference", return_lse=True)
    torch.testing.assert_close(got.out, want.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse, want.lse.to(got.lse.dtype), rtol=1e-12, atol=1e-12)
    q[1, 2] = NAN
    out = cache.attend(q)
    assert torch.isnan(out[1, 2]).all() and torch.isfinite(out[0]).all()


def test_decoding_by_runs_keeps_the_non_finite_rules():
    """NaN in one query makes its row NaN (the fused kernel alone would give 0); NaN in pool
    slots no sequence owns reaches nothing."""
    cache, gen = _forked_cache()
    cache.key_pool[-1] = NAN  # a free block
    cache.value_pool[-1] = NAN
    new = torch.randn(cache.batch, 2, 1, 8, generator=gen)
    cache.append(new, new)
    q = torch.randn(cache.batch, 4, 1, 8, generator=gen)
    q[2, 1] = NAN
    out = cache.attend(q)
    assert torch.isnan(out[2, 1]).all()
    rest = torch.ones(out.shape[:2], dtype=torch.bool)
    rest[2, 1] = False
    assert torch.isfinite(out[rest]).all()


def test_paged_attention_decodes_by_runs_as_it_gathers(monkeypatch):
    lengths = [50, 120, 90]
    key_pool, value_pool, table, _, _ = _pools(lengths, 4, dv=8)
    key_pool, value_pool = key_pool.float(), value_pool.float()
    q = torch.randn(3, 4, 1, 8)
    runs = _counted(monkeypatch, "decode_by_runs")
    for mask in (None, ak.causal("bottom_right"), ak.sliding_window(4, align="bottom_right")):
        by_runs = paged_attention(q, key_pool, value_pool, table, lengths, mask=mask)
        gathered = paged_attention(q, key_pool, value_pool, table, lengths, mask=mask,
                                   backend="reference")
        torch.testing.assert_close(by_runs, gathered)
    assert len(runs) == 3


def _counted(monkeypatch, name: str) -> list:
    """The calls of ``attnkit.paged.<name>`` from here on, one entry each."""
    from attnkit import paged

    calls, real = [], getattr(paged, name)
    monkeypatch.setattr(paged, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_a_small_decoding_step_looks_at_its_keys(monkeypatch):
    """A step whose gathered keys are few enough for ``attention`` to look at them for
    non-finite values gathers them and is looked at too: an ±inf key whose score is −inf
    (which torch's kernel drops as a masked key) makes the rows that see it NaN, never a
    finite number."""
    key_pool, value_pool, table, _, _ = _pools([5, 3], 4, dv=8)
    key_pool, value_pool = key_pool.float(), value_pool.float()
    key_pool[table[0, 0], 1, 0, 3] = INF  # sequence 0, position 1, K/V head 0
    q = torch.randn(2, 4, 1, 8)
    q[..., 3] = -1.0  # the score of that key: −inf
    runs = _counted(monkeypatch, "decode_by_runs")
    got = paged_attention(q, key_pool, value_pool, table, [5, 3], return_lse=True)
    assert not runs
    assert torch.isnan(got.out[0, :2]).all() and torch.isnan(got.lse[0, :2]).all()
    assert torch.isfinite(got.out[0, 2:]).all() and torch.isfinite(got.out[1]).all()


@pytest.mark.parametrize("call", ["paged_attention", "attend"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_decoding_step_by_runs_refuses_a_non_finite_scale(call, scale):
    key_pool, value_pool, table, _, _ = _pools([50, 120], 4, dv=8)
    key_pool, value_pool = key_pool.float(), value_pool.float()
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(ValueError, match="use a finite number"):
        if call == "paged_attention":
            paged_attention(q, key_pool, value_pool, table, [50, 120], scale=scale)
        else:
            cache, _ = _forked_cache()
            cache.attend(torch.randn(cache.batch, 4, 1, 8), scale=scale)


def test_integer_queries_and_pools_are_refused_by_dtype():
    key_pool, value_pool, table, _, _ = _pools([50, 120], 4, dv=8)
    with pytest.raises(TypeError, match="floating point"):
        paged_attention(torch.zeros(2, 4, 1, 8, dtype=torch.long), key_pool.long(),
                        value_pool.long(), table, [50, 120])


@pytest.mark.parametrize("table, seqlens, where", [
    ([[0, 1], [2, 3]], [4.5, 8], "seqlens"),
    ([[0.9, 1], [2, 3]], [5, 8], "block_table"),
])
def test_fractional_tables_and_lengths_are_refused_not_truncated(table, seqlens, where):
    pool = torch.zeros(4, 4, 2, 8)
    with pytest.raises(TypeError, match=where):
        paged_attention(torch.zeros(2, 2, 1, 8), pool, pool, table, seqlens)
    cache = PagedKVCache(8, 4)
    cache.append(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8))
    with pytest.raises(TypeError, match="lengths"):
        cache.append(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), lengths=[0.5, 1])
    assert cache.lengths == [3, 3]


# ---- a contiguous cache with a sliding window --------------------------------------------------
@pytest.mark.parametrize("window", [1, 4, 7])
def test_a_windowed_cache_equals_a_full_cache_under_the_window(window):
    """KVCache(window=w) keeps what a sliding window of w keys needs: every step (a prompt
    chunk, then one token, then chunks of three) equals the full cache under
    ``sliding_window(w - 1, align="bottom_right")``, with ALiBi at true distances too."""
    gen = torch.Generator().manual_seed(5)
    slopes = torch.linspace(0.2, 0.9, 4, dtype=F64)
    windowed, full = KVCache.empty(window=window), KVCache.empty()
    for step, width in enumerate([10, 1, 1, 3, 1, 3, 1, 1, 1, 1, 2]):
        new = torch.randn(2, 2, width, 8, generator=gen, dtype=F64)
        windowed, full = windowed.append(new, new.flip(-1)), full.append(new, new.flip(-1))
        q = torch.randn(2, 4, width, 8, generator=gen, dtype=F64)
        band = ak.sliding_window(window - 1, align="bottom_right")
        for extra in (None, ak.alibi(slopes, align="bottom_right")):
            got_mask = windowed.mask() if extra is None else windowed.mask() & extra
            want_mask = band if extra is None else band & extra
            torch.testing.assert_close(ak.attention(q, windowed.keys, windowed.values, got_mask),
                                       ak.attention(q, full.keys, full.values, want_mask),
                                       msg=f"step {step}")
        assert windowed.length <= window - 1 + width
        assert windowed.offset + windowed.length == full.length
        assert windowed._store.capacity <= max(2 * window, window - 1 + 10)


def test_a_windowed_cache_branches_without_touching_its_sibling():
    gen = torch.Generator().manual_seed(6)
    cache = KVCache.empty(window=3)
    for _ in range(5):
        new = torch.randn(1, 1, 1, 4, generator=gen)
        cache = cache.append(new, new)
    a = cache.append(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    kept = a.keys.clone()
    for _ in range(8):  # the older cache grows again: the buffer is copied, a is untouched
        cache = cache.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    torch.testing.assert_close(a.keys, kept)


def test_a_windowed_cache_refuses_per_sequence_lengths():
    cache = KVCache.empty(window=4)
    with pytest.raises(ValueError, match="window"):
        cache.append(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), lengths=[1, 3])
    with pytest.raises(ValueError, match="window"):
        KVCache.empty(window=0)


def test_a_cache_over_filled_pools_decodes_as_flash_attn_with_kvcache_does():
    """Pools and tables filled elsewhere (flash_attn_with_kvcache's layout): append the new
    token of each sequence at its length, attend with bottom-right causal, as a gathered
    call over the same keys; the blocks no sequence names are free."""
    lengths = [5, 12, 9]
    key_pool, value_pool, table, keys, values = _pools(lengths, 4, dv=8, spare=4)
    cache = PagedKVCache.from_tables(key_pool.float(), value_pool.float(), table, lengths)
    assert cache.free_blocks == 4 and cache.lengths == lengths
    new = torch.randn(3, 2, 1, 8)
    cache.append(new, new)
    q = torch.randn(3, 4, 1, 8)
    got = cache.attend(q, ak.causal("bottom_right"))
    for b, n in enumerate(lengths):
        k = torch.cat([keys[b].float(), new[b]], dim=1)[None]
        v = torch.cat([values[b].float(), new[b]], dim=1)[None]
        torch.testing.assert_close(got[b:b + 1], ak.attention(q[b:b + 1], k, v))
    assert ak.paged_attention is paged_attention


@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_packed_queries_over_paged_keys_equal_each_sequence_alone(mask):
    """Chunked prefill of several prompts over their caches: packed queries (``cu_seqlens_q``)
    over paged keys, each sequence's queries its last positions, as each sequence alone."""
    lengths, q_lengths = [5, 12, 9], [2, 4, 1]
    key_pool, value_pool, table, keys, values = _pools(lengths, 4)
    q = torch.randn(sum(q_lengths), 4, 8, dtype=F64, generator=torch.Generator().manual_seed(8))
    cu_q = torch.tensor([0, 2, 6, 7])
    made = {None: None, "causal": ak.causal("bottom_right"),
            "window": ak.sliding_window(3, align="bottom_right")}[mask]
    got = paged_attention(q, key_pool, value_pool, table, lengths, cu_seqlens_q=cu_q, mask=made,
                          return_lse=True)
    assert got.out.shape == (7, 4, 6) and got.lse.shape == (4, 7)
    for b, (a, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        want = ak.attention(q[a:e].transpose(0, 1)[None], keys[b][None], values[b][None], made,
                            backend="reference", return_lse=True)
        torch.testing.assert_close(got.out[a:e], want.out[0].transpose(0, 1))
        torch.testing.assert_close(got.lse[:, a:e], want.lse[0].to(got.lse.dtype))
    with pytest.raises(ValueError, match="packed q"):
        paged_attention(q[None], key_pool, value_pool, table, lengths, cu_seqlens_q=cu_q)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_decoding_step_keeps_the_invariance_contract(dtype):
    """Under ``attnkit.invariant()`` a paged decoding step (``attend`` and ``paged_attention``)
    gives the bits of the same query row in one causal prefill: it takes the gathered call,
    whose fixed schedule keeps them, not the reading by runs."""
    gen = torch.Generator().manual_seed(0)
    length = 600
    q, k, v = (torch.randn(1, 2, length, 64, generator=gen, dtype=dtype) for _ in range(3))
    with ak.invariant():
        full = ak.attention(q, k, v, ak.causal(), return_lse=True)
        cache = PagedKVCache(num_blocks=40, block_size=32)
        cache.append(k[:, :, :-1], v[:, :, :-1])
        cache.append(k[:, :, -1:], v[:, :, -1:])
        steps = [cache.attend(q[:, :, -1:], return_lse=True),
                 paged_attention(q[:, :, -1:], cache.key_pool, cache.value_pool,
                                 cache.block_table(), [length], mask=ak.causal("bottom_right"),
                                 return_lse=True)]
    for step in steps:
        assert torch.equal(step.out, full.out[:, :, -1:])
        assert torch.equal(step.lse, full.lse[:, :, -1:])


def test_a_decoding_step_follows_use_backend():
    """Inside use_backend(name), a CPU decoding step runs on name as attention() does (not on
    the shortcut that reads the pool by runs)."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_blocks=64, block_size=16)
    cache.append(torch.randn(3, 4, 40, 32, generator=gen), torch.randn(3, 4, 40, 32, generator=gen),
                 lengths=[40, 23, 7])
    cache.append(torch.randn(3, 4, 1, 32, generator=gen), torch.randn(3, 4, 1, 32, generator=gen))
    q = torch.randn(3, 4, 1, 32, generator=gen)
    want = ak.attention(q, cache.keys, cache.values, cache.mask(), backend="reference")
    with ak.use_backend("reference"):
        assert torch.equal(cache.attend(q), want)
    assert torch.equal(cache.attend(q, backend="reference"), want)


def test_a_shallow_copy_is_refused_and_a_deep_copy_is_independent():
    """copy.copy would share the pools and tables (two caches writing the same blocks)."""
    import copy

    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_blocks=8, block_size=4)
    cache.append(torch.randn(2, 2, 3, 8, generator=gen), torch.randn(2, 2, 3, 8, generator=gen))
    with pytest.raises(TypeError, match="deepcopy"):
        copy.copy(cache)
    twin = copy.deepcopy(cache)
    k, v = torch.randn(2, 2, 1, 8, generator=gen), torch.randn(2, 2, 1, 8, generator=gen)
    twin.append(k + 1, v + 1)
    cache.append(k, v)
    assert torch.equal(cache.keys[:, :, 3:4], k) and torch.equal(twin.keys[:, :, 3:4], k + 1)


def test_attend_takes_the_queries_of_the_last_append():
    cache = PagedKVCache(num_blocks=8, block_size=4)
    cache.append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    for t in (2, 5):
        with pytest.raises(ValueError, match="added 3 per sequence"):
            cache.attend(torch.randn(2, 2, t, 8))


def test_rows_and_counts_are_checked():
    import numpy as np

    cache = PagedKVCache(num_blocks=8, block_size=4)
    cache.add(3)
    with pytest.raises(TypeError, match=r"free\(\[0\]\)"):
        cache.free(0)
    with pytest.raises(ValueError, match="count=-1"):
        cache.add(-1)
    with pytest.raises(ValueError, match="row True"):
        cache.fork(True)
    assert cache.fork(np.int64(0)) == 3
    cache.free(torch.tensor([3]))
    cache.free(np.array([2]))
    assert cache.batch == 2


def test_errors_name_what_the_caller_passed():
    pool = torch.zeros(6, 4, 2, 8)
    with pytest.raises(ValueError, match=r"multiple of the pools' Hkv.*q \(2, 3, 1, 8\)"):
        paged_attention(torch.zeros(2, 3, 1, 8), pool, pool, [[0], [1]], [1, 1])
    with pytest.raises(ValueError, match=r"seqlens\[0\] = -1: a sequence holds 0 or more"):
        paged_attention(torch.zeros(2, 2, 1, 8), pool, pool, [[0], [1]], [-1, 1])
    with pytest.raises(ValueError, match="block_tables .* and lengths .* one row per sequence "
                                         "each, got 2 and 1"):
        PagedKVCache.from_tables(pool, pool, [[0], [1]], [1])
    with pytest.raises(ValueError, match=r"got key_pool \(6, 4, 2, 8\), value_pool"):
        PagedKVCache.from_tables(pool, torch.zeros(5, 4, 2, 8), [[0]], [1])


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("length", [8, 500])  # gathered, and read in place by runs of blocks
def test_paged_attention_runs_under_autocast_as_attention_does(pool_dtype, length):
    """Under torch.autocast q and the pools run in the autocast dtype whatever the cache's
    length (the in-place path included), as attention() takes them; a float8 pool is refused
    by name."""
    gen = torch.Generator().manual_seed(3)
    blocks = -(-length // 16)
    key_pool, value_pool = (torch.randn(2 * blocks, 16, 2, 64, generator=gen, dtype=pool_dtype)
                            for _ in range(2))
    table = torch.arange(2 * blocks).view(2, blocks)
    q = torch.randn(2, 4, 1, 64, generator=gen, dtype=pool_dtype)
    keys, values = (pool[table].flatten(1, 2)[:, :length].transpose(1, 2)
                    for pool in (key_pool, value_pool))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = paged_attention(q, key_pool, value_pool, table, [length, length])
        want = ak.attention(q, keys, values)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="float64/float32/float16/bfloat16"):
        paged_attention(q.to(torch.float8_e4m3fn), key_pool.to(torch.float8_e4m3fn),
                        value_pool.to(torch.float8_e4m3fn), table, [length, length])


def test_tables_on_meta_are_refused_by_name():
    """A shape-only call keeps the block table real: one on meta holds no values to read."""
    q = torch.empty(2, 4, 1, 8, device="meta")
    pool = torch.empty(4, 4, 2, 8, device="meta")
    table = torch.tensor([[0, 1], [2, 3]])
    assert paged_attention(q, pool, pool, table, [5, 8]).shape == (2, 4, 1, 8)
    with pytest.raises(ValueError, match="block_table is read on the host"):
        paged_attention(q, pool, pool, table.to("meta"), [5, 8])
