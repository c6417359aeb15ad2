"""Packed variable-length batches: :func:`varlen_attention` on ``[total_tokens, H, D]``.

The sequences of a batch lie one after another along the token axis, sequence b's queries at
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and its keys at ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
(the convention of ``flash_attn_varlen_func`` and ``torch.nn.attention.varlen``). The call
runs as one row of ``ak.attention`` whose mask keeps the sequences apart (a ``documents``
mask, with ``causal=`` aligned per sequence): no padding is made, memory stays O(total
tokens), and the tiled engine skips every tile between two sequences.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, Union, overload

import torch

from . import invariance
from .api import AttentionResult, MaskLike, attention, autocast_call, autocast_device
from .inputs import unexpected_keywords
from .masks import (Mask, MaskCache, MaskSpace, an_int, as_mask, documents, integer_tensor,
                    readable)
from .modifiers import per_sequence, split
from .numerics import accum_dtype


class Layout(NamedTuple):
    """Where each sequence's tokens lie: ``q_ids [total_q]`` and ``kv_ids [total_k]`` (long, on
    q's device; one tensor when the segments coincide) give each token its sequence (keys past
    a sequence's ``seqused_k`` get ``n + b``: no query's), and ``same_segments`` says every
    sequence has the same query and key positions (self-attention over one packing)."""

    q_ids: torch.Tensor
    kv_ids: torch.Tensor
    same_segments: bool
    keys: list[tuple[int, int]]
    """Per sequence, its used keys' ``(start, stop)`` in the packed k and v (host integers)."""
    queries: list[tuple[int, int]]
    """Per sequence, its queries' ``(start, stop)`` in the packed q."""


@overload
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, seqused_k=None, mask: MaskLike = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     generator: Optional[torch.Generator] = None, backend: str = "auto",
                     return_lse: Literal[False] = False, invariant: Optional[bool] = None,
                     ) -> torch.Tensor: ...


@overload
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, seqused_k=None, mask: MaskLike = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     generator: Optional[torch.Generator] = None, backend: str = "auto",
                     return_lse: Literal[True], invariant: Optional[bool] = None,
                     ) -> AttentionResult: ...


@overload
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, seqused_k=None, mask: MaskLike = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     generator: Optional[torch.Generator] = None, backend: str = "auto",
                     return_lse: bool = False, invariant: Optional[bool] = None,
                     ) -> Union[torch.Tensor, AttentionResult]: ...


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, seqused_k=None, mask: MaskLike = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     generator: Optional[torch.Generator] = None, backend: str = "auto",
                     return_lse: bool = False, invariant: Optional[bool] = None,
                     **unexpected) -> Union[torch.Tensor, AttentionResult]:
    """Attention over packed sequences of different lengths, each attending only to itself.

    Shapes: ``q [total_q, Hq, Dk]``, ``k [total_k, Hkv, Dk]``, ``v [total_k, Hkv, Dv]`` (Hq a
    multiple of Hkv); ``cu_seqlens_q``/``cu_seqlens_k``: ``[n + 1]`` integers, 0 first, never
    falling, ending at ``total_q``/``total_k`` (a tensor or a list; ``cu_seqlens_k`` defaults
    to ``cu_seqlens_q``). Returns ``out [total_q, Hq, Dv]`` (contiguous), or an
    :class:`~attnkit.AttentionResult` with ``lse [Hq, total_q]`` when ``return_lse``.

    ``mask`` applies inside every sequence, on its own positions: ``causal(align)`` (top-left:
    a sequence's i-th query sees its first i + 1 keys; bottom-right, flash-attn's ``causal``:
    its last query sees all its keys), ``sliding_window(left, right, align)`` (a window on
    each sequence's own positions), and the score modifiers (``softcap``, ``sinks``,
    ``alibi``, ``relative_bias``) joined by ``&``, ALiBi and relative biases at each
    sequence's own positions (aligned as they say). ``seqused_k [n]``: only
    the first ``seqused_k[b]`` keys of sequence b count (a cache's filled part).
    ``max_seqlen_q``/``max_seqlen_k`` are checked when given (at least every sequence's
    length) and otherwise not needed. ``scale``, ``dropout_p``, ``generator`` and ``backend``
    are :func:`attnkit.attention`'s. A sequence with no key gets output 0 and LSE −inf.
    ``invariant``: the invariance contract (:mod:`attnkit.invariance`; ``None`` follows
    ``attnkit.invariant()``): each sequence then runs as a call of its own, from its first
    key, so its bits are those of the sequence alone.

    The boundaries are read on the host to check them (one read per tensor, and one for
    ``seqused_k``); the attention itself runs as one call of :func:`attnkit.attention` on
    views of q, k and v, except with ALiBi or a relative bias where the query and key segments
    differ (``cu_seqlens_k`` not ``cu_seqlens_q``, or ``seqused_k``): their positions are
    each sequence's, not the packed row's, so each sequence is then one call of its own; so
    too where a relative-bias bucket function fits each sequence's positions but not the
    packed row's. With meta or fake q, k and v (shape-only calls) the boundaries stay real
    values: a list, or a tensor off the meta device.

    Keyword arguments of ``flash_attn_varlen_func`` and torch SDPA that attnkit spells
    differently (``causal``, ``softmax_scale``, ``window_size``, ``softcap``,
    ``alibi_slopes``, ...) raise ``TypeError`` with the attnkit spelling.
    """
    if unexpected:
        raise unexpected_keywords(varlen_attention, unexpected)
    if autocast_device(q) is not None:  # the inputs in its dtype, as attention() takes them
        return autocast_call(varlen_attention, q, k, v, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             seqused_k=seqused_k, mask=mask, scale=scale, dropout_p=dropout_p,
                             generator=generator, backend=backend, return_lse=return_lse,
                             invariant=invariant)
    layout = packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    given = as_mask(mask)
    _check_modifiers(given, q, k, v)
    invariant = invariance.active(invariant)
    if invariant or (reads_positions(given) and (not layout.same_segments
                                                 or _buckets_outside_row(given, q, k))):
        return _each_sequence(q, k, v, layout, given, scale=scale, dropout_p=dropout_p,
                              generator=generator, backend=backend, return_lse=return_lse,
                              invariant=invariant)
    per_sequence = sequence_mask(given, layout)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, total, D] views
    try:
        result = attention(q4, k4, v4, per_sequence, scale=scale, dropout_p=dropout_p,
                           generator=generator, backend=backend, return_lse=return_lse)
    except (ValueError, TypeError) as error:
        error.add_note(f"(varlen_attention runs its packed q {tuple(q.shape)}, k "
                       f"{tuple(k.shape)}, v {tuple(v.shape)} as this one row [1, H, total, D], "
                       f"its sequences kept apart by the documents mask)")
        raise
    if not return_lse:
        return result[0].transpose(0, 1).contiguous()
    return AttentionResult(result.out[0].transpose(0, 1).contiguous(), result.lse[0], None)


def reads_positions(mask: Optional[Mask]) -> bool:
    """Whether ``mask`` holds ALiBi or a relative bias (score modifiers that read positions)."""
    _, modifiers = split(mask)
    return modifiers is not None and bool(modifiers.alibi or modifiers.relative)


def _check_modifiers(mask: Optional[Mask], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
    """``ValueError`` naming the packed shapes when a score modifier's tensors do not fit
    ``q`` (per-head tensors ``[Hq]``, on q's device), before any call sees the packed row.
    Their shapes and devices only: a relative-bias bucket function is checked by each call,
    over the positions that call covers (checked here over a single position)."""
    _, modifiers = split(mask)
    if modifiers is None:
        return
    problems = modifiers.check(MaskSpace(1, q.shape[1], 1, 1, q.device))
    if problems:
        raise ValueError(f"score modifiers do not fit varlen_attention's q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}:\n  " + "\n  ".join(problems))


def _buckets_outside_row(mask: Optional[Mask], q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a relative-bias bucket function gives buckets outside its table over the
    packed row's relative positions: the row cannot run as one call, each sequence (whose
    positions are fewer) can."""
    _, modifiers = split(mask)
    relative = [part for part in modifiers.relative if part.buckets is not None]
    space = MaskSpace(1, q.shape[1], q.shape[0], k.shape[0], q.device)
    return any(part.check(space) for part in relative)


def _each_sequence(q, k, v, layout: Layout, mask: Optional[Mask], *, scale, dropout_p,
                   generator, backend, return_lse, invariant: bool = False,
                   ) -> Union[torch.Tensor, AttentionResult]:
    """:func:`varlen_attention` as one :func:`attnkit.attention` call per sequence on views of
    its queries and used keys, ``mask`` aligned to its own positions; results concatenated
    in packed order (``[total_q, Hq, Dv]``, LSE ``[Hq, total_q]``)."""
    per_sequence(mask, documents(layout.q_ids), call="varlen_attention")  # its refusals
    outs, lses = [], []
    for (q_start, q_stop), (k_start, k_stop) in zip(layout.queries, layout.keys):
        q4, k4, v4 = (t[a:b].transpose(0, 1)[None] for t, a, b in (
            (q, q_start, q_stop), (k, k_start, k_stop), (v, k_start, k_stop)))
        try:
            result = attention(q4, k4, v4, mask, scale=scale, dropout_p=dropout_p,
                               generator=generator, backend=backend, return_lse=return_lse,
                               invariant=invariant)
        except (ValueError, TypeError) as error:
            error.add_note(f"(varlen_attention runs each sequence of its packed q "
                           f"{tuple(q.shape)} alone here, as a row [1, H, T, D]: this one's "
                           f"queries {q_start}:{q_stop}, keys {k_start}:{k_stop})")
            raise
        outs.append((result.out if return_lse else result)[0].transpose(0, 1))
        if return_lse:
            lses.append(result.lse[0])
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
    if not return_lse:
        return out
    lse = torch.cat(lses, 1) if lses else q.new_zeros(q.shape[1], 0,
                                                       dtype=accum_dtype(q.dtype))
    return AttentionResult(out, lse, None)


def packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q=None,
                  max_seqlen_k=None, seqused_k=None) -> Layout:
    """The :class:`Layout` of a packed call, after checking its tensors and boundaries (read
    on the host); ``ValueError``/``TypeError`` naming the offending sequence.
    Shapes as for :func:`varlen_attention`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"varlen_attention takes {name} as a torch.Tensor [total, H, D], "
                            f"got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"varlen_attention takes {name} packed, [total, H, D], got a nested "
                            f"tensor: pass {name}.values() and {name}.offsets() of a jagged "
                            f"[B, j, H, D] (of [B, H, j, D]: {name}.transpose(1, 2).values())")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen_attention takes packed q [total_q, Hq, D], k and v "
                         f"[total_k, Hkv, D] (3-D, tokens first), got {shapes}: flatten a "
                         f"padded batch's real tokens with x[real] for a [B, T] bool mask")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must hold the same tokens and heads (dims 0, 1), got {shapes}")
    if not k.shape[1] or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention needs Hq a multiple of Hkv ≥ 1 (dim 1) and q, k of "
                         f"one head dim (dim 2), got {shapes}")
    if not q.is_floating_point():
        raise TypeError(f"varlen_attention needs floating point q, k and v, got q {q.dtype}: "
                        f"convert with q.float()")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError(f"q, k and v must share one dtype and device, got q {q.dtype} {q.device}, "
                        f"k {k.dtype} {k.device}, v {v.dtype} {v.device}: cast with .to(q)")
    if cu_seqlens_k is None and k.shape[0] != q.shape[0]:
        raise ValueError(f"cu_seqlens_k is needed when keys and queries differ in number "
                         f"(total_q {q.shape[0]}, total_k {k.shape[0]})")
    cu_q, starts_q = _boundaries("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k, starts_k = ((cu_q, starts_q) if cu_seqlens_k is None else
                      _boundaries("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device))
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same sequences, got "
                         f"{len(starts_q) - 1} and {len(starts_k) - 1} sequences")
    lengths_q = [b - a for a, b in zip(starts_q, starts_q[1:])]
    lengths_k = [b - a for a, b in zip(starts_k, starts_k[1:])]
    for name, limit, lengths in (("max_seqlen_q", max_seqlen_q, lengths_q),
                                 ("max_seqlen_k", max_seqlen_k, lengths_k)):
        if limit is not None and not an_int(limit):
            raise TypeError(f"{name}={limit!r:.40}: pass an int (the longest sequence's "
                            f"tokens), or leave it out")
        if limit is not None and lengths and int(limit) < max(lengths):
            seq = lengths.index(max(lengths))
            raise ValueError(f"{name}={limit} but sequence {seq} holds {lengths[seq]} tokens: "
                             f"pass at least the longest length, or leave it out")
    used = counts = None
    if seqused_k is not None:
        used, counts = _seqused(seqused_k, lengths_k, q.device)
    def build() -> Layout:
        return _layout(q, k, cu_k, starts_q, starts_k, lengths_q, lengths_k, used, counts)
    if not readable(q, k, v, used):  # fake and meta calls make fake ids: never kept
        return build()
    key = (tuple(starts_q), tuple(starts_k), None if counts is None else tuple(counts),
           q.device)
    return _LAYOUTS.get(None, key, build)


_LAYOUTS = MaskCache(16)
"""Layouts kept per boundaries (:func:`packed_layout`): the layers of one step, which pass
the same ``cu_seqlens``, get one layout, so one mask and one tile plan between them."""


def _layout(q, k, cu_k, starts_q, starts_k, lengths_q, lengths_k, used, counts) -> Layout:
    """The :class:`Layout` of checked boundaries (:func:`packed_layout`)."""
    n = len(lengths_q)
    same = used is None and starts_q == starts_k
    q_ids = _sequence_ids(lengths_q, q.shape[0], q.device)
    # one tensor when the segments coincide: the mask then knows each token sees itself
    kv_ids = q_ids if same else _sequence_ids(lengths_k, k.shape[0], q.device)
    stops_k = starts_k[1:]
    if used is not None:
        offset = torch.arange(k.shape[0], device=q.device) - cu_k[kv_ids]  # within its sequence
        kv_ids = torch.where(offset < used[kv_ids], kv_ids, kv_ids + n)
        stops_k = [a + u for a, u in zip(starts_k, counts)]
    return Layout(q_ids, kv_ids, same, list(zip(starts_k, stops_k)),
                  list(zip(starts_q, starts_q[1:])))


def _boundaries(name: str, value, total: int, device) -> tuple[torch.Tensor, list[int]]:
    """``cu_seqlens`` as a long tensor on ``device`` and as a list (one host read), checked."""
    if not isinstance(value, torch.Tensor):
        try:
            value = integer_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be integers [n + 1] (a tensor or a list), got "
                            f"{type(value).__name__}") from None
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must be integers [n + 1], got {value.dtype}: convert with "
                        f"{name}.to(torch.int32)")
    if value.dim() != 1 or value.numel() < 1:
        raise ValueError(f"{name} must be [n + 1] (0, then each sequence's end), got shape "
                         f"{tuple(value.shape)}")
    bounds = _host_values(name, value, "the sequences' lengths")
    _check_boundaries(name, bounds, total)
    return value.to(device=device, dtype=torch.long), bounds


def _host_values(name: str, value: torch.Tensor, what: str) -> list:
    """``value`` as a list, read where its values are (a shape-only call on meta tensors keeps
    its boundaries real); ``ValueError`` for a meta ``value``."""
    if value.device.type == "meta":
        raise ValueError(f"{name} must hold values (a list, or a tensor off the meta device): "
                         f"{what} are read to lay the call out, also for a shape-only call on "
                         f"meta tensors")
    return value.tolist()


def _check_boundaries(name: str, bounds: list[int], total: int) -> None:
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[:8]}")
    for seq, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b < a:
            shown = f"{bounds[:16]}{'...' if len(bounds) > 16 else ''}"
            raise ValueError(f"{name} must never fall: sequence {seq} ends at {b}, before its "
                             f"start {a} ({name} = {shown})")
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at the number of packed tokens {total}, got "
                         f"{bounds[-1]}: the last boundary is the total")


def _sequence_ids(lengths: list[int], total: int, device) -> torch.Tensor:
    """Each token's sequence ``[total]`` (long) from the sequences' lengths."""
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), counts,
                                   output_size=total)


def _seqused(value, lengths: list[int], device) -> tuple[torch.Tensor, list[int]]:
    """``seqused_k`` as long ``[n]`` on ``device`` and as a list (one host read), each in
    ``[0, its sequence's keys]``."""
    try:
        used = integer_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"seqused_k must be integers [n] (a tensor or a list), got "
                        f"{type(value).__name__} {value!r:.40}") from None
    if used.dtype == torch.bool or used.is_floating_point() or used.is_complex():
        raise TypeError(f"seqused_k must be integers [n], got {used.dtype}")
    if used.shape != (len(lengths),):
        raise ValueError(f"seqused_k must be [n] = [{len(lengths)}] (one per sequence), got "
                         f"shape {tuple(used.shape)}")
    counts = _host_values("seqused_k", used, "the used keys")
    for seq, (count, length) in enumerate(zip(counts, lengths)):
        if not 0 <= count <= length:
            raise ValueError(f"seqused_k[{seq}] = {count} but sequence {seq} holds {length} keys: "
                             f"each must lie in [0, its keys]")
    return used.to(device=device, dtype=torch.long), counts


def sequence_mask(mask: Optional[Mask], layout: Layout) -> Mask:
    """``mask`` applied inside each sequence of ``layout``, as one mask over the packed row
    (:func:`~attnkit.modifiers.per_sequence` over ``documents`` of the sequence ids): ALiBi
    and relative biases only where the segments coincide (positions there differ by the same
    amount in the packed row as inside a sequence; :func:`varlen_attention` runs the other
    case one sequence at a time)."""
    kv_ids = None if layout.kv_ids is layout.q_ids else layout.kv_ids  # one tensor: documents(ids)
    positions = None if layout.same_segments else (
        "where each sequence's queries and keys are the same positions (cu_seqlens_k equal to "
        "cu_seqlens_q, no seqused_k); pad the batch and call attnkit.attention there")
    return per_sequence(mask, documents(layout.q_ids, kv_ids), call="varlen_attention",
                        positions=positions)
