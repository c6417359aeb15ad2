"""Mask objects: dense forms against hand-written constructions, block maps, tiles, pictures."""

from __future__ import annotations

import inspect
import math
import random

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.masks import EMPTY, FULL, PARTIAL, MaskSpace

from conftest import (dense_band, dense_causal, dense_documents, dense_padding, sorted_ids)


def space(batch=1, heads=1, q_len=8, kv_len=8):
    return MaskSpace(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)


def full_shape(dense: torch.Tensor, sp: MaskSpace) -> torch.Tensor:
    """Broadcast a ``[Bm, Hm, Tq, Tk]`` answer to ``[B, H, Tq, Tk]`` for comparison."""
    assert dense.dim() == 4 and dense.shape[0] in (1, sp.batch) and dense.shape[1] in (1, sp.heads)
    return dense.expand(sp.batch, sp.heads, sp.q_len, sp.kv_len)


def assert_dense(mask, expected: torch.Tensor, sp: MaskSpace):
    got = mask.to_dense(sp)
    assert got.dtype == torch.bool
    assert torch.equal(full_shape(got, sp), expected.expand(sp.batch, sp.heads, sp.q_len, sp.kv_len))


# ---- to_dense against hand-written constructions -------------------------------------------------

@pytest.mark.parametrize("tq,tk", [(5, 5), (3, 7), (7, 3), (1, 4), (4, 1)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_dense(tq, tk, align):
    assert_dense(ak.causal(align), dense_causal(tq, tk, align), space(q_len=tq, kv_len=tk))


def test_causal_default_is_top_left_and_bottom_right_last_query_sees_all():
    sp = space(q_len=3, kv_len=5)
    assert torch.equal(ak.causal().to_dense(sp), ak.causal("top_left").to_dense(sp))
    assert ak.causal("bottom_right").to_dense(sp)[0, 0, -1].all()
    assert ak.causal("top_left").to_dense(sp)[0, 0, 0].tolist() == [True, False, False, False, False]


@pytest.mark.parametrize("tq,tk", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (0, 2), (5, 5)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_sliding_window_dense(tq, tk, left, right, align):
    mask = ak.sliding_window(left, right, align=align)
    assert_dense(mask, dense_band(tq, tk, left, right, align), space(q_len=tq, kv_len=tk))


@pytest.mark.parametrize("q_lengths,kv_lengths", [
    (None, [3, 0, 6]), ([2, 5, 0], None), ([0, 4, 5], [6, 1, 0]), ([5], [2]), (None, [4]),
])
def test_padding_dense(q_lengths, kv_lengths):
    batch = 3
    sp = space(batch=batch, heads=2, q_len=5, kv_len=6)
    expected = dense_padding(5, 6, q_lengths, kv_lengths, batch)
    assert_dense(ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths), expected, sp)


def dense_runs(tq, tk, q_runs, kv_runs, batch):
    """``[B, 1, tq, tk]`` by loops: real when inside the row's ``(start, stop)`` run (``None``: all)."""
    out = torch.zeros(batch, 1, tq, tk, dtype=torch.bool)
    for b in range(batch):
        q0, q1 = (0, tq) if q_runs is None else q_runs[b if len(q_runs) > 1 else 0]
        k0, k1 = (0, tk) if kv_runs is None else kv_runs[b if len(kv_runs) > 1 else 0]
        for i in range(tq):
            for j in range(tk):
                out[b, 0, i, j] = q0 <= i < q1 and k0 <= j < k1
    return out


@pytest.mark.parametrize("kwargs,q_runs,kv_runs", [
    (dict(kv_starts=[2, 0, 6]), None, [(2, 6), (0, 6), (6, 6)]),  # left padding, to the end
    (dict(q_starts=[1, 5, 0], q_lengths=[3, 0, 5]), [(1, 4), (5, 5), (0, 5)], None),
    (dict(q_starts=[1], kv_starts=[0, 3, 1], kv_lengths=[6, 2, 4]), [(1, 5)], [(0, 6), (3, 5), (1, 5)]),
    (dict(kv_lengths=[4, 2, 0], kv_starts=[0]), None, [(0, 4), (0, 2), (0, 0)]),  # zero starts
    (dict(q_starts=torch.tensor([4, 0, 2]), kv_starts=torch.tensor([1, 1, 1], dtype=torch.int32)),
     [(4, 5), (0, 5), (2, 5)], [(1, 6)] * 3),
])
def test_padding_starts_dense(kwargs, q_runs, kv_runs):
    sp = space(batch=3, heads=2, q_len=5, kv_len=6)
    assert_dense(ak.padding(**kwargs), dense_runs(5, 6, q_runs, kv_runs, 3), sp)


def test_padding_from_real_token_mask():
    rows = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0], [1] * 6]
    runs = [(2, 6), (0, 3), (0, 0), (1, 5), (0, 6)]
    sp = space(batch=5, q_len=4, kv_len=6)
    for real in (torch.tensor(rows), torch.tensor(rows, dtype=torch.bool), torch.tensor(rows, dtype=torch.int8)):
        mask = ak.padding(kv_mask=real, allow_empty_rows=True)
        assert mask.kv_starts.tolist() == [2, 0, 0, 1, 0] and mask.kv_lengths.tolist() == [4, 3, 0, 4, 6]
        assert_dense(mask, dense_runs(4, 6, None, runs, 5), sp)
    q_real = torch.tensor([[False, True, True, True], [True] * 4, [False] * 4, [True, True, False, False],
                           [False, False, False, True]])
    both = ak.padding(q_mask=q_real, kv_mask=torch.tensor(rows), allow_empty_rows=True)
    assert_dense(both, dense_runs(4, 6, [(1, 4), (0, 4), (0, 0), (0, 2), (3, 4)], runs, 5), sp)
    assert both.check(sp) == []
    assert "kv_mask has 6 columns" in " ".join(both.check(space(batch=5, q_len=4, kv_len=7)))


def test_padding_from_mask_rejects_non_contiguous_rows():
    with pytest.raises(ValueError, match=r"(?s)rows \[1\].*not one contiguous run.*ak\.dense"):
        ak.padding(kv_mask=torch.tensor([[1, 1, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match=r"q_mask.*ak\.dense\(mask\[:, None, :, None\]\)"):
        ak.padding(q_mask=torch.tensor([[True, False, True]]))
    with pytest.raises(ValueError, match="only 0"):
        ak.padding(kv_mask=torch.tensor([[0, 2, 1]]))
    with pytest.raises(TypeError, match="dtype torch.float32"):
        ak.padding(kv_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"shape \(3,\).*\[B, T\]"):
        ak.padding(kv_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="either kv_mask or kv_lengths"):
        ak.padding(kv_lengths=[3], kv_mask=torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("kwargs,words", [
    (dict(kv_starts=[1.0]), (TypeError, ["kv_starts", "float", "integer starts"])),
    (dict(kv_starts=[[1, 2]]), (ValueError, ["kv_starts", "(1, 2)", "kv_mask="])),
    (dict(q_starts=[-1, 0]), (ValueError, ["q_starts", "[-1, 0]", "0 or more"])),
    (dict(q_starts=[1, 2, 3], q_lengths=[1, 2]), (ValueError, ["q_starts has 3", "q_lengths has 2"])),
])
def test_padding_starts_constructor_errors(kwargs, words):
    exc, needed = words
    with pytest.raises(exc) as info:
        ak.padding(**kwargs)
    for word in needed:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("kwargs,words", [
    (dict(kv_starts=[7, 0]), ["kv_starts=[7, 0]", "[0, 6]"]),
    (dict(kv_starts=[2, 3], kv_lengths=[4, 4]), ["kv_starts + kv_lengths = [6, 7]", "6 key positions"]),
    (dict(q_starts=[1, 2, 3]), ["q_starts has 3 entries", "batch has 2"]),
    (dict(q_starts=[0, 1], q_lengths=[5, 5]), ["q_starts + q_lengths = [5, 6]", "5 query positions"]),
])
def test_padding_starts_check(kwargs, words):
    problems = " ".join(ak.padding(**kwargs).check(space(batch=2, q_len=5, kv_len=6)))
    for word in words:
        assert word in problems, (word, problems)
    assert ak.padding(q_starts=[5, 0], kv_starts=[1], kv_lengths=[5]).check(space(batch=2, q_len=5, kv_len=6)) == []


def test_padding_starts_repr_cache_key_and_digest():
    a = ak.padding(kv_lengths=[3, 4], kv_starts=[1, 0])
    assert repr(a) == "padding(kv_lengths=[3, 4], kv_starts=[1, 0])"
    keep: list = []
    key = ak.masks.cache_key(a, keep)
    assert any(t is a.kv_starts for t in keep)
    b = ak.padding(kv_lengths=a.kv_lengths, kv_starts=[0, 0])
    b.kv_lengths = a.kv_lengths
    assert ak.masks.cache_key(b, []) != key
    assert ak.masks.digest(a) != ak.masks.digest(b)
    assert ak.masks.digest(a) == ak.masks.digest(ak.padding(kv_lengths=[3, 4], kv_starts=[1, 0]))


def test_padding_accepts_tensor_lengths():
    sp = space(batch=2, q_len=4, kv_len=4)
    assert_dense(ak.padding(kv_lengths=torch.tensor([1, 3])), dense_padding(4, 4, None, [1, 3], 2), sp)


def test_documents_dense_1d_2d_and_cross():
    ids = [0, 0, 1, 1, 1, 2]
    assert_dense(ak.documents(ids), dense_documents(ids), space(q_len=6, kv_len=6))
    ids2 = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])
    assert_dense(ak.documents(ids2), dense_documents(ids2), space(batch=2, q_len=6, kv_len=6))
    q_ids, kv_ids = [0, 1, 1], [0, 0, 1, 1, 2]  # cross attention: different q and kv ids
    assert_dense(ak.documents(q_ids, kv_ids), dense_documents(q_ids, kv_ids), space(q_len=3, kv_len=5))
    # unsorted ids are allowed too (the mask is a plain equality test)
    ids3 = [2, 0, 2, 1, 0]
    assert_dense(ak.documents(ids3), dense_documents(ids3), space(q_len=5, kv_len=5))


def test_dense_and_raw_bool(gen):
    allowed = torch.rand(2, 1, 5, 7, generator=gen) < 0.5
    sp = space(batch=2, heads=3, q_len=5, kv_len=7)
    assert_dense(ak.dense(allowed), allowed, sp)
    assert_dense(ak.masks.as_mask(allowed), allowed, sp)
    assert_dense(ak.dense(allowed[0, 0]), allowed[0, 0], sp)  # [Tq, Tk] broadcasts


def test_bias_neginf_counts_as_masked(gen):
    values = torch.randn(5, 7, generator=gen)
    values[values > 0.8] = float("-inf")
    sp = space(q_len=5, kv_len=7)
    mask = ak.bias(values)
    assert mask.has_bias
    assert_dense(mask, ~torch.isneginf(values), sp)
    tile_bias = mask.dense_bias(sp)
    assert torch.isfinite(tile_bias).all()
    assert torch.equal(tile_bias[0, 0], torch.where(torch.isneginf(values), 0.0, values))
    assert ak.causal().dense_bias(sp) is None


def test_from_function_dense():
    def alternate_heads(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 1) | ((h == 1) & (kv_idx == 0)) | (b == 1)
    sp = space(batch=2, heads=2, q_len=4, kv_len=5)
    expected = torch.zeros(2, 2, 4, 5, dtype=torch.bool)
    for b in range(2):
        for h in range(2):
            for i in range(4):
                for j in range(5):
                    expected[b, h, i, j] = abs(i - j) <= 1 or (h == 1 and j == 0) or b == 1
    assert_dense(ak.from_function(alternate_heads), expected, sp)


def test_from_function_must_return_bool():
    with pytest.raises(TypeError, match="bool"):
        ak.from_function(lambda b, h, q, k: (q - k).float()).to_dense(space())
    with pytest.raises(TypeError, match="callable"):
        ak.from_function(3)


def test_combinators_dense():
    tq, tk = 6, 8
    sp = space(batch=2, q_len=tq, kv_len=tk)
    causal, window = dense_causal(tq, tk), dense_band(tq, tk, 2, 1)
    pad = dense_padding(tq, tk, None, [5, 2], 2)
    docs = dense_documents([0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    d = ak.documents([0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    cases = [
        (ak.causal() & ak.padding(kv_lengths=[5, 2]), causal & pad),
        (ak.causal() | ak.sliding_window(2, 1), causal | window),
        (~ak.causal(), ~causal),
        (~(ak.causal() & ak.padding(kv_lengths=[5, 2])), ~(causal & pad)),
        (d & ak.causal(), docs & causal),
        ((d | ak.sliding_window(2, 1)) & ~ak.padding(kv_lengths=[5, 2]), (docs | window) & ~pad),
        (~~ak.causal(), causal),
    ]
    for mask, expected in cases:
        assert_dense(mask, expected, sp)


def test_bias_combines_only_with_and(gen):
    values = torch.randn(4, 4, generator=gen)
    combined = ak.bias(values) & ak.causal()
    sp = space(q_len=4, kv_len=4)
    assert_dense(combined, dense_causal(4, 4), sp)
    assert torch.equal(combined.dense_bias(sp)[0, 0], values)
    both = ak.bias(values) & ak.bias(2 * values)
    assert torch.allclose(both.dense_bias(sp)[0, 0], 3 * values)
    with pytest.raises(TypeError, match=r"\|"):
        ak.bias(values) | ak.causal()
    with pytest.raises(TypeError, match=r"\|"):
        ak.causal() | ak.bias(values)
    with pytest.raises(TypeError, match="~"):
        ~ak.bias(values)
    with pytest.raises(TypeError, match="~"):
        ~(ak.bias(values) & ak.causal())


def test_combinators_accept_raw_tensors():
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[:, 0] = False
    sp = space(q_len=4, kv_len=4)
    assert_dense(ak.causal() & allowed, dense_causal(4, 4) & allowed, sp)


# ---- block maps -------------------------------------------------------------------------------

def _random_masks(rng: random.Random, gen: torch.Generator, batch: int, tq: int, tk: int):
    """(name, mask, exact) for every kind and some combinations; ``exact``: the block map
    must classify EMPTY/FULL exactly (structured masks, and the generic evaluator)."""
    ids = sorted_ids(tq, rng.randint(1, 5), gen)
    ids_2d = sorted_ids(tq, rng.randint(1, 5), gen, batch=batch)
    shared_tq_tk = tq == tk
    kv_ids = ids if shared_tq_tk else sorted_ids(tk, 3, gen)
    q_lengths = [rng.randint(0, tq) for _ in range(batch)]
    kv_lengths = [rng.randint(0, tk) for _ in range(batch)]
    left, right = rng.randint(0, 9), rng.randint(0, 6)
    bias_values = torch.randn(batch, 1, tq, tk, generator=gen)
    bias_values[torch.rand(batch, 1, tq, tk, generator=gen) < 0.3] = float("-inf")
    dense_allowed = torch.rand(1, 2, tq, tk, generator=gen) < 0.5
    fn = ak.from_function(lambda b, h, q, k: (q // 5) == (k // 7), name="blocks57")
    q_starts = [rng.randint(0, tq) for _ in range(batch)]  # with lengths that fit after them
    q_runs = [rng.randint(0, tq - s) for s in q_starts]
    kv_starts = [rng.randint(0, tk) for _ in range(batch)]
    kv_runs = [rng.randint(0, tk - s) for s in kv_starts]
    masks = [
        ("causal", ak.causal(), True),
        ("causal_br", ak.causal("bottom_right"), True),
        ("window", ak.sliding_window(left, right), True),
        ("window_br", ak.sliding_window(left, right, align="bottom_right"), True),
        ("padding", ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths), True),
        ("padding_kv", ak.padding(kv_lengths=kv_lengths), True),
        ("padding_starts", ak.padding(q_runs, kv_runs, q_starts, kv_starts), True),
        ("padding_left", ak.padding(q_starts=q_starts, kv_starts=kv_starts), True),
        ("~padding_starts", ~ak.padding(kv_lengths=kv_runs, kv_starts=kv_starts), True),
        ("causal_br&padding_left", ak.causal("bottom_right") & ak.padding(kv_starts=kv_starts), False),
        ("dense", ak.dense(dense_allowed), True),
        ("bias", ak.bias(bias_values), True),
        ("from_function", fn, True),
        ("~causal", ~ak.causal(), True),
        ("~padding", ~ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths), True),
        ("causal&padding", ak.causal() & ak.padding(kv_lengths=kv_lengths), False),
        ("window|causal_br", ak.sliding_window(left, right) | ak.causal("bottom_right"), False),
        ("bias&window", ak.bias(bias_values) & ak.sliding_window(left, right), False),
        ("~(causal|padding)", ~(ak.causal() | ak.padding(q_lengths=q_lengths)), False),
        ("dense&~window", ak.dense(dense_allowed) & ~ak.sliding_window(left, right), False),
    ]
    if shared_tq_tk:  # sorted ids shared by q and kv: the range test is exact
        masks += [("documents", ak.documents(ids), True),
                  ("documents_2d", ak.documents(ids_2d), True),
                  ("documents&causal", ak.documents(ids_2d) & ak.causal(), False)]
    masks += [("documents_cross", ak.documents(ids, kv_ids), shared_tq_tk),
              ("documents|window", ak.documents(ids, kv_ids) | ak.sliding_window(left), False)]
    # a band inside each document (sorted ids: each document one run on each side)
    cross = sorted_ids(tk, 3, gen)
    for align in ("top_left", "bottom_right"):
        masks += [(f"causal_documents_{align}", ak.documents(ids, cross, causal=align), True),
                  (f"window_documents_{align}", ak.sliding_window(
                      left, right, align, sequences=ak.documents(ids, cross)), True),
                  (f"left_window_documents_{align}", ak.sliding_window(
                      ak.masks.UNBOUNDED, right, align, sequences=ak.documents(ids, cross)), True)]
    return masks


def _check_block_map(name, mask, exact, sp, block_q, block_k, q_offset, q_count, kv_offset, kv_count):
    codes = mask.block_map(block_q, block_k, sp, q_offset=q_offset, q_count=q_count,
                           kv_offset=kv_offset, kv_count=kv_count)
    nq, nk = math.ceil(q_count / block_q), math.ceil(kv_count / block_k)
    where = f"{name} blocks {block_q}x{block_k} q[{q_offset}:+{q_count}] kv[{kv_offset}:+{kv_count}]"
    assert codes.dtype == torch.int8, where
    assert codes.dim() == 4 and codes.shape[2:] == (nq, nk), f"{where}: shape {tuple(codes.shape)}"
    assert codes.shape[0] in (1, sp.batch) and codes.shape[1] in (1, sp.heads), where
    assert set(codes.unique().tolist()) <= {EMPTY, PARTIAL, FULL}, where
    dense = full_shape(mask.to_dense(sp), sp)
    codes = codes.expand(sp.batch, sp.heads, nq, nk)
    for qb in range(nq):
        q0 = q_offset + qb * block_q
        q1 = min(q0 + block_q, q_offset + q_count)
        for kb in range(nk):
            k0 = kv_offset + kb * block_k
            k1 = min(k0 + block_k, kv_offset + kv_count)
            tile = dense[:, :, q0:q1, k0:k1].flatten(2)  # [B, H, tile elements]
            none_allowed, all_allowed = ~tile.any(-1), tile.all(-1)
            code = codes[:, :, qb, kb]
            at = f"{where} tile ({qb}, {kb})"
            assert not (none_allowed == False)[code == EMPTY].any(), f"{at}: EMPTY but has allowed keys"
            assert all_allowed[code == FULL].all(), f"{at}: FULL but has masked keys"
            if mask.has_bias:
                assert not (code == FULL).any(), f"{at}: FULL for a mask with a bias"
            if exact:
                assert torch.equal(code == EMPTY, none_allowed), f"{at}: EMPTY not exact"
                if not mask.has_bias:
                    assert torch.equal(code == FULL, all_allowed & ~none_allowed), f"{at}: FULL not exact"


@pytest.mark.parametrize("seed", range(6))
def test_block_map_whole_sequence(seed, gen):
    rng = random.Random(seed)
    gen.manual_seed(seed)
    tq, tk = (37, 53) if seed == 0 else (rng.randint(1, 40), rng.randint(1, 40))
    if seed == 1:
        tk = tq  # a self-attention shape, so the document masks get their exact checks
    block_q, block_k = (8, 16) if seed == 0 else (rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([1, 3, 5, 8, 16]))
    batch = 2
    sp = space(batch=batch, heads=2, q_len=tq, kv_len=tk)
    for name, mask, exact in _random_masks(rng, gen, batch, tq, tk):
        _check_block_map(name, mask, exact, sp, block_q, block_k, 0, tq, 0, tk)
        # defaults of q_count / kv_count cover the rest of the sequence
        assert torch.equal(mask.block_map(block_q, block_k, sp),
                           mask.block_map(block_q, block_k, sp, q_offset=0, q_count=tq,
                                          kv_offset=0, kv_count=tk)), name


@pytest.mark.parametrize("seed", range(6))
def test_block_map_shard_offsets(seed, gen):
    """A shard of a longer sequence: global positions, ragged last blocks."""
    rng = random.Random(100 + seed)
    gen.manual_seed(100 + seed)
    t = rng.randint(20, 48)
    tq, tk = (t, t) if seed % 2 == 0 else (t, rng.randint(10, 48))
    batch = 2
    sp = space(batch=batch, heads=2, q_len=tq, kv_len=tk)
    for name, mask, exact in _random_masks(rng, gen, batch, tq, tk):
        block_q, block_k = rng.choice([2, 3, 4, 8]), rng.choice([2, 5, 8, 16])
        q_offset = rng.randint(0, tq - 1)
        q_count = rng.randint(1, tq - q_offset)
        kv_offset = rng.randint(0, tk - 1)
        kv_count = rng.randint(1, tk - kv_offset)
        _check_block_map(name, mask, exact, sp, block_q, block_k, q_offset, q_count, kv_offset, kv_count)
        # without counts, a shard runs to the end of the sequence
        codes = mask.block_map(block_q, block_k, sp, q_offset=q_offset, kv_offset=kv_offset)
        assert codes.shape[2:] == (math.ceil((tq - q_offset) / block_q), math.ceil((tk - kv_offset) / block_k))


def test_block_map_causal_picture():
    """Causal 8×8 with 4×4 blocks: the diagonal tiles are PARTIAL, below FULL, above EMPTY."""
    codes = ak.causal().block_map(4, 4, space(q_len=8, kv_len=8))
    assert codes[0, 0].tolist() == [[PARTIAL, EMPTY], [FULL, PARTIAL]]
    codes = ak.causal().block_map(2, 4, space(q_len=8, kv_len=8), q_offset=4, q_count=4)
    assert codes[0, 0].tolist() == [[FULL, PARTIAL], [FULL, PARTIAL]]


# ---- tiles at offsets -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_tile_equals_slice_of_dense(seed, gen):
    rng = random.Random(200 + seed)
    gen.manual_seed(200 + seed)
    tq, tk = 21, 21 if seed == 0 else 30
    batch = 2
    sp = space(batch=batch, heads=2, q_len=tq, kv_len=tk)
    for name, mask, _ in _random_masks(rng, gen, batch, tq, tk):
        dense = full_shape(mask.to_dense(sp), sp)
        dense_bias = mask.dense_bias(sp)
        for _ in range(3):
            q0, k0 = rng.randint(0, tq - 1), rng.randint(0, tk - 1)
            q1, k1 = rng.randint(q0 + 1, tq), rng.randint(k0 + 1, tk)
            q_idx, kv_idx = torch.arange(q0, q1), torch.arange(k0, k1)
            tile = mask.tile(q_idx, kv_idx, sp)
            assert torch.equal(full_shape_tile(tile, sp, q1 - q0, k1 - k0), dense[:, :, q0:q1, k0:k1]), name
            tile_bias = mask.tile_bias(q_idx, kv_idx, sp)
            assert (tile_bias is None) == (dense_bias is None), name
            if tile_bias is not None:
                expected = dense_bias.expand(batch, 2, tq, tk)[:, :, q0:q1, k0:k1]
                assert torch.equal(tile_bias.expand(batch, 2, q1 - q0, k1 - k0), expected), name


def full_shape_tile(tile, sp, tq, tk):
    assert tile.shape[0] in (1, sp.batch) and tile.shape[1] in (1, sp.heads)
    return tile.expand(sp.batch, sp.heads, tq, tk)


def test_tile_with_non_contiguous_positions():
    """Tiles are evaluated at any global positions, not only ranges."""
    sp = space(q_len=10, kv_len=10)
    q_idx, kv_idx = torch.tensor([9, 2, 5]), torch.tensor([0, 7, 5, 9])
    expected = dense_causal(10, 10)[q_idx][:, kv_idx]
    assert torch.equal(ak.causal().tile(q_idx, kv_idx, sp)[0, 0], expected)


# ---- pictures ---------------------------------------------------------------------------------

def test_draw_causal_4x4():
    assert ak.causal().draw(4, 4) == "█░░░\n██░░\n███░\n████"
    assert str(ak.causal()) == ak.causal().draw(8, 8)


def _docstring_pictures(fn):
    """Every block of █/░ lines in a docstring, as lists of rows (side-by-side pictures split)."""
    pictures, current = [], []
    for line in inspect.getdoc(fn).splitlines() + [""]:
        cells = line.strip()
        if cells and set(cells) <= set("█░ "):
            current.append(cells.split())
        elif current:
            columns = len(current[0])
            pictures += [[row[c] for row in current] for c in range(columns)]
            current = []
    return pictures


_PER_SEQUENCE = ak.causal("bottom_right", sequences=ak.padding(q_lengths=[3, 2], kv_lengths=[5, 3],
                                                               kv_starts=[0, 2]))


@pytest.mark.parametrize("fn,masks", [
    (ak.masks, [ak.causal()]),
    (ak.causal, [ak.causal("top_left"), ak.causal("bottom_right"), (_PER_SEQUENCE, 0), (_PER_SEQUENCE, 1)]),
    (ak.sliding_window, [ak.sliding_window(2)]),
    (ak.padding, [ak.padding(kv_lengths=[3])]),
    (ak.documents, [ak.documents([0, 0, 1, 1, 1]),
                    ak.documents([0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], causal="top_left"),
                    ak.documents([0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], causal="bottom_right")]),
])
def test_docstring_pictures_match_draw(fn, masks):
    """Each picture equals ``draw`` of its mask (``(mask, b)``: batch element ``b``)."""
    pictures = _docstring_pictures(fn)
    assert len(pictures) == len(masks), f"{fn.__name__}: found {len(pictures)} pictures"
    for picture, mask in zip(pictures, masks):
        mask, batch = mask if isinstance(mask, tuple) else (mask, 0)
        q_len, kv_len = len(picture), len(picture[0])
        assert mask.draw(q_len, kv_len, batch=batch) == "\n".join(picture), f"{fn.__name__}: {mask!r}"


def test_draw_per_batch_and_head():
    mask = ak.padding(kv_lengths=[1, 3])
    assert mask.draw(2, 4, batch=1) == "███░\n███░"
    assert mask.draw(2, 4, batch=0) == "█░░░\n█░░░"
    with pytest.raises(ValueError, match="holds 2 along batch"):  # past the mask's batch
        mask.draw(2, 4, batch=5)
    for bad in (dict(q_len=-1), dict(kv_len=-2), dict(head=-1), dict(q_len=2.5)):
        with pytest.raises(ValueError, match="pass an int ≥ 0"):
            ak.causal().draw(**bad)


@pytest.mark.parametrize("mask, size", [
    (ak.documents([0, 0, 1]), "3 × 3"),
    (ak.documents([0, 0, 1, 1, 1], causal="top_left"), "5 × 5"),
    (ak.dense(torch.ones(4, 4, dtype=torch.bool).tril()), "4 × 4"),
    (ak.padding(kv_mask=torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)), "any × 5"),
])
def test_draw_at_a_size_the_tensors_do_not_fit_is_refused(mask, size):
    """A picture at a size the mask's tensors do not fix would show a mask no call can use."""
    with pytest.raises(ValueError, match=f"fix its size at {size}"):
        mask.draw(7, 7)
    q_len, kv_len = mask._size()
    mask.draw(q_len or 3, kv_len or 3)  # its own size draws


# ---- constructor errors -------------------------------------------------------------------------

def test_constructor_errors():
    with pytest.raises(ValueError, match="align"):
        ak.causal("middle")
    with pytest.raises(ValueError, match="negative"):
        ak.sliding_window(-1)
    with pytest.raises(TypeError, match="int"):
        ak.sliding_window(2.5)
    for integer in (np.int64(2), torch.tensor(2)):  # integers as numpy and torch hand them over
        assert ak.sliding_window(integer).draw(4) == ak.sliding_window(2).draw(4)
    with pytest.raises(ValueError, match="q_lengths or kv_lengths"):
        ak.padding()
    with pytest.raises(ValueError, match="kv_lengths=\\[-1\\] out of range"):
        ak.padding(kv_lengths=[-1])
    with pytest.raises(TypeError, match="integer"):
        ak.padding(kv_lengths=[1.5, 2.0])
    with pytest.raises(TypeError, match="bool"):
        ak.dense(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="float"):
        ak.bias(torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="integer"):
        ak.documents(torch.zeros(4))


@pytest.mark.parametrize("seed", range(4))
def test_padding_starts_block_map_equals_reduced_tiles(seed):
    """The O(blocks) map of padding with starts equals ``_reduce_blocks`` over its own tile()."""
    from attnkit.masks import _reduce_blocks
    rng = random.Random(300 + seed)
    batch, tq, tk = 3, rng.randint(1, 30), rng.randint(1, 30)
    sp = space(batch=batch, q_len=tq, kv_len=tk)
    q_starts = [rng.randint(0, tq) for _ in range(batch)]
    kv_starts = [rng.randint(0, tk) for _ in range(batch)]
    mask = ak.padding([rng.randint(0, tq - s) for s in q_starts], [rng.randint(0, tk - s) for s in kv_starts],
                      q_starts, kv_starts)
    for block_q, block_k in ((1, 1), (4, 3), (8, 16)):
        q_offset, kv_offset = rng.randint(0, tq - 1), rng.randint(0, tk - 1)
        got = mask.block_map(block_q, block_k, sp, q_offset=q_offset, kv_offset=kv_offset)
        tiles = mask.tile(torch.arange(q_offset, tq), torch.arange(kv_offset, tk), sp)
        assert torch.equal(got, _reduce_blocks(tiles, block_q, block_k, False)), (mask, block_q, block_k)


# ---- structure(): the form kernels evaluate from indices ------------------------------------------

def _from_structure(form, space: MaskSpace) -> torch.Tensor:
    """The bool ``[B, Tq, Tk]`` a :class:`~attnkit.masks.Structure` describes."""
    q = torch.arange(space.q_len)[:, None]
    k = torch.arange(space.kv_len)[None, :]
    if form.diagonals is not None:
        lo, hi = form.diagonals
        ok = torch.ones(space.q_len, space.kv_len, dtype=torch.bool)
        ok = ok & (k - q >= lo) if lo is not None else ok
        ok = ok & (k - q <= hi) if hi is not None else ok
        return ok.expand(space.batch, -1, -1)
    if form.lengths is not None:
        q_len, kv_len = (torch.as_tensor(x if x is not None else [t]).reshape(-1).expand(space.batch)
                         for x, t in zip(form.lengths, (space.q_len, space.kv_len)))
        return (q[None] < q_len[:, None, None]) & (k[None] < kv_len[:, None, None])
    if form.ranges is not None:
        q_ranges, kv_ranges = form.ranges  # each query's key run, each key's query run
        by_query = (k[None] >= q_ranges[..., :1]) & (k[None] < q_ranges[..., 1:])
        by_key = (q[None] >= kv_ranges[..., 0][:, None, :]) & (q[None] < kv_ranges[..., 1][:, None, :])
        assert torch.equal(by_query, by_key), "the two sides' ranges must describe one mask"
        return by_query
    q_ids, kv_ids = (ids.reshape(-1, ids.shape[-1]).expand(space.batch, -1) for ids in form.ids)
    return q_ids[:, :, None] == kv_ids[:, None, :]


def _structured(name: str) -> ak.masks.Mask:
    ids_q, ids_k = torch.arange(12) // 5, torch.arange(14) // 5
    return {"causal": ak.causal(), "bottom_right": ak.causal("bottom_right"),
            "window": ak.sliding_window(3, 2), "lengths": ak.padding(q_lengths=[12, 7], kv_lengths=[9, 14]),
            "starts": ak.padding(kv_starts=[2, 0], kv_lengths=[9, 10], q_starts=[1, 3]),
            "documents": ak.documents(ids_q, ids_k),
            "split_documents": ak.documents(torch.tensor([0, 1] * 6), torch.tensor([1, 0] * 7)),
            "causal_documents": ak.documents(ids_q, ids_k, causal="bottom_right"),
            "sequence_causal": ak.causal(sequences=ak.padding(kv_starts=[2, 0], kv_lengths=[9, 10],
                                                              q_lengths=[12, 7])),
            "bias&causal": ak.bias(torch.randn(2, 1, 12, 14)) & ak.causal(),
            "dense&documents": ak.dense(torch.rand(12, 14) < 0.6) & ak.documents(ids_q, ids_k)}[name]


@pytest.mark.parametrize("name", ["causal", "bottom_right", "window", "lengths", "starts", "documents",
                                  "split_documents", "causal_documents", "sequence_causal"])
def test_structure_describes_the_element_mask(name):
    """Each structured leaf's ``structure(space)`` describes exactly the mask ``tile`` gives
    (the triton kernels evaluate the structure instead of the mask)."""
    space = MaskSpace(2, 1, 12, 14)
    mask = _structured(name)
    (leaf,) = mask.leaves()
    form = leaf.structure(space)
    assert sum(field is not None for field in form) == 1
    assert (form.ids is not None) == (name == "split_documents")  # not one run per id: ids
    assert torch.equal(_from_structure(form, space), mask.to_dense(space)[:, 0].expand(2, -1, -1))


@pytest.mark.parametrize("name", ["causal", "bottom_right", "window", "lengths", "starts", "documents",
                                  "split_documents", "causal_documents", "sequence_causal",
                                  "bias&causal", "dense&documents"])
def test_a_window_of_a_mask_is_that_rectangle_of_it(name):
    """A ring step's :func:`~attnkit.distributed.window.window`: every rectangle's element mask,
    bias, block map and each leaf's structure are the whole mask's, at local positions."""
    from attnkit.distributed.window import window

    torch.manual_seed(0)
    whole = MaskSpace(2, 1, 12, 14)
    mask = inputs_mask(_structured(name), whole)
    dense, bias = mask.to_dense(whole).expand(2, 1, 12, 14), mask.dense_bias(whole)
    for q_off, q_count, kv_off, kv_count in ((0, 12, 0, 14), (3, 5, 6, 8), (7, 5, 0, 4), (0, 3, 11, 3)):
        local_mask, local = window(mask, whole, q_off, q_count, kv_off, kv_count)
        rect = (..., slice(q_off, q_off + q_count), slice(kv_off, kv_off + kv_count))
        assert (local.q_len, local.kv_len) == (q_count, kv_count)
        assert torch.equal(local_mask.to_dense(local).expand(2, 1, q_count, kv_count), dense[rect])
        if bias is not None:
            assert torch.equal(local_mask.dense_bias(local).expand(2, 1, q_count, kv_count),
                               bias.expand(2, 1, 12, 14)[rect])
        for block_q, block_k in ((1, 1), (2, 3), (4, 4)):
            assert torch.equal(local_mask.block_map(block_q, block_k, local),
                               mask.block_map(block_q, block_k, whole, q_offset=q_off, q_count=q_count,
                                              kv_offset=kv_off, kv_count=kv_count))
        for leaf, local_leaf in zip(mask.leaves(), local_mask.leaves()):
            form = local_leaf.structure(local)
            if form is None:
                continue
            part = leaf.to_dense(whole).expand(2, 1, 12, 14)[rect][:, 0]
            if form.bias is not None:
                assert torch.equal(form.bias.expand(2, 1, q_count, kv_count),
                                   leaf.values.expand(2, 1, 12, 14)[rect])
            else:
                assert torch.equal(_from_structure(form, local), part), (leaf, q_off, kv_off)


def inputs_mask(mask, space):
    """``mask`` fitted to ``space`` as validation fits it (tensors laid over the scores)."""
    from attnkit.inputs import validate
    q = torch.zeros(space.batch, space.heads, space.q_len, 4)
    k = torch.zeros(space.batch, space.heads, space.kv_len, 4)
    return validate(q, k, k, mask).mask


def test_leaves_flatten_and_chains_and_others_have_no_structure():
    a, b, c = ak.causal(), ak.padding(kv_lengths=[3]), ak.sliding_window(2)
    assert all(x is y for x, y in zip((a & (b & c)).leaves(), (a, b, c)))
    assert len(((a & b) & c).leaves()) == 3
    either = a | b
    assert either.leaves() == [either] and either.structure(MaskSpace(1, 1, 4, 4)) is None
    assert ak.dense(torch.ones(4, 4, dtype=torch.bool)).structure(MaskSpace(1, 1, 4, 4)) is None
    values = torch.zeros(4, 4)
    assert ak.bias(values).structure(MaskSpace(1, 1, 4, 4)).bias is values


# ---- simplified(): the simplest equivalent mask --------------------------------------------------

@pytest.mark.parametrize("mask, tq, tk, expected", [
    (ak.causal("bottom_right"), 1, 9, "none"),  # a decode step sees every cached key
    (ak.causal("bottom_right"), 6, 6, "causal"),
    (ak.causal(), 1, 9, "self"),  # top-left: the one query sees key 0 only
    (ak.sliding_window(20), 8, 8, "causal"),  # wider than the sequence
    (ak.sliding_window(20, 30), 8, 8, "none"),
    (ak.sliding_window(3), 8, 8, "self"),
    (ak.causal("bottom_right") & ak.padding(kv_lengths=[5]), 1, 9, "padding"),
    (ak.causal("bottom_right") & ak.sliding_window(20, 20), 1, 9, "none"),
])
def test_simplified_is_the_same_mask(mask, tq, tk, expected):
    """``simplified`` allows exactly what the mask does, in the simplest form: nothing
    (``None``), top-left causal, or the mask itself."""
    space = MaskSpace(1, 1, tq, tk)
    simple = mask.simplified(space)
    if expected == "none":
        assert simple is None and bool(mask.to_dense(space).all())
        return
    assert torch.equal(simple.to_dense(space), mask.to_dense(space))
    if expected == "self":
        assert simple is mask
    elif expected == "causal":
        assert simple.band() == ak.masks.CAUSAL
    else:
        assert [type(leaf) for leaf in simple.leaves()] == [type(ak.padding(kv_lengths=[1]))]


def test_decode_step_under_bottom_right_causal_runs_unmasked(gen):
    """One query against a cache under bottom-right causal has no mask left: ``auto`` takes the
    fused kernel of an unmasked call, with the same result."""
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 4, 33, 16, generator=gen) for _ in range(2))
    mask = ak.causal("bottom_right")
    assert ak.explain_dispatch(q, k, v, mask).backend == ak.explain_dispatch(q, k, v).backend == "torch"
    torch.testing.assert_close(ak.attention(q, k, v, mask), ak.attention(q, k, v, backend="reference"))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("left, right", [(2, 0), (0, 1), (3, 2), (None, 1), (1, None)])
def test_a_band_per_document_is_the_band_on_each_documents_own_positions(align, left, right):
    """``sliding_window(left, right, align, sequences=documents(q_ids, kv_ids))``: inside each
    document, the band on that document's own query and key segments (written out here
    segment by segment); nothing across documents."""
    q_ids = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    kv_ids = torch.tensor([0, 0, 0, 0, 0, 2, 2, 3, 3])  # document 1 has no keys, 3 no queries
    unbounded = ak.masks.UNBOUNDED
    mask = ak.sliding_window(unbounded if left is None else left,
                             unbounded if right is None else right, align,
                             sequences=ak.documents(q_ids, kv_ids))
    want = torch.zeros(len(q_ids), len(kv_ids), dtype=torch.bool)
    for doc in range(4):
        qs, ks = (q_ids == doc).nonzero().flatten(), (kv_ids == doc).nonzero().flatten()
        if len(qs) and len(ks):
            want[qs[0]:qs[-1] + 1, ks[0]:ks[-1] + 1] = dense_band(len(qs), len(ks), left, right,
                                                                  align)
    got = mask.to_dense(space(batch=1, heads=1, q_len=len(q_ids), kv_len=len(kv_ids)))[0, 0]
    assert torch.equal(got, want), f"{mask!r}\n{got.int()}\n{want.int()}"
    if left is None and right == 0:
        assert repr(mask).startswith("documents(")


def test_an_and_of_bands_of_one_alignment_is_their_intersection():
    from attnkit.masks import Band
    assert (ak.causal() & ak.sliding_window(3, 2)).band() == Band(3, 0, "top_left")
    assert (ak.sliding_window(4, 1, "bottom_right")
            & ak.sliding_window(2, 5, "bottom_right")).band() == Band(2, 1, "bottom_right")
    assert (ak.causal() & ak.causal("bottom_right")).band() is None
    assert (ak.causal() & ak.padding(kv_lengths=[3])).band() is None
