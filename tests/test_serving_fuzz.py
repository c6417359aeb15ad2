"""Differential fuzz of the serving paths against ``ak.attention(..., backend="reference")``
run per sequence in float64: ``paged_attention`` (decoding by runs, the gathered call, packed
queries are covered by ``test_paged.py``), ``PagedKVCache`` over pools someone else filled,
and ``varlen_attention``.

Each case is drawn from a seeded ``random.Random`` (tensors from a seeded
``torch.Generator``) and prints as a dict when it fails. The inputs are what serving code
passes: pools and queries as transposed views, slices of a larger buffer, halves of a fused
K|V or QKV projection, stride-0 expansions and negative views (``torch._neg_view``); block
tables as lists, int32/int64 tensors, strided and transposed views, their unused trailing
entries naming a garbage page, block 0, −1 or a block outside the pool; pool slots no
sequence owns hold NaN and ±inf (as do a varlen call's keys past ``seqused_k``), which must
reach no result. Lengths include 0, 1 and multiples of the block size ±1; a third of the
paged cases are decoding steps over hundreds of keys (the runs path).

Tolerances are those of ``test_paged.py`` and ``test_varlen.py``: float64 within 1e-12 of
the reference, gradients (float64) within ``assert_close``'s defaults, and other dtypes by
the 2× rule (``conftest.assert_within_2x``) against plain math in the dtype on the
sequence's contiguous keys, or, with a score modifier (which plain math lacks), against
``ak.attention(..., backend="tiled")`` on those keys in the dtype. A ``ValueError`` is a
refusal: its message is checked against the ones the docstrings state.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (assert_within_2x, dense_band, import_triton_interpreted,
                      interpreted_triton_launch, plain_attention)

import_triton_interpreted()  # before attnkit: the triton cases run interpreted on CPU

import attnkit as ak  # noqa: E402
from attnkit.nn import PagedKVCache  # noqa: E402
from attnkit.paged import paged_attention  # noqa: E402

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NAN, INF = float("nan"), float("inf")
BANDS = ("none", "causal_br", "causal_tl", "window_br", "window_tl", "window_both")
REFUSALS = (  # what the docstrings say a call refuses, and a backend's "cannot run"
    "cannot run these inputs", "with one query per sequence",
    "does not take alibi(align='bottom_right') with")


# ---- layouts ---------------------------------------------------------------------------------
def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (any rank ≥ 3) with the same values in another memory layout."""
    if layout == "heads_major":  # e.g. a pool stored [num_blocks, Hkv, block_size, D]
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "dim_major":  # the last dim not contiguous
        return t.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "slot_major":  # e.g. a pool stored [block_size, num_blocks, Hkv, D]
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "slice":  # inside a larger NaN buffer
        big = torch.full((t.shape[0] + 2, *t.shape[1:-1], t.shape[-1] + 3), NAN, dtype=t.dtype)
        big[1:-1, ..., 1:-2] = t
        return big[1:-1, ..., 1:-2]
    if layout == "neg":
        return torch._neg_view(-t)
    assert layout == "contiguous", layout
    return t


def _mask(kind: str, heads: int, dtype: torch.dtype, window: int, gen: torch.Generator):
    slopes = (torch.rand(heads, generator=gen, dtype=F64) * 0.5 + 0.05).to(dtype)
    sinks = torch.randn(heads, generator=gen, dtype=F64).to(dtype)
    return {"none": None, "causal_br": ak.causal("bottom_right"), "causal_tl": ak.causal(),
            "window_br": ak.sliding_window(window, align="bottom_right"),
            "window_tl": ak.sliding_window(window), "window_both": ak.sliding_window(window, 2),
            "softcap": ak.causal("bottom_right") & ak.softcap(window / 2 + 0.5),
            "sinks": ak.sinks(sinks), "alibi": ak.alibi(slopes),
            "alibi_br": ak.alibi(slopes, align="bottom_right"),
            "mixed": ak.sliding_window(window, align="bottom_right") & ak.softcap(2.0)
            & ak.sinks(sinks)}[kind]


def _check(problems: list, where: str, got: torch.Tensor, q, k, v, mask, kind: str,
           lse: torch.Tensor = None) -> None:
    """``got [1, Hq, tq, Dv]`` (and ``lse [1, Hq, tq]``) of one sequence, its queries
    ``q`` in the call's dtype and keys ``k``, ``v`` ``[1, Hkv, tk, D]`` in float64, against
    the reference; problems appended to ``problems``."""
    dtype = got.dtype
    want = ak.attention(q.detach().double(), k, v, mask, backend="reference", return_lse=True)
    try:
        if dtype == F64:
            torch.testing.assert_close(got.detach(), want.out, rtol=1e-12, atol=1e-12)
            if lse is not None:
                torch.testing.assert_close(lse.detach().double(), want.lse, rtol=1e-12,
                                           atol=1e-12)
            return
        low = (q.detach(), k.to(dtype), v.to(dtype))
        if kind in BANDS:
            band = None if mask is None else mask.band()
            allowed = None if band is None else dense_band(q.shape[2], k.shape[2], band.left,
                                                           band.right, band.align)
            plain = plain_attention(*low, allowed)[0]
        else:
            plain = ak.attention(*(t.contiguous() for t in low), mask, backend="tiled")
        assert_within_2x("out", got, want.out, plain, dtype)
    except AssertionError as error:
        problems.append(f"{where}: {str(error)[:300]}")


def _refusal(error: ValueError) -> str:
    assert any(words in str(error) for words in REFUSALS), f"unexpected refusal: {error}"
    return "refused"


def _check_grads(problems: list, names: tuple, got: tuple, want: tuple, leaves: tuple) -> None:
    """Each gradient of ``got`` against ``want`` (``None``: zeros like its leaf); problems
    appended to ``problems``."""
    for name, g, w, leaf in zip(names, got, want, leaves):
        try:
            torch.testing.assert_close(torch.zeros_like(leaf) if g is None else g,
                                       torch.zeros_like(leaf) if w is None else w)
        except AssertionError as error:
            problems.append(f"{name}: {str(error)[:300]}")


def _failures(make, run, seeds) -> dict:
    """``{seed: (case, problems)}`` of the cases ``make(seed)`` that ``run`` finds wrong."""
    cases = {seed: make(seed) for seed in seeds}
    return {seed: (case, problems) for seed, case in cases.items() if (problems := run(case))}


# ---- paged_attention ----------------------------------------------------------------------------
POOL_LAYOUTS = ("contiguous", "heads_major", "dim_major", "slot_major", "slice", "neg",
                "fused_kv", "expanded")
Q_LAYOUTS = ("contiguous", "bthd", "fused_qkv", "dim_major", "slice", "neg", "expanded")
PAGED_MASKS = BANDS[:5] + ("softcap", "sinks", "alibi", "alibi_br", "mixed")


def paged_case(seed: int, triton: bool = False) -> dict:
    rnd = random.Random(seed)
    block = rnd.choice([2, 4, 16] if triton else [1, 2, 3, 4, 16])
    decoding = not triton and rnd.random() < 0.35  # one query over many keys: by runs
    edges = [0, 1, block - 1, block, block + 1, 2 * block, 3 * block - 1, rnd.randint(0, 40)]
    batch = rnd.randint(1, 4)
    lengths = [rnd.choice(edges + ([rnd.randint(200, 600)] * 3 if decoding else []))
               for _ in range(batch)]
    heads_kv = rnd.choice([1, 2])
    dk = rnd.choice([4, 8, 16])
    return dict(
        seed=seed, block=block, lengths=lengths, heads_kv=heads_kv,
        heads=heads_kv * rnd.choice([1, 2, 3]), dk=dk, dv=rnd.choice([dk, 6]),
        tq=1 if decoding else rnd.choice([1, 1, 2, 3]),
        dtype=rnd.choice([F32, F16, BF16] if triton else [F64, F64, F32, F16, BF16]),
        backend="triton" if triton else ("auto" if decoding else rnd.choice(
            ["auto", "tiled", "torch", "reference"])),
        mask=rnd.choice(BANDS[:2] + ("window_br",) if decoding else PAGED_MASKS),
        window=rnd.choice([0, 1, 3, 20]), pools=rnd.choice(POOL_LAYOUTS),
        q=rnd.choice(Q_LAYOUTS), table=rnd.choice(["list", "int64", "int32", "strided",
                                                    "transposed"]),
        tail=rnd.choice(["outside", "garbage", "minus_one", "zero"]),
        seqlens=rnd.choice(["list", "int64", "int32", "strided"]), lse=rnd.random() < 0.6,
        grad=rnd.random() < 0.5, spare=rnd.randint(1, 4), extra=rnd.randint(0, 3),
        shuffle=rnd.random() < 0.8)


def paged_inputs(case: dict):
    """``(q, key_pool, value_pool, block_table, seqlens, rows, mask)``: ``rows`` the tables
    as lists (live blocks first)."""
    gen = torch.Generator().manual_seed(case["seed"])
    block, lengths, dtype = case["block"], case["lengths"], case["dtype"]
    needed = [-(-n // block) for n in lengths]
    num_blocks = sum(needed) + case["spare"]
    order = (torch.randperm(num_blocks, generator=gen).tolist() if case["shuffle"]
             else list(range(num_blocks)))
    garbage_page = order[sum(needed)]
    stored_heads = 1 if case["pools"] == "expanded" else case["heads_kv"]
    poison = torch.tensor([NAN, INF, -INF], dtype=F64)
    pools = [poison[torch.randint(0, 3, (num_blocks, block, stored_heads, d), generator=gen)]
             for d in (case["dk"], case["dv"])]
    width = max(max(needed, default=0) + case["extra"], 1)
    tail = {"outside": num_blocks + 7, "garbage": garbage_page, "minus_one": -1,
            "zero": 0}[case["tail"]]
    rows = []
    for n, count in zip(lengths, needed):
        blocks, order = order[:count], order[count:]
        for pool in pools:
            for p in range(n):
                pool[blocks[p // block], p % block] = torch.randn(
                    stored_heads, pool.shape[-1], generator=gen, dtype=F64)
        rows.append(blocks + [tail] * (width - count))
    key_pool, value_pool = (pool.to(dtype) for pool in pools)
    if case["pools"] == "expanded":  # stride-0 heads
        key_pool, value_pool = (pool.expand(-1, -1, case["heads_kv"], -1)
                                for pool in (key_pool, value_pool))
    elif case["pools"] == "fused_kv":  # halves of one [num_blocks, block, Hkv, Dk + Dv] buffer
        fused = torch.cat([key_pool, value_pool], -1)
        key_pool, value_pool = fused[..., :case["dk"]], fused[..., case["dk"]:]
    else:
        key_pool, value_pool = (laid_out(p, case["pools"]) for p in (key_pool, value_pool))
    table = {"list": lambda t: t.tolist(), "int64": lambda t: t,
             "int32": lambda t: t.int(), "transposed": lambda t: t.t().contiguous().t(),
             "strided": lambda t: torch.stack([t, torch.full_like(t, 9999)], -1)[..., 0],
             }[case["table"]](torch.tensor(rows))
    seqlens = {"list": lambda t: t.tolist(), "int64": lambda t: t, "int32": lambda t: t.int(),
               "strided": lambda t: torch.stack([t, -t - 1], -1)[:, 0],
               }[case["seqlens"]](torch.tensor(lengths))
    shape = (len(lengths), case["heads"], case["tq"], case["dk"])
    q = torch.randn(shape, generator=gen, dtype=F64)
    if case["q"] == "expanded":  # stride-0 queries
        q = q[:, :, :1].expand(shape)
    q = q.to(dtype)
    if case["q"] == "bthd":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif case["q"] == "fused_qkv":  # q of a [B, Tq, 3, Hq, D] projection
        fused = torch.randn(shape[0], shape[2], 3, shape[1], shape[3], generator=gen,
                            dtype=F64).to(dtype)
        fused[:, :, 0] = q.transpose(1, 2)
        q = fused.unbind(2)[0].transpose(1, 2)
    elif case["q"] == "dim_major":  # stored [B, Tq, D, Hq]: the head dim strided by Hq
        q = q.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    elif case["q"] in ("slice", "neg"):
        q = laid_out(q, case["q"])
    mask_dtype = dtype if dtype in (F64, F32) else F32
    mask = _mask(case["mask"], case["heads"], mask_dtype, case["window"], gen)
    return q, key_pool, value_pool, table, seqlens, rows, mask


def sequence_keys(pool: torch.Tensor, row: list, n: int, block: int) -> torch.Tensor:
    """Sequence keys ``[1, Hkv, n, D]`` read slot by slot (float64; differentiable)."""
    slots = [pool[row[p // block], p % block].double() for p in range(n)]
    return (torch.stack(slots, 1) if slots else
            pool.new_zeros(pool.shape[2], 0, pool.shape[3], dtype=F64))[None]


def run_paged(case: dict) -> list:
    """Problems of one paged case (empty: right, or refused as documented)."""
    q, key_pool, value_pool, table, seqlens, rows, mask = paged_inputs(case)
    grad = case["grad"] and case["dtype"] == F64
    if grad:
        q, key_pool, value_pool = (t.detach().requires_grad_() for t in (q, key_pool, value_pool))
    try:
        got = paged_attention(q, key_pool, value_pool, table, seqlens, mask=mask,
                              backend=case["backend"], return_lse=case["lse"])
    except ValueError as error:
        _refusal(error)
        return []
    out, lse = (got.out, got.lse) if case["lse"] else (got, None)
    assert out.shape == (*q.shape[:3], case["dv"])
    problems = []
    keys = [sequence_keys(key_pool.detach(), row, n, case["block"])
            for row, n in zip(rows, case["lengths"])]
    values = [sequence_keys(value_pool.detach(), row, n, case["block"])
              for row, n in zip(rows, case["lengths"])]
    for b in range(len(rows)):
        _check(problems, f"sequence {b}", out[b:b + 1], q[b:b + 1], keys[b], values[b], mask,
               case["mask"], None if lse is None else lse[b:b + 1])
    if grad and not problems:  # dq and the pools' gradients (0 on every slot not read)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
        leaves = (q, key_pool, value_pool)
        truth_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        total = sum((ak.attention(truth_leaves[0][b:b + 1],
                                  sequence_keys(truth_leaves[1], row, n, case["block"]),
                                  sequence_keys(truth_leaves[2], row, n, case["block"]), mask,
                                  backend="reference") * dout[b:b + 1]).sum()
                    for b, (row, n) in enumerate(zip(rows, case["lengths"])))
        got_grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        want_grads = torch.autograd.grad(total, truth_leaves, allow_unused=True)
        _check_grads(problems, ("dq", "dkey_pool", "dvalue_pool"), got_grads, want_grads,
                     leaves)
    return problems


@pytest.mark.parametrize("first", range(0, 320, 40))
def test_paged_attention_equals_each_sequence_alone(first):
    failures = _failures(paged_case, run_paged, range(first, first + 40))
    assert not failures, failures


def test_paged_attention_on_the_triton_kernel_equals_each_sequence_alone(monkeypatch):
    """Small cases on the split-key kernel reading the table (interpreted on CPU)."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = _failures(lambda seed: paged_case(seed, triton=True), run_paged, range(12))
    assert not failures, failures


# ---- one case per layout ----------------------------------------------------------------------
def _decoding_case(layout: str, q_layout: str = "contiguous", dtype=F64):
    """A decoding step over pools in ``layout`` that reads by runs: a sequence whose 300
    keys lie in consecutive blocks (a run of its own, read in place) and two short ones."""
    return dict(seed=5, block=4, lengths=[300, 7, 1], heads_kv=2, heads=4, dk=16, dv=16,
                tq=1, dtype=dtype, backend="auto", mask="none", window=0, pools=layout,
                q=q_layout, table="int64", tail="garbage", seqlens="list", lse=True,
                grad=False, spare=2, extra=1, shuffle=False)


@pytest.mark.parametrize("layout", ["heads_major", "dim_major", "slot_major", "fused_kv",
                                    "expanded", "neg"])
def test_a_decoding_step_reads_pools_of_any_layout(layout):
    """Pools as views of another layout (a ``[num_blocks, Hkv, block_size, D]`` pool
    transposed, the last dim strided, a fused K|V buffer's halves, stride-0 heads) decode
    as contiguous pools do: by runs where the runs are views, else by the gathered call."""
    assert run_paged(_decoding_case(layout)) == []


@pytest.mark.parametrize("q_layout", ["dim_major", "bthd", "fused_qkv"])
def test_a_decoding_step_takes_queries_of_any_strides(q_layout):
    """The fused CPU kernel reads a query row as contiguous memory: a q whose head dim is
    strided is copied for it (reading it as it lies gives another query's numbers)."""
    assert run_paged(_decoding_case("contiguous", q_layout, F32)) == []


def test_the_triton_kernel_reads_negative_views_as_their_values(monkeypatch):
    """A negative view holds −t in memory; the kernel reads memory through pointers."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = dict(_decoding_case("neg", "neg", F32), lengths=[9, 0, 33], backend="triton")
    assert run_paged(case) == []


@pytest.mark.parametrize("layout", ["heads_major", "slot_major", "dim_major", "neg"])
def test_a_cache_over_pools_of_any_layout_appends_in_place(layout):
    """``PagedKVCache.from_tables`` over pools in another layout writes its new tokens into
    them (no copy: the caller's pools hold them) and attends as over contiguous pools."""
    gen = torch.Generator().manual_seed(2)
    key_pool, value_pool = (laid_out(torch.randn(12, 4, 2, 8, generator=gen, dtype=F64),
                                     layout) for _ in range(2))
    keys = [sequence_keys(key_pool, [3, 1], 5, 4), sequence_keys(key_pool, [5], 2, 4)]
    values = [sequence_keys(value_pool, [3, 1], 5, 4), sequence_keys(value_pool, [5], 2, 4)]
    cache = PagedKVCache.from_tables(key_pool, value_pool, [[3, 1], [5, 0]], [5, 2])
    for width in (1, 3, 1):
        new = torch.randn(2, 2, width, 8, generator=gen, dtype=F64)
        cache.append(new, -new)
        keys = [torch.cat([k, new[b:b + 1]], 2) for b, k in enumerate(keys)]
        values = [torch.cat([v, -new[b:b + 1]], 2) for b, v in enumerate(values)]
        assert cache.key_pool is key_pool
        for b, row in enumerate(cache.tables):
            assert torch.equal(sequence_keys(key_pool, row, cache.lengths[b], 4), keys[b])
        q = torch.randn(2, 4, width, 8, generator=gen, dtype=F64)
        got = cache.attend(q, return_lse=True)
        problems = []
        for b in range(2):
            _check(problems, f"sequence {b}", got.out[b:b + 1], q[b:b + 1], keys[b],
                   values[b], ak.causal("bottom_right"), "causal_br", got.lse[b:b + 1])
        assert not problems, problems


# ---- PagedKVCache over filled pools, step by step ------------------------------------------------
def run_cache(seed: int) -> list:
    """A cache over pools in a drawn layout (NaN in every slot no sequence owns) through
    forks, frees, reorders and ragged appends, each step's ``attend`` against the reference
    on every sequence's keys kept here."""
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block, heads_kv, group, dim = rnd.choice([1, 2, 4, 16]), rnd.choice([1, 2]), 2, 8
    layout = rnd.choice(["contiguous", "heads_major", "dim_major", "slot_major", "slice",
                         "neg"])
    lengths = [rnd.choice([0, 1, block, block + 1, rnd.randint(0, 300)])
               for _ in range(rnd.randint(1, 3))]
    needed = [-(-n // block) for n in lengths]
    num_blocks = sum(needed) + 8 * (-(-15 // block) + 2)  # room for 8 rows of 15 new tokens
    pools = [torch.full((num_blocks, block, heads_kv, dim), NAN, dtype=F64) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values, tables = [], [], []
    for n, count in zip(lengths, needed):
        blocks, order = order[:count], order[count:]
        seq = [torch.randn(n, heads_kv, dim, generator=gen, dtype=F64) for _ in range(2)]
        for pool, rows in zip(pools, seq):
            for p in range(n):
                pool[blocks[p // block], p % block] = rows[p]
        keys.append(seq[0].transpose(0, 1)[None])
        values.append(seq[1].transpose(0, 1)[None])
        tables.append(blocks + [num_blocks + 3] * (max(needed) + 1 - count))
    cache = PagedKVCache.from_tables(*(laid_out(p, layout) for p in pools), tables, lengths)
    problems = []
    for step in range(5):
        draw = rnd.random()
        if draw < 0.15:
            row = rnd.randrange(cache.batch)
            cache.fork(row)
            keys, values = keys + [keys[row]], values + [values[row]]
        elif draw < 0.25 and cache.batch > 1:
            row = rnd.randrange(cache.batch)
            cache.free([row])
            del keys[row], values[row]
        elif draw < 0.35:
            index = [rnd.randrange(cache.batch) for _ in range(cache.batch)]
            cache.reorder(index)
            keys, values = [keys[i] for i in index], [values[i] for i in index]
        width = rnd.choice([1, 1, 1, 2, 3])
        counts = ([width] * cache.batch if rnd.random() < 0.7
                  else [rnd.randint(0, width) for _ in range(cache.batch)])
        new = [torch.randn(cache.batch, heads_kv, width, dim, generator=gen, dtype=F64)
               for _ in range(2)]
        cache.append(*new, lengths=counts)
        keys = [torch.cat([k, new[0][b:b + 1, :, :n]], 2) for b, (k, n) in
                enumerate(zip(keys, counts))]
        values = [torch.cat([v, new[1][b:b + 1, :, :n]], 2) for b, (v, n) in
                  enumerate(zip(values, counts))]
        q = torch.randn(cache.batch, heads_kv * group, width, dim, generator=gen, dtype=F64)
        kind = rnd.choice(["none", "window_br", "softcap", "sinks"])
        mask = _mask(kind, heads_kv * group, F64, rnd.choice([0, 3, 50]), gen)
        got = cache.attend(q, mask, return_lse=True)
        step_mask = ak.causal("bottom_right") if mask is None else ak.causal(
            "bottom_right") & mask
        for b, n in enumerate(counts):
            _check(problems, f"step {step} sequence {b}", got.out[b:b + 1, :, :n],
                   q[b:b + 1, :, :n], keys[b], values[b], step_mask, kind,
                   got.lse[b:b + 1, :, :n])
            if not (got.out[b, :, n:] == 0).all():
                problems.append(f"step {step} sequence {b}: padded queries not 0")
    return problems


def test_a_cache_over_filled_pools_equals_each_sequence_alone():
    failures = {seed: problems for seed in range(30) if (problems := run_cache(seed))}
    assert not failures, failures


# ---- varlen_attention ----------------------------------------------------------------------------
VARLEN_MASKS = BANDS[1:] + ("none", "softcap", "sinks", "alibi", "mixed")


def varlen_case(seed: int, triton: bool = False) -> dict:
    rnd = random.Random(seed)
    count = rnd.randint(0, 4)
    edges = [0, 1, 2, 5, 16, 17, rnd.randint(0, 40)]
    lengths_q = [rnd.choice(edges) for _ in range(count)]
    same = rnd.random() < 0.5
    lengths_k = list(lengths_q) if same else [rnd.choice(edges) for _ in range(count)]
    heads_kv, dk = rnd.choice([1, 2]), rnd.choice([4, 8])
    return dict(
        seed=seed, lengths_q=lengths_q, lengths_k=lengths_k,
        used=[rnd.randint(0, n) for n in lengths_k] if rnd.random() < 0.3 else None,
        heads_kv=heads_kv, heads=heads_kv * rnd.choice([1, 2]), dk=dk, dv=rnd.choice([dk, 6]),
        dtype=rnd.choice([F32, F16, BF16] if triton else [F64, F64, F32, F16, BF16]),
        backend="triton" if triton else rnd.choice(["auto", "tiled", "torch", "reference"]),
        layout=rnd.choice(["contiguous", "fused", "heads_major", "dim_major", "neg", "slice",
                           "expanded"]),
        cu=rnd.choice(["int32", "int64", "list", "strided"]),
        pass_k=not same or rnd.random() < 0.5, mask=rnd.choice(VARLEN_MASKS),
        window=rnd.choice([0, 1, 3, 9]), lse=rnd.random() < 0.5, grad=rnd.random() < 0.5)


def varlen_inputs(case: dict):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, total_q, total_k = case["dtype"], sum(case["lengths_q"]), sum(case["lengths_k"])
    heads_k = 1 if case["layout"] == "expanded" else case["heads_kv"]
    q = torch.randn(total_q, case["heads"], case["dk"], generator=gen, dtype=F64)
    k = torch.randn(total_k, heads_k, case["dk"], generator=gen, dtype=F64)
    v = torch.randn(total_k, heads_k, case["dv"], generator=gen, dtype=F64)
    if case["used"] is not None:  # poison past each sequence's used keys
        start = 0
        for n, used in zip(case["lengths_k"], case["used"]):
            k[start + used:start + n], v[start + used:start + n] = NAN, INF
            start += n
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if case["layout"] == "expanded":  # stride-0 heads
        k, v = k.expand(-1, case["heads_kv"], -1), v.expand(-1, case["heads_kv"], -1)
    elif case["layout"] == "fused":
        if total_q == total_k and case["heads"] == case["heads_kv"] and case["dk"] == case["dv"]:
            q, k, v = torch.stack([q, k, v], 1).unbind(1)  # a [total, 3, H, D] projection
        else:
            fused = torch.cat([k, v], -1)  # a [total_k, Hkv, Dk + Dv] projection
            k, v = fused[..., :case["dk"]], fused[..., case["dk"]:]
    else:
        q, k, v = (laid_out(t, case["layout"]) for t in (q, k, v))

    def bounds(lengths):
        values = torch.tensor([0, *lengths]).cumsum(0)
        return {"int32": lambda t: t.int(), "int64": lambda t: t, "list": lambda t: t.tolist(),
                "strided": lambda t: torch.stack([t, -t], -1)[:, 0]}[case["cu"]](values)
    mask_dtype = dtype if dtype in (F64, F32) else F32
    mask = _mask(case["mask"], case["heads"], mask_dtype, case["window"], gen)
    return q, k, v, bounds(case["lengths_q"]), (bounds(case["lengths_k"]) if case["pass_k"]
                                                 else None), mask


def run_varlen(case: dict) -> list:
    q, k, v, cu_q, cu_k, mask = varlen_inputs(case)
    grad = case["grad"] and case["dtype"] == F64
    if grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        got = ak.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=case["used"], mask=mask,
                                  backend=case["backend"], return_lse=case["lse"])
    except ValueError as error:
        _refusal(error)
        return []
    out, lse = (got.out, got.lse) if case["lse"] else (got, None)
    assert out.shape == (q.shape[0], case["heads"], case["dv"])
    problems, truth_leaves = [], [t.detach().double().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    total, a, c = 0, 0, 0
    for b, (nq, nk) in enumerate(zip(case["lengths_q"], case["lengths_k"])):
        used = nk if case["used"] is None else case["used"][b]
        mine = [t[start:start + n].transpose(0, 1)[None] for t, start, n in zip(
            truth_leaves, (a, c, c), (nq, used, used))]
        _check(problems, f"sequence {b}", out[a:a + nq].transpose(0, 1)[None],
               q[a:a + nq].transpose(0, 1)[None], mine[1].detach(), mine[2].detach(), mask,
               case["mask"], None if lse is None else lse[:, a:a + nq][None])
        if grad:
            want = ak.attention(*mine, mask, backend="reference")
            total = total + (want * dout[a:a + nq].transpose(0, 1)[None]).sum()
        a, c = a + nq, c + nk
    if grad and not problems and out.numel():  # gradients, 0 for keys past seqused_k
        got_grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
        want_grads = (torch.autograd.grad(total, truth_leaves, allow_unused=True)
                      if torch.is_tensor(total) else [None] * 3)
        _check_grads(problems, ("dq", "dk", "dv"), got_grads, want_grads, (q, k, v))
    return problems


@pytest.mark.parametrize("first", range(0, 300, 50))
def test_varlen_attention_equals_each_sequence_alone(first):
    failures = _failures(varlen_case, run_varlen, range(first, first + 50))
    assert not failures, failures


def test_varlen_attention_on_triton_equals_each_sequence_alone(monkeypatch):
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = _failures(lambda seed: varlen_case(seed, triton=True), run_varlen, range(10))
    assert not failures, failures


def test_appending_to_a_pool_of_stride_zero_is_refused_clearly():
    """An expanded pool (one slot standing for several heads) reads fine but cannot take
    one head's token at a time: the append says so and what to pass, changing nothing."""
    pool = torch.zeros(4, 2, 1, 8, dtype=F64).expand(4, 2, 2, 8)
    cache = PagedKVCache.from_tables(pool, pool, [[1], [2]], [1, 1])
    new = torch.ones(2, 2, 1, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"key_pool \(4, 2, 2, 8\) has strides .*contiguous"):
        cache.append(new, new)
    assert cache.lengths == [1, 1]


@pytest.mark.parametrize("new", [1, 3])
def test_a_step_of_no_sequences_appends_and_attends_nothing(new):
    """A batch emptied (every sequence freed) still steps: an append of 0 rows, one token
    each (the decoding step) or several, changes nothing and its attention is empty."""
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_blocks=4, block_size=4)
    cache.append(*torch.randn(2, 2, 2, 3, 8, dtype=F64, generator=generator).unbind(0))
    cache.free([0, 1])
    none = torch.zeros(0, 2, new, 8, dtype=F64)
    cache.append(none, none)
    assert cache.batch == 0 and cache.free_blocks == 4
    out = cache.attend(torch.zeros(0, 4, new, 8, dtype=F64))
    assert out.shape == (0, 4, new, 8)
