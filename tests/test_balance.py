"""The balanced layout of ring attention (attnkit.distributed.balance): the plan is a
permutation with equal shards, its work model counts what the block map counts, it balances
packed documents where zigzag does not, and ring_attention over it is exact (multi-process
gloo against single-process ``attention`` on the whole sequence: float64 on the tiled engine,
float32 on the triton kernels through the Triton interpreter).

Ring cases follow tests/test_ring.py: each world size is started once (``spawn``), one worker
runs every case and records each case's failed assertion, and the pytest test of the case
re-raises it.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.bench.workloads import packed_ids
from attnkit.distributed import (BalancedLayout, balance_blocks, default_block, plan_balance,
                                 rank_work, ring_attention, shard, tile_work, unshard)
from attnkit.masks import MaskSpace
from conftest import spawned_once


def _dense_tile_work(mask, space: MaskSpace, tile: int) -> torch.Tensor:
    """The work of each row of tiles counted from the element mask: tiles with any allowed
    element, summed over batch elements and heads ([T/tile])."""
    allowed = mask.to_dense(space).expand(space.batch, space.heads, space.q_len, space.kv_len)
    tiles = allowed.reshape(space.batch, space.heads, space.q_len // tile, tile,
                            space.kv_len // tile, tile).any(5).any(3)  # [B, H, nq, nk]
    return tiles.sum((0, 1, 3))


def _masks(length: int) -> dict:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 6, (length,), generator=gen).sort().values
    kv_ids = torch.randint(0, 6, (length,), generator=gen).sort().values
    return {
        "documents_causal": ak.documents(ids, causal="top_left"),
        "documents_bottom_right": ak.documents(ids, kv_ids, causal="bottom_right"),
        "window": ak.sliding_window(left=13, right=3),
        "causal": ak.causal(),
    }


# ---- the cost model ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(_masks(96)))
@pytest.mark.parametrize("tile", (4, 8, 16))
def test_tile_work_counts_the_tiles_the_element_mask_touches(name, tile):
    """tile_work (from the block map) equals a count of tiles with any allowed element made
    from the dense element mask."""
    mask = _masks(96)[name]
    space = MaskSpace(1, 1, 96, 96)
    assert torch.equal(tile_work(mask, 96, tile), _dense_tile_work(mask, space, tile))


def test_tile_work_sums_over_batch_and_heads():
    """Per-batch padding lengths: each batch element's tiles count; heads multiply."""
    mask = ak.padding(kv_lengths=[32, 9]) & ak.causal()
    space = MaskSpace(2, 3, 32, 32)
    work = tile_work(mask, space, 8)
    assert torch.equal(work, _dense_tile_work(mask, space, 8))
    assert work.tolist() == [3 * (1 + 1), 3 * (2 + 2), 3 * (3 + 2), 3 * (4 + 2)]
    assert torch.equal(tile_work(None, 32, 8), torch.full((4,), 4))


def test_default_block_gives_each_rank_whole_blocks():
    """At least BLOCKS_PER_RANK (8) blocks per rank where the tiles of a rank allow it."""
    assert default_block(1 << 20, 8, 128) == 16384  # 1024 tiles per rank: 8 blocks of 128
    assert default_block(192 * 8, 2, 8) == 8 * 12  # 96 tiles per rank: 8 blocks of 12
    assert default_block(24 * 8 * 3, 3, 8) == 8 * 3  # 24 tiles: 8 blocks of 3
    assert default_block(13 * 8 * 2, 2, 8) == 8  # 13 tiles (prime): 13 blocks of 1
    assert default_block(192, 3, 8) == 8  # 8 tiles: 8 blocks of 1


# ---- the plan ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(_masks(192)))
@pytest.mark.parametrize("world, block", [(1, 24), (2, 8), (2, 16), (3, 8), (4, 24), (4, None)])
def test_plan_is_a_permutation_of_equal_shards(name, world, block):
    mask, length, tile = _masks(192)[name], 192, 8
    layout = plan_balance(mask, length, world, tile=tile, block=block)
    block = block or default_block(length, world, tile)
    assert layout.block == block
    assert isinstance(layout, BalancedLayout)
    assert torch.equal(layout.permutation.sort().values, torch.arange(length))
    assert torch.equal(layout.permutation[layout.inverse], torch.arange(length))
    assert torch.equal(layout.assignment.bincount(minlength=world),
                       torch.full((world,), length // block // world))
    for rank in range(world):
        runs = layout.pieces(rank)
        assert sum(run.count for run in runs) == length // world
        assert [run.start for run in runs] == [sum(r.count for r in runs[:i])
                                               for i in range(len(runs))]
        # maximal runs: never two that could have been one, in increasing position
        assert all(a.global_start + a.count < b.global_start for a, b in zip(runs, runs[1:]))
        expected = torch.cat([torch.arange(r.global_start, r.global_start + r.count) for r in runs])
        assert torch.equal(layout.positions(rank), expected)
        blocks = torch.nonzero(layout.assignment == rank).flatten()
        assert int(layout.work[rank]) == int(layout.block_work[blocks].sum())
    per_block = tile_work(mask, length, tile).view(-1, block // tile).sum(1)
    assert torch.equal(layout.block_work, per_block)
    assert torch.equal(rank_work(mask, length, layout, world, tile), layout.work)


def test_plan_balances_causal_work_exactly_where_it_can():
    """Causal, 8 blocks of 1 position, 2 ranks: block works 1..8 sum to 36, 18 each."""
    layout = plan_balance(ak.causal(), 8, 2, tile=1, block=1)
    assert layout.block_work.tolist() == list(range(1, 9))
    assert layout.work.tolist() == [18, 18] and layout.imbalance == 1.0


def test_swaps_improve_on_the_greedy_plan():
    """Works 17, 13, 10, 6, 6, 1 on 2 ranks of 3 blocks. The greedy pass gives rank 0 17, 6, 6
    (29) and rank 1 13, 10, 1 (24); swapping 17 with 13 moves 4 and gives 25 and 28, the best
    split (28 ≥ 53 / 2, and 27 cannot be made from three of these works)."""
    layout = balance_blocks(torch.tensor([17, 13, 10, 6, 6, 1]), 2, 1)
    assert sorted(layout.work.tolist()) == [25, 28]
    assert layout.assignment.tolist() == [1, 0, 1, 0, 0, 1]


def test_plan_is_deterministic():
    mask = ak.documents(packed_ids(4096, 16, 1024, 128, 1.2, seed=3), causal="top_left")
    first, second = plan_balance(mask, 4096, 8, tile=16), plan_balance(mask, 4096, 8, tile=16)
    assert torch.equal(first.permutation, second.permutation)
    assert first.digest() == second.digest() and repr(first) == repr(second)


def test_shard_unshard_round_trip_and_positions():
    mask = ak.documents(packed_ids(768, 8, 256, 48, 1.0, seed=1), causal="top_left")
    layout = plan_balance(mask, 768, 4, tile=16)
    x = torch.randn(2, 3, 768, 5, dtype=torch.float64, requires_grad=True)
    parts = [shard(x, rank, 4, layout) for rank in range(4)]
    assert all(p.shape == (2, 3, 192, 5) for p in parts)
    assert torch.equal(unshard(parts, layout), x)
    positions = torch.arange(768)
    for rank in range(4):
        assert torch.equal(shard(positions[:, None], rank, 4, layout)[:, 0], layout.positions(rank))
        assert torch.equal(parts[rank], x[:, :, layout.positions(rank)])
    ids = torch.arange(768)[None].expand(2, 768)  # another dim, another layout of that dim
    assert torch.equal(unshard([shard(ids, r, 4, layout, dim=1) for r in range(4)], layout, dim=1),
                       ids)
    unshard(parts, layout).sum().backward()  # differentiable, each position once
    assert torch.equal(x.grad, torch.ones_like(x))


# ---- balance on packed documents --------------------------------------------------------------

PACKED_LENGTH, PACKED_TILE = 65536, 64


@pytest.fixture(scope="module")
def packed():
    """Packed documents of log-normal lengths (median 1024, σ 1.2, clipped to [64, 8192]),
    causal inside each."""
    return ak.documents(packed_ids(PACKED_LENGTH, 64, 8192, 1024, 1.2, seed=0), causal="top_left")


@pytest.mark.parametrize("world", (8, 16, 32, 64))
def test_packed_documents_are_balanced_where_zigzag_is_not(packed, world):
    """max/mean work ≤ 1.05 for the balanced layout (default blocks: 8 or more per rank);
    zigzag's, counted by the same model on the same batch, is far above (the figure can tell
    a bad plan)."""
    layout = plan_balance(packed, PACKED_LENGTH, world, tile=PACKED_TILE)
    assert layout.length // layout.block // world >= 8
    assert layout.imbalance <= 1.05, (world, layout.work.tolist())
    zigzag = rank_work(packed, PACKED_LENGTH, "zigzag", world, PACKED_TILE)
    assert int(zigzag.sum()) == int(layout.work.sum())  # chunks are whole tiles: the same tiles
    assert float(zigzag.max()) * world / float(zigzag.sum()) > 1.5, zigzag.tolist()
    assert torch.equal(rank_work(packed, PACKED_LENGTH, layout, world, PACKED_TILE), layout.work)


# ---- bad input --------------------------------------------------------------------------------

def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="multiple of tile × world_size = 8 × 4"):
        plan_balance(ak.causal(), 48, 4, tile=8)
    with pytest.raises(ValueError, match="self-attention"):
        plan_balance(ak.causal(), MaskSpace(1, 1, 32, 64), 2, tile=8)
    with pytest.raises(TypeError, match="MaskSpace"):
        plan_balance(ak.causal(), 32.0, 2, tile=8)
    with pytest.raises(ValueError, match="world_size=0"):
        plan_balance(ak.causal(), 32, 0, tile=8)
    with pytest.raises(ValueError, match="tile=0"):
        plan_balance(ak.causal(), 32, 2, tile=0)
    with pytest.raises(ValueError, match="block=12 must be a multiple of tile=8"):
        plan_balance(ak.causal(), 64, 2, tile=8, block=12)
    with pytest.raises(ValueError, match="block=24 must be a multiple of tile=8 that divides"):
        plan_balance(ak.causal(), 64, 2, tile=8, block=24)
    with pytest.raises(ValueError, match="does not fit"):
        plan_balance(ak.documents(torch.zeros(16, dtype=torch.long)), 32, 2, tile=8)
    with pytest.raises(TypeError, match="integer tensor"):
        balance_blocks(torch.ones(4), 2, 8)
    with pytest.raises(ValueError, match="do not split into 3 equal shards"):
        balance_blocks(torch.ones(4, dtype=torch.long), 3, 8)
    layout = plan_balance(ak.causal(), 64, 2, tile=8)
    with pytest.raises(ValueError, match="planned for world_size=2 and length 64"):
        shard(torch.zeros(64, 4), 0, 4, layout)
    with pytest.raises(ValueError, match="planned for world_size=2 and length 64"):
        shard(torch.zeros(128, 4), 0, 2, layout)
    with pytest.raises(ValueError, match=r"plan_balance\(mask, 96, 3"):
        unshard([torch.zeros(32, 4)] * 3, layout)
    with pytest.raises(ValueError, match="rank=2"):
        layout.positions(2)
    with pytest.raises(ValueError, match="BalancedLayout"):
        shard(torch.zeros(64, 4), 0, 2, "striped")


# ---- exactness of ring attention over a balanced layout ---------------------------------------

RING_LENGTH, RING_TILE = 192, 8  # 24 blocks of one tile: 12 per rank at P = 2, 8 at P = 3
BLOCK_Q, BLOCK_K = 8, 4  # the tiled engine's tiles inside a step


def _ring_case(name: str, rank: int, world: int) -> None:
    """One mask on this rank: out, lse, dq, dk, dv of the ring over the balanced layout equal
    the rows of the whole-sequence float64 reference (1e-9)."""
    mask = _masks(RING_LENGTH)[name]
    layout = plan_balance(mask, RING_LENGTH, world, tile=RING_TILE)
    assert layout.block == RING_TILE
    contiguous = torch.arange(RING_LENGTH).view(world, -1)[rank]
    assert not torch.equal(layout.positions(rank), contiguous), "the plan is the contiguous one"
    gen = torch.Generator().manual_seed(world * 100 + len(name))
    shape = (1, 2, RING_LENGTH, 8)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    truth = ak.attention(*whole, mask, backend="reference", return_lse=True)
    (truth.out * grad).sum().backward()
    local = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    result = ring_attention(*local, mask, layout=layout, return_lse=True, block_q=BLOCK_Q,
                            block_k=BLOCK_K, backend="tiled")
    (result.out * shard(grad, rank, world, layout)).sum().backward()
    pairs = dict(out=(result.out, truth.out), lse=(result.lse, truth.lse),
                 dq=(local[0].grad, whole[0].grad), dk=(local[1].grad, whole[1].grad),
                 dv=(local[2].grad, whole[2].grad))
    for what, (actual, expected) in pairs.items():
        expected = shard(expected, rank, world, layout, dim=-1 if what == "lse" else -2)
        assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(actual)), what
        err = float((actual - expected)[finite].abs().max())
        assert err <= 1e-9, f"rank {rank}: {what} error {err:.3g}"


def _plain_float32(q, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch math in float32 on the whole sequence (every row has a key here):
    ``(out, lse)``, differentiable; the yardstick of the float32 error bound."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    allowed = mask.to_dense(MaskSpace(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _triton_case(name: str, rank: int, world: int) -> None:
    """One mask with the steps on the triton kernels (interpreted), float32: every shard's
    out, lse, dq, dk, dv within 2 × the error of plain float32 math + 8 ulps of the largest
    value, against the float64 reference (tests/conftest.py's rule)."""
    mask = _masks(RING_LENGTH)[name]
    layout = plan_balance(mask, RING_LENGTH, world, tile=RING_TILE)
    gen = torch.Generator().manual_seed(world * 10 + len(name))
    shape = (1, 2, RING_LENGTH, 16)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    results = {}
    for dtype in (torch.float64, torch.float32):  # the truth, then plain float32 math
        whole = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        if dtype == torch.float64:
            found = ak.attention(*whole, mask, backend="reference", return_lse=True)
            out, lse = found.out, found.lse
        else:
            out, lse = _plain_float32(*whole, mask)
        (out * grad.to(dtype)).sum().backward()
        results[dtype] = dict(out=out, lse=lse, dq=whole[0].grad, dk=whole[1].grad,
                              dv=whole[2].grad)
    local = [shard(t, rank, world, layout).float().requires_grad_() for t in (q, k, v)]
    ring = ring_attention(*local, mask, layout=layout, return_lse=True, backend="triton")
    (ring.out * shard(grad, rank, world, layout).float()).sum().backward()
    actual = dict(out=ring.out, lse=ring.lse, dq=local[0].grad, dk=local[1].grad,
                  dv=local[2].grad)
    for what, value in actual.items():
        dim = -1 if what == "lse" else -2
        truth, plain = (shard(results[d][what], rank, world, layout, dim=dim).double()
                        for d in (torch.float64, torch.float32))
        floor = 8 * torch.finfo(torch.float32).eps * max(1.0, float(truth.abs().max()))
        bound = 2 * float((plain - truth).abs().max()) + floor
        err = float((value.double() - truth).abs().max())
        assert err <= bound, f"rank {rank}: {what} error {err:.3g} > {bound:.3g}"


def _triton_worker(rank: int, world: int) -> dict:
    """The triton cases (``TRITON_INTERPRET=1`` is set before triton is imported here)."""
    torch.set_num_threads(1)
    failures = {}
    for name in TRITON_MASKS:
        try:
            _triton_case(name, rank, world)
            failures[name] = None
        except AssertionError as error:
            failures[name] = str(error) or "assertion failed"
    return failures


TRITON_MASKS = ("documents_causal", "window")


def _wrong_layout(rank: int, world: int) -> str:
    """ring_attention with a layout planned for another world size: the ValueError's text
    (the same on every rank, before any transfer)."""
    layout = plan_balance(ak.causal(), RING_LENGTH, world + 1, tile=RING_TILE)
    q = torch.randn(1, 1, RING_LENGTH // world, 4)
    try:
        ring_attention(q, q, q, ak.causal(), layout=layout)
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    failures = {}
    for name in _masks(RING_LENGTH):
        try:
            _ring_case(name, rank, world)
            failures[name] = None
        except AssertionError as error:
            failures[name] = str(error) or "assertion failed"
    return dict(failures=failures, wrong_layout=_wrong_layout(rank, world))


def run_world(world: int) -> list[dict]:
    """Every rank's results for ``world`` processes (started once per test run)."""
    return spawned_once(_worker, world)


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", list(_masks(RING_LENGTH)))
def test_ring_over_balanced_layout_matches_single_process(world, name):
    """Forward (out, lse) and backward (dq, dk, dv) in float64 against ``attention``."""
    problems = [f"rank {rank}: {run['failures'][name]}"
                for rank, run in enumerate(run_world(world)) if run["failures"][name]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", TRITON_MASKS)
def test_ring_over_balanced_layout_on_triton_steps(name):
    """Steps on the fused triton kernels (Triton interpreter, 2 ranks, float32): each pair's
    window of the mask at the runs' offsets, forward and backward."""
    pytest.importorskip("triton")
    runs = spawned_once(_triton_worker, 2, env={"TRITON_INTERPRET": "1"})
    problems = [f"rank {rank}: {failures[name]}"
                for rank, failures in enumerate(runs) if failures[name]]
    assert not problems, "\n".join(problems)



@pytest.mark.parametrize("world", (2, 3))
def test_ring_refuses_a_layout_of_another_world_size_on_every_rank(world):
    for rank, run in enumerate(run_world(world)):
        assert f"planned for world_size={world + 1}" in run["wrong_layout"], (rank, run)
