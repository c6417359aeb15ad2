"""Mask objects: which keys each query may attend to, without building a dense matrix.

A mask answers three questions, and every backend uses only these:

- ``tile(q_idx, kv_idx, space)``: the boolean "may attend" for one tile of positions,
  shape ``[Bm, Hm, len(q_idx), len(kv_idx)]`` with ``Bm in (1, B)`` and ``Hm in (1, H)``.
- ``tile_bias(q_idx, kv_idx, space)``: the additive float bias for that tile, or ``None``.
- ``block_map(block_q, block_k, space)``: for every (query-block, key-block) tile,
  ``EMPTY`` (skip it), ``FULL`` (no masking needed) or ``PARTIAL`` (apply ``tile``).

Positions are *global*: ``q_idx``/``kv_idx`` are absolute indices into the whole sequence,
so a shard of a longer sequence is evaluated by passing its own index range (``q_offset``).
``space`` (:class:`MaskSpace`) carries the batch size, head count and the *global* lengths.

True means "may attend", as in ``torch.nn.functional.scaled_dot_product_attention``::

    >>> print(causal().draw(4, 4))
    █░░░
    ██░░
    ███░
    ████
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import numbers
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Union

import numpy as np
import torch
import torch.autograd.forward_ad as forward_ad
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .threadlocal import setting

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Block-map codes: skip the tile, apply the element mask, or use the tile unmasked."""

__all__ = [
    "EMPTY", "PARTIAL", "FULL", "MaskSpace", "Mask", "Band", "Structure", "MASK_TYPES", "causal",
    "sliding_window", "padding", "real_keys", "documents", "dense", "bias", "from_function",
    "as_mask",
]


@dataclass(frozen=True)
class MaskSpace:
    """The extent a mask is evaluated over: batch size, heads, and global sequence lengths."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    device: torch.device = torch.device("cpu")


def _positions(start: int, stop: int, device) -> torch.Tensor:
    return torch.arange(start, stop, device=device)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x


class Band(NamedTuple):
    """A band mask's parameters (:meth:`Mask.band`): keys ``q + shift − left ≤ k ≤ q + shift +
    right`` (``None``: unbounded), ``shift`` 0 for ``"top_left"``, ``Tk − Tq`` for
    ``"bottom_right"``."""

    left: Optional[int]
    right: Optional[int]
    align: str


CAUSAL = Band(None, 0, "top_left")
"""Top-left causal (torch's ``is_causal``) as a :class:`Band`."""


class Structure(NamedTuple):
    """A mask in a form a kernel evaluates from indices (:meth:`Mask.structure`); one field is
    set. ``diagonals``: ``lo ≤ k − q ≤ hi`` (``None``: unbounded). ``lengths``: the real queries
    and keys are ``[0, length)`` per batch element (long ``[B]`` or ``[1]`` each, or ``None``).
    ``ranges``: each query's allowed keys are one run and each key's allowed queries one run,
    int32 ``[B, Tq, 2]`` and ``[B, Tk, 2]`` (``[lo, hi)``; empty as ``[0, 0)``). ``ids``: a query
    and a key match when their document ids are equal, ``[T]`` or ``[B, T]`` per side.
    ``bias``: float values added to the scores, ``-inf`` = masked."""

    diagonals: Optional[tuple[Optional[int], Optional[int]]] = None
    lengths: Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None
    ranges: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ids: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    bias: Optional[torch.Tensor] = None

MASK_TYPES: dict[str, type] = {}
"""Every mask class by name (filled as classes are defined), for rebuilding a mask from a
description of its fields (``attnkit.compiled``)."""


class GuardRuns(NamedTuple):
    """Real runs ``(lo, hi)`` (two long ``[Bm]``: positions ``lo ≤ i < hi``) of the queries and
    of the keys, or ``None`` for a side without them (:meth:`Mask.guard_runs`)."""

    q: Optional[tuple[torch.Tensor, torch.Tensor]]
    kv: Optional[tuple[torch.Tensor, torch.Tensor]]


NO_RUNS = GuardRuns(None, None)


class Mask:
    """Base class. Subclasses implement :meth:`tile`; structured ones also :meth:`block_map`."""

    has_bias: bool = False
    """True when the mask carries an additive float bias (tiles then always need applying)."""

    runs_code: bool = False
    """True when evaluating the mask calls user code (``from_function``): a compiled graph
    evaluates such a mask once into a dense one."""

    modifies: bool = False
    """True when the mask is or holds a score modifier (:mod:`attnkit.modifiers`: ``softcap``,
    ``alibi``, …), which changes scores instead of choosing keys; validation takes modifiers
    out of the mask, so backends never see one here."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        MASK_TYPES[cls.__name__] = cls

    def __getstate__(self) -> dict:
        """The mask's fields without what was derived from its tensors (:func:`memo`, keyed by
        their identities, which a copy's tensors do not have, and a later object's may reuse):
        a copied or unpickled mask derives anew."""
        return mask_fields(self)

    def band(self) -> Optional[Band]:
        """The mask's :class:`Band` when it is one band (``causal``, ``sliding_window``), else
        ``None``."""
        return None

    def leaves(self) -> list["Mask"]:
        """The parts of an ``&`` chain, flattened (``a & (b & c)`` → ``[a, b, c]``); ``[self]``
        for any other mask."""
        return [self]

    def structure(self, space: MaskSpace) -> Optional[Structure]:
        """This mask as a :class:`Structure` over ``space``, or ``None`` when it has no such
        form (a kernel then loads it as a dense mask). Asked of the :meth:`leaves` of a chain."""
        return None

    def simplified(self, space: MaskSpace) -> Optional["Mask"]:
        """The simplest mask allowing exactly what this one does over ``space``: ``None`` when
        it allows everything, top-left causal for a band that is causal there (bottom-right
        causal with Tq = Tk; a window wider than the sequence), else ``self``. Validation
        applies it, so a decode step with one query under ``causal("bottom_right")`` runs as
        unmasked attention and can take a fused kernel."""
        return self

    def cache_key(self, keep: list) -> Optional[tuple]:
        """A hashable description of the mask (its kind, parameters and tensors: a tensor by
        identity and version counter, :func:`tensor_key`, so an in-place write through torch
        misses; no value is read), or ``None`` when
        it is not cached: ``from_function`` (its function may read anything), and ``dense``
        and ``bias`` (reading their Tq×Tk tensors to validate a key costs about what deriving
        a block map from them costs, and a cache would keep them alive). Tensors named by
        ``id`` are appended to ``keep``; a cache must hold them, so an id cannot be reused
        while its entry lives."""
        return None

    def guard_runs(self, space: MaskSpace) -> "GuardRuns":
        """Each batch element's runs of real queries and real keys, outside which q (a padded
        query) and K/V may hold garbage that no result needs: :func:`attnkit.finite.guard`
        zeroes them there before a call. A side is ``None`` when the mask gives it no run, or
        vouches for those positions (a :class:`~attnkit.nn.KVCache`'s keys)."""
        return NO_RUNS

    def map_score_tensors(self, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> "Mask":
        """This mask with each tensor laid over the scores (a ``dense`` bool mask, a ``bias``)
        replaced by ``fn(tensor, is_bias)``; the mask itself when it holds none (``fn`` maps
        a caller's layout to ``[Bm, Hm, Tq, Tk]`` in validation). Never modifies ``self``."""
        return self

    # ---- the three questions -------------------------------------------------------------
    def tile(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, space: MaskSpace) -> torch.Tensor:
        """Bool "may attend" for positions ``q_idx`` [tq] × ``kv_idx`` [tk] → ``[Bm, Hm, tq, tk]``."""
        raise NotImplementedError

    def tile_bias(self, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                  space: MaskSpace) -> Optional[torch.Tensor]:
        """Additive bias ``[Bm, Hm, tq, tk]`` (float), or ``None`` when the mask has none."""
        return None

    def block_map(self, block_q: int, block_k: int, space: MaskSpace, *,
                  q_offset: int = 0, q_count: Optional[int] = None,
                  kv_offset: int = 0, kv_count: Optional[int] = None) -> torch.Tensor:
        """Classify tiles: int8 ``[Bm, Hm, ceil(q_count/block_q), ceil(kv_count/block_k)]``.

        Covers queries ``q_offset .. q_offset+q_count`` and keys ``kv_offset .. kv_offset+kv_count``
        (global positions; the counts default to the rest of the sequence). Codes are
        :data:`EMPTY`, :data:`PARTIAL`, :data:`FULL`. The generic version evaluates the element
        mask once (O(tq·tk) booleans); structured masks override it with O(blocks) arithmetic.
        """
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)
        allowed = self.tile(_positions(q_offset, q_offset + q_count, space.device),
                            _positions(kv_offset, kv_offset + kv_count, space.device), space)
        return _reduce_blocks(allowed, block_q, block_k, self.has_bias)

    def to_dense(self, space: MaskSpace) -> torch.Tensor:
        """The whole bool mask ``[Bm, Hm, q_len, kv_len]`` (for the reference backend, the
        torch backend's bias and pictures; not to be written to). Kept on the mask while its
        tensors are unchanged (:func:`memo`) up to :data:`DENSE_MEMO_ELEMENTS` per head, so
        every layer of a step that passes one mask evaluates it once."""
        def evaluate():
            return self.tile(_positions(0, space.q_len, space.device),
                             _positions(0, space.kv_len, space.device), space)
        if space.q_len * space.kv_len > DENSE_MEMO_ELEMENTS:
            return evaluate()
        return memo(self, ("dense", space.batch, space.heads, space.q_len, space.kv_len,
                            space.device), mask_tensors(self), evaluate)

    def dense_bias(self, space: MaskSpace) -> Optional[torch.Tensor]:
        """The whole additive bias ``[Bm, Hm, q_len, kv_len]``, or ``None``."""
        if not self.biases():
            return None
        return self.tile_bias(_positions(0, space.q_len, space.device),
                              _positions(0, space.kv_len, space.device), space)

    def draw(self, q_len: int = 8, kv_len: Optional[int] = None, *, batch: int = 0,
             head: int = 0) -> str:
        """Text picture of the mask: █ may attend, ░ masked (one line per query), for batch
        element ``batch`` and head ``head`` of a ``q_len × kv_len`` call; ``ValueError`` for
        a size or index the mask cannot be drawn at (a negative size, a size other than the one
        its tensors fix, an element past the mask's own batch)."""
        kv_len = q_len if kv_len is None else kv_len
        for name, value in (("q_len", q_len), ("kv_len", kv_len), ("batch", batch),
                            ("head", head)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"draw({name}={value!r}): pass an int ≥ 0")
        space = MaskSpace(batch=max(batch + 1, self._min_batch()), heads=head + 1,
                          q_len=q_len, kv_len=kv_len)
        fixed = self._size()
        if fixed[0] not in (None, q_len) or fixed[1] not in (None, kv_len):
            sides = " × ".join("any" if n is None else str(n) for n in fixed)
            raise ValueError(f"draw({q_len}, {kv_len}): the mask's tensors fix its size at "
                             f"{sides} (queries × keys); draw it at that size")
        grid = self.to_dense(space)
        for name, index, size in (("batch", batch, grid.shape[0]), ("head", head, grid.shape[1])):
            if size > 1 and index >= size:  # (a mask of one broadcasts to any index)
                raise ValueError(f"draw({name}={index}): the mask holds {size} along {name} "
                                 f"(indices 0..{size - 1})")
        grid = grid[min(batch, grid.shape[0] - 1), min(head, grid.shape[1] - 1)]
        return "\n".join("".join("█" if a else "░" for a in row.tolist()) for row in grid)

    def _min_batch(self) -> int:
        return 1

    def check(self, space: MaskSpace) -> list[str]:
        """Problems fitting this mask to ``space`` (empty when it fits); used by validation."""
        return []

    def biases(self) -> list[torch.Tensor]:
        """The additive bias tensors this mask adds to the scores (each as stored, e.g.
        ``[Bm, Hm, Tq|1, Tk|1]`` once fitted to a call); a bias that requires grad gets its
        gradient through them. Empty for boolean masks."""
        return []

    # ---- combinators ------------------------------------------------------------------------
    def __and__(self, other: Union["Mask", torch.Tensor, None]) -> "Mask":
        if other is None:  # no mask: nothing more to require (an optional mask's "and")
            return self
        return _And(self, as_mask(other))

    def __rand__(self, other: Optional[torch.Tensor]) -> "Mask":
        # a bool or float tensor, or None, on the left
        return self if other is None else as_mask(other) & self

    def __or__(self, other: Union["Mask", torch.Tensor]) -> "Mask":
        if other is None:
            raise _union_with_none(f"{self!r} | None")
        return _Or(self, as_mask(other))

    def __ror__(self, other: torch.Tensor) -> "Mask":
        if other is None:
            raise _union_with_none(f"None | {self!r}")
        return as_mask(other) | self

    def __invert__(self) -> "Mask":
        return _Not(self)

    def _size(self) -> tuple[Optional[int], Optional[int]]:
        """``(Tq, Tk)`` as far as the mask's tensors fix them (document ids, a dense mask, a
        "real token" mask's width), ``None`` where they do not: :meth:`__str__` draws there."""
        return None, None

    def __str__(self) -> str:
        """The mask's picture (:meth:`draw`) at the size its tensors fix (a side they leave
        open as long as the other), else 8×8; its ``repr`` when that size is over 32
        positions or it cannot be drawn on its own."""
        q_len, kv_len = self._size()
        q_len, kv_len = q_len or kv_len or 8, kv_len or q_len or 8
        if max(q_len, kv_len) > 32:
            return repr(self)
        try:
            return self.draw(q_len, kv_len)
        except (IndexError, RuntimeError, TypeError, ValueError):  # e.g. a from_function's code
            return repr(self)


def _counts(space: MaskSpace, q_offset: int, q_count: Optional[int], kv_offset: int,
            kv_count: Optional[int]) -> tuple[int, int]:
    """The query and key counts a block map covers (default: the rest of the sequence)."""
    return (space.q_len - q_offset if q_count is None else q_count,
            space.kv_len - kv_offset if kv_count is None else kv_count)


def _reduce_blocks(allowed: torch.Tensor, block_q: int, block_k: int, has_bias: bool) -> torch.Tensor:
    """Collapse an element mask ``[Bm, Hm, tq, tk]`` into block codes."""
    bm, hm, tq, tk = allowed.shape
    nq, nk = math.ceil(tq / block_q), math.ceil(tk / block_k)
    pad_q, pad_k = nq * block_q - tq, nk * block_k - tk
    # Padding positions count as allowed for "all" and disallowed for "any".
    padded = torch.nn.functional.pad(allowed.to(torch.int8), (0, pad_k, 0, pad_q), value=-1)
    blocks = padded.reshape(bm, hm, nq, block_q, nk, block_k).transpose(3, 4)
    blocks = blocks.reshape(bm, hm, nq, nk, block_q * block_k)
    any_allowed = (blocks == 1).any(-1)
    all_allowed = (blocks != 0).all(-1)
    codes = any_allowed.to(torch.int8)  # EMPTY (0) or PARTIAL (1)
    if not has_bias:
        codes = codes + (any_allowed & all_allowed)  # FULL (2)
    return codes


def _block_bounds(offset: int, count: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last global position of every block: two [n] tensors."""
    starts = torch.arange(offset, offset + count, block, device=device)
    ends = torch.clamp(starts + block - 1, max=offset + count - 1)
    return starts, ends


def _codes_from_bounds(any_allowed: torch.Tensor, all_allowed: torch.Tensor) -> torch.Tensor:
    """int8 tile codes: EMPTY where nothing is allowed, FULL where everything is, else PARTIAL
    (selected on the device: no value is read)."""
    full = torch.full((), FULL, dtype=torch.int8, device=any_allowed.device)
    partial = torch.full((), PARTIAL, dtype=torch.int8, device=any_allowed.device)
    empty = torch.full((), EMPTY, dtype=torch.int8, device=any_allowed.device)
    return torch.where(any_allowed, torch.where(all_allowed, full, partial), empty)


def _union_with_none(expression: str) -> TypeError:
    return TypeError(f"{expression}: None is no mask (every key allowed), so the union would "
                     f"be no mask either; pass None itself, or a mask")


def aligned_shift(align: str, space: MaskSpace) -> int:
    """What an alignment subtracts from ``j − i`` (a band's diagonal, a position modifier's
    distance): 0 for ``"top_left"``, ``Tk − Tq`` for ``"bottom_right"`` (the last query sits
    on the last key)."""
    return space.kv_len - space.q_len if align == "bottom_right" else 0


class _Band(Mask):
    """Keys in ``[q + shift - left, q + shift + right]``; ``None`` bounds are unbounded."""

    def __init__(self, left: Optional[int], right: Optional[int], align: str):
        if align not in ("top_left", "bottom_right"):
            raise ValueError(f"align={align!r}: use 'top_left' (torch SDPA) or 'bottom_right' (flash-attn)")
        self.left, self.right, self.align = left, right, align

    def band(self) -> Band:
        return Band(self.left, self.right, self.align)

    def cache_key(self, keep):
        return ("band", self.left, self.right, self.align)

    def _shift(self, space: MaskSpace) -> int:
        return aligned_shift(self.align, space)

    def structure(self, space):
        shift = self._shift(space)
        return Structure(diagonals=(None if self.left is None else shift - self.left,
                                    None if self.right is None else shift + self.right))

    def simplified(self, space):
        if not (space.q_len and space.kv_len):
            return self
        lo, hi = self.structure(space).diagonals  # k - q lies in [1 - Tq, Tk - 1]
        lo = None if lo is None or lo <= 1 - space.q_len else lo
        hi = None if hi is None or hi >= space.kv_len - 1 else hi
        if lo is None and hi is None:
            return None
        if lo is None and hi == 0 and (self.left, self.right, self.align) != tuple(CAUSAL):
            return _Band(*CAUSAL)
        return self

    def tile(self, q_idx, kv_idx, space):
        rel = kv_idx[None, :] - (q_idx[:, None] + self._shift(space))  # [tq, tk]
        if self.right is None and self.left is None:
            return _as_4d(torch.ones_like(rel, dtype=torch.bool))
        allowed = rel <= self.right if self.right is not None else None
        if self.left is not None:
            above = rel >= -self.left
            allowed = above if allowed is None else allowed & above
        return _as_4d(allowed)

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)
        q_lo, q_hi = _block_bounds(q_offset, q_count, block_q, space.device)
        k_lo, k_hi = _block_bounds(kv_offset, kv_count, block_k, space.device)
        shift = self._shift(space)
        # rel = k - q - shift over a tile spans [k_lo - q_hi, k_hi - q_lo] - shift.
        rel_min = k_lo[None, :] - q_hi[:, None] - shift  # [nq, nk]
        rel_max = k_hi[None, :] - q_lo[:, None] - shift
        hi = self.right if self.right is not None else math.inf
        lo = -self.left if self.left is not None else -math.inf
        any_allowed = (rel_min <= hi) & (rel_max >= lo)
        all_allowed = (rel_max <= hi) & (rel_min >= lo)
        return _codes_from_bounds(any_allowed, all_allowed)[None, None]  # [1, 1, nq, nk]

    def __repr__(self):
        return _band_call(self.left, self.right, self.align)


def _band_call(left: Optional[int], right: Optional[int], align: str, *extra: str) -> str:
    """The call that builds a band: ``causal()``, ``causal('bottom_right')``,
    ``sliding_window(128)``, ``sliding_window(UNBOUNDED, 4)``; ``extra`` arguments appended
    (``sequences=...``)."""
    if left is None and right == 0:
        args = [] if align == "top_left" else [repr(align)]
        return f"causal({', '.join(args + list(extra))})"
    args = ["UNBOUNDED" if left is None else str(left)]
    if right != 0:
        args.append("UNBOUNDED" if right is None else str(right))
    if align != "top_left":
        args.append(f"align={align!r}")
    return f"sliding_window({', '.join(args + list(extra))})"


def tensor_summary(t: torch.Tensor) -> str:
    """A tensor in a repr, by its dtype and shape: ``<float32 [2, 16]>``."""
    return f"<{str(t.dtype).removeprefix('torch.')} {list(t.shape)}>"


def _show(t: Optional[torch.Tensor], short: int = 8) -> str:
    """A tensor of integers as the caller would write it: a number, a list (up to ``short``
    entries), or its first entries and its length; ``<dtype [shape]>`` when its values cannot
    be read (meta tensors, inside a compiled region)."""
    if t is None:
        return "None"
    if not readable(t):
        return tensor_summary(t)
    if t.dim() == 0:
        return str(t.item())
    if t.numel() <= short:
        return str(t.tolist())
    head = ", ".join(str(x) for x in t.reshape(-1)[:4].tolist())
    return f"[{head}, …] ({t.shape[0]} rows)"


def causal(align: str = "top_left", *, sequences: Optional[Mask] = None) -> Mask:
    """Causal mask: query i sees keys j ≤ i.

    ``align="top_left"`` (torch SDPA's ``is_causal``) anchors the diagonal at (0, 0);
    ``align="bottom_right"`` (flash-attn) anchors it at the last query and last key, so with
    more keys than queries (decoding with a cache) the last query sees every key::

        top_left, 3×5      bottom_right, 3×5
        █░░░░              ███░░
        ██░░░              ████░
        ███░░              █████

    ``sequences``: a :func:`padding` mask. The diagonal is then anchored in each batch
    element's own real runs ``[q_start_b, q_start_b + q_len_b)`` and ``[kv_start_b, kv_start_b +
    kv_len_b)`` instead of the whole ``[Tq, Tk]`` (flash-attn's varlen causal, xFormers'
    ``BlockDiagonalCausalFromBottomRightMask``, a KV cache with a length per sequence), and the
    result includes that padding: one object is the whole mask, ``sequences & band``. Top-left:
    the i-th real query sees the real keys j ≤ i; bottom-right: the last real query sits on the
    last real key, ``shift_b = (kv_start_b + kv_len_b) − (q_start_b + q_len_b)``. Each batch
    element ``b`` of ``[B, H, Tq, Tk]`` gets its own mask ``[Tq, Tk]``;
    ``causal("bottom_right", sequences=padding(q_lengths=[3, 2], kv_lengths=[5, 3],
    kv_starts=[0, 2]))`` on 3×5, batch elements 0 and 1::

        b = 0   b = 1
        ███░░   ░░██░
        ████░   ░░███
        █████   ░░░░░

    ``sequences`` may also be a :func:`documents` mask (packed sequences in one row): the
    diagonal is then anchored in each document's own query and key segments,
    ``documents(q_ids, kv_ids, causal=align)``.
    """
    band = _Band(left=None, right=0, align=align)
    return band if sequences is None else _per_sequence(band, sequences, "causal")


def sliding_window(left: int, right: int = 0, align: str = "top_left", *,
                   sequences: Optional[Mask] = None) -> Mask:
    """Local attention: query i sees keys ``i - left ≤ j ≤ i + right`` (``right=0``: causal window).

    ``sliding_window(2)`` on 5×5::

        █░░░░
        ██░░░
        ███░░
        ░███░
        ░░███

    ``sequences``: a :func:`padding` mask; ``i`` and ``j`` then count from each batch element's
    own real runs (``align`` as in :func:`causal`: top-left from their starts, bottom-right
    with the last real query on the last real key), and the result includes that padding. Or
    a :func:`documents` mask: ``i`` and ``j`` count inside each document's query and key
    segments (packed sequences of different lengths, each with its own window).
    """
    for name, value in (("left", left), ("right", right)):
        if not an_int(value):
            raise TypeError(f"sliding_window {name}={value!r}: must be an int number of positions")
    left, right = (v if isinstance(v, torch.SymInt) else int(v) for v in (left, right))
    for name, value in (("left", left), ("right", right)):
        if value < 0:
            raise ValueError(f"sliding_window {name}={value} is negative: use a window of 0 or more "
                             f"positions (left counts keys before the query, right keys after it)")
    # A bound at or past the sequence length allows every key on that side; past UNBOUNDED it
    # is stored as unbounded, so no index arithmetic overflows.
    band = _Band(left=None if left >= UNBOUNDED else left,
                 right=None if right >= UNBOUNDED else right, align=align)
    return band if sequences is None else _per_sequence(band, sequences, "sliding_window")


UNBOUNDED = 1 << 30
"""A sliding-window bound at least this large is stored as unbounded (``None``): longer than
any sequence, and small enough for 32-bit index arithmetic in kernels."""


def an_int(value) -> bool:
    """Whether ``value`` is one integer: a Python or numpy integer, a traced size
    (``torch.SymInt``), or a 0-d integer tensor or numpy array (``bool`` is not). Under
    ``torch.compile`` a numpy integer is traced as a 0-d ``np.ndarray``, so arrays are read
    through their tensor dtype."""
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            return False
        try:
            value = torch.as_tensor(value, device="cpu")
        except (TypeError, RuntimeError):  # strings, objects
            return False
    if isinstance(value, torch.SymInt):  # a traced size's arithmetic (export, make_fx)
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex()
                                         or value.dtype == torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer_tensor(value) -> torch.Tensor:
    """``value`` (a tensor, or nested lists of numbers) as a tensor of its own dtype, for the
    caller to refuse unless integer: a list holding a float becomes a float tensor, never
    truncated; an empty list (no dtype of its own) becomes long, for the caller's shape
    check. Raises what ``torch.tensor`` raises for anything else (``torch.tensor``, not
    ``as_tensor``: dynamo traces the list's ints as inputs, where ``as_tensor`` pins their
    values into the graph, a recompile for every new list)."""
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")
    if t.numel() == 0 and not isinstance(value, torch.Tensor):
        t = t.to(torch.long)
    return t


def _lengths(name: str, value) -> Optional[torch.Tensor]:
    """``value`` as a long tensor of shape ``[B]`` (or ``[]``/``[1]``), ``None`` kept; ``name``
    is the argument (``q_lengths``, ``kv_starts``, ...) the messages name."""
    if value is None:
        return None
    what = "start" if name.endswith("starts") else "length"
    try:
        t = integer_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"padding {name}={value!r}: pass integer {what}s, one per batch element "
                        f"(a list of ints or an integer tensor of shape [B])") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"padding {name} has dtype {t.dtype}: pass integer {what}s, one per batch "
                        f"element (for a 2-D 'real token' mask [B, T] use padding("
                        f"{name[:name.index('_')]}_mask=...))")
    if t.dim() > 1:
        raise ValueError(f"padding {name} has shape {tuple(t.shape)}: pass one {what} per batch "
                         f"element, shape [B] (for a 2-D 'real token' mask [B, T] use padding("
                         f"{name[:name.index('_')]}_mask=...))")
    return t.to(torch.long)


def _refuse_negative(named: dict) -> None:
    """ValueError for the first of ``named`` (argument name → long tensor or ``None``) holding a
    negative value; one host read for all (none where values cannot be read: check() then)."""
    given = {name: t for name, t in named.items() if t is not None and t.numel()}
    if not given or not readable(*given.values()):
        return
    lows = torch.stack([t.min() for t in given.values()]).tolist()
    for (name, t), low in zip(given.items(), lows):
        if low < 0:
            what = "start" if name.endswith("starts") else "length"
            raise ValueError(f"padding {name}={t.tolist()} out of range: each {what} must be 0 "
                             f"or more")


class _Runs(NamedTuple):
    """A 2-D "real token" mask read into runs (:func:`_runs`)."""

    starts: torch.Tensor  # long [B]: each row's first real position (0 for an empty row)
    lengths: torch.Tensor  # long [B]: each row's number of real positions
    width: int  # T, the mask's columns
    broken: Optional[torch.Tensor]  # bool [B], inside a compiled region: real tokens not one run
    empty: Optional[torch.Tensor]  # bool [B], inside a compiled region: no real token (refused)
    every_row: bool = False  # every row holds a real token (read; False when unknown)
    real: Optional[torch.Tensor] = None  # bool [B, T]: the mask itself, a copy of its own
    shifted: Optional[bool] = None  # some row starts past position 0 (read; None when unknown)
    full: bool = False  # every token is real (read; False when unknown)
    spans: Optional[tuple] = None  # ((start, stop) per row, read; None when unknown)


def run_bounds(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a bool ``[B, T]``: ``(count, first, last)``, its True entries, the first and
    the last one's position (``T`` and ``-1`` for a row without one), each ``[B]``."""
    batch, width = m.shape
    count = m.sum(-1)
    if not width:
        return (count, torch.zeros(batch, dtype=torch.long, device=m.device),
                torch.full((batch,), -1, dtype=torch.long, device=m.device))
    positions = torch.arange(width, device=m.device)
    return (count, torch.where(m, positions, width).amin(-1),
            torch.where(m, positions, -1).amax(-1))


def _one_run(m: torch.Tensor) -> torch.Tensor:
    """Per row of a bool ``[B, T]``, whether its True entries are one non-empty run: ``[B]``."""
    count, first, last = run_bounds(m)
    return (count > 0) & (last - first + 1 == count)


def _runs(name: str, value, allow_empty_rows: bool) -> _Runs:
    """A 2-D "real token" mask ``[B, T]`` (True or 1 = real) → its runs (:class:`_Runs`); a
    row without real tokens gives start 0, length 0, and is refused unless
    ``allow_empty_rows``. Each row's real tokens must be one contiguous run. Both are checked
    here, or, inside a compiled region, where no value can be read, returned as ``broken`` /
    ``empty`` for :meth:`_Padding.check`."""
    side = name[:name.index("_")]
    dense_fix = ("ak.dense(mask[:, None, None, :])" if side == "kv"
                 else "ak.dense(mask[:, None, :, None])")
    try:
        m = value if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"padding {name}={value!r}: pass a bool or 0/1 integer tensor of shape "
                        f"[B, T] (True = real token)") from None
    if m.is_floating_point() or m.is_complex():
        raise TypeError(f"padding {name} has dtype {m.dtype}: pass a bool or 0/1 integer tensor "
                        f"[B, T] (True = real token), e.g. {name}=attention_mask.bool()")
    if m.dim() != 2:
        raise ValueError(f"padding {name} has shape {tuple(m.shape)}: pass a 2-D 'real token' mask "
                         f"of shape [B, T] (one row per batch element; mask[None] for a single "
                         f"sequence)")
    compiling = not readable(m)  # value checks then wait for check(): no host read
    if m.dtype != torch.bool:
        if m.numel() and not compiling and not bool(((m == 0) | (m == 1)).all()):
            bad = sorted(set(m[(m != 0) & (m != 1)].tolist()))[:5]
            raise ValueError(f"padding {name} holds values {bad}: an integer 'real token' mask "
                             f"must hold only 0 (padding) and 1 (real token)")
        m = m != 0
    else:
        m = m.clone()  # kept (_Runs.real): a later write to the caller's tensor changes nothing
    width = m.shape[1]
    # per row [B]: its real tokens, the first one's position (0 in a row without one), the runs
    # that open past position 0 and whether position 0 is real (one run: opens + that ≤ 1)
    count = m.sum(-1)
    starts = m.to(torch.uint8).argmax(-1) if width else torch.zeros_like(count)
    opens = (m[:, 1:] > m[:, :-1]).sum(-1)
    first_real = m[:, 0] if width else torch.zeros_like(count, dtype=torch.bool)
    if compiling:
        return _Runs(starts, count, width, (opens + first_real) > 1,
                     None if allow_empty_rows else count == 0)
    # One host read for both checks and what the padding keeps: whether some row starts past
    # 0, whether every row has a real token, whether every token is real.
    counts, firsts, opened, real_first = torch.stack([count, starts, opens, first_real]).tolist()
    broken = [row for row, runs in enumerate(map(sum, zip(opened, real_first))) if runs > 1]
    empty = [row for row, n in enumerate(counts) if not n]
    if broken:
        # torch's key_padding_mask (True = padding) read as a real-token mask: an unpadded row
        # is all False, padding at both ends is True at both ends. Its inverse is one run per
        # row, so the message suggests ~mask when that holds.
        example = "".join("1" if x else "0" for x in m[broken[0]].tolist()[:40])
        inverse = (f"; if True marks padding in this mask (torch's key_padding_mask), pass "
                   f"{name}=~mask, whose rows are one run each" if bool(_one_run(~m).all()) else "")
        raise ValueError(f"padding {name} of shape {tuple(m.shape)}: the real tokens of rows "
                         f"{_rows(broken)} are not one contiguous run "
                         f"(row {broken[0]}: {example}{'...' if width > 40 else ''}); padding() "
                         f"takes left or right padding only: use {dense_fix} for this mask"
                         f"{inverse}")
    if empty and not allow_empty_rows:
        raise ValueError(_empty_rows_message(name, empty, tuple(m.shape),
                                             bool(_one_run(~m).all())))
    return _Runs(starts, count, width, None, None, not empty, m, any(firsts),
                 all(n == width for n in counts),
                 tuple((first, first + n) for first, n in zip(firsts, counts)))


def _rows(rows: list) -> str:
    """Row indices for a message: at most 8, then ``...``."""
    return f"{rows[:8]}{'...' if len(rows) > 8 else ''}"


def _empty_rows_message(name: str, rows: list, shape: Optional[tuple], inverse_fits: bool) -> str:
    """The error for rows of a real-token mask without a real token; ``inverse_fits``: the
    mask's inverse is one run per row, so it may be torch's ``key_padding_mask``."""
    noun = "key" if name.startswith("kv") else "query"
    several = len(rows) > 1
    effect = (f"{'their' if several else 'its'} queries would attend to nothing" if noun == "key"
              else f"{'their' if several else 'its'} outputs would all be 0")
    inverse = (f"; torch's key_padding_mask is the opposite (True = padding): if this is one, "
               f"pass {name}=~mask" if inverse_fits else "")
    return (f"padding {name}{'' if shape is None else f' of shape {shape}'}: batch "
            f"row{'s' if several else ''} {_rows(rows)} {'have' if several else 'has'} no real "
            f"{noun} (all False): {effect}. {name} takes True = real token (may attend), as "
            f"Hugging Face's attention_mask{inverse}. For rows with no real {noun} on purpose, "
            f"pass allow_empty_rows=True")


def readable(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the values of ``tensors`` can be read on the host: not inside a compiled region
    (no value exists while tracing), not on ``meta``, not fake or under an active
    ``FakeTensorMode`` (shape propagation, memory estimates; real tensors there make fake
    results), not batched by a ``torch.func`` transform (``vmap`` over per-example lengths).
    Value checks are skipped where they cannot be made; the call then propagates shapes only
    (:func:`attnkit.dispatch.select`), or evaluates the mask as tensors (under ``vmap``)."""
    if torch.compiler.is_compiling() or _fake_mode_active():
        return False
    return not any(t is not None and (shapes_only(t) or wrapped_eagerly(t)) for t in tensors)


def _fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is active (its results hold no values)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` transform's wrapper or a forward-mode dual tensor
    (``torch.autograd.forward_ad``): what only differentiable torch operations may carry.
    Never inside a compiled region, where dynamo cannot call the check and traces the
    transforms itself."""
    return not torch.compiler.is_compiling() and wrapped_eagerly(t)


def wrapped_eagerly(t: torch.Tensor) -> bool:
    """:func:`_is_wrapped` for a caller that knows it runs outside a compiled region (False
    for what is not a tensor: the caller's checks name it)."""
    return isinstance(t, torch.Tensor) and (
        torch._C._functorch.is_functorch_wrapped_tensor(t)
        or (forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None))


def shapes_only(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no values at all: on ``meta``, or fake (``FakeTensorMode``)."""
    return t.device.type == "meta" or isinstance(t, FakeTensor)


DENSE_MEMO_ELEMENTS = 1 << 20
"""The largest ``Tq·Tk`` whose dense mask :meth:`Mask.to_dense` keeps on the mask."""

DENSE_MAX_SCORES = 1 << 16
"""``auto`` runs a mask other than causal on the torch backend, materialised as a dense bias,
when it covers at most this many scores per batch element and head (Tq·Tk ≤ 256²: decoding
steps, short padded batches); the tiled engine, which skips empty tiles and plans on the
host, is measured faster beyond (docs/BENCHMARKS.md)."""


def mask_fields(mask: Mask) -> dict:
    """What a mask is made of, by name: its fields without ``_memo`` (values derived from
    them, :func:`memo`), for the code that describes a mask (digests, compiled specs). Read
    from a copy of the mask's ``__dict__``, which another thread's first :func:`memo` may
    grow meanwhile."""
    fields = vars(mask).copy()
    fields.pop("_memo", None)
    return fields


def mask_tensors(mask: Mask) -> Optional[tuple]:
    """Every tensor a mask holds (its fields, its parts' fields), or ``None`` when it runs
    user code (``from_function``: what it reads is unknown). A mask's fields never change
    after construction: found once, kept with its memos; traced, found without keeping (a
    write into a mask made outside the traced region is a side effect that a checkpointed
    region refuses under ``fullgraph=True``)."""
    kept = mask.__dict__.get("_memo")
    if kept is not None and "tensors" in kept:
        return kept["tensors"]
    tensors, runs_code = _walk_tensors(mask)
    found = None if runs_code else tensors
    if not torch.compiler.is_compiling():
        mask.__dict__.setdefault("_memo", {})["tensors"] = found
    return found


def held_tensors(mask: Mask) -> tuple:
    """Every tensor in a mask's fields and its parts' fields, parts that run user code
    included (where :func:`mask_tensors` gives up on the whole mask): the tensors a plan
    and a backward watch for in-place writes."""
    tensors = mask_tensors(mask)
    return _walk_tensors(mask)[0] if tensors is None else tensors


def derived_values(mask: Optional[Mask]) -> list:
    """What ``mask`` and its parts keep of what was derived from them: their :func:`memo`
    values and causal documents' runs (:data:`_DOCUMENT_RUNS`), for the call cache's byte
    bound. Reads a copy of each memo, which another thread may grow meanwhile."""
    found: list = []
    stack = [] if mask is None else [mask]
    while stack:
        value = stack.pop()
        if isinstance(value, Mask):
            found.extend(tuple(value.__dict__.get("_memo", {}).values()))
            if isinstance(value, _CausalDocuments):
                found.append(_DOCUMENT_RUNS.get(value))
            stack.extend(mask_fields(value).values())
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
    return found


def tensor_versions(mask: Optional[Mask], extra: tuple = ()) -> tuple:
    """``(tensor, version counter)`` of every tensor ``mask`` holds and of ``extra`` (plain
    tensors with a counter: not inference tensors), for :func:`check_unwritten`."""
    held = (*(() if mask is None else held_tensors(mask)), *extra)
    return tuple((t, t._version) for t in held
                 if type(t) is torch.Tensor and not t.is_inference())


def check_unwritten(versions: tuple, backend: str) -> None:
    """A ``RuntimeError`` where a tensor of :func:`tensor_versions` was written in place since:
    a backward that reads the mask again (its biases, lengths, ids) would give the gradients
    of another mask, as torch refuses for a tensor saved for backward."""
    for t, version in versions:
        if t._version != version:
            raise RuntimeError(
                f"attnkit ({backend} backward): a tensor of the mask, shape {tuple(t.shape)}, "
                f"was written in place between the forward and the backward (version "
                f"{version} → {t._version}); the backward reads the mask's tensors again, "
                f"so its gradients could be those of another mask. Write it after the "
                f"backward, or build the mask from a clone")


def _walk_tensors(mask: Mask) -> tuple[tuple, bool]:
    """``(tensors, runs_code)``: the tensors in ``mask``'s fields and its parts', in field
    order, and whether some part runs user code."""
    found: list[torch.Tensor] = []
    runs_code = False
    # a stack, not a recursive closure: that is a reference cycle, which would keep the
    # tensors (and their autograd graphs) alive until the garbage collector runs
    stack = [mask]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, Mask):
            runs_code = runs_code or value.runs_code
            stack.extend(reversed(mask_fields(value).values()))
        elif isinstance(value, (tuple, list)):
            stack.extend(reversed(value))
    return tuple(found), runs_code


MEMO_ENTRIES = 8
"""Values :func:`memo` keeps per mask (one per extent a mask is used at, at most)."""


def keeping() -> bool:
    """Whether values derived from masks and calls may be kept and reused (the call cache,
    :func:`memo`, :class:`MaskCache`): not under ``FakeTensorMode`` (nothing made of fake
    tensors is kept for real calls) nor under a selective activation checkpoint's modes
    (each call then runs the same operations: the recompute meets the forward's, and the
    operations the policy saves are matched by their order). Other dispatch modes (operation
    counters, profilers) see what the call runs, kept values included."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return True
    if _fake_mode_active():
        return False
    checkpoint = sys.modules.get("torch.utils.checkpoint")  # imported by whoever checkpoints
    if checkpoint is None:  # (importing it here would import triton)
        return True
    recomputing = (checkpoint._CachingTorchDispatchMode, checkpoint._CachedTorchDispatchMode)
    return not any(isinstance(mode, recomputing) for mode in _get_current_dispatch_mode_stack())


def learnable(t: torch.Tensor) -> bool:
    """Whether ``t`` is what an optimizer may step, or a view of it: a parameter (frozen for
    an evaluation too, stepped while unfrozen) or a leaf that requires grad. ``torch.optim``'s
    fused optimizers (``AdamW(..., fused=True)``) write those without moving the version
    counter, so nothing derived from them is kept (:func:`memo`, the call cache, plans). A
    tensor computed with autograd history (a bias a layer computes) is never written so."""
    base = t._base
    return _steppable(t) or (base is not None and _steppable(base))


def _steppable(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.grad_fn is None)


def memo(mask: Mask, key: tuple, tensors: tuple, compute: Callable[[], object]):
    """``compute()``, kept on ``mask`` under ``key`` and the version counters of ``tensors``
    (the mask's own, :func:`mask_tensors`; ``None`` entries allowed), so each layer of a step
    evaluating one mask pays once, and an in-place write to a tensor recomputes. Not kept
    where ``tensors`` is ``None`` (a mask that runs user code), inside a compiled region or
    a mode that keeps nothing (:func:`keeping`), for inference tensors (no version counter),
    what an optimizer may step (:func:`learnable`: a fused one writes without moving the
    counter) or tensor subclasses (fake tensors): computed. A value kept is computed outside
    inference mode, so a mask first used in an inference-mode pass still serves calls that
    autograd records."""
    if tensors is None or torch.compiler.is_compiling() or not keeping() or any(
            t is not None and (type(t) is not torch.Tensor or t.is_inference()
                               or learnable(t)) for t in tensors):
        return compute()
    key = (*key, *(None if t is None else (id(t), t._version) for t in tensors))
    kept = mask.__dict__.setdefault("_memo", {})
    try:
        value = kept.get(key)
    except TypeError:  # symbolic sizes in the key (a symbolic trace): computed, not kept
        return compute()
    if value is None:
        if len(kept) >= MEMO_ENTRIES:
            tensors = kept.get("tensors")
            kept.clear()
            if tensors is not None:
                kept["tensors"] = tensors
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                value = kept[key] = compute()
        else:
            value = kept[key] = compute()
    return value


class _Padding(Mask):
    """Per batch element ``b``, query ``i`` is real when ``q_starts[b] ≤ i < q_starts[b] +
    q_lengths[b]`` (keys likewise); only real queries attend, and only to real keys. A ``None``
    start is 0; a ``None`` length runs to the end of the sequence. ``q_width``/``kv_width``: the
    width of the 2-D mask the runs were read from (``None`` when given as numbers), which must
    equal the sequence length."""

    vouched: bool = False
    """Set by a producer that made the runs itself (a :class:`~attnkit.nn.KVCache`): they fit
    the sequences it holds, so :meth:`check` reads no value, and K/V outside the key runs hold
    no garbage (zeros, or the sequence's own earlier keys), so :meth:`guard_runs` is ``None``."""

    keys_everywhere: bool = False
    """Every query is real and every key run non-empty, known without a further read: said
    by a vouching producer, or read with the runs of a ``kv_mask`` (:func:`every_row_has_key`)."""
    every_key_real: bool = False
    """A ``kv_mask`` without a query side whose every key is real (read with its runs): the
    mask allows every pair."""
    kv_spans: Optional[tuple] = None
    """A ``kv_mask`` without a query side: each row's real keys ``(start, stop)`` as read
    with its runs (Python ints), or ``None``."""

    def __init__(self, q_lengths, kv_lengths, q_starts=None, kv_starts=None, *,
                 q_mask=None, kv_mask=None, allow_empty_rows: bool = False):
        self.q_width = self.kv_width = self.q_broken = self.kv_broken = None
        self.q_empty = self.kv_empty = None
        for side, mask, lengths, starts in (("q", q_mask, q_lengths, q_starts),
                                            ("kv", kv_mask, kv_lengths, kv_starts)):
            if mask is not None and (lengths is not None or starts is not None):
                raise TypeError(f"padding: pass either {side}_mask or {side}_lengths/{side}_starts, "
                                f"not both ({side}_mask already gives each row's start and length)")
        if not isinstance(allow_empty_rows, bool):
            raise TypeError(f"padding allow_empty_rows={allow_empty_rows!r}: pass True or False")
        for name, value in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths),
                            ("q_starts", q_starts), ("kv_starts", kv_starts),
                            ("q_mask", q_mask), ("kv_mask", kv_mask)):
            if isinstance(value, torch.Tensor) and value.layout is not torch.strided:
                raise TypeError(f"padding {name} is a {value.layout} tensor of shape "
                                f"{tuple(value.shape)}: pass a dense one ({name}.to_dense())")
        self.q_lengths = _lengths("q_lengths", q_lengths)
        self.kv_lengths = _lengths("kv_lengths", kv_lengths)
        self.q_starts = _lengths("q_starts", q_starts)
        self.kv_starts = _lengths("kv_starts", kv_starts)
        _refuse_negative({name: getattr(self, name) for name in
                          ("q_lengths", "kv_lengths", "q_starts", "kv_starts")})
        # runs read from a 2-D mask lie within its width by construction (check(): width only)
        if q_mask is not None:
            runs = _runs("q_mask", q_mask, allow_empty_rows)
            self.q_starts, self.q_lengths, self.q_width, self.q_broken, self.q_empty = runs[:5]
            self._know_shifted("q", runs.shifted)
        self.kv_real = None
        if kv_mask is not None:
            runs = _runs("kv_mask", kv_mask, allow_empty_rows)
            (self.kv_starts, self.kv_lengths, self.kv_width, self.kv_broken,
             self.kv_empty) = runs[:5]
            self.kv_real = runs.real  # the runs as read: bool [B, Tk] (None when compiling)
            self._know_shifted("kv", runs.shifted)
            # every query real and every row of keys non-empty (read with the runs): every
            # row has a key (every_row_has_key)
            no_query_side = q_mask is None and self.q_lengths is None and self.q_starts is None
            self.keys_everywhere = runs.every_row and no_query_side
            self.every_key_real = runs.full and no_query_side
            self.kv_spans = runs.spans if no_query_side else None
        if all(t is None for t in (self.q_lengths, self.kv_lengths, self.q_starts, self.kv_starts)):
            raise ValueError("padding() needs q_lengths or kv_lengths (a length per batch element), "
                             "q_starts/kv_starts (left padding), or q_mask/kv_mask (a [B, T] "
                             "'real token' mask)")
        for side in ("q", "kv"):
            lengths, starts = getattr(self, f"{side}_lengths"), getattr(self, f"{side}_starts")
            if (lengths is not None and starts is not None and lengths.numel() != starts.numel()
                    and 1 not in (lengths.numel(), starts.numel())):
                raise ValueError(f"padding {side}_starts has {starts.numel()} entries but "
                                 f"{side}_lengths has {lengths.numel()}: give one start and one "
                                 f"length per batch element (or a single one for all)")

    def runs_read(self) -> bool:
        """Whether every run of this padding was read from a ``[B, T]`` mask on the host and
        found valid there (its :meth:`check` then compares widths only)."""
        return all((lengths is None and starts is None)
                   or (width is not None and broken is None and empty is None)
                   for lengths, starts, width, broken, empty in (
                       (self.q_lengths, self.q_starts, self.q_width, self.q_broken, self.q_empty),
                       (self.kv_lengths, self.kv_starts, self.kv_width, self.kv_broken,
                        self.kv_empty)))

    def _min_batch(self):
        return max(t.numel() for t in (self.q_lengths, self.kv_lengths, self.q_starts,
                                       self.kv_starts) if t is not None)

    def _size(self):
        return self.q_width, self.kv_width

    def cache_key(self, keep):
        return _tensors_key(self, ("q_lengths", "kv_lengths", "q_starts", "kv_starts"), keep)

    def guard_runs(self, space):
        q_runs = not (self.q_lengths is None and self.q_starts is None)
        kv_runs = not (self.vouched or (self.kv_lengths is None and self.kv_starts is None))
        if not (q_runs or kv_runs):
            return NO_RUNS
        q_lo, q_hi, kv_lo, kv_hi = self.runs(space)
        return GuardRuns((q_lo, q_hi) if q_runs else None, (kv_lo, kv_hi) if kv_runs else None)

    def has_starts(self) -> bool:
        """True when some real run does not begin at position 0 (left padding). Read once per
        content of the starts (:func:`memo`), or known without a read of its own: from the
        read that found a real-token mask's runs, or the one that validated the starts."""
        return self._shifted("q") or self._shifted("kv")

    def _shifted(self, side: str) -> bool:
        starts = getattr(self, f"{side}_starts")
        if starts is None or not starts.numel():
            return False
        return memo(self, ("shifted", side), (starts,), lambda: bool((starts != 0).any()))

    def _know_shifted(self, side: str, shifted: Optional[bool]) -> None:
        """Keep what a read found of ``side``'s starts (``None``: nothing)."""
        starts = getattr(self, f"{side}_starts")
        if shifted is not None and starts is not None:
            memo(self, ("shifted", side), (starts,), lambda: shifted)

    def check(self, space):
        if self.vouched:
            return []
        problems = []
        bounds = self._extremes()  # every (min, max) the range checks need: one host read
        for side, limit, width in (("q", space.q_len, self.q_width),
                                   ("kv", space.kv_len, self.kv_width)):
            noun = "query" if side == "q" else "key"
            lengths, starts = getattr(self, f"{side}_lengths"), getattr(self, f"{side}_starts")
            if width is not None and width != limit:
                problems.append(f"padding {side}_mask has {width} columns but the sequence has "
                                f"{limit} {noun} positions: give one entry per position, "
                                f"shape [B, {limit}]")
                continue
            rows = next((t.numel() for t in (lengths, starts) if t is not None), None)
            if width is not None and rows not in (None, 1, space.batch):
                problems.append(f"padding {side}_mask has {rows} rows but the batch has "
                                f"{space.batch}: give one row per batch element, shape "
                                f"[{space.batch}, {limit}]")
                continue
            broken = getattr(self, f"{side}_broken")
            if not readable(broken, getattr(self, f"{side}_empty"), lengths, starts):
                continue  # values unknown here (compiled, meta or fake): shapes only
            if broken is not None and bool(broken.any()):
                problems.append(f"padding {side}_mask: the real tokens of rows "
                                f"{broken.nonzero().flatten().tolist()[:8]} are not one contiguous "
                                f"run; padding() takes left or right padding only: use ak.dense "
                                f"for this mask")
                continue
            empty = getattr(self, f"{side}_empty")
            if empty is not None and bool(empty.any()):
                problems.append(_empty_rows_message(f"{side}_mask", empty.nonzero().flatten().tolist(),
                                                    None, True))
                continue
            if width is not None:  # runs read from a mask of this width: in range
                continue
            counts_ok = True
            for name, t in ((f"{side}_lengths", lengths), (f"{side}_starts", starts)):
                if t is not None and t.numel() not in (1, space.batch):
                    counts_ok = False
                    what = "start" if name.endswith("starts") else "length"
                    problems.append(f"padding {name} has {t.numel()} entries (shape "
                                    f"{tuple(t.shape)}) but the batch has {space.batch}: give one "
                                    f"{what} per batch element")
            if not counts_ok:
                continue
            low, high = bounds.get(side, ({}, {}))
            if not low:
                continue
            ends = starts + lengths if starts is not None and lengths is not None else None
            if starts is None:
                if low["lengths"] < 0 or high["lengths"] > limit:
                    problems.append(f"padding {side}_lengths={lengths.tolist()} out of range: each "
                                    f"must be in [0, {limit}] (the {noun} length)")
                continue
            if "starts" in low:
                self._know_shifted(side, high["starts"] > 0)
            if "starts" in low and (low["starts"] < 0 or high["starts"] > limit):
                problems.append(f"padding {side}_starts={starts.tolist()} out of range: each must be "
                                f"in [0, {limit}] (the {noun} length)")
                continue
            if "ends" in high and high["ends"] > limit:
                problems.append(f"padding {side}_starts + {side}_lengths = {ends.tolist()} out of "
                                f"range ({side}_starts={starts.tolist()}, {side}_lengths="
                                f"{lengths.tolist()}): each real run must end within the {limit} "
                                f"{noun} positions; shorten {side}_lengths or move {side}_starts")
        return problems

    def _extremes(self) -> dict:
        """Per side (``"q"``, ``"kv"``) with runs given as numbers: ``(low, high)``, dicts of
        the minimum and maximum of its ``"lengths"``, ``"starts"`` and ``"ends"`` (starts +
        lengths), all read in one host read."""
        parts = {}
        for side in ("q", "kv"):
            if getattr(self, f"{side}_width") is not None:
                continue  # runs read from a mask: in range by construction
            lengths, starts = getattr(self, f"{side}_lengths"), getattr(self, f"{side}_starts")
            ends = None
            if (starts is not None and lengths is not None
                    and (starts.numel() == lengths.numel() or 1 in (starts.numel(), lengths.numel()))):
                ends = starts.reshape(-1) + lengths.reshape(-1)
            for name, t in (("lengths", lengths), ("starts", starts), ("ends", ends)):
                if t is not None and t.numel():
                    parts[side, name] = t
        if not parts or not readable(*parts.values()):
            return {}
        read = torch.stack([x for t in parts.values() for x in (t.min(), t.max())]).tolist()
        bounds: dict = {}
        for (side, name), low, high in zip(parts, read[0::2], read[1::2]):
            lows, highs = bounds.setdefault(side, ({}, {}))
            lows[name], highs[name] = low, high
        return bounds

    def _side(self, lengths, starts, limit, device) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last real position per batch element: two long ``[Bm]``."""
        if starts is None and lengths is not None:  # right padding: runs [0, length)
            hi = lengths.reshape(-1).to(device)
            return torch.zeros_like(hi), hi
        lo = (torch.zeros(1, dtype=torch.long, device=device) if starts is None
              else starts.reshape(-1).to(device))
        hi = (torch.full((1,), limit, dtype=torch.long, device=device) if lengths is None
              else lo + lengths.reshape(-1).to(device))
        lo, hi = torch.broadcast_tensors(lo, hi)
        return lo, hi

    def runs(self, space):
        """``(q_lo, q_hi, kv_lo, kv_hi)``: the real runs ``[lo, hi)``, each long ``[Bm]``;
        computed once per extent while the mask's tensors are unchanged (:func:`memo`)."""
        return memo(self, ("bounds", space.q_len, space.kv_len, space.device),
                     (self.q_lengths, self.kv_lengths, self.q_starts, self.kv_starts),
                     lambda: (*self._side(self.q_lengths, self.q_starts, space.q_len, space.device),
                              *self._side(self.kv_lengths, self.kv_starts, space.kv_len,
                                          space.device)))

    def key_spans(self, space) -> Optional[tuple]:
        """Each batch element's real keys ``(start, stop)`` as Python ints, for a padding of
        the keys alone that does not vouch for what lies outside them: as read with a
        ``kv_mask``'s runs, else read once (one host read, kept while the mask's tensors are
        unchanged); ``None`` for any other padding, or where values cannot be read."""
        if self.kv_spans is not None:
            return self.kv_spans
        if (self.vouched or self.q_lengths is not None or self.q_starts is not None
                or self.kv_width is not None
                or not readable(*(t for t in (self.kv_lengths, self.kv_starts) if t is not None))):
            return None

        def read():
            _, _, lo, hi = self.runs(space)
            lo, hi = torch.broadcast_tensors(lo.clamp(0, space.kv_len), hi.clamp(0, space.kv_len))
            return tuple((a, max(a, b)) for a, b in zip(*torch.stack([lo, hi]).tolist()))
        return memo(self, ("key spans", space.kv_len), mask_tensors(self), read)

    def structure(self, space):
        if not self.has_starts():
            return Structure(lengths=(self.q_lengths, self.kv_lengths))
        q_lo, q_hi, kv_lo, kv_hi = (t.expand(space.batch) for t in self.runs(space))

        def ranges(lo, hi, length, other_lo, other_hi):  # a real row's range: the other side's run
            pos = torch.arange(length, device=space.device)[None, :]
            real = ((pos >= lo[:, None]) & (pos < hi[:, None]))[..., None]  # [B, T, 1]
            span = torch.stack([other_lo, other_hi], dim=-1)[:, None, :]  # [B, 1, 2]
            return torch.where(real, span, 0).to(torch.int32)
        return Structure(ranges=(ranges(q_lo, q_hi, space.q_len, kv_lo, kv_hi),
                                 ranges(kv_lo, kv_hi, space.kv_len, q_lo, q_hi)))

    def key_mask(self, space) -> Optional[torch.Tensor]:
        """Bool ``[B, Tk]``: the real keys as read from ``kv_mask``, when that is this mask's
        whole content (no query side) and it spans the call's keys; else ``None``."""
        real = self.kv_real
        if (real is None or self.q_lengths is not None or self.q_starts is not None
                or real.shape[1] != space.kv_len):
            return None
        if real.device == space.device:
            return real
        return memo(self, ("key mask", space.device), mask_tensors(self),  # moved once
                    lambda: real.to(space.device))

    def to_dense(self, space):
        # key padding alone, its real keys broadcast over the queries: read from a real-key
        # mask, or a decoding step's (made anew in every layer: no memo would be read again),
        # positions below each sequence's length
        keys = self.key_mask(space)
        if keys is None and self.vouched and self.q_lengths is None:
            keys = keys_below(self.kv_lengths, space.kv_len, space.device)
        if keys is None:
            return super().to_dense(space)
        return keys[:, None, None, :].expand(-1, 1, space.q_len, -1)  # [B, 1, Tq, Tk]

    def tile(self, q_idx, kv_idx, space):
        def inside(idx, starts, lengths, side):  # [Bm, t], or None: every position real
            if starts is None and lengths is None:
                return None
            if starts is None:  # right padding, runs [0, length): no bounds to build
                return idx[None, :] < lengths.reshape(-1).to(space.device)[:, None]
            bounds = self.runs(space)  # [Bm] each: (q_lo, q_hi, kv_lo, kv_hi)
            lo, hi = bounds[:2] if side == "q" else bounds[2:]
            return (idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None])
        q_ok = inside(q_idx, self.q_starts, self.q_lengths, "q")
        kv_ok = inside(kv_idx, self.kv_starts, self.kv_lengths, "kv")
        if q_ok is None or kv_ok is None:
            rows = q_ok if kv_ok is None else kv_ok
            if rows is None:
                return torch.ones(1, 1, q_idx.shape[0], kv_idx.shape[0], dtype=torch.bool, device=space.device)
            shape = (rows.shape[0], 1, q_idx.shape[0], kv_idx.shape[0])
            return (rows[:, None, :, None] if kv_ok is None else rows[:, None, None, :]).expand(shape)
        return (q_ok[:, :, None] & kv_ok[:, None, :])[:, None]  # [Bm, 1, tq, tk]

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)
        q_lo, q_hi, kv_lo, kv_hi = self.runs(space)
        b_qlo, b_qhi = _block_bounds(q_offset, q_count, block_q, space.device)
        b_klo, b_khi = _block_bounds(kv_offset, kv_count, block_k, space.device)

        def classify(first, last, lo, hi):  # blocks [first, last] against runs [lo, hi) → [Bm, n]
            lo, hi = lo[:, None], hi[:, None]
            any_real = (first[None] < hi) & (last[None] >= lo) & (lo < hi)
            all_real = (first[None] >= lo) & (last[None] < hi)
            return any_real, all_real

        q_any, q_all = classify(b_qlo, b_qhi, q_lo, q_hi)  # [Bm, nq]
        k_any, k_all = classify(b_klo, b_khi, kv_lo, kv_hi)  # [Bm, nk]
        any_allowed = q_any[:, :, None] & k_any[:, None, :]
        all_allowed = q_all[:, :, None] & k_all[:, None, :]
        return _codes_from_bounds(any_allowed, all_allowed)[:, None]  # [Bm, 1, nq, nk]

    def __repr__(self):
        parts = [f"{name}={_show(getattr(self, name))}"
                 for name in ("q_lengths", "kv_lengths", "q_starts", "kv_starts")
                 if getattr(self, name) is not None]
        return f"padding({', '.join(parts)})"


Padding = _Padding
"""The class of :func:`padding` masks (for ``isinstance``)."""


def padding(q_lengths=None, kv_lengths=None, q_starts=None, kv_starts=None, *,
            q_mask=None, kv_mask=None, allow_empty_rows: bool = False) -> Mask:
    """Variable-length batches, padded on the right, the left or both: query ``i`` of batch
    element ``b`` is real when ``q_starts[b] ≤ i < q_starts[b] + q_lengths[b]``, key ``j`` when
    ``kv_starts[b] ≤ j < kv_starts[b] + kv_lengths[b]``. Padded keys are never attended;
    padded queries output exactly 0 (LSE −inf).

    Each argument is integers, one per batch element (a list or a ``[B]`` tensor; a single
    value applies to every element). Starts default to 0 (right padding); starts without
    lengths mean the real tokens run from the start to the end of the sequence (left padding
    for generation: ``kv_starts=[pad_0, pad_1, ...]``). Every run must fit in the sequence:
    ``0 ≤ start`` and ``start + length ≤`` the query/key length. An int64 tensor is held, not
    copied (other dtypes and lists are converted): what is derived from it is kept by its
    version counter, so a later write through torch is seen and one torch does not count (into
    numpy memory shared by ``torch.from_numpy``, through ``.data``) is not: pass a new tensor
    then, or call ``torch.autograd.graph.increment_version(t)`` after the write.

    ``q_mask`` / ``kv_mask``: a 2-D "real token" mask ``[B, T]`` instead (bool, or 0/1
    integers; True = real token, as Hugging Face's ``attention_mask``), read here into starts
    and lengths (so later in-place writes to it are not seen: build a new mask after them); a
    row's real tokens must be one contiguous run (any other pattern is a general
    mask: ``ak.dense(mask[:, None, None, :])``). Its width ``T`` must equal the sequence length.
    A row with no real token (all False) is refused (ValueError naming the rows) unless
    ``allow_empty_rows=True``: it is what torch's ``key_padding_mask`` (True = padding) gives
    for an unpadded row, so such a mask is passed as ``~key_padding_mask``. A length of 0 is
    always allowed: that row's queries output 0, or its keys are never attended.

    ``padding(kv_lengths=[3])`` on 4×5::

        ███░░
        ███░░
        ███░░
        ███░░
    """
    return _Padding(q_lengths, kv_lengths, q_starts, kv_starts, q_mask=q_mask, kv_mask=kv_mask,
                    allow_empty_rows=allow_empty_rows)


def keys_below(lengths: torch.Tensor, kv_len: int, device) -> torch.Tensor:
    """Bool ``[B, kv_len]``: key position j of sequence b is real when ``j < lengths[b]``
    (a vouched key padding's dense form, :func:`vouched_padding`)."""
    return torch.arange(kv_len, device=device) < lengths.view(-1, 1)


def vouched_padding(q_lengths: Optional[torch.Tensor], kv_lengths: torch.Tensor, *,
                    keys_everywhere: bool = False) -> Mask:
    """``padding(q_lengths=..., kv_lengths=...)`` from a producer that made both itself (a
    :class:`~attnkit.nn.KVCache`; ``q_lengths`` ``None``: every query real): long ``[B]``
    tensors that fit its sequences, and K/V past
    each key length that hold no garbage (zeros, or the sequence's own earlier keys). No value
    is read, neither here nor when a call validates it (:attr:`_Padding.vouched`).
    ``keys_everywhere``: the producer also vouches that every key length is at least 1 and
    ``q_lengths`` is ``None``, so every query row has a key (:func:`every_row_has_key`)."""
    if keys_everywhere and q_lengths is not None:
        raise ValueError("vouched_padding(keys_everywhere=True) needs q_lengths=None: a padded "
                         "query has no key")
    mask = _Padding.__new__(_Padding)
    mask.kv_real = None
    mask.q_width = mask.kv_width = mask.q_broken = mask.kv_broken = None
    mask.q_empty = mask.kv_empty = None
    mask.q_lengths, mask.kv_lengths = q_lengths, kv_lengths
    mask.q_starts = mask.kv_starts = None
    mask.vouched = True
    mask.keys_everywhere = keys_everywhere
    # its tensors, known here (mask_tensors): a step's mask is new in every layer
    mask._memo = {"tensors": tuple(t for t in (q_lengths, kv_lengths) if t is not None)}
    return mask


def every_row_has_key(mask: Optional[Mask], space: Optional[MaskSpace] = None) -> bool:
    """Whether every query row of ``mask`` is known to have an allowed key without reading a
    value: no mask, or a key padding whose every row has a real key, as a vouching producer
    said (``vouched_padding(..., keys_everywhere=True)``: a decoding step over a cache) or as
    read with the runs of its ``kv_mask`` (the transformers padding mask). ``False`` means
    unknown, not that some row has none. Also ``documents`` over one ids tensor for queries
    and keys (``kv_ids`` left out), with or without ``causal=``: each query sees its own
    position (:func:`every_key_seen`); and, given the call's ``space``, a causal mask or
    window whose band reaches a key from every row (:func:`_band_covers`)."""
    return (mask is None or (isinstance(mask, _Padding) and mask.keys_everywhere)
            or _self_documents(mask) or _band_covers(mask, space, rows=True))


def every_key_seen(mask: Optional[Mask], space: Optional[MaskSpace] = None) -> bool:
    """Whether every key of ``mask`` is known to be seen by some query without reading a
    value: no mask, or ``documents`` over one ids tensor for queries and keys (with or
    without ``causal=``: key j is seen by query j); given the call's ``space``, a causal mask
    or window whose band reaches every key (:func:`_band_covers`). ``False`` means unknown."""
    return mask is None or _self_documents(mask) or _band_covers(mask, space, rows=False)


def _band_covers(mask: Mask, space: Optional[MaskSpace], rows: bool) -> bool:
    """For a band ``lo ≤ k − q ≤ hi`` over ``Tq × Tk`` (both non-zero): whether every query
    has a key (``rows``: ``hi ≥ 0`` and ``Tq − 1 + lo ≤ Tk − 1``), or every key a query
    (``lo ≤ 0`` and ``Tk − 1 − hi ≤ Tq − 1``); both need ``lo ≤ hi``. Known from the shapes
    alone: bottom-right causal with ``Tq ≤ Tk`` reaches every row, top-left with ``Tq ≥ Tk``
    every key."""
    if space is None or not isinstance(mask, _Band) or not (space.q_len and space.kv_len):
        return False
    lo, hi = mask.structure(space).diagonals
    if lo is not None and hi is not None and lo > hi:
        return False
    if rows:
        return ((hi is None or hi >= 0)
                and (lo is None or space.q_len - 1 + lo <= space.kv_len - 1))
    return ((lo is None or lo <= 0)
            and (hi is None or space.kv_len - 1 - hi <= space.q_len - 1))


def key_starts(mask: Optional[Mask]) -> Optional[torch.Tensor]:
    """Where each batch element's keys begin, ``[Bm]`` long, when ``mask`` (or a part of its
    ``&`` chain) is a key padding with starts, or a band aligned to one (left padding, a
    transformers ``attention_mask`` read by :func:`real_keys`; several: their latest start);
    ``None`` when the keys of every sequence begin at position 0 as far as the mask says."""
    if mask is None:
        return None
    paddings = (leaf.sequences if isinstance(leaf, _SequenceBand) else leaf
                for leaf in mask.leaves())
    starts = list({id(p.kv_starts): p.kv_starts.reshape(-1) for p in paddings
                   if isinstance(p, _Padding) and p.kv_starts is not None}.values())
    if not starts:
        return None
    first = starts[0]  # every part allows a key: a sequence's keys begin at its latest start
    for other in starts[1:]:
        first = torch.maximum(first, other.to(first.device))
    return first


class KeyRanges(NamedTuple):
    """Each query's allowed keys as one run ``[lo, hi)`` (:func:`key_ranges`): long ``[Bm,
    Tq]`` each, global key positions within ``[0, Tk]`` (``lo ≥ hi``: a row without a key);
    ``exact``: ``None``, or a bool 0-d tensor that must hold for the runs to describe the mask
    (document ids, each one contiguous run), to be read with whatever else the caller reads."""

    lo: torch.Tensor
    hi: torch.Tensor
    exact: Optional[torch.Tensor]


def key_ranges(mask: Optional[Mask], space: MaskSpace) -> Optional[KeyRanges]:
    """``mask`` as each query's one run of allowed keys (:class:`KeyRanges`), from the
    :meth:`~Mask.structure` of every part of its ``&`` chain (bands, lengths, ranges, document
    ids: runs intersect into a run), computed on the device without reading a value; ``None``
    when a part has another form (a bias, a dense or function mask, ``|``, ``~``). Kept on the
    mask while its tensors are unchanged (:func:`memo`): a call's planner and run, and every
    layer of a step that passes the mask, share one."""
    if mask is None or mask.has_bias:
        return None
    return memo(mask, ("key ranges", space), mask_tensors(mask),
                lambda: _key_ranges(mask, space))


def _key_ranges(mask: Mask, space: MaskSpace) -> Optional[KeyRanges]:
    """:func:`key_ranges`, computed."""
    rows = torch.arange(space.q_len, device=space.device)
    lo = torch.zeros(1, space.q_len, dtype=torch.long, device=space.device)
    hi = torch.full_like(lo, space.kv_len)
    exact = None
    for leaf in mask.leaves():
        if isinstance(leaf, _Documents):  # the ranges form, exact when each id is one run
            q_runs, kv_runs, whole = leaf.spans(space)
            exact = whole if exact is None else exact & whole
            form = Structure(ranges=(q_runs, kv_runs))
        elif isinstance(leaf, _Padding):  # its runs, whether or not they start at 0
            q_lo, q_hi, kv_lo, kv_hi = (t[:, None] for t in leaf.runs(space))
            real = (rows >= q_lo) & (rows < q_hi)
            lo, hi = torch.maximum(lo, kv_lo), torch.minimum(hi, torch.where(real, kv_hi, 0))
            continue
        else:
            form = leaf.structure(space)
        if form is None or not (form.diagonals or form.lengths or form.ranges):
            return None
        if form.diagonals is not None:  # lo ≤ k − q ≤ hi
            low, high = form.diagonals
            if low is not None:
                lo = torch.maximum(lo, rows + low)
            if high is not None:
                hi = torch.minimum(hi, rows + high + 1)
        elif form.lengths is not None:  # queries [0, q_len) see keys [0, kv_len); others none
            q_len, kv_len = (None if t is None else t.reshape(-1, 1).to(space.device)
                             for t in form.lengths)
            if kv_len is not None:
                hi = torch.minimum(hi, kv_len)
            if q_len is not None:
                hi = torch.where(rows < q_len, hi, 0)
        else:
            runs = form.ranges[0].to(space.device, torch.long)  # [B, Tq, 2]
            lo, hi = torch.maximum(lo, runs[..., 0]), torch.minimum(hi, runs[..., 1])
    return KeyRanges(lo.clamp(0, space.kv_len), hi.clamp(0, space.kv_len), exact)


def packs_documents(mask: Optional[Mask]) -> bool:
    """Whether ``mask`` (or a part of its ``&`` chain) keeps packed documents apart
    (``documents``, with or without ``causal=``; the per-sequence masks of a packed batch):
    rows of one query block may then see disjoint keys."""
    return mask is not None and any(isinstance(leaf, (_Documents, _CausalDocuments))
                                    for leaf in mask.leaves())


def _self_documents(mask: Mask) -> bool:
    """``documents(ids)`` or ``documents(ids, causal=...)`` with the keys' ids the queries'
    own tensor: queries and keys are the same positions, so the diagonal is allowed."""
    docs = mask.documents if isinstance(mask, _CausalDocuments) else mask
    return isinstance(docs, _Documents) and docs.kv_ids is docs.q_ids


def real_keys(kv_mask: torch.Tensor) -> Mask:
    """The mask of a bool "real key" tensor ``[B, Tk]`` (True = may be attended):
    ``padding(kv_mask=..., allow_empty_rows=True)`` when each row's real keys are one run
    (left or right padding: an analytic block map), else ``dense(kv_mask[:, None, None, :])``;
    always ``dense`` inside a compiled region, where the pattern cannot be read. A row without
    real keys is allowed (a fully padded batch element attends to nothing)."""
    if not torch.compiler.is_compiling():
        try:
            return _Padding(None, None, kv_mask=kv_mask, allow_empty_rows=True)
        except ValueError:  # not one run per row
            pass
    return _Dense(kv_mask[:, None, None, :])


class _Intervals(Mask):
    """A mask in which each query's allowed keys are one run of positions ``[lo, hi)``, and each
    key's allowed queries one run too (a run with ``lo ≥ hi`` is empty). Subclasses give the
    runs (:meth:`_key_runs`, :meth:`_query_runs`) and an analytic :meth:`block_map`; the
    element mask and :meth:`structure` (the ranges form: the triton kernels' and
    :func:`key_ranges`') follow from the runs."""

    def _key_runs(self, q_idx: torch.Tensor, space: MaskSpace) -> tuple[torch.Tensor, torch.Tensor]:
        """The allowed keys ``[lo, hi)`` of the queries at positions ``q_idx`` [tq] → two long
        ``[Bm, tq]``."""
        raise NotImplementedError

    def _query_runs(self, kv_idx: torch.Tensor, space: MaskSpace) -> tuple[torch.Tensor, torch.Tensor]:
        """The allowed queries ``[lo, hi)`` of the keys at positions ``kv_idx`` [tk] → two long
        ``[Bm, tk]``."""
        raise NotImplementedError

    def tile(self, q_idx, kv_idx, space):
        lo, hi = self._key_runs(q_idx, space)  # [Bm, tq]
        kv = kv_idx[None, None, :]
        return ((kv >= lo[:, :, None]) & (kv < hi[:, :, None]))[:, None]  # [Bm, 1, tq, tk]

    def structure(self, space):
        def form(runs, limit):  # clipped to the sequence, an empty run as [0, 0)
            lo, hi = (t.clamp(0, limit) for t in runs)
            empty = lo >= hi
            both = torch.stack([lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)], dim=-1)
            return both.to(torch.int32).expand(space.batch, -1, 2)
        return Structure(ranges=(
            form(self._key_runs(_positions(0, space.q_len, space.device), space), space.kv_len),
            form(self._query_runs(_positions(0, space.kv_len, space.device), space), space.q_len)))


def band_per_sequence(band: Band, sequences: Mask) -> Mask:
    """The band ``band`` (:meth:`Mask.band`'s answer) aligned to each sequence of
    ``sequences``: a :func:`padding` (each batch element's real runs) or :func:`documents`
    (packed sequences in one row), as ``causal(..., sequences=)`` and
    ``sliding_window(..., sequences=)`` build it; the result includes ``sequences``."""
    return _per_sequence(_Band(band.left, band.right, band.align), sequences, "band")


def _per_sequence(band: _Band, sequences, name: str) -> Mask:
    """``band`` aligned to the real runs of the padding mask ``sequences``, or inside each
    document of the ``documents`` mask ``sequences`` (see :func:`causal`)."""
    if isinstance(sequences, _Documents):
        return _CausalDocuments(sequences, band.align, band.left, band.right)
    if not isinstance(sequences, _Padding):
        hint = (": pass the padding object itself, not a combination of masks"
                if isinstance(sequences, _Combined) else "")
        raise TypeError(f"{name}(sequences=...) takes a padding mask, ak.padding(q_lengths=..., "
                        f"kv_lengths=..., q_starts=..., kv_starts=...) or ak.padding(q_mask=..., "
                        f"kv_mask=...), whose runs give each batch element's real tokens, or "
                        f"ak.documents(q_ids, kv_ids) for packed sequences; got "
                        f"{sequences!r}{hint}")
    return _SequenceBand(band.left, band.right, band.align, sequences)


class _SequenceBand(_Intervals):
    """A band aligned to each batch element's own real runs, and inside them: ``sequences`` (a
    :class:`_Padding`) gives element ``b`` its runs ``[q_lo, q_hi)`` and ``[kv_lo, kv_hi)``; a
    real query ``q`` sees a real key ``k`` when ``-left ≤ k - q - shift_b ≤ right``, with
    ``shift_b = kv_lo - q_lo`` (top_left) or ``kv_hi - q_hi`` (bottom_right). ``None`` bounds
    are unbounded."""

    def __init__(self, left: Optional[int], right: Optional[int], align: str, sequences: _Padding):
        self.left, self.right, self.align, self.sequences = left, right, align, sequences

    def cache_key(self, keep):
        part = self.sequences.cache_key(keep)
        return None if part is None else ("sequence_band", self.left, self.right, self.align, part)

    def _min_batch(self):
        return self.sequences._min_batch()

    def _size(self):
        return self.sequences._size()

    def check(self, space):
        return self.sequences.check(space)

    def guard_runs(self, space):
        return self.sequences.guard_runs(space)

    def _aligned(self, space) -> tuple[torch.Tensor, ...]:
        """``(q_lo, q_hi, kv_lo, kv_hi, shift)``: the runs and the shift, long ``[Bm]`` each."""
        def aligned():
            q_lo, q_hi, kv_lo, kv_hi = torch.broadcast_tensors(*self.sequences.runs(space))
            shift = kv_lo - q_lo if self.align == "top_left" else kv_hi - q_hi
            return q_lo, q_hi, kv_lo, kv_hi, shift
        sequences = self.sequences
        return memo(self, ("aligned", space.q_len, space.kv_len, space.device),
                     (sequences.q_lengths, sequences.kv_lengths, sequences.q_starts,
                      sequences.kv_starts), aligned)

    def _key_runs(self, q_idx, space):
        q_lo, q_hi, kv_lo, kv_hi, shift = self._aligned(space)  # [Bm] each
        q = q_idx[None, :]
        diagonal = q + shift[:, None]  # the key at offset 0 from each query: [Bm, tq]
        lo = kv_lo[:, None] if self.left is None else torch.maximum(kv_lo[:, None],
                                                                     diagonal - self.left)
        hi = kv_hi[:, None] if self.right is None else torch.minimum(kv_hi[:, None],
                                                                      diagonal + (self.right + 1))
        real = q < q_hi[:, None]  # [Bm, tq]
        if self.sequences.q_starts is not None:
            real = real & (q >= q_lo[:, None])
        hi = hi.where(real, 0)  # a padded query's run is empty: [lo, 0) with lo ≥ 0
        return lo.expand_as(hi), hi

    def _query_runs(self, kv_idx, space):
        q_lo, q_hi, kv_lo, kv_hi, shift = (t[:, None] for t in self._aligned(space))  # [Bm, 1]
        k = kv_idx[None, :]
        diagonal = k - shift  # the query at offset 0 from each key: [Bm, tk]
        lo = q_lo if self.right is None else torch.maximum(q_lo, diagonal - self.right)
        hi = q_hi if self.left is None else torch.minimum(q_hi, diagonal + self.left + 1)
        real = (k >= kv_lo) & (k < kv_hi)  # [Bm, tk]
        return torch.where(real, lo, 0), torch.where(real, hi, 0)

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)
        q_lo, q_hi, kv_lo, kv_hi, shift = (t[:, None, None] for t in self._aligned(space))  # [Bm, 1, 1]
        b_qlo, b_qhi = (t[:, None]  # [nq, 1]
                        for t in _block_bounds(q_offset, q_count, block_q, space.device))
        b_klo, b_khi = _block_bounds(kv_offset, kv_count, block_k, space.device)  # [nk]
        hi = self.right if self.right is not None else math.inf
        lo = -self.left if self.left is not None else -math.inf
        # Each block clipped to the element's real runs is a rectangle of queries [q0, q1] × keys
        # [k0, k1], over which k - q takes every value in [k0 - q1, k1 - q0]: exact for the band.
        q0, q1 = torch.maximum(b_qlo, q_lo), torch.minimum(b_qhi, q_hi - 1)  # [Bm, nq, 1]
        k0, k1 = torch.maximum(b_klo, kv_lo), torch.minimum(b_khi, kv_hi - 1)  # [Bm, 1, nk]
        any_allowed = ((q0 <= q1) & (k0 <= k1) & (k0 - q1 - shift <= hi)
                       & (k1 - q0 - shift >= lo))  # [Bm, nq, nk]
        all_allowed = ((b_qlo >= q_lo) & (b_qhi < q_hi) & (b_klo >= kv_lo) & (b_khi < kv_hi)
                       & (b_klo - b_qhi - shift >= lo) & (b_khi - b_qlo - shift <= hi))
        return _codes_from_bounds(any_allowed, all_allowed)[:, None]  # [Bm, 1, nq, nk]

    def __repr__(self):
        return _band_call(self.left, self.right, self.align, f"sequences={self.sequences!r}")


def _document_ids(name: str, value) -> torch.Tensor:
    """``value`` as a tensor of integer document ids ``[T]`` or ``[B, T]``; TypeError /
    ValueError naming ``name`` (``q_ids``/``kv_ids``) and the fix for anything else."""
    if isinstance(value, torch.Tensor):
        ids = value
    else:
        if _holds_text(value):
            raise TypeError(f"documents {name} holds strings (str): pass integer document ids, "
                            f"one per position; number the names first, e.g. index = {{name: i for "
                            f"i, name in enumerate(dict.fromkeys(names))}}; ids = [index[name] for "
                            f"name in names]")
        try:
            ids = torch.tensor(value, device="cpu")  # (not as_tensor: see integer_tensor)
        except (TypeError, RuntimeError):
            raise TypeError(f"documents {name}: cannot read {type(value).__name__} as document ids; "
                            f"pass integer ids, one per position (a list of ints or an integer "
                            f"tensor of shape [T] or [B, T])") from None
        except ValueError as error:
            raise ValueError(f"documents {name} cannot be read as [T] or [B, T] ids ({error}): "
                             f"give every row of a batch the same length (pad the shorter rows "
                             f"with an id of their own)") from None
        if ids.numel() == 0:
            ids = ids.to(torch.long)  # an empty list has no dtype (torch.tensor says float)
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"documents {name} has dtype {ids.dtype}: document ids are compared for "
                        f"equality, so they must be integers; pass {name}.long() when the values "
                        f"are whole numbers")
    if ids.dim() not in (1, 2):
        fix = ("a single id: every position is then in one document, which needs no mask (or "
               "pass torch.full((T,), id))" if ids.dim() == 0 else
               "drop the extra dimensions, e.g. ids.reshape(B, T)")
        raise TypeError(f"documents {name} has shape {tuple(ids.shape)} ({ids.dtype}): pass one id "
                        f"per position, shape [T] (shared by the batch) or [B, T]; {fix}")
    return ids


def _holds_text(value) -> bool:
    """Whether ``value`` (a list, tuple or numpy array) holds strings, judged by its first entry."""
    if getattr(getattr(value, "dtype", None), "kind", None) in ("U", "S"):
        return True
    first = value.flat[0] if hasattr(value, "flat") and getattr(value, "size", 0) else value
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    return isinstance(first, (str, bytes))


class _Documents(Mask):
    def __init__(self, q_ids, kv_ids):
        self.q_ids = _document_ids("q_ids", q_ids)
        self.kv_ids = self.q_ids if kv_ids is None else _document_ids("kv_ids", kv_ids)

    def cache_key(self, keep):
        return _tensors_key(self, ("q_ids", "kv_ids"), keep)

    def _min_batch(self):
        return max(self.q_ids.dim() == 2 and self.q_ids.shape[0] or 1,
                   self.kv_ids.dim() == 2 and self.kv_ids.shape[0] or 1)

    def _size(self):
        return self.q_ids.shape[-1], self.kv_ids.shape[-1]

    def check(self, space):
        problems = []
        for name, ids, length in (("q_ids", self.q_ids, space.q_len), ("kv_ids", self.kv_ids, space.kv_len)):
            if ids.shape[-1] != length:
                problems.append(f"documents {name} has shape {tuple(ids.shape)} but the sequence has "
                                f"{length} positions: give one document id per position")
            if ids.dim() == 2 and ids.shape[0] not in (1, space.batch):
                problems.append(f"documents {name} has {ids.shape[0]} rows but the batch has "
                                f"{space.batch}: use shape [T] or [{space.batch}, T]")
        return problems

    def structure(self, space):
        def form():
            q_ranges, kv_ranges, whole = self.spans(space)
            if not bool(whole):
                return Structure(ids=(self.q_ids.to(space.device), self.kv_ids.to(space.device)))
            return Structure(ranges=(q_ranges, kv_ranges))
        return memo(self, ("structure", space.batch, space.device), (self.q_ids, self.kv_ids),
                    form)  # one read per content of the ids

    def spans(self, space) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ranges form (:class:`Structure`) of this mask without reading a value: each
        query's keys and each key's queries of the same id, int32 ``[B, Tq, 2]`` and ``[B, Tk,
        2]``, and a bool 0-d tensor saying whether they describe the mask (every id's positions
        on each side one contiguous run)."""
        q_ids, kv_ids = self.q_ids.to(space.device), self.kv_ids.to(space.device)
        q_ranges, q_whole = _id_ranges(q_ids, kv_ids, space.batch)
        kv_ranges, kv_whole = _id_ranges(kv_ids, q_ids, space.batch)
        return q_ranges, kv_ranges, q_whole & kv_whole

    def _ids(self, ids, idx, space):
        ids = ids.to(space.device)
        return (ids if ids.dim() == 2 else ids[None])[:, idx]  # [Bm, t]

    def tile(self, q_idx, kv_idx, space):
        q_doc, kv_doc = self._ids(self.q_ids, q_idx, space), self._ids(self.kv_ids, kv_idx, space)
        return (q_doc[:, :, None] == kv_doc[:, None, :])[:, None]

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)

        def ranges(ids, offset, count, block):
            part = self._ids(ids, torch.arange(offset, offset + count, device=space.device), space)
            n = math.ceil(count / block)
            pad = n * block - count
            part = part.long()
            bounds = torch.iinfo(part.dtype)  # padding that changes no block's least or greatest
            lo = torch.cat([part, part.new_full((part.shape[0], pad), bounds.max)], 1)
            hi = torch.cat([part, part.new_full((part.shape[0], pad), bounds.min)], 1)
            return (lo.reshape(part.shape[0], n, block).amin(-1),
                    hi.reshape(part.shape[0], n, block).amax(-1))  # [Bm, n] each

        q_min, q_max = ranges(self.q_ids, q_offset, q_count, block_q)
        k_min, k_max = ranges(self.kv_ids, kv_offset, kv_count, block_k)
        # Disjoint id ranges share no document; one shared id on both sides is a full tile.
        any_allowed = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
        all_allowed = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
                       & (q_min[:, :, None] == k_min[:, None, :]))
        return _codes_from_bounds(any_allowed, all_allowed)[:, None]  # [Bm, 1, nq, nk]

    def _arguments(self) -> list[str]:
        """The ids as :func:`documents` takes them: one argument when the sides share them."""
        shown = [_show_ids(self.q_ids)]
        if self.kv_ids is not self.q_ids:
            shown.append(_show_ids(self.kv_ids))
        return shown

    def __repr__(self):
        return f"documents({', '.join(self._arguments())})"


def _show_ids(ids: torch.Tensor) -> str:
    """Document ids as a list when short (16 entries at most), else a summary:
    ``<ids [4096]: 4 documents>``, ``<ids [2, 64]: 2 to 4 documents per row>``."""
    if ids.numel() <= 16 or not readable(ids):
        return _show(ids, short=16)
    counts = [int(row.unique().numel()) for row in ids.reshape(-1, ids.shape[-1])]
    low, high = min(counts), max(counts)
    number = f"{low}" if low == high else f"{low} to {high}"
    plural = "" if high == 1 else "s"
    return f"<ids {list(ids.shape)}: {number} document{plural}{' per row' if ids.dim() == 2 else ''}>"


def _id_spans(own: torch.Tensor, other: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position of ``own`` (long ids ``[T]``), the positions of ``other`` (``[T']``)
    holding its id → ``(lo, hi, whole)`` ``[T]`` each: the first of them and one past the last
    (``0, 0`` where there is none), and whether they are all of ``[lo, hi)`` (bool: the id's
    positions are one contiguous run). On the device, reading no value."""
    zero = torch.zeros_like(own)
    if not other.numel():
        return zero, zero, torch.ones_like(own, dtype=torch.bool)
    ids, order = other.sort(stable=True)  # equal ids in position order
    own = own.contiguous()  # (searchsorted warns on strided values)
    first, stop = torch.searchsorted(ids, own), torch.searchsorted(ids, own, right=True)
    found = stop > first
    lo = torch.where(found, order[first.clamp(max=other.numel() - 1)], zero)
    hi = torch.where(found, order[(stop - 1).clamp(min=0)] + 1, zero)
    return lo, hi, hi - lo == stop - first


def _id_ranges(own: torch.Tensor, other: torch.Tensor, batch: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position of ``own`` (ids ``[T]`` or ``[B, T]``), the positions ``[lo, hi)`` of
    ``other`` that hold the same id (``[0, 0)`` when none do) → int32 ``[B, T, 2]``, and a bool
    0-d tensor: whether each of these ids' positions in ``other`` is one contiguous run (else
    the ranges do not describe the mask). Reads no value."""
    rows = max(own.shape[0] if own.dim() == 2 else 1, other.shape[0] if other.dim() == 2 else 1)
    own, other = (ids.to(torch.int64).reshape(-1, ids.shape[-1]) for ids in (own, other))
    spans, whole = [], []
    for row in range(rows):
        lo, hi, one_run = _id_spans(own[min(row, own.shape[0] - 1)],
                                    other[min(row, other.shape[0] - 1)])
        spans.append(torch.stack([lo, hi], dim=-1))
        whole.append(one_run.all())
    return torch.stack(spans).to(torch.int32).expand(batch, -1, 2), torch.stack(whole).all()


def documents(q_ids, kv_ids=None, causal: Optional[str] = None) -> Mask:
    """Packed sequences: a query attends only to keys of the same document id.

    ``q_ids`` is ``[Tq]`` or ``[B, Tq]`` (integers); ``kv_ids`` (``[Tk]`` or ``[B, Tk]``)
    defaults to ``q_ids``. Combine with :func:`causal` for packed causal training.
    ``documents([0, 0, 1, 1, 1])``::

        ██░░░
        ██░░░
        ░░███
        ░░███
        ░░███

    ``causal``: ``"top_left"`` or ``"bottom_right"``: causal inside each document, whose query
    and key segments may differ in length (cross-attention between packed sequences, a cache
    per packed sequence). With ``i`` / ``j`` a query's / key's offset in its document's segment
    and ``qlen`` / ``kvlen`` the segments' lengths, top-left allows ``j ≤ i``, bottom-right
    ``j − kvlen ≤ i − qlen`` (the segments' last query and last key aligned). Each document's
    positions must be one contiguous run on each side (checked with the inputs). With equal
    ids on both sides, ``documents(ids, causal="top_left")`` is ``documents(ids) & causal()``.
    ``documents([0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], causal=...)``::

        top_left   bottom_right
        █░░░░░░    ██░░░░░
        ██░░░░░    ███░░░░
        ░░░█░░░    ░░░██░░
        ░░░██░░    ░░░███░
        ░░░███░    ░░░████
    """
    docs = _Documents(q_ids, kv_ids)
    if causal is None:
        return docs
    if causal not in ("top_left", "bottom_right"):
        raise ValueError(f"documents causal={causal!r}: use 'top_left' (a document's i-th query "
                         f"sees its first i + 1 keys), 'bottom_right' (its last query sees all its "
                         f"keys) or None (no causal restriction)")
    return _CausalDocuments(docs, causal)


_DOCUMENT_RUNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per :class:`_CausalDocuments` mask: ``(key, runs)``, the runs derived from its ids for the
ids' identity and version (:func:`tensor_key`) and the device in ``key`` (kept outside the mask, so
``digest`` sees only its parameters)."""


def _not_one_run(ids: torch.Tensor, name: str, row: Optional[int], align: str) -> ValueError:
    """The error for ids (long ``[T]``) in which some document has more than one run
    (``name``/``row`` say where); reads the ids."""
    change = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    change[1:] = ids[1:] != ids[:-1]
    run_ids = ids[change].sort().values
    doc = int(run_ids[1:][run_ids[1:] == run_ids[:-1]][0])
    at = (ids == doc).nonzero().flatten().tolist()
    where = name if row is None else f"{name} row {row}"
    return ValueError(
        f"documents(causal={align!r}): document {doc} sits at positions {at[:12]}"
        f"{'...' if len(at) > 12 else ''} of {where}, not one contiguous run; {_ONE_RUN}")


_ONE_RUN = ("causal= aligns each document's query and key segments, so each document's "
            "positions must be contiguous on each side: pack each document's tokens together "
            "(sorted by document), or drop causal= and combine documents(q_ids, kv_ids) with "
            "ak.dense(...) or ak.from_function(...) for this layout")
"""What a document in more than one run breaks, and the fixes."""


def _vmapped(*tensors: torch.Tensor) -> bool:
    """Whether some of ``tensors`` are batched by ``vmap`` over tensors that hold values (not
    traced, meta or fake): :func:`readable` refuses them, and :func:`_batched_values` reads
    every example at once."""
    return (any(map(_is_wrapped, tensors)) and not _fake_mode_active()
            and not any(shapes_only(_batched_values(t)) for t in tensors))


def _batched_values(t: torch.Tensor) -> torch.Tensor:
    """The tensor a ``torch.func`` wrapper ``t`` stands for at every level unwrapped: the
    values of all vmapped examples, batch dims where the wrappers keep them (for a reduction
    over all of them); ``t`` itself when not wrapped."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _not_one_run_vmapped(name: str, align: str) -> ValueError:
    """:func:`_not_one_run` for ids batched by ``vmap`` (``name``: the side)."""
    return ValueError(
        f"documents(causal={align!r}) under torch.func.vmap: in some vmapped example a "
        f"document's positions in {name} are not one contiguous run (the call without vmap "
        f"names them); {_ONE_RUN}")


def _document_runs(q_ids: torch.Tensor, kv_ids: torch.Tensor, align: str,
                   left: Optional[int] = None, right: Optional[int] = 0
                   ) -> tuple[torch.Tensor, ...]:
    """One row of :meth:`_CausalDocuments._runs_per_position` from long ids ``[Tq]``, ``[Tk]``:
    keys ``diagonal − left ≤ j ≤ diagonal + right`` of each query's document (``None``:
    unbounded), and whether each side's documents are one run each (two bool 0-d tensors; the
    runs hold only then). Reads no value."""
    q_start, q_stop, q_whole = _id_spans(q_ids, q_ids)  # each position's own document run
    kv_start, kv_stop, kv_whole = _id_spans(kv_ids, kv_ids)

    def shift(own_start, own_stop, other_start, other_stop):  # key offset - query offset on the diagonal
        return other_start - own_start if align == "top_left" else other_stop - own_stop

    # queries: the keys [lo, hi) of their document, within the band
    lo, hi, _ = _id_spans(q_ids, kv_ids)
    diagonal = torch.arange(q_ids.shape[0], device=q_ids.device) + shift(q_start, q_stop, lo, hi)
    q_lo = lo if left is None else torch.maximum(lo, diagonal - left)
    q_hi = hi if right is None else torch.minimum(hi, diagonal + right + 1)
    empty = (hi <= lo) | (q_hi <= q_lo)
    q_lo, q_hi = q_lo.masked_fill(empty, 0), q_hi.masked_fill(empty, 0)
    # keys: the queries [lo, hi) of their document whose band holds them
    lo, hi, _ = _id_spans(kv_ids, q_ids)
    diagonal = torch.arange(kv_ids.shape[0], device=kv_ids.device) - shift(lo, hi, kv_start,
                                                                           kv_stop)
    kv_lo = lo if right is None else torch.maximum(lo, diagonal - right)
    kv_hi = hi if left is None else torch.minimum(hi, diagonal + left + 1)
    empty = (hi <= lo) | (kv_hi <= kv_lo)
    kv_lo, kv_hi = kv_lo.masked_fill(empty, 0), kv_hi.masked_fill(empty, 0)
    return q_lo, q_hi, kv_lo, kv_hi, q_start, q_whole.all(), kv_whole.all()


class _CausalDocuments(_Intervals):
    """:func:`documents` with ``causal=``, or a band per document (``sliding_window(...,
    sequences=documents(...))``): a query sees the keys of its own document from ``left``
    before the diagonal to ``right`` after it (``None``: unbounded; causal is ``None, 0``),
    the document's query and key segments aligned at their starts (``align`` top_left) or
    ends (bottom_right). Each document's positions are one run on each side."""

    def __init__(self, documents: _Documents, align: str, left: Optional[int] = None,
                 right: Optional[int] = 0):
        self.documents, self.align, self.left, self.right = documents, align, left, right

    def cache_key(self, keep):
        part = self.documents.cache_key(keep)
        return None if part is None else ("causal_documents", self.align, self.left,
                                          self.right, part)

    def _min_batch(self):
        return self.documents._min_batch()

    def _size(self):
        return self.documents._size()

    def check(self, space):
        problems = self.documents.check(space)
        ids = (self.documents.q_ids, self.documents.kv_ids)
        if not problems and (readable(*ids) or _vmapped(*ids)):
            try:
                self._runs_per_position(space.device)
            except ValueError as error:
                problems.append(str(error))
        return problems

    def _runs_per_position(self, device) -> tuple[torch.Tensor, ...]:
        """``(q_lo, q_hi, kv_lo, kv_hi, q_run)``: each query's key run ``[q_lo, q_hi)`` and
        each key's query run ``[kv_lo, kv_hi)`` (long ``[Bm, Tq]`` and ``[Bm, Tk]``, an empty run
        as ``[0, 0)``), and where each query's document run starts ``[Bm, Tq]``; derived from
        the ids once per content of the ids and device. ValueError when a document is not
        one run on each side."""
        q_ids, kv_ids = self.documents.q_ids, self.documents.kv_ids
        key = None  # traced: nothing kept (no value exists); a checkpoint's recompute must
        if not torch.compiler.is_compiling() and keeping():  # run what its forward ran
            ids_key = self.documents.cache_key([])  # the mask holds the ids: no keep list
            key = None if ids_key is None else (ids_key, str(device))
        cached = None if key is None else _DOCUMENT_RUNS.get(self)
        if cached is not None and cached[0] == key:
            return cached[1]
        q2, kv2 = (ids.long() if ids.dim() == 2 else ids.long()[None] for ids in (q_ids, kv_ids))
        rows = max(q2.shape[0], kv2.shape[0])
        per_row = [_document_runs(q2[min(r, q2.shape[0] - 1)], kv2[min(r, kv2.shape[0] - 1)],
                                  self.align, self.left, self.right) for r in range(rows)]
        if not per_row:  # no batch element
            return tuple(torch.zeros(0, n, dtype=torch.long, device=device) for n in (
                q2.shape[1], q2.shape[1], kv2.shape[1], kv2.shape[1], q2.shape[1]))
        *runs, q_whole, kv_whole = (torch.stack(parts) for parts in zip(*per_row))
        if _vmapped(q_ids, kv_ids):  # one read of every example's rows at once
            for name, whole in (("q_ids", q_whole), ("kv_ids", kv_whole)):
                if not bool(_batched_values(whole).all()):
                    raise _not_one_run_vmapped(name, self.align)
        elif readable(q_ids, kv_ids) and not bool(torch.cat([q_whole, kv_whole]).all()):
            # (one read for every row and side; none where no value exists: traced, fake)
            name, ids, whole = (("q_ids", q2, q_whole) if not bool(q_whole.all())
                                else ("kv_ids", kv2, kv_whole))
            row = int((~whole).nonzero()[0])
            raise _not_one_run(ids[min(row, ids.shape[0] - 1)], name,
                               row if (q_ids if name == "q_ids" else kv_ids).dim() == 2 else None,
                               self.align)
        runs = tuple(t.to(device) for t in runs)
        if key is not None:
            _DOCUMENT_RUNS[self] = (key, runs)
        return runs

    def _key_runs(self, q_idx, space):
        q_lo, q_hi = self._runs_per_position(space.device)[:2]
        return q_lo[:, q_idx], q_hi[:, q_idx]

    def _query_runs(self, kv_idx, space):
        kv_lo, kv_hi = self._runs_per_position(space.device)[2:4]
        return kv_lo[:, kv_idx], kv_hi[:, kv_idx]

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count, kv_count = _counts(space, q_offset, q_count, kv_offset, kv_count)
        q_lo, q_hi, _, _, q_run = (t[:, q_offset:q_offset + q_count]
                                   for t in self._runs_per_position(space.device))  # [Bm, n]
        rows, nq = q_lo.shape[0], math.ceil(q_count / block_q)
        k_first, k_last = _block_bounds(kv_offset, kv_count, block_k, space.device)  # [nk]
        # Within one document's queries both ends of the key runs never fall (a band slides
        # with the diagonal), and the non-empty runs of consecutive queries touch. So in each
        # piece of a query block that lies in one document, the keys some query sees are one
        # run [least start, greatest stop) of its non-empty runs, and the keys every query sees
        # are [greatest start, least stop): O(pieces · key blocks), fewer than nq + documents
        # pieces.
        block = torch.arange(q_count, device=space.device) // block_q  # [n]
        starts = torch.ones_like(q_run, dtype=torch.bool)  # [Bm, n]: a piece begins here
        starts[:, 1:] = (q_run[:, 1:] != q_run[:, :-1]) | (block[1:] != block[:-1])
        piece = starts.flatten().cumsum(0) - 1  # each position's piece (pieces never span rows)
        count = piece.shape[0]  # room for a piece per position: their number is not read
        lo, hi = q_lo.flatten(), q_hi.flatten()
        seen = hi > lo
        far = torch.iinfo(lo.dtype).max

        def reduce(values, how, start):
            return torch.full((count,), start, dtype=lo.dtype, device=lo.device).scatter_reduce(
                0, piece, values, how)
        some_lo = reduce(lo.masked_fill(~seen, far), "amin", far)[:, None]  # [P, 1]
        some_hi = reduce(hi.masked_fill(~seen, 0), "amax", 0)[:, None]
        every_lo, every_hi = reduce(lo, "amax", 0)[:, None], reduce(hi, "amin", far)[:, None]
        # [P]: the (row, query block) of each piece (0 for the room no piece uses: its
        # extremes hold nowhere)
        position = torch.arange(count, device=space.device)
        slot = torch.zeros_like(piece).scatter_(
            0, piece, position // q_count * nq + block[position % q_count])

        def per_block(holds):  # count, per (row, query block, key block), pieces where holds
            counts = torch.zeros(rows * nq, k_first.shape[0], dtype=torch.int32, device=space.device)
            counts.index_add_(0, slot, holds.to(torch.int32))
            return counts.view(rows, nq, -1)  # [Bm, nq, nk]

        any_allowed = per_block((some_lo <= k_last) & (some_hi > k_first)) > 0
        all_allowed = per_block((every_lo > k_first) | (every_hi <= k_last)) == 0
        return _codes_from_bounds(any_allowed, all_allowed)[:, None]  # [Bm, 1, nq, nk]

    def __repr__(self):
        if self.left is None and self.right == 0:
            return f"documents({', '.join(self.documents._arguments())}, causal={self.align!r})"
        return _band_call(self.left, self.right, self.align, f"sequences={self.documents!r}")


def _fit_tensor(t: torch.Tensor, q_idx, kv_idx, space) -> torch.Tensor:
    """Index a [..., Tq, Tk]-broadcastable tensor at global positions → [Bm, Hm, tq, tk]."""
    t = _as_4d(t.to(space.device))
    if t.shape[-2] != 1:
        t = t.index_select(-2, q_idx)
    if t.shape[-1] != 1:
        t = t.index_select(-1, kv_idx)
    return t.expand(*t.shape[:2], q_idx.shape[0], kv_idx.shape[0])


def _fit_problems(kind: str, t: torch.Tensor, space: MaskSpace) -> list[str]:
    shape = tuple(t.shape)
    target = (space.batch, space.heads, space.q_len, space.kv_len)
    if t.dim() > 4 or any(s not in (1, full) for s, full in zip(shape[::-1], target[::-1])):
        return [f"{kind} mask of shape {shape} does not broadcast to [B, H, Tq, Tk] = "
                f"{list(target)}: each dimension must equal the target's or be 1"]
    return []


def _tensor_size(t: torch.Tensor) -> tuple[Optional[int], Optional[int]]:
    """``(Tq, Tk)`` of a tensor laid over the scores ``[..., Tq|1, Tk|1]`` (``None`` for 1)."""
    q_len = t.shape[-2] if t.dim() >= 2 and t.shape[-2] != 1 else None
    kv_len = t.shape[-1] if t.dim() >= 1 and t.shape[-1] != 1 else None
    return q_len, kv_len


class _Dense(Mask):
    def __init__(self, allowed: torch.Tensor):
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"dense() takes a bool tensor (True = may attend), got "
                            f"{getattr(allowed, 'dtype', type(allowed).__name__)}; "
                            f"for an additive float mask use attnkit.bias()")
        self.allowed = allowed

    def _min_batch(self):
        return self.allowed.shape[0] if self.allowed.dim() == 4 else 1

    def _size(self):
        return _tensor_size(self.allowed)

    def map_score_tensors(self, fn):
        return _Dense(fn(self.allowed, False))

    def check(self, space):
        return _fit_problems("dense", self.allowed, space)

    def tile(self, q_idx, kv_idx, space):
        return _fit_tensor(self.allowed, q_idx, kv_idx, space)

    def __repr__(self):
        return f"dense({tensor_summary(self.allowed)})"


def dense(allowed: torch.Tensor) -> Mask:
    """A bool tensor broadcastable to ``[B, H, Tq, Tk]``; True = may attend (as torch SDPA)."""
    return _Dense(allowed)


class _Bias(Mask):
    has_bias = True

    def __init__(self, values: torch.Tensor):
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            raise TypeError(f"bias() takes a float tensor added to the scores, got "
                            f"{getattr(values, 'dtype', type(values).__name__)}; for a bool mask "
                            f"use attnkit.dense()")
        self.values = values

    def _min_batch(self):
        return self.values.shape[0] if self.values.dim() == 4 else 1

    def _size(self):
        return _tensor_size(self.values)

    def map_score_tensors(self, fn):
        return _Bias(fn(self.values, True))

    def structure(self, space):
        return Structure(bias=self.values)

    def check(self, space):
        return _fit_problems("bias", self.values, space)

    def biases(self):
        return [self.values]

    def tile(self, q_idx, kv_idx, space):
        # -inf entries mean "masked", so fully masked rows follow the contract (output 0).
        return ~torch.isneginf(_fit_tensor(self.values, q_idx, kv_idx, space))

    def tile_bias(self, q_idx, kv_idx, space):
        values = _fit_tensor(self.values, q_idx, kv_idx, space)
        return torch.where(torch.isneginf(values), torch.zeros((), dtype=values.dtype,
                                                                device=values.device), values)

    def __repr__(self):
        return f"bias({tensor_summary(self.values)})"


def bias(values: torch.Tensor) -> Mask:
    """An additive float bias broadcastable to ``[B, H, Tq, Tk]`` (ALiBi, relative positions, …),
    added to the scaled scores before the softmax. ``-inf`` entries are masked positions."""
    return _Bias(values)


def check_arity(fn: Callable, entry: str, arguments: str, other: str) -> None:
    """A ``TypeError`` naming ``entry`` where ``fn`` cannot take ``arguments`` (its names,
    comma-separated) positionally, with the call ``other`` that takes the other kind of
    function (a mask function and a score function differ by the leading ``score``);
    nothing where Python cannot tell (a builtin without a signature) or while a compiler
    traces (dynamo cannot trace ``inspect.signature``; a wrong function fails when called)."""
    if torch.compiler.is_compiling():
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    names = arguments.split(", ")
    try:
        signature.bind(*names)
    except TypeError:
        raise TypeError(f"{entry}() takes fn({arguments}); {getattr(fn, '__name__', fn)!s} takes "
                        f"{signature}: {other}") from None


class _Function(Mask):
    runs_code = True

    def __init__(self, fn: Callable, name: Optional[str]):
        if not callable(fn):
            raise TypeError(f"from_function() takes a callable fn(b, h, q_idx, kv_idx) -> bool tensor, "
                            f"got {type(fn).__name__}")
        check_arity(fn, "from_function", "b, h, q_idx, kv_idx",
                    "a score function fn(score, b, h, q_idx, kv_idx) (FlexAttention's score_mod) "
                    "goes to ak.score_function")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "fn")

    def tile(self, q_idx, kv_idx, space):
        b = torch.arange(space.batch, device=space.device)[:, None, None, None]
        h = torch.arange(space.heads, device=space.device)[None, :, None, None]
        out = self.fn(b, h, q_idx[None, None, :, None], kv_idx[None, None, None, :])
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(f"from_function({self.name}) must return a bool tensor, got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        target = (space.batch, space.heads, q_idx.shape[0], kv_idx.shape[0])
        if out.dim() not in (0, 4) or any(s not in (1, t) for s, t in zip(out.shape, target)):
            raise ValueError(
                f"from_function({self.name}) returned shape {tuple(out.shape)}; it must broadcast "
                f"the index tensors b [B,1,1,1], h [1,H,1,1], q_idx [1,1,tq,1], kv_idx [1,1,1,tk] to "
                f"[B|1, H|1, tq, tk] = {list(target)}: combine q_idx and kv_idx (e.g. "
                f"q_idx >= kv_idx), not one of them alone")
        out = _as_4d(out)
        return out.expand(out.shape[0], out.shape[1], q_idx.shape[0], kv_idx.shape[0])

    def __repr__(self):
        return f"from_function({self.name})"


def from_function(fn: Callable, name: Optional[str] = None) -> Mask:
    """A mask from ``fn(b, h, q_idx, kv_idx) -> bool``, evaluated on broadcast index tensors
    (``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,tq,1]``, ``kv_idx [1,1,1,tk]``), like
    FlexAttention's ``mask_mod``. Its block map is found by evaluating it once. With more
    than one batch dim (``[B1, B2, H, T, D]`` inputs), ``b`` counts the flattened batch
    (``b = b1 · B2 + b2``). ``pickle`` and ``torch.save`` (DataLoader workers, checkpoints)
    save ``fn`` by its name: a lambda or a function defined inside another cannot be
    pickled there (``PicklingError`` or ``AttributeError``); define ``fn`` at module level."""
    return _Function(fn, name)


class _Combined(Mask):
    def __init__(self, *parts: Mask):
        self.parts = parts
        self.has_bias = any(p.has_bias for p in parts)
        self.modifies = any(p.modifies for p in parts)

    def _min_batch(self):
        return max(p._min_batch() for p in self.parts)

    def _size(self):
        sizes = [p._size() for p in self.parts]
        return (next((q for q, _ in sizes if q is not None), None),
                next((k for _, k in sizes if k is not None), None))

    def check(self, space):
        return [problem for p in self.parts for problem in p.check(space)]

    def biases(self):
        return [t for p in self.parts for t in p.biases()]

    def cache_key(self, keep):
        parts = [part.cache_key(keep) for part in self.parts]
        return None if any(p is None for p in parts) else (type(self).__name__, *parts)

    def map_score_tensors(self, fn):
        parts = [p.map_score_tensors(fn) for p in self.parts]
        if all(mapped is part for mapped, part in zip(parts, self.parts)):
            return self  # no tensor part to map: this node, unchanged
        return type(self)(*parts)  # a new node: the caller's mask may be reused in later calls


class _And(_Combined):
    def leaves(self):
        return [leaf for part in self.parts for leaf in part.leaves()]

    def band(self):
        """The intersection of bands of one alignment (``causal("bottom_right") &
        sliding_window(w, align="bottom_right")``) is one band; anything else is not."""
        bands = [part.band() for part in self.parts]
        if any(b is None for b in bands) or len({b.align for b in bands}) != 1:
            return None
        def least(values):  # None: unbounded
            bounded = [v for v in values if v is not None]
            return min(bounded) if bounded else None
        return Band(least(b.left for b in bands), least(b.right for b in bands), bands[0].align)

    def structure(self, space):
        """An ``&`` of bands is the one band it makes (:meth:`band`); any other chain has no
        structure of its own (its leaves do)."""
        band = self.band()
        return None if band is None else _Band(*band).structure(space)

    def simplified(self, space):
        parts = [p.simplified(space) for p in self.parts]
        if all(new is old for new, old in zip(parts, self.parts)):
            return self
        kept = [p for p in parts if p is not None]
        return None if not kept else kept[0] if len(kept) == 1 else _And(*kept)

    def tile(self, q_idx, kv_idx, space):
        a, b = (p.tile(q_idx, kv_idx, space) for p in self.parts)
        return a & b

    def guard_runs(self, space):
        parts = [p.guard_runs(space) for p in self.parts]

        def both(side):  # positions real for every part that has runs on this side
            runs = [r for r in (getattr(p, side) for p in parts) if r is not None]
            if not runs:
                return None
            lo, hi = runs[0]
            for other_lo, other_hi in runs[1:]:
                lo, hi = torch.maximum(lo, other_lo), torch.minimum(hi, other_hi)
            return lo, hi
        return GuardRuns(both("q"), both("kv"))

    def tile_bias(self, q_idx, kv_idx, space):
        biases = [b for b in (p.tile_bias(q_idx, kv_idx, space) for p in self.parts) if b is not None]
        if not biases:
            return None
        return biases[0] if len(biases) == 1 else biases[0] + biases[1]

    def block_map(self, block_q, block_k, space, **where):
        a, b = (p.block_map(block_q, block_k, space, **where) for p in self.parts)
        codes = torch.minimum(a, b)  # EMPTY < PARTIAL < FULL
        if self.has_bias:
            codes = torch.clamp(codes, max=PARTIAL)
        return codes

    def __repr__(self):
        return " & ".join(_operand(part, _And) for part in self.parts)


class _Or(_Combined):
    def __init__(self, *parts):
        super().__init__(*parts)
        if self.has_bias:
            raise TypeError("a bias mask can only be combined with &: '|' has no meaning for "
                            "additive biases")
        if self.modifies:
            raise TypeError(f"a score modifier ({_modifier_in(parts)!r}) can only be combined "
                            f"with &: '|' has no meaning for a change of the scores")

    def tile(self, q_idx, kv_idx, space):
        a, b = (p.tile(q_idx, kv_idx, space) for p in self.parts)
        return a | b

    def block_map(self, block_q, block_k, space, **where):
        a, b = (p.block_map(block_q, block_k, space, **where) for p in self.parts)
        return torch.maximum(a, b)

    def __repr__(self):
        return " | ".join(_operand(part, _Or) for part in self.parts)


class _Not(_Combined):
    def __init__(self, part):
        super().__init__(part)
        if self.has_bias:
            raise TypeError("a bias mask cannot be inverted with ~: it is additive, not boolean")
        if self.modifies:
            raise TypeError(f"a score modifier ({_modifier_in([part])!r}) cannot be inverted "
                            f"with ~: it changes scores, it does not choose keys")

    def tile(self, q_idx, kv_idx, space):
        return ~self.parts[0].tile(q_idx, kv_idx, space)

    def block_map(self, block_q, block_k, space, **where):
        return (FULL - self.parts[0].block_map(block_q, block_k, space, **where)).to(torch.int8)

    def __repr__(self):
        return f"~{_operand(self.parts[0], _Not)}"


def _operand(part: Mask, within: type) -> str:
    """``repr(part)`` as an operand of a ``within`` node: bracketed when it is a combination
    of another kind (``(a | b) & c``, ``~(a & b)``), so the text reads as the expression."""
    text = repr(part)
    if isinstance(part, (_And, _Or)) and not (within is not _Not and isinstance(part, within)):
        return f"({text})"
    return text


def _modifier_in(parts) -> Mask:
    """The first score modifier among the leaves of ``parts`` (for error messages)."""
    return next(leaf for part in parts for leaf in part.leaves() if leaf.modifies)


def as_mask(mask) -> Optional[Mask]:
    """``None``/Mask pass through; a bool tensor becomes :func:`dense`, a float one :func:`bias`."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return dense(mask) if mask.dtype == torch.bool else bias(mask) if mask.is_floating_point() else _bad_mask(mask)
    return _bad_mask(mask)


def _bad_mask(mask):
    if type(mask).__name__ == "BlockMask" and hasattr(mask, "mask_mod"):
        raise TypeError("mask is a FlexAttention BlockMask: pass its function as "
                        "`mask=ak.from_function(block_mask.mask_mod)` (attnkit finds the blocks "
                        "to skip itself)")
    if callable(mask) and not isinstance(mask, torch.Tensor):
        raise TypeError(_uncalled_mask(mask))
    raise TypeError(f"mask must be an attnkit mask, a bool tensor (True = may attend) or a float "
                    f"bias tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")


def _uncalled_mask(mask) -> str:
    """What to say about a callable passed as the mask: an attnkit factory to call, or a
    function to wrap."""
    module = getattr(mask, "__module__", None)
    name = getattr(mask, "__name__", "")
    if module in ("attnkit.masks", "attnkit.modifiers") and not name.startswith("_"):
        import attnkit
        where = "ak" if getattr(attnkit, name, None) is mask else "ak." + module.split(".")[1]
        required = any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                       for p in inspect.signature(mask).parameters.values())
        kind = "class" if isinstance(mask, type) else "function"
        return (f"mask is the {kind} `{where}.{name}` itself, not a mask: call it: "
                f"`mask={where}.{name}({'...' if required else ''})`")
    return (f"mask is a {type(mask).__name__} ({name or mask!r}), not a mask: wrap a "
            f"mask function fn(b, h, q_idx, kv_idx) -> bool as `ak.from_function(fn)`, a score "
            f"function fn(score, b, h, q_idx, kv_idx) -> score as `ak.score_function(fn)`")


# ---- caching what is derived from a mask ----------------------------------------------------
KEY_BYTES = 1 << 22
"""The largest inference tensor (in bytes) whose content :func:`tensor_key` reads: 4 MiB, e.g.
document ids of 512K tokens; a larger one's derived values are not cached."""


_UNKEYED = threading.local()
"""``on`` inside :func:`unkeyed`, per thread."""


@contextlib.contextmanager
def unkeyed() -> Iterator[None]:
    """Inside, no tensor is keyed by identity and version counter (:func:`tensor_key`: CPU
    tensors by their content, others not at all, so nothing derived from them is cached
    across calls). For the compiled operators, whose tensors may be buffers inductor reuses,
    rewritten by its kernels with the same identity and version counter."""
    with setting(_UNKEYED, "on", True, False):
        yield


def tensor_key(t: torch.Tensor, keep: list) -> Optional[tuple]:
    """A tensor for a cache key: its identity, layout and version counter, or ``None`` when it
    cannot be keyed (what is derived from it is then not cached). No value is read: keying a
    call costs no host read (no device sync, and CUDA-graph capture stays possible). Inside
    :func:`unkeyed`, a CPU tensor is keyed by its content, as an inference tensor is (a read
    without a device sync), and any other is not keyed.

    The version counter counts every in-place write made through torch (``t[i] = x``,
    ``t.add_``, ``t.copy_``), so a plan or validation derived from the old values is made
    again. A write torch does not see (through memory shared with numpy, through ``.data``,
    by a foreign kernel) is not seen here either (nor by a new mask over the same tensor,
    which keys alike): call ``torch.autograd.graph.increment_version(t)`` after one, or pass
    a new tensor. Identity too: a
    cached value may hold the tensor itself, so only the same tensor hits; ``t`` is appended
    to ``keep``, which the cache holds, so its id is not reused while the entry lives.

    Inference tensors (made under ``torch.inference_mode``) have no version counter: their
    content is read instead (bytes up to 256, else a blake2b digest), up to
    :data:`KEY_BYTES`. ``None``: a larger inference tensor, a sparse tensor, a ``torch.func`` wrapper, a meta
    or fake tensor (no storage to identify), a tensor subclass."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta"
            or t.layout is not torch.strided  # sparse: validation refuses it
            or torch._C._functorch.is_functorch_wrapped_tensor(t)):
        return None
    unkeyed = getattr(_UNKEYED, "on", False)
    layout = (id(t), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    if not (t.is_inference() or unkeyed):
        keep.append(t)
        return (*layout, "version", t._version)
    if (unkeyed and t.device.type != "cpu") or t.numel() * t.element_size() > KEY_BYTES:
        return None
    keep.append(t)
    return (*layout, content_key(t))


def content_key(t: torch.Tensor) -> bytes:
    """``t``'s values as a key (a host read): its bytes up to 256 of them (lengths, slopes,
    short ids), else their blake2b digest; for tensors without a version counter (inference
    tensors)."""
    values = t.detach() if t.device.type == "cpu" else t.detach().to("cpu")
    try:
        data = values.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16): its bytes
        data = values.contiguous().reshape(-1).view(torch.uint8).numpy()
    if data.nbytes <= 256:
        return data.tobytes()
    return hashlib.blake2b(np.ascontiguousarray(data), digest_size=16).digest()


def cache_key(mask: Optional[Mask], keep: list) -> Optional[tuple]:
    """``mask.cache_key(keep)`` (:meth:`Mask.cache_key`); ``()`` for no mask."""
    return () if mask is None else mask.cache_key(keep)


def validation_key(mask: Mask, keep: list, q_len: int, kv_len: int,
                   ) -> tuple[Optional[tuple], bool]:
    """``(key, by_shape)``: the key under which validating ``mask`` gives the same answer.
    Two paddings validate from shapes alone, so their key names shapes, not tensors, and
    ``by_shape`` is True (a call cache hit must then run on the call's own mask): a vouched
    padding (:func:`vouched_padding`, which a decoding step makes anew every layer and step),
    and one whose runs were all read from ``[B, T]`` masks on the host (:func:`real_keys`:
    transformers' padding, a new mask every step), checked when read. The key of the latter
    also holds whether its widths are the call's ``q_len`` and ``kv_len``, and what a
    backend's choice reads of its values (whether some run starts past 0, whether every row
    has a key). Any other mask: :meth:`Mask.cache_key`, ``by_shape`` False. Plans derived
    from a mask's values (block lists, run masks) never use this key."""
    if isinstance(mask, _Padding) and mask.vouched:
        return ("vouched", *_layouts(mask.q_lengths, mask.kv_lengths)), True
    if isinstance(mask, _Padding) and mask.runs_read():
        return ("read runs", mask.q_width in (None, q_len), mask.kv_width in (None, kv_len),
                mask.has_starts(), mask.keys_everywhere,
                *_layouts(mask.q_starts, mask.q_lengths, mask.kv_starts, mask.kv_lengths)), True
    return mask.cache_key(keep), False


def _layouts(*tensors) -> tuple:
    """Each tensor's shape, dtype and device (``None`` for ``None``): a key by layout."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)


def _tensors_key(mask: Mask, names: tuple[str, ...], keep: list) -> Optional[tuple]:
    """The key of a mask described by its tensor fields ``names`` (``None`` fields allowed)."""
    keys = [None if getattr(mask, name) is None else tensor_key(getattr(mask, name), keep)
            for name in names]
    if any(key is None and getattr(mask, name) is not None for key, name in zip(keys, names)):
        return None
    return (type(mask).__name__, *keys)


class MaskCache:
    """A small LRU of values derived from a mask and shapes (block lists, tile plans), so a
    training loop that reuses one mask pays for its block map once, as FlexAttention's
    ``create_block_mask`` is paid once. Masks that cannot be keyed are never cached, nor
    anything under a dispatch mode (:func:`keeping`)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # guards _entries; build() runs outside it

    def get(self, mask: Optional[Mask], extra: tuple, build: Callable[[], object]):
        """The cached value for ``(mask, extra)``, or ``build()`` (stored when cacheable)."""
        keep: list = []
        key = cache_key(mask, keep) if keeping() else None
        if key is None:
            return build()
        key = (key, extra)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = build()  # unlocked: two threads may build one value; both results are equal
        with self._lock:
            self._entries[key] = (value, keep)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value


def digest(mask: Optional[Mask]) -> str:
    """A short hex digest of ``mask``'s content: its kind, parameters and the values of its
    tensors (not their identity), so two masks built separately with equal contents agree and
    masks of one shape but different values (document ids, lengths, biases) do not. A
    ``from_function`` mask is described by its function's qualified name (its values cannot be
    read without evaluating it). Used to check that ranks of a process group pass one mask."""
    import hashlib

    h = hashlib.sha256()

    def feed(obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            h.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, Mask):
            h.update(type(obj).__name__.encode())
            fields = mask_fields(obj)
            for name in sorted(fields):
                h.update(name.encode())
                feed(fields[name])
        elif isinstance(obj, (tuple, list)):
            h.update(f"seq{len(obj)}".encode())
            for item in obj:
                feed(item)
        elif callable(obj):
            h.update(f"fn{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}".encode())
        else:
            h.update(repr(obj).encode())

    feed(mask)
    return h.hexdigest()[:16]
