"""Sequence parallelism as a value: which parallel attention, over which group, which layout.

    from attnkit.distributed.parallel import SequenceParallel

    sp = SequenceParallel(kind="ring", layout="zigzag")     # group None: the whole world
    x_local = sp.shard(x, dim=1)                             # [B, T, E] → [B, T/P, E]
    positions = sp.positions(x_local.shape[1])               # global positions of the shard
    out_local = sp.attend(q_local, k_local, v_local, ak.causal())   # [B, H, T/P, D]

:class:`attnkit.nn.MultiHeadAttention` (``sequence_parallel=``) and the Hugging Face
integration (:func:`attnkit.integrations.transformers.sequence_parallel`) take one; both run
their attention through :meth:`SequenceParallel.attend`, i.e. :func:`ring_attention`,
:func:`ulysses_attention` or :func:`hybrid_attention` (``kind="hybrid"`` with a 2-D
``mesh``), with the mask of the WHOLE sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..masks import Mask
from .hybrid import MeshLike, _mesh_groups, hybrid_attention, hybrid_shard
from .ring import BACKENDS as RING_BACKENDS
from .ring import Layout, _check_layout, pieces, ring_attention, shard, unshard
from .ulysses import ulysses_attention

__all__ = ["SequenceParallel", "KINDS"]

KINDS = ("ring", "ulysses", "hybrid")
"""The parallel attentions :class:`SequenceParallel` can name."""


@dataclass(frozen=True)
class SequenceParallel:
    """How an attention layer runs across the ranks of a process group, each holding one shard
    of the sequence.

    Attributes:
        group: the ``torch.distributed`` process group (``None``: the default, whole world).
        kind: ``"ring"`` (:func:`~attnkit.distributed.ring_attention`: K/V shards travel around
            the ring; every rank holds every head) or ``"ulysses"``
            (:func:`~attnkit.distributed.ulysses.ulysses_attention`: all-to-all to head shards;
            the number of query heads must be a multiple of the group size) or ``"hybrid"``
            (:func:`~attnkit.distributed.hybrid_attention`: Ulysses inside the groups of a 2-D
            ``mesh``, ring across them).
        layout: how the sequence is cut into shards: ``"contiguous"`` (rank r holds positions
            ``[r·T/P, (r+1)·T/P)``), ``"zigzag"`` or a ``BalancedLayout`` (ring only; Ulysses
            takes contiguous shards only); for the hybrid, the layout of its ring across the
            groups (:func:`~attnkit.distributed.hybrid_shard`).
        backend: what computes each rank's part: for ring and hybrid one of ``"auto"``,
            ``"tiled"``, ``"triton"``; for Ulysses any :func:`attnkit.attention` backend name.
        mesh: for ``kind="hybrid"`` only (and then required, with ``group`` None): a 2-D
            ``DeviceMesh`` of shape ``(R, U)`` or a pair ``(ring_group, ulysses_group)``.

    Frozen and compared by value; it holds no tensors. The ring, Ulysses, shapes and masks are
    checked by the functions it calls, on every rank, before any transfer.
    """

    group: Optional["dist.ProcessGroup"] = None
    kind: str = "ring"
    layout: Layout = "contiguous"
    backend: str = "auto"
    mesh: Optional[MeshLike] = None

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"SequenceParallel(kind={self.kind!r}): use 'ring' "
                             f"(ring_attention), 'ulysses' (ulysses_attention) or 'hybrid' "
                             f"(hybrid_attention, with mesh=)")
        if (self.kind == "hybrid") != (self.mesh is not None) or (
                self.kind == "hybrid" and self.group is not None):
            raise ValueError(f"SequenceParallel(kind={self.kind!r}, mesh={self.mesh!r}, "
                             f"group={self.group!r}): kind='hybrid' takes a mesh (a 2-D "
                             f"DeviceMesh (R, U) or a pair of groups) and no group; the other "
                             f"kinds take a group and no mesh")
        _check_layout(self.layout)
        if self.kind == "ulysses" and not (isinstance(self.layout, str)
                                           and self.layout == "contiguous"):
            raise ValueError(f"SequenceParallel(kind='ulysses', layout={self.layout!r}): "
                             f"Ulysses takes contiguous shards only; use layout='contiguous', "
                             f"or kind='ring' for zigzag and balanced layouts")
        if not isinstance(self.backend, str):
            raise TypeError(f"SequenceParallel(backend={self.backend!r}): pass a backend name")
        if self.kind != "ulysses" and self.backend not in RING_BACKENDS:
            raise ValueError(f"SequenceParallel(kind={self.kind!r}, backend={self.backend!r}): "
                             f"a ring step runs on one of {list(RING_BACKENDS)}")
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"SequenceParallel(group=...) takes a torch.distributed "
                            f"ProcessGroup or None (the world), got {type(self.group).__name__}")

    # ---- where this rank stands ----------------------------------------------------------------
    def _check_initialised(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "sequence parallelism needs an initialised torch.distributed process group: "
                "launch with torchrun and call torch.distributed.init_process_group(...), or use "
                "attnkit.distributed.spawn(fn, world_size) for local processes")

    def _mesh(self) -> tuple:
        """The hybrid's ``(ring_group, ulysses_group, r, u, R, U)`` on this rank."""
        self._check_initialised()
        return _mesh_groups(self.mesh)

    def rank(self) -> int:
        """This process's rank in :attr:`group` (the hybrid: ``r·U + u`` in its mesh)."""
        self._check_initialised()
        if self.kind == "hybrid":
            _, _, r, u, _, ulysses = self._mesh()
            return r * ulysses + u
        return dist.get_rank(self.group)

    def world_size(self) -> int:
        """P, the number of ranks in :attr:`group` (the hybrid: ``R·U``)."""
        self._check_initialised()
        if self.kind == "hybrid":
            _, _, _, _, ring, ulysses = self._mesh()
            return ring * ulysses
        return dist.get_world_size(self.group)

    def shard(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """This rank's shard of the whole-sequence ``x`` along ``dim``, cut by :attr:`layout`:
        ``[..., T, ...]`` → ``[..., T/P, ...]`` (``dim=1`` for ``[B, T, E]`` hidden states or
        ``[B, T]`` token ids; the default -2 for ``[B, H, T, D]``)."""
        if self.kind == "hybrid":
            _, _, r, u, ring, ulysses = self._mesh()
            return hybrid_shard(x, (r, u), (ring, ulysses), self.layout, dim=dim)
        return shard(x, self.rank(), self.world_size(), self.layout, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """The whole-sequence tensor from every rank's shard ``x`` along ``dim`` (the inverse
        of :meth:`shard`, by all-gathers; no gradient): ``[..., T/P, ...]`` → ``[..., T, ...]``,
        e.g. the whole row's ``position_ids``. Call on every rank."""
        def everyone(t: torch.Tensor, group) -> list[torch.Tensor]:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            return parts
        if self.kind == "hybrid":
            ring_group, ulysses_group = self._mesh()[:2]
            chunk = unshard(everyone(x, ulysses_group), "contiguous", dim=dim)
            return unshard(everyone(chunk, ring_group), self.layout, dim=dim)
        self._check_initialised()
        return unshard(everyone(x, self.group), self.layout, dim=dim)

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """LongTensor ``[T/P]``: the global position of each of the ``local_len`` rows of this
        rank's shard (``local_len · P = T``), e.g. the ``position_ids`` of an unpacked row."""
        if isinstance(local_len, bool) or not isinstance(local_len, int) or local_len < 0:
            raise ValueError(f"local_len={local_len!r}: pass the shard's length, an int >= 0")
        if self.kind == "hybrid":
            return self.shard(torch.arange(local_len * self.world_size(), device=device), dim=0)
        runs = pieces(local_len, self.rank(), self.world_size(), self.layout)
        parts = [torch.arange(run.global_start, run.global_start + run.count, device=device)
                 for run in runs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    # ---- the attention ---------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Union[Mask, torch.Tensor, None] = None, *, scale: Optional[float] = None,
               dropout_p: float = 0.0, invariant: bool = False) -> torch.Tensor:
        """This rank's rows of ``attention(q_whole, k_whole, v_whole, mask)``; call on every rank.

        ``q [B, Hq, Tq/P, Dk]``, ``k [B, Hkv, Tk/P, Dk]``, ``v [B, Hkv, Tk/P, Dv]``: this rank's
        shards as :meth:`shard` cuts them; ``mask``: the mask of the WHOLE sequence, the same
        on every rank. Returns ``out [B, Hq, Tq/P, Dv]``. Differentiable; every rank must run
        the backward. ``dropout_p`` and ``invariant`` are Ulysses-only (each rank then draws
        its own dropout pattern); with ring they raise ``ValueError``.
        """
        if self.kind != "ulysses":
            if dropout_p:
                raise ValueError(f"{self.kind} attention has no attention dropout (dropout_p="
                                 f"{dropout_p}): its ring steps have none; set the dropout to 0 "
                                 f"(or call eval()), or use SequenceParallel(kind='ulysses')")
            if invariant:
                raise ValueError(f"{self.kind} attention does not run under the invariance "
                                 f"contract (its ring merges steps in ring order); leave "
                                 f"attnkit.invariant() off, or use kind='ulysses'")
            if self.kind == "hybrid":
                return hybrid_attention(q, k, v, mask, mesh=self.mesh, scale=scale,
                                        ring_layout=self.layout, backend=self.backend)
            return ring_attention(q, k, v, mask, scale=scale, group=self.group,
                                  layout=self.layout, backend=self.backend)
        extra = {}
        if dropout_p:
            extra["dropout_p"] = dropout_p
        if invariant:
            extra["invariant"] = True
        return ulysses_attention(q, k, v, mask, scale=scale, group=self.group,
                                 backend=self.backend, **extra)
