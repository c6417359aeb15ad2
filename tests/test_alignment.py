"""Causal and sliding-window masks aligned per sequence (``sequences=`` a padding mask), and
causal documents whose query and key segments differ in length (``documents(causal=...)``).

Every expected mask is built here with Python loops from the definitions (offsets inside each
sequence's or document's own segments), never by calling the code under test. Attention is
checked against float64 attention over those masks (``conftest.naive_attention``) on the
reference, tiled, torch and auto backends, with gradients; triton runs through its interpreter
on CPU (switched on as ``test_padding.py`` does) and skips where that cannot run.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import import_triton_interpreted, interpreted_triton_launch  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.backends import tiled  # noqa: E402
from attnkit.inputs import validate  # noqa: E402
from attnkit.masks import EMPTY, FULL, MaskSpace  # noqa: E402

from conftest import (dense_band, dense_causal, dense_documents, naive_attention,  # noqa: E402
                      usable_backends)
from test_tiled import _assert_like_truth, _run  # noqa: E402


# ---- expected masks, by loops ---------------------------------------------------------------------

def band_loops(tq, tk, q_runs, kv_runs, left, right, align):
    """``[B, 1, tq, tk]``: batch element b's real queries ``q_runs[b] = (start, stop)`` and real
    keys ``kv_runs[b]``; with ``i``/``j`` a query's/key's offset in its run, ``d = j - i``
    (top_left) or ``(j - kv_len) - (i - q_len)`` (bottom_right), allowed when ``-left ≤ d ≤
    right`` (``None``: unbounded)."""
    rows = []
    for (q0, q1), (k0, k1) in zip(q_runs, kv_runs):
        grid = []
        for qpos in range(tq):
            line = []
            for kpos in range(tk):
                ok = q0 <= qpos < q1 and k0 <= kpos < k1
                if ok:
                    i, j = qpos - q0, kpos - k0
                    d = j - i if align == "top_left" else (j - (k1 - k0)) - (i - (q1 - q0))
                    ok = (right is None or d <= right) and (left is None or d >= -left)
                line.append(ok)
            grid.append(line)
        rows.append([grid])
    return torch.tensor(rows, dtype=torch.bool)


def documents_loops(q_ids, kv_ids, align):
    """``[B, 1, tq, tk]`` (B = 1 for 1-D ids): same document, and with ``i``/``j`` the offsets in
    the document's query/key segment of lengths ``qlen``/``kvlen``: ``j ≤ i`` (top_left) or
    ``j - kvlen ≤ i - qlen`` (bottom_right)."""
    q2 = [q_ids] if not isinstance(q_ids[0], list) else q_ids
    k2 = [kv_ids] if not isinstance(kv_ids[0], list) else kv_ids
    rows = []
    for b in range(max(len(q2), len(k2))):
        qs, ks = q2[min(b, len(q2) - 1)], k2[min(b, len(k2) - 1)]
        grid = []
        for qpos, qd in enumerate(qs):
            line = []
            for kpos, kd in enumerate(ks):
                ok = qd == kd
                if ok:
                    i, qlen = qpos - qs.index(qd), qs.count(qd)
                    j, kvlen = kpos - ks.index(kd), ks.count(kd)
                    ok = j <= i if align == "top_left" else j - kvlen <= i - qlen
                line.append(ok)
            grid.append(line)
        rows.append([grid])
    return torch.tensor(rows, dtype=torch.bool)


# ---- random cases -------------------------------------------------------------------------------

def random_runs(rng, batch, length, kind):
    """One ``(start, stop)`` per element: right, left or mixed padding, some rows empty or full."""
    runs = []
    for _ in range(batch):
        if kind == "right":
            runs.append((0, rng.randint(0, length)))
        elif kind == "left":
            runs.append((rng.randint(0, length), length))
        else:
            start = rng.randint(0, length)
            runs.append((start, rng.randint(start, length)))
    return runs


def padding_of(q_runs, kv_runs, tq, tk, form):
    """The padding mask of these runs, given as lengths/starts or as [B, T] real-token masks."""
    if form == "masks":
        def real(runs, width):
            return torch.tensor([[s <= t < e for t in range(width)] for s, e in runs])
        return ak.padding(q_mask=real(q_runs, tq), kv_mask=real(kv_runs, tk), allow_empty_rows=True)
    return ak.padding(q_lengths=[e - s for s, e in q_runs], kv_lengths=[e - s for s, e in kv_runs],
                      q_starts=[s for s, _ in q_runs], kv_starts=[s for s, _ in kv_runs])


BANDS = [(None, 0), (3, 0), (0, 0), (2, 1), (None, 2), (4, None)]  # (left, right); (None, 0) is causal


def band_mask(left, right, align, pad):
    if left is None and right == 0:
        return ak.causal(align, sequences=pad)
    return ak.sliding_window(ak.masks.UNBOUNDED if left is None else left,
                             ak.masks.UNBOUNDED if right is None else right, align=align, sequences=pad)


def band_case(seed):
    """``(mask, expected [B, 1, Tq, Tk], space)`` for one seed: random shapes (Tq ≠ Tk mostly),
    padding kind, band and alignment."""
    rng = random.Random(seed)
    batch, tq, tk = 3, rng.randint(1, 24), rng.randint(1, 28)
    kinds = ["right", "left", "mixed"]
    q_runs = random_runs(rng, batch, tq, kinds[seed % 3])
    kv_runs = random_runs(rng, batch, tk, kinds[(seed // 3) % 3])
    pad = padding_of(q_runs, kv_runs, tq, tk, "masks" if seed % 4 == 3 else "numbers")
    left, right = BANDS[seed % len(BANDS)]
    align = ("top_left", "bottom_right")[(seed // len(BANDS)) % 2]  # every band in both alignments
    mask = band_mask(left, right, align, pad)
    expected = band_loops(tq, tk, q_runs, kv_runs, left, right, align)
    return mask, expected, MaskSpace(batch, 2, tq, tk)


def random_documents(rng, n_docs, shuffle_kv=False, allow_absent=True):
    """Packed ids on each side with independent segment lengths (0 = absent on that side)."""
    low = 0 if allow_absent else 1
    q_ids, kv_ids = [], []
    for d in range(n_docs):
        q_ids += [d] * rng.randint(low, 5)
        kv_ids += [d] * rng.randint(low, 6)
    if not q_ids:
        q_ids = [0]
    if not kv_ids:
        kv_ids = [0]
    if shuffle_kv:  # the same documents in another order on the key side (still contiguous)
        order = list(dict.fromkeys(kv_ids))
        rng.shuffle(order)
        kv_ids = [d for d in order for _ in range(kv_ids.count(d))]
    return q_ids, kv_ids


def documents_case(seed):
    """``(mask, expected, space)``: causal documents, 1-D ids (seeds < 6) or 2-D rows of equal
    widths, segments of different lengths, documents missing on one side."""
    rng = random.Random(1000 + seed)
    align = ("top_left", "bottom_right")[seed % 2]
    if seed < 6:
        q_ids, kv_ids = random_documents(rng, rng.randint(1, 5), shuffle_kv=seed % 3 == 2)
        mask = ak.documents(q_ids, kv_ids, causal=align)
        space = MaskSpace(2, 2, len(q_ids), len(kv_ids))
    else:
        rows = [random_documents(rng, rng.randint(1, 4)) for _ in range(3)]
        tq, tk = max(len(q) for q, _ in rows), max(len(k) for _, k in rows)
        # pad each row with a document of its own at the end (absent on the other side)
        q_ids = [q + [90 + b] * (tq - len(q)) for b, (q, _) in enumerate(rows)]
        kv_ids = [k + [80 + b] * (tk - len(k)) for b, (_, k) in enumerate(rows)]
        mask = ak.documents(torch.tensor(q_ids), torch.tensor(kv_ids), causal=align)
        space = MaskSpace(3, 2, tq, tk)
    return mask, documents_loops(q_ids, kv_ids, align), space


def full(t, space):
    return t.expand(space.batch, space.heads, space.q_len, space.kv_len)


# ---- the element mask ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(48))
def test_sequence_band_dense_equals_loops(seed):
    mask, expected, space = band_case(seed)
    assert mask.check(space) == []
    assert torch.equal(full(mask.to_dense(space), space), full(expected, space)), mask


@pytest.mark.parametrize("seed", range(10))
def test_causal_documents_dense_equals_loops(seed):
    mask, expected, space = documents_case(seed)
    assert mask.check(space) == []
    assert torch.equal(full(mask.to_dense(space), space), full(expected, space)), mask


def test_tiles_at_any_positions_equal_the_dense_mask():
    for mask, _, space in [band_case(s) for s in range(6)] + [documents_case(s) for s in (1, 7)]:
        dense = full(mask.to_dense(space), space)
        q_idx = torch.randperm(space.q_len)[: max(1, space.q_len // 2)]
        kv_idx = torch.randperm(space.kv_len)[: max(1, space.kv_len // 2)]
        tile = mask.tile(q_idx, kv_idx, space).expand(space.batch, space.heads, len(q_idx), len(kv_idx))
        assert torch.equal(tile, dense[:, :, q_idx][:, :, :, kv_idx]), mask


def test_same_lengths_reduce_to_the_global_masks():
    """Sequences that fill the whole [Tq, Tk]: the global alignment; equal ids on both sides:
    ``documents(ids) & causal()``."""
    space = MaskSpace(2, 1, 5, 9)
    pad = ak.padding(q_lengths=[5, 5], kv_lengths=[9, 9])
    for align in ("top_left", "bottom_right"):
        assert torch.equal(full(ak.causal(align, sequences=pad).to_dense(space), space),
                           full(ak.causal(align).to_dense(space), space))
        assert torch.equal(full(ak.sliding_window(2, 1, align, sequences=pad).to_dense(space), space),
                           full(ak.sliding_window(2, 1, align).to_dense(space), space))
    ids = [0, 0, 0, 1, 1, 2, 2, 2]
    square = MaskSpace(1, 1, 8, 8)
    assert torch.equal(ak.documents(ids, causal="top_left").to_dense(square),
                       (ak.documents(ids) & ak.causal()).to_dense(square))
    combined = ak.documents(ids) & ak.causal()  # unchanged: the plain documents mask, global causal
    assert type(combined.parts[0]) is ak.masks._Documents
    assert torch.equal(combined.to_dense(square), dense_documents(ids) & dense_causal(8, 8))


def test_decode_with_per_sequence_cache_lengths():
    """Tq = 1 after a cache of a different length per sequence (right-padded cache): bottom-right
    per sequence sees the whole cache, a window its last ``left + 1`` keys; the global
    bottom-right alignment would put every query on the last *padded* key."""
    cache = [5, 9, 1, 0]
    space = MaskSpace(4, 2, 1, 9)
    pad = ak.padding(kv_lengths=cache)
    runs_q, runs_kv = [(0, 1)] * 4, [(0, n) for n in cache]
    got = ak.causal("bottom_right", sequences=pad).to_dense(space)
    expected = band_loops(1, 9, runs_q, runs_kv, None, 0, "bottom_right")
    assert torch.equal(full(got, space), full(expected, space))
    assert torch.equal(full(got, space), full(pad.to_dense(space), space))  # every cached key
    window = ak.sliding_window(2, align="bottom_right", sequences=pad).to_dense(space)[:, 0, 0]
    assert window.tolist() == [[j in (2, 3, 4) for j in range(9)], [j in (6, 7, 8) for j in range(9)],
                               [j == 0 for j in range(9)], [False] * 9]
    # a chunk of 3 new tokens per sequence, left-padded cache: the chunk's last query on the last key
    space = MaskSpace(2, 1, 3, 7)
    pad = ak.padding(q_lengths=[3, 2], kv_starts=[2, 0], kv_lengths=[5, 4])
    expected = band_loops(3, 7, [(0, 3), (0, 2)], [(2, 7), (0, 4)], None, 0, "bottom_right")
    got = ak.causal("bottom_right", sequences=pad).to_dense(space)
    assert torch.equal(full(got, space), full(expected, space))


# ---- block maps and tile structure ------------------------------------------------------------

def assert_block_map_exact(mask, space, block_q, block_k, q_offset=0, q_count=None, kv_offset=0,
                           kv_count=None):
    q_count = space.q_len - q_offset if q_count is None else q_count
    kv_count = space.kv_len - kv_offset if kv_count is None else kv_count
    codes = mask.block_map(block_q, block_k, space, q_offset=q_offset, q_count=q_count,
                           kv_offset=kv_offset, kv_count=kv_count)
    nq, nk = math.ceil(q_count / block_q), math.ceil(kv_count / block_k)
    assert codes.dtype == torch.int8 and codes.shape[2:] == (nq, nk)
    codes = codes.expand(space.batch, space.heads, nq, nk)
    dense = full(mask.to_dense(space), space)
    for qb in range(nq):
        q0, q1 = q_offset + qb * block_q, q_offset + min((qb + 1) * block_q, q_count)
        for kb in range(nk):
            k0, k1 = kv_offset + kb * block_k, kv_offset + min((kb + 1) * block_k, kv_count)
            tile = dense[:, :, q0:q1, k0:k1].flatten(2)
            code = codes[:, :, qb, kb]
            where = f"{mask!r} block ({qb}, {kb}) of {block_q}x{block_k}"
            assert torch.equal(code == EMPTY, ~tile.any(-1)), f"{where}: EMPTY is not exactly 'none allowed'"
            assert torch.equal(code == FULL, tile.all(-1)), f"{where}: FULL is not exactly 'all allowed'"


@pytest.mark.parametrize("seed", range(12))
def test_block_maps_are_exact(seed):
    rng = random.Random(500 + seed)
    cases = [band_case(seed), band_case(seed + 12), documents_case(seed % 10)]
    for mask, _, space in cases:
        for _ in range(3):
            block_q, block_k = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 5, 8])
            q_offset, kv_offset = rng.randint(0, space.q_len - 1), rng.randint(0, space.kv_len - 1)
            assert_block_map_exact(mask, space, block_q, block_k, q_offset,
                                   rng.randint(1, space.q_len - q_offset), kv_offset)
        assert_block_map_exact(mask, space, 4, 4)


def test_block_maps_are_analytic_and_skip_padded_tiles(monkeypatch):
    """Neither block map evaluates the element mask, and a padded batch gets its EMPTY blocks:
    per element (what the triton kernels skip) and for the whole batch (what tiled skips)."""
    def no_elements(*args, **kwargs):
        raise AssertionError("block_map evaluated the element mask")
    space = MaskSpace(2, 1, 64, 96)
    pad = ak.padding(q_lengths=[16, 40], kv_lengths=[20, 96], kv_starts=[8, 0])
    docs = ak.documents(torch.arange(64) // 16, torch.arange(96) // 24, causal="bottom_right")
    for mask in (ak.causal("bottom_right", sequences=pad), ak.sliding_window(8, sequences=pad), docs):
        expected = mask.to_dense(space)
        monkeypatch.setattr(type(mask), "tile", no_elements)
        codes = mask.block_map(8, 8, space)
        monkeypatch.undo()
        per_element = (codes == EMPTY).sum((1, 2, 3))
        truth = (~expected.unflatten(2, (8, 8)).unflatten(-1, (12, 8)).any(-1).any(-2)).sum((1, 2, 3))
        assert torch.equal(per_element, truth), mask
        assert int(per_element.min()) >= 40, (mask, per_element)  # of 96 blocks
    # tiled skips a block only where every element's is EMPTY: queries past both real runs
    plan = tiled.make_plan(ak.causal(sequences=pad), space, batch=2, heads=1, q_offset=0, q_count=64,
                           kv_offset=0, kv_count=96, block_q=8, block_k=8)
    assert all(segments == () for segments in plan.rows[5:]), plan.rows
    assert sum(seg.stop - seg.start for seg in plan.rows[0]) <= 32


@pytest.mark.parametrize("maker", ["band", "documents", "padding"])
def test_square_structures_are_never_wrong(maker):
    """What a fused plan knows of a square tile from the mask's key ranges (full, lower or
    upper triangle: ``plan._Squares``) is what the dense mask holds there, for every query
    block of 1–5 rows and every key offset."""
    from attnkit.backends.tiled.plan import _square_summaries, _Squares
    from attnkit.masks import key_ranges

    if maker == "band":
        same = ak.padding(q_lengths=[12, 12], kv_lengths=[12, 12], q_starts=[0, 0], kv_starts=[2, 2])
        masks = [band_case(s)[0] for s in (0, 5, 7)] + [
            ak.causal(sequences=same), ak.sliding_window(3, sequences=same),
            ak.causal("bottom_right", sequences=ak.padding(q_lengths=[6, 12], kv_lengths=[8, 14]))]
        spaces = [band_case(s)[2] for s in (0, 5, 7)] + [MaskSpace(2, 1, 12, 14)] * 3
    elif maker == "documents":
        masks = [documents_case(s)[0] for s in (0, 1, 6)] + [
            ak.documents(torch.arange(12) // 4, torch.arange(12) // 4, causal="bottom_right")]
        spaces = [documents_case(s)[2] for s in (0, 1, 6)] + [MaskSpace(1, 1, 12, 12)]
    else:
        masks = [ak.padding(q_starts=[2, 4, 3], kv_starts=[5, 1, 6], kv_lengths=[8, 9, 3]),
                 ak.padding(kv_starts=[4]) & ak.causal("bottom_right"),
                 ak.padding(q_starts=[12, 12, 12])]
        spaces = [MaskSpace(3, 1, 12, 14)] * 3
    claims = set()
    for mask, space in zip(masks, spaces):
        dense = full(mask.to_dense(space), space)
        ranges = key_ranges(mask, space)
        if ranges.exact is not None and not bool(ranges.exact):
            continue  # documents not one run each: a plan knows no square of theirs
        for q0 in range(space.q_len):
            for n in range(1, min(5, space.q_len - q0) + 1):
                lo, hi = (t[:, q0:q0 + n] for t in ranges[:2])
                squares = _Squares(_square_summaries(lo, hi, n).tolist())
                rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
                for k0 in range(space.kv_len - n + 1):
                    claim = squares.structure(0, n, k0, k0 + n)
                    claims.add(claim)
                    tile = dense[:, :, q0:q0 + n, k0:k0 + n]
                    shape = {"full": torch.ones(n, n, dtype=torch.bool), "lower": cols <= rows,
                             "upper": cols >= rows}
                    if claim is not None:
                        assert torch.equal(tile, shape[claim].expand_as(tile)), (
                            mask, q0, n, k0, claim)
                    else:  # and never unsure where the dense mask is one of them
                        assert not any(torch.equal(tile, s.expand_as(tile))
                                       for s in shape.values()), (mask, q0, n, k0)
    assert {"full", "lower", None} <= claims


# ---- attention on every backend ---------------------------------------------------------------

def qkv(space, dtype=torch.float64, seed=5, d=8):
    g = torch.Generator().manual_seed(seed)
    shapes = ((space.batch, 4, space.q_len, d), (space.batch, 2, space.kv_len, d),
              (space.batch, 2, space.kv_len, d))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def attention_cases():
    """name → (mask, expected [B, 1, Tq, Tk], space): shapes Tq ≠ Tk, decode, both alignments,
    windows, mixed padding, causal documents."""
    cases = {f"band{s}": band_case(s) for s in (5, 6, 12, 13, 16, 21, 30, 47)}
    space = MaskSpace(3, 4, 1, 11)  # decode: one new token per sequence, caches of 7, 11 and 0 keys
    pad = ak.padding(kv_lengths=[7, 11, 0])
    expected = band_loops(1, 11, [(0, 1)] * 3, [(0, 7), (0, 11), (0, 0)], 3, 0, "bottom_right")
    cases["decode"] = (ak.sliding_window(3, align="bottom_right", sequences=pad), expected, space)
    space = MaskSpace(3, 4, 4, 14)  # a chunk of new tokens per sequence after a left-padded cache
    q_runs, kv_runs = [(1, 4), (0, 2), (0, 4)], [(2, 10), (0, 5), (5, 14)]
    cases["chunk"] = (ak.causal("bottom_right", sequences=padding_of(q_runs, kv_runs, 4, 14, "numbers")),
                      band_loops(4, 14, q_runs, kv_runs, None, 0, "bottom_right"), space)
    cases["docs_tl"], cases["docs_br"], cases["docs_2d"] = (documents_case(s) for s in (0, 3, 7))
    return cases


CASES = list(attention_cases())


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "auto"])
@pytest.mark.parametrize("name", CASES)
def test_backends_against_float64(backend, name):
    if backend not in usable_backends() and backend != "auto":
        pytest.skip(f"{backend} is not usable here")
    mask, allowed, space = attention_cases()[name]
    q, k, v = qkv(space)
    result = ak.attention(q, k, v, mask, backend=backend, return_lse=True)
    out, lse, _ = naive_attention(q, k, v, allowed)
    assert torch.allclose(result.out, out, atol=1e-10, rtol=0), name
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(result.lse), finite), name
    assert torch.allclose(result.lse[finite], lse[finite], atol=1e-10, rtol=0), name
    empty = ~allowed.expand(space.batch, 4, space.q_len, space.kv_len).any(-1)
    assert torch.equal(result.out[empty], torch.zeros_like(result.out[empty]))


@pytest.mark.parametrize("name", ["band12", "band30", "decode", "chunk", "docs_br", "docs_2d"])
def test_reference_gradients(name):
    mask, allowed, space = attention_cases()[name]
    q, k, v = (t.requires_grad_() for t in qkv(space))
    cot = torch.randn(space.batch, 4, space.q_len, 8, generator=torch.Generator().manual_seed(3),
                      dtype=torch.float64)
    got = torch.autograd.grad((ak.attention(q, k, v, mask, backend="reference") * cot).sum(), (q, k, v))
    want = torch.autograd.grad((naive_attention(q, k, v, allowed)[0] * cot).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-10, rtol=0), name


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["band6", "band13", "band21", "band47", "decode", "chunk", "docs_tl",
                                  "docs_2d"])
def test_tiled_small_blocks_forward_backward(fused, name):
    """8×4 tiles (EMPTY, FULL, PARTIAL and triangle ones), both tile primitives, with gradients."""
    mask, allowed, space = attention_cases()[name]
    q, k, v = qkv(space, torch.float32)
    result = _run(q, k, v, mask, 0.4, block_q=8, block_k=4,
                  options=tiled.TiledOptions(fused_tiles=fused))
    _assert_like_truth(result, q, k, v, allowed, None, 0.4, torch.float32)


def test_combined_with_other_masks():
    """A per-sequence band & documents, and | with a global band, on tiled against float64."""
    space = MaskSpace(2, 4, 12, 16)
    pad = ak.padding(q_lengths=[12, 7], kv_lengths=[16, 9], kv_starts=[0, 5])
    ids_q, ids_kv = torch.arange(12) // 6, torch.arange(16) // 8
    runs = ([(0, 12), (0, 7)], [(0, 16), (5, 14)])
    per_seq = band_loops(12, 16, *runs, None, 0, "bottom_right")
    q, k, v = qkv(space)
    for mask, allowed in [
        (ak.causal("bottom_right", sequences=pad) & ak.documents(ids_q, ids_kv),
         per_seq & dense_documents(ids_q, ids_kv)),
        (ak.causal("bottom_right", sequences=pad) | ak.sliding_window(1), per_seq | dense_band(12, 16, 1, 0)),
    ]:
        out = ak.attention(q, k, v, mask, backend="tiled")
        assert torch.allclose(out, naive_attention(q, k, v, allowed)[0], atol=1e-10, rtol=0), mask


# ---- validation, keys, pictures --------------------------------------------------------------------

def test_sequences_must_be_a_padding_mask():
    not_padding = (ak.causal(), ak.padding(kv_lengths=[2]) & ak.causal(), torch.ones(2, 3, dtype=torch.bool),
                   [3, 4])
    for bad in not_padding:
        with pytest.raises(TypeError, match=r"causal\(sequences=\.\.\.\) takes a padding mask"):
            ak.causal(sequences=bad)
        with pytest.raises(TypeError, match=r"sliding_window\(sequences=\.\.\.\) takes a padding mask"):
            ak.sliding_window(2, sequences=bad)
    with pytest.raises(TypeError, match="not a combination"):
        ak.causal(sequences=ak.padding(kv_lengths=[2]) & ak.causal())
    with pytest.raises(ValueError, match="align"):
        ak.causal("middle", sequences=ak.padding(kv_lengths=[2]))


def test_padding_problems_are_reported_through_the_band():
    mask = ak.causal("bottom_right", sequences=ak.padding(kv_lengths=[3, 9]))
    q = torch.zeros(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"kv_lengths=\[3, 9\] out of range"):
        ak.attention(q, torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8), mask)


def test_documents_causal_validation():
    with pytest.raises(ValueError, match="'top_left'.*'bottom_right'"):
        ak.documents([0, 0, 1], causal="yes")
    split = ak.documents([0, 0, 1, 1], [0, 1, 0, 1], causal="top_left")
    problems = " ".join(split.check(MaskSpace(1, 1, 4, 4)))
    assert "document 0 sits at positions [0, 2] of kv_ids" in problems and "pack each document" in problems
    rows = ak.documents(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]]), causal="bottom_right")
    assert "of q_ids row 1, not one contiguous run" in " ".join(rows.check(MaskSpace(2, 1, 4, 4)))
    with pytest.raises(ValueError, match="not one contiguous run"):
        ak.attention(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), split)
    assert "has shape (4,) but the sequence has 5" in " ".join(split.check(MaskSpace(1, 1, 5, 4)))


def test_cache_keys_and_digests():
    pad = ak.padding(kv_lengths=[3, 4])
    keys = set()
    for mask in (ak.causal(sequences=pad), ak.causal("bottom_right", sequences=pad),
                 ak.sliding_window(2, sequences=pad), ak.sliding_window(2, 1, sequences=pad),
                 ak.causal(sequences=ak.padding(kv_lengths=[3, 4], kv_starts=[1, 0]))):
        keep: list = []
        key = ak.masks.cache_key(mask, keep)
        assert key is not None and any(t is pad.kv_lengths for t in keep) == (mask.sequences is pad)
        keys.add(key)
    assert len(keys) == 5
    ids = torch.tensor([0, 0, 1, 1])
    tl, br = ak.documents(ids, causal="top_left"), ak.documents(ids, causal="bottom_right")
    assert ak.masks.cache_key(tl, []) != ak.masks.cache_key(br, [])
    assert ak.masks.cache_key(tl, []) != ak.masks.cache_key(ak.documents(ids), [])
    digest = ak.masks.digest
    assert digest(ak.causal(sequences=pad)) == digest(ak.causal(sequences=ak.padding(kv_lengths=[3, 4])))
    assert digest(ak.causal(sequences=pad)) != digest(ak.causal(sequences=ak.padding(kv_lengths=[3, 5])))
    assert digest(ak.causal(sequences=pad)) != digest(ak.causal("bottom_right", sequences=pad))
    before = digest(tl)
    tl.to_dense(MaskSpace(1, 1, 4, 4))  # derived runs are cached outside the mask
    assert digest(tl) == before == digest(ak.documents([0, 0, 1, 1], causal="top_left"))
    assert digest(tl) != digest(br)


def test_modified_ids_are_derived_again():
    ids = torch.tensor([0, 0, 1, 1])
    mask = ak.documents(ids, causal="top_left")
    space = MaskSpace(1, 1, 4, 4)
    assert mask.to_dense(space)[0, 0, 2].tolist() == [False, False, True, False]
    ids[1] = 1  # in place: the document runs change
    assert mask.to_dense(space)[0, 0, 2].tolist() == [False, True, True, False]


def test_docstring_pictures_of_the_new_forms():
    pad = ak.padding(q_lengths=[3, 2], kv_lengths=[5, 3], kv_starts=[0, 2])
    mask = ak.causal("bottom_right", sequences=pad)
    assert mask.draw(3, 5, batch=0) == "███░░\n████░\n█████"
    assert mask.draw(3, 5, batch=1) == "░░██░\n░░███\n░░░░░"
    q_ids, kv_ids = [0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]
    assert ak.documents(q_ids, kv_ids, causal="top_left").draw(5, 7) == (
        "█░░░░░░\n██░░░░░\n░░░█░░░\n░░░██░░\n░░░███░")
    assert ak.documents(q_ids, kv_ids, causal="bottom_right").draw(5, 7) == (
        "██░░░░░\n███░░░░\n░░░██░░\n░░░███░\n░░░████")
    assert repr(mask) == ("causal('bottom_right', sequences=padding(q_lengths=[3, 2], "
                          "kv_lengths=[5, 3], kv_starts=[0, 2]))")


# ---- triton (interpreter) ------------------------------------------------------------------------



@pytest.mark.parametrize("name", ["band30", "band21", "chunk", "docs_br"])
def test_triton_runs_them_as_row_ranges(name, monkeypatch):
    """The kernels take each query's key run and each key's query run (their document-range
    form): no dense [B, H, Tq, Tk] mask, forward and backward against float64."""
    launch = interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mask, allowed, space = attention_cases()[name]
    q, k, v = qkv(space, torch.float32)
    assert not dispatch.BACKENDS["triton"].not_supported_reasons(validate(q, k, v, mask))
    program = launch.compile_mask(mask, space)
    assert program.doc_ranges and program.allowed is None and program.features() == ["documents"]
    q_ranges, kv_ranges = program.q_docs, program.kv_docs
    positions_q, positions_k = torch.arange(space.q_len), torch.arange(space.kv_len)
    dense = allowed.expand(space.batch, 1, space.q_len, space.kv_len)[:, 0]
    assert torch.equal((positions_k >= q_ranges[..., :1]) & (positions_k < q_ranges[..., 1:]), dense)
    assert torch.equal((positions_q >= kv_ranges[..., :1]) & (positions_q < kv_ranges[..., 1:]),
                       dense.transpose(1, 2))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    result = ak.attention(q, k, v, mask, scale=0.4, backend="triton", return_lse=True)
    cot = torch.randn(result.out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (result.out * cot.to(result.out.dtype)).sum().backward()
    _assert_like_truth((result.out, result.lse, [t.grad for t in (q, k, v)]), q, k, v, allowed, None,
                       0.4, torch.float32)
