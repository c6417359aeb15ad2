"""Garbage and non-finite values, handled by construction: no host read, no recomputation.

Real inputs hold garbage where no query looks: the padding of a batch, the unwritten slots of
a cache allocated with ``torch.empty``. The rules (docs/NUMERICS.md), for every backend:

- **Outside a sequence's real keys, never read.** Where the mask gives each batch element a
  run of real keys (``padding``, a per-sequence ``causal(sequences=...)``, the transformers
  padding mask), :func:`guard` zeroes K and V outside that run before any backend sees them,
  so NaN/inf there cannot reach any output, LSE or gradient. Masks that vouch for those
  positions (a :class:`~attnkit.nn.KVCache`'s, whose slots past a sequence's length hold zeros
  or that sequence's own earlier keys) skip the copy.
- **Inside, a non-finite value reaches as NaN, never as a wrong finite number.** NaN/inf in
  ``q[i]``, or in a key row that query ``i`` may attend, makes ``out[i]`` and ``lse[i]`` NaN.
  Kernels propagate it by themselves (and may spread it as NaN to the other rows of a tile
  they compute partially, ``0 · NaN``), except the fused CPU kernel, which returns a row whose
  scores are all NaN as output 0 and LSE 0. :func:`poison` marks those rows: every row with a
  non-finite query, and, where the keys are cheap to look at (:func:`checks_keys`), every row
  that may attend a non-finite key. A fully masked row stays output 0, LSE −inf.

Both run on device tensors without branching on their values, so a call stays free of host
reads (and capturable in a CUDA graph). :func:`poison` runs on CPU tensors only: the GPU
kernels propagate NaN themselves.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .inputs import Inputs, derived
from .masks import (Padding, _is_wrapped, every_key_seen, every_row_has_key, keeping, mask_tensors,
                    memo)

KV_CHECK_MIN_ROWS = 64
"""Calls with at least this many query rows also look at the keys in :func:`poison`: at most
1/64 of what the attention itself reads."""

KV_CHECK_MAX_ELEMENTS = 1 << 12
"""Calls whose K holds at most this many elements also look at the keys, whatever their query
rows (a decoding step over a longer cache reads little else: looking at its keys would cost as
much as the step)."""

CHUNK_ELEMENTS = 1 << 22
"""Mask elements evaluated at once when finding the rows that may attend a non-finite key."""


class Guarded(NamedTuple):
    """What :func:`guard` makes of a call: ``inputs`` without garbage where no result needs it,
    and ``seen`` in q's dtype, per query row ``[B, Hq, Tq, 1]``, per K/V head and row
    ``[B, Hkv, Tq, 1]`` or per K/V head ``[B, Hkv, 1, 1]``, NaN where the row may attend a
    non-finite key row and 0 elsewhere (``None`` when :func:`poison` does not run or the keys
    are not looked at, :func:`checks_keys`)."""

    inputs: Inputs
    poisons: bool
    """Whether :func:`poison` runs on the result (:func:`applies`)."""
    seen: Optional[torch.Tensor] = None
    has_key: Optional[torch.Tensor] = None
    """Bool ``[Bm|B, Hm|Hq, Tq, 1]``: the rows with an allowed key (``None``: every row, or
    :func:`poison` does not run)."""
    keep_rows: Optional[torch.Tensor] = None
    """``has_key`` in :func:`keep_for` q's form where it was kept so (a padding's rows, made
    once per validation), else ``None``: :func:`poison` zeroes out's rows with it."""


def guard(inputs: Inputs, poisons: bool, zero_kv: bool = True,
          whole_mask: bool = False) -> Guarded:
    """Zero what no result needs and may hold garbage: K/V outside each batch element's real
    keys, where the mask gives such runs and does not vouch for them
    (:meth:`~attnkit.masks.Mask.guard_runs`), and the queries with no allowed key (on CPU,
    where :func:`poison` runs: every such row; elsewhere the padded ones of such runs): their
    result is 0 and their gradient 0 whatever they hold. On the device, whatever the values;
    ``inputs`` itself when there is nothing to zero. ``poisons``: :func:`applies`;
    ``zero_kv``: whether the backend reads K/V outside the runs
    (:meth:`~attnkit.backends.base.Backend.reads_padding`); ``whole_mask``: whether it
    evaluates the whole mask itself (:meth:`~attnkit.backends.base.Backend.evaluates_mask`),
    which the scan then shares."""
    mask = inputs.mask
    if mask is None:
        return Guarded(inputs, poisons,
                       _seen_unmasked(inputs.k) if poisons and checks_keys(inputs) else None)
    prep = derived(inputs, ("guard", poisons), lambda: _prepare(inputs, poisons))
    has_key = seen = key_seen = None
    if poisons and not prep.padding:  # one evaluation of the mask (garbage outside the runs
        has_key, seen, key_seen = _scan(inputs, whole_mask)  # is never counted)
    fixed = {}
    # keys no query sees (which include those outside the runs), else those outside the runs
    real = (keep_for(key_seen, inputs.k) if key_seen is not None and not prep.every_key_seen
            else prep.kv)
    if real is not None and zero_kv:
        fixed["k"], fixed["v"] = zero_outside(inputs.k, real), zero_outside(inputs.v, real)
    keep_rows = None
    if poisons and prep.padding:
        has_key, keep_rows = prep.rows, prep.keep_rows
        if checks_keys(inputs):  # the keys as zeroed: every real row sees all of its own
            seen = _seen_unmasked(fixed.get("k", inputs.k))
    if has_key is not None:
        fixed["q"] = zero_outside(inputs.q, has_key if keep_rows is None else keep_rows)
    elif prep.q is not None:
        fixed["q"] = zero_outside(inputs.q, prep.q)
    return Guarded(inputs.replaced(**fixed) if fixed else inputs, poisons, seen, has_key,
                   keep_rows)


class _Prepared(NamedTuple):
    """What :func:`guard` derives from the mask alone (:func:`_prepare`), once per shared
    validation (:func:`~attnkit.inputs.derived`)."""

    kv: Optional[torch.Tensor]
    """The keys to keep, ``[Bm, 1, Tk, 1]`` in :func:`keep_for` K's form, or ``None``."""
    q: Optional[torch.Tensor]
    """The queries inside the real runs, ``[Bm, 1, Tq, 1]`` in q's form, or ``None``."""
    padding: bool
    """A padding mask whose key runs are zeroed: a real row sees its element's real keys."""
    rows: Optional[torch.Tensor]
    """With ``padding`` and poison: :func:`_padding_rows`."""
    every_key_seen: bool
    keep_rows: Optional[torch.Tensor] = None
    """``rows`` in :func:`keep_for` q's form (``None`` without ``rows``)."""


def _prepare(inputs: Inputs, poisons: bool) -> _Prepared:
    """:class:`_Prepared` for the call's mask (``poisons``: :func:`applies`)."""
    mask, space = inputs.mask, inputs.space
    padding = isinstance(mask, Padding) and not mask.vouched
    rows = _padding_rows(mask, space) if poisons and padding else None
    keep_rows = None if rows is None else keep_for(rows, inputs.q)
    keys = mask.key_mask(space) if padding else None
    if keys is not None:  # the real-key mask itself: no runs to build
        return _Prepared(keep_for(keys[:, None, :, None], inputs.k), None, True, rows,
                         every_key_seen(mask, space), keep_rows)
    runs = mask.guard_runs(space)
    kv = None if runs.kv is None else _runs_mask(mask, runs.kv, space.kv_len, "kv", inputs.k)
    if poisons and padding and runs.q is not None:  # and the keys of an element without queries
        kv = _padding_keys(mask, space, inputs.k)
    q = None if runs.q is None else _runs_mask(mask, runs.q, space.q_len, "q", inputs.q)
    return _Prepared(kv, q, padding, rows, every_key_seen(mask, space), keep_rows)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
"""The integer dtype of each float dtype's width: :func:`zero_outside` clears bits."""


def zero_outside(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` with +0 wherever ``keep`` (broadcastable to ``x``) is False, whatever ``x`` holds
    there (NaN and ±inf too). ``keep`` is bool, or :func:`keep_for` ``x``'s form. Without
    autograd the bits are cleared (``x`` seen as integers ``& keep``): one pass that vectorises
    over a broadcast mask, several times cheaper than ``where`` on CPU; with autograd (or
    inside a ``torch.func`` transform) ``where``, whose gradient is 0 outside ``keep``."""
    x = x.resolve_neg()  # a negative view reinterprets no bits (itself for any other)
    bits = _bits(x)
    if bits is None:
        return x.where(keep if keep.dtype == torch.bool else keep != 0, 0.0)
    if keep.dtype != bits:
        keep = keep_for(keep, x)
    return (x.view(bits) & keep).view(x.dtype)


def keep_for(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``keep`` (bool) in the form :func:`zero_outside` reads fastest for ``x``: all bits set
    where True in ``x``'s integer width, or ``keep`` itself where ``x`` takes ``where``."""
    bits = _bits(x)
    return keep if bits is None else keep.to(bits).neg_()


def _bits(x: torch.Tensor) -> Optional[torch.dtype]:
    """The integer dtype :func:`zero_outside` clears ``x``'s bits in, or ``None`` (autograd,
    a ``torch.func`` transform, a dtype without one)."""
    if x.requires_grad or _is_wrapped(x):
        return None
    return _BITS.get(x.dtype)


def _runs_mask(mask, run: tuple[torch.Tensor, torch.Tensor], length: int, side: str,
               like: torch.Tensor) -> torch.Tensor:
    """``[Bm, 1, length, 1]``: the positions inside the run ``[lo, hi)`` of each batch element,
    in :func:`keep_for` ``like``'s form; kept on ``mask`` while its tensors are unchanged, so
    the layers of a step that pass one mask compute it once."""
    def inside():
        lo, hi = run
        positions = torch.arange(length, device=lo.device)
        keep = ((positions >= lo[:, None]) & (positions < hi[:, None]))[:, None, :, None]
        return keep_for(keep, like)
    return memo(mask, ("guard", side, length, run[0].device, _bits(like)), mask_tensors(mask),
                inside)


def applies(inputs: Inputs, backend) -> bool:
    """Whether :func:`poison` runs on ``backend``'s result: CPU calls outside ``torch.func``
    transforms, on a backend that does not keep the rule by itself (``EXACT_NONFINITE``: the
    reference, which also runs those transforms; GPU kernels propagate NaN themselves)."""
    return (inputs.q.device.type == "cpu" and not inputs.transformed
            and not backend.EXACT_NONFINITE)


def checks_keys(inputs: Inputs) -> bool:
    """Whether :func:`poison` looks at the keys too (:func:`looks_at_keys`)."""
    return looks_at_keys(inputs.q.shape[2], inputs.k.numel())


def looks_at_keys(query_rows: int, key_elements: int) -> bool:
    """Whether a call of ``query_rows`` query rows over K of ``key_elements`` elements has its
    keys looked at for non-finite values: at least :data:`KV_CHECK_MIN_ROWS` rows, or at most
    :data:`KV_CHECK_MAX_ELEMENTS` elements. Paths that run torch's kernel without
    :func:`guard` (a cache's decoding step) keep the same rule by taking ``attention`` there.
    Traced (compile, export), always: a graph holds for every size its dims may take, and
    a choice by size would bound them."""
    return (torch.compiler.is_compiling() or query_rows >= KV_CHECK_MIN_ROWS
            or key_elements <= KV_CHECK_MAX_ELEMENTS)


def poison(guarded: Guarded, out: torch.Tensor, lse: Optional[torch.Tensor],
           weights: Optional[torch.Tensor]) -> tuple:
    """``(out, lse, weights)`` of the call :func:`guard` made with every row that holds or may
    attend a non-finite value set to NaN, as ``x + flag`` with flag 0 or NaN per row (out
    under autograd as ``out · (1 + flag)``: a gradient reaching a poisoned row of out goes
    back as NaN, into q, k and v), and every other row is unchanged. A row with no allowed
    key holds zeros after :func:`guard`: never poisoned.

    The flag of a row is its query and output times a zero vector (``[Tq, D] @ 0``: NaN
    exactly where the row holds a NaN or ±inf; no sum that could overflow), plus
    :attr:`Guarded.seen`. A non-finite value row shows in the output rows that weigh it, so
    their LSE and every column become NaN too. Few operations: a small call's cost is their
    number."""
    flag = query_and_output_flags(out, guarded.inputs.q)  # [B, Hq, Tq, 1]: 0, or NaN
    if guarded.seen is not None:
        flag = _grouped_add(flag, guarded.seen)
    # in place on the backend's own tensor, except where autograd or a trace holds it (a
    # graph traced without gradients may run with them); under autograd as out · (1 + flag),
    # whose derivative 1 + flag sends NaN back from a poisoned row into the backward (and
    # any other gradient unchanged, infinite ones too)
    if out.requires_grad:
        out = out * (flag + 1)
    elif torch.compiler.is_compiling():
        out = out + flag
    else:
        out = out.add_(flag)
    if lse is not None:  # −inf stays −inf
        lse = lse + flag[..., 0].to(lse.dtype)
    weights = None if weights is None else weights + flag.to(weights.dtype)
    has_key = guarded.has_key
    if has_key is not None:  # a kernel may spread a tile's NaN into a row with no key
        keep = guarded.keep_rows  # (q's form fits out, of q's dtype, where no grad needs where)
        out = zero_outside(out, has_key if keep is None or keep.dtype != _bits(out) else keep)
        lse = None if lse is None else lse.where(has_key[..., 0], float("-inf"))
        weights = None if weights is None else zero_outside(weights, has_key)
    return out, lse, weights


def query_and_output_flags(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row ``[..., 1]``: 0, or NaN where the row of ``out`` or of ``q`` holds a NaN or
    ±inf (:func:`row_flags` of each, summed): what :func:`poison` adds to every result whose
    keys it does not look at."""
    out_rows, q_rows = _logical_rows(out), _logical_rows(q)
    if out_rows is not None and q_rows is not None:  # one product adds to the other
        flags = torch.addmm(q_rows @ _zeros(q), out_rows, _zeros(out))  # [N, 1]
        return flags.view(*out.shape[:-1], 1)
    # out of place: a mode around the call may hold the product (a selective checkpoint
    # that saves aten.mm)
    return row_flags(out) + row_flags(q)


def _logical_rows(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x [..., D]`` as a view ``[N, D]`` of its rows in index order, or ``None`` where that
    needs a copy (rows laid out in another order) or ``x`` is traced (its layout is the
    compiler's, and a decomposition may change it)."""
    x = _plain(x)
    if torch.compiler.is_compiling():
        return None
    if x.is_contiguous() or _flat_rows(x):
        return x.view(-1, x.shape[-1])
    return None


@functools.lru_cache(maxsize=64)
def _zero_column(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # usable outside inference mode too
        return torch.zeros(size, 1, dtype=dtype, device=device)


def _zeros(x: torch.Tensor) -> torch.Tensor:
    """A zero column ``[D, 1]`` in ``x``'s dtype: ``x @`` it is 0 per row, NaN where the row
    holds a NaN or ±inf (``0 · inf`` is NaN). Kept per size, dtype and device for plain
    tensors only: one made for a fake, meta, traced or subclass ``x`` is made anew each
    time, never cached where a real call would find it."""
    if (type(x) is not torch.Tensor or x.device.type == "meta"  # fake, traced, a subclass
            or torch.compiler.is_compiling()
            or (torch._C._len_torch_dispatch_stack() and not keeping())):  # a fake mode
        return x.new_zeros(x.shape[-1], 1)
    return _zero_column(x.shape[-1], x.dtype, x.device)


def row_flags(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D] @ 0`` → ``[..., 1]``: 0 per row, NaN where the row holds a NaN or ±inf;
    one matrix product on the rows laid out flat, in memory order (a ``[B, T, H, D]`` tensor
    seen as ``[B, H, T, D]`` too), where that needs no copy."""
    x = _plain(x)
    if not x.numel() or torch.compiler.is_compiling():  # traced: the compiler lays it out
        return x @ _zeros(x)
    rows = _logical_rows(x)
    if rows is not None:
        return (rows @ _zeros(x)).view(*x.shape[:-1], 1)
    lead = x.dim() - 1
    order = sorted(range(lead), key=lambda d: -x.stride(d))  # leading dims, outermost first
    stored = x.permute(*order, lead)
    if not _flat_rows(stored):
        return x @ _zeros(x)
    flags = (stored.reshape(-1, x.shape[-1]) @ _zeros(x)).view(*stored.shape[:-1], 1)
    return flags.permute(*sorted(range(lead), key=order.__getitem__), lead)


def _flat_rows(x: torch.Tensor) -> bool:
    """Whether the leading dims of ``x [..., D]`` merge into one without a copy (a view
    ``[N, D]``)."""
    outer = None  # (size, stride) of the last leading dim of size > 1 seen, inner to outer
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if outer is not None and stride != outer[0] * outer[1]:
            return False
        outer = (size, stride)
    return True


def _grouped_add(flag: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``flag [B, Hq, Tq, 1] + seen`` with ``seen [B, Hkv, Tq | 1, 1]`` read by every query
    head of its group (GQA/MQA: no copy per head)."""
    batch, heads, q_len, _ = flag.shape
    heads_kv = seen.shape[1]
    if heads_kv == heads:
        return flag + seen
    return (flag.view(batch, heads_kv, heads // heads_kv, q_len, 1)
            + seen[:, :, None]).view(batch, heads, q_len, 1)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its autograd history (only where it has one: a detach is an operation)."""
    return x.detach() if x.requires_grad else x


def _dtype(inputs: Inputs) -> torch.dtype:
    return torch.float64 if inputs.q.dtype == torch.float64 else torch.float32


def _seen_unmasked(k: torch.Tensor) -> torch.Tensor:
    """:attr:`Guarded.seen` where every row attends every key of ``k [B, Hkv, Tk, Dk]`` (no
    mask, or a padding mask once the keys outside each run are zeroed): per K/V head
    ``[B, Hkv, 1, 1]``, NaN exactly where its K holds a non-finite value. V is not looked at:
    a non-finite value row shows in the output rows that weigh it, which :func:`poison`
    looks at."""
    k = _plain(k)
    return (k @ _zeros(k)).sum(-2, keepdim=True)  # a sum of zeros and NaN: no overflow


def _padding_keys(mask: Padding, space, like: torch.Tensor) -> torch.Tensor:
    """The keys some query of a padding mask sees, ``[Bm, 1, Tk, 1]`` in :func:`keep_for`
    ``like``'s form: the real keys of a batch element with a real query."""
    return _padding_real(mask, space, "kv", like)


def _padding_rows(mask: Padding, space) -> Optional[torch.Tensor]:
    """The rows with an allowed key of a padding mask, bool ``[Bm, 1, Tq, 1]``: real queries
    of a batch element with a real key; ``None`` when every row has one."""
    if every_row_has_key(mask, space):
        return None
    return _padding_real(mask, space, "q", None)


def _padding_real(mask: Padding, space, side: str, like: Optional[torch.Tensor]
                  ) -> torch.Tensor:
    """``[Bm, 1, T, 1]`` over ``side``'s positions: those inside its real run, in batch
    elements whose other side's run is not empty; bool, or in :func:`keep_for` ``like``'s
    form. Kept on the mask while its tensors are unchanged."""
    def real():
        q_lo, q_hi, kv_lo, kv_hi = mask.runs(space)
        lo, hi, other = ((q_lo, q_hi, kv_hi > kv_lo) if side == "q"
                         else (kv_lo, kv_hi, q_hi > q_lo))
        positions = torch.arange(space.q_len if side == "q" else space.kv_len,
                                 device=space.device)
        inside = (positions >= lo[:, None]) & (positions < hi[:, None]) & other[:, None]
        inside = inside[:, None, :, None]
        return inside if like is None else keep_for(inside, like)
    key = ("padding real", side, space.q_len, space.kv_len, space.device,
           None if like is None else _bits(like))
    return memo(mask, key, mask_tensors(mask), real)


def _count(allowed: torch.Tensor, bad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row, the non-finite keys it may see: ``allowed [Bm, Hm, n, Tk]`` (bool) against
    ``bad [B, Hq, Tk, 1]`` (1 at a non-finite key) → ``[B, Hq, n, 1]``. A mask shared by the
    heads (Hm = 1) is not copied per head: one matrix product per batch element, the heads
    as its columns."""
    if allowed.shape[1] == 1:
        per_head = allowed[:, 0].to(dtype) @ bad[..., 0].transpose(1, 2)  # [B, n, Hq]
        return per_head.transpose(1, 2)[..., None]
    return allowed.to(dtype) @ bad


def _mask_runs(inputs: Inputs) -> Optional[tuple]:
    """Each query's allowed keys as one run and each key's allowed queries as one run, from
    the mask's :meth:`~attnkit.masks.Mask.structure` (ranges, or a band's diagonals):
    ``(q_lo, q_hi [Bm, Tq], kv_lo, kv_hi [Bm, Tk])`` long with ``lo ≤ hi``, or ``None``
    when the mask has no such form. Kept on the mask while its tensors are unchanged."""
    mask, space = inputs.mask, inputs.space

    def build():
        structure = mask.structure(space)
        if structure is None:
            return None
        if structure.ranges is not None:
            q_runs, kv_runs = (r.long() for r in structure.ranges)  # [B, T, 2] each
            q_lo, q_hi = q_runs[..., 0], q_runs[..., 1]
            kv_lo, kv_hi = kv_runs[..., 0], kv_runs[..., 1]
        elif structure.diagonals is not None:  # keys lo ≤ k − q ≤ hi
            lo, hi = structure.diagonals
            q = torch.arange(space.q_len, device=space.device)[None]
            kv = torch.arange(space.kv_len, device=space.device)[None]
            q_lo = (torch.zeros_like(q) if lo is None else q + lo).clamp(0, space.kv_len)
            q_hi = (torch.full_like(q, space.kv_len) if hi is None
                    else (q + hi + 1).clamp(0, space.kv_len))
            kv_lo = (torch.zeros_like(kv) if hi is None else kv - hi).clamp(0, space.q_len)
            kv_hi = (torch.full_like(kv, space.q_len) if lo is None
                     else (kv - lo + 1).clamp(0, space.q_len))
        else:
            return None
        return q_lo, torch.maximum(q_lo, q_hi), kv_lo, torch.maximum(kv_lo, kv_hi)

    return memo(mask, ("runs", space.batch, space.q_len, space.kv_len, space.device),
                mask_tensors(mask), build)


def _count_runs(runs: tuple, bad: Optional[torch.Tensor], batch: int) -> tuple:
    """:func:`_scan`'s ``(has_key, count, key_any)`` from :func:`_mask_runs`: a row's count
    of non-finite keys is a difference of prefix sums of ``bad [B, Hq, Tk, 1]``, O(Tq + Tk)
    per head instead of a mask evaluation of O(Tq·Tk)."""
    q_lo, q_hi, kv_lo, kv_hi = runs
    has_key = (q_hi > q_lo)[:, None, :, None]  # [Bm, 1, Tq, 1]
    if bad is None:
        return has_key, None, None
    heads = bad.shape[1]
    sums = F.pad(bad[..., 0].cumsum(-1), (1, 0))  # [B, Hq, Tk + 1]: bad keys before each
    at = lambda x: x.expand(batch, -1)[:, None].expand(-1, heads, -1)  # noqa: E731  [B, Hq, T]
    count = (sums.gather(-1, at(q_hi)) - sums.gather(-1, at(q_lo)))[..., None]  # [B, Hq, Tq, 1]
    return has_key, count, (kv_hi > kv_lo)[:, None]  # key_any [Bm, 1, Tk]


def _scan(inputs: Inputs, whole_mask: bool = False) -> tuple:
    """From one evaluation of the mask: per query row, whether it has an allowed key (bool
    ``[Bm|B, Hm|Hq, Tq, 1]``), and, when :func:`checks_keys`, :attr:`Guarded.seen` and per
    key whether some query may see it (bool ``[Bm|B, Hm|Hkv, Tk, 1]``; else ``None``).
    ``whole_mask``: the backend evaluates the whole mask anyway (shared, whatever the
    mask's batch)."""
    if _up_to_a_diagonal(inputs.mask):
        return _scan_prefix(inputs)
    k, dtype = _plain(inputs.k), _dtype(inputs)
    batch, heads, q_len, _ = inputs.q.shape
    bad = None
    if checks_keys(inputs):
        bad = (k @ _zeros(k))[..., 0].isnan().to(dtype)  # [B, Hkv, Tk]: 1 at a non-finite
        # key row (a non-finite value row shows in the outputs, which poison looks at)
        bad = bad.repeat_interleave(inputs.group_size, dim=1)[..., None]  # [B, Hq, Tk, 1]
    space = inputs.space
    banded = q_len >= KV_CHECK_MIN_ROWS and inputs.mask.band() is not None  # prefix sums
    # the whole [Bm, Tq, Tk] mask when small or the backend's own (the call's evaluation),
    # else prefix sums over runs, else row chunks of at most CHUNK_ELEMENTS entries per batch
    entries = q_len * space.kv_len
    mask_batch = _mask_batch(inputs)
    if (entries <= CHUNK_ELEMENTS and not banded
            and (whole_mask or mask_batch * entries <= CHUNK_ELEMENTS)):
        has_key = inputs.has_key()  # [Bm, Hm, Tq, 1], or None: every row has a key
        count = key_any = None
        if bad is not None:
            allowed = inputs.allowed()  # [Bm, Hm, Tq, Tk]
            count, key_any = _count(allowed, bad, dtype), allowed.any(-2)  # key_any [Bm, Hm, Tk]
    elif (runs := _mask_runs(inputs)) is not None:  # each row's keys one run: prefix sums
        has_key, count, key_any = _count_runs(runs, bad, batch)
    else:
        has_key = torch.empty(batch, heads, q_len, 1, dtype=torch.bool, device=k.device)
        count = key_any = None
        if bad is not None:
            count = torch.empty(batch, heads, q_len, 1, dtype=dtype, device=k.device)
            key_any = torch.zeros(batch, heads, space.kv_len, dtype=torch.bool, device=k.device)
        kv_idx = torch.arange(space.kv_len, device=k.device)
        rows = max(1, CHUNK_ELEMENTS // max(1, mask_batch * space.kv_len))
        for start in range(0, q_len, rows):
            stop = min(start + rows, q_len)
            allowed = inputs.mask.tile(torch.arange(start, stop, device=k.device), kv_idx, space)
            has_key[:, :, start:stop] = allowed.any(-1, keepdim=True)  # [Bm, Hm, n, 1] broadcast
            if bad is not None:
                count[:, :, start:stop] = _count(allowed, bad, dtype)
                key_any |= allowed.any(-2)
    if every_row_has_key(inputs.mask, space):
        has_key = None
    if bad is None:
        return has_key, None, None
    seen = torch.where(count > 0, float("nan"), 0.0).to(inputs.q.dtype)  # [B, Hq, Tq, 1]
    heads_kv, group = k.shape[1], inputs.group_size
    if key_any.shape[1] != 1 and group > 1:  # a key counts when a query of its group sees it
        key_any = key_any.unflatten(1, (heads_kv, group)).any(2)
    return has_key, seen, key_any[..., None]


def _mask_batch(inputs: Inputs) -> int:
    """The batch of an evaluation of the call's mask: the mask's own
    (:meth:`~attnkit.masks.Mask._min_batch`), or the call's for a mask that runs user code
    (``from_function`` reading ``b``)."""
    mask = inputs.mask
    return inputs.q.shape[0] if mask_tensors(mask) is None else mask._min_batch()


def _up_to_a_diagonal(mask) -> bool:
    """Whether ``mask`` is a band with an upper bound and no lower one (causal and its
    shifts): :func:`_scan_prefix` reads it."""
    band = mask.band()
    return band is not None and band.left is None and band.right is not None


def _scan_prefix(inputs: Inputs) -> tuple:
    """:func:`_scan` for a band with no lower bound (causal, top-left or bottom-right, and its
    shifts): row ``i`` sees keys ``[0, i + hi]``, so its :attr:`Guarded.seen` is the running
    sum of the keys' flags (0, or NaN from the first non-finite key on) at its last key,
    per K/V head ``[B, Hkv, Tq, 1]``: no mask evaluation, O(Tk) per head."""
    space = inputs.space
    q_len, kv_len = space.q_len, space.kv_len
    hi = inputs.mask.structure(space).diagonals[1]  # row i's last key: i + hi
    device = inputs.q.device
    has_key = None
    if not every_row_has_key(inputs.mask, space):
        has_key = (torch.arange(q_len, device=device) + hi >= 0)[None, None, :, None]
    if not checks_keys(inputs):
        return has_key, None, None
    k = _plain(inputs.k)
    running = (k @ _zeros(k)).cumsum(-2)  # [B, Hkv, Tk, 1]
    if 0 <= hi and hi + q_len <= kv_len:  # every row's last key in range: a slice
        seen = running[:, :, hi:hi + q_len]
    else:
        last = (torch.arange(q_len, device=device) + hi).clamp(0, kv_len - 1)
        seen = running.index_select(2, last)
        if has_key is not None:  # a row without keys sees nothing
            seen = zero_outside(seen, has_key)
    key_seen = None
    if not every_key_seen(inputs.mask, space):
        key_seen = (torch.arange(kv_len, device=device) <= q_len - 1 + hi)[None, None, :, None]
    return has_key, seen.to(inputs.q.dtype), key_seen
