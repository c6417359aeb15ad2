"""Hybrid sequence parallelism: Ulysses inside a group of ranks, ring attention across groups.

The P = R·U ranks form a 2-D mesh of shape ``(R, U)`` (a ``DeviceMesh`` from
``init_device_mesh(device, (R, U))``, or a pair of process groups ``(ring_group,
ulysses_group)``). Rank ``(r, u)`` (ring rank r, Ulysses rank u; mesh position ``r·U + u``)
holds the u-th of U contiguous parts of the ring shard r of the sequence
(:func:`hybrid_shard`); with ``ring_layout="contiguous"`` that is shard ``r·U + u`` of P
contiguous shards, positions ``[(r·U + u)·T/P, (r·U + u + 1)·T/P)``.

One call:

1. inside each Ulysses group (the U ranks sharing r), an all-to-all turns the U sequence
   shards into head shards of the group's chunk: rank (r, u) gets query heads ``[u·H/U,
   (u+1)·H/U)`` over the ``T/R`` positions of ring shard r (and the K/V heads they read, as
   :func:`~attnkit.distributed.ulysses.kv_head_index` picks them for U ranks);
2. ring attention (:func:`~attnkit.distributed.ring.ring_attention`) runs across each ring
   group (the R ranks sharing u) on those chunks, with the whole-sequence mask narrowed to the
   rank's heads (:func:`~attnkit.distributed.ulysses.heads_of`);
3. the reverse all-to-all returns the output (and the LSE) to sequence shards.

The backward runs the same three stages in reverse order. ``R = 1`` is Ulysses over U ranks,
``U = 1`` ring attention over R ranks.

Communication per rank per call (:func:`hybrid_bytes`): the Ulysses all-to-alls of
:func:`~attnkit.distributed.ulysses.ulysses_bytes` for U ranks, plus the ring's transfers of
chunks of ``T/R`` positions of the rank's K/V heads: ``R − 1`` K/V sends forward, ``R − 1``
K/V sends and ``R`` dK/dV sends (fp32, fp64 for fp64 inputs) backward.

Tested with multi-process gloo on CPU; written for NCCL on GPUs as well, not tested there.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..call import AttentionResult
from ..inputs import validate
from ..masks import Mask
from .balance import BalancedLayout
from .comm import disagreement_text
from .ring import (BACKENDS, Layout, RingStats, _check_balanced, _check_layout, ring_attention,
                   shard, unshard, whole_inputs)
from .ulysses import (_mask_for_heads, _q_head_index, _signature, _ToHeads, _ToSequence,
                      backward_timeout_of, check_shards, kv_head_index, ulysses_bytes)

__all__ = ["hybrid_attention", "hybrid_bytes", "hybrid_shard", "hybrid_unshard"]

MeshLike = Union[DeviceMesh, Sequence[dist.ProcessGroup]]
"""A 2-D ``DeviceMesh`` of shape ``(R, U)`` or a pair ``(ring_group, ulysses_group)``."""

_AGREEMENT = {
    "shapes": "every rank passes shards of one shape: the whole sequence cut as hybrid_shard "
              "cuts it, into P = R·U equal parts along dim -2",
    "dtype": "cast q, k and v to one dtype on every rank",
    "options": "pass the same scale=, return_lse=, backend= and ring_layout= on every rank",
    "mask": "every rank passes the mask of the whole sequence with the same contents",
    "grad": "call with grad enabled on every rank or on none, and with q, k, v requiring grad "
            "alike on every rank: the backward runs transfers that every rank joins",
}
"""What every rank must agree on, each with the way to make ranks agree."""


# ---- the mesh ---------------------------------------------------------------------------------

def _mesh_groups(mesh: MeshLike) -> tuple:
    """``(ring_group, ulysses_group, r, u, R, U)`` of this rank in ``mesh``; raises
    ``TypeError``/``ValueError`` for anything but a 2-D mesh holding this rank."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 2:
            raise ValueError(
                f"hybrid_attention takes a 2-D mesh of shape (R, U) (ring size, Ulysses size); "
                f"got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Build one with "
                f"init_device_mesh(device, (R, U)), e.g. (1, P) for Ulysses only or (P, 1) "
                f"for ring only")
        if mesh.get_coordinate() is None:
            raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh {mesh!r}: call "
                             f"hybrid_attention only on the mesh's ranks")
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    elif (isinstance(mesh, (tuple, list)) and len(mesh) == 2
          and all(isinstance(g, dist.ProcessGroup) for g in mesh)):
        ring_group, ulysses_group = mesh
    else:
        raise TypeError(
            f"mesh must be a 2-D torch.distributed.device_mesh.DeviceMesh of shape (R, U) or a "
            f"pair (ring_group, ulysses_group) of process groups; got {type(mesh).__name__}. "
            f"Build one with init_device_mesh(device, (R, U))")
    r, u = dist.get_rank(ring_group), dist.get_rank(ulysses_group)
    if r < 0 or u < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in both groups of the mesh "
                         f"(ring rank {r}, Ulysses rank {u}): call hybrid_attention only on "
                         f"ranks of both groups")
    return (ring_group, ulysses_group, r, u, dist.get_world_size(ring_group),
            dist.get_world_size(ulysses_group))


def _check_mesh_shape(shape: Sequence[int], what: str) -> tuple[int, int]:
    """``(R, U)`` from ``shape``; a ``ValueError`` unless it is two positive ints."""
    if (len(shape) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                               for s in shape)):
        raise ValueError(f"{what}: mesh_shape={tuple(shape)!r} must be (R, U), two positive "
                         f"ints: ring size and Ulysses size")
    return int(shape[0]), int(shape[1])


# ---- the layout of the sequence ---------------------------------------------------------------

def hybrid_shard(x: torch.Tensor, coordinate: Sequence[int], mesh_shape: Sequence[int],
                 ring_layout: Layout = "contiguous", dim: int = -2) -> torch.Tensor:
    """Rank ``coordinate = (r, u)``'s shard of ``x`` along ``dim`` for a mesh of shape
    ``mesh_shape = (R, U)``: ``x [..., T, D]`` → ``[..., T/(R·U), D]``.

    The u-th of U contiguous parts of ``shard(x, r, R, ring_layout)`` (the ring shard of
    Ulysses group r). With ``ring_layout="contiguous"`` this is ``shard(x, r·U + u, R·U)``;
    with ``"zigzag"`` the group's chunks ``r`` and ``2R−1−r`` of 2R are cut into U parts.
    :func:`hybrid_unshard` is its inverse.
    """
    ring_size, ulysses_size = _check_mesh_shape(mesh_shape, "hybrid_shard")
    if len(coordinate) != 2:
        raise ValueError(f"hybrid_shard: coordinate={tuple(coordinate)!r} must be (r, u)")
    r, u = coordinate
    return shard(shard(x, r, ring_size, ring_layout, dim), u, ulysses_size, "contiguous", dim)


def hybrid_unshard(shards: Sequence[torch.Tensor], mesh_shape: Sequence[int],
                   ring_layout: Layout = "contiguous", dim: int = -2) -> torch.Tensor:
    """The whole tensor from every rank's shard: the inverse of :func:`hybrid_shard`.

    ``shards``: P = R·U tensors ``[..., T/P, D]`` in mesh order (rank (r, u) at index
    ``r·U + u``, the order of ``init_device_mesh``'s ranks) → ``[..., T, D]``.
    """
    ring_size, ulysses_size = _check_mesh_shape(mesh_shape, "hybrid_unshard")
    shards = list(shards)
    if len(shards) != ring_size * ulysses_size:
        raise ValueError(f"hybrid_unshard: got {len(shards)} shards for a mesh of shape "
                         f"({ring_size}, {ulysses_size}); pass R·U = "
                         f"{ring_size * ulysses_size}, in mesh order")
    chunks = [unshard(shards[r * ulysses_size:(r + 1) * ulysses_size], "contiguous", dim)
              for r in range(ring_size)]
    return unshard(chunks, ring_layout, dim)


# ---- validation (every rank agrees, or every rank raises) -------------------------------------

def _check_local(q, k, v, mask, scale, return_lse, backend, ring_layout, u: int, ring_size: int,
                 ulysses_size: int):
    """This rank's checks; returns the whole-sequence mask restricted to this rank's query heads
    after the all-to-all. Raises ``TypeError``/``ValueError`` naming the shapes and the fix."""
    check_shards(q, k, v, "hybrid_attention")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS} (what computes each ring "
                         f"step)")
    _check_layout(ring_layout)
    validate(q, k, v, None, scale=scale, need_lse=return_lse)  # the attention() checks
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % ulysses_size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"hybrid_attention gives each rank of a Ulysses group H/U query heads, so the number "
            f"of query heads H must be a multiple of the mesh's Ulysses size U (its dim 1); got "
            f"H={heads}, mesh shape ({ring_size}, {ulysses_size}), q {tuple(q.shape)}. Use a "
            f"mesh (R, U) with U one of {divisors}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k {tuple(k.shape)} has Hkv={kv_heads} heads and q {tuple(q.shape)} has "
                         f"H={heads}: the number of query heads must be a multiple of the "
                         f"key/value heads (GQA)")
    chunk_q, chunk_k = q.shape[2] * ulysses_size, k.shape[2] * ulysses_size
    if ring_layout == "zigzag" and (chunk_q % 2 or chunk_k % 2):
        raise ValueError(
            f"ring_layout='zigzag' cuts the sequence into 2R = {2 * ring_size} chunks, so a "
            f"Ulysses group's chunk (U × the local length: q {chunk_q}, k {chunk_k}) must be "
            f"even: pad the sequence to a multiple of {2 * ring_size * ulysses_size}")
    if isinstance(ring_layout, BalancedLayout):
        if chunk_q != chunk_k:
            raise ValueError(f"a BalancedLayout cuts queries and keys the same way: the local q "
                             f"length {q.shape[2]} and k length {k.shape[2]} must be equal")
        _check_balanced(ring_layout, ring_size, chunk_q * ring_size,
                        f"this call (q {tuple(q.shape)} per rank, mesh ({ring_size}, "
                        f"{ulysses_size}))")
    whole = whole_inputs(q, k, v, mask, scale, ring_size * ulysses_size)
    if whole.bias_grad:
        raise ValueError("hybrid_attention takes a bias as a constant (its ring steps give it no "
                         "gradient); detach it (bias.detach()) or call attnkit.attention on one "
                         "device")
    count = heads // ulysses_size
    return _mask_for_heads(whole.mask, whole.modifiers, u * count, count, heads,
                           caller="hybrid_attention")


def _gather(obj, group, size: int) -> list:
    """Every rank's ``obj`` in ``group`` (``size`` ranks), in group-rank order."""
    if size == 1:
        return [obj]
    gathered: list = [None] * size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _validate(q, k, v, mask, scale, return_lse, backend, ring_layout, groups):
    """Check this rank's input, then that all P ranks agree; raise the same error on every rank
    before any transfer of q, k, v. Returns this rank's mask.

    Two gathers reach all P ranks: inside the Ulysses group, then across the ring group (each
    rank passing on its group's entries), so every rank sees the entry of every mesh position.
    """
    ring_group, ulysses_group, r, u, ring_size, ulysses_size = groups
    failure, local_mask = None, None
    try:
        local_mask = _check_local(q, k, v, mask, scale, return_lse, backend, ring_layout, u,
                                  ring_size, ulysses_size)
    except (TypeError, ValueError) as error:
        failure = (type(error).__name__, str(error))
    signature = _signature(q, k, v, mask, scale, return_lse, backend,
                           {"ring_layout": ring_layout})
    row = _gather(((r, u), failure, signature), ulysses_group, ulysses_size)
    rows = _gather(((r, u), row), ring_group, ring_size)
    table = [entry for _, group_row in rows for entry in group_row]  # mesh order r·U + u
    grid = [(i, j) for i in range(ring_size) for j in range(ulysses_size)]
    if ([coordinate for coordinate, _ in rows] != [(i, u) for i in range(ring_size)]
            or [coordinate for coordinate, _, _ in table] != grid):
        raise ValueError(
            f"hybrid_attention: the ring group and the Ulysses group do not form an (R, U) = "
            f"({ring_size}, {ulysses_size}) grid (seen on ring rank {r}, Ulysses rank {u}): the "
            f"ring group must hold the ranks of one Ulysses rank across all groups, in ring "
            f"order. Use init_device_mesh(device, (R, U))")
    failed = [(position, f) for position, (_, f, _) in enumerate(table) if f is not None]
    if failed:
        position, (kind, message) = failed[0]
        error_type = TypeError if kind == "TypeError" else ValueError
        raise error_type(f"hybrid_attention: invalid input at mesh position(s) r·U + u = "
                         f"{[p for p, _ in failed]} (position {position}): {message}")
    disagreement = disagreement_text("hybrid_attention (ranks numbered r·U + u)",
                                     [s for _, _, s in table], _AGREEMENT)
    if disagreement:
        raise ValueError(disagreement)
    return local_mask


# ---- the public functions ---------------------------------------------------------------------

@overload
def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Union[Mask, torch.Tensor, None] = None, *,
                     mesh: MeshLike, scale: Optional[float] = None,
                     return_lse: Literal[False] = False,
                     backend: str = "auto", ring_layout: Layout = "contiguous",
                     stats: Optional[RingStats] = None, backward_timeout: Optional[float] = None,
                     ) -> torch.Tensor: ...


@overload
def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Union[Mask, torch.Tensor, None] = None, *,
                     mesh: MeshLike, scale: Optional[float] = None, return_lse: Literal[True],
                     backend: str = "auto", ring_layout: Layout = "contiguous",
                     stats: Optional[RingStats] = None, backward_timeout: Optional[float] = None,
                     ) -> AttentionResult: ...


@overload
def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Union[Mask, torch.Tensor, None] = None, *,
                     mesh: MeshLike, scale: Optional[float] = None, return_lse: bool = False,
                     backend: str = "auto", ring_layout: Layout = "contiguous",
                     stats: Optional[RingStats] = None, backward_timeout: Optional[float] = None,
                     ) -> Union[torch.Tensor, AttentionResult]: ...


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Union[Mask, torch.Tensor, None] = None, *,
                     mesh: MeshLike, scale: Optional[float] = None, return_lse: bool = False,
                     backend: str = "auto", ring_layout: Layout = "contiguous",
                     stats: Optional[RingStats] = None, backward_timeout: Optional[float] = None,
                     ) -> Union[torch.Tensor, AttentionResult]:
    """Exact attention over a sequence sharded across a 2-D mesh ``(R, U)``: Ulysses'
    all-to-all inside each group of U ranks, ring attention across the R groups; call on every
    rank of the mesh.

    Rank ``(r, u)`` passes its shard as :func:`hybrid_shard` cuts it (``ring_layout=
    "contiguous"``: shard ``r·U + u`` of P = R·U contiguous shards): ``q [B, H, Tq/P, Dk]``,
    ``k [B, Hkv, Tk/P, Dk]``, ``v [B, Hkv, Tk/P, Dv]``. Returns its ``out [B, H, Tq/P, Dv]``,
    or with ``return_lse`` an :class:`~attnkit.AttentionResult` ``(out, lse [B, H, Tq/P],
    None)``: the rows of ``attention(q_whole, k_whole, v_whole, mask)`` at its positions.

    Args:
        mesh: a 2-D ``DeviceMesh`` of shape ``(R, U)`` (dim 0: ring, dim 1: Ulysses), e.g.
            ``init_device_mesh("cuda", (R, U))``, or a pair ``(ring_group, ulysses_group)``
            whose ranks form that grid (checked). Rank ``(r, u)`` is this rank's rank in
            each group, ``(dist.get_rank(ring_group), dist.get_rank(ulysses_group))`` (a
            mesh's ``get_group(0)``/``get_group(1)`` ranks): cut the shards by those, as
            ``SequenceParallel`` does, not by the world rank. H must be a multiple of U.
        mask: the mask of the WHOLE sequence, the same on every rank: what ``ring_attention``
            takes (causal, windows, documents, padding, dense/bias tensors, softcap, alibi,
            relative_bias, sinks); per-head tensors are narrowed to the rank's heads
            (:func:`~attnkit.distributed.ulysses.heads_of`), so a learnable slope, table or
            logit gets the gradient of the rank's heads and queries only: sum it over the
            mesh. A bias requiring grad, ``from_function`` and ``score_function`` raise.
        backend: what computes each ring step (``"auto"``, ``"tiled"``, ``"triton"``).
        ring_layout: the ring's layout across groups: ``"contiguous"``, ``"zigzag"``
            (balanced causal work across groups) or a ``BalancedLayout`` planned for R ranks
            and the whole length; shard the inputs with the same one.
        stats: a :class:`~attnkit.distributed.ring.RingStats` the ring fills (its steps and
            bytes sent across groups).
        backward_timeout: seconds each backward handshake (the Ulysses group's, then the
            ring's) waits for the other ranks (default: the ring's ``BACKWARD_TIMEOUT``, read
            at call time); ranks that do not come are named in a ``RuntimeError``.

    K/V heads (GQA/MQA) go to the Ulysses ranks as
    :func:`~attnkit.distributed.ulysses.kv_head_index` picks them for U ranks (replicated when
    Hkv is not a multiple of U). Differentiable in q, k, v and the mask's learnable tensors;
    every rank must backpropagate through its output. Shapes, dtype, options, the mask's
    contents, grad mode and ``requires_grad`` are compared across all P ranks before any
    transfer: a problem on any rank raises the same error on every rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "hybrid_attention needs an initialised torch.distributed process group: launch with "
            "torchrun and call torch.distributed.init_process_group(...), or use "
            "attnkit.distributed.spawn(fn, world_size) for local processes")
    timeout = backward_timeout_of(backward_timeout, "hybrid_attention")
    groups = _mesh_groups(mesh)
    ring_group, ulysses_group, _, _, _, ulysses_size = groups
    local_mask = _validate(q, k, v, mask, scale, return_lse, backend, ring_layout, groups)
    heads, kv_heads = q.shape[1], k.shape[1]
    q_index = _q_head_index(heads, ulysses_size)
    kv_index = kv_head_index(heads, kv_heads, ulysses_size)
    q_h, k_h, v_h = _ToHeads.apply(ulysses_group, q_index, kv_index, q, k, v)
    result = ring_attention(q_h, k_h, v_h, local_mask, scale=scale, group=ring_group,
                            layout=ring_layout, return_lse=return_lse, stats=stats,
                            backend=backend, backward_timeout=timeout)
    if not return_lse:
        (out,) = _ToSequence.apply(ulysses_group, q_index, heads, timeout, "hybrid_attention",
                                   result)
        return out
    out, lse = _ToSequence.apply(ulysses_group, q_index, heads, timeout, "hybrid_attention",
                                 result.out, result.lse.unsqueeze(-1))
    return AttentionResult(out, lse.squeeze(-1), None)


def hybrid_bytes(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int],
                 mesh_shape: Sequence[int], element_size: int, *, return_lse: bool = False,
                 lse_element_size: int = 4) -> dict:
    """Bytes one rank sends to other ranks in one :func:`hybrid_attention` call.

    ``q_shape [B, H, Tq/P, Dk]``, ``k_shape [B, Hkv, Tk/P, Dk]``, ``v_shape [B, Hkv, Tk/P,
    Dv]``: the local shards; ``mesh_shape (R, U)``; ``element_size``: bytes per element of
    q/k/v/out (2 for fp16/bf16, 8 for fp64); ``lse_element_size``: of the LSE.

    Returns ``{"ulysses", "ring", "forward", "backward"}``. ``"ulysses"``:
    :func:`~attnkit.distributed.ulysses.ulysses_bytes` of the shards for U ranks (its
    ``"forward"``/``"backward"`` entries included). ``"ring"``: ``{"k", "v", "dk", "dv",
    "forward", "backward"}``, what :class:`~attnkit.distributed.ring.RingStats`'s
    ``bytes_sent`` counts: ``k``/``v`` one send of the rank's chunk ``[B, n, U·Tk/P, D]``
    (``n`` K/V heads per Ulysses rank, :func:`~attnkit.distributed.ulysses.kv_head_index`),
    ``dk``/``dv`` the same in the gradient sums' dtype (4 bytes, 8 for fp64);
    forward ``(R−1)·(k + v)``, backward ``(R−1)·(k + v) + R·(dk + dv)`` (0 when R = 1).
    ``"forward"``/``"backward"``: the two summed.

    ``mesh_shape (1, P)`` gives ``ulysses_attention``'s bytes and ``(P, 1)``
    ``ring_attention``'s (contiguous or zigzag layout), so the three compare side by side.
    """
    ring_size, ulysses_size = _check_mesh_shape(mesh_shape, "hybrid_bytes")
    for name, shape in (("q_shape", q_shape), ("k_shape", k_shape), ("v_shape", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"hybrid_bytes: {name} {tuple(shape)} must be a 4-D local shard "
                             f"shape [B, H, T/P, D]")
    heads = q_shape[1]
    if heads % ulysses_size:
        raise ValueError(f"hybrid_bytes: H={heads} query heads (q_shape {tuple(q_shape)}) must "
                         f"be a multiple of the Ulysses size U={ulysses_size} of mesh_shape "
                         f"{tuple(mesh_shape)}")
    ulysses = ulysses_bytes(q_shape, k_shape, v_shape, ulysses_size, element_size,
                            return_lse=return_lse, lse_element_size=lse_element_size)
    batch, kv_heads, kv_len, dk = k_shape
    dv = v_shape[-1]
    local_kv = kv_head_index(heads, kv_heads, ulysses_size).shape[1]
    chunk = batch * local_kv * kv_len * ulysses_size  # elements per head dim of a K/V chunk
    grad_size = max(element_size, 4)  # the ring's dK/dV sums: fp32, fp64 for fp64
    ring = {"k": chunk * dk * element_size, "v": chunk * dv * element_size,
            "dk": chunk * dk * grad_size, "dv": chunk * dv * grad_size}
    hops = ring_size - 1
    ring["forward"] = hops * (ring["k"] + ring["v"])
    ring["backward"] = hops * (ring["k"] + ring["v"]) + (
        ring_size * (ring["dk"] + ring["dv"]) if ring_size > 1 else 0)
    return {"ulysses": ulysses, "ring": ring,
            "forward": ulysses["forward"] + ring["forward"],
            "backward": ulysses["backward"] + ring["backward"]}
