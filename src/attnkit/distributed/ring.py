"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Every rank holds one shard of the queries, keys and values (dim -2 is the sequence). The K/V
shards travel around the ring, one hop per step; after P steps every query shard has met every
key shard. Each step is computed at GLOBAL positions, so the mask is the one that would be
given to ``attention`` on the whole sequence, and partial results are merged in fp32 with the
stable LSE merge (:func:`attnkit.numerics.merge`). A step runs on the fused triton kernels
(``backend="triton"``, the choice of ``"auto"`` on CUDA), which take the whole mask's
:func:`~attnkit.distributed.window.window` over the step's rectangle, or on the tiled engine
(:mod:`attnkit.backends.tiled`), which takes global offsets itself.

- Double buffering: the next K/V shard is already in flight while the current one is computed.
- Skipping: a (query chunk × key chunk) pair whose block map is empty everywhere is never
  computed (most of the upper triangle of a causal mask), and its K/V still moves on.
- Backward: each step's exact contribution to dQ, dK, dV comes from the step's backward with the
  *final* out and LSE (as FlashAttention / ring-flash-attn). dK/dV accumulators travel around
  the ring with the K/V and arrive, complete, at the rank that owns the shard.
- ``layout="zigzag"``: the sequence is cut into 2P chunks and rank r holds chunks r and
  2P−1−r, so every rank does the same causal work. A step is then up to 4 chunk pairs.
- ``layout=`` a :class:`~attnkit.distributed.balance.BalancedLayout`: the blocks each rank
  holds were chosen by :func:`~attnkit.distributed.balance.plan_balance` to even out the work of
  any mask; a rank's shard is its runs of adjacent blocks, a step one pair per run pair.
- Agreement: before any transfer the ranks compare shapes, dtype, layout, scale, the mask's
  content digest, grad mode and ``requires_grad`` (:func:`_validate`). The backward starts with
  a handshake bounded by ``backward_timeout``: a rank that skips the backward is named on the
  others within that time instead of leaving them waiting for the group timeout.

Tested with multi-process gloo on CPU (world sizes 1–4, float64/float32, every structured
mask; the triton steps through the Triton interpreter, world sizes 2–3); written for NCCL on
GPUs, not tested there (see docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, Union, overload

import torch
import torch.distributed as dist

from ..call import AttentionResult
from ..backends.base import batched_gradient
from ..backends.tiled import BLOCK_K, Problem, make_plan, tiled_backward, tiled_forward, uses_fused_kernel
from ..backends.triton import TritonBackend, backward_step, forward_step, score_mods
from ..backends.triton import launch
from ..inputs import Inputs, restore, validate
from ..masks import Mask, MaskSpace, as_mask, digest, mask_tensors
from ..modifiers import Modifiers
from ..numerics import accum_dtype, merge
from .balance import BalancedLayout, Piece
from .comm import RingComm, disagreement_text, ranks_text
from .window import window

LAYOUTS = ("contiguous", "zigzag")
"""The named ways to cut the global sequence into shards (see :func:`shard`); a
:class:`~attnkit.distributed.balance.BalancedLayout` is the other kind of layout."""

Layout = Union[str, BalancedLayout]
"""A layout: one of :data:`LAYOUTS` or a :class:`BalancedLayout`."""

BACKENDS = ("auto", "tiled", "triton")
"""What computes a ring step: the fused triton kernels, the tiled engine, or ``"auto"``:
triton for CUDA tensors it supports, else tiled."""

KV_TAG, GRAD_TAG, HANDSHAKE_TAG = 0, 8, 16
"""Tag ranges of the K/V and the dK/dV transfers (both are in flight at once in backward) and
the tag of the backward's handshake."""

BACKWARD_TIMEOUT = 120.0
"""Seconds the backward waits for every other rank to reach it (``ring_attention``'s
``backward_timeout=None`` reads this at call time). Ranks that run the backward wait for each
other here, so it must exceed the usual skew between ranks; it only needs to be below the
process group's timeout to make a skipped backward fail first and with a clear message."""


# ---- layouts ----------------------------------------------------------------------------------

def _check_layout(layout: Layout) -> None:
    if isinstance(layout, BalancedLayout):
        return
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use 'contiguous' (rank r holds the r-th of P equal "
                         f"parts), 'zigzag' (rank r holds chunks r and 2P-1-r of 2P, balanced "
                         f"for causal masks) or a BalancedLayout from "
                         f"attnkit.distributed.plan_balance(mask, T, P) (balanced for any mask)")


def _check_balanced(layout: BalancedLayout, world_size: int, length: int, what: str) -> None:
    """A ``ValueError`` unless ``layout`` was planned for ``world_size`` ranks and a sequence
    of ``length`` positions (``what`` names where the length comes from)."""
    if layout.world_size != world_size or layout.length != length:
        raise ValueError(f"{layout!r} was planned for world_size={layout.world_size} and length "
                         f"{layout.length}, but {what} has world_size={world_size} and length "
                         f"{length}: plan the layout with plan_balance(mask, {length}, "
                         f"{world_size}, block=...) for this sequence and group")


def pieces(local_len: int, rank: int, world_size: int, layout: Layout) -> list[Piece]:
    """The runs of global positions that rank ``rank``'s shard of ``local_len`` rows holds.

    contiguous: one run, ``[rank·L, (rank+1)·L)``. zigzag: two runs of ``L/2`` rows, chunks
    ``rank`` and ``2P−1−rank`` of the 2P chunks of size ``L/2``. A :class:`BalancedLayout`:
    its runs for ``rank`` (``layout.pieces(rank)``); ``local_len · world_size`` must be its
    length.
    """
    _check_layout(layout)
    if isinstance(layout, BalancedLayout):
        _check_balanced(layout, world_size, local_len * world_size,
                        f"a shard of {local_len} rows on {world_size} ranks")
        return layout.pieces(rank)
    if layout == "contiguous":
        return [Piece(0, rank * local_len, local_len)]
    half = local_len // 2
    return [Piece(0, rank * half, half), Piece(half, (2 * world_size - 1 - rank) * half, half)]


def shard(x: torch.Tensor, rank: int, world_size: int, layout: Layout = "contiguous",
          dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (default -2, the sequence of ``[..., H, T, D]``).

    ``x [..., T, D]`` → ``[..., T/P, D]``. contiguous: the rank-th of P equal parts. zigzag: the
    sequence cut into 2P chunks, the shard is chunk ``rank`` followed by chunk ``2P−1−rank``.
    A :class:`~attnkit.distributed.balance.BalancedLayout` (planned for this T and P): the
    layout's runs for ``rank``, in order (rows at global positions ``layout.positions(rank)``).
    The result is a new contiguous tensor (differentiable). :func:`unshard` is its inverse.
    """
    _check_layout(layout)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive int")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: must be an int in [0, {world_size})")
    length = x.shape[dim]
    if isinstance(layout, BalancedLayout):
        _check_balanced(layout, world_size, length, f"x {tuple(x.shape)} (dim {dim})")
        return torch.cat([x.narrow(dim, run.global_start, run.count)
                          for run in layout.pieces(rank)], dim=dim)
    parts = world_size * (2 if layout == "zigzag" else 1)
    if length % parts:
        raise ValueError(f"sequence length {length} (dim {dim} of {tuple(x.shape)}) does not split "
                         f"into {parts} equal chunks for layout={layout!r} with world_size="
                         f"{world_size}: pad the sequence to a multiple of {parts} (and mask the "
                         f"padding)")
    runs = pieces(length // world_size, rank, world_size, layout)
    return torch.cat([x.narrow(dim, run.global_start, run.count) for run in runs], dim=dim)


def unshard(shards: Sequence[torch.Tensor], layout: Layout = "contiguous",
            dim: int = -2) -> torch.Tensor:
    """The whole tensor from every rank's shard (rank order): the inverse of :func:`shard`.

    ``shards``: P tensors ``[..., T/P, D]`` → ``[..., T, D]``. A
    :class:`~attnkit.distributed.balance.BalancedLayout` must have been planned for this P and T.
    """
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("unshard needs at least one shard")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"unshard: shards must all have one shape, got "
                         f"{[tuple(s.shape) for s in shards]}")
    world_size, local_len = len(shards), shards[0].shape[dim]
    if isinstance(layout, BalancedLayout):
        _check_balanced(layout, world_size, world_size * local_len,
                        f"unshard of {world_size} shards {tuple(shards[0].shape)} (dim {dim})")
        whole = torch.cat(shards, dim=dim)  # rows in the layout's permutation order
        return whole.index_select(dim, layout.inverse.to(whole.device))
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"unshard: zigzag shards hold two equal chunks, so their length must be "
                         f"even; got {local_len} (dim {dim} of {tuple(shards[0].shape)})")
    chunks_per_rank = 2 if layout == "zigzag" else 1
    chunk = local_len // chunks_per_rank
    if chunk == 0:  # empty shards: nothing to reorder
        return torch.cat(shards, dim=dim)
    ordered: list[Optional[torch.Tensor]] = [None] * (world_size * chunks_per_rank)
    for rank, part in enumerate(shards):
        for run in pieces(local_len, rank, world_size, layout):
            ordered[run.global_start // chunk] = part.narrow(dim, run.start, run.count)
    return torch.cat(ordered, dim=dim)


# ---- one call's plan --------------------------------------------------------------------------

@dataclass
class RingStats:
    """What one :func:`ring_attention` call did on this rank (filled when passed as ``stats=``).

    ``tiles_per_step[i]``: tiles (of the step backend's size, per batch element and head for
    triton) computed at ring step i (the K/V of rank
    ``rank − i``); ``forward_tiles`` their sum; ``backward_tiles`` the same for the backward pass
    (0 until it runs). ``pairs_skipped``: (query chunk × key chunk) pairs the mask empties.
    ``bytes_sent``: bytes this rank sent (forward, plus backward once it ran). ``layout``:
    the layout's name, ``"balanced"`` for a :class:`BalancedLayout`.
    """

    rank: int = 0
    world_size: int = 1
    layout: str = "contiguous"
    tiles_per_step: list[int] = field(default_factory=list)
    forward_tiles: int = 0
    backward_tiles: int = 0
    pairs_computed: int = 0
    pairs_skipped: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True)
class Scoring:
    """A ring call's score modifiers (softcap, ALiBi, relative biases; sinks join after the
    ring) as its steps take them. ``params``: the tensors the ring differentiates (the
    autograd inputs of its steps, ``None`` entries allowed): for triton steps ALiBi's ``slopes
    [1|B, H]`` and the relative biases per distance ``diag [H, Tq + Tk − 1]`` (over the whole
    sequence; :func:`~attnkit.backends.triton.backend.score_mods`), with ``cap`` and ``shift``;
    for tiled steps the modifiers' own tensors (``modifiers.tensors``), ``modifiers`` applied
    per tile at global positions."""

    params: tuple
    modifiers: Optional[Modifiers] = None
    cap: Optional[float] = None
    shift: int = 0


NO_SCORING = Scoring(())


class _TiledStep:
    """A step's pair on the tiled engine, its ``problem`` at global offsets (with the
    modifiers' own tensors: ``params`` are not read, ``dparams`` get their gradients)."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def forward(self, q, k, v, params=()):
        return tiled_forward(q, k, v, self.problem)

    def backward(self, q, k, v, out, lse, grad_out, grad_lse, params=(), dparams=()):
        # fp32 parts for fp16/bf16: rounded once, at the end
        return tiled_backward(q, k, v, out, lse, grad_out, grad_lse, self.problem, accumulate=True,
                              dparams=dparams)


class _TritonStep:
    """A step's pair on the fused triton kernels, ``plan`` built from the mask's window, the
    modifiers moved there too (``cap``; ALiBi's ``shift`` and the relative vector's offset at
    local positions). Its parts come in the inputs' dtype (fp16/bf16 parts are rounded before
    the fp32 merge)."""

    def __init__(self, plan: launch.Plan, cap: Optional[float], shift: int, diag_off: int):
        self.plan, self.cap, self.shift, self.diag_off = plan, cap, shift, diag_off

    def _mods(self, params) -> launch.ScoreMods:
        slopes, diag = params if params else (None, None)
        return launch.ScoreMods(self.cap, slopes, self.shift, diag, self.diag_off)

    def forward(self, q, k, v, params=()):
        return forward_step(q, k, v, self.plan, self._mods(params))

    def backward(self, q, k, v, out, lse, grad_out, grad_lse, params=(), dparams=()):
        dslope, ddiag = dparams if dparams else (None, None)
        return backward_step(grad_out, grad_lse, q, k, v, out, lse.contiguous(), self.plan,
                             self._mods(params), dslope, ddiag)


@dataclass(frozen=True)
class _Pair:
    """One computation of a step: these local query rows against these rows of the K/V shard
    currently held, at global positions. ``step.forward(q, k, v) -> (out, lse)`` and
    ``step.backward(q, k, v, out, lse, grad_out, grad_lse) -> (dq, dk, dv)``."""

    q: Piece
    kv: Piece
    step: Union[_TiledStep, _TritonStep]


@dataclass
class _Ring:
    comm: RingComm
    steps: list[list[_Pair]]  # steps[i]: pairs against the K/V of rank (rank - i) mod P
    stats: RingStats
    backward_timeout: float  # seconds the backward's handshake waits for the other ranks


def pair_step(backend: str, mask: Optional[Mask], space: MaskSpace, scale: float, q_run: Piece,
              kv_run: Piece, fused: bool = False, block_q: Optional[int] = None,
              block_k: Optional[int] = None, scoring: Scoring = NO_SCORING,
              ) -> tuple[Union[_TiledStep, _TritonStep], int]:
    """The computation of queries ``q_run`` against keys ``kv_run`` under ``mask`` (and the
    modifiers of ``scoring``) over the global ``space`` on ``backend`` (``"tiled"`` or
    ``"triton"``), and the tiles it computes (0: the mask empties the pair). ``fused``,
    ``block_q``, ``block_k``: the tiled engine's."""
    moved = kv_run.global_start - q_run.global_start  # local k − q plus this is the global one
    if backend == "triton":
        local_mask, local_space = window(mask, space, q_run.global_start, q_run.count,
                                         kv_run.global_start, kv_run.count)
        plan = launch.build_plan(local_mask, local_space, scale)
        step = _TritonStep(plan, scoring.cap, scoring.shift - moved, space.q_len - 1 + moved)
        return step, plan.rows.visited()
    plan = make_plan(mask, space, batch=space.batch, heads=space.heads,
                     q_offset=q_run.global_start, q_count=q_run.count,
                     kv_offset=kv_run.global_start, kv_count=kv_run.count,
                     block_q=block_q, block_k=block_k or BLOCK_K,
                     fused=fused and scoring.modifiers is None)
    problem = Problem(mask, scale, space, q_run.global_start, kv_run.global_start, plan,
                      modifiers=scoring.modifiers)
    return _TiledStep(problem), plan.tiles_computed()


def _plan_steps(mask: Optional[Mask], space: MaskSpace, scale: float, local_q: int, local_kv: int,
                comm: RingComm, layout: Layout, backend: str, fused: bool, block_q: Optional[int],
                block_k: Optional[int], stats: RingStats, scoring: Scoring) -> list[list[_Pair]]:
    """Every step's non-empty pairs (from the mask's block map at global positions)."""
    rank, world = comm.rank, comm.world_size
    q_runs = pieces(local_q, rank, world, layout)
    steps = []
    for step in range(world):
        kv_runs = pieces(local_kv, (rank - step) % world, world, layout)
        pairs, tiles = [], 0
        for q_run in q_runs:
            for kv_run in kv_runs:
                step, count = pair_step(backend, mask, space, scale, q_run, kv_run, fused, block_q,
                                        block_k, scoring)
                if count == 0:
                    stats.pairs_skipped += 1
                    continue
                tiles += count
                pairs.append(_Pair(q_run, kv_run, step))
        stats.tiles_per_step.append(tiles)
        stats.pairs_computed += len(pairs)
        steps.append(pairs)
    stats.forward_tiles = sum(stats.tiles_per_step)
    return steps


# ---- forward and backward ---------------------------------------------------------------------

def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, params: tuple,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, Tq/P, Dk]``, ``k [B, Hkv, Tk/P, Dk]``, ``v [B, Hkv, Tk/P, Dv]`` (this rank's
    shards) → ``out [B, Hq, Tq/P, Dv]`` (q's dtype) and ``lse [B, Hq, Tq/P]`` (fp32/fp64) over
    the whole key sequence."""
    batch, heads_q, tq, _ = q.shape
    acc = accum_dtype(q.dtype)
    out = torch.zeros(batch, heads_q, tq, v.shape[-1], dtype=acc, device=q.device)  # [B, Hq, Tq/P, Dv]
    lse = torch.full((batch, heads_q, tq), float("-inf"), dtype=acc, device=q.device)  # [B, Hq, Tq/P]
    current, spare = [k, v], None  # the K/V shard being computed; a free receive buffer
    for step, pairs in enumerate(ring.steps):
        transfer = None
        if step + 1 < len(ring.steps):  # the next shard travels while this one is computed
            transfer = ring.comm.exchange(current, spare, tag=KV_TAG)
        keys, values = current
        for pair in pairs:
            rows = pair.q.rows
            part_out, part_lse = pair.step.forward(q[:, :, rows], keys[:, :, pair.kv.rows],
                                                   values[:, :, pair.kv.rows], params)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     part_out, part_lse)
        if transfer is not None:
            received = transfer.wait()
            spare = current if step > 0 else None  # the caller's own k/v are never written
            current = received
    return out.to(q.dtype), lse


def _ring_backward(q, k, v, out, lse, grad_out, grad_lse, ring: _Ring, params: tuple,
                   dparams: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this rank's shards. ``out``/``lse`` are the final forward results of this
    rank's queries, ``grad_out [B, Hq, Tq/P, Dv]``, ``grad_lse [B, Hq, Tq/P]`` or ``None``;
    the modifiers' ``params`` get this rank's queries' share of their gradients added into
    ``dparams`` (fp32 accumulators, ``None`` where unwanted).

    K/V go around the ring as in the forward pass; with them travel the dK/dV sums of their
    owner (fp32, fp64 for fp64), to which each rank adds its queries' contribution. After P
    steps plus one last hop every sum is back home, complete."""
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [B, Hq, Tq/P, Dk]
    current, spare = [k, v], None
    grads_sent, grads_free, grads_transfer = None, None, None
    for step, pairs in enumerate(ring.steps):
        transfer = None
        if step + 1 < len(ring.steps):
            transfer = ring.comm.exchange(current, spare, tag=KV_TAG)
        keys, values = current
        contributions = []
        for pair in pairs:
            rows, kv_rows = pair.q.rows, pair.kv.rows
            dq_part, dk_part, dv_part = pair.step.backward(
                q[:, :, rows], keys[:, :, kv_rows], values[:, :, kv_rows], out[:, :, rows],
                lse[:, :, rows], grad_out[:, :, rows],
                None if grad_lse is None else grad_lse[:, :, rows], params, dparams)
            dq[:, :, rows] += dq_part
            contributions.append((kv_rows, dk_part, dv_part))
        if grads_transfer is None:  # step 0: this rank starts the sums of its own K/V
            grads = [torch.zeros(k.shape, dtype=acc, device=k.device),  # [B, Hkv, Tk/P, Dk]
                     torch.zeros(v.shape, dtype=acc, device=v.device)]  # [B, Hkv, Tk/P, Dv]
        else:  # the sums for the K/V now held, from the ranks before this one
            grads = grads_transfer.wait()
            grads_free = grads_sent  # that exchange's send has completed too
        for kv_rows, dk_part, dv_part in contributions:
            grads[0][:, :, kv_rows] += dk_part
            grads[1][:, :, kv_rows] += dv_part
        grads_transfer = ring.comm.exchange(grads, grads_free, tag=GRAD_TAG)
        grads_sent, grads_free = grads, None
        if transfer is not None:
            received = transfer.wait()
            spare = current if step > 0 else None
            current = received
    dk, dv = grads_transfer.wait()  # the last hop brings this rank its own sums
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the modifiers' ``params`` (:class:`Scoring`; each rank
    gets its own queries' share of their gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, *params):
        ctx.set_materialize_grads(False)  # an unused lse gives grad_lse None, not zeros
        k, v = k.contiguous(), v.contiguous()  # they are sent as they are
        sent = ring.comm.bytes_sent
        out, lse = _ring_forward(q, k, v, ring, params)
        ring.stats.bytes_sent += ring.comm.bytes_sent - sent
        ctx.save_for_backward(q, k, v, out, lse, *params)
        ctx.ring = ring
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled() or batched_gradient(grad_out, grad_lse):
            # every rank runs the same backward, so every rank raises (no rank left waiting)
            raise RuntimeError("ring_attention has no double backward (create_graph=True) and "
                               "no batched backward (is_grads_batched=True, jacobian with "
                               "vectorize=True): differentiate it once, without vmap")
        q, k, v, out, lse, *params = ctx.saved_tensors
        ring = ctx.ring
        _check_everyone_backpropagates(ring, q.device)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dparams = [torch.zeros(p.shape, dtype=accum_dtype(p.dtype), device=p.device) if want
                   else None for p, want in zip(params, ctx.needs_input_grad[4:])]
        sent = ring.comm.bytes_sent
        dq, dk, dv = _ring_backward(q, k, v, out, lse, grad_out, grad_lse, ring, tuple(params),
                                    dparams)
        ring.stats.bytes_sent += ring.comm.bytes_sent - sent
        ring.stats.backward_tiles = ring.stats.forward_tiles
        return (dq, dk, dv, None, *(None if d is None else d.to(p.dtype)
                                    for d, p in zip(dparams, params)))


def _check_everyone_backpropagates(ring: _Ring, device: torch.device) -> None:
    """The backward's first communication: a token from every rank, waited for at most
    ``ring.backward_timeout`` seconds. A rank whose token does not come skipped the backward (its
    loss did not use this output, or it never called ``.backward()``); without this check the
    ring below would wait for it until the process group's timeout."""
    absent, error = ring.comm.handshake(ring.backward_timeout, tag=HANDSHAKE_TAG, device=device)
    if absent:
        raise RuntimeError(
            f"ring_attention: {ranks_text(absent)} did not run the backward of ring_attention within "
            f"backward_timeout={ring.backward_timeout:g} s (seen on rank {ring.comm.rank}); every "
            f"rank must backpropagate through its output, e.g. each rank calls loss.backward() on "
            f"a loss that uses its out (add 0 * out.sum() on a rank whose share of the loss is "
            f"zero). The process group cannot be used after this error. Transport error: {error}")


# ---- validation (every rank agrees, or every rank raises) -------------------------------------

def _whole(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """A stand-in for the whole sequence of ``t`` (``[..., T/P, D]`` → ``[..., T, D]``) that holds
    one row: ``D`` zeros, expanded (unit stride along D, so that validation keeps it a view
    instead of copying it whole). Only its shape, dtype and device are looked at."""
    shape = (*t.shape[:-2], t.shape[-2] * world_size, t.shape[-1])
    return torch.zeros(t.shape[-1], dtype=t.dtype, device=t.device).expand(shape)


def whole_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: Optional[float],
                 world_size: int) -> Inputs:
    """The validated inputs of the WHOLE sequence that ``world_size`` local shards ``q [B, H,
    T/P, Dk]``, ``k``, ``v`` make up, with ``mask`` at global positions (stand-ins: no data is
    gathered); a ``ValueError`` naming the whole length when the mask does not fit it. Ring,
    Ulysses and the hybrid check their masks with it."""
    try:
        return validate(*(_whole(t, world_size) for t in (q, k, v)), mask, scale=scale)
    except ValueError as error:
        raise ValueError(f"mask at global positions (the whole sequence is P={world_size} × the "
                         f"local shard: q {tuple(q.shape)} → [B, H, {q.shape[2] * world_size}, "
                         f"Dk]): {error}") from None


_AGREEMENT = {
    "shapes": "every rank passes shards of one shape: the whole sequence cut into equal parts "
              "along dim -2 (see shard())",
    "dtype": "cast q, k and v to one dtype on every rank",
    "layout": "pass the same layout= on every rank",
    "scale": "pass the same scale= on every rank",
    "mask": "every rank passes the mask of the whole sequence with the same contents (the same "
            "document ids, lengths, dense/bias values), built from data every rank shares",
    "grad mode": "call ring_attention with grad enabled on every rank or on none (torch.no_grad()"
                 " / inference_mode alike everywhere)",
    "requires_grad": "q, k, v (and any bias of the mask) must require grad alike on every "
                     "rank: the backward is a ring that every rank runs together",
}
"""The signature entries every rank must agree on, each with the way to make ranks agree."""


def _signature(q, k, v, mask, layout, scale) -> dict[str, str]:
    """What every rank must agree on (the keys of :data:`_AGREEMENT`), as strings; never raises,
    since a rank that raised here would leave the others waiting in the exchange. The mask is
    compared by :func:`attnkit.masks.digest` (kind, parameters and tensor values) of
    ``as_mask(mask)``, so tensors passed as ``mask=`` are compared as the mask they become."""
    def shape(t):
        return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__

    mask_text, grads = mask_agreement(q, k, v, mask)
    return {"shapes": f"q {shape(q)}, k {shape(k)}, v {shape(v)}",
            "dtype": str(getattr(q, "dtype", None)), "layout": repr(layout), "scale": repr(scale),
            "mask": mask_text, "grad mode": "enabled" if torch.is_grad_enabled() else "disabled",
            "requires_grad": grads}


def mask_agreement(q, k, v, mask) -> tuple[str, str]:
    """``(mask, requires_grad)`` texts every rank must agree on: the mask as
    :func:`attnkit.masks.digest` (kind, parameters and tensor values) of ``as_mask(mask)``
    with its ``repr``, and the ``requires_grad`` of q, k, v and of the mask's tensors (biases,
    ALiBi slopes, relative-bias tables, sink logits: a rank whose tensor requires grad runs a
    backward the others would not join). Never raises."""
    try:
        fitted = as_mask(mask)
        mask_text = "None" if fitted is None else f"{fitted!r} (content digest {digest(fitted)})"
        mask_grads = ([t.requires_grad for t in mask_tensors(fitted) or ()
                       if t.is_floating_point()] if fitted is not None else [])
    except (TypeError, ValueError):  # reported by validation on this rank
        mask_text, mask_grads = f"invalid {type(mask).__name__}", []
    grads = ", ".join(f"{name} {getattr(t, 'requires_grad', None)}"
                      for name, t in (("q", q), ("k", k), ("v", v)))
    if mask_grads:
        grads += f", mask tensors {mask_grads}"
    return mask_text, grads


def _step_backend(backend: str, local: Inputs) -> str:
    """``"tiled"`` or ``"triton"``: what runs the steps of ``backend`` (:data:`BACKENDS`) on
    these local inputs; a ``ValueError`` when ``"triton"`` cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    if backend == "tiled":
        return "tiled"
    reasons = TritonBackend().not_supported_reasons(local)
    if backend == "triton" and reasons:
        raise ValueError("backend='triton' cannot run these shards:\n  " + "\n  ".join(reasons)
                         + "\nuse backend='tiled' (or 'auto')")
    return "triton" if not reasons and (backend == "triton" or local.q.device.type == "cuda") else "tiled"


def _validate(q, k, v, mask, scale, layout, return_lse, backward_timeout, backend,
              comm: RingComm) -> tuple[Inputs, Optional[Mask], MaskSpace, str, Inputs]:
    """Check this rank's shards, then that all ranks agree; raise the same error on every rank.

    Returns the local :class:`Inputs` (``[B, H, T/P, D]`` views), the mask fitted to the whole
    sequence, the global :class:`MaskSpace`, the steps' backend (``"tiled"``/``"triton"``) and
    the whole sequence's :class:`Inputs` (stand-in tensors; its modifiers).
    """
    failure, result = None, None
    try:
        _check_layout(layout)
        if (isinstance(backward_timeout, bool) or not isinstance(backward_timeout, (int, float))
                or not (math.isfinite(backward_timeout) and backward_timeout > 0)):
            raise ValueError(f"backward_timeout={backward_timeout!r}: use a finite positive number "
                             f"of seconds (or None for BACKWARD_TIMEOUT = {BACKWARD_TIMEOUT:g})")
        local = validate(q, k, v, None, scale=scale, need_lse=return_lse)
        if isinstance(layout, BalancedLayout):
            world = comm.world_size
            if local.q.shape[2] != local.k.shape[2]:
                raise ValueError(f"a BalancedLayout cuts queries and keys the same way: the local "
                                 f"q length {local.q.shape[2]} and k length {local.k.shape[2]} "
                                 f"must be equal (use layout='contiguous' or 'zigzag' for "
                                 f"cross-attention lengths)")
            _check_balanced(layout, world, local.q.shape[2] * world,
                            f"this call (q {tuple(q.shape)} per rank on {world} ranks)")
        if layout == "zigzag" and (local.q.shape[2] % 2 or local.k.shape[2] % 2):
            raise ValueError(
                f"layout='zigzag' cuts the sequence into 2P = {2 * comm.world_size} chunks and each "
                f"rank holds two of them, so the local length must be even; got q length "
                f"{local.q.shape[2]}, k length {local.k.shape[2]}: pad the global sequence to a "
                f"multiple of {2 * comm.world_size}")
        whole = whole_inputs(q, k, v, mask, scale, comm.world_size)
        if whole.bias_grad:
            raise ValueError("ring_attention takes a bias as a constant and gives it no gradient; "
                             "detach it (bias.detach()) or use attention() on one device, whose "
                             "tiled and reference backends give dBias")
        if whole.modifiers is not None and whole.modifiers.functions:
            raise ValueError("ring_attention runs softcap, alibi, relative_bias and sinks, not "
                             "score_function: use attention() on one device, or leave it out "
                             "of the mask")
        step_backend = _step_backend(backend, local)
        if step_backend == "triton" and whole.modifiers is not None and len(whole.modifiers.alibi) > 1:
            raise ValueError("ring_attention on triton steps takes one alibi modifier: sum the "
                             "slopes into one")
        result = (local, whole.mask, whole.space, step_backend, whole)
    except (TypeError, ValueError) as error:
        failure = (type(error).__name__, str(error))
    everyone = comm.all_gather_object((failure, _signature(q, k, v, mask, layout, scale)))
    failed = [(rank, f) for rank, (f, _) in enumerate(everyone) if f is not None]
    if failed:
        first_rank, (kind, message) = failed[0]
        error_type = TypeError if kind == "TypeError" else ValueError
        raise error_type(f"ring_attention: invalid input on rank(s) "
                         f"{[rank for rank, _ in failed]} (rank {first_rank}): {message}")
    disagreement = disagreement_text("ring_attention", [signature for _, signature in everyone],
                                     _AGREEMENT)
    if disagreement:
        raise ValueError(disagreement)
    return result


def _scoring(whole: Inputs, step_backend: str) -> Scoring:
    """The :class:`Scoring` of a call whose whole-sequence inputs are ``whole``."""
    modifiers = whole.modifiers
    if modifiers is None or not modifiers.changes_scores:
        return NO_SCORING
    if step_backend == "triton":
        found = score_mods(whole)
        return Scoring((found.get("slopes"), found.get("diag")), cap=found.get("cap"),
                       shift=found.get("shift", 0))
    sink = [] if modifiers.sinks is None else [modifiers.sinks.logits]
    tensors = tuple(t for t in modifiers.tensors if not any(t is s for s in sink))
    own = dataclasses.replace(modifiers, sinks=None, tensors=tensors)
    return Scoring(tensors, modifiers=own)


# ---- the public function ----------------------------------------------------------------------

@overload
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: Union[Mask, torch.Tensor, None] = None, *, scale: Optional[float] = None,
                   group: Optional[dist.ProcessGroup] = None, layout: Layout = "contiguous",
                   return_lse: Literal[False] = False, block_q: Optional[int] = None,
                   block_k: Optional[int] = None, stats: Optional[RingStats] = None,
                   backward_timeout: Optional[float] = None, backend: str = "auto",
                   ) -> torch.Tensor: ...


@overload
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: Union[Mask, torch.Tensor, None] = None, *, scale: Optional[float] = None,
                   group: Optional[dist.ProcessGroup] = None, layout: Layout = "contiguous",
                   return_lse: Literal[True], block_q: Optional[int] = None,
                   block_k: Optional[int] = None, stats: Optional[RingStats] = None,
                   backward_timeout: Optional[float] = None, backend: str = "auto",
                   ) -> AttentionResult: ...


@overload
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: Union[Mask, torch.Tensor, None] = None, *, scale: Optional[float] = None,
                   group: Optional[dist.ProcessGroup] = None, layout: Layout = "contiguous",
                   return_lse: bool = False, block_q: Optional[int] = None,
                   block_k: Optional[int] = None, stats: Optional[RingStats] = None,
                   backward_timeout: Optional[float] = None, backend: str = "auto",
                   ) -> Union[torch.Tensor, AttentionResult]: ...


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: Union[Mask, torch.Tensor, None] = None, *, scale: Optional[float] = None,
                   group: Optional[dist.ProcessGroup] = None, layout: Layout = "contiguous",
                   return_lse: bool = False, block_q: Optional[int] = None,
                   block_k: Optional[int] = None, stats: Optional[RingStats] = None,
                   backward_timeout: Optional[float] = None, backend: str = "auto",
                   ) -> Union[torch.Tensor, AttentionResult]:
    """Exact attention over a sequence sharded across the ranks of ``group``; call on every rank.

    Each rank passes its shard along dim -2: ``q [..., Hq, Tq/P, Dk]``, ``k [..., Hkv, Tk/P, Dk]``,
    ``v [..., Hkv, Tk/P, Dv]`` (also ``[T/P, D]`` and ``[B, T/P, D]``), cut as :func:`shard` cuts
    with the same ``layout``. Returns this rank's ``out [..., Hq, Tq/P, Dv]``, or an
    :class:`~attnkit.AttentionResult` ``(out, lse [..., Hq, Tq/P], None)`` with ``return_lse``:
    the rows of what ``attention(q_whole, k_whole, v_whole, mask)`` returns for this shard.

    Args:
        mask: the mask of the WHOLE sequence, as given to ``attention`` (causal in both
            alignments, documents, padding, sliding window, dense/bias tensors of the global
            size, and their combinations; and the score modifiers ``softcap``, ``alibi``,
            ``relative_bias`` and ``sinks``, at global positions); every rank passes the same
            one. A modifier's tensors get each rank's queries' share of their gradient (sum
            it over the group, as for any replicated parameter).
        group: the process group (default: the world); its timeout bounds every wait.
        layout: ``"contiguous"``, ``"zigzag"`` (balanced causal work; the local length must
            be even) or a :class:`~attnkit.distributed.balance.BalancedLayout` from
            ``plan_balance(mask, T, P)`` (balanced work for any mask; self-attention lengths,
            planned for this T and P; the same one on every rank).
        block_q, block_k: tile sizes of the tiled engine (default: its own choice).
        backend: what computes each step (:data:`BACKENDS`): ``"triton"`` (fused kernels; CPU
            tensors through the Triton interpreter), ``"tiled"``, or ``"auto"``: triton for
            CUDA tensors it supports (float32/float16/bfloat16, head dims ≤ 256), else tiled.
        stats: a :class:`RingStats` to fill with this rank's computed tiles and traffic.
        backward_timeout: seconds the backward waits for every other rank to reach it (default
            ``None``: :data:`BACKWARD_TIMEOUT`, read at each call).

    Differentiable: the backward pass is a ring too, so every rank must run it (e.g. each
    backpropagates its share of the loss). It starts with a handshake among all ranks: ranks
    that have not reached it within ``backward_timeout`` are named in a ``RuntimeError`` on the
    others, and the process group is unusable afterwards. Shapes, dtypes, layout, scale, the
    mask's contents, grad mode and ``requires_grad`` are checked on every rank and compared
    across ranks: any problem raises the same error on every rank, before any transfer.
    """
    comm = RingComm(group)
    if backward_timeout is None:
        backward_timeout = BACKWARD_TIMEOUT
    local, fitted, space, step_backend, whole = _validate(q, k, v, mask, scale, layout, return_lse,
                                                          backward_timeout, backend, comm)
    scoring = _scoring(whole, step_backend)
    stats = stats if stats is not None else RingStats()
    stats.rank, stats.world_size = comm.rank, comm.world_size
    stats.layout = "balanced" if isinstance(layout, BalancedLayout) else layout
    stats.tiles_per_step, stats.pairs_computed, stats.pairs_skipped = [], 0, 0
    stats.backward_tiles, stats.bytes_sent = 0, 0
    steps = _plan_steps(fitted, space, local.scale, local.q.shape[2], local.k.shape[2], comm,
                        layout, step_backend, uses_fused_kernel(local.q, local.v, 0.0), block_q,
                        block_k, stats, scoring)
    out, lse = _RingAttention.apply(local.q, local.k, local.v,
                                    _Ring(comm, steps, stats, float(backward_timeout)),
                                    *scoring.params)
    sinks = None if whole.modifiers is None else whole.modifiers.sinks
    if sinks is not None:  # in every row's denominator: joined to the finished rows
        out, lse, _ = sinks.join(out, lse)
    out = restore(out, local)
    if not return_lse:
        return out
    return AttentionResult(out, restore(lse, local), None)
