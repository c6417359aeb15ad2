"""flash-attn's keyword arguments spelled as attnkit's hints say (``FLASH_ATTN_KEYWORDS``) give
flash-attn's results: its semantics written out here in float64 from its documentation
(``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``; layout
``[B, T, H, D]``), compared over seeded random shapes in float64 and float32.

flash-attn's documented semantics, per sequence of ``Tq`` queries and ``Tk`` keys, with
``d = i + Tk − Tq − j`` (query i, key j; bottom-right aligned):
- ``causal``: keys with ``d ≥ 0``; a row with no key gives output 0;
- ``window_size=(left, right)``: keys with ``−right ≤ d ≤ left``, a negative side unbounded;
  ``causal`` makes ``right`` 0;
- ``softcap``: ``cap · tanh(s / cap)`` of the scaled scores ``s``, before ALiBi;
- ``alibi_slopes`` ``[H]`` or ``[B, H]``: ``−slope · |d|`` added to the scores;
- GQA: query head h reads key/value head ``h // (Hq / Hkv)``;
- LSE ``[B, H, Tq]`` (packed ``[H, total_q]`` for varlen), natural log. flash-attn's kernel
  writes +inf for a row with no key, attnkit −inf: the reference gives −inf (the hints say so).
"""

from __future__ import annotations

import random
import re

import pytest
import torch

import attnkit as ak
from attnkit.inputs import FLASH_ATTN_KEYWORDS
from attnkit.masks import UNBOUNDED
from attnkit.nn import PagedKVCache

F64, F32 = torch.float64, torch.float32


# ---- flash-attn, written out ------------------------------------------------------------------
def fa_reference(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 softmax_scale=None):
    """flash_attn_func: ``q [B, Tq, Hq, D]``, ``k``/``v [B, Tk, Hkv, D]`` → ``(out [B, Tq, Hq,
    Dv], lse [B, Hq, Tq])`` in float64."""
    batch, tq, hq, dk = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = dk ** -0.5 if softmax_scale is None else softmax_scale
    keys = k.double().repeat_interleave(hq // hkv, dim=2)  # head h reads h // group
    values = v.double().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), keys) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    d = torch.arange(tq)[:, None] + tk - tq - torch.arange(tk)[None, :]  # [Tq, Tk]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, hq)  # [1|B, H]
        s = s - slopes[:, :, None, None] * d.abs().double()
    left, right = window_size
    right = 0 if causal else right
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if left >= 0:
        allowed &= d <= left
    if right >= 0:
        allowed &= -d <= right
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    weights = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no key: 0
    return torch.einsum("bhij,bjhd->bihd", weights, values), lse


def fa_varlen_reference(q, k, v, cu_q, cu_k, **options):
    """flash_attn_varlen_func: packed ``q [total_q, Hq, D]``, ``k``/``v [total_k, Hkv, D]`` →
    ``(out [total_q, Hq, Dv], lse [Hq, total_q])``, each sequence alone."""
    outs, lses = [], []
    slopes = options.pop("alibi_slopes", None)
    for b, (a, z, c, e) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        sequence = None if slopes is None else slopes if slopes.dim() == 1 else slopes[b]
        out, lse = fa_reference(q[None, a:z], k[None, c:e], v[None, c:e],
                                alibi_slopes=sequence, **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def fa_kvcache_reference(q, k_pool, v_pool, k_new, v_new, cache_seqlens, block_table,
                         **options):
    """flash_attn_with_kvcache on a paged cache: ``k_new``/``v_new [B, t, Hkv, D]`` written at
    each sequence's positions ``cache_seqlens[b]…`` through ``block_table`` (in place), then
    ``q [B, Tq, Hq, D]`` over its ``cache_seqlens[b] + t`` keys → ``(out, lse [B, Hq, Tq])``."""
    block = k_pool.shape[1]
    new = 0 if k_new is None else k_new.shape[1]
    outs, lses = [], []
    slopes = options.pop("alibi_slopes", None)
    for b, start in enumerate(cache_seqlens):
        for t in range(new):
            where = int(block_table[b][(start + t) // block]), (start + t) % block
            k_pool[where], v_pool[where] = k_new[b, t], v_new[b, t]
        positions = torch.arange(start + new)
        blocks = torch.tensor(block_table[b])[positions // block]
        keys, values = (pool[blocks, positions % block][None] for pool in (k_pool, v_pool))
        sequence = None if slopes is None else slopes if slopes.dim() == 1 else slopes[b]
        out, lse = fa_reference(q[b:b + 1], keys, values, alibi_slopes=sequence, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# ---- the attnkit spelling the hints give ------------------------------------------------------
def hinted(name: str) -> list[str]:
    """The code a hint spells (its backticked parts)."""
    return re.findall(r"`([^`]+)`", FLASH_ATTN_KEYWORDS[name])


def symmetric_alibi(slopes: torch.Tensor, n: int):
    """flash-attn's ALiBi without a causal mask, as the alibi_slopes hint spells it."""
    (code,) = [c for c in hinted("alibi_slopes") if "relative_bias" in c]
    return eval(code, {"ak": ak, "torch": torch, "slopes": slopes, "n": n})  # noqa: S307


def spelled(causal, window_size, softcap, alibi_slopes, longest, causal_mask=True,
            ) -> ak.Mask | None:
    """flash-attn's options as the hints spell them, joined by ``&`` (``causal_mask=False``:
    all but the causal mask, which ``PagedKVCache.attend`` takes as ``is_causal``)."""
    left, right = window_size
    parts = [ak.causal("bottom_right")] if causal and causal_mask else []
    if window_size != (-1, -1):
        parts.append(ak.sliding_window(UNBOUNDED if left < 0 else left,
                                       UNBOUNDED if right < 0 else right, "bottom_right"))
    if softcap > 0:
        parts.append(ak.softcap(softcap))
    if alibi_slopes is not None:
        keys_causal = causal or right == 0
        parts.append(ak.alibi(alibi_slopes, "bottom_right") if keys_causal
                     else symmetric_alibi(alibi_slopes, longest))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def options(rng: random.Random, heads: int, batch: int, causal_alibi: bool = False,
            batched_slopes: bool = True) -> dict:
    """Random flash-attn options: causal, window_size, softcap, alibi_slopes."""
    causal = rng.random() < 0.5
    window = ((rng.choice([-1, 0, 1, 3]), rng.choice([-1, 0, 1, 3])) if rng.random() < 0.5
              else (-1, -1))
    slopes = None
    if rng.random() < 0.4:
        shape = (batch, heads) if batched_slopes and rng.random() < 0.5 else (heads,)
        slopes = torch.rand(shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)),
                            dtype=F64)
        causal = causal or causal_alibi
    return dict(causal=causal, window_size=window, softcap=rng.choice([0.0, 0.0, 2.0]),
                alibi_slopes=slopes)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def close(got, want, dtype):
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.double(), want, **tol)


def close_lse(got, want, dtype):
    """LSE equal where a row has keys; −inf (flash-attn's documented log 0) where it has none."""
    finite = torch.isfinite(want)
    close(got[finite], want[finite], dtype)
    assert (got[~finite] == float("-inf")).all()


# ---- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32])
def test_flash_attn_func_options_as_the_hints_spell_them(dtype):
    """causal (Tq ≠ Tk, rows with no key), windows, softcap, ALiBi ([H] and [B, H]; causal,
    and without causal as the hint's relative bias), GQA/MQA: ``ak.attention`` on ``[B, H, T,
    D]`` gives flash_attn_func's output and LSE."""
    rng = random.Random(0)
    for trial in range(40):
        batch, heads_kv, group = rng.randint(1, 2), rng.choice([1, 2]), rng.choice([1, 2, 3])
        tq, tk, dk = rng.randint(1, 9), rng.randint(1, 9), rng.choice([4, 8])
        gen = torch.Generator().manual_seed(trial)
        q, k, v = (randn(gen, batch, t, h, dk) for t, h in
                   ((tq, heads_kv * group), (tk, heads_kv), (tk, heads_kv)))
        chosen = options(rng, heads_kv * group, batch)
        if chosen["alibi_slopes"] is not None and not chosen["causal"]:
            chosen["alibi_slopes"] = chosen["alibi_slopes"].reshape(-1)[:heads_kv * group]
        want_out, want_lse = fa_reference(q, k, v, **chosen)
        mask = spelled(**chosen, longest=max(tq, tk))
        got = ak.attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)), mask,
                           return_lse=True)
        close(got.out.transpose(1, 2), want_out, dtype)
        close_lse(got.lse, want_lse, dtype)


def test_alibi_without_causal_is_symmetric_in_flash_attn():
    """flash-attn's ALiBi subtracts slope·|d| on both sides of the diagonal; ``ak.alibi`` adds
    slope·(j − i − shift), which differs on keys after the query: the hint spells the
    non-causal case by the relative bias it names."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = randn(gen, 1, 5, 2, 8), randn(gen, 1, 3, 2, 8), randn(gen, 1, 3, 2, 8)
    slopes = torch.tensor([0.5, 0.25], dtype=F64)
    want, _ = fa_reference(q, k, v, alibi_slopes=slopes)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    one_sided = ak.attention(qh, kh, vh, ak.alibi(slopes, "bottom_right")).transpose(1, 2)
    assert not torch.allclose(one_sided, want)
    torch.testing.assert_close(ak.attention(qh, kh, vh, symmetric_alibi(slopes, 5)).transpose(
        1, 2), want)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_flash_attn_varlen_func_as_the_hints_spell_it(dtype):
    """Packed sequences, cu_seqlens_k ≠ cu_seqlens_q (empty sequences too), each aligned
    bottom-right on its own lengths; LSE packed ``[Hq, total_q]`` as flash-attn's."""
    rng = random.Random(1)
    for trial in range(30):
        n, heads_kv, group = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 2])
        lengths_q = [rng.randint(0, 6) for _ in range(n)]
        lengths_k = lengths_q if rng.random() < 0.3 else [rng.randint(0, 6) for _ in range(n)]
        cu_q, cu_k = ([0, *torch.tensor(lengths).cumsum(0).tolist()]
                      for lengths in (lengths_q, lengths_k))
        gen = torch.Generator().manual_seed(100 + trial)
        q = randn(gen, cu_q[-1], heads_kv * group, 4)
        k, v = randn(gen, cu_k[-1], heads_kv, 4), randn(gen, cu_k[-1], heads_kv, 4)
        chosen = options(rng, heads_kv * group, n, batched_slopes=False)
        want_out, want_lse = fa_varlen_reference(q, k, v, cu_q, cu_k, **dict(chosen))
        mask = spelled(**chosen, longest=max(lengths_q + lengths_k + [1]))
        got = ak.varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                  torch.tensor(cu_q, dtype=torch.int32),
                                  torch.tensor(cu_k, dtype=torch.int32),
                                  max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k),
                                  mask=mask, return_lse=True)
        close(got.out, want_out, dtype)
        close_lse(got.lse, want_lse, dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_flash_attn_with_kvcache_as_the_hints_spell_it(dtype):
    """A paged cache: new keys written at cache_seqlens through the block table and counted in
    seqlens (or appended by ``PagedKVCache``), causal relative to each sequence's length,
    windows, softcap, GQA; ALiBi (one query per sequence, without the LSE, as the hint says);
    LSE ``[B, Hq, Tq]``."""
    rng = random.Random(2)
    for trial in range(30):
        batch, heads_kv, group = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 2])
        block, tq = rng.choice([2, 4]), rng.choice([1, 1, 2, 3])
        new = rng.choice([0, tq])
        cached = [rng.randint(0 if new else 1, 7) for _ in range(batch)]
        table = torch.randperm(16, generator=torch.Generator().manual_seed(trial))[
            :batch * 5].reshape(batch, 5).tolist()
        gen = torch.Generator().manual_seed(200 + trial)
        q = randn(gen, batch, tq, heads_kv * group, 4)
        k_pool, v_pool = randn(gen, 16, block, heads_kv, 4), randn(gen, 16, block, heads_kv, 4)
        k_new, v_new = (randn(gen, batch, new, heads_kv, 4) for _ in range(2))
        chosen = options(rng, heads_kv * group, batch, causal_alibi=True)
        alibi = chosen["alibi_slopes"] is not None
        if alibi:  # one query per sequence
            tq, new = 1, min(new, 1)
            q, k_new, v_new = q[:, :1], k_new[:, :new], v_new[:, :new]
        pools = k_pool.to(dtype).clone(), v_pool.to(dtype).clone()  # the reference writes its own
        want_out, want_lse = fa_kvcache_reference(q, k_pool, v_pool, k_new, v_new, cached,
                                                  table, **dict(chosen))
        mask = spelled(**chosen, longest=0)
        lse = not alibi
        by_hand = tuple(pool.clone() for pool in pools)  # new keys written at flash-attn's slots
        for b, start in enumerate(cached):
            for t in range(new):
                where = table[b][(start + t) // block], (start + t) % block
                by_hand[0][where], by_hand[1][where] = k_new[b, t], v_new[b, t]
        direct = ak.paged_attention(q.to(dtype).transpose(1, 2), *by_hand, table,
                                    [n + new for n in cached], mask=mask, return_lse=lse)
        got = None
        if new:  # or the cache appends them, into blocks of its own
            cache = PagedKVCache.from_tables(*pools, table, cached)
            cache.append(k_new.to(dtype).transpose(1, 2), v_new.to(dtype).transpose(1, 2))
            got = cache.attend(q.to(dtype).transpose(1, 2),
                               spelled(**chosen, longest=0, causal_mask=False),
                               is_causal=chosen["causal"], return_lse=lse)
        for result in (got, direct):
            if result is None:
                continue
            close((result.out if lse else result).transpose(1, 2), want_out, dtype)
            if lse:
                close_lse(result.lse, want_lse, dtype)


@pytest.mark.parametrize("name", ["causal", "softmax_scale", "window_size", "softcap",
                                  "alibi_slopes", "return_attn_probs", "return_softmax_lse",
                                  "cache_seqlens"])
def test_flash_attn_keywords_name_their_spelling(name):
    """Every keyword of flash_attn_varlen_func and flash_attn_with_kvcache that the packed and
    paged calls do not take gets its attnkit spelling."""
    q = torch.zeros(4, 2, 8)
    spelling = rf"'{name}'; attnkit spells it:\n  {name} \(flash-attn's\)"
    with pytest.raises(TypeError, match=spelling):
        ak.varlen_attention(q, q, q, [0, 4], **{name: None})


def test_the_lse_hints_say_what_differs():
    """attnkit's LSE of a row with no key is −inf, flash-attn's kernel writes +inf; its layouts
    are flash-attn's."""
    for name in ("return_attn_probs", "return_softmax_lse"):
        assert "+inf" in FLASH_ATTN_KEYWORDS[name] and "[B, Hq, Tq]" in FLASH_ATTN_KEYWORDS[name]
    assert "[Hq, total_q]" in FLASH_ATTN_KEYWORDS["return_attn_probs"]
    q = torch.zeros(2, 2, 8)
    got = ak.varlen_attention(q, q[:1], q[:1], [0, 1, 2], [0, 1, 1], return_lse=True)
    assert got.lse.shape == (2, 2) and (got.lse[:, 1] == float("-inf")).all()
    assert (got.out[1] == 0).all()
