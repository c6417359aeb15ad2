"""Paged KV caches: keys and values in a pool of fixed-size blocks, each sequence reading its
own blocks through a block table (the layout of vLLM and ``flash_attn_with_kvcache``).

- :func:`paged_attention`: attention of ``q [B, Hq, Tq, D]`` over pools ``[num_blocks,
  block_size, Hkv, D]`` read through ``block_table [B, max_blocks]`` up to ``seqlens [B]``.
- :class:`PagedKVCache`: the pool with its tables kept on the host (append, fork, free,
  reorder), for :class:`attnkit.nn.MultiHeadAttention` or by hand.

On CPU the keys and values of a call are gathered from the pool into one ``[B, Hkv, T, D]``
tensor (zeros past each sequence's length) and attended like a contiguous cache: any mask
and score modifier applies. Sharing blocks between sequences (forks, beam search, a common
prompt) costs no pool memory; each sequence's gathered keys are its own.
"""

from __future__ import annotations

import math
import numbers
from itertools import accumulate, chain
from typing import Literal, NamedTuple, Optional, Sequence, Union, overload

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

from . import dispatch, invariance
from .api import AttentionResult, MaskLike, _autocast, attention, autocast_call, autocast_device
from .finite import looks_at_keys, query_and_output_flags
from .inputs import FLOAT_DTYPES, checked_scale, refuse_jit_trace, unexpected_keywords
from .masks import (Mask, an_int, as_mask, causal, integer_tensor, readable,
                    vouched_padding)
from .modifiers import per_sequence, split
from .numerics import accum_dtype, merge_into


# ---- reading a pool through block tables ------------------------------------------------------
def gather(key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
           seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` positions of every sequence's keys and values, read through its
    blocks: ``(keys, values)`` ``[B, Hkv, length, D]`` (views of new tensors), zeros past
    ``seqlens[b]`` (so nothing a sequence does not own is ever attended, whatever the pool
    holds there). ``block_table [B, ≥ ceil(length / block_size)]`` long, ``seqlens [B]``
    long, on the pools' device; no value is read on the host."""
    block_size = key_pool.shape[1]
    positions = torch.arange(length, device=key_pool.device)  # [T]
    valid = positions[None, :] < seqlens[:, None]  # [B, T]
    blocks = block_table[:, positions // block_size].where(valid, 0)  # [B, T]
    offsets = (positions % block_size).expand_as(blocks)
    out = []
    for pool in (key_pool, value_pool):
        rows = pool[blocks, offsets]  # [B, T, Hkv, D]: a copy of these slots (any pool strides)
        out.append(rows.masked_fill_(~valid[:, :, None, None], 0).transpose(1, 2))
    return out[0], out[1]


def table_tensor(tables: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Block tables (host lists, one per sequence) as long ``[B, max_blocks]`` on ``device``,
    rows padded with block 0 past their blocks (never read: positions past a sequence's
    length are not looked up)."""
    width = max([len(t) for t in tables], default=0) or 1
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device).reshape(len(tables), width)


def token_slots(table: torch.Tensor, starts: torch.Tensor, counts: Sequence[int],
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``counts[b]`` (host integers) consecutive positions of each sequence from
    ``starts[b]``, flattened in sequence order: ``(rows, offsets, slots)``, each ``[Σ counts]``
    long — the sequence, the offset from its start, and the pool row (``[num_blocks ·
    block_size]``) through ``table [B, max_blocks]``. Reads no value (meta tensors too)."""
    total = sum(counts)
    counts = torch.tensor(list(counts), dtype=torch.long, device=table.device)
    rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=table.device), counts,
                                   output_size=total)
    offsets = torch.arange(rows.shape[0], device=table.device) - (counts.cumsum(0) - counts)[rows]
    positions = starts[rows] + offsets
    return rows, offsets, table[rows, positions // block_size] * block_size + positions % block_size


def decode(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
           tables: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]],
           scale: Optional[float], return_lse: bool, runs: Optional[dict] = None,
           ) -> Union[torch.Tensor, AttentionResult]:
    """A decoding step read in place by runs of blocks (:func:`decode_by_runs`; ``runs``:
    its :func:`shared_runs` when known), returned as :func:`attnkit.attention` returns it
    (:func:`decode_result`)."""
    out, lse = decode_by_runs(q, key_pool, value_pool, tables, spans,
                              checked_scale(scale, q.shape[-1]), runs)
    return decode_result(q, out, lse, return_lse)


@overload
def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_table, seqlens, *, cu_seqlens_q=None, mask: MaskLike = None,
                    scale: Optional[float] = None, backend: str = "auto",
                    return_lse: Literal[False] = False) -> torch.Tensor: ...


@overload
def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_table, seqlens, *, cu_seqlens_q=None, mask: MaskLike = None,
                    scale: Optional[float] = None, backend: str = "auto",
                    return_lse: Literal[True]) -> AttentionResult: ...


@overload
def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_table, seqlens, *, cu_seqlens_q=None, mask: MaskLike = None,
                    scale: Optional[float] = None, backend: str = "auto",
                    return_lse: bool = False) -> Union[torch.Tensor, AttentionResult]: ...


def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_table, seqlens, *, cu_seqlens_q=None, mask: MaskLike = None,
                    scale: Optional[float] = None, backend: str = "auto",
                    return_lse: bool = False, **unexpected) -> Union[torch.Tensor, AttentionResult]:
    """Attention of ``q [B, Hq, Tq, Dk]`` over paged keys and values.

    ``key_pool [num_blocks, block_size, Hkv, Dk]``, ``value_pool [num_blocks, block_size,
    Hkv, Dv]``; ``block_table [B, max_blocks]`` (integers): sequence b's position p lies in
    block ``block_table[b, p // block_size]`` at offset ``p % block_size``; ``seqlens [B]``:
    sequence b's number of keys (at most ``max_blocks · block_size``). Entries past a
    sequence's blocks are not read. Returns ``out [B, Hq, Tq, Dv]``, or an
    :class:`~attnkit.AttentionResult` with ``lse [B, Hq, Tq]`` when ``return_lse``.

    ``mask`` applies per sequence over its own keys: ``causal(align)`` and
    ``sliding_window(...)`` are aligned to each sequence (bottom-right: its last query sees
    its last key, as ``flash_attn_with_kvcache``'s ``causal``), and the score modifiers join
    by ``&`` (ALiBi with one query per sequence, where its alignment adds a constant per
    row; relative biases are refused: their buckets would read a decoding query at position
    0). The table and lengths are read once on the host to check them (block ids in
    range, no block twice in one sequence, lengths within the blocks).

    ``cu_seqlens_q`` (``[B + 1]``, as :func:`attnkit.varlen_attention` takes it): ``q`` is
    packed ``[total_q, Hq, Dk]``, sequence b's queries at ``cu_seqlens_q[b]:cu_seqlens_q[b +
    1]`` (chunked prefill of several prompts over their caches); the result is packed too,
    as :func:`attnkit.varlen_attention` returns it, over the sequences' keys packed from
    the pool.

    A decoding step (one query per sequence, CPU, no autograd, no mask but a bottom-right
    band, gathered keys too many for :func:`attnkit.attention` to look at them for non-finite
    values) reads the pool by runs of consecutive blocks: a long run in place (one fused-kernel
    call), a run shared by several sequences once for all of them, the short rest of every
    sequence in one batched call (:func:`decode_by_runs`). On the triton kernel (CUDA with
    ``backend="auto"``, or ``backend="triton"``), a call without autograd and with no mask
    but a bottom-right band (a decoding step, a chunk of prefill) reads every key tile's
    blocks through the table, a prompt forks share once for all of them (:func:`kernel_decode`).
    Any other call gathers each sequence's keys and values first.

    Keyword arguments of ``flash_attn_with_kvcache`` and torch SDPA that attnkit spells
    differently (``causal``, ``softmax_scale``, ``window_size``, ...) raise ``TypeError``
    with the attnkit spelling.
    """
    if unexpected:
        raise unexpected_keywords(paged_attention, unexpected)
    if not all(isinstance(t, torch.Tensor) for t in (q, key_pool, value_pool)):
        raise TypeError("paged_attention takes q, key_pool and value_pool as torch.Tensors")
    refuse_jit_trace("paged_attention")
    if autocast_device(q) is not None:  # the inputs in its dtype, as attention() takes them
        return autocast_call(paged_attention, q, key_pool, value_pool, block_table, seqlens,
                             cu_seqlens_q=cu_seqlens_q, mask=mask, scale=scale,
                             backend=backend, return_lse=return_lse)
    if cu_seqlens_q is not None:
        return _packed_queries(q, key_pool, value_pool, block_table, seqlens, cu_seqlens_q,
                               mask=mask, scale=scale, backend=backend, return_lse=return_lse)
    table, lengths = _checked_tables(q, key_pool, value_pool, block_table, seqlens)
    given = as_mask(mask)
    band = kernel_band(q, key_pool, value_pool, given, backend)
    if band is not None:
        out, lse = kernel_decode(q, key_pool, value_pool, table_tensor(table, q.device), table,
                                 lengths, band, scale)
        return decode_result(q, out, lse, return_lse)
    spans = decode_spans(q, key_pool, value_pool, given, lengths, backend)
    if spans is not None:
        return decode(q, key_pool, value_pool, table, spans, scale, return_lse)
    seqlens_t = torch.tensor(lengths, dtype=torch.long, device=q.device)
    keys, values = gather(key_pool, value_pool, table_tensor(table, q.device), seqlens_t,
                          max(lengths, default=0))
    per_sequence = sequence_mask(given, vouched_padding(None, seqlens_t), q.shape[-2],
                                 return_lse)
    return attention(q, keys, values, per_sequence, scale=scale, backend=backend,
                     return_lse=return_lse)


def _packed_queries(q, key_pool, value_pool, block_table, seqlens, cu_seqlens_q, *, mask,
                    scale, backend, return_lse) -> Union[torch.Tensor, AttentionResult]:
    """:func:`paged_attention` with packed queries: each sequence's keys and values packed
    from the pool ``[total_k, Hkv, D]``, then :func:`attnkit.varlen_attention`."""
    from .varlen import varlen_attention

    if q.dim() != 3:
        raise ValueError(f"paged_attention with cu_seqlens_q takes packed q [total_q, Hq, D], "
                         f"got q {tuple(q.shape)}")
    batch = len(_integers("cu_seqlens_q", cu_seqlens_q, 1)) - 1
    table, lengths = _checked_tables(q, key_pool, value_pool, block_table, seqlens, batch)
    block_size = key_pool.shape[1]
    _, _, slots = token_slots(table_tensor(table, q.device),
                              torch.zeros(len(lengths), dtype=torch.long, device=q.device),
                              lengths, block_size)  # [total_k]
    keys, values = (pool[slots // block_size, slots % block_size]  # [total_k, Hkv, D]
                    for pool in (key_pool, value_pool))
    cu_k = [0, *accumulate(lengths)] if lengths else [0]
    return varlen_attention(q, keys, values, cu_seqlens_q, cu_k, mask=mask, scale=scale,
                            backend=backend, return_lse=return_lse)


def _checked_tables(q, key_pool, value_pool, block_table, seqlens,
                    batch: Optional[int] = None, *, caller: str = "paged_attention",
                    ) -> tuple[list, list]:
    """``(table, lengths)`` as host lists after checking them against the pools (one read of
    each); ``ValueError``/``TypeError`` naming the offending sequence. ``batch``: the
    sequences of packed queries (``q [total_q, Hq, D]``), else q's batch. ``caller``:
    ``"PagedKVCache.from_tables"`` names its own arguments (``block_tables``, ``lengths``;
    ``q`` is then a probe of the pools' dtype and device, never named)."""
    tables = caller == "PagedKVCache.from_tables"
    table_name, lengths_name = ("block_tables", "lengths") if tables else ("block_table",
                                                                           "seqlens")
    where = ("" if tables else f"q {tuple(q.shape)}, ") + (
        f"key_pool {tuple(key_pool.shape)}, value_pool {tuple(value_pool.shape)}")
    if q.dim() != (4 if batch is None else 3) or key_pool.dim() != 4 or value_pool.dim() != 4:
        takes = ("" if tables else
                 "q [B, Hq, Tq, D] (packed [total_q, Hq, D] with cu_seqlens_q) and ")
        raise ValueError(f"{caller} takes {takes}pools [num_blocks, block_size, Hkv, D], got "
                         f"{where}")
    if key_pool.shape[:3] != value_pool.shape[:3]:
        raise ValueError(f"key_pool and value_pool must share num_blocks, block_size and Hkv, "
                         f"got {where}")
    if not tables and (q.shape[1] % key_pool.shape[2] or q.shape[-1] != key_pool.shape[-1]):
        raise ValueError(f"{caller} needs q's heads (dim 1) a multiple of the pools' Hkv "
                         f"(dim 2) and q's head dim equal to key_pool's, got {where}")
    if q.dtype not in FLOAT_DTYPES:  # (from_tables' probe has key_pool's dtype)
        got = "" if tables else f"q {q.dtype}, "
        raise TypeError(f"{caller} needs floating point {'' if tables else 'q and '}pools "
                        f"(float64/float32/float16/bfloat16), got {got}key_pool "
                        f"{key_pool.dtype}: convert them, e.g. with .float()")
    if (key_pool.dtype != q.dtype or value_pool.dtype != q.dtype
            or not q.device == key_pool.device == value_pool.device):
        pools = (f"key_pool {key_pool.dtype} {key_pool.device}, value_pool {value_pool.dtype} "
                 f"{value_pool.device}")
        if tables:
            raise TypeError(f"{caller}: key_pool and value_pool must share one dtype and "
                            f"device, got {pools}: cast with value_pool.to(key_pool)")
        raise TypeError(f"q and the pools must share one dtype and device, got q {q.dtype} "
                        f"{q.device}, {pools} (under torch.autocast q is in the autocast "
                        f"dtype: fill and read a cache on the same side of autocast)")
    num_blocks, block_size = key_pool.shape[:2]
    table = _integers(table_name, block_table, 2)
    lengths = _integers(lengths_name, seqlens, 1)
    batch = (len(table) if tables else q.shape[0]) if batch is None else batch
    if len(table) != batch or len(lengths) != batch:
        of = "each" if tables else f"of q (B = {batch})"
        raise ValueError(f"{table_name} [B, max_blocks] and {lengths_name} [B] must have one "
                         f"row per sequence {of}, got {len(table)} and {len(lengths)}")
    for seq, (row, count) in enumerate(zip(table, lengths)):
        needed = -(-count // block_size)
        if count < 0:
            raise ValueError(f"{lengths_name}[{seq}] = {count}: a sequence holds 0 or more "
                             f"tokens")
        if needed > len(row):
            raise ValueError(f"{lengths_name}[{seq}] = {count} but sequence {seq} has "
                             f"{len(row)} blocks of {block_size} positions: at most "
                             f"{len(row) * block_size}")
        live = row[:needed]
        bad = [b for b in live if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"{table_name}[{seq}] names block {bad[0]}, outside the pool of "
                             f"{num_blocks} blocks")
        if len(set(live)) != len(live):
            twice = next(b for b in live if live.count(b) > 1)
            raise ValueError(f"{table_name}[{seq}] holds block {twice} twice among its "
                             f"{needed} live blocks: each position needs its own slot")
    return table, lengths


def _integers(name: str, value, dims: int) -> list:
    """``value`` (a tensor or nested lists of integers, ``dims`` dims) as host lists."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must be integers, got {value.dtype}")
        if value.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims, got shape {tuple(value.shape)}")
        if value.device.type == "meta" or is_fake(value):
            raise ValueError(f"{name} is read on the host, but a {value.device.type} tensor "
                             f"holds no values: pass it as a list or a CPU tensor (a shape-only "
                             f"call keeps the tables real)")
        return value.tolist()
    try:
        as_tensor = integer_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be integers ({dims}-D), got {type(value).__name__}") from None
    return _integers(name, as_tensor, dims)


def sequence_mask(mask: Optional[Mask], sequences: Mask, q_len: int, lse: bool) -> Mask:
    """``mask`` applied per sequence over ``sequences`` (a padding of each sequence's keys,
    :func:`~attnkit.modifiers.per_sequence`): ALiBi with one query per sequence only, where
    a bottom-right alignment adds a constant per row (the gathered keys' length is not the
    sequence's), which softmax ignores but sinks and the LSE do not: refused with either
    (``lse``: whether the call returns it). Relative biases are refused: their buckets would
    read a decoding query at position 0, not at its own."""
    _, modifiers = split(mask)
    if modifiers is not None and modifiers.relative:
        raise ValueError("a paged call does not take relative_bias: its buckets read each "
                         "query's position in the call (a decoding query at 0), not in its "
                         "sequence, so they would be wrong; attend a contiguous cache with "
                         "the step's bias as a tensor (attnkit.bias) instead")
    if (modifiers is not None and (modifiers.sinks or lse)
            and any(part.align == "bottom_right" for part in modifiers.alibi)):
        raise ValueError(f"a paged call does not take alibi(align='bottom_right') with "
                         f"{'sinks' if modifiers.sinks else 'return_lse=True'}: it would "
                         f"align each query with the last of the gathered keys, not of its "
                         f"sequence, a constant per row that softmax ignores but the sinks' "
                         f"share and the LSE do not. Pass the step's ALiBi bias as a tensor "
                         f"(attnkit.bias) instead")
    positions = None if q_len == 1 else (
        f"with one query per sequence (got {q_len}): with more, their alignment differs per "
        f"sequence; attend a contiguous cache for this")
    return per_sequence(mask, sequences, call="a paged call", positions=positions)


# ---- decoding by runs of blocks ----------------------------------------------------------
def decode_spans(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                 mask: Optional[Mask], lengths: Sequence[int],
                 backend: str) -> Optional[list[tuple[int, int]]]:
    """The keys ``(first, stop)`` each sequence's one query sees, when :func:`decode_by_runs`
    can run the call: a decoding step (one query per sequence) on CPU tensors holding values
    (not fake) without autograd, ``backend="auto"``, equal key and value head dims (the fused
    kernel's), and no mask but a bottom-right causal band (all keys, or a window's last
    ones), over keys that :func:`attnkit.attention` would not look at for non-finite values
    (:func:`~attnkit.finite.looks_at_keys` of the keys it would gather), from pools
    :func:`decode_by_runs` reads in place (:func:`_runs_in_place`); ``None`` otherwise (the
    gathered path runs it, and validates it); ``None`` under the invariance contract too,
    whose fixed schedule the gathered call keeps (:mod:`attnkit.invariance`)."""
    gathered = len(lengths) * max(lengths, default=0) * math.prod(key_pool.shape[2:])
    if (dispatch.forced(backend) != "auto" or invariance.active(None) or q.device.type != "cpu"
            or not all(_runs_in_place(pool) for pool in (key_pool, value_pool))
            or not readable(q, key_pool, value_pool)
            or q.dim() != 4 or q.shape[2] != 1 or not q.is_floating_point()
            or looks_at_keys(1, gathered)
            or q.dtype != key_pool.dtype or q.shape[-1] != key_pool.shape[-1]
            or value_pool.shape[-1] != q.shape[-1]
            or q.shape[1] % key_pool.shape[2] or q.shape[0] != len(lengths)
            or (torch.is_grad_enabled() and q.requires_grad)):
        return None
    left = None
    if mask is not None:
        band = None if mask.modifies else mask.band()
        if band is None or band.align != "bottom_right" or band.right is None or band.right < 0:
            return None
        left = band.left
    return [(0 if left is None else max(0, n - 1 - left), n) for n in lengths]


def _runs_in_place(pool: torch.Tensor) -> bool:
    """Whether :func:`decode_by_runs` can read runs of ``pool [num_blocks, block_size, Hkv,
    D]`` as views: its block and slot dims merge into one axis of slots (else the pool would
    be copied whole; e.g. a ``[num_blocks, Hkv, block_size, D]`` pool transposed), and its
    last dim D is contiguous (the fused CPU kernel reads each key's row as contiguous
    memory, whatever its strides say)."""
    return ((min(pool.shape[:2]) <= 1 or pool.stride(0) == pool.shape[1] * pool.stride(1))
            and (pool.shape[-1] <= 1 or pool.stride(-1) == 1))


def decode_result(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, return_lse: bool,
                  ) -> Union[torch.Tensor, AttentionResult]:
    """:func:`decode_by_runs`'s result as :func:`attnkit.attention` returns it, with every
    row whose query or output holds a non-finite value NaN (the fused kernel returns a row of
    NaN scores as 0: :mod:`attnkit.finite`)."""
    flag = query_and_output_flags(out, q)  # [B, Hq, 1, 1]
    out = out + flag
    if not return_lse:
        return out
    return AttentionResult(out, lse + flag[..., 0].to(lse.dtype), None)


def shared_runs(tables: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]],
                block_size: int) -> dict[tuple[int, int], list[int]]:
    """The pool slots each sequence reads, logical positions ``spans[b] = (first, stop)``
    through its blocks ``tables[b]``, as runs of consecutive pool slots ``(slot_start,
    slot_stop)`` (pool rows ``[num_blocks · block_size]``), each with the sequences reading
    it, in order. A run ends where the next block is not the next in the pool or is held by
    a different number of these sequences, so a run several sequences share is one run of
    all of them (whose other runs are their own)."""
    return _shared_runs(tables, spans, block_size)[0]


class StepRuns(NamedTuple):
    """The runs of one decoding step (:func:`shared_runs`), with what the next step needs to
    update them instead of finding them again (:func:`step_runs`): the tables (the lists
    themselves, which no code changes in place) and spans they were found for, and each
    sequence's last run (``None``: it reads no key)."""

    tables: tuple
    spans: tuple
    runs: dict
    last: list


def step_runs(previous: Optional[StepRuns], tables: Sequence[Sequence[int]],
              spans: Sequence[tuple[int, int]], block_size: int) -> StepRuns:
    """The runs of a step (:func:`shared_runs`): ``previous``'s, each sequence's last run
    lengthened, where the tables are the same lists and every sequence that moved only
    moved its end within its last block, a run no other sequence reads (a decoding step that
    took no new block); else found anew."""
    if (previous is not None and len(previous.tables) == len(tables)
            and all(a is b for a, b in zip(previous.tables, tables))):
        moved, runs = {}, previous.runs
        for last, (first, stop), (first_now, stop_now) in zip(previous.last, previous.spans,
                                                              spans):
            if (first, stop) == (first_now, stop_now):
                continue
            if (first != first_now or stop_now < stop or last is None or len(runs[last]) != 1
                    or -(-stop // block_size) != -(-stop_now // block_size)):
                moved = None
                break
            moved[last] = (last[0], last[1] + stop_now - stop)
        if moved is not None:
            return StepRuns(tuple(tables), tuple(spans),
                            {moved.get(key, key): seqs for key, seqs in runs.items()},
                            [None if key is None else moved.get(key, key)
                             for key in previous.last])
    runs, last = _shared_runs(tables, spans, block_size)
    return StepRuns(tuple(tables), tuple(spans), runs, last)


def _shared_runs(tables, spans, block_size) -> tuple[dict, list]:
    """:func:`shared_runs`, and each sequence's last run (its key, or ``None``)."""
    live = [table[first // block_size:-(-stop // block_size)] if first < stop else []
            for table, (first, stop) in zip(tables, spans)]
    counts = [len(blocks) for blocks in live]
    blocks = np.fromiter(chain.from_iterable(live), dtype=np.int64, count=sum(counts))
    last: list = [None] * len(live)
    if not blocks.size:
        return {}, last
    seq = np.repeat(np.arange(len(live)), counts)
    held = np.bincount(blocks)[blocks]
    new = np.ones(blocks.size, dtype=bool)
    new[1:] = (blocks[1:] != blocks[:-1] + 1) | (held[1:] != held[:-1]) | (seq[1:] != seq[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], blocks.size)
    slot_start, slot_stop = blocks[starts] * block_size, (blocks[ends - 1] + 1) * block_size
    ends_of = np.cumsum(counts)[np.asarray(counts) > 0]  # past each sequence's last block
    first, stop = np.array(spans, dtype=np.int64).reshape(-1, 2).T
    edge = np.zeros((2, blocks.size), dtype=bool)  # a sequence's first block, its last block
    edge[0, ends_of - np.asarray(counts)[np.asarray(counts) > 0]] = True
    edge[1, ends_of - 1] = True
    opening, closing = edge[0, starts], edge[1, ends - 1]
    slot_start[opening] += first[seq[starts[opening]]] % block_size
    slot_stop[closing] -= -stop[seq[starts[closing]]] % block_size
    runs: dict[tuple[int, int], list[int]] = {}
    for run in zip(slot_start.tolist(), slot_stop.tolist(), seq[starts].tolist()):
        runs.setdefault(run[:2], []).append(run[2])
        last[run[2]] = run[:2]
    return runs, last


SHORT_RUN = 256
"""Keys of a run one sequence holds alone below which :func:`decode_by_runs` reads it in one
batched call with the other sequences' short runs instead of a fused-kernel call of its own
(a call costs about what copying a few hundred keys does)."""


def decode_by_runs(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                   tables: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]],
                   scale: float, runs: Optional[dict] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its keys ``spans[b] = (first, stop)`` (logical positions)
    read from the pool: ``q [B, Hq, 1, Dk]`` → ``(out [B, Hq, 1, Dv], lse [B, Hq, 1])`` (LSE
    in the accumulation dtype; output 0 and LSE −inf for an empty span).

    The keys are read by maximal runs of consecutive pool slots. A run several sequences hold
    (a shared prompt, beam search) or of :data:`SHORT_RUN` keys or more is one fused-kernel
    call on a view of the pool (no copy) whose query rows are those of every sequence holding
    it, so a shared run is read once; the short runs each sequence holds alone (its own
    latest tokens) are copied out and read together in one batched call. The pieces merge by
    their log-sum-exp: pairwise in place when each covers every sequence (forks of one
    prompt, each with its own tokens), else by a scatter over the sequences. ``runs``: the
    step's :func:`shared_runs` when the caller kept them (:func:`step_runs`). CPU, no
    autograd: :meth:`PagedKVCache.attend` chooses it."""
    batch, heads_q = q.shape[:2]
    heads_kv = key_pool.shape[2]
    group = heads_q // heads_kv
    # [B, Hkv, G, Dk]: a query's heads, contiguous (the fused kernel reads rows as contiguous)
    rows_of = q.reshape(batch, heads_kv, group, q.shape[-1]).contiguous()
    holders = shared_runs(tables, spans, key_pool.shape[1]) if runs is None else runs
    keys = key_pool.reshape(-1, heads_kv, key_pool.shape[-1])  # [slots, Hkv, Dk]
    values = value_pool.reshape(-1, heads_kv, value_pool.shape[-1])
    outs, lses, targets, covered = [], [], [], []  # covered: each piece's sequences (host)
    short: dict[int, list[tuple[int, int]]] = {}
    for (start, stop), seqs in holders.items():
        if len(seqs) == 1 and stop - start < SHORT_RUN:
            short.setdefault(seqs[0], []).append((start, stop))
            continue
        index = torch.tensor(seqs, device=q.device)
        rows = rows_of[index].permute(1, 0, 2, 3).reshape(1, heads_kv, -1, q.shape[-1])
        k_run = keys[start:stop].permute(1, 0, 2)[None]  # [1, Hkv, L, Dk]: a view
        v_run = values[start:stop].permute(1, 0, 2)[None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            rows, k_run, v_run, 0.0, False, scale=scale)[:2]
        outs.append(out[0].unflatten(1, (len(seqs), group)).transpose(0, 1))  # [n, Hkv, G, Dv]
        lses.append(lse[0].unflatten(1, (len(seqs), group)).transpose(0, 1))  # [n, Hkv, G]
        targets.append(index)
        covered.append(seqs)
    if short:
        index = torch.tensor(list(short), device=q.device)
        out, lse = _short_runs(rows_of[index], keys, values, list(short.values()), scale)
        outs.append(out)
        lses.append(lse)
        targets.append(index)
        covered.append(list(short))
    dv = value_pool.shape[-1]
    if not outs:
        return (q.new_zeros(batch, heads_q, 1, dv), torch.full(
            (batch, heads_q, 1), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device))
    acc = accum_dtype(q.dtype)
    if all(seqs == list(range(batch)) for seqs in covered):  # each piece: every sequence
        out, lse = outs[0].to(acc), lses[0].to(acc)  # the kernel's own results: merged in place
        for other_out, other_lse in zip(outs[1:], lses[1:]):
            merge_into(out, lse, other_out.to(acc), other_lse.to(acc))
        return (out.to(q.dtype).reshape(batch, heads_q, 1, dv), lse.reshape(batch, heads_q, 1))
    out, lse, target = torch.cat(outs).to(acc), torch.cat(lses).to(acc), torch.cat(targets)
    top = torch.full((batch, heads_kv, group), float("-inf"), dtype=acc, device=q.device)
    top = top.scatter_reduce(0, target[:, None, None].expand_as(lse), lse, "amax")  # [B, Hkv, G]
    weight = torch.exp(lse - top[target])  # [pieces, Hkv, G]
    total = torch.zeros_like(top).index_add(0, target, weight)
    merged = torch.zeros(batch, heads_kv, group, dv, dtype=acc, device=q.device)
    merged = merged.index_add(0, target, out * weight[..., None])
    empty = total == 0  # no key at all
    merged = (merged / total.masked_fill(empty, 1.0)[..., None]).to(q.dtype)
    lse_all = (top + torch.log(total)).masked_fill(empty, float("-inf"))
    return merged.reshape(batch, heads_q, 1, dv), lse_all.reshape(batch, heads_q, 1)


def _short_runs(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                runs: list[list[tuple[int, int]]], scale: float,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``rows [n, Hkv, G, Dk]`` of n sequences over the pool slots of their
    ``runs`` (per sequence, ``(slot_start, slot_stop)`` pairs, at least one key), copied out
    of ``keys``/``values`` ``[slots, Hkv, D]`` into one padded batch read by one fused-kernel
    call under a key bias: ``(out [n, Hkv, G, Dv], lse [n, Hkv, G])``. A sequence's padding
    repeats its first slot (a key it attends, so nothing it does not own is read)."""
    pieces = [run for seq_runs in runs for run in seq_runs]
    starts, stops = np.array(pieces, dtype=np.int64).reshape(-1, 2).T
    sizes = stops - starts
    if len(pieces) == len(runs):  # one run each: its slots, then its first slot repeated
        counts, width = sizes, int(sizes.max())
        columns = np.arange(width)
        index = starts[:, None] + np.where(columns < sizes[:, None], columns, 0)  # [n, L]
    else:
        seq_of = np.repeat(np.arange(len(runs)), [len(seq_runs) for seq_runs in runs])
        counts = np.bincount(seq_of, weights=sizes, minlength=len(runs)).astype(np.int64)
        before = np.cumsum(sizes) - sizes  # keys of the runs before each run, all sequences
        column = before - (np.cumsum(counts) - counts)[seq_of]  # its first key's column
        run_of = np.repeat(np.arange(sizes.size), sizes)  # per key
        step = np.arange(run_of.size) - before[run_of]
        width = int(counts.max())
        index = np.repeat(starts[column == 0][:, None], width, axis=1)  # [n, L]
        index[seq_of[run_of], column[run_of] + step] = starts[run_of] + step
    outside = torch.from_numpy(np.arange(width)[None, :] >= counts[:, None]).to(rows.device)
    bias = rows.new_zeros(outside.shape).masked_fill_(outside, float("-inf"))  # [n, L]
    flat = torch.from_numpy(index).to(rows.device).view(-1)
    n, heads_kv = rows.shape[:2]
    k, v = (t.index_select(0, flat).view(n, width, heads_kv, -1).transpose(1, 2)
            for t in (keys, values))  # [n, Hkv, L, D]: copies, whatever the pools' strides
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, k, v, 0.0, False, attn_mask=bias[:, None, None, :], scale=scale)[:2]
    return out, lse


# ---- decoding on the split-key kernel (triton) --------------------------------------------------
def kernel_band(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                mask: Optional[Mask], backend: str,
                ) -> Optional[tuple[Optional[int], Optional[int]]]:
    """The band ``(left, right)`` (``None``: unbounded) of a step the triton split-key kernel
    runs reading blocks through the table (:func:`kernel_decode`): ``backend="triton"``, or
    ``"auto"`` on CUDA with triton usable; no autograd; float32, float16 or bfloat16; no mask
    but a bottom-right band; not under the invariance contract. ``None`` otherwise."""
    backend = dispatch.forced(backend)  # (auto inside use_backend(name) means name)
    if (backend not in ("triton", "auto") or (backend == "auto" and q.device.type != "cuda")
            or invariance.active(None)):  # (the gathered call keeps the fixed schedule)
        return None
    from .backends.triton import TritonBackend

    heads_kv = key_pool.shape[2]
    if (TritonBackend().unavailable_reason() is not None
            or not readable(q, key_pool, value_pool) or q.dim() != 4
            or q.dtype not in (torch.float32, torch.float16, torch.bfloat16)
            or q.shape[1] % heads_kv
            or max(q.shape[-1], value_pool.shape[-1]) > TritonBackend.MAX_HEAD_DIM
            or (torch.is_grad_enabled()
                and any(t.requires_grad for t in (q, key_pool, value_pool)))):
        return None
    if mask is None:
        return None, None
    band = None if mask.modifies else mask.band()
    if band is None or band.align != "bottom_right":
        return None
    return band.left, band.right


def shared_prefixes(tables: Sequence[Sequence[int]], lengths: Sequence[int],
                    block_size: int) -> list[tuple[list[int], list[int], int]]:
    """Prompts several sequences share, as ``(members, blocks, keys)``: the sequences
    ``members`` all begin with the pool blocks ``blocks`` holding their first ``keys``
    positions. A sequence's shared prefix is its leading blocks that other sequences of the
    call hold too; sequences with the same prefix form one entry (a prefix only one sequence
    has is not shared)."""
    live = [list(t[:-(-n // block_size)]) for t, n in zip(tables, lengths)]
    held = np.bincount(np.fromiter(chain.from_iterable(live), dtype=np.int64),
                       minlength=1).tolist()
    groups: dict[tuple, list[int]] = {}
    for seq, (blocks, count) in enumerate(zip(live, lengths)):
        lead = next((i for i, b in enumerate(blocks) if held[b] < 2), len(blocks))
        if lead:
            groups.setdefault((tuple(blocks[:lead]), min(count, lead * block_size)),
                              []).append(seq)
    return [(members, list(blocks), keys) for (blocks, keys), members in groups.items()
            if len(members) > 1]


def kernel_decode(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                  table: torch.Tensor, tables: Sequence[Sequence[int]], lengths: Sequence[int],
                  band: tuple[Optional[int], Optional[int]], scale: Optional[float],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step of ``q [B, Hq, Tq, Dk]`` on the triton split-key kernel, every key tile's blocks
    read through ``table [B, max_blocks]`` (the device copy of ``tables``, host lists): query
    i of sequence b sees its keys within ``band`` (bottom-right: its position is ``lengths[b]
    − Tq + i``) → ``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq])``.

    With one query per sequence and no left bound, a prefix several sequences share
    (:func:`shared_prefixes`: forks of a prompt) is read once: one kernel launch over the
    prefix's blocks whose queries are all the members', then each sequence's keys past the
    prefix, the two merged by their log-sum-exp.
    Any number of queries: a prefill of many runs its query rows in blocks."""
    from .backends.triton import launch

    batch, heads_q, q_len, _ = q.shape
    scale = checked_scale(scale, q.shape[-1])
    device = q.device
    # a negative view (torch._neg_view) holds -t in memory, which the kernel reads as it lies
    q, key_pool, value_pool = (t.resolve_neg() for t in (q, key_pool, value_pool))
    if batch == 0 or q_len == 0:  # nothing to launch
        return (q.new_zeros(batch, heads_q, q_len, value_pool.shape[-1]),
                q.new_full((batch, heads_q, q_len), float("-inf"), dtype=torch.float32))
    counts = torch.tensor(lengths, dtype=torch.int32, device=device)  # [B]
    last = counts[:, None] - q_len + torch.arange(q_len, dtype=torch.int32, device=device)
    left, right = band
    hi = counts[:, None].expand(-1, q_len) if right is None else torch.minimum(
        (last + 1 + right).clamp(min=0), counts[:, None])
    lo = torch.zeros_like(hi) if left is None else (last - left).clamp(min=0)
    prefixes = shared_prefixes(tables, lengths, key_pool.shape[1]) \
        if q_len == 1 and left is None else []
    if prefixes:  # each member's own pass starts after its prefix
        skip = [0] * batch
        for members, _, keys in prefixes:
            for seq in members:
                skip[seq] = keys
        lo = torch.tensor(skip, dtype=torch.int32, device=device)[:, None]
    ranges = torch.stack([lo, hi], -1).to(torch.int32).contiguous()  # [B, Tq, 2]
    out, lse = launch.paged_decode(q, key_pool, value_pool, table, counts, ranges, scale)
    for members, blocks, keys in prefixes:
        index = torch.tensor(members, device=device)
        rows = q[index].transpose(0, 2)  # [1, Hq, m, Dk]: the members as queries
        one = torch.tensor([blocks], dtype=table.dtype, device=device)
        seen = torch.tensor([[[0, keys]] * len(members)], dtype=torch.int32, device=device)
        shared_out, shared_lse = launch.paged_decode(rows, key_pool, value_pool, one,
                                                     seen[:, 0, 1], seen, scale)
        own = (out[index], lse[index])
        out[index], lse[index] = _merged(own, (shared_out[0].transpose(0, 1)[:, :, None],
                                               shared_lse[0].transpose(0, 1)[:, :, None]))
    return out, lse


def _merged(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmaxes over disjoint keys ``(out, lse)`` merged into the one over all of them
    (output 0 and LSE −inf where neither has a key)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), 0.0, top)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    out = (out_a.float() * weight_a[..., None] + out_b.float() * weight_b[..., None]) \
        / torch.where(total == 0, 1.0, total)[..., None]
    return out.to(out_a.dtype), torch.where(total == 0, float("-inf"), top + torch.log(total))


# ---- the cache ---------------------------------------------------------------------------------
class PagedKVCache:
    """Keys and values of a batch of sequences in a pool of ``num_blocks`` blocks of
    ``block_size`` positions each, with a block table per sequence (kept on the host).

    Sequences are the batch rows, in order. The first :meth:`append` sizes the pools
    (``[num_blocks, block_size, Hkv, D]``, zeros) and makes one sequence per row; :meth:`add`
    starts new empty sequences (a request joining a running batch), :meth:`fork` a sequence
    sharing another's blocks (copy-on-write: the shared last block is copied when either
    writes to it), :meth:`free` ends sequences and returns their blocks, and
    :meth:`reorder` rebuilds the batch from existing rows (beam search). Mutable: each
    method changes this cache in place; a refused call (a full pool, bad lengths) changes
    nothing.

    What a layer attends over after an append: :attr:`keys` and :attr:`values`, every
    sequence's gathered ``[B, Hkv, T, D]`` (T the longest sequence, zeros past each one's
    length), and :meth:`mask`, as :class:`~attnkit.nn.KVCache` gives them, so
    :class:`~attnkit.nn.MultiHeadAttention` takes either cache.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache {name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.key_pool: Optional[torch.Tensor] = None
        self.value_pool: Optional[torch.Tensor] = None
        self.tables: list[list[int]] = []
        """Per sequence, its blocks in order (host lists)."""
        self.lengths: list[int] = []
        """Per sequence, its number of tokens."""
        self.appended: list[int] = []
        """Per sequence, the tokens the last :meth:`append` added."""
        self._holders = [0] * num_blocks  # sequences holding each block
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 first
        self._width = 0  # the positions per row of the last append's chunk
        self._device_state: Optional[tuple] = None  # block table, lengths, appended
        self._gathered: Optional[tuple] = None  # keys, values
        self._runs: Optional[StepRuns] = None  # the last decoding step's (step_runs)

    @classmethod
    def from_tables(cls, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables,
                    lengths) -> "PagedKVCache":
        """A cache over pools someone else filled (``[num_blocks, block_size, Hkv, D]``, as
        ``flash_attn_with_kvcache`` takes them): sequence b holds ``lengths[b]`` tokens in the
        blocks ``block_tables[b]`` (``[B, max_blocks]`` integers; entries past a sequence's
        blocks are ignored). A block several sequences name is shared (copied when one of them
        writes to it); blocks no sequence names are free. The pools are used in place."""
        if not isinstance(key_pool, torch.Tensor) or not isinstance(value_pool, torch.Tensor):
            raise TypeError("PagedKVCache.from_tables takes key_pool and value_pool as "
                            "torch.Tensors [num_blocks, block_size, Hkv, D]")
        probe = key_pool.new_empty(len(_integers("lengths", lengths, 1)), 1, 1, key_pool.shape[-1])
        table, counts = _checked_tables(probe, key_pool, value_pool, block_tables, lengths,
                                        caller="PagedKVCache.from_tables")
        cache = cls(key_pool.shape[0], key_pool.shape[1])
        cache.key_pool, cache.value_pool = key_pool, value_pool
        cache.tables = [row[:-(-n // cache.block_size)] for row, n in zip(table, counts)]
        cache.lengths, cache.appended = list(counts), [0] * len(counts)
        for row in cache.tables:
            for block in row:
                cache._holders[block] += 1
        cache._free = [b for b in range(cache.num_blocks - 1, -1, -1) if not cache._holders[b]]
        return cache

    # ---- the batch ----------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        """The number of sequences (the batch rows, B)."""
        return len(self.tables)

    @property
    def free_blocks(self) -> int:
        """Blocks of the pool no sequence holds."""
        return len(self._free)

    def add(self, count: int = 1) -> list[int]:
        """Start ``count`` empty sequences at the end of the batch; their rows."""
        if not an_int(count) or count < 0:
            raise ValueError(f"PagedKVCache.add(count={count!r}): pass the number of new "
                             f"sequences, an int >= 0")
        first = self.batch
        # new lists, never extended in place (a snapshot holds the old ones: _snapshot)
        self.tables = self.tables + [[] for _ in range(count)]
        self.lengths = self.lengths + [0] * count
        self.appended = self.appended + [0] * count
        self._changed()
        return list(range(first, first + count))

    def __copy__(self):
        raise TypeError("copy.copy(PagedKVCache) would share its pools, block tables and free "
                        "list, so appending to both would write the same blocks: copy it "
                        "whole with copy.deepcopy(cache), or add a sequence that shares a "
                        "row's blocks with cache.fork(row)")

    def fork(self, row: int) -> int:
        """A new sequence at the end of the batch holding sequence ``row``'s tokens, sharing
        its blocks (no copy until one of them writes to a shared block); its row."""
        (row,) = self._check_rows([row])
        for block in self.tables[row]:
            self._holders[block] += 1
        self.tables.append(list(self.tables[row]))
        self.lengths.append(self.lengths[row])
        self.appended.append(0)
        self._changed()
        return self.batch - 1

    def free(self, rows: Sequence[int]) -> None:
        """End the sequences at ``rows``: their blocks return to the pool (a block shared with
        a sequence that lives on stays); the other rows keep their order."""
        if an_int(rows):
            raise TypeError(f"PagedKVCache.free takes a list of rows, e.g. free([{rows}])")
        rows = sorted(set(self._check_rows(_integers("rows", rows, 1))))
        for row in rows:
            self._release(self.tables[row])
        keep = [r for r in range(self.batch) if r not in set(rows)]
        self._take_rows(keep)

    def reorder(self, index) -> None:
        """The batch rebuilt from existing rows: row i becomes old row ``index[i]`` (a row may
        appear several times: its copies share blocks; rows not named are freed), as a
        beam search keeps its best hypotheses."""
        index = self._check_rows(_integers("index", index, 1))
        for row in index:
            for block in self.tables[row]:
                self._holders[block] += 1
        old_tables = self.tables
        for table in old_tables:
            self._release(table)
        self._take_rows(index)

    def _take_rows(self, rows: list[int]) -> None:
        self.tables = [list(self.tables[r]) for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.appended = [self.appended[r] for r in rows]
        self._changed()

    def _release(self, table: list[int]) -> None:
        for block in table:
            self._holders[block] -= 1
            if self._holders[block] == 0:
                self._free.append(block)

    def _check_rows(self, rows) -> list[int]:
        """``rows`` (ints, numpy integers or 0-d integer tensors; ``[B']`` tensors are read by
        :func:`_integers` first) as Python ints, each a row of this cache."""
        found = []
        for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows):
            if not an_int(r) or not 0 <= int(r) < self.batch:
                raise ValueError(f"row {r!r} is not a sequence of this cache (rows 0.."
                                 f"{self.batch - 1})")
            found.append(int(r))
        return found

    # ---- writing -----------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor,
               lengths=None) -> "PagedKVCache":
        """Write ``keys [B, Hkv, t, D]`` / ``values [B, Hkv, t, Dv]`` after each sequence's
        tokens, in place (B = :attr:`batch`, or any B for a cache without sequences yet).
        ``lengths [B]`` (integers in ``[0, t]``): only the first ``lengths[b]`` of row b's t
        positions are real (a ragged chunk: prompts joining, or rows with nothing new).
        Returns this cache. Raises ``ValueError`` when the pool lacks the blocks, changing
        nothing."""
        self._check_step(keys, values)
        for name, pool in (("key_pool", self.key_pool), ("value_pool", self.value_pool)):
            if pool is not None and any(stride == 0 and size > 1
                                        for size, stride in zip(pool.shape, pool.stride())):
                raise ValueError(
                    f"PagedKVCache.append: the {name} {tuple(pool.shape)} has strides "
                    f"{pool.stride()}: a stride of 0 (an expand) makes one memory slot stand "
                    f"for several, which an append cannot write one at a time; build the cache "
                    f"from_tables over {name}.contiguous()")
        batch, new = keys.shape[0], keys.shape[2]
        if self.tables and batch != self.batch:
            raise ValueError(f"keys/values hold {batch} sequences but the cache has "
                             f"{self.batch}: one row per sequence, in order")
        counts = [new] * batch if lengths is None else _integers("lengths", lengths, 1)
        if len(counts) != batch or any(not 0 <= c <= new for c in counts):
            raise ValueError(f"lengths must be [B] = [{batch}] integers in [0, {new}], got "
                             f"{counts}")
        undo = None
        if not self.tables:  # the first append starts the batch (undone if the pool is full)
            undo = self._snapshot()
            self.add(batch)
        try:
            plan, copies = self._plan(counts)
        except ValueError:
            if undo is not None:
                self._restore(undo)
            raise
        if (self.key_pool is not None and self.key_pool.is_inference()
                and not torch.is_inference_mode_enabled()):  # (torch refuses writes into them)
            self.key_pool, self.value_pool = self.key_pool.clone(), self.value_pool.clone()
        if self.key_pool is None:
            shape = (self.num_blocks, self.block_size, keys.shape[1])
            self.key_pool = keys.new_zeros(*shape, keys.shape[3])
            self.value_pool = values.new_zeros(*shape, values.shape[3])
        for source, target in copies:  # copy-on-write of shared last blocks
            self.key_pool[target] = self.key_pool[source]
            self.value_pool[target] = self.value_pool[source]
        size = self.block_size
        if new == 1 and all(counts):  # a decoding step: each sequence's one slot, on the host
            blocks = torch.tensor([table[n // size] for table, n in zip(plan, self.lengths)],
                                  dtype=torch.long, device=keys.device)  # [B]
            within = torch.tensor([n % size for n in self.lengths], dtype=torch.long,
                                  device=keys.device)  # [B]
            for pool, new_rows in ((self.key_pool, keys), (self.value_pool, values)):
                pool[blocks, within] = new_rows[:, :, 0]
        elif any(counts):  # row b's offsets [0, counts[b]) go after its lengths[b] tokens
            device = keys.device
            tails = [table[length // size:] for table, length in zip(plan, self.lengths)]
            rows, offsets, slots = token_slots(  # positions counted from each tail's block
                table_tensor(tails, device), torch.tensor([n % size for n in self.lengths],
                                                          device=device), counts, size)
            blocks, within = slots // size, slots % size
            for pool, new_rows in ((self.key_pool, keys), (self.value_pool, values)):
                pool[blocks, within] = new_rows.transpose(1, 2)[rows, offsets]
        self.tables = plan
        self.lengths = [a + b for a, b in zip(self.lengths, counts)]
        self.appended, self._width = counts, new
        self._changed()
        return self

    def _plan(self, counts: list[int]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """The tables after writing ``counts`` tokens per sequence, and the block copies
        (``(source, target)``) copy-on-write needs, taking blocks from the free list; holder
        counts are updated only when the pool has room (else ``ValueError``, nothing
        changed)."""
        free, holders = self._free, self._holders
        copied = False  # the free list and holder counts, copied at their first change
        tables, copies = [], []
        size = self.block_size
        for seq, (table, length, count) in enumerate(zip(self.tables, self.lengths, counts)):
            shared_last = count and length % size and holders[table[-1]] > 1
            if not shared_last and len(table) * size >= length + count:
                tables.append(table)  # unchanged: no table is changed in place
                continue
            if not copied:
                free, holders, copied = list(free), list(holders), True
            table = list(table)
            if shared_last:
                if not free:
                    raise self._full(counts)
                fresh = free.pop()
                holders[table[-1]] -= 1
                holders[fresh] = 1
                copies.append((table[-1], fresh))
                table[-1] = fresh
            while len(table) * self.block_size < length + count:
                if not free:
                    raise self._full(counts)
                fresh = free.pop()
                holders[fresh] = 1
                table.append(fresh)
            tables.append(table)
        self._free, self._holders = free, holders
        return tables, copies

    def _full(self, counts) -> ValueError:
        return ValueError(f"PagedKVCache is full: appending {counts} tokens needs more than "
                          f"its {len(self._free)} free blocks of {self.block_size} (pool of "
                          f"{self.num_blocks}); free finished sequences or make a larger pool")

    def _check_step(self, keys, values) -> None:
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError("PagedKVCache.append takes keys and values as torch.Tensors "
                            "[B, Hkv, t, D]")
        where = (f"keys {tuple(keys.shape)} {keys.dtype}, values {tuple(values.shape)} "
                 f"{values.dtype}")
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"PagedKVCache.append takes keys and values [B, Hkv, t, D] with "
                             f"matching B, Hkv and t, got {where}")
        if keys.dtype != values.dtype or keys.dtype not in FLOAT_DTYPES:
            raise TypeError(f"keys and values must share one dtype of float64/float32/float16/"
                            f"bfloat16, got {where}")
        if self.key_pool is not None and (
                self.key_pool.shape[2:] != keys.shape[1:2] + keys.shape[3:]
                or self.value_pool.shape[3] != values.shape[3]
                or self.key_pool.dtype != keys.dtype or self.key_pool.device != keys.device):
            raise ValueError(f"new {where} on {keys.device} do not fit the pools (key_pool "
                             f"{tuple(self.key_pool.shape)} {self.key_pool.dtype} on "
                             f"{self.key_pool.device}): Hkv, head dims, dtype and device must "
                             f"match")

    # ---- reading -----------------------------------------------------------------------------
    def block_table(self) -> torch.Tensor:
        """The block tables as long ``[B, max_blocks]`` on the pools' device (rows padded with
        block 0 past their blocks)."""
        return self._state()[0]

    @property
    def keys(self) -> torch.Tensor:
        """Every sequence's keys gathered from the pool ``[B, Hkv, T, D]`` (T the longest
        sequence; zeros past each one's length), once per change of the cache: the cache's
        own tensor, which later calls read (copy it before writing into it)."""
        return self._gather()[0]

    @property
    def values(self) -> torch.Tensor:
        """Every sequence's values gathered ``[B, Hkv, T, Dv]``, as :attr:`keys`."""
        return self._gather()[1]

    def _snapshot(self) -> tuple:
        """What :meth:`append` changes, for :meth:`_restore`: the batch's lists, the free list
        and the holder counts (an append, its ``add`` and ``_plan`` included, replaces them,
        never writes them), the pools (a first append makes them). Slots an undone append
        wrote lie past the lengths."""
        return (self.tables, self.lengths, self.appended, self._width, self._free,
                self._holders, self._runs, self.key_pool, self.value_pool)

    def _restore(self, snapshot: tuple) -> None:
        """The cache as :meth:`_snapshot` found it (a step refused after its append)."""
        (self.tables, self.lengths, self.appended, self._width, self._free, self._holders,
         self._runs, self.key_pool, self.value_pool) = snapshot
        self._changed()

    def _changed(self) -> None:
        """Forget what was made from the tables and the pool (:meth:`_state`, :meth:`_gather`):
        the cache changed."""
        self._device_state = self._gathered = None

    def _state(self) -> tuple:
        """(block table, lengths, appended) on the pools' device, made once per change of the
        cache."""
        if self._device_state is None:
            if self.key_pool is None:
                raise ValueError("PagedKVCache holds no tokens yet: append first")
            device = self.key_pool.device
            self._device_state = (table_tensor(self.tables, device),
                                  torch.tensor(self.lengths, dtype=torch.long, device=device),
                                  torch.tensor(self.appended, dtype=torch.long, device=device))
        return self._device_state

    def _gather(self) -> tuple:
        """(keys, values) gathered through the tables, made once per change of the cache."""
        if self._gathered is None:
            table, lengths, _ = self._state()
            self._gathered = gather(self.key_pool, self.value_pool, table, lengths,
                                    max(self.lengths, default=0))
        return self._gathered

    def mask(self, is_causal: bool = True) -> Mask:
        """The mask of the last :meth:`append`'s queries over :attr:`keys`: each sequence's
        real new queries see its own keys, causally with ``is_causal`` (bottom-right: they
        are its last positions); a row's padded queries (past its appended count) see
        nothing."""
        real = self._sequences()
        return causal("bottom_right", sequences=real) if is_causal else real

    def _sequences(self) -> Mask:
        """Each sequence's real new queries and keys, as a (vouched) padding mask."""
        _, lengths, appended = self._state()
        if all(a == self._width for a in self.appended):
            return vouched_padding(None, lengths)  # every query real
        return vouched_padding(appended, lengths)

    @overload
    def attend(self, q: torch.Tensor, mask: MaskLike = None, *, is_causal: bool = True,
               scale: Optional[float] = None, backend: str = "auto",
               return_lse: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def attend(self, q: torch.Tensor, mask: MaskLike = None, *, is_causal: bool = True,
               scale: Optional[float] = None, backend: str = "auto",
               return_lse: Literal[True]) -> AttentionResult: ...

    @overload
    def attend(self, q: torch.Tensor, mask: MaskLike = None, *, is_causal: bool = True,
               scale: Optional[float] = None, backend: str = "auto",
               return_lse: bool = False) -> Union[torch.Tensor, AttentionResult]: ...

    def attend(self, q: torch.Tensor, mask: MaskLike = None, *, is_causal: bool = True,
               scale: Optional[float] = None, backend: str = "auto",
               return_lse: bool = False) -> Union[torch.Tensor, AttentionResult]:
        """Attention of the last :meth:`append`'s queries ``q [B, Hq, t, Dk]`` over each
        sequence's keys: ``attnkit.attention(q, self.keys, self.values, self.mask(is_causal)
        & mask, ...)`` with ``mask`` (a band, score modifiers) applied per sequence, aligned
        to its own keys (:func:`sequence_mask`). A decoding step (one new token per
        sequence; ``mask`` ``None`` or a bottom-right band; CPU, no autograd) reads the pool
        in place by runs of blocks, a run several sequences share (forks: a common prompt,
        beam search) once for all of them (:func:`decode_by_runs`), and gathers nothing; on
        the triton kernel, a step of any number of new tokens per sequence reads the blocks
        through the table, as :func:`paged_attention` says (:func:`kernel_decode`)."""
        if isinstance(q, torch.Tensor) and autocast_device(q) is not None:
            device = autocast_device(q)  # q in its dtype; the pools must be in it already
            (q,) = _autocast(device, q)
            if self.key_pool is not None and self.key_pool.dtype != q.dtype:
                raise TypeError(f"PagedKVCache.attend under torch.autocast computes in "
                                f"{q.dtype}, but the pools hold {self.key_pool.dtype}: fill and "
                                f"read a cache on the same side of autocast (paged_attention "
                                f"casts the pools, a copy of them, on every call)")
            with torch.autocast(device, enabled=False):
                return self.attend(q, mask, is_causal=is_causal, scale=scale, backend=backend,
                                   return_lse=return_lse)
        given = as_mask(mask)
        if (self.key_pool is not None and isinstance(q, torch.Tensor) and q.dim() == 4
                and q.shape[-2] != self._width):
            raise ValueError(f"PagedKVCache.attend takes the queries of the last append: q "
                             f"{tuple(q.shape)} has {q.shape[-2]} positions but the last "
                             f"append added {self._width} per sequence (q [B, Hq, "
                             f"{self._width}, D])")
        band = kernel_band(q, self.key_pool, self.value_pool, given, backend) \
            if self.key_pool is not None and q.shape[2] == self._width and all(
                a == self._width for a in self.appended) else None
        if band is not None:
            left, right = band
            if is_causal:
                right = 0 if right is None else min(right, 0)
            out, lse = kernel_decode(q, self.key_pool, self.value_pool, self.block_table(),
                                     self.tables, self.lengths, (left, right), scale)
            return decode_result(q, out, lse, return_lse)
        if all(a == 1 for a in self.appended) and self._width == 1 and self.key_pool is not None:
            band = given if given is not None or not is_causal else causal("bottom_right")
            spans = decode_spans(q, self.key_pool, self.value_pool, band, self.lengths,
                                 backend)
            if spans is not None:  # the runs, updated from the last step's where it can
                self._runs = step_runs(self._runs, self.tables, spans, self.block_size)
                return decode(q, self.key_pool, self.value_pool, self.tables, spans, scale,
                              return_lse, self._runs.runs)
        step = self.mask(is_causal)
        if given is not None:
            step = step & sequence_mask(given, self._sequences(), q.shape[-2], return_lse)
        return attention(q, self.keys, self.values, step, scale=scale, backend=backend,
                         return_lse=return_lse)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"sequences={self.batch}, lengths={self.lengths}, free_blocks={self.free_blocks})")
