"""Non-finite inputs: masked positions cannot leak, allowed ones propagate.

Real inputs hold garbage where the mask says it does not matter: a padded batch, a KV cache
allocated with ``torch.empty``. The rules (docs/NUMERICS.md), for every backend:

- NaN/inf in K or V at a position the mask excludes for query i never reaches out[i], lse[i]
  or any gradient;
- NaN/inf in q[i], or in a K/V row that query i may attend, makes out[i] and lse[i] NaN (and
  the gradients that flow through row i), never 0. A fully masked row stays out 0, lse −inf.

Kernels compute masked scores and ``0 · v`` products inside partially masked tiles, so a
non-finite value there leaks (``NaN + −inf``, ``0 · NaN``) and shows as NaN in the output or
LSE; the fused CPU kernel turns a row whose scores in one call are all NaN (a NaN query, or
only non-finite keys) into output 0 and LSE 0 instead. Rather than guard every tile of every
kernel, :func:`suspect` sums, after each call, q, the results and, for calls of at least
:data:`KV_CHECK_MIN_ROWS` query rows or small K/V, K and V too (a decoding step over a long
cache reads nothing but K/V, so summing them there would double its cost); the common case
ends there. A suspect call is
recomputed: :func:`clean` finds the non-finite rows of q, K and V, zeroes them in copies that
the backend runs on, and :func:`poison` marks the query rows that could see them as NaN.

The check runs on eager CPU calls only (:func:`checked`): on a GPU its host read would make
every call wait for the device. There a non-finite K/V value at a masked position inside a
partially masked tile reaches that tile's other rows as NaN, never as a wrong finite number.

What a decoding step over a long cache can miss (K/V not summed): a row for which every key
that one fused-kernel call gives it is non-finite *and allowed* comes out as 0 (not NaN); and
a fully masked row (zeroed after the torch kernel) hides that kernel's backward reading
non-finite masked K/V, whose gradients then carry NaN.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from .inputs import Inputs

KV_CHECK_MIN_ROWS = 64
"""Calls with at least this many query rows also sum K and V in :func:`suspect`: at most
1/64 of what the attention itself reads."""

KV_CHECK_MAX_ELEMENTS = 1 << 12
"""Calls whose K and V hold at most this many elements each also sum them in :func:`suspect`,
whatever their query rows: a few microseconds, below a call's fixed cost (a decoding step over
a longer cache reads little else, and summing its cache would cost as much as the step)."""

SMALL_CALL_ELEMENTS = 1 << 16
"""Calls whose checked tensors hold at most this many elements in all are checked with one
concatenation and one sum (copying them costs less than an operation per tensor)."""

CHUNK_ELEMENTS = 1 << 22
"""Mask elements evaluated at once when finding the rows that see a non-finite key."""


def checked(inputs: Inputs) -> bool:
    """Whether :func:`suspect` runs for this call: eager, untransformed calls on the CPU. On
    an accelerator its host read would wait for the device (every call a synchronisation,
    which also breaks CUDA-graph capture); a traced or compiled graph cannot branch on data;
    under ``torch.func`` the reference keeps the rules by itself."""
    return (inputs.q.device.type == "cpu" and not inputs.transformed
            and not torch.compiler.is_compiling())


def suspect(inputs: Inputs, out: torch.Tensor, lse: Optional[torch.Tensor]) -> bool:
    """Whether the call must be recomputed on cleaned inputs: q, K and V hold NaN/inf, or,
    where K/V are not summed (:data:`KV_CHECK_MIN_ROWS`), q, ``out`` or ``lse`` do (a
    non-finite K/V value a row reads shows in its out or LSE). With every input finite the
    results need no look: a recomputation would find nothing to clean. NaN and ±inf propagate
    into a sum (a finite tensor whose sum overflows only costs a recomputation that finds
    nothing to clean); the LSE enters clamped at 0, since its −inf (a fully masked row) is no
    problem. Small calls sum one concatenation (one reduction instead of one per tensor: their
    cost is the number of operations); either way one host read."""
    dtype = torch.float64 if inputs.q.dtype == torch.float64 else torch.float32
    k, v = inputs.k, inputs.v
    with torch.no_grad() if inputs.need_grad else contextlib.nullcontext():
        if inputs.q.shape[2] >= KV_CHECK_MIN_ROWS or max(k.numel(), v.numel()) <= KV_CHECK_MAX_ELEMENTS:
            parts = [inputs.q, k, v]
        else:
            parts = [inputs.q, out] + ([] if lse is None else [lse.clamp(min=0)])
        if sum(p.numel() for p in parts) <= SMALL_CALL_ELEMENTS:
            return not math.isfinite(torch.cat([p.reshape(-1) for p in parts]).sum(dtype=dtype).item())
        return not all(map(math.isfinite, torch.stack([p.sum(dtype=dtype) for p in parts]).tolist()))


class Cleaned(NamedTuple):
    """``inputs`` with non-finite q/k/v rows zeroed, and ``rows [B, Hq, Tq]`` (bool): the
    query rows whose result must be NaN."""

    inputs: Inputs
    rows: torch.Tensor


def clean(inputs: Inputs) -> Optional[Cleaned]:
    """Zero every q row and K/V row holding a non-finite value (a copy; gradients still reach
    the finite entries), and find the query rows that see one: a non-finite q row with any
    allowed key, or a row that may attend a non-finite K/V row. ``None`` when nothing is
    non-finite after all."""
    q, k, v = inputs.q, inputs.k, inputs.v
    bad_q = ~torch.isfinite(q).all(-1)  # [B, Hq, Tq]
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [B, Hkv, Tk]
    any_q, any_kv = bool(bad_q.any()), bool(bad_kv.any())
    if not (any_q or any_kv):
        return None
    group = inputs.group_size
    bad_keys = bad_kv.repeat_interleave(group, dim=1)  # [B, Hq, Tk]
    rows = torch.zeros_like(bad_q)
    mask, space = inputs.mask, inputs.space
    tq, tk = q.shape[2], k.shape[2]
    if mask is None:
        rows |= bad_keys.any(-1, keepdim=True)
        if tk:
            rows |= bad_q
    else:
        q_idx = torch.arange(tq, device=q.device)
        chunk = max(1, CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * tq))
        if any_kv:  # only the key columns that are non-finite somewhere
            columns = bad_kv.flatten(0, 1).any(0).nonzero().flatten()
            for part in columns.split(chunk):
                allowed = mask.tile(q_idx, part, space)  # [Bm, Hm, Tq, c]
                rows |= (allowed & bad_keys[:, :, None, part]).any(-1)
        if any_q:  # a non-finite q row counts only where it has an allowed key
            has_key = torch.zeros_like(bad_q)
            for start in range(0, tk, chunk):
                part = torch.arange(start, min(start + chunk, tk), device=q.device)
                has_key |= mask.tile(q_idx, part, space).any(-1)
            rows |= bad_q & has_key
    fixed = replace(inputs,
                    q=q.masked_fill(bad_q[..., None], 0.0) if any_q else q,
                    k=k.masked_fill(bad_kv[..., None], 0.0) if any_kv else k,
                    v=v.masked_fill(bad_kv[..., None], 0.0) if any_kv else v)
    return Cleaned(fixed, rows)


def poison(x: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """``x [B, Hq, Tq, ...]`` with ``rows`` set to NaN, as ``x · (NaN or 1)``: a gradient
    reaching a poisoned row goes back as NaN, so training divergence shows in the gradients
    too, and every other row's value and gradient is unchanged."""
    if x is None:
        return None
    where = rows.reshape(*rows.shape, *([1] * (x.dim() - rows.dim())))
    return x * torch.where(where, float("nan"), 1.0).to(x.dtype)
