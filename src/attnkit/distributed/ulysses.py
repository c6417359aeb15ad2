"""Ulysses sequence parallelism (DeepSpeed-Ulysses): exact attention over a sequence sharded
across the ranks of a process group, computed as head shards of the whole sequence.

Every rank holds a contiguous shard of the sequence: rank r holds positions ``[r·T/P,
(r+1)·T/P)`` of ``q [B, H, T/P, Dk]``, ``k [B, Hkv, T/P, Dk]`` and ``v [B, Hkv, T/P, Dv]``.
One all-to-all per tensor turns the sequence shards into head shards: rank r receives query
heads ``[r·H/P, (r+1)·H/P)`` over the WHOLE sequence (``[B, H/P, T, Dk]``) and the key/value
heads those query heads read. Each rank then runs :func:`attnkit.attention` on its heads with
the mask of the whole sequence, restricted to its heads (:func:`heads_of`), and a last
all-to-all returns the output (and the LSE) to sequence shards ``[B, H, T/P, Dv]``.

Communication (per rank, per call; :func:`ulysses_bytes` computes it): each all-to-all keeps
``1/P`` of its buffer on the rank and sends the other ``(P − 1)/P`` to the other ranks, so the
forward pass sends ``(P − 1)/P`` of the local q, of the local k and v as laid out by heads for
the receivers (larger than the local k and v when K/V heads are replicated, below), and of the
output (and the LSE); the backward pass sends the same amounts the other way (dOut and dLSE
there, then dQ, dK, dV back). Without replication a rank sends about ``1/P`` of the whole
q, k, v and out (ring attention: the whole K and V, P − 1 local shards of them); in exchange
each rank holds ``[B, H/P, T, D]`` per tensor, the whole sequence of its heads.

K/V heads (GQA/MQA, ``g = H / Hkv`` query heads per K/V head): when ``Hkv`` is a multiple of
P, rank r receives K/V heads ``[r·Hkv/P, (r+1)·Hkv/P)``, each K/V head on one rank. Otherwise
(``Hkv < P``, e.g. MQA, or ``Hkv`` not a multiple of P) the K/V heads are replicated: a rank's
``H/P`` query heads are cut into groups of ``gcd(g, H/P)`` heads that read one K/V head each,
and the rank receives one K/V head per group (:func:`kv_head_index`), so a K/V head read by
the query heads of several ranks is sent to each of them, and may be sent twice to one rank
when two of its groups read it. Each replica's gradient is summed back into the K/V head it
came from.

Tested with multi-process gloo on CPU; written for NCCL on GPUs as well (``all_to_all_single``
on CUDA tensors), not tested there.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Literal, Optional, Sequence, Union, overload

import torch
import torch.distributed as dist

from ..api import attention
from ..call import AttentionResult
from ..inputs import validate
from ..masks import (Mask, _And, _Band, _Bias, _CausalDocuments, _Dense, _Documents, _Not, _Or,
                     _Padding, _SequenceBand)
from ..modifiers import Alibi, RelativeBias, Sinks, Softcap
from . import ring as _ring  # BACKWARD_TIMEOUT (read at call time) and whole_inputs
from .comm import RingComm, disagreement_text, ranks_text

__all__ = ["ulysses_attention", "ulysses_bytes", "heads_of", "kv_head_index"]

PASSED_KEYWORDS = ("dropout_p", "generator", "invariant")
"""Keywords of :func:`attnkit.attention` that :func:`ulysses_attention` passes on to the
attention of each rank's heads."""

_SAME_FOR_EVERY_HEAD = (_Band, _Padding, _Documents, _SequenceBand, _CausalDocuments, Softcap)
"""Mask kinds whose answer is the same for every head (causal, windows, padding, documents,
their per-sequence bands, softcap): every rank evaluates them as given."""


# ---- head layout ------------------------------------------------------------------------------

def _check_heads(heads: int, kv_heads: int, world_size: int) -> None:
    """A ``ValueError`` unless ``world_size`` ranks can share ``heads`` query heads equally."""
    if heads % world_size:
        divisors = [p for p in range(1, heads + 1) if heads % p == 0]
        raise ValueError(
            f"ulysses_attention gives each rank H/P query heads, so the number of query heads H "
            f"must be a multiple of the group size P; got H={heads}, P={world_size}. Use a group "
            f"whose size divides H (one of {divisors}), or ring_attention, which shards the "
            f"sequence only and takes any H")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k has Hkv={kv_heads} heads and q has H={heads}: the number of query "
                         f"heads must be a multiple of the key/value heads (GQA)")


def kv_head_index(heads: int, kv_heads: int, world_size: int) -> torch.Tensor:
    """The K/V heads each rank receives: long ``[P, n]``, row r the global K/V head of each of
    rank r's ``n`` local K/V heads, in order.

    Rank r holds query heads ``[r·H/P, (r+1)·H/P)``; with ``g = H/Hkv`` and ``m = gcd(g,
    H/P)``, its local query head i reads local K/V head ``i // m``, which is global K/V head
    ``(r·H/P + (i // m)·m) // g``, and ``n = (H/P) / m``. When Hkv is a multiple of P this is
    ``m = g``, ``n = Hkv/P`` and row r is ``[r·Hkv/P, (r+1)·Hkv/P)``: no head is repeated.
    Otherwise some K/V heads appear on several ranks (or twice on one).
    """
    _check_heads(heads, kv_heads, world_size)
    group = heads // kv_heads
    local = heads // world_size
    per_kv = math.gcd(group, local)
    starts = torch.arange(world_size)[:, None] * local + torch.arange(local // per_kv) * per_kv
    return starts // group  # [P, n]


def _q_head_index(heads: int, world_size: int) -> torch.Tensor:
    """Rank r's query heads ``[r·H/P, (r+1)·H/P)`` as long ``[P, H/P]``."""
    return torch.arange(heads).reshape(world_size, heads // world_size)


# ---- masks restricted to a rank's heads -------------------------------------------------------

def _narrowed(part: Mask, **tensors: torch.Tensor) -> Mask:
    """A shallow copy of ``part`` with the named tensor fields replaced (memos dropped)."""
    part = copy.copy(part)
    part.__dict__.pop("_memo", None)
    for name, value in tensors.items():
        setattr(part, name, value)
    return part


def heads_of(mask: Optional[Mask], start: int, count: int, heads: int, *,
             caller: str = "ulysses_attention") -> Optional[Mask]:
    """``mask`` (over ``heads`` query heads, its tensors fitted as validation fits them: dense
    and bias ``[Bm, Hm, Tq|1, Tk|1]``) as seen by query heads ``[start, start + count)`` alone.

    Masks that are the same for every head (causal, sliding windows, padding, documents, their
    per-sequence bands, softcap) are kept; per-head tensors are narrowed to those heads:
    ``dense``/``bias`` with ``Hm = H`` (dim 1), ALiBi slopes ``[H]``/``[B, H]`` (last dim),
    relative-bias tables ``[H, buckets]`` (dim 0) and sink logits ``[H]``. The narrowing is a
    view, so a gradient reaches the original tensor's rows of those heads. ``&``, ``|`` and
    ``~`` are rebuilt around their narrowed parts.

    Raises ``ValueError`` for kinds whose dependence on the head cannot be restricted
    (``from_function`` and ``score_function``, which see local head indices ``0 … count − 1``;
    any other mask class); ``caller`` names the function in its message.
    """
    if mask is None:
        return None
    if type(mask) in (_And, _Or, _Not):
        parts = [heads_of(p, start, count, heads, caller=caller) for p in mask.parts]
        if all(new is old for new, old in zip(parts, mask.parts)):
            return mask
        return type(mask)(*parts)
    if type(mask) in _SAME_FOR_EVERY_HEAD:
        return mask
    if type(mask) is _Dense:
        allowed = mask.allowed
        if allowed.dim() == 4 and allowed.shape[1] == heads and heads > 1:
            return _narrowed(mask, allowed=allowed.narrow(1, start, count))
        return mask
    if type(mask) is _Bias:
        values = mask.values
        if values.dim() == 4 and values.shape[1] == heads and heads > 1:
            return _narrowed(mask, values=values.narrow(1, start, count))
        return mask
    if type(mask) is Alibi:
        return _narrowed(mask, slopes=mask.slopes.narrow(-1, start, count))
    if type(mask) is RelativeBias:
        return _narrowed(mask, table=mask.table.narrow(0, start, count))
    if type(mask) is Sinks:
        return _narrowed(mask, logits=mask.logits.narrow(0, start, count))
    kind = getattr(mask, "kind", None) or type(mask).__name__.lstrip("_")
    if kind in ("Function", "score_function"):
        raise ValueError(
            f"{caller} cannot restrict {mask!r} to a rank's heads: each rank would "
            f"call its function with head indices 0 … {count - 1} for its own {count} of the "
            f"{heads} heads (heads {start} … {start + count - 1} here). Express it with "
            f"head-free masks and alibi / "
            f"relative_bias / bias / dense tensors, or use ring_attention, whose ranks hold "
            f"every head")
    raise ValueError(f"{caller} does not know how mask kind {kind} ({mask!r}) depends "
                     f"on the head, so it cannot restrict it to a rank's heads; use "
                     f"ring_attention, whose ranks hold every head")


def _mask_for_heads(whole_mask: Optional[Mask], modifiers, start: int, count: int,
                    heads: int, caller: str = "ulysses_attention") -> Optional[Mask]:
    """The validated whole-sequence mask and modifiers as one mask for heads ``[start, start +
    count)`` (:func:`heads_of` of each; ``caller`` names the function in its errors)."""
    parts = [] if whole_mask is None else [whole_mask]
    if modifiers is not None:
        parts.extend(modifiers.parts())
    parts = [heads_of(part, start, count, heads, caller=caller) for part in parts]
    return functools.reduce(lambda a, b: a & b, parts) if parts else None


# ---- the all-to-alls --------------------------------------------------------------------------

def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """``send [P, ...]`` (part p for rank p) → ``recv [P, ...]`` (part p from rank p)."""
    if send.shape[0] == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _to_heads(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """Sequence shard → head shard. ``x [B, Hx, S, D]`` (this rank's S = T/P positions of every
    head), ``index [P, n]`` (the heads of ``x`` each rank receives) → ``[B, n, P·S, D]``: the
    heads ``index[rank]`` over the whole sequence, shards in rank order."""
    world, n = index.shape
    batch, _, length, dim = x.shape
    picked = x.index_select(1, index.reshape(-1).to(x.device))  # [B, P·n, S, D]
    send = picked.reshape(batch, world, n, length, dim).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group)  # [P (source rank = sequence shard), B, n, S, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, n, world * length, dim)


def _to_sequence(y: torch.Tensor, index: torch.Tensor, heads: int, group) -> torch.Tensor:
    """Head shard → sequence shard, the adjoint of :func:`_to_heads`. ``y [B, n, P·S, D]`` (the
    heads ``index[rank]`` over the whole sequence) → ``[B, heads, S, D]``: this rank's S
    positions of every head, a head that several ranks (or local heads) held getting the sum
    of their parts."""
    world, n = index.shape
    batch, _, total, dim = y.shape
    length = total // world
    send = y.reshape(batch, n, world, length, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # [P (source rank = heads index[source]), B, n, S, D]
    parts = recv.transpose(0, 1).reshape(batch, world * n, length, dim)
    flat = index.reshape(-1).to(y.device)
    out = torch.zeros(batch, heads, length, dim, dtype=y.dtype, device=y.device)
    if flat.unique().numel() == flat.numel():  # every head once: placed, not summed
        return out.index_copy_(1, flat, parts)
    return out.index_add_(1, flat, parts)


class _ToHeads(torch.autograd.Function):
    """``q, k, v`` sequence shards → head shards of the whole sequence (:func:`_to_heads`);
    the backward is the reverse all-to-all (:func:`_to_sequence`), which sums the gradients
    of replicated K/V heads. The three transfers run in a fixed order on every rank."""

    @staticmethod
    def forward(ctx, group, q_index, kv_index, q, k, v):
        ctx.group, ctx.q_index, ctx.kv_index = group, q_index, kv_index
        ctx.heads = (q.shape[1], k.shape[1])
        return (_to_heads(q, q_index, group), _to_heads(k, kv_index, group),
                _to_heads(v, kv_index, group))

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        need_q, need_k, need_v = ctx.needs_input_grad[3:]
        heads, kv_heads = ctx.heads
        dq = _to_sequence(grad_q, ctx.q_index, heads, ctx.group) if need_q else None
        dk = _to_sequence(grad_k, ctx.kv_index, kv_heads, ctx.group) if need_k else None
        dv = _to_sequence(grad_v, ctx.kv_index, kv_heads, ctx.group) if need_v else None
        return None, None, None, dq, dk, dv


HANDSHAKE_TAG = 32
"""The tag of the backward's handshake (apart from the ring's tags: a hybrid runs both)."""


def backward_timeout_of(value: Optional[float], caller: str) -> float:
    """``value`` checked (a finite positive number of seconds), or the ring's
    ``BACKWARD_TIMEOUT`` read now when ``None``."""
    if value is None:
        return _ring.BACKWARD_TIMEOUT
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)):
        raise ValueError(f"{caller}: backward_timeout={value!r}: use a finite positive number of "
                         f"seconds (default {_ring.BACKWARD_TIMEOUT:g}), below the process "
                         f"group's own timeout")
    return float(value)


class _ToSequence(torch.autograd.Function):
    """Head shards of the whole sequence (``out``, and ``lse`` as ``[B, H/P, T, 1]``) → sequence
    shards (:func:`_to_sequence`); the backward is the reverse all-to-all, after a handshake
    bounded by ``timeout`` seconds: a rank that skipped the backward is named on the others
    (``caller``'s message) instead of leaving them in the all-to-all until the group's
    timeout. A gradient that autograd does not give (an unused LSE) travels as zeros, so every
    rank makes the same transfers."""

    @staticmethod
    def forward(ctx, group, q_index, heads, timeout, caller, *tensors):
        ctx.group, ctx.q_index, ctx.timeout, ctx.caller = group, q_index, timeout, caller
        return tuple(_to_sequence(t, q_index, heads, group) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        comm = RingComm(ctx.group)
        absent, error = comm.handshake(ctx.timeout, tag=HANDSHAKE_TAG, device=grads[0].device)
        if absent:
            raise RuntimeError(
                f"{ctx.caller}: {ranks_text(absent)} of its all-to-all group did not run the "
                f"backward of {ctx.caller} within backward_timeout={ctx.timeout:g} s (seen on "
                f"rank {comm.rank} of that group); every rank must backpropagate through its "
                f"output, e.g. each rank calls loss.backward() on a loss that uses its out (add "
                f"0 * out.sum() on a rank whose share of the loss is zero). The process group "
                f"cannot be used after this error. Transport error: {error}")
        return (None, None, None, None, None,
                *(_to_heads(g.contiguous(), ctx.q_index, ctx.group) for g in grads))


# ---- validation (every rank agrees, or every rank raises) -------------------------------------

_AGREEMENT = {
    "shapes": "every rank passes shards of one shape: the whole sequence cut into P equal "
              "contiguous parts along dim -2",
    "dtype": "cast q, k and v to one dtype on every rank",
    "options": "pass the same scale=, return_lse=, backend= and attention keywords on every rank",
    "mask": "every rank passes the mask of the whole sequence with the same contents",
    "grad": "call with grad enabled on every rank or on none, and with q, k, v requiring grad "
            "alike on every rank: the backward runs all-to-alls that every rank joins",
}
"""What every rank must agree on, each with the way to make ranks agree."""


def _signature(q, k, v, mask, scale, return_lse, backend, kwargs) -> dict[str, str]:
    """What every rank must agree on (the keys of :data:`_AGREEMENT`) as strings; never
    raises (a rank that raised here would leave the others waiting)."""
    def shape(t):
        return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__

    mask_text, grads = _ring.mask_agreement(q, k, v, mask)
    options = f"scale={scale!r}, return_lse={return_lse!r}, backend={backend!r}, " + ", ".join(
        f"{key}={'<generator>' if key == 'generator' else repr(value)}"
        for key, value in sorted(kwargs.items()))
    return {"shapes": f"q {shape(q)}, k {shape(k)}, v {shape(v)}",
            "dtype": str(getattr(q, "dtype", None)), "options": options, "mask": mask_text,
            "grad": f"grad mode {torch.is_grad_enabled()}, requires_grad {grads}"}


def check_shards(q, k, v, caller: str) -> None:
    """``q``, ``k``, ``v`` are 4-D tensors (``[B, H, T/P, D]`` shards), else a ``TypeError`` /
    ``ValueError`` from ``caller`` naming the shapes and the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{caller} takes 4-D shards [B, H, T/P, D]; {name} has shape "
                f"{tuple(t.shape)} (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                f"). Add the missing dims (x[None] for a batch of one, x[:, None] for one head)")


def _check_local(q, k, v, mask, scale, return_lse, backend, kwargs, rank: int,
                 world_size: int) -> Optional[Mask]:
    """This rank's checks; returns the mask restricted to this rank's query heads. Raises
    ``TypeError``/``ValueError`` naming the shapes and the fix."""
    check_shards(q, k, v, "ulysses_attention")
    unknown = sorted(set(kwargs) - set(PASSED_KEYWORDS))
    if "return_weights" in unknown:
        raise ValueError("ulysses_attention does not return attention weights: each rank holds "
                         "[B, H/P, T, T] of them, not a sequence shard; call attnkit.attention on "
                         "the whole sequence to get weights")
    if unknown:
        raise TypeError(f"ulysses_attention got unexpected keyword(s) {unknown}; it passes "
                        f"{list(PASSED_KEYWORDS)} on to attnkit.attention")
    validate(q, k, v, None, scale=scale, need_lse=return_lse)  # the attention() checks
    heads, kv_heads = q.shape[1], k.shape[1]
    _check_heads(heads, kv_heads, world_size)
    whole = _ring.whole_inputs(q, k, v, mask, scale, world_size)
    count = heads // world_size
    return _mask_for_heads(whole.mask, whole.modifiers, rank * count, count, heads)


def _validate(q, k, v, mask, scale, return_lse, backend, kwargs, group, rank: int,
              world_size: int) -> Optional[Mask]:
    """Check this rank's input, then that all ranks agree; raise the same error on every rank
    before any all-to-all. Returns this rank's mask (:func:`heads_of`)."""
    failure, local_mask = None, None
    try:
        local_mask = _check_local(q, k, v, mask, scale, return_lse, backend, kwargs, rank,
                                  world_size)
    except (TypeError, ValueError) as error:
        failure = (type(error).__name__, str(error))
    signature = _signature(q, k, v, mask, scale, return_lse, backend, kwargs)
    everyone: list = [None] * world_size
    if world_size == 1:
        everyone = [(failure, signature)]
    else:
        dist.all_gather_object(everyone, (failure, signature), group=group)
    failed = [(r, f) for r, (f, _) in enumerate(everyone) if f is not None]
    if failed:
        own = failure if failure is not None else failed[0][1]
        kind, message = own
        error_type = TypeError if kind == "TypeError" else ValueError
        where = f"rank {rank}" if failure is not None else f"rank {failed[0][0]}"
        raise error_type(f"ulysses_attention: invalid input on rank(s) "
                         f"{[r for r, _ in failed]} ({where}): {message}")
    disagreement = disagreement_text("ulysses_attention", [s for _, s in everyone], _AGREEMENT)
    if disagreement:
        raise ValueError(disagreement)
    return local_mask


# ---- the public functions ---------------------------------------------------------------------

@overload
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Union[Mask, torch.Tensor, None] = None, *,
                      scale: Optional[float] = None, group: Optional[dist.ProcessGroup] = None,
                      return_lse: Literal[False] = False, backend: str = "auto",
                      backward_timeout: Optional[float] = None, **attention_kwargs: Any,
                      ) -> torch.Tensor: ...


@overload
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Union[Mask, torch.Tensor, None] = None, *,
                      scale: Optional[float] = None, group: Optional[dist.ProcessGroup] = None,
                      return_lse: Literal[True], backend: str = "auto",
                      backward_timeout: Optional[float] = None, **attention_kwargs: Any,
                      ) -> AttentionResult: ...


@overload
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Union[Mask, torch.Tensor, None] = None, *,
                      scale: Optional[float] = None, group: Optional[dist.ProcessGroup] = None,
                      return_lse: bool = False, backend: str = "auto",
                      backward_timeout: Optional[float] = None, **attention_kwargs: Any,
                      ) -> Union[torch.Tensor, AttentionResult]: ...


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Union[Mask, torch.Tensor, None] = None, *,
                      scale: Optional[float] = None, group: Optional[dist.ProcessGroup] = None,
                      return_lse: bool = False, backend: str = "auto",
                      backward_timeout: Optional[float] = None, **attention_kwargs,
                      ) -> Union[torch.Tensor, AttentionResult]:
    """Exact attention over a sequence sharded across the ranks of ``group`` by Ulysses'
    all-to-all (sequence shards → head shards → sequence shards); call on every rank.

    Each rank passes its contiguous shard (rank r: positions ``[r·T/P, (r+1)·T/P)``, as
    ``shard(x, r, P)`` cuts): ``q [B, H, Tq/P, Dk]``, ``k [B, Hkv, Tk/P, Dk]``, ``v [B, Hkv,
    Tk/P, Dv]``. Returns this rank's ``out [B, H, Tq/P, Dv]``, or with ``return_lse`` an
    :class:`~attnkit.AttentionResult` ``(out, lse [B, H, Tq/P], None)``: the rows of
    ``attention(q_whole, k_whole, v_whole, mask)`` at this rank's positions (as
    ``ring_attention`` returns them).

    Rank r computes query heads ``[r·H/P, (r+1)·H/P)`` over the whole sequence with
    :func:`attnkit.attention` (``backend`` picks its backend; ``dropout_p``, ``generator`` and
    ``invariant`` in ``attention_kwargs`` are passed on; dropout then draws per rank, so its
    pattern differs from a single-process call's). H must be a multiple of P (``ValueError``
    otherwise). K/V heads: when Hkv is a multiple of P, each rank receives ``Hkv/P`` of them;
    otherwise (``Hkv < P``, MQA, or not a multiple) each rank receives the K/V heads its query
    heads read (:func:`kv_head_index`): a K/V head is then sent to every rank that reads it, so
    each rank holds and receives ``H/(P·gcd(H/Hkv, H/P))`` K/V heads of the whole sequence
    instead of ``Hkv/P`` (MQA: one K/V head per rank, i.e. the whole K and V on every rank),
    and the backward sums each replica's gradient into its K/V head.

    Args:
        mask: the mask of the WHOLE sequence, as given to ``attention`` (the same on every
            rank). Masks that are the same for every head (causal, sliding windows, padding,
            documents, softcap) are used as given; per-head tensors are narrowed to the rank's
            heads (``dense``/``bias`` with a head dim of H, ``alibi`` slopes, ``relative_bias``
            tables, ``sinks`` logits; :func:`heads_of`). A learnable slope, table, logit or
            bias gets the gradient of this rank's heads only: sum it over the group, as for
            any replicated parameter. ``from_function`` and ``score_function`` raise
            ``ValueError`` (they would see local head indices).
        group: the process group (default: the world); its timeout bounds every wait.
        backend: the :func:`attnkit.attention` backend of each rank's heads.
        backward_timeout: seconds the backward waits for every other rank to reach it
            (default: ``attnkit.distributed.ring.BACKWARD_TIMEOUT``, read at call time); the
            ranks that do not are named in a ``RuntimeError`` on the others.

    Communication, per rank: four all-to-alls forward (q, k, v, out; a fifth for the LSE with
    ``return_lse``), the same four (five) backward; bytes in :func:`ulysses_bytes`.

    Differentiable in q, k, v and the mask's learnable tensors; every rank must backpropagate
    through its output (the backward's all-to-alls need every rank). Shapes, dtype, options,
    the mask's contents, grad mode and ``requires_grad`` are compared across ranks before any
    transfer: a problem on any rank raises the same error on every rank.
    """
    timeout = backward_timeout_of(backward_timeout, "ulysses_attention")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ulysses_attention needs an initialised torch.distributed process group: launch with "
            "torchrun and call torch.distributed.init_process_group(...), or use "
            "attnkit.distributed.spawn(fn, world_size) for local processes")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    local_mask = _validate(q, k, v, mask, scale, return_lse, backend, attention_kwargs, group,
                           rank, world_size)
    heads, kv_heads = q.shape[1], k.shape[1]
    q_index = _q_head_index(heads, world_size)
    kv_index = kv_head_index(heads, kv_heads, world_size)
    q_h, k_h, v_h = _ToHeads.apply(group, q_index, kv_index, q, k, v)
    result = attention(q_h, k_h, v_h, local_mask, scale=scale, backend=backend,
                       return_lse=return_lse, **attention_kwargs)
    if not return_lse:
        (out,) = _ToSequence.apply(group, q_index, heads, timeout, "ulysses_attention", result)
        return out
    out, lse = _ToSequence.apply(group, q_index, heads, timeout, "ulysses_attention", result.out,
                                 result.lse.unsqueeze(-1))
    return AttentionResult(out, lse.squeeze(-1), None)


def ulysses_bytes(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int],
                  world_size: int, element_size: int, *, return_lse: bool = False,
                  lse_element_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends to the other ranks in one :func:`ulysses_attention` call.

    ``q_shape [B, H, Tq/P, Dk]``, ``k_shape [B, Hkv, Tk/P, Dk]``, ``v_shape [B, Hkv, Tk/P,
    Dv]``: the local shards; ``element_size``: bytes per element of q/k/v/out (2 for
    fp16/bf16); ``lse_element_size``: of the LSE (4: fp32, 8 for fp64 inputs).

    Returns ``{"q", "k", "v", "out", "lse", "forward", "backward"}``: each all-to-all sends
    ``(P − 1)/P`` of its buffer: q ``(P−1)·B·(H/P)·(Tq/P)·Dk``, k ``(P−1)·B·n·(Tk/P)·Dk``
    and v ``(P−1)·B·n·(Tk/P)·Dv`` with ``n`` the K/V heads per rank (``Hkv/P``, or more when
    replicated: :func:`kv_head_index`), out ``(P−1)·B·(H/P)·(Tq/P)·Dv`` and, with
    ``return_lse``, lse ``(P−1)·B·(H/P)·(Tq/P)`` elements (else 0). ``forward`` is their sum;
    ``backward`` the same sum (dOut, dLSE, dQ, dK, dV travel the reverse way).
    """
    for name, shape in (("q_shape", q_shape), ("k_shape", k_shape), ("v_shape", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"ulysses_bytes: {name} {tuple(shape)} must be a 4-D local shard "
                             f"shape [B, H, T/P, D]")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"ulysses_bytes: world_size={world_size!r} must be a positive int")
    batch, heads, q_len, dk = q_shape
    _, kv_heads, kv_len, _ = k_shape
    dv = v_shape[-1]
    local_kv = kv_head_index(heads, kv_heads, world_size).shape[1]
    others = world_size - 1
    local_q = heads // world_size
    sent = {"q": others * batch * local_q * q_len * dk * element_size,
            "k": others * batch * local_kv * kv_len * dk * element_size,
            "v": others * batch * local_kv * kv_len * dv * element_size,
            "out": others * batch * local_q * q_len * dv * element_size,
            "lse": others * batch * local_q * q_len * lse_element_size if return_lse else 0}
    sent["forward"] = sent["backward"] = sum(sent.values())
    return sent
