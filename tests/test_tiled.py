"""The tiled engine with many small tiles: forward and backward against the independent float64
truth, on both tile primitives (torch's fused CPU kernel and the matmul path), ragged tails,
every mask kind and combination, GQA, all dtypes, shard offsets, dropout, determinism, block
skipping and the O(T) memory contract (nothing Tq×Tk saved for backward)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.backends import tiled
from attnkit.backends.tiled import TiledBackend, TiledOptions, make_plan, tiled_attention
from attnkit.inputs import validate
from attnkit.masks import MaskSpace

from conftest import (ALL_DTYPES, MASK_KINDS, assert_within_2x, delta_form_floors, dense_band,
                      dense_documents, dense_padding, mask_case, naive_attention, plain_attention)

# Small blocks so that every case has many tiles, ragged tails and all three tile kinds.
BLOCKS = dict(block_q=16, block_k=8)


@pytest.fixture(params=["fused", "matmul"])
def path(request) -> TiledOptions:
    """Run a test on each tile primitive: the options that select it (fused applies to
    fp32/fp64 with Dk == Dv only)."""
    return TiledOptions(fused_tiles=request.param == "fused")


def _inputs(gen, dtype, batch=2, heads_q=4, heads_kv=2, tq=37, tk=53, dk=16, dv=16):
    q = torch.randn(batch, heads_q, tq, dk, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, heads_kv, tk, dk, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, heads_kv, tk, dv, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _fit_mask(kind, gen, batch, tq, tk):
    mask, allowed, bias = mask_case(kind, (batch,), 4, tq, tk, gen)
    mask = ak.masks.as_mask(mask)
    if mask is not None:  # tensor masks come in the caller's layout; give them [B?, 1, Tq, Tk]
        from attnkit.inputs import validate
        mask = validate(torch.zeros(batch, 1, tq, 1), torch.zeros(batch, 1, tk, 1),
                        torch.zeros(batch, 1, tk, 1), mask).mask
    return mask, allowed, bias


def _cotangent(shape) -> torch.Tensor:
    """The fixed random output gradient (float64) of :func:`_run` and :func:`_truth`."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _run(q, k, v, mask, scale, grad_seed=None, options=TiledOptions(), **kw):
    """Forward (and backward with a fixed random cotangent) → (out, lse, grads), with
    ``options``; with ``fused_tiles=False`` the matmul path is checked to have run."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = tiled_attention(q, k, v, mask, scale=scale, options=options, **{**BLOCKS, **kw})
    assert out.grad_fn.problem.plan.options == options
    assert options.fused_tiles or not out.grad_fn.problem.plan.fused
    (out * _cotangent(out.shape).to(out.dtype)).sum().backward()
    return out, lse, [t.grad for t in (q, k, v)]


def _truth(q, k, v, allowed, bias, scale, dtype):
    """Float64 truth and plain-math-in-dtype (out, lse, grads) with the same cotangent."""
    results = []
    for compute in (torch.float64, dtype):
        qq, kk, vv = (t.detach().to(compute).requires_grad_() for t in (q, k, v))
        out, lse, _ = plain_attention(qq, kk, vv, allowed, bias, scale, dtype=compute)
        (out * _cotangent(out.shape).to(compute)).sum().backward()
        results.append((out, lse, [t.grad for t in (qq, kk, vv)]))
    return results


def _assert_like_truth(result, q, k, v, allowed, bias, scale, dtype):
    """``result = (out, lse, grads)`` of :func:`_run` within the 2x rule of the float64 truth
    (same cotangent), for out, LSE and every gradient; dq and dk with the floor of the
    backward's ``dS = P ∘ (dP − Δ)`` form in its accumulation dtype (float32 below float64)."""
    out, lse, grads = result
    (t_out, t_lse, t_grads), (p_out, p_lse, p_grads) = _truth(q, k, v, allowed, bias, scale, dtype)
    assert_within_2x("out", out, t_out, p_out, dtype)
    assert_within_2x("lse", lse, t_lse, p_lse, dtype)
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    floors = delta_form_floors(q, k, v, _cotangent(out.shape), allowed, bias, scale,
                               torch.finfo(accumulation).eps)
    for name, g, tg, pg in zip("qkv", grads, t_grads, p_grads):
        assert_within_2x(f"d{name}", g, tg, pg, dtype, floors.get(f"d{name}", 0.0))


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_mask_forward_backward(path, kind, gen):
    dtype = torch.float32
    q, k, v = _inputs(gen, dtype)
    mask, allowed, bias = _fit_mask(kind, gen, 2, 37, 53)
    scale = 0.3
    out, lse, grads = _run(q, k, v, mask, scale, options=path)
    _assert_like_truth((out, lse, grads), q, k, v, allowed, bias, scale, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [
    dict(tq=37, tk=53),  # ragged tails on both sides
    dict(tq=64, tk=64, heads_q=6, heads_kv=1),  # MQA, exact multiples of the blocks
    dict(tq=5, tk=70, dv=24),  # Dv != Dk (matmul path), long keys
    dict(tq=45, tk=9, batch=1, heads_q=2, heads_kv=2),  # fewer keys than one block row
])
@pytest.mark.parametrize("kind", ["causal", "causal&padding", "documents", "bias&causal"])
def test_dtypes_and_shapes(path, dtype, shape, kind, gen):
    q, k, v = _inputs(gen, dtype, **shape)
    batch, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    mask, allowed, bias = _fit_mask(kind, gen, batch, tq, tk)
    out, lse, grads = _run(q, k, v, mask, None if False else 1 / math.sqrt(q.shape[-1]),
                           options=path)
    (t_out, t_lse, t_grads), (p_out, p_lse, p_grads) = _truth(q, k, v, allowed, bias, None, dtype)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_within_2x("out", out, t_out, p_out, dtype)
    assert_within_2x("lse", lse, t_lse, p_lse.float() if dtype != torch.float64 else p_lse, dtype)
    for name, g, tg, pg in zip("qkv", grads, t_grads, p_grads):
        assert_within_2x(f"d{name}", g, tg, pg, dtype)


def test_fully_masked_rows_exact_zero(path, gen):
    q, k, v = _inputs(gen, torch.float32)
    mask = ak.padding(q_lengths=[37, 20], kv_lengths=[0, 30])  # batch 0: no keys at all
    out, lse, grads = _run(q, k, v, mask, 0.25, options=path)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1, :, 20:], torch.zeros_like(out[1, :, 20:]))
    for g in grads:
        assert not g.isnan().any()
        assert torch.equal(g[0], torch.zeros_like(g[0]))
    assert torch.equal(grads[0][1, :, 20:], torch.zeros_like(grads[0][1, :, 20:]))
    assert torch.equal(grads[1][1, :, 30:], torch.zeros_like(grads[1][1, :, 30:]))


@pytest.mark.parametrize("offsets", [(0, 0), (24, 0), (16, 40), (53, 13)])
def test_shard_offsets_equal_slices_of_the_whole(path, offsets, gen):
    """One shard of queries against one shard of keys, with the mask at global positions,
    equals that block of the whole computation (what ring attention relies on)."""
    total_q, total_k = 80, 96
    q, k, v = _inputs(gen, torch.float64, tq=total_q, tk=total_k)
    ids = torch.arange(total_q) // 23
    mask = ak.documents(ids, torch.arange(total_k) // 23) & ak.causal("bottom_right")
    space = MaskSpace(2, 4, total_q, total_k)
    q0, k0 = offsets
    q_part, k_part, v_part = q[:, :, q0:q0 + 27], k[:, :, k0:k0 + 31], v[:, :, k0:k0 + 31]
    out, lse = tiled_attention(q_part, k_part, v_part, mask, scale=0.25, space=space,
                               q_offset=q0, kv_offset=k0, options=path, **BLOCKS)
    allowed = mask.to_dense(space)[..., q0:q0 + 27, k0:k0 + 31]
    t_out, t_lse, _ = naive_attention(q_part, k_part, v_part, allowed, None, 0.25)
    assert torch.allclose(out, t_out, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(t_lse))
    finite = torch.isfinite(t_lse)
    assert torch.allclose(lse[finite], t_lse[finite], atol=1e-12)


def test_bit_identical_reruns(path, gen):
    q, k, v = _inputs(gen, torch.float32, tq=70, tk=70)
    mask = ak.sliding_window(9) & ak.padding(kv_lengths=[60, 70])
    first = _run(q, k, v, mask, 0.2, options=path)
    second = _run(q, k, v, mask, 0.2, options=path)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


def test_lse_gradient(path, gen):
    """Gradients flow through the returned LSE too (d lse / d score = softmax weight)."""
    # gradcheck perturbs every input element: keep them few (still several tiles of 16×8).
    q, k, v = _inputs(gen, torch.float64, batch=1, heads_q=2, heads_kv=1, tq=23, tk=21, dk=4, dv=4)
    mask = ak.causal() & ak.padding(q_lengths=[20])  # rows 20.. are fully masked

    def fn(q, k, v):
        out, lse = tiled_attention(q, k, v, mask, scale=0.3, options=path, **BLOCKS)
        return out, torch.nan_to_num(lse, neginf=0.0)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def test_gradcheck_through_backend(path, gen):
    q, k, v = _inputs(gen, torch.float64, batch=1, heads_q=2, heads_kv=1, tq=21, tk=19, dk=4, dv=4)
    mask = ak.documents(torch.arange(21) // 7, torch.arange(19) // 7) & ak.causal()
    backend = TiledBackend(path)
    fn = lambda q, k, v: backend.forward(validate(q, k, v, mask)).out  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def test_dropout_reproducible_and_consistent(gen):
    """Same generator seed → same output; the backward uses the forward's dropout pattern
    (gradcheck passes only if both passes see the same keep-mask, tile by tile)."""
    q, k, v = _inputs(gen, torch.float64, batch=1, heads_q=2, heads_kv=1, tq=17, tk=19, dk=4, dv=4)

    def seeded(seed):
        return ak.attention(q, k, v, ak.causal("bottom_right"), dropout_p=0.3, backend="tiled",
                            generator=torch.Generator().manual_seed(seed))

    assert torch.equal(seeded(11), seeded(11))
    assert not torch.equal(seeded(11), seeded(12))

    def fn(q, k, v):
        out, _ = tiled_attention(q, k, v, ak.causal("bottom_right"), scale=0.5, dropout_p=0.3,
                                 seed=11, **BLOCKS)
        return out

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def test_dropout_expectation(gen):
    """Averaged over many seeds, dropout's output approaches the dropout-free output."""
    q, k, v = _inputs(gen, torch.float64, batch=1, heads_q=1, heads_kv=1, tq=8, tk=40)
    clean = ak.attention(q, k, v, backend="tiled")
    runs = torch.stack([ak.attention(q, k, v, dropout_p=0.5, backend="tiled",
                                     generator=torch.Generator().manual_seed(s)) for s in range(200)])
    # The mean of 200 independent runs has standard error std/sqrt(200); allow 5 of them.
    spread = runs.std(0).max() / math.sqrt(200)
    assert (runs.mean(0) - clean).abs().max() < 5 * spread


def test_nothing_of_size_tq_tk_is_saved(path, gen):
    q, k, v = _inputs(gen, torch.float32, batch=1, heads_q=2, heads_kv=1, tq=96, tk=96)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        q.requires_grad_()
        out = TiledBackend(path).forward(validate(q, k, v, ak.causal())).out
    assert out.grad_fn.problem.plan.fused == path.fused_tiles
    assert saved and max(saved) < 96 * 96, saved
    out.sum().backward()


@pytest.mark.parametrize("mask, dropout_p", [
    (ak.causal() & ak.softcap(2.0), 0.0),
    (ak.sliding_window(3), 0.0),
    (ak.causal(), 0.3),
], ids=["softcap", "window", "dropout"])
def test_selective_checkpointing_that_saves_bmm_keeps_the_gradients(mask, dropout_p, gen):
    """Selective activation checkpointing whose policy saves ``aten.bmm`` replays the saved
    products in the recompute: the engine's in-place writes to its scores must not reach
    them (the gradients equal those of the call without checkpointing)."""
    import functools
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    def save_bmm(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.bmm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    q0, k0, v0 = _inputs(gen, torch.float32, batch=1, heads_q=2, heads_kv=2, tq=24, tk=24)
    grad = torch.randn(q0.shape, generator=gen)

    def grads(checkpointed: bool):
        torch.manual_seed(1)  # one dropout draw for both
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        fn = functools.partial(ak.attention, mask=mask, backend="tiled", dropout_p=dropout_p)
        if checkpointed:
            context = functools.partial(create_selective_checkpoint_contexts, save_bmm)
            out = checkpoint(fn, q, k, v, use_reentrant=False, context_fn=context)
        else:
            out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)

    for name, got, want in zip(("dq", "dk", "dv"), grads(True), grads(False)):
        assert torch.equal(got, want), name


def test_the_first_invariant_call_under_selective_checkpointing(gen):
    """The fixed schedule's row quantum is measured by the first invariant call of a process:
    inside a selective checkpoint that saves torch's kernel, the measurement's own kernel
    calls must not be kept (the recompute would get them for its real ones)."""
    import functools
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)
    from attnkit.backends.tiled.plan import row_quantum

    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def save_kernel(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is kernel else CheckpointPolicy.PREFER_RECOMPUTE

    q0, k0, v0 = _inputs(gen, torch.float32, batch=1, heads_q=2, heads_kv=2, tq=100, tk=100)

    def grads(checkpointed: bool):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        fn = functools.partial(ak.attention, mask=ak.causal(), backend="tiled", invariant=True)
        if checkpointed:
            context = functools.partial(create_selective_checkpoint_contexts, save_kernel)
            out = checkpoint(fn, q, k, v, use_reentrant=False, context_fn=context)
        else:
            out = fn(q, k, v)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    row_quantum.cache_clear()  # this process's first invariant call is the checkpointed one
    for name, got, want in zip(("dq", "dk", "dv"), grads(True), grads(False)):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("mask, expected", [
    (None, 1.0),
    (ak.causal(), 0.5),
    (ak.sliding_window(32), 48 / 512),
])
def test_block_skipping(mask, expected):
    """The plan computes only the tiles the mask needs: ~half for causal, a band for a window."""
    n = 512
    space = MaskSpace(1, 1, n, n)
    plan = make_plan(mask, space, batch=1, heads=1, q_offset=0, q_count=n, kv_offset=0,
                     kv_count=n, block_q=16, block_k=16)
    fraction = plan.tiles_computed() / (n // 16) ** 2
    assert fraction == pytest.approx(expected, abs=2 / (n // 16))
    if mask is not None:
        assert any(s.partial for row in plan.rows for s in row)
        assert any(not s.partial for row in plan.rows for s in row)


def _square_masks() -> dict:
    ids = torch.tensor([0] * 200 + [1] * 320 + [2] * 80)
    starts, lengths = torch.tensor([0, 90]), torch.tensor([600, 510])
    return {
        "causal": ak.causal(),
        "causal, bottom right": ak.causal("bottom_right"),
        "window": ak.sliding_window(255),
        "window both sides": ak.sliding_window(256, 256),
        "padding": ak.padding(kv_lengths=torch.tensor([300, 600])),
        "left padding": ak.padding(q_starts=starts, kv_starts=starts),
        "causal & padding": ak.causal() & ak.padding(q_lengths=lengths, kv_lengths=lengths),
        "causal(sequences)": ak.causal("bottom_right", sequences=ak.padding(
            q_starts=starts, kv_starts=starts)),
        "window(sequences)": ak.sliding_window(256, align="bottom_right", sequences=ak.padding(
            kv_lengths=lengths, q_lengths=lengths)),
        "documents & causal": ak.documents(ids) & ak.causal(),
        "documents(causal)": ak.documents(ids, causal="top_left"),
    }


def _square_of(dense: torch.Tensor, q0: int, n: int, k0: int) -> Optional[str]:
    """The structure of the square ``[q0, q0 + n) × [k0, k0 + n)`` of a dense mask ``[Bm, Hm,
    Tq, Tk]``, for every batch element and head: full, lower, upper triangle, or ``None``."""
    tile = dense[..., q0:q0 + n, k0:k0 + n]
    row, col = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for name, shape in (("full", torch.ones(n, n, dtype=torch.bool)), ("lower", col <= row),
                        ("upper", col >= row)):
        if torch.equal(tile, shape.expand_as(tile)):
            return name
    return None


@pytest.mark.parametrize("name", list(_square_masks()))
@pytest.mark.parametrize("block_q, q_offset", [(256, 0), (64, 100), (40, 3)])
def test_square_summaries_answer_as_the_dense_mask_does(name, block_q, q_offset):
    """The squares' structures a fused plan reads in one host read with its block codes
    (``_square_summaries``, from the mask's key ranges) are the dense mask's (full, lower,
    upper) for every query block and key offset, ragged last blocks and a chunk's query
    offset included."""
    from attnkit.backends.tiled.plan import _square_summaries, _Squares
    from attnkit.masks import key_ranges

    mask, space = _square_masks()[name], MaskSpace(2, 1, 600, 600)
    dense = mask.to_dense(space)
    q_count = space.q_len - q_offset
    ranges = key_ranges(mask, space)
    assert ranges.exact is None or bool(ranges.exact)
    lo, hi = (t[:, q_offset:] for t in ranges[:2])
    squares = _Squares(_square_summaries(lo, hi, block_q).tolist())
    seen = set()
    for i in range(math.ceil(q_count / block_q)):
        q_start = q_offset + i * block_q
        n = min(block_q, space.q_len - q_start)
        for k0 in range(0, space.kv_len - n + 1, 1 if n < 64 else 4):
            want = _square_of(dense, q_start, n, k0)
            assert squares.structure(i, n, k0, k0 + n) == want, (i, n, k0)
            seen.add(want)
    assert len(seen) > 1  # the mask has squares of some structure and squares of none


def _plan_masks() -> dict:
    masks = _square_masks()
    split = torch.arange(600) // 50
    split[550:] = 0  # document 0 in two runs: its key ranges do not hold
    masks["documents, not one run each"] = ak.documents(split)
    masks["documents, not one run each, & causal"] = ak.documents(split) & ak.causal()
    masks["short documents"] = ak.documents(torch.arange(600) // 50)
    masks["short documents(causal)"] = ak.documents(torch.arange(600) // 50, causal="top_left")
    masks["short documents per sequence"] = ak.documents(torch.stack([
        torch.arange(600) // 50, torch.arange(600) // 60]))
    return masks


@pytest.mark.parametrize("name", list(_plan_masks()))
@pytest.mark.parametrize("q_offset, q_count", [(0, 600), (100, 300)])
def test_a_fused_plans_known_tiles_are_the_masks(name, q_offset, q_count):
    """A fused plan (one host read: block codes, squares and each row's keys from the mask's
    key ranges) marks as staircases only tiles whose dense mask is that staircase, and its
    pieces are the ones the evaluated mask gives; documents whose key ranges do not hold
    (an id in two runs) get no staircase, and pieces from the evaluated mask."""
    from attnkit.backends.tiled.plan import _with_pieces

    mask, space = _plan_masks()[name], MaskSpace(2, 1, 600, 600)
    dense = mask.to_dense(space).expand(2, 1, 600, 600)
    plan = tiled.plan.build_plan(mask, space, batch=2, heads=1, q_offset=q_offset,
                                 q_count=q_count, kv_offset=0, kv_count=600, fused=True)
    for i, row in enumerate(plan.rows):
        q0 = q_offset + i * plan.block_q
        n = min(plan.block_q, q_offset + q_count - q0)
        tile = dense[..., q0:q0 + n, :]
        for seg in row:
            keys = tile[..., seg.start:seg.stop]
            if not seg.partial:
                assert keys.all()
            elif seg.structure is not None:  # upper triangle first, lower last, full between
                width = seg.stop - seg.start
                col = torch.arange(width)[None, :]
                row_ = torch.arange(n)[:, None]
                shape = torch.ones(n, width, dtype=torch.bool)
                if seg.structure in ("upper", "band"):
                    shape &= col >= row_
                if seg.structure in ("lower", "band"):
                    shape &= col <= row_ + width - n
                assert torch.equal(keys, shape.expand_as(keys)), (i, seg)
    bare = [tuple(dataclasses.replace(seg, pieces=None) for seg in row) for row in plan.rows]
    evaluated = _with_pieces(mask, space, bare, plan.block_q, q_offset, q_count, 0)
    assert tuple(evaluated) == plan.rows
    if "not one run" in name:
        assert not any(seg.structure for row in plan.rows for seg in row)
    if q_offset == 0 and name in ("causal", "causal(sequences)"):
        assert any(seg.structure for row in plan.rows for seg in row)
    if name.startswith("short documents"):
        assert any(seg.pieces for row in plan.rows for seg in row)


def _structure_by_rows(lo: torch.Tensor, hi: torch.Tensor, k0: int, n: int):
    """A square's structure from its rows' key runs, clamped to it (``[Bm, n]`` each)."""
    lo, hi, row = lo.clamp(min=k0), hi.clamp(max=k0 + n), torch.arange(n)
    for name, first, stop in (("full", k0, k0 + n), ("lower", k0, k0 + row + 1),
                              ("upper", k0 + row, k0 + n)):
        if bool(((lo == first) & (hi == stop)).all()):
            return name
    return None


@pytest.mark.parametrize("seed", range(4))
def test_square_summaries_on_random_key_runs(seed):
    """``_Squares`` against the square's rows, on random runs drawn near each structure with
    rows moved outward (a first row seeing further left, a last row further right: the
    structure holds) or anywhere (it breaks)."""
    from attnkit.backends.tiled.plan import _square_summaries, _Squares

    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for _ in range(60):
        batch, rows, block_q = (int(torch.randint(a, b, (), generator=gen))
                                for a, b in ((1, 3), (1, 24), (1, 9)))
        row = torch.arange(rows) % block_q
        k0 = torch.randint(0, 6, (1, rows), generator=gen)  # per row: blocks mostly share it
        k0 = k0[:, :1].expand(batch, rows).clone()
        kind = int(torch.randint(0, 3, (), generator=gen))
        lo = k0 + (row if kind == 2 else 0)
        hi = k0 + (row + 1 if kind == 1 else block_q)
        moved = torch.rand(batch, rows, generator=gen) < 0.3
        lo = torch.where(moved, lo - torch.randint(0, 3, lo.shape, generator=gen), lo)
        moved = torch.rand(batch, rows, generator=gen) < 0.3
        hi = torch.where(moved, hi + torch.randint(-1, 3, hi.shape, generator=gen), hi)
        squares = _Squares(_square_summaries(lo, hi, block_q).tolist())
        for i in range(math.ceil(rows / block_q)):
            n = min(block_q, rows - i * block_q)
            block = slice(i * block_q, i * block_q + n)
            for start in range(0, 8):
                want = _structure_by_rows(lo[:, block], hi[:, block], start, n)
                assert squares.structure(i, n, start, start + n) == want, (lo, hi, i, start)
                seen.add(want)
    assert seen == {None, "full", "lower", "upper"}


def test_empty_tiles_are_never_evaluated(monkeypatch, gen):
    """PARTIAL tiles evaluate the element mask; FULL and EMPTY tiles never do."""
    calls = []
    real_tile = ak.masks._Documents.tile

    def spy(self, q_idx, kv_idx, space):
        calls.append((int(q_idx[0]), int(q_idx[-1]), int(kv_idx[0]), int(kv_idx[-1])))
        return real_tile(self, q_idx, kv_idx, space)

    monkeypatch.setattr(ak.masks._Documents, "tile", spy)
    ids = torch.arange(64) // 16  # four documents of 16, aligned with the blocks
    q, k, v = _inputs(gen, torch.float32, batch=1, heads_q=1, heads_kv=1, tq=64, tk=64)
    tiled_attention(q, k, v, ak.documents(ids), scale=0.25, block_q=16, block_k=16)
    assert calls == []  # every tile is FULL (same document) or EMPTY (different ones)


def test_weights_rebuilt_tile_by_tile(gen):
    q, k, v = _inputs(gen, torch.float64)
    mask = ak.causal() & ak.padding(kv_lengths=[0, 40])
    r = ak.attention(q, k, v, mask, backend="tiled", return_weights=True, return_lse=True)
    ref = ak.attention(q, k, v, mask, backend="reference", return_weights=True)
    assert torch.allclose(r.weights, ref.weights, atol=1e-12)


def test_refuses_weights_with_autograd(gen):
    q, k, v = _inputs(gen, torch.float32)
    q.requires_grad_()
    with pytest.raises(ValueError, match="not supported by tiled"):
        ak.attention(q, k, v, backend="tiled", return_weights=True)


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("q_shape, kv_shape", [
    ((2, 3, 4, 8), (2, 3, 0, 8)),  # no keys: every row fully masked
    ((2, 3, 0, 8), (2, 3, 5, 8)),  # no queries
    ((0, 3, 4, 8), (0, 3, 4, 8)),  # empty batch
])
def test_empty_sequences(backend, q_shape, kv_shape):
    q = torch.randn(q_shape, requires_grad=True)
    k, v = torch.randn(kv_shape), torch.randn(kv_shape)
    r = ak.attention(q, k, v, ak.causal(), backend=backend, return_lse=True)
    assert r.out.shape == q_shape and torch.equal(r.out, torch.zeros(q_shape))
    assert torch.isneginf(r.lse).all()
    r.out.sum().backward()
    assert torch.equal(q.grad, torch.zeros(q_shape))


# ---- tiles the mask knows to be triangles (run with is_causal, never evaluated) --------------

def _structure_cases():
    """(mask, its dense form [Bm, 1, tq, tk] built by hand) on a 40×44 space, batch 2."""
    tq, tk = 40, 44
    ids_q, ids_k = torch.arange(tq) // 8, torch.arange(tk) // 8
    ids2_q = torch.stack([torch.arange(tq) // 8, torch.arange(tq) // 5])
    ids2_k = torch.stack([torch.arange(tk) // 8, torch.arange(tk) // 5])
    return [
        (ak.causal(), dense_band(tq, tk, None, 0)[None, None]),
        (ak.causal("bottom_right"), dense_band(tq, tk, None, 0, "bottom_right")[None, None]),
        (ak.sliding_window(8), dense_band(tq, tk, 8, 0)[None, None]),
        (ak.sliding_window(6, 3), dense_band(tq, tk, 6, 3)[None, None]),
        (ak.sliding_window(0, 8, "bottom_right"), dense_band(tq, tk, 0, 8, "bottom_right")[None, None]),
        (ak.documents(ids_q, ids_k) & ak.causal(),
         dense_documents(ids_q, ids_k) & dense_band(tq, tk, None, 0)),
        (ak.documents(ids2_q, ids2_k) & ak.sliding_window(8),
         dense_documents(ids2_q, ids2_k) & dense_band(tq, tk, 8, 0)),
        (ak.causal() & ak.padding(q_lengths=[30, 40], kv_lengths=[33, 44]),
         dense_band(tq, tk, None, 0) & dense_padding(tq, tk, [30, 40], [33, 44], batch=2)),
        (ak.causal() & ak.bias(torch.zeros(tq, tk)), None),  # a bias: never a known structure
        (ak.causal() | ak.sliding_window(2), None),  # masks that cannot tell say None
    ]


@pytest.mark.parametrize("case", range(len(_structure_cases())))
def test_square_structures_match_the_hand_built_masks(case):
    """Every structure a fused plan knows of a square tile from the mask's key ranges
    (``plan._Squares``) equals the hand-built dense form there, for every batch element; the
    claims do occur (lower and upper triangles, full tiles); masks without key ranges (a bias,
    ``|``) claim none."""
    from attnkit.backends.tiled.plan import _square_summaries, _Squares
    from attnkit.masks import key_ranges

    mask, dense = _structure_cases()[case]
    space = MaskSpace(2, 1, 40, 44)
    ranges = key_ranges(mask, space)
    if dense is None:
        assert ranges is None
        return
    claims = set()
    for n in (1, 3, 8, 9, 16):
        for q0 in range(0, 41 - n):
            lo, hi = (t[:, q0:q0 + n] for t in ranges[:2])
            squares = _Squares(_square_summaries(lo, hi, n).tolist())
            for k0 in range(0, 45 - n):
                claim = squares.structure(0, n, k0, k0 + n)
                claims.add(claim)
                if claim is None:
                    continue
                got = dense[..., q0:q0 + n, k0:k0 + n].expand(2, 1, n, n)
                square = torch.ones(n, n, dtype=torch.bool)
                want = {"full": square, "lower": square.tril(), "upper": square.triu()}[claim]
                assert torch.equal(got, want.expand_as(got)), (mask, (q0, n, k0), claim)
    if case < 6:  # bands and documents&causal: triangles must be recognised
        assert claims & {"lower", "upper"}, claims


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(3, 3), (4, 2)])
@pytest.mark.parametrize("strip", [64, 4, 5])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("kind, seq", [("window", 64), ("window", 70), ("documents", 64),
                                       ("bottom_right", 48), ("window_right", 64),
                                       ("window_block", 64)])
def test_triangle_tiles_forward_backward(path, dtype, heads, strip, merge, kind, seq, gen,
                                         monkeypatch):
    """Lower and upper triangle tiles recognised from the mask's structure, alone or merged with
    their full neighbours into staircase segments (``merge``), against the float64 truth. With
    the fused kernel they run in strips of rows when the tile holds two strips (16-row tiles,
    strips of 4 or 5, the last one ragged), else lower squares with is_causal and the rest (GQA
    too) with a cached additive staircase. On block-aligned sizes with the fused kernel the
    element mask is never evaluated; reruns are bit-identical."""
    options = dataclasses.replace(path, triangle_strip=strip,
                                  staircase_max_keys=path.staircase_max_keys if merge else 0)
    tq = seq if kind != "bottom_right" else 32
    q, k, v = _inputs(gen, dtype, batch=2, heads_q=heads[0], heads_kv=heads[1], tq=tq, tk=seq)
    if kind == "window":  # window 32 on blocks 16×8: upper, full and lower tiles per row
        mask, allowed = ak.sliding_window(32), dense_band(tq, seq, 32, 0)
    elif kind == "window_block":  # window 16 = block_q: upper and lower tiles in one partial run
        mask, allowed = ak.sliding_window(16), dense_band(tq, seq, 16, 0)
    elif kind == "window_right":  # upper and full tiles, then partial ones evaluated
        mask, allowed = ak.sliding_window(32, 20), dense_band(tq, seq, 32, 20)
    elif kind == "documents":
        ids = torch.arange(seq) // 32
        mask, allowed = ak.documents(ids) & ak.causal(), dense_documents(ids) & dense_band(seq, seq, None, 0)
    else:
        mask, allowed = ak.causal("bottom_right"), dense_band(tq, seq, None, 0, "bottom_right")
    plan = make_plan(mask, MaskSpace(2, heads[0], tq, seq), batch=2, heads=heads[0], q_offset=0, q_count=tq,
                     kv_offset=0, kv_count=seq, fused=True, options=options, **BLOCKS)
    structures = {s.structure for row in plan.rows for s in row if s.partial}
    expected = {"window": {"lower", "band" if merge else "upper"}, "window_right": {"upper"},
                "window_block": {"lower", "band" if merge else "upper"}}
    assert expected.get(kind, {"lower"}) <= structures
    evaluated = []
    real_tile = type(mask).tile
    monkeypatch.setattr(type(mask), "tile", lambda self, *a: evaluated.append(1) or real_tile(self, *a))
    out, lse, grads = _run(q, k, v, mask, 0.3, options=options)
    if path.fused_tiles and seq % 16 == 0 and kind != "window_right":
        assert evaluated == []
    again = _run(q, k, v, mask, 0.3, options=options)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, again[2]))
    _assert_like_truth((out, lse, grads), q, k, v, allowed, None, 0.3, dtype)


def test_backward_can_keep_the_accumulation_dtype(gen):
    """``accumulate=True`` hands back fp32 gradients for bf16 inputs (ring attention sums the
    parts of every step, then rounds once); the default rounds them to the input dtype."""
    q, k, v = _inputs(gen, torch.bfloat16, batch=1, heads_q=2, heads_kv=1, tq=40, tk=40)
    mask, scale = ak.causal(), 0.25
    space = MaskSpace(1, 2, 40, 40)
    plan = make_plan(mask, space, batch=1, heads=2, q_offset=0, q_count=40, kv_offset=0,
                     kv_count=40, block_q=16, block_k=16)
    problem = tiled.Problem(mask, scale, space, 0, 0, plan)
    out, lse = tiled.tiled_forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    kept = tiled.tiled_backward(q, k, v, out, lse, dout, None, problem, accumulate=True)
    rounded = tiled.tiled_backward(q, k, v, out, lse, dout, None, problem)
    for full, low in zip(kept, rounded):
        assert full.dtype == torch.float32 and low.dtype == torch.bfloat16
        assert torch.equal(full.to(torch.bfloat16), low)
        assert not torch.equal(full, low.float())  # the kept bits are really there


@pytest.mark.parametrize("heads", [(3, 3), (4, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "token_major"])
@pytest.mark.parametrize("kind", ["window", "documents"])
def test_runs_of_blocks_match_block_by_block(kind, layout, heads, gen, monkeypatch):
    """Evenly spaced query blocks with the same relative structure run as one strided kernel
    call (``Plan.runs``); dK/dV of overlapping key windows are added in non-overlapping sets.
    out, LSE and dQ equal the block-by-block execution bit for bit (dK/dV sum the blocks in
    another order), all within the 2x rule; inputs whose batch and head dimensions do not
    merge ([B, T, H, D] storage, B > 1) fall back to block by block. With GQA a run executes
    once per query head of a K/V head (out and LSE then equal block-by-block up to rounding:
    block by block, GQA blocks run as additive staircases, not strips)."""
    seq = 96
    mask = (ak.sliding_window(24) if kind == "window"
            else ak.documents(torch.arange(seq) // 32) & ak.causal())
    space = MaskSpace(2, heads[0], seq, seq)
    plan = make_plan(mask, space, batch=2, heads=heads[0], q_offset=0, q_count=seq, kv_offset=0,
                     kv_count=seq, fused=True, **BLOCKS)
    assert plan.runs and all(count >= 2 for _, _, count in plan.runs)
    q, k, v = _inputs(gen, torch.float32, batch=2, heads_q=heads[0], heads_kv=heads[1], tq=seq,
                      tk=seq)
    if layout == "token_major":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    runs_executed = []
    real_run_work = tiled._RunWork
    monkeypatch.setattr(tiled.forward, "_RunWork",
                        lambda *a: runs_executed.append(a) or real_run_work(*a))
    results = {}
    for batched in (True, False):
        results[batched] = _run(q, k, v, mask, 0.3, options=TiledOptions(batch_runs=batched))
    assert bool(runs_executed) == (layout == "contiguous")
    (out, lse, grads), (out_b, lse_b, grads_b) = results[True], results[False]
    if heads[0] == heads[1]:
        assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
        assert torch.equal(grads[0], grads_b[0])
    else:
        torch.testing.assert_close(out, out_b, atol=1e-6, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(grads, _run(q, k, v, mask, 0.3)[2]))  # reruns
    _assert_like_truth((out, lse, grads), q, k, v, mask.to_dense(space), None, 0.3, torch.float32)


@pytest.mark.parametrize("kind", ["causal", "causal&padding", "bottom_right"])
def test_shared_prefix_groups(path, kind, gen):
    """Consecutive query blocks that start with the same FULL keys run those as one call over
    all their rows, then each block's remaining keys merge into it (``fresh=False``): forward
    and backward within the 2x rule, with fully masked rows and ragged tails, and equal to
    block-by-block execution up to rounding."""
    tq, tk = 133, 150
    mask, allowed = {
        "causal": (ak.causal(), dense_band(tq, tk, None, 0)),
        "causal&padding": (ak.causal() & ak.padding(q_lengths=[120, 120], kv_lengths=[140, 140]),
                           dense_band(tq, tk, None, 0) & dense_padding(tq, tk, [120, 120], [140, 140], batch=2)),
        "bottom_right": (ak.causal("bottom_right"), dense_band(tq, tk, None, 0, "bottom_right")),
    }[kind]
    plan = make_plan(mask, MaskSpace(2, 3, tq, tk), batch=2, heads=3, q_offset=0, q_count=tq,
                     kv_offset=0, kv_count=tk, fused=path.fused_tiles, options=path, **BLOCKS)
    groups = list(plan.groups(tq, shared_prefix=True))
    if path.fused_tiles:
        assert any(not g.fresh for g in groups) and any(g.rows[1] - g.rows[0] > 16 for g in groups)
    q, k, v = _inputs(gen, torch.float32, batch=2, heads_q=3, heads_kv=3, tq=tq, tk=tk)
    shared = _run(q, k, v, mask, 0.3, options=path)
    unshared = dataclasses.replace(path, prefix_blocks=0)
    assert all(g.fresh for g in dataclasses.replace(plan, options=unshared).groups(
        tq, shared_prefix=True))
    (out, lse, grads), (out_b, _, grads_b) = shared, _run(q, k, v, mask, 0.3, options=unshared)
    torch.testing.assert_close(out, out_b, atol=1e-6, rtol=1e-5)
    for g, g_b in zip(grads, grads_b):
        torch.testing.assert_close(g, g_b, atol=1e-5, rtol=1e-5)
    _assert_like_truth((out, lse, grads), q, k, v, allowed, None, 0.3, torch.float32)


@settings(max_examples=30, deadline=None)
@example(seed=2917, kind="documents", seq=124, param=32, heads=(3, 1), batch=1, strip=4)  # dq: Δ form
@given(seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(["window", "band", "documents", "equal_documents", "causal"]),
       seq=st.integers(33, 140), param=st.one_of(st.sampled_from([8, 16, 24, 32, 48]),
                                                 st.integers(3, 60)),
       heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]), batch=st.integers(1, 2),
       strip=st.sampled_from([4, 5, 64]))
def test_runs_and_prefixes_on_random_structures(seed, kind, seq, param, heads, batch, strip):
    """Runs (equal relative structure, any spacing), shared prefixes and staircase strips on
    random windows, bands, documents of equal and unequal lengths and causal masks, with GQA,
    batches and ragged tails (16×8 blocks): forward and backward within the 2x rule of the
    float64 truth."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "window":
        mask, allowed = ak.sliding_window(param), dense_band(seq, seq, param, 0)
    elif kind == "band":
        mask, allowed = ak.sliding_window(param, param // 3), dense_band(seq, seq, param, param // 3)
    elif kind == "causal":
        mask, allowed = ak.causal(), dense_band(seq, seq, None, 0)
    else:
        ids = (torch.arange(seq) // param if kind == "equal_documents"
               else torch.randint(0, max(2, seq // param), (seq,), generator=gen).sort().values)
        mask, allowed = ak.documents(ids) & ak.causal(), dense_documents(ids) & dense_band(seq, seq, None, 0)
    q, k, v = _inputs(gen, torch.float32, batch=batch, heads_q=heads[0], heads_kv=heads[1], tq=seq,
                      tk=seq)
    out, lse, grads = _run(q, k, v, mask, 0.3, options=TiledOptions(triangle_strip=strip))
    _assert_like_truth((out, lse, grads), q, k, v, allowed, None, 0.3, torch.float32)


@pytest.mark.parametrize("count, step, width", [(7, 16, 40), (5, 16, 16), (3, 8, 5), (4, 10, 31)])
def test_run_adds_never_write_overlapping_windows(count, step, width, monkeypatch):
    """``_RunWork.add`` adds each block's key window into dK/dV. Windows wider than the step
    overlap, and an in-place add through an overlapping view may lose updates across threads,
    so every view it adds through must hold disjoint windows; together they cover each block's
    window once, and the sums equal adding block by block."""
    views = []
    real_view = tiled._run_view
    monkeypatch.setattr(tiled.tiles, "_run_view", lambda x, start, every, n, w, *a: views.append(
        (start, every, n, w)) or real_view(x, start, every, n, w, *a))
    start = 5
    dest = torch.zeros(2, 3, start + (count - 1) * step + width, 4, dtype=torch.float64)
    value = torch.randn(count, 6, width, 4, dtype=torch.float64)  # [count, B·H, width, D]
    tiled._RunWork(step, count, heads_q=3).add(dest, start, start + width, value)
    expected = torch.zeros_like(dest)
    for j in range(count):
        expected[:, :, start + j * step:start + j * step + width] += value[j].view(2, 3, width, 4)
    torch.testing.assert_close(dest, expected, rtol=0, atol=1e-12)
    assert all(every >= w for _, every, _, w in views)
    firsts = sorted(s + every * i for s, every, n, _ in views for i in range(n))
    assert firsts == [start + j * step for j in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["documents", "cross", "causal", "padding", "bias"])
def test_pieces_of_packed_documents(kind, dtype, gen):
    """Partial tiles of packed documents run as pieces, each document's rows over its own keys
    (rows without a key in the tile as pieces of their own): forward and backward equal the
    float64 truth, the plan holds pieces (and a piece without keys where a document has no
    key in a tile)."""
    tq = tk = 70
    q, k, v = _inputs(gen, dtype, batch=2, heads_q=2, heads_kv=2, tq=tq, tk=tk)
    q_ids = torch.tensor([0] * 9 + [1] * 20 + [2] * 3 + [3] * 30 + [4] * 8)
    kv_ids = torch.tensor([0] * 9 + [1] * 26 + [3] * 27 + [5] * 8) if kind == "cross" else None
    mask = ak.documents(q_ids, kv_ids)
    allowed = dense_documents(q_ids, kv_ids)
    bias = None
    if kind == "causal":
        mask = ak.documents(q_ids, causal="top_left")
        allowed = allowed & torch.ones(tq, tk, dtype=torch.bool).tril()
    elif kind == "padding":
        lengths = torch.tensor([70, 40])
        mask = mask & ak.padding(q_lengths=lengths, kv_lengths=lengths)
        allowed = allowed & dense_padding(tq, tk, lengths, lengths, batch=2)
    elif kind == "bias":
        bias = torch.randn(tq, tk, generator=gen, dtype=torch.float64)
        mask = mask & ak.bias(bias.to(dtype))
    result = _run(q, k, v, mask, 0.3, block_q=32, block_k=8)
    pieces = [s.pieces for row in result[0].grad_fn.problem.plan.rows for s in row if s.pieces]
    assert pieces
    if kind == "cross":  # document 2's queries have no key
        assert any(k0 == k1 for p in pieces for _, _, k0, k1 in p)
    _assert_like_truth(result, q, k, v, allowed, bias, 0.3, dtype)


@pytest.mark.parametrize("mask", [ak.causal(), ak.sliding_window(2),
                                  ak.padding(kv_lengths=torch.tensor([5, 7]))])
def test_overlapping_keys_and_values_get_their_gradients(mask, gen):
    """K and V whose rows overlap in memory (as ``unfold`` or ``as_strided`` make them): an
    elementwise op on them (the zeroing of keys no query sees) returns a tensor whose last dim
    is strided, which torch's fused CPU backward reads as if it were not."""
    base = torch.randn(300, generator=gen)
    q = torch.randn(2, 4, 6, 8, generator=gen).requires_grad_()
    k = base.as_strided((2, 4, 7, 8), (3, 5, 1, 1)).detach().requires_grad_()
    v = base.as_strided((2, 4, 7, 8), (7, 11, 2, 1)).detach().requires_grad_()
    weight = torch.randn(2, 4, 6, 8, generator=gen)
    out = ak.attention(q, k, v, mask=mask, backend="tiled")
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    truth = ak.attention(*leaves, mask=mask, backend="reference")
    expected = torch.autograd.grad((truth * weight.double()).sum(), leaves)
    torch.testing.assert_close(out.double(), truth, rtol=0, atol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
