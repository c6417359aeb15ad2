"""The paged and packed cases of the peer suites, as attnkit states them.

- flash-attn's ``test_flash_attn_kvcache`` with ``paged_kv_block_size``: a paged cache
  (blocks in random order, ``cache_seqlens`` per sequence) receives new keys at each
  sequence's end, then the queries attend with bottom-right causal or a local window, MHA,
  GQA and MQA. Here: :meth:`PagedKVCache.from_tables`, ``append``, ``attend``.
- xFormers' ``PagedBlockDiagonal…PaddedKeysMask``: packed queries of several sequences, each
  over its own paged keys, causal from the bottom right. Here: ``paged_attention`` with
  ``cu_seqlens_q``.
- flash-attn's ``test_flash_attn_varlen_output``: packed sequences of random lengths, full,
  causal, local or ALiBi, MHA, GQA and MQA, forward and backward. Here: ``varlen_attention``.

Each case against float64 math on every sequence's own keys, alone.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.nn import PagedKVCache

F64 = torch.float64


def _random_pools(gen, lengths, block_size, heads_kv, dim, spare=2):
    """Pools in random block order holding ``lengths`` tokens per sequence, NaN elsewhere:
    ``(key_pool, value_pool, table, keys, values)`` with ``keys[b] [Hkv, n, D]``."""
    needed = [-(-n // block_size) + 1 for n in lengths]  # one block of room each
    count = sum(needed) + spare
    order = torch.randperm(count, generator=gen).tolist()
    pools = [torch.full((count, block_size, heads_kv, dim), float("nan"), dtype=F64)
             for _ in range(2)]
    table = torch.full((len(lengths), max(needed)), count + 3)  # garbage past the blocks
    keys, values = [], []
    for b, n in enumerate(lengths):
        blocks, order = order[:needed[b]], order[needed[b]:]
        table[b, :needed[b]] = torch.tensor(blocks)
        truth = [torch.randn(heads_kv, n, dim, generator=gen, dtype=F64) for _ in range(2)]
        for pool, t in zip(pools, truth):
            for p in range(n):
                pool[blocks[p // block_size], p % block_size] = t[:, p]
        keys.append(truth[0])
        values.append(truth[1])
    return pools[0], pools[1], table, keys, values


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("band", ["causal", "local"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_flash_attn_kvcache_paged(block_size, heads, new, band, backend):
    gen = torch.Generator().manual_seed(block_size + new)
    heads_q, heads_kv = heads
    lengths = [0, 7, 300, 129]
    key_pool, value_pool, table, keys, values = _random_pools(gen, lengths, block_size,
                                                              heads_kv, 16)
    cache = PagedKVCache.from_tables(key_pool, value_pool, table, lengths)
    k_new = torch.randn(4, heads_kv, new, 16, generator=gen, dtype=F64)
    v_new = torch.randn(4, heads_kv, new, 16, generator=gen, dtype=F64)
    cache.append(k_new, v_new)
    q = torch.randn(4, heads_q, new, 16, generator=gen, dtype=F64)
    window = ak.sliding_window(20, align="bottom_right") if band == "local" else None
    got = cache.attend(q, window, backend=backend)
    for b in range(4):
        k = torch.cat([keys[b], k_new[b]], 1)[None]
        v = torch.cat([values[b], v_new[b]], 1)[None]
        mask = ak.causal("bottom_right") if window is None else ak.sliding_window(
            20, align="bottom_right")
        want = ak.attention(q[b:b + 1], k, v, mask, backend="reference")
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_xformers_paged_block_diagonal_causal_padded_keys(block_size, backend):
    gen = torch.Generator().manual_seed(block_size)
    q_lens, kv_lens = [3, 1, 5, 2], [10, 1, 40, 2]
    key_pool, value_pool, table, keys, values = _random_pools(gen, kv_lens, block_size, 2, 8)
    q = torch.randn(sum(q_lens), 4, 8, generator=gen, dtype=F64)  # packed [total_q, H, D]
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    got = ak.paged_attention(q, key_pool, value_pool, table, kv_lens, cu_seqlens_q=cu,
                             mask=ak.causal("bottom_right"), backend=backend)
    for b in range(4):
        rows = q[cu[b]:cu[b + 1]].transpose(0, 1)[None]  # [1, H, n, D]
        want = ak.attention(rows, keys[b][None], values[b][None], ak.causal("bottom_right"),
                            backend="reference")
        torch.testing.assert_close(got[cu[b]:cu[b + 1]], want[0].transpose(0, 1), rtol=1e-10,
                                   atol=1e-10)


FLASH_VARLEN_SHAPES = [(1, 147), (113, 203), (128, 217), (108, 256), (256, 512), (512, 256)]
"""``(seqlen_q, seqlen_k)`` of flash-attn's ``test_flash_attn_varlen_output`` (the smaller
ones: the larger differ only in size)."""


@pytest.mark.parametrize("seqlen_q,seqlen_k", FLASH_VARLEN_SHAPES)
@pytest.mark.parametrize("variant", ["full", "causal", "local", "alibi", "causal&alibi"])
@pytest.mark.parametrize("heads", [(9, 9), (9, 3), (9, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_flash_attn_varlen_output(seqlen_q, seqlen_k, variant, heads, backend):
    """Four sequences of random lengths up to (seqlen_q, seqlen_k) (flash-attn's "random"
    padding: the last 20 positions may be padding), packed; causal and local windows from the
    bottom right of each sequence, ALiBi at each sequence's own positions: out, LSE and the
    gradients of q, k and v equal each sequence alone on the float64 reference."""
    heads_q, heads_kv = heads
    gen = torch.Generator().manual_seed(seqlen_q * 7 + seqlen_k + heads_kv)
    dim = 59 if heads_kv == 3 else 32
    lens_q = torch.randint(max(1, seqlen_q - 20), seqlen_q + 1, (4,), generator=gen).tolist()
    lens_k = torch.randint(max(1, seqlen_k - 20), seqlen_k + 1, (4,), generator=gen).tolist()
    q = torch.randn(sum(lens_q), heads_q, dim, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(sum(lens_k), heads_kv, dim, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(sum(lens_k), heads_kv, dim, generator=gen, dtype=F64, requires_grad=True)
    left, right = torch.randint(0, seqlen_k, (2,), generator=gen).tolist()
    mask = {"full": None, "causal": ak.causal("bottom_right"),
            "local": ak.sliding_window(left, right, align="bottom_right"),
            "alibi": ak.alibi(torch.rand(heads_q, generator=gen, dtype=F64)),
            "causal&alibi": ak.causal("bottom_right") & ak.alibi(
                torch.rand(heads_q, generator=gen, dtype=F64))}[variant]
    cu_q = [0, *torch.tensor(lens_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    got = ak.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                              mask=mask, backend=backend, return_lse=True)
    grad = torch.randn(got.out.shape, generator=gen, dtype=F64)
    got_grads = torch.autograd.grad(got.out, (q, k, v), grad)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [t.detach()[s].transpose(0, 1)[None].requires_grad_()
               for t, s in ((q, rows), (k, keys), (v, keys))]
        want = ak.attention(*one, mask, backend="reference", return_lse=True)
        want_grads = torch.autograd.grad(want.out, one, grad[rows].transpose(0, 1)[None])
        torch.testing.assert_close(got.out[rows], want.out[0].transpose(0, 1), rtol=1e-9,
                                   atol=1e-9)
        torch.testing.assert_close(got.lse[:, rows], want.lse[0], rtol=1e-9, atol=1e-9)
        for g, w, s in zip(got_grads, want_grads, (rows, keys, keys)):
            torch.testing.assert_close(g[s], w[0].transpose(0, 1), rtol=1e-9, atol=1e-9)
