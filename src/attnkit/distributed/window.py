"""A mask of the whole sequence, seen from one rectangle of it: a ring step's local view.

A ring step computes the queries at global positions ``[q_offset, q_offset + q_count)`` against
the keys at ``[kv_offset, kv_offset + kv_count)``. Kernels that evaluate masks from local
indices (the triton kernels) take :func:`window`'s mask over the rectangle's own
:class:`~attnkit.masks.MaskSpace`: its tiles, block maps and :class:`~attnkit.masks.Structure`
are the global mask's, moved to local positions (diagonals shifted, lengths reduced, ranges
and ids sliced, dense tensors sliced), so no kernel needs to know about offsets.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..masks import Mask, MaskSpace, Structure, cache_key


def window(mask: Optional[Mask], space: MaskSpace, q_offset: int, q_count: int, kv_offset: int,
           kv_count: int) -> tuple[Optional[Mask], MaskSpace]:
    """``mask`` over the global ``space``, restricted to queries ``[q_offset, q_offset+q_count)``
    and keys ``[kv_offset, kv_offset+kv_count)``: ``(local mask, local space)``, the local space
    ``[B, H, q_count, kv_count]``; the mask is ``None`` when ``mask`` is."""
    local = MaskSpace(space.batch, space.heads, q_count, kv_count, space.device)
    if mask is None:
        return None, local
    return _Window(mask, space, q_offset, kv_offset, local), local


class _Window(Mask):
    """``inner`` (a mask over the global ``whole``) at local positions: local query ``i`` is
    global ``i + q_offset``, local key ``j`` global ``j + kv_offset``."""

    def __init__(self, inner: Mask, whole: MaskSpace, q_offset: int, kv_offset: int,
                 local: MaskSpace):
        self.inner, self.whole, self.local = inner, whole, local
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.has_bias = inner.has_bias

    def _moved(self, leaf: Mask) -> "_Window":
        return _Window(leaf, self.whole, self.q_offset, self.kv_offset, self.local)

    def leaves(self):
        return [self._moved(leaf) for leaf in self.inner.leaves()]

    def cache_key(self, keep):
        key = cache_key(self.inner, keep)
        if key is None:
            return None
        whole, local = self.whole, self.local
        return ("window", key, whole.batch, whole.heads, whole.q_len, whole.kv_len, self.q_offset,
                self.kv_offset, local.q_len, local.kv_len)

    def biases(self):
        return self.inner.biases()

    def tile(self, q_idx, kv_idx, space):
        return self.inner.tile(q_idx + self.q_offset, kv_idx + self.kv_offset, self.whole)

    def tile_bias(self, q_idx, kv_idx, space):
        return self.inner.tile_bias(q_idx + self.q_offset, kv_idx + self.kv_offset, self.whole)

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count = self.local.q_len - q_offset if q_count is None else q_count
        kv_count = self.local.kv_len - kv_offset if kv_count is None else kv_count
        return self.inner.block_map(block_q, block_k, self.whole,
                                    q_offset=q_offset + self.q_offset, q_count=q_count,
                                    kv_offset=kv_offset + self.kv_offset, kv_count=kv_count)

    def structure(self, space):
        form = self.inner.structure(self.whole)
        if form is None:
            return None
        q_off, kv_off = self.q_offset, self.kv_offset
        q_count, kv_count = self.local.q_len, self.local.kv_len
        if form.diagonals is not None:  # lo ≤ (k + kv_off) − (q + q_off) ≤ hi
            return Structure(diagonals=tuple(None if d is None else d + q_off - kv_off
                                             for d in form.diagonals))
        if form.lengths is not None:
            q_len, kv_len = form.lengths
            return Structure(lengths=(_shorter(q_len, q_off, q_count), _shorter(kv_len, kv_off, kv_count)))
        if form.ranges is not None:  # each row's run of the other side, moved and clipped
            q_runs, kv_runs = form.ranges
            return Structure(ranges=(_runs(q_runs[:, q_off:q_off + q_count], kv_off, kv_count),
                                     _runs(kv_runs[:, kv_off:kv_off + kv_count], q_off, q_count)))
        if form.ids is not None:
            q_ids, kv_ids = form.ids
            return Structure(ids=(q_ids[..., q_off:q_off + q_count], kv_ids[..., kv_off:kv_off + kv_count]))
        if form.bias is not None:
            return Structure(bias=_sliced(form.bias, q_off, q_count, kv_off, kv_count))
        return None

    def __repr__(self):
        return (f"window({self.inner!r}, queries {self.q_offset}+{self.local.q_len}, "
                f"keys {self.kv_offset}+{self.local.kv_len})")


def _shorter(lengths: Optional[torch.Tensor], offset: int, count: int) -> Optional[torch.Tensor]:
    """Per-batch real lengths from global position ``offset`` on, within ``count``."""
    return None if lengths is None else (lengths - offset).clamp(0, count)


def _runs(runs: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """Runs ``[lo, hi)`` ``[B, T, 2]`` of the other side's global positions → local ones within
    ``[0, count)``, an emptied run as ``[0, 0)``."""
    moved = (runs - offset).clamp(0, count)
    return torch.where((moved[..., 1:] > moved[..., :1]), moved, 0).to(runs.dtype)


def _sliced(values: torch.Tensor, q_off: int, q_count: int, kv_off: int, kv_count: int) -> torch.Tensor:
    """``[Bm, Hm, Tq|1, Tk|1]`` → the rectangle's ``[Bm, Hm, q_count|1, kv_count|1]`` (a view)."""
    if values.shape[-2] != 1:
        values = values[..., q_off:q_off + q_count, :]
    if values.shape[-1] != 1:
        values = values[..., kv_off:kv_off + kv_count]
    return values
