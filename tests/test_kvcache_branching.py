"""KVCache branching (beam search, speculative decoding): extending one cache several times.

Every cache :meth:`KVCache.append` gives out keeps its own keys and values however its parent,
its siblings and its descendants are extended later. Expected contents are built here
independently, per sequence, by concatenating the real rows each append contributed; a
cache's padded positions (past ``lengths[b]``) hold no promise and are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention

BATCH, HEADS, DK, DV = 3, 2, 4, 3


@dataclass
class Expected:
    """What a cache must hold: per sequence b, ``keys[b] [Hkv, n_b, Dk]``, ``values[b]
    [Hkv, n_b, Dv]``, and whether it has per-sequence lengths."""

    keys: list
    values: list
    ragged: bool

    @classmethod
    def empty(cls) -> "Expected":
        return cls([torch.zeros(HEADS, 0, DK)] * BATCH, [torch.zeros(HEADS, 0, DV)] * BATCH, False)

    def extended(self, keys: torch.Tensor, values: torch.Tensor,
                 lengths: Optional[list]) -> "Expected":
        new = [keys.shape[2] if lengths is None else n for n in (lengths or [None] * BATCH)]
        return Expected([torch.cat([self.keys[b], keys[b, :, :new[b]]], 1) for b in range(BATCH)],
                        [torch.cat([self.values[b], values[b, :, :new[b]]], 1) for b in range(BATCH)],
                        self.ragged or lengths is not None)

    @property
    def sizes(self) -> list:
        return [k.shape[1] for k in self.keys]


def _check(cache: KVCache, expected: Expected, name: str) -> None:
    sizes = expected.sizes
    # with per-sequence lengths, T bounds the longest without reading a value: the chunk widths
    assert cache.length == max(sizes) if not expected.ragged else cache.length >= max(sizes), name
    assert cache.keys.shape[2] == cache.values.shape[2] == cache.length, name
    if expected.ragged:
        assert cache.lengths.tolist() == sizes, name
    else:
        assert cache.lengths is None, name
    for b, n in enumerate(sizes):
        assert torch.equal(cache.keys[b, :, :n], expected.keys[b]), f"{name}: keys of sequence {b}"
        assert torch.equal(cache.values[b, :, :n], expected.values[b]), f"{name}: values of sequence {b}"


class Tree:
    """Caches and what each must hold; new steps draw distinct random keys and values."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)
        self.nodes: list[tuple[str, KVCache, Expected]] = []

    def append(self, name: str, parent: tuple, t: int, lengths: Optional[list]) -> tuple:
        _, cache, expected = parent
        keys = torch.randn(BATCH, HEADS, t, DK, generator=self.gen)
        values = torch.randn(BATCH, HEADS, t, DV, generator=self.gen)
        node = (name, cache.append(keys, values, None if lengths is None else torch.tensor(lengths)),
                expected.extended(keys, values, lengths))
        self.nodes.append(node)
        return node

    def check(self) -> None:
        for name, cache, expected in self.nodes:
            if cache.length:
                _check(cache, expected, name)


CHAINS = {  # (t, lengths or None) per append, from an empty cache
    "ragged": [(6, [6, 2, 4]), (2, [0, 2, 1]), (1, [1, 1, 0]), (3, [0, 3, 2]), (1, [0, 0, 1])],
    "full": [(4, None), (1, None), (2, None), (1, None)],
    "mixed": [(4, None), (2, [0, 2, 1]), (1, None), (3, [0, 3, 2]), (1, [1, 0, 0])],
}


def _children(sizes: list, mode: str) -> list:
    """Pairs of appends to branch with: ragged ones where the longest sequence does not grow
    (the others write inside the parent's length) and ones where all grow; full ones; and,
    mixing, one of each in both orders."""
    longest = max(sizes)
    shorter = [[0 if n == longest else grow for n in sizes] for grow in (1, 2)]
    pairs = {"ragged": [(2, shorter[0], 2, shorter[1]), (2, [1, 2, 1], 2, [2, 1, 2])],
             "full": [(1, None, 2, None)],
             "mixed": [(2, shorter[0], 1, None), (1, None, 2, shorter[1])]}
    return pairs[mode]


@pytest.mark.parametrize("mode", list(CHAINS))
def test_branching_at_every_cache_of_a_chain_keeps_every_cache(mode):
    """For each cache of a decoding chain (ragged, full or mixed appends), two appends with
    different keys and lengths, then one more on each child: every cache ever given out (the
    chain, the parent, both children, the grandchildren) still holds exactly its own keys and
    values. The chain itself writes in place into one buffer; the first child of the chain's
    last cache does too, and the second child gets its own."""
    for parent_index in range(len(CHAINS[mode]) + 1):
        for t_a, lengths_a, t_b, lengths_b in _children_for(mode, parent_index):
            tree = Tree()
            node = ("empty", KVCache.empty(capacity=64), Expected.empty())
            chain = [node]
            for step, (t, lengths) in enumerate(CHAINS[mode]):
                node = tree.append(f"chain[{step + 1}]", node, t, lengths)
                chain.append(node)
            assert len({id(c._store) for _, c, _ in chain[1:]}) == 1  # in place all along
            parent = chain[parent_index]
            where = f"{mode}, branch at chain[{parent_index}] with {lengths_a} then {lengths_b}"
            a = tree.append(f"{where}: first child", parent, t_a, lengths_a)
            b = tree.append(f"{where}: second child", parent, t_b, lengths_b)
            tree.check()
            assert b[1]._store is not a[1]._store
            if parent is chain[-1]:
                assert a[1]._store is parent[1]._store  # the latest cache extends in place
            tree.append(f"{where}: first grandchild", a, 1, None if lengths_a is None else [1, 0, 1])
            tree.append(f"{where}: second grandchild", b, 2, None if lengths_b is None else [0, 2, 1])
            tree.check()
            if parent_index:
                _check(parent[1], parent[2], f"{where}: parent")


def _children_for(mode: str, parent_index: int) -> list:
    """:func:`_children` for the cache after the first ``parent_index`` appends of the chain."""
    sizes = [0] * BATCH
    for t, lengths in CHAINS[mode][:parent_index]:
        sizes = [n + (t if lengths is None else grow) for n, grow in zip(sizes, lengths or sizes)]
    return _children(sizes, mode)


def test_branches_of_a_ragged_cache_where_only_short_sequences_grow():
    """The smallest branching case: sequence 0 is the longest and stays so, sequence 1 grows
    by one in both branches, into the same slot of the shared buffer."""
    parent = KVCache.empty().append(torch.zeros(2, 1, 5, 2), torch.zeros(2, 1, 5, 2),
                                    lengths=torch.tensor([5, 3]))
    left = parent.append(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2), lengths=torch.tensor([0, 1]))
    right = parent.append(torch.full((2, 1, 1, 2), 2.0), torch.full((2, 1, 1, 2), 2.0),
                          lengths=torch.tensor([0, 1]))
    assert left.lengths.tolist() == right.lengths.tolist() == [5, 4]
    assert bool((left.keys[1, 0, 3] == 1).all()) and bool((left.values[1, 0, 3] == 1).all())
    assert bool((right.keys[1, 0, 3] == 2).all()) and bool((right.values[1, 0, 3] == 2).all())
    assert parent.lengths.tolist() == [5, 3] and bool((parent.keys[:, :, :3] == 0).all())


@pytest.mark.parametrize("first_lengths", [None, [5, 3]])
def test_padded_chunks_write_their_real_positions_and_zeros_past_them(first_lengths):
    """Each sequence's real positions land right after its own tokens, and the slots past its
    length hold zeros however NaN the chunk's padding was (the cache's masks vouch for those
    slots: no guard copies them). An append to a cache whose sequences are all alike fills one
    slice of the store; one to a ragged cache writes per sequence."""
    def chunk(width, start):
        keys = torch.arange(start, start + 2 * width, dtype=torch.float32).view(2, 1, width, 1)
        return keys.expand(2, 1, width, 2).clone()

    first, second = chunk(5, 0), chunk(1, 100)
    lengths = None if first_lengths is None else torch.tensor(first_lengths)
    if lengths is not None:
        first[1, :, 3:] = float("nan")
    second[1] = float("nan")
    cache = KVCache.empty(16).append(first, first.clone(), lengths=lengths)
    cache = cache.append(second, second.clone(), lengths=torch.tensor([1, 0]))
    before = [5, 5] if lengths is None else [5, 3]
    assert cache.lengths.tolist() == [before[0] + 1, before[1]]
    for b, (old, new) in enumerate(zip(before, [1, 0])):
        for stored in (cache.keys[b, 0, :, 0], cache.values[b, 0, :, 0]):
            want = torch.cat([first[b, 0, :old, 0], second[b, 0, :new, 0]])
            assert torch.equal(stored[:old + new], want), (b, stored)
            assert bool((stored[old + new:] == 0).all()), (b, stored)


@pytest.mark.parametrize("width", [8, 200])
@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_a_cache_of_the_callers_tensors_never_reads_past_its_lengths(backend, width):
    """A ``KVCache(keys, values, length, lengths)`` built from the caller's tensors vouches for
    nothing past each length: NaN there reaches no output, neither through its own mask nor
    through the step ``MultiHeadAttention`` appends to it (the store the step writes into
    holds zeros there) nor through a reordered copy, and the results equal those of the same
    cache holding zeros."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([width, width // 2, 3])
    keys = torch.randn(3, 2, width, 16, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 2, width, 16, generator=gen, dtype=torch.float64)
    past = (torch.arange(width) >= lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]
    clean = [keys.masked_fill(past, 0.0), values.masked_fill(past, 0.0)]
    dirty = [keys.masked_fill(past, float("nan")), values.masked_fill(past, float("nan"))]
    mha = MultiHeadAttention(64, 4, 2, dtype=torch.float64, backend=backend)
    x = torch.randn(3, 1, 64, generator=gen, dtype=torch.float64)
    q = torch.randn(3, 4, 1, 16, generator=gen, dtype=torch.float64)
    results = []
    for k, v in (clean, dirty):
        cache = KVCache(k, v, length=width, lengths=lengths)
        step = mha(x, is_causal=True, cache=cache, lengths=torch.ones(3, dtype=torch.long)).out
        direct = ak.attention(q, k, v, cache.mask(is_causal=False), backend=backend)
        kept = cache.reorder(torch.arange(3))  # a copy the cache vouches for
        reordered = ak.attention(q, kept.keys, kept.values, kept.mask(is_causal=False),
                                 backend=backend)
        results.append((step, direct, reordered))
    for got, want in zip(results[1], results[0]):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lengths,error,match", [
    ([1, 2, 3], TypeError, "integer tensor"),
    (torch.tensor([1.5, 1.0, 1.0]), TypeError, "dtype"),
    (torch.tensor([1, 2]), ValueError, r"shape \(2,\)"),
    (torch.tensor([9, 1, 1]), ValueError, r"outside \[0, 8\]"),
    (torch.tensor([-1, 1, 1]), ValueError, r"outside \[0, 8\]"),
])
def test_a_cache_of_the_callers_tensors_checks_its_lengths(lengths, error, match):
    keys = torch.zeros(3, 2, 8, 4)
    with pytest.raises(error, match=match):
        KVCache(keys, keys.clone(), length=8, lengths=lengths)


def test_threads_extending_one_cache_each_keep_their_own_keys():
    """Request threads continuing one cached prompt at once: one appends in place, the others
    copy, and every new cache holds the prompt and its own keys (the claim on the store is
    made under a lock, not after the writes)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(0)
    threads, wrong = 4, 0
    for _ in range(25):
        k0, v0 = torch.randn(2, 2, 16, 64, generator=gen), torch.randn(2, 2, 16, 64, generator=gen)
        prefix = KVCache.empty(capacity=1024).append(k0, v0)
        news = [(torch.randn(2, 2, 64, 64, generator=gen), torch.randn(2, 2, 64, 64, generator=gen))
                for _ in range(threads)]
        barrier = threading.Barrier(threads, timeout=60)  # a failing thread breaks it

        def extend(i):
            barrier.wait()
            return prefix.append(*news[i])
        with ThreadPoolExecutor(threads) as pool:
            caches = list(pool.map(extend, range(threads)))
        for (k, v), cache in zip(news, caches):
            wrong += not (torch.equal(cache.keys, torch.cat([k0, k], 2))
                          and torch.equal(cache.values, torch.cat([v0, v], 2)))
        assert torch.equal(prefix.keys, k0) and torch.equal(prefix.values, v0)
    assert wrong == 0, f"{wrong} of {25 * threads} caches hold another thread's keys"


def test_a_cache_made_without_grad_extends_twice_with_grad():
    """A prompt cached under no_grad, continued twice with grad mode on (the second copies
    the prompt): both give what a fresh cache of the same tokens gives."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4)
    prompt, step = torch.randn(1, 10, 32), torch.randn(2, 1, 3, 32)
    with torch.no_grad():
        prefix = mha(prompt, cache=mha.empty_cache(), is_causal=True).cache
    for x in step:  # the first appends in place, the second copies
        got = mha(x, cache=prefix, is_causal=True).out
        want = mha(torch.cat([prompt, x], 1), is_causal=True).out[:, -3:]
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_ragged_cache_continues_with_the_same_lengths_tensor(how):
    """A decode loop passes one lengths tensor every step; a copy of its cache (whose store
    remembers a copy of that tensor) continues as the original does."""
    import copy
    import pickle

    gen = torch.Generator().manual_seed(0)
    step = torch.ones(BATCH, dtype=torch.long)

    def kv(t):
        return (torch.randn(BATCH, HEADS, t, DK, generator=gen),
                torch.randn(BATCH, HEADS, t, DV, generator=gen))
    with torch.no_grad():
        cache = KVCache.empty().append(*kv(5), lengths=torch.tensor([5, 3, 4]))
        cache = cache.append(*kv(1), lengths=step)
        twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
        k, v = kv(1)
        want = cache.append(k, v, lengths=step)
        got = twin.append(k, v, lengths=step)
    assert torch.equal(got.lengths, want.lengths)
    for b, n in enumerate(want.lengths.tolist()):
        assert torch.equal(got.keys[b, :, :n], want.keys[b, :, :n])
