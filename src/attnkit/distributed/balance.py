"""A load-balancing planner for the sequence layout of ring attention, for any mask.

    from attnkit.distributed import plan_balance, ring_attention, shard

    layout = plan_balance(mask, T, world_size)                 # data; the same on every rank
    q_local = shard(q, rank, world_size, layout=layout)   # [..., H, T/P, D]  (k, v alike)
    positions = layout.positions(rank)                    # [T/P] global positions (RoPE)
    out_local = ring_attention(q_local, k_local, v_local, mask, layout=layout)

Cost model. In a ring every rank computes its own queries against every key of the sequence
(the keys come to it one shard per step). The sequence is cut into tiles ``tile × tile``; the
work of a row of tiles (``tile`` queries) is the number of its tiles against the whole key
sequence that the mask's block map does not mark EMPTY, summed over the batch elements and
heads (:func:`tile_work`). A query block is ``block / tile`` adjacent rows of tiles and its work
their sum; a rank's work is the sum over its query blocks. Tiles are counted on the global key
grid; a ring step's engine cuts the keys it holds at its own offsets, which can count a tile
cut by a shard boundary twice.

The planner gives every rank the same number of query blocks (the ring needs shards of equal
length) and nearly the same work: longest-processing-time greedy (blocks by falling work, each
to the least loaded rank that still has room), then pairwise swaps between the most loaded rank
and the others while a swap lowers the larger of the two loads. Ties go to the lower block
index and the lower rank: the plan depends on nothing but the mask, the space, ``world_size``,
``tile`` and ``block``, so every rank computes the same one.

The block size trades balance against the ring's per-step calls: a rank holds at most
``T / (P · block)`` runs, and each ring step computes one pair per (query run × key run) that
the mask does not empty. The default gives every rank :data:`BLOCKS_PER_RANK` blocks when
``T / P`` allows it.

Not balanced: the work of one ring step. A rank's total is even, but at step ``i`` it meets the
keys of rank ``r − i`` only, and two ranks' work against one key shard can differ; the ranks
wait for each other at every step's transfer, so per-step skew still costs time.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..masks import EMPTY, Mask, MaskSpace, as_mask
from ..modifiers import split

DEFAULT_TILE = 128
"""Positions per side of the cost model's tiles when ``tile`` is not given."""

BLOCKS_PER_RANK = 8
"""Query blocks per rank that the default ``block`` aims at (see :func:`default_block`)."""

TILE_ROWS_PER_CALL = 256
"""Rows of tiles whose block map is built at once (bounds the planner's memory to
``TILE_ROWS_PER_CALL × T/tile`` codes per mask row)."""


@dataclass(frozen=True)
class Piece:
    """One contiguous run of a rank's shard: local rows ``[start, start+count)`` are the global
    positions ``[global_start, global_start+count)``."""

    start: int
    global_start: int
    count: int

    @property
    def rows(self) -> slice:
        """The local rows of this run, as a slice of dim -2 of the shard."""
        return slice(self.start, self.start + self.count)


@dataclass(frozen=True, eq=False)
class BalancedLayout:
    """Which global positions each rank holds: the result of :func:`plan_balance`, passed as
    ``layout=`` to :func:`~attnkit.distributed.shard`, :func:`~attnkit.distributed.unshard`
    and :func:`~attnkit.distributed.ring_attention`. Self-attention lengths only (queries and
    keys are cut the same way, so ``Tq = Tk = length``).

    Fields (P = ``world_size``, T = ``length``, n = ``T / block`` query blocks):

    - ``world_size``, ``length``, ``block``: ints; every rank holds ``T / P`` positions,
      ``n / P`` whole blocks.
    - ``runs``: P tuples of :class:`Piece`: rank r's shard is the concatenation of its runs,
      each a maximal run of adjacent blocks, in increasing global position.
    - ``permutation``: LongTensor ``[T]``: row i of the shards concatenated in rank order is
      global position ``permutation[i]`` (rank r holds rows ``r·T/P … (r+1)·T/P − 1``).
    - ``inverse``: LongTensor ``[T]``: global position j is row ``inverse[j]`` of that
      concatenation (``permutation[inverse] == arange(T)``).
    - ``assignment``: LongTensor ``[n]``: the rank that holds each query block.
    - ``block_work``: LongTensor ``[n]``: each query block's work (the module's cost model, or
      whatever costs :func:`balance_blocks` was given).
    - ``work``: LongTensor ``[P]``: each rank's work, the sum of its blocks' ``block_work``.
    """

    world_size: int
    length: int
    block: int
    runs: tuple
    permutation: torch.Tensor
    inverse: torch.Tensor
    assignment: torch.Tensor
    block_work: torch.Tensor
    work: torch.Tensor

    @property
    def local_length(self) -> int:
        """Positions on every rank: ``length / world_size``."""
        return self.length // self.world_size

    @property
    def imbalance(self) -> float:
        """The largest rank's work over the mean work (1.0 is perfect balance; 1.0 when the
        mask leaves no work at all)."""
        total = int(self.work.sum())
        return float(self.work.max()) * self.world_size / total if total else 1.0

    def pieces(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s runs of global positions (see :class:`Piece`), in local row order."""
        self._check_rank(rank)
        return list(self.runs[rank])

    def positions(self, rank: int) -> torch.Tensor:
        """LongTensor ``[T/P]``: the global position of each row of rank ``rank``'s shard (for
        position encodings such as RoPE: rotate row i by ``positions(rank)[i]``)."""
        self._check_rank(rank)
        return self.permutation[rank * self.local_length:(rank + 1) * self.local_length].clone()

    def digest(self) -> str:
        """A short hex digest of the permutation: two layouts with the same digest, world size,
        length and block hold the same positions on every rank."""
        data = self.permutation.numpy().astype(np.int64).tobytes()
        return hashlib.sha256(data).hexdigest()[:16]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: must be an int in [0, {self.world_size}) for this "
                             f"layout of world_size={self.world_size}")

    def __repr__(self) -> str:
        return (f"BalancedLayout(world_size={self.world_size}, length={self.length}, "
                f"block={self.block}, imbalance={self.imbalance:.4f}, digest={self.digest()})")


# ---- the cost model ---------------------------------------------------------------------------

def _space(space: Union[MaskSpace, int]) -> MaskSpace:
    """``space`` as a :class:`MaskSpace`; an int T is self-attention ``[1, 1, T, T]``."""
    if isinstance(space, MaskSpace):
        return space
    if isinstance(space, bool) or not isinstance(space, int) or space < 1:
        raise TypeError(f"space={space!r}: pass the sequence length T (a positive int) or a "
                        f"attnkit.masks.MaskSpace(batch, heads, T, T)")
    return MaskSpace(1, 1, space, space)


def _mask_alone(mask) -> Optional[Mask]:
    """The mask part of ``mask`` (a :class:`Mask`, a tensor, or ``None``); score modifiers
    change no tile's emptiness and are dropped."""
    return split(as_mask(mask))[0]


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive int (the number of "
                         f"ranks of the ring)")


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: use a positive int of positions (a tile: e.g. the "
                         f"ring engine's tile size, {DEFAULT_TILE}; a block: a multiple of the "
                         f"tile)")


def _tiles(mask: Optional[Mask], space: MaskSpace, start: int, count: int, tile: int,
           ) -> torch.Tensor:
    """LongTensor ``[ceil(count/tile)]``: the non-EMPTY tiles of each row of tiles of the
    positions ``[start, start+count)`` (rows cut from ``start``) against the tiles of the whole
    key sequence, summed over the batch elements and heads of ``space``."""
    key_tiles = math.ceil(space.kv_len / tile)
    rows = space.batch * space.heads
    if mask is None:
        return torch.full((math.ceil(count / tile),), key_tiles * rows, dtype=torch.long)
    parts = []
    for first in range(start, start + count, TILE_ROWS_PER_CALL * tile):
        size = min(TILE_ROWS_PER_CALL * tile, start + count - first)
        codes = mask.block_map(tile, tile, space, q_offset=first, q_count=size)  # [Bm, Hm, nq, nk]
        spread = rows // (codes.shape[0] * codes.shape[1])  # broadcast rows count once each
        parts.append((codes != EMPTY).sum(dim=(0, 1, 3)).cpu().long() * spread)
    return torch.cat(parts)


def _checked(mask, space: Union[MaskSpace, int], tile: int) -> tuple[Optional[Mask], MaskSpace]:
    """The mask alone and the space, after checking that they fit each other."""
    _check_size("tile", tile)
    space = _space(space)
    fitted = _mask_alone(mask)
    if fitted is not None:
        problems = fitted.check(space)
        if problems:
            raise ValueError(f"mask {fitted!r} does not fit the space [B={space.batch}, "
                             f"H={space.heads}, Tq={space.q_len}, Tk={space.kv_len}]: "
                             + "; ".join(problems) + ". Pass the space of the whole sequence "
                             "(attnkit.masks.MaskSpace with the batch and lengths the mask "
                             "was built for)")
    return fitted, space


def tile_work(mask, space: Union[MaskSpace, int], tile: int = DEFAULT_TILE) -> torch.Tensor:
    """LongTensor ``[ceil(Tq/tile)]``: the work of each row of tiles under the module's cost
    model: its non-EMPTY tiles ``tile × tile`` against the whole key sequence
    (``mask.block_map(tile, tile, space)``), summed over batch elements and heads.

    ``mask``: the mask of the whole sequence (a :class:`~attnkit.masks.Mask`, a tensor as
    ``attention`` takes it, or ``None``: every tile counts); score modifiers are ignored.
    ``space``: a :class:`~attnkit.masks.MaskSpace` or the sequence length T (batch 1, 1 head).
    """
    fitted, space = _checked(mask, space, tile)
    return _tiles(fitted, space, 0, space.q_len, tile)


def rank_work(mask, space: Union[MaskSpace, int], layout, world_size: int,
              tile: int = DEFAULT_TILE) -> torch.Tensor:
    """LongTensor ``[P]``: each rank's work under the module's cost model for any ``layout``
    (``"contiguous"``, ``"zigzag"`` or a :class:`BalancedLayout`), its rows of tiles cut from
    the start of each of its runs. For a :class:`BalancedLayout` planned with the same mask,
    space and tile this equals ``layout.work``.

    ``space`` as in :func:`tile_work`; the sequence must split as :func:`shard` splits it.
    """
    from .ring import pieces  # ring imports this module

    fitted, space = _checked(mask, space, tile)
    _check_world(world_size)
    parts = world_size * (2 if layout == "zigzag" else 1)
    if isinstance(layout, str) and space.q_len % parts:
        raise ValueError(f"sequence length {space.q_len} does not split into {parts} equal "
                         f"chunks for layout={layout!r}: pad it to a multiple of {parts}")
    local = space.q_len // world_size
    totals = []
    for rank in range(world_size):
        runs = pieces(local, rank, world_size, layout)
        totals.append(sum(int(_tiles(fitted, space, run.global_start, run.count, tile).sum())
                          for run in runs))
    return torch.tensor(totals, dtype=torch.long)


# ---- the planner ------------------------------------------------------------------------------

def _greedy(work: np.ndarray, world_size: int, per_rank: int) -> np.ndarray:
    """Longest processing time first under equal counts: ``[n]`` block works → ``[n]`` ranks.
    Blocks by falling work (ties: lower index first), each to the least loaded rank with room
    (ties: lower rank)."""
    order = np.argsort(-work, kind="stable")
    assignment = np.empty(len(work), dtype=np.int64)
    heap = [(0, rank) for rank in range(world_size)]  # (load, rank) of ranks with room
    counts = [0] * world_size
    for index in order:
        load, rank = heapq.heappop(heap)
        assignment[index] = rank
        counts[rank] += 1
        if counts[rank] < per_rank:
            heapq.heappush(heap, (load + int(work[index]), rank))
    return assignment


def _best_swap(high: np.ndarray, low: np.ndarray, gap: int) -> Optional[tuple[int, int, int]]:
    """The swap of a block of the most loaded rank (works ``high [m]``) with one of a less
    loaded rank (works ``low [m]``, loads ``gap`` apart) that brings the larger of the two new
    loads lowest: ``(index in high, index in low, moved work)``, or ``None`` when no swap
    lowers it (the moved work must lie in ``(0, gap)``)."""
    order = np.argsort(low, kind="stable")
    ranked = low[order]
    near = np.searchsorted(ranked, high - gap / 2)  # the ideal partner has work high − gap/2
    candidates = np.stack([np.clip(near - 1, 0, len(ranked) - 1),
                           np.clip(near, 0, len(ranked) - 1)])  # [2, m]
    moved = high[None, :] - ranked[candidates]  # [2, m]
    worse = np.maximum(-moved, moved - gap)  # the pair's new larger load minus the old larger
    worse = np.where((moved > 0) & (moved < gap), worse, 1)
    best = int(np.argmin(worse))  # first of equals: deterministic
    if worse.flat[best] >= 0:
        return None
    which, at = divmod(best, candidates.shape[1])
    return at, int(order[candidates[which, at]]), int(moved[which, at])


def _swaps(work: np.ndarray, assignment: np.ndarray, world_size: int) -> np.ndarray:
    """Pairwise swaps between the most loaded rank and the others (least loaded first) while
    one lowers the larger of the pair's loads; each swap lowers the sum of squared loads, so
    this ends."""
    members = [list(np.flatnonzero(assignment == rank)) for rank in range(world_size)]
    loads = np.array([int(work[m].sum()) for m in members], dtype=np.int64)
    for _ in range(16 * len(work) + 16):
        ranks = np.argsort(loads, kind="stable")
        top = int(ranks[-1])
        high = work[members[top]]
        swapped = False
        for other in (int(rank) for rank in ranks[:-1]):
            gap = int(loads[top] - loads[other])
            if gap < 2:  # an integer move strictly inside (0, gap) needs gap ≥ 2
                break
            found = _best_swap(high, work[members[other]], gap)
            if found is not None:
                at, there, moved = found
                members[top][at], members[other][there] = members[other][there], members[top][at]
                loads[top] -= moved
                loads[other] += moved
                swapped = True
                break
        if not swapped:
            break
    result = np.empty(len(work), dtype=np.int64)
    for rank, blocks in enumerate(members):
        result[blocks] = rank
    return result


def _runs(blocks: Sequence[int], block: int) -> tuple[Piece, ...]:
    """Sorted block indices → the runs of adjacent blocks as :class:`Piece` s."""
    runs: list[Piece] = []
    row = 0
    for index in blocks:
        if runs and runs[-1].global_start + runs[-1].count == index * block:
            last = runs[-1]
            runs[-1] = Piece(last.start, last.global_start, last.count + block)
        else:
            runs.append(Piece(row, index * block, block))
        row += block
    return tuple(runs)


def balance_blocks(work: torch.Tensor, world_size: int, block: int) -> BalancedLayout:
    """The :class:`BalancedLayout` for query blocks of ``block`` positions whose works are
    ``work`` (LongTensor ``[n]``, non-negative: any per-block cost) over ``world_size`` ranks,
    ``n / world_size`` blocks each: greedy, then swaps (see the module docstring). The layout's
    ``length`` is ``n · block``."""
    _check_size("block", block)
    _check_world(world_size)
    if not isinstance(work, torch.Tensor) or work.dim() != 1 or work.is_floating_point():
        shape = tuple(getattr(work, "shape", ()))
        raise TypeError(f"work: expected an integer tensor [n] of block works (e.g. tile_work() "
                        f"summed per block), got {type(work).__name__} {shape}")
    blocks = work.shape[0]
    if blocks == 0 or blocks % world_size:
        raise ValueError(f"{blocks} query blocks of {block} positions (length {blocks * block}) "
                         f"do not split into {world_size} equal shards of whole blocks: pad the "
                         f"sequence to a multiple of block × world_size = {block * world_size}, "
                         f"or pick a block that divides length / world_size")
    if bool((work < 0).any()):
        raise ValueError("work: block works must be non-negative")
    values = work.cpu().numpy().astype(np.int64)
    assignment = _swaps(values, _greedy(values, world_size, blocks // world_size), world_size)
    members = [np.flatnonzero(assignment == rank) for rank in range(world_size)]  # ascending
    runs = tuple(_runs(m.tolist(), block) for m in members)
    order = np.concatenate(members)  # blocks in shard order
    permutation = (torch.from_numpy(order)[:, None] * block + torch.arange(block)).flatten()
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel())
    loads = torch.tensor([int(values[m].sum()) for m in members], dtype=torch.long)
    return BalancedLayout(world_size, blocks * block, block, runs, permutation, inverse,
                          torch.from_numpy(assignment), work.cpu().long().clone(), loads)


def default_block(length: int, world_size: int, tile: int = DEFAULT_TILE) -> int:
    """The block :func:`plan_balance` uses when none is given: the largest multiple of ``tile`` that
    divides ``length / world_size`` into at least :data:`BLOCKS_PER_RANK` blocks (``tile``
    itself when ``length / world_size`` has fewer than that many tiles)."""
    _check_size("tile", tile)
    _check_world(world_size)
    tiles = length // world_size // tile  # rows of tiles per rank
    return tile * max((d for d in range(1, tiles // BLOCKS_PER_RANK + 1) if tiles % d == 0),
                      default=1)


def plan_balance(mask, space: Union[MaskSpace, int], world_size: int, *, tile: int = DEFAULT_TILE,
            block: Optional[int] = None) -> BalancedLayout:
    """A :class:`BalancedLayout` of the sequence over ``world_size`` ranks for ``mask``: every
    rank holds ``T / world_size`` positions (whole blocks) and nearly the same work under the
    module's cost model (its queries against all keys: non-EMPTY ``tile × tile`` tiles).

    ``mask``: the mask of the whole sequence, as given to ``ring_attention`` (any mask; a
    tensor; ``None``). ``space``: the sequence length T, or a
    :class:`~attnkit.masks.MaskSpace` ``(B, H, T, T)`` when the mask varies over the batch
    (per-batch document ids, padding lengths). ``tile``: positions per side of a counted tile;
    T must be a multiple of ``tile × world_size``. ``block``: positions per query block, a
    multiple of ``tile`` dividing ``T / world_size`` (default :func:`default_block`); smaller
    blocks balance finer and cut shards into more runs. Deterministic: every rank can call it
    and get the same layout, or one rank can plan it and send it. Needs no process group.
    """
    fitted, space = _checked(mask, space, tile)
    _check_world(world_size)
    if space.q_len != space.kv_len:
        raise ValueError(f"plan_balance: query length {space.q_len} != key length "
                         f"{space.kv_len}; a balanced layout cuts queries and keys the same "
                         f"way, so it needs self-attention lengths (use layout='contiguous' or "
                         f"'zigzag' for cross-attention lengths)")
    length = space.q_len
    if length % (tile * world_size):
        raise ValueError(f"plan_balance: sequence length {length} is not a multiple of tile × "
                         f"world_size = {tile} × {world_size}: pad the sequence (and mask the "
                         f"padding) or pick a tile that divides {length} / {world_size}")
    block = default_block(length, world_size, tile) if block is None else block
    _check_size("block", block)
    if block % tile or (length // world_size) % block:
        raise ValueError(f"plan_balance: block={block} must be a multiple of tile={tile} that "
                         f"divides the {length // world_size} positions of each rank; pass "
                         f"block=None for default_block(), "
                         f"{default_block(length, world_size, tile)} here")
    rows = _tiles(fitted, space, 0, length, tile)  # [T / tile]
    return balance_blocks(rows.view(-1, block // tile).sum(1), world_size, block)
