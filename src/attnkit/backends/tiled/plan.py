"""The tiled engine's planner: its constants and options (:class:`TiledOptions`), the key
segments each query block visits (:class:`Segment`, :class:`Plan`: built from the mask's block
map by :func:`build_plan`, cached by :func:`make_plan`), the groups it runs them in
(:class:`Group`: runs, shared prefixes, dense row ranges), and :class:`Problem`, one computation
without its tensors."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...masks import (EMPTY, FULL, PARTIAL, KeyRanges, Mask, MaskCache, MaskSpace, key_ranges,
                      packs_documents, run_bounds)
from ...modifiers import Modifiers

BLOCK_K = 128
"""Key-block width of the block map: the granularity at which tiles are skipped."""

TILE_ELEMENTS = 1 << 21
"""Score elements per tile (8 MiB in fp32): bounds memory and sets ``block_q``."""

FUSED_BLOCK_Q = 256
"""Query rows per block when tiles go through torch's fused CPU kernel."""

_FOLD_LIMIT = 2.0 ** 64
"""The largest ``|scale| / cap`` folded into the queries (:meth:`TileScores.scores`)."""

MODIFIED_TILE_KEYS = 1024
"""Keys per tile that the matmul path sizes its query blocks for when softcap or score
functions run on it (:func:`choose_block_q`): taller tiles than its default measured faster
in their backward."""

FLUSH_BELOW = -100.0
"""The matmul path counts a weight below ``2^FLUSH_BELOW`` of its row's largest (forward) or
of its row's sum (backward) as 0, so that no tile holds subnormal floats (CPUs take a slow
path on them, and ALiBi makes long runs of keys decay through that range). float32 resolves
``2^-24`` of a row: such a key changes no result unless its value is ``2^76`` times the
others'."""

WIDE_BIAS = 64.0
"""Position biases (ALiBi, relative) whose values span more than this take the matmul path's
backward even on a fused plan: torch's fused backward then forms subnormal weights (keys about
``e^-87`` below their row's sum), on which CPUs take a slow path; the matmul path flushes them
(:data:`FLUSH_BELOW`)."""

FIXED_BLOCK_K = 256
"""Key-block width of the fixed schedule (:attr:`TiledOptions.fixed_blocks`): its plans'
blocks, and on the matmul path (and with position biases) the blocks ``[256·j, 256·(j +
1))`` of each sequence's own positions its keys are reduced and merged in, whatever the
call's shapes (torch's fused kernel takes whole splits of 512 instead, ``forward.
KV_SPLIT``). Part of the invariance contract (docs/NUMERICS.md): changing it changes the
invariant results' last bits."""

ROW_QUANTUM = 4
"""The fewest query rows per kernel call of the fixed schedule: calls come in multiples of
:func:`row_quantum` (this, or a doubling of it), because torch's fused CPU kernel and BLAS
compute a row alike in any call with enough rows, but fewer rows (a decoding step) take
another code path that rounds differently; shorter calls are padded with copies of their
last row."""

FUSED_MIN_KEYS = 16
"""torch's fused CPU kernel gives out 0 and LSE 0, not NaN, for a row whose scores are all NaN
(a NaN query, or non-finite keys alone) over fewer keys than this without an additive mask
(with ``is_causal``, a square's first row sees one key): such segments (a cache's newest keys
past a block boundary, a short chunk's diagonal square) take the matmul path or an additive
tile, which keep the NaN."""

INVARIANT_MAX_HEAD_DIM = 256
"""The widest head dim the fixed schedule takes: above it BLAS blocks the ``q·kᵀ`` reduction
differently for different row counts."""


@functools.lru_cache(maxsize=None)
def row_quantum(head_dim: int, dtype: torch.dtype = torch.float32,
                device: torch.device = torch.device("cpu")) -> int:
    """The row multiple of the fixed schedule's kernel calls for queries of ``head_dim`` in
    ``dtype`` (the accumulation dtype) on ``device``, measured once per process there: the first
    of :data:`ROW_QUANTUM` and its doublings (up to 256) whose every multiple up to 64 rows
    (at least four of them) gives, through torch's fused kernel (float32/float64) and the
    matmuls of a tile, the first rows the bits they get among 256. How few rows take
    BLAS's other path depends on the CPU and grows with the head dim (on AVX-512 Xeons: 1
    or 2 rows at head dim 64, 5 at 128, 10 at 256). The multiples divide 32, so torch's
    kernel's own splits of a call's rows (32 and more) keep whole multiples too.

    Measured with the caller's dispatch modes set aside: the first call may come from inside
    one (selective activation checkpointing would keep the probes' results and hand them to
    the recompute's real products; a fake-tensor mode would measure nothing)."""
    with _disable_current_modes():
        return _measure_row_quantum(head_dim, dtype, device)


PROBE_ROWS = 256
"""The query rows of the probes :func:`row_quantum` and :func:`rows_anywhere` measure against."""


def _probe(key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device, seed: int,
           ) -> Callable[[int, int], list[torch.Tensor]]:
    """``products(start, stop)``: what the fixed schedule computes for probe query rows
    ``[start, stop)`` of :data:`PROBE_ROWS` against one key block (``q·kᵀ``, weights times
    values, and torch's fused kernel where it applies), drawn from ``seed`` on the CPU
    whatever the default device (the generator is the CPU's), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64,
                           device="cpu").to(device, dtype)

    q, k, v = draw(1, 2, PROBE_ROWS, key_dim), draw(1, 2, FIXED_BLOCK_K, key_dim), draw(
        1, 2, FIXED_BLOCK_K, value_dim)
    weights = torch.rand(1, 2, PROBE_ROWS, FIXED_BLOCK_K, generator=gen, dtype=torch.float64,
                         device="cpu").to(device, dtype)
    fused = (device.type == "cpu" and dtype in (torch.float32, torch.float64)
             and key_dim == value_dim)

    def products(start: int, stop: int) -> list[torch.Tensor]:
        found = [q[:, :, start:stop] @ k.transpose(-1, -2), weights[:, :, start:stop] @ v]
        if fused:
            found += torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, start:stop], k, v, 0.0, False, scale=key_dim ** -0.5)[:2]
        return found

    return products


def _measure_row_quantum(head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    results = _probe(head_dim, head_dim, dtype, device, seed=0)
    rows = PROBE_ROWS
    whole = results(0, rows)

    def alike(n: int) -> bool:
        return all(torch.equal(part, full.narrow(2, 0, n))
                   for part, full in zip(results(0, n), whole))

    quantum = ROW_QUANTUM
    while quantum < rows and not all(alike(m) for m in range(quantum, max(64, 4 * quantum) + 1,
                                                             quantum)):
        quantum *= 2
    return min(quantum, rows)


@functools.lru_cache(maxsize=None)
def rows_anywhere(key_dim: int, value_dim: int, dtype: torch.dtype = torch.float32,
                  device: torch.device = torch.device("cpu")) -> bool:
    """Whether the fixed schedule's products give a query row the same bits wherever it sits
    in a kernel call (a decoding step's row comes first in its call, the same row of a
    prefill anywhere), for head dims ``key_dim``/``value_dim`` in ``dtype`` (the accumulation
    dtype) on ``device``, measured once per process: a call's rows shifted by 1 to 16 against
    the same rows of one call of 256. BLAS rounds a row by its place for some widths that are
    not a multiple of its vector length (odd widths especially, more of them in float64);
    there the fixed schedule cannot keep the contract. Measured outside the caller's dispatch
    modes, as :func:`row_quantum`."""
    if device.type != "cpu":
        return True
    with _disable_current_modes():
        return _measure_rows_anywhere(key_dim, value_dim, dtype, device)


def _measure_rows_anywhere(key_dim: int, value_dim: int, dtype: torch.dtype,
                           device: torch.device) -> bool:
    results = _probe(key_dim, value_dim, dtype, device, seed=1)
    whole = results(0, PROBE_ROWS)
    count = max(row_quantum(key_dim, dtype, device), row_quantum(value_dim, dtype, device), 32)
    count = min(count, PROBE_ROWS - 16)
    return all(torch.equal(part, full.narrow(2, shift, count))
               for shift in range(1, 17)
               for part, full in zip(results(shift, shift + count), whole))


LOG2E = 1.4426950408889634
"""``exp(x) = exp2(x · log2 e)``: the matmul path exponentiates in base 2, because torch's CPU
``exp`` takes a slow path for arguments below about −87 (where ALiBi puts far keys) and
``exp2`` does not."""


@dataclass(frozen=True)
class TiledOptions:
    """How the tiled engine schedules its work (the results agree within rounding for every
    choice). Hashable: a plan is cached per options value."""

    fused_tiles: bool = True
    """Tiles go through torch's fused CPU kernel where it applies (see
    :func:`uses_fused_kernel`); ``False`` takes the matmul path everywhere."""

    batch_runs: bool = True
    """Run evenly spaced query blocks with equal relative structure (sliding windows, documents)
    as one kernel call over a strided view (see :func:`_find_runs`)."""

    prefix_blocks: int = 4
    """Most query blocks that run a shared FULL prefix as one call (see
    ``Plan._shared_prefix``); below 2, never."""

    staircase_max_keys: int = 1024
    """Widest run ``upper triangle, full…, [lower triangle]`` merged into one staircase segment
    (one set of strips, no merges: measured faster for sliding windows). A lower triangle is
    not merged with the full keys before it: those run better as one call of the whole query
    block (causal measured slower merged)."""

    fixed_blocks: bool = False
    """The fixed schedule behind ``attnkit.invariant()``: keys at their absolute positions in
    whole splits of torch's fused kernel (``forward._kernel_forward``), or in blocks of
    :data:`FIXED_BLOCK_K` merged in key order (``forward._fixed_forward``: the matmul path,
    position biases), each kernel call with a multiple of :func:`row_quantum` query rows; no
    runs, shared prefixes, staircases or pieces, and position biases never read from reversed
    keys. A query row's result then depends on its own inputs
    alone: not on the other rows or sequences of the call, their padding, or how the queries
    were chunked. Plans are built with ``block_k`` :data:`FIXED_BLOCK_K`."""

    triangle_strip: int = 64
    """Query rows per kernel call inside a staircase segment. The fused kernel skips no key of a
    tile narrower than its 512-key blocks, so a 256-wide triangle run whole computes its masked
    half too; run as strips, each strip sees only the keys it may (measured faster per
    tile)."""


@dataclass(frozen=True)
class Segment:
    """Keys ``[start, stop)`` (local) computed together; ``partial``: apply the element mask.

    ``structure`` (fused plans only): the segment's mask, known without evaluating it (see
    :class:`_Squares`), as a *staircase* over the query block's ``n``
    rows: ``"lower"``: its last ``n`` keys are a lower triangle, every key before them allowed;
    ``"upper"``: its first ``n`` keys are an upper triangle, every key after them allowed;
    ``"band"``: both. A square triangle tile is the case ``stop - start == n``. ``None``: the
    element mask is evaluated (partial) or not needed (full)."""

    start: int
    stop: int
    partial: bool
    structure: Optional[str] = None
    pieces: Optional[tuple[tuple[int, int, int, int], ...]] = None
    """(fused plans) A partial segment whose rows see few of its keys, as ``(row_start,
    row_stop, key_start, key_stop)`` pieces (local to the block and the segment, covering its
    rows in order; no key where ``key_start == key_stop``): the rows of each packed document
    with its own keys only (see :func:`_pieces`). ``None``: the segment runs whole."""


class Group(NamedTuple):
    """A unit of execution: query block ``block`` (rows ``[rows[0], rows[1])``, keys
    ``segments``), and, when ``count > 1``, the query blocks ``block + step·j`` (j < count) too,
    which see the same keys relative to their rows (a *run*: one kernel call serves them all)."""

    block: int
    rows: tuple[int, int]
    segments: tuple[Segment, ...]
    step: int = 0
    count: int = 1
    fresh: bool = True
    """False: the rows already hold a partial result (a shared prefix ran before); every
    segment merges into it."""


@dataclass(frozen=True)
class Plan:
    """Which key segments each query block visits. ``rows[i]`` lists block i's segments;
    ``runs`` lists ``(first, step, count)``: query blocks ``first + step·j`` whose segments are
    the same up to the shift ``step·j·block_q`` and need no element mask (full or staircase).
    ``options``: the options it was built with, which its execution follows too."""

    block_q: int
    block_k: int
    rows: tuple[tuple[Segment, ...], ...]
    fused: bool = False
    runs: tuple[tuple[int, int, int], ...] = ()
    options: TiledOptions = TiledOptions()
    squares: Optional["_Squares"] = None
    """(fused plans) The structure of each query block's square tiles, where the mask's key
    ranges tell it (:func:`~attnkit.masks.key_ranges`); ``None`` where they do not."""

    def structure(self, block: int, n: int, k0: int, k1: int) -> Optional[str]:
        """``"full"``, ``"lower"`` or ``"upper"`` for query block ``block`` (its ``n`` rows) ×
        global keys ``[k0, k1)`` where :attr:`squares` knows it; else ``None`` (also for rows
        of more than one block)."""
        if self.squares is None or n > self.block_q:
            return None
        return self.squares.structure(block, n, k0, k1)

    def groups(self, tq: int, *, runs: bool = False, shared_prefix: bool = False,
               dense: bool = False):
        """Yield :class:`Group` s for execution. With ``runs``, each run is one group. With
        ``dense`` (the fused kernel executes: it tiles internally), consecutive query blocks
        (outside runs) whose segments are identical and all FULL run as one call (a dense row
        range is a single kernel launch); with ``shared_prefix``, consecutive blocks that start
        with the same FULL keys run those as one call too (see :meth:`_shared_prefix`);
        otherwise one query block at a time."""
        in_run = {}
        if runs:
            for first, step, count in self.runs:
                in_run.update({first + step * j: (first, step, count) for j in range(count)})
        i = 0
        while i < len(self.rows):
            if i in in_run:
                first, step, count = in_run[i]
                if i == first:
                    yield Group(i, (i * self.block_q, (i + 1) * self.block_q), self.rows[i], step,
                                count)
                i += 1
                continue
            end = i + 1
            if dense and not any(s.partial for s in self.rows[i]):
                while (end < len(self.rows) and end not in in_run
                       and self.rows[end] == self.rows[i]):
                    end += 1
            shared = self._shared_prefix(i, in_run, tq) if shared_prefix and end == i + 1 else None
            if shared is not None:
                end = shared[-1].block + 1
                yield from shared
            else:
                yield Group(i, (i * self.block_q, min(end * self.block_q, tq)), self.rows[i])
            i = end

    def _shared_prefix(self, i: int, in_run: dict, tq: int) -> Optional[list]:
        """Query blocks ``i…j−1`` (at most ``options.prefix_blocks``, outside runs) whose first
        segment is FULL, starts where block i's does and reaches at least as far, as groups:
        block i's first segment for all their rows in one kernel call (torch's CPU kernel
        measured faster per pair, forward and backward, on 1024 query rows than on 256), then
        each block's remaining keys, merged into that (``fresh=False``). ``None`` when fewer
        than two blocks qualify or block i's first segment is shorter than two blocks of keys.
        (Causal: the keys below the first block's diagonal are shared.)"""
        head = self.rows[i][0] if self.rows[i] else None
        if head is None or head.partial or head.stop - head.start < 2 * self.block_q:
            return None
        j = i + 1
        while (j < len(self.rows) and j - i < self.options.prefix_blocks and j not in in_run
               and self.rows[j] and not self.rows[j][0].partial
               and self.rows[j][0].start == head.start and self.rows[j][0].stop >= head.stop):
            j += 1
        if j - i < 2:
            return None
        groups = [Group(i, (i * self.block_q, min(j * self.block_q, tq)), (head,))]
        for block in range(i, j):
            first, *rest = self.rows[block]
            remainder = ((Segment(head.stop, first.stop, False),) if first.stop > head.stop
                         else ()) + tuple(rest)
            if remainder:
                groups.append(Group(block, (block * self.block_q,
                                            min((block + 1) * self.block_q, tq)),
                                    remainder, fresh=False))
        return groups

    def tiles_computed(self) -> int:
        """Number of ``block_q × block_k`` tiles the plan computes (skipped ones excluded)."""
        return sum(math.ceil((s.stop - s.start) / self.block_k) for row in self.rows for s in row)


def _find_runs(rows: list, block_q: int, q_count: int) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(first, step, count ≥ 2)`` of whole query blocks, evenly spaced, whose segments
    are equal relative to the block's first row and are all full or staircases (their masks
    move with the block, so one strided view of the blocks runs them in one call)."""
    by_pattern: dict = {}
    for i, row in enumerate(rows):
        if not row or (i + 1) * block_q > q_count or any(
                s.partial and s.structure is None for s in row):
            continue
        shift = i * block_q
        pattern = tuple((s.start - shift, s.stop - shift, s.partial, s.structure) for s in row)
        by_pattern.setdefault(pattern, []).append(i)
    runs = []
    for blocks in by_pattern.values():
        j = 0
        while j + 1 < len(blocks):
            step, end = blocks[j + 1] - blocks[j], j + 1
            while end + 1 < len(blocks) and blocks[end + 1] - blocks[end] == step:
                end += 1
            runs.append((blocks[j], step, end - j + 1))
            j = end + 1
    return tuple(sorted(runs))


def choose_block_q(rows_of_work: int, kv_len: int, max_keys: int = 4096) -> int:
    """Query rows per block so that one tile ``[rows_of_work · block_q, min(kv_len,
    max_keys)]`` fits ``TILE_ELEMENTS`` (a power of two in [16, 512])."""
    per_row = max(1, rows_of_work * min(kv_len, max_keys))
    block = 1 << max(4, min(9, int(math.log2(max(1, TILE_ELEMENTS // per_row)))))
    return block


_PLANS = MaskCache(64)


def make_plan(mask: Optional[Mask], space: MaskSpace, *, batch: int, heads: int,
              q_offset: int, q_count: int, kv_offset: int, kv_count: int,
              block_q: Optional[int] = None, block_k: int = BLOCK_K, fused: bool = False,
              options: TiledOptions = TiledOptions()) -> Plan:
    """Per-query-block key segments for ``mask`` (see :func:`build_plan`), cached per mask
    (same tensors, unmodified) and arguments, ``options`` included: a loop that reuses a mask
    plans it once."""
    extra = (space, batch, heads, q_offset, q_count, kv_offset, kv_count, block_q, block_k, fused,
             options)
    if _every_block_masked(mask, options):  # its plan follows the shapes alone
        mask_key, extra = None, (*extra, "every block masked")
    else:
        mask_key = mask
    return _PLANS.get(mask_key, extra, lambda: build_plan(
        mask, space, batch=batch, heads=heads, q_offset=q_offset, q_count=q_count,
        kv_offset=kv_offset, kv_count=kv_count, block_q=block_q, block_k=block_k, fused=fused,
        options=options))


def _every_block_masked(mask: Optional[Mask], options: TiledOptions) -> bool:
    """Whether a fixed plan (:attr:`TiledOptions.fixed_blocks`) of ``mask`` runs every block
    masked instead of reading the mask's block map: a key padding its producer vouched for
    (a ``KVCache``'s, new in every layer of a decoding step, its keys up to the longest
    sequence). The fixed schedule gives a row the same bits from a block run masked as from
    one skipped (EMPTY) or run unmasked (FULL), so the plan then follows the shapes alone and
    is made once per shape."""
    return options.fixed_blocks and getattr(mask, "vouched", False)


def build_plan(mask: Optional[Mask], space: MaskSpace, *, batch: int, heads: int,
               q_offset: int, q_count: int, kv_offset: int, kv_count: int,
               block_q: Optional[int] = None, block_k: int = BLOCK_K, fused: bool = False,
               options: TiledOptions = TiledOptions()) -> Plan:
    """Turn the mask's block map into per-query-block key segments.

    A block counts as EMPTY only when it is empty for every batch element and head, and as
    FULL only when it is full for all of them; otherwise it is PARTIAL (the element mask, which
    varies per batch/head, is applied). Consecutive blocks of one kind merge into one segment
    of at most ``TILE_ELEMENTS`` scores (FULL runs are unbounded with the ``fused`` kernel, which
    tiles internally and never materialises them). ``options`` decide the staircase merges
    (``staircase_max_keys``) and runs (``batch_runs``); the plan carries them.
    """
    fixed = options.fixed_blocks
    if fixed and block_k != FIXED_BLOCK_K:
        raise ValueError(f"build_plan: the fixed schedule takes block_k={FIXED_BLOCK_K}, "
                         f"got {block_k}")
    block_q = block_q or (FUSED_BLOCK_Q if fused else choose_block_q(batch * heads, kv_count))
    nq, nk = math.ceil(q_count / block_q), math.ceil(kv_count / block_k)
    structured = fused and mask is not None and not fixed
    squares = hull = None
    if mask is None:
        codes = [[FULL] * nk for _ in range(nq)]
    elif _every_block_masked(mask, options):
        codes = [[PARTIAL] * nk for _ in range(nq)]
    else:
        per_bh = mask.block_map(block_q, block_k, space, q_offset=q_offset, q_count=q_count,
                                kv_offset=kv_offset, kv_count=kv_count)  # [Bm, Hm, nq, nk]
        all_empty = (per_bh == EMPTY).flatten(0, 1).all(0)
        all_full = (per_bh == FULL).flatten(0, 1).all(0)
        union = torch.where(all_empty, EMPTY, torch.where(all_full, FULL, 1)).long()
        codes, squares, hull = _read_blocks(
            union, key_ranges(mask, space) if fused else None, q_offset, q_count, block_q,
            structured and packs_documents(mask))
    max_blocks = 1 if fixed else max(1, TILE_ELEMENTS // (max(1, batch * heads) * block_q
                                                          * block_k))
    rows = []
    for i, row in enumerate(codes):
        segments, j = [], 0
        while j < nk:
            code = row[j]
            if code == EMPTY:
                j += 1
                continue
            end = j + 1
            while end < nk and row[end] == code and (
                    end - j < max_blocks or (fused and code == FULL and not fixed)):
                end += 1
            segments.append(Segment(j * block_k, min(end * block_k, kv_count), code != FULL))
            j = end
        if structured and squares is not None:
            segments = _with_structure(segments, squares, i, min((i + 1) * block_q, q_count)
                                       - i * block_q, kv_offset, options.staircase_max_keys)
        rows.append(tuple(segments))
    if structured:
        rows = _with_pieces(mask, space, rows, block_q, q_offset, q_count, kv_offset, hull)
    runs = (_find_runs(rows, block_q, q_count) if fused and options.batch_runs and not fixed
            else ())
    return Plan(block_q, block_k, tuple(rows), fused, runs, options, squares)


def _read_blocks(union: torch.Tensor, ranges: Optional[KeyRanges], q_offset: int, q_count: int,
                 block_q: int, hulls: bool) -> tuple[list, Optional["_Squares"], Optional[tuple]]:
    """The block codes ``union [nq, nk]`` read as lists, with, in the same host read, what the
    mask's key ``ranges`` (:func:`~attnkit.masks.key_ranges`, or ``None``) give where they
    hold: the squares' structures (:class:`_Squares`) and, with ``hulls``, each row's keys
    over the batch, ``[lo, hi)`` (two lists of ``q_count``; ``lo ≥ hi`` where it has none) →
    ``(codes, squares, hull)``, ``None`` for what is not known."""
    if ranges is None:
        return union.tolist(), None, None
    nq, nk = union.shape
    lo, hi = (t[:, q_offset:q_offset + q_count] for t in ranges[:2])
    exact = torch.ones((), device=union.device) if ranges.exact is None else ranges.exact
    table = torch.cat([union, _square_summaries(lo, hi, block_q),
                       exact.to(union).expand(nq, 1)], 1)  # [nq, nk + 9]
    parts = [table.flatten()]
    if hulls:
        seen = hi > lo
        parts += [torch.where(seen, lo, _FAR).amin(0), torch.where(seen, hi, -_FAR).amax(0)]
    values = torch.cat(parts).tolist()
    width = table.shape[1]
    rows = [values[i * width:(i + 1) * width] for i in range(nq)]
    codes = [row[:nk] for row in rows]
    if not rows or not rows[0][-1]:
        return codes, None, None
    rest = values[nq * width:]
    return (codes, _Squares(tuple(tuple(row[nk:-1]) for row in rows)),
            (rest[:q_count], rest[q_count:]) if hulls else None)


def _with_structure(segments: list, known: "_Squares", i: int, n: int, kv_offset: int,
                    max_keys: int) -> list:
    """Mark the partial square segments of query block ``i`` (``n`` rows) that ``known``
    shows to be lower or upper triangles (a partial run of several squares, all known, is
    split into them), and merge each adjacent run ``upper, full…, [lower]`` into one
    staircase segment of at most ``max_keys`` keys (see :class:`Segment`). The element mask
    of these segments is never evaluated."""
    marked = []
    for seg in segments:
        width = seg.stop - seg.start
        if not seg.partial or width % n:
            marked.append(seg)
            continue
        # A partial run of whole squares (e.g. the upper and lower triangle of a window as wide
        # as the block): known when every square is known.
        squares = []
        for start in range(seg.start, seg.stop, n):
            structure = known.structure(i, n, kv_offset + start, kv_offset + start + n)
            if structure not in ("lower", "upper", "full"):
                break
            squares.append(Segment(start, start + n, structure != "full",
                                   None if structure == "full" else structure))
        marked.extend(squares if len(squares) == width // n else [seg])

    def adjacent(j: int) -> bool:
        return marked[j].start == marked[j - 1].stop

    merged, i = [], 0
    while i < len(marked):
        j = i + 1
        if marked[i].structure == "upper":  # with the full segments and lower triangle after it
            while j < len(marked) and adjacent(j) and not marked[j].partial:
                j += 1
            if j < len(marked) and adjacent(j) and marked[j].structure == "lower":
                j += 1
        run = marked[i:j]
        if len(run) > 1 and run[-1].stop - run[0].start <= max_keys:
            structure = "band" if run[-1].structure == "lower" else "upper"
            merged.append(Segment(run[0].start, run[-1].stop, True, structure))
        else:
            merged.extend(run)
        i = j
    return merged


_FAR = 1 << 62
"""A key position beyond any tensor's: the neutral value of the summaries' reductions."""


def _square_summaries(lo: torch.Tensor, hi: torch.Tensor, block_q: int) -> torch.Tensor:
    """For the query blocks of ``block_q`` rows over each row's keys ``[lo, hi)`` (long
    ``[Bm, Tq]``): what decides which square tiles of keys a block sees as full, lower or upper
    triangles (:class:`_Squares`), long ``[nq, 8]``, every batch element at once. With ``ρ``
    a row's place in its block of ``n`` rows: the largest ``lo`` and smallest ``hi``; the
    smallest and largest ``hi − ρ − 1`` over rows ``ρ ≤ n − 2`` (a lower triangle from key
    ``k0`` has ``hi = k0 + ρ + 1`` there) and the smallest ``hi`` of the last row; the
    smallest and largest ``lo − ρ`` over rows ``ρ ≥ 1`` (an upper triangle has ``lo = k0 +
    ρ``) and the largest ``lo`` of the first row."""
    rows = lo.shape[-1]
    nq = math.ceil(rows / block_q)
    rho = torch.arange(block_q, device=lo.device)
    n = (rows - torch.arange(nq, device=lo.device) * block_q).clamp(max=block_q)[:, None]
    real = rho < n  # [nq, block_q]
    lo, hi = (torch.nn.functional.pad(t, (0, nq * block_q - rows)).view(-1, nq, block_q)
              for t in (lo, hi))

    def least(values, where):
        return torch.where(where, values, _FAR).amin((0, 2))

    def most(values, where):
        return torch.where(where, values, -_FAR).amax((0, 2))
    lower, upper = hi - rho - 1, lo - rho
    return torch.stack([most(lo, real), least(hi, real),
                        least(lower, real & (rho <= n - 2)), most(lower, real & (rho <= n - 2)),
                        least(hi, rho == n - 1),
                        least(upper, real & (rho >= 1)), most(upper, real & (rho >= 1)),
                        most(lo, rho == 0)], 1)


class _Squares(NamedTuple):
    """The :func:`_square_summaries` of a plan's query blocks, read: which of a block's
    square tiles the mask makes full (every key allowed), a lower triangle (``k ≤ q`` counted
    from the tile's corner: torch's ``is_causal`` on the tile) or an upper one (``k ≥ q``),
    for every batch element and head, from one host read for all of them::

        lower  upper
        █░░░   ████
        ██░░   ░███
        ███░   ░░██
        ████   ░░░█
    """

    blocks: tuple

    def structure(self, i: int, n: int, k0: int, k1: int) -> Optional[str]:
        """The structure of query block ``i`` (``n`` rows) × keys ``[k0, k1)``, or ``None``."""
        most_lo, least_hi, lower_lo, lower_hi, last_hi, upper_lo, upper_hi, first_lo = (
            self.blocks[i])
        if most_lo <= k0 and k1 <= least_hi:
            return "full"
        if k1 - k0 != n:
            return None
        if lower_lo == lower_hi == k0 and most_lo <= k0 and last_hi >= k1:
            return "lower"
        if upper_lo == upper_hi == k0 and first_lo <= k0 and least_hi >= k1:
            return "upper"
        return None


PIECES_BELOW = 0.75
"""A partial segment runs as pieces (:attr:`Segment.pieces`) when they hold at most this
fraction of its ``rows × keys`` scores."""


def _with_pieces(mask: Mask, space: MaskSpace, rows: list, block_q: int, q_offset: int,
                 q_count: int, kv_offset: int, hull: Optional[tuple] = None) -> list:
    """``rows`` with :attr:`Segment.pieces` set on the partial segments without a known
    structure where that computes at most :data:`PIECES_BELOW` of their scores, for masks
    that keep packed documents apart (:func:`~attnkit.masks.packs_documents`; in other masks
    consecutive rows see overlapping keys). Each row's first and last key in a segment come
    from ``hull`` (each row's keys over the batch, :func:`_read_blocks`: read with the block
    codes) or, without it, from each such segment's mask evaluated once here (its union over
    batch and heads), read in one host read for all of them."""
    todo = [(i, j) for i, row in enumerate(rows) for j, seg in enumerate(row)
            if seg.partial and seg.structure is None] if packs_documents(mask) else []
    if not todo:
        return rows
    if hull is None:
        extents = []
        for i, j in todo:
            seg = rows[i][j]
            q_idx = torch.arange(q_offset + i * block_q,
                                 q_offset + min((i + 1) * block_q, q_count), device=space.device)
            kv_idx = torch.arange(kv_offset + seg.start, kv_offset + seg.stop, device=space.device)
            allowed = mask.tile(q_idx, kv_idx, space).flatten(0, 1).any(0)  # [n, span]
            _, first, last = run_bounds(allowed)  # span and -1 for a row without a key
            extents.append(torch.stack([first, last + 1]))
        values = torch.cat(extents, 1).tolist()  # [2, Σ n]: each row's [first, last + 1) key
    rows, at = [list(row) for row in rows], 0
    for i, j in todo:
        seg = rows[i][j]
        n = min((i + 1) * block_q, q_count) - i * block_q
        if hull is None:
            first, last = values[0][at:at + n], values[1][at:at + n]
            at += n
        else:  # the row's keys clipped to the segment
            start, span = kv_offset + seg.start, seg.stop - seg.start
            first = [max(lo - start, 0) for lo in hull[0][i * block_q:i * block_q + n]]
            last = [min(hi - start, span) for hi in hull[1][i * block_q:i * block_q + n]]
        pieces = _pieces(first, last)
        work = sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1 in pieces)
        if work <= PIECES_BELOW * n * (seg.stop - seg.start):
            rows[i][j] = Segment(seg.start, seg.stop, True, None, pieces)
    return [tuple(row) for row in rows]


def _pieces(first: list[int], last: list[int]) -> tuple[tuple[int, int, int, int], ...]:
    """Rows cut where a row's keys ``[first, last)`` do not overlap the keys of the piece
    before it (rows without a key form pieces of their own): ``(row_start, row_stop,
    key_start, key_stop)`` each, keys the union of its rows'."""
    pieces: list[list[int]] = []
    for r, (lo, hi) in enumerate(zip(first, last)):
        if pieces:
            piece = pieces[-1]
            empty = piece[2] == piece[3]
            if (lo >= hi and empty) or (lo < hi and not empty and lo < piece[3]
                                        and hi > piece[2]):
                piece[1] = r + 1
                if lo < hi:
                    piece[2], piece[3] = min(piece[2], lo), max(piece[3], hi)
                continue
        pieces.append([r, r + 1, lo, hi] if lo < hi else [r, r + 1, 0, 0])
    return tuple(tuple(p) for p in pieces)


@dataclass(frozen=True)
class Problem:
    """Everything about one tiled computation except the tensors."""

    mask: Optional[Mask]
    scale: float
    space: MaskSpace
    q_offset: int
    kv_offset: int
    plan: Plan
    dropout_p: float = 0.0
    seed: int = 0
    modifiers: Optional[Modifiers] = None
    """Score modifiers applied per tile (a plan with the fused kernel takes ALiBi and relative
    biases alone, see :meth:`Modifiers.by_position`); sinks are not the engine's: they join
    its result (``Sinks.join``)."""

    @property
    def modifies_scores(self) -> bool:
        return self.modifiers is not None and self.modifiers.changes_scores

    def position_vector(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The ALiBi and relative biases by relative position, ``[1|B, H, Tq + Tk − 1]`` in
        ``dtype`` without a graph (see :meth:`Modifiers.position_bias`), or ``None``."""
        if self.modifiers is None:
            return None
        with torch.no_grad():
            return self.modifiers.position_bias(self.space, dtype)
