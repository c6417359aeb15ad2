"""Attention layers built on :func:`attnkit.attention`.

- :class:`MultiHeadAttention`: multi-head attention (batch first by default) with separate q/k/v/out
  projections, grouped-query attention (``num_kv_heads``), cross-attention (``kdim``/``vdim``),
  any attnkit mask, a key-padding mask, per-head weights and a :class:`KVCache` for
  incremental decoding. :meth:`MultiHeadAttention.from_torch` copies a
  ``torch.nn.MultiheadAttention`` and reproduces its outputs.
- :class:`AdditiveAttention`: Bahdanau's additive score ``vᵀ tanh(W_q q + W_k k)``.

Mask conventions are attnkit's everywhere: **True = may attend**. PyTorch's
``nn.MultiheadAttention`` uses the opposite for its bool ``attn_mask`` and
``key_padding_mask`` (True = ignore), so a mask written for torch is passed here as ``~mask``.

Shapes (E = embed_dim, H = num_heads, Hkv = num_kv_heads, D = E // H)::

    query [B, Tq, E]   key [B, Tk, kdim]   value [B, Tk, vdim]     (or unbatched [T, ·])
    out   [B, Tq, E]   weights [B, H, Tq, Tk]   cache.keys / cache.values [B, Hkv, T, D]

(``batch_first=False``: query, key, value and out ``[T, B, ·]``, the rest as above.)
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, finite, invariance, masks
from .api import attention
from .backends.tiled.forward import KV_SPLIT, kernel_call
from .backends.tiled.plan import INVARIANT_MAX_HEAD_DIM, rows_anywhere
from .backends.torch_sdpa import context_refusal, sdpa_call
from .finite import zero_outside
from .inputs import LazyText, refuse_jit_trace
from .masks import (DENSE_MAX_SCORES, Mask, MaskSpace, as_mask, causal, keys_below, padding,
                    readable, real_keys, sliding_window, vouched_padding, wrapped_eagerly)
from .numerics import accum_dtype, additive_mask, grouped, masked_softmax, ungrouped
from .modifiers import split
from .paged import PagedKVCache

if TYPE_CHECKING:  # torch.distributed loads only when sequence parallelism is used
    from .distributed.parallel import SequenceParallel

__all__ = ["KVCache", "PagedKVCache", "MultiHeadAttention", "MHAOutput", "AdditiveAttention"]

MaskLike = Union[Mask, torch.Tensor, None]


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------
class MHAOutput(NamedTuple):
    """What :meth:`MultiHeadAttention.forward` returns: ``out [B, Tq, E]``, ``weights
    [B, H, Tq, Tk]`` (``None`` unless ``need_weights``) and the extended ``cache`` (``None``
    when the call had none)."""

    out: torch.Tensor
    weights: Optional[torch.Tensor]
    cache: Union[KVCache, PagedKVCache, None]


class _Store:
    """The buffers a chain of caches writes into: ``keys``/``values [B, Hkv, capacity, D]`` and
    the ``generation`` of the latest cache of the chain (each cache written into the store
    numbers one more). Only that cache is extended in place, and only past each sequence's own
    length, where no cache of the chain holds a real position (older caches may show those
    slots as padding). Any other cache is extended into a copy, so no real position of a cache
    ever changes, however many branches grow from one cache (beam search).
    """

    def __init__(self, like_keys: torch.Tensor, like_values: torch.Tensor, capacity: int):
        batch, heads, _, _ = like_keys.shape
        # zeros: a ragged batch leaves slots unwritten, and the cache's masks vouch that no
        # garbage lies past a sequence's length (no guard copies K/V: docs/NUMERICS.md)
        self.keys = like_keys.new_zeros(batch, heads, capacity, like_keys.shape[-1])
        self.values = like_values.new_zeros(batch, heads, capacity, like_values.shape[-1])
        self.generation = 0
        # read by a query that requires grad: autograd holds views of it (an attention's
        # saved keys), so later appends copy (as for a store whose keys require grad)
        self.graphed = False
        # whether the buffers are inference tensors (torch refuses writes into them outside
        # inference mode); None where a compiled region made them: dynamo sees neither
        # inference mode nor inference tensors, and they are ones when the graph runs under
        # inference mode
        self.inference: Optional[bool] = (None if torch.compiler.is_compiling()
                                          else self.keys.is_inference())
        # (what _checked remembers of the lengths the last append validated, those lengths
        # as a long tensor on the device)
        self.checked: Optional[tuple] = None
        self._whole: dict[int, torch.Tensor] = {}
        self._positions: Optional[torch.Tensor] = None
        self._bias_values: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __setstate__(self, state: dict) -> None:
        """Unpickled or deep-copied: :attr:`inference` as the buffers are made again (under
        ``inference_mode`` or not), not as they were."""
        self.__dict__.update(state)
        self.inference = self.keys.is_inference()

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def whole(self, new: int) -> torch.Tensor:
        """Long ``[B]`` filled with ``new``: the ``appended`` of a step whose ``new``
        positions are all real, made once per store (never written in place)."""
        counts = self._whole.get(new)
        if counts is None:
            counts = self._whole[new] = torch.full(self.keys.shape[:1], new, dtype=torch.long,
                                                   device=self.keys.device)
        return counts

    def positions(self, count: int) -> torch.Tensor:
        """Long ``[1, 1, 1, count]``: the store's first ``count`` positions, made once."""
        if self._positions is None:
            self._positions = torch.arange(self.capacity, device=self.keys.device).view(1, 1, 1, -1)
        return self._positions[..., :count]

    def key_bias(self, lengths: Union[torch.Tensor, int], kv_len: int) -> torch.Tensor:
        """Additive ``[B|1, 1, 1, kv_len]`` in the store's dtype: 0 where position j of
        sequence b is real, ``j < lengths[b]`` (``lengths`` an int: the same for every
        sequence), −inf elsewhere (:func:`~attnkit.masks.keys_below`'s keys, as
        :func:`~attnkit.numerics.additive_mask` gives them). One comparison against the
        store's positions and one ``where`` from values made once: torch's kernel would turn a
        bool mask into this on every call."""
        if self._bias_values is None:
            dtype, device = self.keys.dtype, self.keys.device
            self._bias_values = (torch.zeros((), dtype=dtype, device=device),
                                 torch.tensor(float("-inf"), dtype=dtype, device=device))
        bound = lengths if isinstance(lengths, int) else lengths.view(-1, 1, 1, 1)
        return torch.where(self.positions(kv_len) < bound, *self._bias_values)


def _same(checked: tuple, seen: tuple) -> bool:
    """Whether two :func:`_checked` records name the same tensor, unchanged (its identity:
    a copied store's record holds a copy, which must not be compared by value)."""
    return checked[:3] == seen[:3] and checked[3] is seen[3]


_CLAIMS = threading.Lock()
"""Held while a cache claims its store for an append (:func:`_claimed`)."""


def _claimed(store: _Store, generation: int, needed: int) -> bool:
    """Whether the cache of ``generation`` may append in place into ``store`` (it is the
    latest of its chain and the store holds ``needed`` positions), and if so, that claim
    made: the store's generation moves on at once, so of several threads extending one
    cache (a shared prompt), one writes in place and the others copy."""
    def claim() -> bool:
        # two comparisons, not `!=`: compiled with dynamic shapes, dynamo turns an
        # inequality of two symbolic ints into a replacement of one by the other, which
        # inductor's generated code then leaves unbound (pytorch/pytorch#104102)
        if (store.generation > generation or store.generation < generation
                or store.capacity < needed):
            return False
        store.generation += 1
        return True
    if torch.compiler.is_compiling():  # (dynamo traces no lock; a trace runs on one thread)
        return claim()
    with _CLAIMS:
        return claim()


def _writable(store: _Store) -> bool:
    """Whether an append may write into ``store`` in place: not while autograd may hold views
    of it (it holds keys that require grad, or a query that requires grad read it: a backward
    through an earlier step would find its saved keys changed), nor an inference-mode store
    outside inference mode (torch refuses the write). Compiled, inference mode is not seen
    (dynamo breaks the graph on it): a store made under inference mode outside the region
    is copied once (into a store the region makes), a store a region made is written in
    place (wrong for one case, which torch refuses: see :class:`KVCache`)."""
    if store.graphed or store.keys.requires_grad or store.values.requires_grad:
        return False
    if torch.compiler.is_compiling():
        return store.inference is not True
    return torch.is_inference_mode_enabled() or not store.keys.is_inference()


def _recorded(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether autograd records this append (and the attention that reads the cache next):
    it then goes into a new store, which older caches' views (made under ``no_grad``,
    perhaps) do not share, and that store is not written in place again."""
    return torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad)


def _read_by_graph(cache: "KVCache", q: torch.Tensor) -> None:
    """Mark ``cache``'s store as read by autograd when ``q`` requires grad: the attention
    saves the cache's keys and values for q's gradient (frozen K/V projections), which a
    later write in place would invalidate."""
    if cache._store is not None and torch.is_grad_enabled() and q.requires_grad:
        cache._store.graphed = True


def _checked(lengths, new: int) -> Optional[tuple]:
    """What :meth:`KVCache.append` remembers of ``lengths`` it validated for chunks of ``new``
    positions: the tensor, its version counter and ``new``, so a decode loop passing the same
    unchanged tensor every step validates it (one host read) once."""
    if (type(lengths) is not torch.Tensor or torch.compiler.is_compiling()
            or lengths.is_inference()):  # (a compiled region keeps no state across calls)
        return None
    return (id(lengths), lengths._version, new, lengths)


def _check_pair(caller: str, keys, values) -> LazyText:
    """Raise unless ``keys`` and ``values`` are tensors of one floating dtype on one device
    (``caller`` names the entry point); their shapes, dtypes and devices as text for the
    caller's other messages."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller} takes keys and values as torch.Tensors [B, Hkv, T, D], "
                            f"got {type(t).__name__} for {name}: convert with "
                            f"torch.as_tensor({name})")
    where = LazyText(lambda: f"keys {tuple(keys.shape)} {keys.dtype} {keys.device}, values "
                             f"{tuple(values.shape)} {values.dtype} {values.device}")
    if not keys.is_floating_point() or keys.dtype != values.dtype:
        raise TypeError(f"{caller}: keys and values must share one floating-point dtype, got "
                        f"{where}: cast them, e.g. values.to(keys.dtype)")
    if keys.device != values.device:
        raise ValueError(f"{caller}: keys and values must be on one device, got {where}: move "
                         f"them with values.to(keys.device)")
    return where


@dataclass(frozen=True)
class KVCache:
    """Projected keys and values of the tokens seen so far, for incremental decoding.

    ``keys [B, Hkv, T, D]``, ``values [B, Hkv, T, D]`` (views of the filled part of
    preallocated buffers; ``None`` while empty) and ``length = T``. With per-sequence
    ``lengths [B]`` (batched decoding of sequences of different lengths, see :meth:`append`),
    sequence b's tokens are positions ``[0, lengths[b])``, ``T`` is at least the longest (the
    widths of the chunks appended, summed: no value is read to find it), and
    ``appended [B]`` counts the real positions the last :meth:`append` added to each.

    Immutable to its users: :meth:`append` returns a new cache. It writes in place into the
    buffers it shares with this one while there is room and this is the latest cache of its
    chain, so decoding T tokens copies each once (the buffers grow geometrically, or hold
    ``capacity`` positions from the start). Under autograd it copies instead, into buffers
    just large enough, once they hold keys that require grad or a query that requires grad
    read them through ``MultiHeadAttention`` (a backward reads them as they were). When you
    call :func:`attnkit.attention` on :attr:`keys` yourself with a query that requires grad
    and keys that do not, the next append may write over what that backward reads: pass
    ``keys.clone()`` and ``values.clone()`` there. Buffers made under ``inference_mode`` are
    copied before an eager write outside it. A compiled step sees neither inference mode nor
    inference tensors: it copies such buffers made eagerly and writes in place into those a
    compiled step made, so a cache that compiled steps extended under ``inference_mode`` is
    extended under it again, or by one eager step first (which copies): torch refuses the
    write otherwise. Extending an older cache again (beam search, speculative decoding)
    copies it first, so no cache's real positions ever change. With per-sequence
    ``lengths``, a sequence's positions past ``lengths[b]`` are padding, which :meth:`mask`
    excludes; a later append of the chain may write there. A cache built from the caller's
    tensors may hold anything there: it is never read (the first append copies zeros in its
    place).

    ``window`` (Mistral-style sliding-window attention, ``KVCache.empty(window=w)``): each
    append first drops all but the last ``w − 1`` keys, so a query sees at most ``w`` keys, its
    own included; :meth:`mask` is then ``sliding_window(w − 1, align="bottom_right")`` and
    ``offset`` counts the tokens dropped (the absolute position of ``keys[..., 0, :]``). The
    kept keys sit in a buffer of about ``2w`` positions, moved to its start about once per
    ``w`` steps. Positions stay bottom-right aligned, so causal masks and ALiBi see each key
    at its true distance. Not with per-sequence ``lengths``.
    """

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    length: int = 0
    lengths: Optional[torch.Tensor] = None
    appended: Optional[torch.Tensor] = None
    capacity: Optional[int] = None
    window: Optional[int] = None
    offset: int = 0
    _store: Optional[_Store] = field(default=None, repr=False, compare=False)
    _generation: int = field(default=0, repr=False, compare=False)
    _whole: Optional[int] = field(default=None, repr=False, compare=False)
    """The positions the last :meth:`append` added to every sequence, when it took no
    ``lengths`` (all real: known without reading ``appended``); else ``None``."""
    _start: int = field(default=0, repr=False, compare=False)
    """Where ``keys`` begin in the store (past the keys a window dropped)."""

    def __post_init__(self):
        if (self.keys is None) != (self.values is None):
            raise ValueError("KVCache needs both keys and values, or neither (an empty cache)")
        if self.keys is not None and self._store is None:  # the caller's tensors
            self._check_tensors()
        stored = 0 if self.keys is None else self.keys.shape[-2]
        if self.keys is not None and (self.keys.dim() != 4 or self.values.dim() != 4
                                      or self.keys.shape[:3] != self.values.shape[:3]):
            raise ValueError(f"KVCache keys/values must be [B, Hkv, T, D] with matching B, Hkv, T; "
                             f"got keys {tuple(self.keys.shape)}, values {tuple(self.values.shape)}")
        if self.length != stored:
            raise ValueError(f"KVCache length={self.length} but the keys hold {stored} positions")
        if self.lengths is not None and self._store is None:  # the caller's (not reorder's)
            self._check_lengths()
        if self.capacity is not None:
            _check_positive_int("capacity", self.capacity)
        if self.window is not None:
            _check_positive_int("window", self.window)
            if self.lengths is not None:
                raise ValueError(f"KVCache(window={self.window}) keeps every sequence's last "
                                 f"keys alike: per-sequence lengths are not supported with a "
                                 f"window; pass lengths=None, or no window")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"KVCache offset={self.offset!r}: the tokens a window dropped "
                             f"before keys[..., 0, :], an int >= 0")

    def _check_tensors(self) -> None:
        """Raise unless the caller's ``keys`` and ``values`` are tensors of one floating dtype
        on one device, holding ``length`` (an int) positions."""
        _check_pair("KVCache", self.keys, self.values)
        # (a numpy integer, or keys.shape[2] traced symbolically: torch.export, make_fx)
        if isinstance(self.length, bool) or not isinstance(self.length,
                                                           (numbers.Integral, torch.SymInt)):
            raise TypeError(f"KVCache length={self.length!r}: the positions the keys hold, an "
                            f"int (dim 2 of keys {tuple(self.keys.shape)} [B, Hkv, T, D])")

    def _check_lengths(self) -> None:
        """Raise unless ``lengths`` is an integer tensor ``[B]`` on the keys' device with every
        value in ``[0, length]`` (values are read where they can be: not when compiling)."""
        lengths, keys = self.lengths, self.keys
        if keys is None:
            raise ValueError("KVCache lengths= needs keys and values (an empty cache has none: "
                             "KVCache.empty(), then append(..., lengths=...))")
        batch = keys.shape[0]

        def fix() -> str:  # formatted only when raising: a traced length would be pinned
            return (f"pass lengths as an integer tensor [B] = [{batch}] on the keys' device, "
                    f"each sequence's real positions (at most length={self.length})")
        if not isinstance(lengths, torch.Tensor):
            raise TypeError(f"KVCache lengths={lengths!r}: {fix()}, e.g. torch.tensor(lengths)")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise TypeError(f"KVCache lengths has dtype {lengths.dtype}: {fix()}")
        if tuple(lengths.shape) != (batch,) or lengths.device != keys.device:
            raise ValueError(f"KVCache lengths has shape {tuple(lengths.shape)} on "
                             f"{lengths.device}, keys {tuple(keys.shape)} on {keys.device}: "
                             f"{fix()}")
        if readable(lengths) and batch and not bool(((lengths >= 0) & (lengths <= self.length))
                                                    .all()):
            raise ValueError(f"KVCache lengths={lengths.tolist()} outside [0, {self.length}]: "
                             f"{fix()}")
        appended = self.appended
        if appended is None:
            return
        if (not isinstance(appended, torch.Tensor) or appended.is_floating_point()
                or appended.is_complex() or appended.dtype == torch.bool
                or tuple(appended.shape) != (batch,) or appended.device != keys.device):
            raise TypeError(f"KVCache appended={appended!r:.60}: pass an integer tensor [B] = "
                            f"[{batch}] on the keys' device, each sequence's positions added by "
                            f"the last step (at most its length)")
        if readable(appended, lengths) and batch and not bool(
                ((appended >= 0) & (appended <= lengths)).all()):
            raise ValueError(f"KVCache appended={appended.tolist()} outside [0, lengths] "
                             f"(lengths={lengths.tolist()}): each sequence's last step added "
                             f"at most its length")

    @classmethod
    def empty(cls, capacity: Optional[int] = None, window: Optional[int] = None) -> "KVCache":
        """A cache with no tokens yet (its dtype, device and batch come from the first step);
        ``capacity``: positions to allocate at the first step (default: grow as needed);
        ``window``: keep only what a sliding window of ``window`` keys needs (see above)."""
        return cls(capacity=capacity, window=window)

    def append(self, keys: torch.Tensor, values: torch.Tensor,
               lengths: Optional[torch.Tensor] = None) -> "KVCache":
        """This cache followed by ``keys [B, Hkv, t, D]`` / ``values [B, Hkv, t, D]`` (a new cache).

        ``lengths`` (int ``[B]``, each in ``[0, t]``): only the first ``lengths[b]`` of the t new
        positions of sequence b are real (a right-padded chunk); they go right after that
        sequence's own tokens, and the cache keeps per-sequence :attr:`lengths` from then on.
        The same ``lengths`` tensor passed again unchanged (its version counter) is not
        checked again: after a write torch does not count (numpy memory shared by
        ``torch.from_numpy``, ``.data``), pass a new tensor.
        """
        return self._append(keys, values, lengths, 1)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, lengths: Optional[torch.Tensor],
                split: int) -> "KVCache":
        """:meth:`append`, with new buffers holding a multiple of ``split`` positions (whole
        key splits of the invariance contract, so that :meth:`decode` reads them in place)."""
        self._check_step(keys, values)
        batch, new = keys.shape[0], keys.shape[2]
        if lengths is None and self.lengths is None:
            # a window keeps the last w - 1 keys: each new query then sees its w
            keep = self.length if self.window is None else min(self.length, self.window - 1)
            store, start = self._room(keys, values, keep, keep + new, split)
            store.keys[:, :, start + keep:start + keep + new] = keys
            store.values[:, :, start + keep:start + keep + new] = values
            return self._extended(store, keep + new, None, None, start=start,
                                  offset=self.offset + self.length - keep)
        if self.window is not None:
            raise ValueError(f"KVCache(window={self.window}) keeps every sequence's last keys "
                             f"alike: per-sequence lengths are not supported with a window; "
                             f"decode equal-length sequences, or use a cache without window")
        padded = lengths is not None  # else every new position is real
        seen = _checked(lengths, new) if padded else None
        # T grows by the chunk's width: a bound on every sequence's length read from no value
        length = self.length + new
        store, _ = self._room(keys, values, self.length, length, split)
        if not padded:
            lengths = store.whole(new)
        elif seen is not None and store.checked is not None and _same(store.checked[0], seen):
            lengths = store.checked[1]  # validated by an earlier append, unchanged since
        else:
            lengths = self._new_lengths(lengths, batch, new, keys.device)
        store.checked = None if seen is None else (seen, lengths)
        before = (self.lengths if self.lengths is not None
                  else torch.full((batch,), self.length, dtype=torch.long, device=keys.device))
        if padded:  # zeros in a chunk's padding (past its new length: no cache of the chain reads it)
            offset = torch.arange(new, device=keys.device)
            real = (offset[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, t, 1]
            keys, values = zero_outside(keys, real), zero_outside(values, real)
        if self.lengths is None:  # every sequence holds self.length: one slice of the store
            store.keys[:, :, self.length:length] = keys
            store.values[:, :, self.length:length] = values
        else:  # sequence b's chunk goes to positions before[b] + [0, t)
            if (not torch.compiler.is_compiling() and before.is_inference()
                    and not torch.is_inference_mode_enabled()):
                before = before.clone()  # the scatter's backward saves its index
            slots = (before.view(-1, 1, 1, 1) if new == 1 else
                     (before[:, None] + torch.arange(new, device=keys.device))[:, None, :, None])
            store.keys.scatter_(2, slots.expand(-1, keys.shape[1], -1, keys.shape[3]), keys)
            store.values.scatter_(2, slots.expand(-1, values.shape[1], -1, values.shape[3]),
                                  values)
        return self._extended(store, length, before + (lengths if padded else new), lengths,
                              None if padded else new)

    def reorder(self, index) -> "KVCache":
        """This cache with its batch rebuilt from existing rows (a copy): row i of the new
        cache is row ``index[i]`` of this one (``[B']`` integers; a row may repeat, as a beam
        search keeps its best hypotheses). Per-sequence lengths follow their rows."""
        if self.keys is None:
            raise ValueError("KVCache.reorder needs a cache holding tokens: append first")
        index = (index.to(self.keys.device) if isinstance(index, torch.Tensor)
                 else torch.tensor(index, device=self.keys.device))  # (masks.integer_tensor)
        if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point():
            raise TypeError(f"index must be integers [B'] (rows of this cache), got "
                            f"{index.dtype} {tuple(index.shape)}")
        batch = self.keys.shape[0]
        if readable(index) and index.numel() and not (0 <= int(index.min())
                                                      and int(index.max()) < batch):
            raise ValueError(f"index {index.tolist()} names rows outside this cache's batch of "
                             f"{batch}")
        keys, values = (t.index_select(0, index) for t in self._vouchable())
        store = _Store(keys, values, max(self.length, self._store.capacity
                                         if self._store is not None else 0))
        store.keys[:, :, :self.length] = keys
        store.values[:, :, :self.length] = values
        store.generation = 1
        pick = (lambda t: None if t is None else t.index_select(0, index))
        return KVCache(store.keys[:, :, :self.length], store.values[:, :, :self.length],
                       self.length, pick(self.lengths), pick(self.appended), self.capacity,
                       self.window, self.offset, _store=store, _generation=store.generation,
                       _whole=self._whole)

    def mask(self, is_causal: bool = True) -> Optional[Mask]:
        """The mask of the step whose queries are the positions the last :meth:`append` added,
        over :attr:`keys`: ``None`` or bottom-right ``causal()`` without per-sequence lengths
        (with ``window``: ``sliding_window(window − 1, align="bottom_right")``);
        with them each sequence's real queries see its own real keys, causally with
        ``is_causal`` (its padded queries see nothing: their output is 0)."""
        if self.lengths is None:
            if self.window is not None and is_causal:  # each query sees its last w keys
                return sliding_window(self.window - 1, 0, "bottom_right")
            return causal("bottom_right") if is_causal else None
        if self._store is None:  # the caller's tensors: what lies past each length is unknown
            real = padding(self.appended, self.lengths, allow_empty_rows=True)
            return causal("bottom_right", sequences=real) if is_causal else real
        if self._whole is not None and (self._whole == 1 or not is_causal):
            # every query real; one new query per sequence sees all its keys: key padding only
            return vouched_padding(None, self.lengths, keys_everywhere=self._whole >= 1)
        real = vouched_padding(self.appended, self.lengths)
        return causal("bottom_right", sequences=real) if is_causal else real

    def decode(self, q: torch.Tensor, backend: str = "auto", invariant: Optional[bool] = None,
               ) -> Optional[torch.Tensor]:
        """One new query per sequence over this cache, ``q [B, Hq, 1, D]`` → ``[B, Hq, 1,
        Dv]``, as :func:`attnkit.attention` with :meth:`mask` gives it, without its per-call
        validation and dispatch: the cache made its keys and lengths, so the call is known
        to be torch's fused kernel over a key mask ``position < lengths[b]`` (none without
        lengths, nor with a window, which keeps only the keys the query sees), then the
        non-finite flags of q and the output (:func:`attnkit.finite.poison`'s rule for a
        step that does not look at its keys). Under the invariance contract (``invariant``,
        or ``attnkit.invariant()``) the call is the fixed schedule's
        (:func:`~attnkit.backends.tiled.forward.kernel_call`) over the store's whole key
        splits, read in place: it needs a store allocated in whole splits
        (``MultiHeadAttention`` appends so under the contract). ``None`` where that is not
        the call ``attention`` would make (another backend asked or forced, not CPU
        float32/float64, gradients, autocast, a ``torch.nn.attention.sdpa_kernel`` context
        that allows none of torch's CPU kernels, a traced or shape-only call, ``torch.func``
        or forward-mode AD tensors, a step whose keys
        ``attention`` looks at, a mask too large for a dense key mask, not one real query
        per sequence; under the contract also a window, head dims that differ or exceed
        :data:`~attnkit.backends.tiled.plan.INVARIANT_MAX_HEAD_DIM` or whose rows round by
        their place (:func:`~attnkit.backends.tiled.plan.rows_anywhere`), or a store without
        whole splits): the caller then runs ``attention``."""
        keys, values = self.keys, self.values
        # Plain CPU tensors only (not fake, not meta, not a subclass): ``type(q)`` inside a
        # compiled region is a plain tensor's, hence the compiling check.
        if (keys is None or type(q) is not torch.Tensor or not q.is_cpu or q.dim() != 4
                or type(keys) is not torch.Tensor or type(values) is not torch.Tensor
                or torch.compiler.is_compiling() or any(map(wrapped_eagerly, (q, keys, values)))):
            return None
        batch, heads, q_len, head_dim = q.shape
        _, kv_heads, kv_len, key_dim = keys.shape
        if (q_len != 1 or q.dtype not in (torch.float32, torch.float64)
                or not (q.dtype == keys.dtype == values.dtype and keys.is_cpu)
                or batch != keys.shape[0] or not batch or not kv_len
                or heads % kv_heads or head_dim != key_dim
                or (self.lengths is not None and self._whole != 1)
                or kv_len > DENSE_MAX_SCORES
                or finite.looks_at_keys(q_len, keys.numel())
                or (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad
                                                 or values.requires_grad))
                or torch.is_autocast_enabled("cpu") or dispatch.forced(backend) != "auto"
                or context_refusal(q.device) is not None):
            return None
        scale = 1.0 / math.sqrt(head_dim)
        if invariance.active(invariant):
            out = self._decode_in_splits(q, scale)
        else:
            key_bias = None
            if self.lengths is not None:  # [B, 1, 1, T]: each sequence's real keys
                key_bias = (self._store.key_bias(self.lengths, kv_len)
                            if self._store is not None and not self._start
                            else additive_mask(keys_below(self.lengths, kv_len, q.device)
                                               [:, None, None, :], None, q.dtype))
            out, _ = sdpa_call(q, keys, values, key_bias, False, scale, False)
        return None if out is None else out.add_(finite.query_and_output_flags(out, q))

    def _decode_in_splits(self, q: torch.Tensor, scale: float) -> Optional[torch.Tensor]:
        """:meth:`decode` under the invariance contract: the fixed schedule's one kernel call
        over the store's keys up to whole splits (:data:`~attnkit.backends.tiled.forward.
        KV_SPLIT`), those past each sequence's length forbidden (the store holds finite
        values there: zeros, or that sequence's own keys), the query heads of a K/V head
        stacked as rows; ``None`` where the store lacks whole splits or the contract's tiled
        call would take another path."""
        store, kv_len = self._store, self.length
        width = -(-kv_len // KV_SPLIT) * KV_SPLIT
        head_dim, heads_kv = q.shape[-1], self.keys.shape[1]
        if (store is None or self._start or self.window is not None or store.capacity < width
                or self.values.shape[-1] != head_dim or head_dim > INVARIANT_MAX_HEAD_DIM
                or not rows_anywhere(head_dim, head_dim, q.dtype)):
            return None
        bias = store.key_bias(kv_len if self.lengths is None else self.lengths, width)
        out, _ = kernel_call(grouped(q, heads_kv), store.keys[:, :, :width],
                             store.values[:, :, :width], bias, scale)  # bias [B|1, 1, 1, width]
        return ungrouped(out, q.shape[1])

    def _vouchable(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` as a store of this chain may hold them, its masks vouching for
        what lies past each length: with zeros there where they are the caller's tensors
        (copies), else themselves; a store's as views made now (a view made under
        ``no_grad`` of a store a later cache wrote to with grad mode on cannot be read)."""
        if self._store is not None:
            start, end = self._start, self._start + self.length
            return self._store.keys[:, :, start:end], self._store.values[:, :, start:end]
        if self.lengths is None:
            return self.keys, self.values
        real = keys_below(self.lengths, self.length, self.keys.device)[:, None, :, None]
        return zero_outside(self.keys, real), zero_outside(self.values, real)

    def _room(self, keys: torch.Tensor, values: torch.Tensor, keep: int, needed: int,
              split: int = 1) -> tuple[_Store, int]:
        """``(store, start)``: a store holding this cache's last ``keep`` positions from
        ``start`` on, with room for ``needed`` positions from there: this one's, when this is
        the latest cache of its chain and it has room; else a new one (geometric growth, about
        ``2 · window`` with a window, or ``capacity``; rounded up to a multiple of ``split``)
        with them copied to its start."""
        store = self._store
        start = self._start + self.length - keep
        recorded = _recorded(keys, values)
        writable = store is not None and not recorded and _writable(store)
        if writable and _claimed(store, self._generation, start + needed):
            return store, start
        if store is None:
            grown = 0
        elif store.capacity >= start + needed:  # room, but not writable: a copy of its size
            grown = store.capacity
        else:
            grown = 2 * store.capacity
        capacity = max(needed, self.capacity or 0,
                       grown if self.window is None else 2 * self.window)
        if recorded or (store is not None and not writable and torch.is_grad_enabled()):
            capacity = needed  # under autograd: a store not written in place again, no room
        capacity = -(-capacity // split) * split
        fresh = _Store(keys, values, capacity)
        fresh.generation = 1  # claimed by the cache this append makes
        if keep:
            kept_keys, kept_values = (t[:, :, self.length - keep:] for t in self._vouchable())
            fresh.keys[:, :, :keep] = kept_keys
            fresh.values[:, :, :keep] = kept_values
        return fresh, 0

    def _extended(self, store: _Store, length: int, lengths: Optional[torch.Tensor],
                  appended: Optional[torch.Tensor], whole: Optional[int] = None, *,
                  start: int = 0, offset: int = 0) -> "KVCache":
        # valid by construction (no __post_init__ checks); the latest of its chain (_room
        # claimed the store for it)
        cache = object.__new__(KVCache)
        cache.__dict__.update(
            keys=store.keys[:, :, start:start + length],
            values=store.values[:, :, start:start + length], length=length, lengths=lengths,
            appended=appended, capacity=self.capacity, window=self.window, offset=offset,
            _store=store, _generation=store.generation, _whole=whole, _start=start)
        return cache

    def _check_step(self, keys, values) -> None:
        """Raise unless ``keys``/``values`` are one step ``[B, Hkv, t, D]`` that continues
        this cache (the same B, Hkv, head dims, dtype and device)."""
        # the store's buffers where there is one (B, Hkv, D, dtype and device of the views):
        # a compiled step then reads the store alone, not also views of it
        cached, cached_values = ((self.keys, self.values) if self._store is None
                                 else (self._store.keys, self._store.values))
        if (cached is not None and type(keys) is type(values) is torch.Tensor
                and keys.dim() == values.dim() == 4 and keys.shape[:3] == values.shape[:3]
                and keys.shape[:2] == cached.shape[:2] and keys.shape[3] == cached.shape[3]
                and values.shape[3] == cached_values.shape[3] and keys.dtype == values.dtype
                and keys.dtype == cached.dtype and keys.device == values.device == cached.device
                and keys.is_floating_point()):
            return  # the common step, accepted at once; the checks below name what is wrong
        where = _check_pair("KVCache.append", keys, values)
        if keys.dim() != 4 or values.dim() != 4:
            raise ValueError(f"KVCache.append takes keys and values [B, Hkv, t, D] (4-D), got "
                             f"{where}: add the head dim of one head with .unsqueeze(1), or "
                             f"transpose [B, t, Hkv, D] with .transpose(1, 2)")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys and values must match in B, Hkv and t (all dims but the "
                             f"head dim), got {where}")
        if self.keys is None:
            return
        if (self.keys.shape[:2] != keys.shape[:2] or self.keys.shape[-1] != keys.shape[-1]
                or self.values.shape[-1] != values.shape[-1]):
            raise ValueError(f"new {where} do not continue the cache (keys "
                             f"{tuple(self.keys.shape)}, values {tuple(self.values.shape)}): batch "
                             f"size, KV heads and head dims must match. Start a new cache with "
                             f"KVCache.empty() for a new batch")
        if self.keys.dtype != keys.dtype:
            raise TypeError(f"new keys are {keys.dtype} but the cache holds {self.keys.dtype}: "
                            f"decode in one dtype (under torch.autocast the projections give "
                            f"the autocast dtype: fill and extend a cache on the same side of "
                            f"autocast)")
        if self.keys.device != keys.device:
            raise ValueError(f"new keys are on {keys.device} but the cache holds keys on "
                             f"{self.keys.device}: decode on one device")

    @staticmethod
    def _new_lengths(lengths, batch: int, new: int, device) -> torch.Tensor:
        """``lengths`` (ints ``[B]``, a tensor or a list) as a long tensor on ``device``, or
        ``new`` for every sequence when ``None``."""
        if lengths is None:
            return torch.full((batch,), new, dtype=torch.long, device=device)
        given = lengths
        try:
            lengths = (lengths.to(device) if isinstance(lengths, torch.Tensor)
                       else torch.tensor(lengths, device=device))  # (see masks.integer_tensor)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"lengths must be integers [B] = [{batch}] (real new positions per "
                            f"sequence), a tensor or a list, got {type(given).__name__} "
                            f"{given!r:.60}") from None
        if lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be integers [B] = [{batch}] (real new positions per "
                            f"sequence), got torch.bool {tuple(lengths.shape)}: for a [B, t] mask "
                            f"of real positions pass its counts, real.sum(-1)")
        if lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"lengths must be integers [B] = [{batch}] (real new positions per "
                            f"sequence), got {lengths.dtype} {tuple(lengths.shape)}: convert with "
                            f"lengths.long()")
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must be integers [B] = [{batch}] (real new positions per "
                             f"sequence), got {lengths.dtype} {tuple(lengths.shape)}")
        if readable(lengths) and bool(((lengths < 0) | (lengths > new)).any()):
            raise ValueError(f"lengths must lie in [0, {new}] (the new positions), got "
                             f"{lengths.tolist()}")
        kept = lengths.long()  # a copy unless it shares the caller's memory (a tensor or an
        # array of int64), which the caller may write later
        return kept.clone() if kept is lengths and not isinstance(given, (list, tuple)) else kept


# ---------------------------------------------------------------------------------------------
# Multi-head attention
# ---------------------------------------------------------------------------------------------
def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")


def _check_parallel(parallel):
    """``parallel`` when it is ``None`` or a ``SequenceParallel``; else a ``TypeError``."""
    if parallel is None:
        return None
    from .distributed.parallel import SequenceParallel

    if not isinstance(parallel, SequenceParallel):
        raise TypeError(f"sequence_parallel must be an attnkit.distributed.parallel."
                        f"SequenceParallel (e.g. SequenceParallel(kind='ring')) or None, got "
                        f"{type(parallel).__name__}")
    return parallel


def _refuse_with_parallel(parallel, *, cache, lengths, need_weights: bool) -> None:
    """A ``ValueError`` for what a sequence-parallel call cannot do."""
    what = f"sequence_parallel=SequenceParallel(kind={parallel.kind!r})"
    if cache is not None:
        raise ValueError(f"{what} does not take a cache ({type(cache).__name__}): each rank "
                         f"holds a shard of the sequence, not the whole of it; decode "
                         f"incrementally without sequence_parallel")
    if lengths is not None:
        raise ValueError(f"{what} does not take lengths (they describe a cache's chunks); "
                         f"pass the padding of the whole sequence as key_valid [B, Tk]")
    if need_weights:
        raise ValueError(f"{what} returns no attention weights: no rank holds a whole "
                         f"[Tq, Tk] row block of them; call with need_weights=False, or "
                         f"without sequence_parallel on the whole sequence")


ROWWISE_ROWS = 16
"""Rows per matrix product of :func:`_rowwise`."""

ROWWISE_ALIGN = 64
"""Bytes every row of a :func:`_rowwise` product starts at a multiple of."""


def _check_dtypes(module: nn.Module, inputs) -> None:
    """Raise unless every ``(name, tensor)`` of ``inputs`` has the dtype of ``module``'s
    parameters (outside ``torch.autocast``, which casts both for each product). Parameters
    of another type than a plain tensor's (FSDP's sharded ``DTensor`` or flat parameters,
    which its mixed precision casts, with the inputs, when the layer runs) are not read."""
    weight = next(module.parameters(), None)
    if weight is None or type(weight).__name__ in ("DTensor", "FlatParameter") or (
            weight.device.type in ("cpu", "cuda")
            and torch.is_autocast_enabled(weight.device.type)):
        return
    for name, t in inputs:
        if t.dtype != weight.dtype:
            fix = (f"convert the input ({name}.to({weight.dtype})) or the module "
                   f"(module.to({t.dtype}))" if t.is_floating_point() else
                   f"attention needs floating point: convert it with {name}.to({weight.dtype})")
            raise TypeError(f"{name} has dtype {t.dtype} but {type(module).__name__}'s weights "
                            f"are {weight.dtype}: {fix}")


def _rowwise(layer: nn.Module, x: torch.Tensor, product=None) -> torch.Tensor:
    """``layer(x)`` for ``x [..., in]`` as products of exactly :data:`ROWWISE_ROWS` rows each
    (the last padded with copies of its last row), so that each row is computed the same
    way whatever the number of rows: BLAS takes another path for a few rows (a decoding
    step), and for wide layers blocks its reduction, or splits it over threads, by the row
    count. Each row starts at a multiple of :data:`ROWWISE_ALIGN` bytes (the rows are copied
    into a buffer whose row stride is widened to one): BLAS rounds a row by its address's
    alignment (MKL on AVX2: float64 rows of an odd width, float32 ones of a width not a
    multiple of 4, give other bits at every other place in a product). The projections of
    ``MultiHeadAttention`` under the invariance contract. ``layer``: an ``nn.Linear``, or
    transformers' ``Conv1D`` (weight ``[in, out]``), its product taken from its weight; or
    ``product``, a function of each chunk of rows ``[ROWWISE_ROWS, in]`` (row stride a
    multiple of :data:`ROWWISE_ALIGN` bytes, not ``in``), such as the layer's own forward."""
    flat = x.reshape(-1, x.shape[-1])
    rows, width = flat.shape
    if product is None:
        weight = layer.weight if isinstance(layer, nn.Linear) else layer.weight.t()

        def product(chunk: torch.Tensor) -> torch.Tensor:
            return F.linear(chunk, weight, layer.bias)
    if not rows:
        out = product(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    step = max(1, ROWWISE_ALIGN // flat.element_size())
    wide = -(-width // step) * step
    # torch.cat allocates (aligned), never aliases x; F.pad widens the row stride
    padded = torch.cat([flat, flat[-1:].expand(-rows % ROWWISE_ROWS, width)])
    if wide != width:
        padded = F.pad(padded, (0, wide - width))[:, :width]
    out = torch.cat([product(chunk) for chunk in padded.split(ROWWISE_ROWS)])
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def _attn_mask_hint(attn_mask) -> str:
    """attnkit's spelling of torch's ``attn_mask`` ``[Tq, Tk]`` or per-head ``[B*H, Tq, Tk]``
    (``[H, Tq, Tk]`` unbatched): bool True = NOT allowed, float = added to the scores."""
    if attn_mask is None:
        return "drop it (no mask is the default)"
    if not isinstance(attn_mask, torch.Tensor):
        return "pass mask= (a tensor over the scores [B, H, Tq, Tk], or an attnkit mask)"
    flip, how = (("~", "a bool mask here means True = may attend, the opposite of torch's")
                 if attn_mask.dtype == torch.bool else
                 ("", "a float mask is added to the scores, as torch's"))
    if attn_mask.dim() == 3:
        tq, tk = attn_mask.shape[1:]
        return (f"pass mask= ({how}; torch's per-head [B*H, Tq, Tk] is [B, H, Tq, Tk] here): "
                f"mask={flip}attn_mask.view(-1, num_heads, {tq}, {tk})")
    return f"pass mask= ({how}): mask={flip}attn_mask"


def _key_padding_mask_hint(key_padding_mask) -> str:
    """attnkit's spelling of torch's ``key_padding_mask`` ``[B, Tk]`` (``[Tk]`` unbatched):
    bool True = ignore the key, float = added to the scores of that key."""
    if key_padding_mask is None:
        return "drop it (no padding is the default)"
    if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.is_floating_point():
        return ("a float mask is added to the scores of each key: pass mask=key_padding_mask"
                "[:, None, None] ([B, 1, 1, Tk]; unbatched: mask=key_padding_mask; with an "
                "attn_mask, add the two)")
    return ("pass key_valid=~key_padding_mask (key_valid: True = a real key that may be "
            "attended, the opposite of torch's key_padding_mask)")


def _average_attn_weights_hint(average) -> str:
    """attnkit's spelling of torch's ``average_attn_weights``: the weights are per head."""
    if average is False:
        return ("drop it: the weights (need_weights=True) are per head, [B, H, Tq, Tk], as "
                "torch's with average_attn_weights=False")
    return ("the weights (need_weights=True) are per head, [B, H, Tq, Tk]: average them with "
            "weights.mean(1)")


_TORCH_MHA_KEYWORDS = {"attn_mask": _attn_mask_hint, "key_padding_mask": _key_padding_mask_hint,
                       "average_attn_weights": _average_attn_weights_hint}
"""torch's ``nn.MultiheadAttention.forward`` keywords → their hint, a function of the value."""


def _unexpected(keywords: dict) -> TypeError:
    """The error for keywords :meth:`MultiHeadAttention.forward` does not take: torch's
    ``nn.MultiheadAttention`` ones with their attnkit spelling (for the value passed)."""
    hints = [f"{name}: {_TORCH_MHA_KEYWORDS[name](value)}" for name, value in keywords.items()
             if name in _TORCH_MHA_KEYWORDS]
    names = ", ".join(repr(name) for name in keywords)
    return TypeError(f"MultiHeadAttention.forward() got unexpected keyword argument(s) {names}"
                     + (" (torch's nn.MultiheadAttention):\n  " + "\n  ".join(hints) if hints
                        else "; it takes mask, key_valid, need_weights, cache, is_causal, "
                             "lengths, sequence_parallel"))


_TORCH_MHA_POSITIONAL = ("key_padding_mask", "need_weights", "attn_mask",
                         "average_attn_weights", "is_causal")
"""torch's ``nn.MultiheadAttention.forward`` arguments after ``value``, in order."""


def _positional(extra: tuple) -> TypeError:
    """The error for arguments passed positionally after ``value``, which torch's
    ``nn.MultiheadAttention.forward`` reads as :data:`_TORCH_MHA_POSITIONAL`: each named,
    with its attnkit spelling where it has one."""
    named = dict(zip(_TORCH_MHA_POSITIONAL, extra))
    hints = [f"{name}: " + (_TORCH_MHA_KEYWORDS[name](value) if name in _TORCH_MHA_KEYWORDS
                            else f"pass {name}={value!r:.40} by keyword")
             for name, value in named.items()]
    more = (f" (it takes at most {len(_TORCH_MHA_POSITIONAL)})"
            if len(extra) > len(_TORCH_MHA_POSITIONAL) else "")
    return TypeError(f"MultiHeadAttention.forward() takes query, key and value positionally, "
                     f"got {len(extra)} more: in torch's nn.MultiheadAttention order{more} they "
                     f"are {', '.join(named)}; pass them by keyword:\n  " + "\n  ".join(hints))


def _parameter_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The dtype of ``module``'s first parameter, which :func:`_check_dtypes` compares the
    inputs with (``None`` without one). Read from the parameter, never through a layer's
    ``weight``: a parametrized weight (``torch.nn.utils.parametrize``: weight norm,
    spectral norm) is computed on each read, a pass over the weight, and spectral norm in
    training steps its power iteration on each one, so only the projection itself reads it.
    The first parameter of ``module.parameters()`` (its own, then its submodules' depth
    first), found without that generator's walk over every module."""
    weight = _first_parameter(module)
    return None if weight is None else weight.dtype


def _first_parameter(module: nn.Module) -> Optional[torch.Tensor]:
    """``next(module.parameters(), None)``: a parameter of ``module``'s own, else the first
    of its submodules' in registration order."""
    for weight in module._parameters.values():
        if weight is not None:
            return weight
    for child in module._modules.values():
        weight = None if child is None else _first_parameter(child)
        if weight is not None:
            return weight
    return None


def _projected(layer: nn.Module, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``layer(x)``, row-wise under the invariance contract (:func:`_rowwise`, through
    :func:`attnkit.invariance._held_rowwise` for this call): the layer is called as usual, so
    its forward hooks and pre-hooks see the whole ``x``; its product runs per chunk of rows,
    from the weight for a plain ``nn.Linear``, else by a forward set on the instance
    (accelerate's device hooks) or the layer's own forward (a wrapper such as LoRA, whose
    inner layers' hooks then see the chunks). Compiled, a plain ``nn.Linear`` is traced; any
    other projection runs outside the graph (a graph break; ``fullgraph=True`` refuses it)."""
    if not invariant:
        return layer(x)
    if type(layer).__module__.startswith("torch.ao.nn.quantized"):
        raise ValueError(f"{type(layer).__name__} under the invariance contract: a dynamically "
                         f"quantized projection scales its activations by the rows of each "
                         f"call, so a row's result depends on the others; run it without "
                         f"invariant, or with float projections")
    if torch.compiler.is_compiling() and _plain_linear(layer):
        return _rowwise(layer, x)  # (dynamo traces neither the lock nor a patched forward)
    with invariance._held_rowwise((layer,)):  # compiled: a graph break here
        return layer(x)


def _plain_linear(layer: nn.Module) -> bool:
    """Whether ``layer(x)`` is ``F.linear`` of its weight and nothing else: an ``nn.Linear``
    with no forward of its own (class or instance) and no hooks (its own or global)."""
    return (type(layer).forward is nn.Linear.forward and "forward" not in layer.__dict__
            and not layer._forward_hooks and not layer._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks
            and not nn.modules.module._global_forward_pre_hooks)



_TORCH_MHA_PARAMETERS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                         "v_proj_weight", "bias_k", "bias_v")
"""``torch.nn.MultiheadAttention``'s parameter names that :class:`MultiHeadAttention` lacks."""


class MultiHeadAttention(nn.Module):
    """Multi-head attention with GQA/MQA, cross-attention and a KV cache.

    ``out = out_proj(attention(q_proj(query), k_proj(key), v_proj(value)))`` with the
    projections split into heads: q into ``num_heads``, k and v into ``num_kv_heads`` heads of
    ``head_dim = embed_dim // num_heads`` each. Query head h reads key/value head
    ``h // (num_heads // num_kv_heads)``; K/V are never repeated in memory.

    Args:
        embed_dim: E, width of the query and of the output.
        num_heads: H, query heads; must divide ``embed_dim``.
        num_kv_heads: Hkv, key/value heads (default ``num_heads``; 1 is multi-query attention);
            must divide ``num_heads``.
        dropout: dropout probability on the attention weights, applied in training mode only.
        bias: whether the four projections have a bias.
        kdim, vdim: input widths of key and value (default ``embed_dim``) for cross-attention.
        backend: attnkit backend name passed to :func:`attnkit.attention` (``"auto"`` picks one).
        invariant: run every call under the invariance contract (:mod:`attnkit.invariance`):
            a sequence's outputs do not depend on the batch around it, its padding, or
            whether it was prefilled at once, in chunks or decoded token by token (a
            ``KVCache`` without a window); ``None`` follows ``attnkit.invariant()``. Under
            the contract a ``KVCache`` without a window grows its buffers in whole key splits
            (512 positions), which its decoding steps read in place, and the projections
            compute their rows in products of 16 rows each: hooks registered on a projection
            see the call's whole input, while a forward set on its instance (accelerate's
            device hooks) or a wrapper's forward (LoRA) runs once per 16 rows.
        sequence_parallel: a :class:`attnkit.distributed.parallel.SequenceParallel`: every
            call attends across the ranks of its group (``ring_attention`` or
            ``ulysses_attention``); see :meth:`forward`. ``None``: one process. Stored as the
            attribute ``sequence_parallel``; a call's ``sequence_parallel=`` overrides it.
        batch_first: ``True`` (default): batched inputs and outputs are ``[B, T, ·]``;
            ``False``: ``[T, B, ·]``, as ``torch.nn.MultiheadAttention``'s default. Masks,
            ``key_valid``, ``lengths``, the weights and the cache stay batch first.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 dropout: float = 0.0, bias: bool = True, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, *, backend: str = "auto",
                 invariant: Optional[bool] = None,
                 sequence_parallel: Optional["SequenceParallel"] = None,
                 batch_first: bool = True, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("kdim", kdim), ("vdim", vdim)):
            _check_positive_int(name, value)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: "
                             f"each head gets embed_dim // num_heads features; choose num_heads "
                             f"among the divisors of {embed_dim} or change embed_dim")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads="
                             f"{num_kv_heads}: each key/value head serves a whole group of query "
                             f"heads (GQA); choose num_kv_heads among the divisors of {num_heads}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r}: must be a float in [0, 1)")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str), got {backend!r}")
        dispatch.check_name(backend)
        if invariant is not None and not isinstance(invariant, bool):
            raise TypeError(f"invariant={invariant!r}: pass True, False or None (None follows "
                            f"attnkit.invariant())")
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first={batch_first!r}: pass True ([B, T, E] inputs) or "
                            f"False ([T, B, E])")

        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim, vdim
        self.dropout = float(dropout)
        self.backend = backend
        self.invariant = invariant
        self.batch_first = batch_first
        self.sequence_parallel = _check_parallel(sequence_parallel)
        factory = dict(device=device, dtype=dtype)
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform input projections and zero biases (as ``torch.nn.MultiheadAttention``)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}, dropout={self.dropout}, "
                f"backend={self.backend!r}" + ("" if self.invariant is None
                                               else f", invariant={self.invariant}")
                + ("" if self.sequence_parallel is None
                   else f", sequence_parallel={self.sequence_parallel.kind!r}")
                + ("" if self.batch_first else ", batch_first=False"))

    @staticmethod
    def empty_cache() -> KVCache:
        """An empty :class:`KVCache` to start incremental decoding with."""
        return KVCache.empty()

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None,
                value: Optional[torch.Tensor] = None, *positional, mask: MaskLike = None,
                key_valid: Optional[torch.Tensor] = None, need_weights: bool = False,
                cache: Union[KVCache, PagedKVCache, None] = None, is_causal: bool = False,
                lengths: Optional[torch.Tensor] = None, key_padding_mask: None = None,
                sequence_parallel: Optional["SequenceParallel"] = None, **unexpected,
                ) -> "MHAOutput":
        """Attend from ``query`` to ``key``/``value`` (both default to ``query``: self-attention).

        Args:
            query: ``[B, Tq, E]`` or unbatched ``[Tq, E]`` (``[Tq, B, E]`` with
                ``batch_first=False``, likewise key, value and the output).
            key: ``[B, Tk, kdim]`` (same rank and batch as ``query``); default ``query``.
            value: ``[B, Tk, vdim]``; default ``key``. The arguments after it are keywords
                (torch's positional ``key_padding_mask, need_weights, attn_mask, ...`` raise
                ``TypeError`` with their attnkit spelling).
            mask: anything :func:`attnkit.attention` accepts, over the scores
                ``[B, H, Tq, Tk]``: an attnkit mask (``causal()``, ``padding(...)``, ...), a bool
                tensor (**True = may attend**) or a float bias, broadcastable to
                ``[B, H, Tq, Tk]`` (``[Tq, Tk]`` is shared by every batch element and head; a
                per-batch mask is ``[B, 1, Tq, Tk]``). With a cache, bands (causal, windows),
                ALiBi and relative biases count the cache's positions: align them
                ``"bottom_right"`` (the new queries are the last ones). Bands, relative biases
                and ALiBi with sinks over a cache whose sequences hold different numbers of
                keys are refused (``ValueError``), but for a ``PagedKVCache`` step with a
                bottom-right band, softcap or sinks alone, which runs per sequence.
            key_valid: bool ``[B, Tk]`` (``[Tk]`` unbatched), **True = a real key that may be
                attended**, False = padding (Hugging Face's ``attention_mask``). torch's
                ``nn.MultiheadAttention`` takes the opposite, ``key_padding_mask`` (True =
                ignore): pass ``key_valid=~key_padding_mask``; passing ``key_padding_mask``
                here raises a TypeError saying so. With a cache, Tk counts the cached keys too.
                Combined with ``mask`` and ``is_causal`` by "and".
            need_weights: also return the attention weights per head (before dropout).
                It may change which backend runs, and so the dropout pattern a seed gives;
                pin ``backend=`` for patterns that must not depend on it.
            cache: a :class:`KVCache` (e.g. ``self.empty_cache()``); this call's projected
                keys/values are appended to it and the queries attend over the whole cache.
                Or a :class:`PagedKVCache`, appended to in place (the same object returns).
            is_causal: causal attention. Without a cache query i sees keys ``j <= i``
                (top-left, as torch); with a cache the mask is bottom-right aligned
                (``attnkit.causal(align="bottom_right")``): the new queries are the *last* Tq
                positions, so a chunk of several new tokens decodes correctly.
            lengths: with a cache, int ``[B]``: sequence b's chunk holds ``lengths[b]`` real
                tokens, then padding (batched decoding of sequences of different lengths).
                Its real keys/values go right after that sequence's cached ones
                (:meth:`KVCache.append`), its real queries see only its own tokens, and its
                padded queries get attention output 0 (``out`` there is ``out_proj``'s bias).
            sequence_parallel: a :class:`~attnkit.distributed.parallel.SequenceParallel`
                for this call (default: the module's ``sequence_parallel``). Then ``query``,
                ``key`` and ``value`` are this rank's shards ``[B, T/P, ·]`` of the sequence
                (cut by its layout, e.g. ``sequence_parallel.shard(x, dim=1)``; ``[T/P, B, ·]``
                and ``dim=0`` with ``batch_first=False``), ``out`` is this rank's shard in
                the same layout, and ``mask``, ``key_valid`` (``[B, Tk]``)
                and ``is_causal`` describe the WHOLE sequence, at global positions; every
                rank passes the same ones, and every rank must run the backward. Not with a
                ``cache``, ``lengths`` or ``need_weights`` (``ValueError``); attention dropout
                in training needs ``kind="ulysses"``.

        Returns:
            :class:`MHAOutput` ``(out, weights, cache)``: ``out [B, Tq, E]`` (``[Tq, B, E]``
            with ``batch_first=False``), ``weights [B, H, Tq, Tk]`` or ``None`` (unbatched:
            ``[Tq, E]``, ``[H, Tq, Tk]``), and the
            extended cache (``None`` without one). A query row whose keys are all masked gets 0
            attention output (never NaN).
        """
        if positional:  # torch's positional order after value
            raise _positional(positional)
        if key_padding_mask is not None:  # torch's, reported with the others
            unexpected = {"key_padding_mask": key_padding_mask, **unexpected}
        if unexpected:
            raise _unexpected(unexpected)
        if not (isinstance(is_causal, bool) and isinstance(need_weights, bool)):
            name, flag = (("is_causal", is_causal) if not isinstance(is_causal, bool)
                          else ("need_weights", need_weights))
            raise TypeError(f"MultiHeadAttention {name}={flag!r:.40}: pass True or False")
        refuse_jit_trace("MultiHeadAttention")
        key = query if key is None else key
        value = key if value is None else value
        unbatched = self._check_inputs(query, key, value)
        if unbatched:
            query, key, value = query[None], key[None], value[None]
            if isinstance(key_valid, torch.Tensor):  # anything else: _combine_masks says why
                if key_valid.dim() != 1:
                    raise ValueError(f"key_valid has shape {tuple(key_valid.shape)} but unbatched "
                                     f"keys take [Tk] = [{key.shape[1]}]; True = real key")
                key_valid = key_valid[None]
        elif not self.batch_first:  # [T, B, ·] as views [B, T, ·]
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, q_len, _ = query.shape
        invariant = invariance.active(self.invariant)
        parallel = (self.sequence_parallel if sequence_parallel is None
                    else _check_parallel(sequence_parallel))
        if parallel is not None:
            _refuse_with_parallel(parallel, cache=cache, lengths=lengths,
                                  need_weights=need_weights)
        # each row's product computed alike whatever the row count under the contract
        q, k, v = (_projected(self.q_proj, query, invariant),
                   _projected(self.k_proj, key, invariant),
                   _projected(self.v_proj, value, invariant))
        # heads of head_dim: as many as the projections give (num_heads, num_kv_heads; a
        # tensor-parallel rank's share where the projections are sharded by columns)
        q = q.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [B, H, Tq, D]
        k = k.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [B, Hkv, Tk, D]
        v = v.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [B, Hkv, Tk, D]
        self._check_projected_heads(q.shape[1], k.shape[1], v.shape[1])

        new_cache, paged_step = None, False
        if parallel is not None:
            world = parallel.world_size()
            full_mask = self._combine_masks(mask, key_valid, is_causal, cache=None,
                                            batch=batch, kv_len=k.shape[2] * world)
            dropout = self.dropout if self.training else 0.0
            heads_out = parallel.attend(q, k, v, full_mask, dropout_p=dropout,
                                        invariant=invariant)  # [B, H, Tq/P, D]
            out = _projected(self.out_proj, self._merged(heads_out, unbatched), invariant)
            return MHAOutput(out[0] if unbatched else out, None, None)
        # a PagedKVCache is written in place: a step refused after its append (a mask that
        # does not fit) puts the cache back as it was
        undo = cache._snapshot() if isinstance(cache, PagedKVCache) else None
        try:
            if cache is not None:
                if not isinstance(cache, (KVCache, PagedKVCache)):
                    raise TypeError(f"cache must be a KVCache (MultiHeadAttention."
                                    f"empty_cache()) or a PagedKVCache, got "
                                    f"{type(cache).__name__}")
                # a paged step over its own new tokens runs PagedKVCache.attend, which aligns a
                # band and the score modifiers to each sequence (:func:`_per_sequence_step`)
                paged_step = (isinstance(cache, PagedKVCache) and not invariant
                              and key_valid is None and not need_weights
                              and not (self.training and self.dropout)
                              and q.shape[2] == k.shape[2] and _per_sequence_step(mask))
                if mask is not None and not paged_step:
                    _check_positions(as_mask(mask), cache, lengths, k.shape[2])
                new_cache = (cache._append(k, v, lengths, KV_SPLIT)  # read in place by decode
                             if invariant and isinstance(cache, KVCache) and cache.window is None
                             else cache.append(k, v, lengths))
                if not isinstance(new_cache, PagedKVCache):  # a paged cache gathers only if asked
                    k, v = new_cache.keys, new_cache.values  # [B, Hkv, T_cache + Tk, D]
                    _read_by_graph(new_cache, q)
            elif lengths is not None:
                raise TypeError("lengths (real tokens per sequence of a chunk) needs a cache; "
                                "without one, pass the padding as key_valid")

            dropout = self.dropout if self.training else 0.0
            plain = mask is None and key_valid is None and not need_weights and not dropout
            heads_out = weights = None
            if plain and isinstance(new_cache, KVCache):  # a decoding step: None otherwise
                heads_out = new_cache.decode(q, backend=self.backend, invariant=invariant)
            elif isinstance(new_cache, PagedKVCache) and paged_step:
                heads_out = new_cache.attend(q, mask, is_causal=is_causal, backend=self.backend)
            if heads_out is None:
                if isinstance(new_cache, PagedKVCache):
                    k, v = new_cache.keys, new_cache.values  # gathered [B, Hkv, T, D]
                full_mask = self._combine_masks(mask, key_valid, is_causal, cache=new_cache,
                                                batch=batch, kv_len=k.shape[2])
                result = attention(q, k, v, full_mask, dropout_p=dropout, backend=self.backend,
                                   return_weights=need_weights, invariant=invariant)
                heads_out, weights = ((result.out, result.weights) if need_weights
                                      else (result, None))
        except BaseException:
            if undo is not None:
                cache._restore(undo)
            raise
        out = _projected(self.out_proj, self._merged(heads_out, unbatched), invariant)
        if unbatched:
            out = out[0]  # [Tq, E]
            weights = None if weights is None else weights[0]  # [H, Tq, Tk]
        return MHAOutput(out, weights, new_cache)

    if TYPE_CHECKING:  # calling the module runs forward (nn.Module's __call__ returns Any)
        __call__ = forward

    def _merged(self, heads_out: torch.Tensor, unbatched: bool) -> torch.Tensor:
        """``heads_out [B, H, Tq, D]`` with its heads merged, in the caller's layout, for the
        out projection: ``[B, Tq, H·D]``, or ``[Tq, B, H·D]`` with ``batch_first=False`` (so
        that the output is contiguous in it, as torch's is; unbatched: ``B = 1``)."""
        if self.batch_first or unbatched:
            return heads_out.transpose(1, 2).flatten(-2)
        return heads_out.permute(2, 0, 1, 3).flatten(-2)

    def _check_inputs(self, query, key, value) -> bool:
        """Raise on shapes the projections cannot take; return True for unbatched input."""
        if (type(query) is torch.Tensor and key is query and value is query
                and query.dim() == 3 and query.shape[-1] == self.embed_dim == self.kdim
                == self.vdim and query.dtype == _parameter_dtype(self)):
            return False  # batched self-attention, accepted at once
        where = LazyText(lambda: ", ".join(f"{n} {tuple(t.shape)}" for n, t in (
            ("query", query), ("key", key), ("value", value)) if isinstance(t, torch.Tensor)))
        layout, batch_dim = (("[B, T, ", 0) if self.batch_first else
                             ("[T, B, ", 1))  # batch_first=False: torch's default layout
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                               ("value", value, self.vdim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() not in (2, 3):
                raise ValueError(f"{name} must be {layout}{width}] or unbatched [T, {width}]; "
                                 f"got {where}")
            if t.shape[-1] != width:
                hint = "embed_dim" if name == "query" else name[0] + "dim"
                raise ValueError(f"{name} has width {t.shape[-1]} but this module expects "
                                 f"{width} ({hint}); got {where}")
        if not query.dim() == key.dim() == value.dim():
            raise ValueError(f"query, key and value must all be batched {layout}·] or all "
                             f"unbatched [T, ·]; got {where}")
        if query.dim() == 3 and not (query.shape[batch_dim] == key.shape[batch_dim]
                                     == value.shape[batch_dim]):
            raise ValueError(f"query, key and value must share the batch size (dim {batch_dim}, "
                             f"{layout}·]); got {where}")
        time_dim = 0 if query.dim() == 2 else 1 - batch_dim
        if key.shape[time_dim] != value.shape[time_dim]:
            raise ValueError(f"key and value must have the same length Tk (dim {time_dim}); "
                             f"got {where}")
        _check_dtypes(self, (("query", query), ("key", key), ("value", value)))
        return query.dim() == 2

    def _check_projected_heads(self, heads: int, kv_heads: int, v_heads: int) -> None:
        """Raise unless the projections gave ``num_heads`` query and ``num_kv_heads`` key and
        value heads, or one share of both (a tensor-parallel rank's column shards)."""
        if (v_heads == kv_heads and heads * self.num_kv_heads == kv_heads * self.num_heads
                and heads and self.num_heads % heads == 0):
            return
        raise ValueError(f"the projections gave {heads} query, {kv_heads} key and {v_heads} "
                         f"value heads of head_dim {self.head_dim}; this module has num_heads="
                         f"{self.num_heads} and num_kv_heads={self.num_kv_heads} (or one share "
                         f"of both per tensor-parallel rank): give q_proj {self.num_heads} · "
                         f"{self.head_dim} outputs and k_proj, v_proj {self.num_kv_heads} · "
                         f"{self.head_dim}")

    def _combine_masks(self, mask: MaskLike, key_valid: Optional[torch.Tensor],
                       is_causal: bool, *, cache: Union[KVCache, PagedKVCache, None],
                       batch: int, kv_len: int) -> Optional[Mask]:
        """``mask & causal & key padding`` as one attnkit mask over ``[B, H, Tq, Tk]``; with a
        cache, causal and the cache's per-sequence lengths come from :meth:`KVCache.mask`."""
        parts = []
        if mask is not None:
            parts.append(as_mask(mask))
        step = cache.mask(is_causal) if cache is not None else causal() if is_causal else None
        if step is not None:
            parts.append(step)
        if key_valid is not None:
            if not isinstance(key_valid, torch.Tensor) or key_valid.dtype != torch.bool:
                raise TypeError(f"key_valid must be a bool tensor [B, Tk] with True = real "
                                f"key (may attend), got {getattr(key_valid, 'dtype', type(key_valid).__name__)}"
                                f"; torch's key_padding_mask (True = ignore) is the opposite: pass ~mask")
            if tuple(key_valid.shape) != (batch, kv_len):
                raise ValueError(f"key_valid has shape {tuple(key_valid.shape)} but "
                                 f"the keys are [B, Tk] = [{batch}, {kv_len}] (with a cache, Tk "
                                 f"counts cached keys too); True = real key")
            parts.append(real_keys(key_valid))
        if not parts:
            return None
        combined = parts[0]
        for part in parts[1:]:
            combined = combined & part
        return combined

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """torch's loading, refusing ``torch.nn.MultiheadAttention``'s state dict (packed
        ``in_proj_weight`` or ``q/k/v_proj_weight``), also with ``strict=False`` (which would
        load ``out_proj`` alone). The error gives code that converts it: torch's module built
        as the state dict needs (``bias``, ``kdim``/``vdim``), loaded from the entries under
        ``prefix``, copied by :meth:`from_torch`; one with ``bias_k``/``bias_v``
        (``add_bias_kv=True``), which :meth:`from_torch` refuses, is named as such."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        found = [prefix + name for name in _TORCH_MHA_PARAMETERS if prefix + name in state_dict]
        if not found or prefix + "q_proj.weight" in state_dict:
            return
        names = ", ".join(map(repr, found))
        if prefix + "bias_k" in state_dict or prefix + "bias_v" in state_dict:
            error_msgs.append(
                f"{names} are torch.nn.MultiheadAttention's parameters with add_bias_kv=True: "
                f"a learned key and value appended to every sequence, which MultiHeadAttention "
                f"has no place for (from_torch refuses them): keep torch's module for this "
                f"layer")
            return
        options = ""
        k_weight, v_weight = (state_dict.get(prefix + name)
                              for name in ("k_proj_weight", "v_proj_weight"))
        if isinstance(k_weight, torch.Tensor) and isinstance(v_weight, torch.Tensor):
            options += f", kdim={k_weight.shape[-1]}, vdim={v_weight.shape[-1]}"
        if prefix + "in_proj_bias" not in state_dict:
            options += ", bias=False"
        entries = ("state_dict" if not prefix else
                   f"{{k.removeprefix({prefix!r}): v for k, v in state_dict.items() "
                   f"if k.startswith({prefix!r})}}")
        error_msgs.append(
            f"{names} are torch.nn.MultiheadAttention's parameters; MultiHeadAttention has "
            f"q_proj, k_proj, v_proj and out_proj layers. Load the state dict into torch's "
            f"module and copy that: src = torch.nn.MultiheadAttention({self.embed_dim}, "
            f"{self.num_heads}{options}, batch_first={self.batch_first}); "
            f"src.load_state_dict({entries}); "
            f"MultiHeadAttention.from_torch(src)")

    # ---- conversion ---------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, backend: str = "auto") -> "MultiHeadAttention":
        """A copy of ``torch.nn.MultiheadAttention`` (weights, biases, dropout, dtype, device).

        Handles the packed ``in_proj_weight`` and the separate ``q/k/v_proj_weight`` layouts
        (the latter when kdim/vdim differ from embed_dim), biases where the source has them,
        and each parameter's ``requires_grad``. A torch state_dict (``in_proj_weight``,
        ``out_proj.weight``, ...) does not load here (``in_proj_weight`` is ``q_proj.weight``,
        ``k_proj.weight`` and ``v_proj.weight``): load it into the torch module and copy that,
        ``src.load_state_dict(sd); MultiHeadAttention.from_torch(src)``.

        The copy's outputs and gradients are the source's, called the attnkit way:

        - the same layout: ``batch_first`` is the source's (``[T, B, E]`` for torch's default);
        - it returns ``(out, weights, cache)``; weights only with ``need_weights=True`` (torch's
          default), per head ``[B, H, Tq, Tk]`` (``weights.mean(1)`` is torch's default
          average), before dropout (torch's are after);
        - bool masks mean True = may attend: ``mask=~attn_mask``,
          ``key_valid=~key_padding_mask``; a float ``attn_mask`` is ``mask=attn_mask``, a float
          ``key_padding_mask [B, Tk]`` is ``mask=key_padding_mask[:, None, None]``, and a
          per-head ``attn_mask [B*H, Tq, Tk]`` is ``attn_mask.view(B, H, Tq, Tk)``;
        - torch's ``is_causal`` is a hint that ``attn_mask`` is causal; here
          ``is_causal=True`` alone is the causal mask, and with ``mask`` both apply;
        - a query row with every key masked gets attention output 0 (torch's may be NaN).

        Raises:
            ValueError: ``add_bias_kv=True`` (no learned extra key/value here) or
                ``add_zero_attn=True`` (attnkit's ``sinks`` at each call instead: see the
                message).
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if hasattr(module, "linear_Q"):  # torch.ao.nn.quantizable: its own projections
            raise TypeError(f"from_torch copies torch.nn.MultiheadAttention; "
                            f"{type(module).__name__} (eager-mode quantization's module) "
                            f"projects with its own linear_Q/K/V layers and computes "
                            f"otherwise: copy the float module it was made from")
        if module.bias_k is not None or module.bias_v is not None:
            raise ValueError("from_torch: add_bias_kv=True appends a learned key and value "
                             "(bias_k, bias_v) to every sequence, which MultiHeadAttention "
                             "has no place for: keep torch's module for this layer (an "
                             "untrained one can be built with add_bias_kv=False)")
        if module.add_zero_attn:
            raise ValueError(f"from_torch: add_zero_attn=True appends a zero key and value to "
                             f"every head, which is attnkit's sinks with logit 0: copy the "
                             f"module with add_zero_attn=False (module.add_zero_attn = False; "
                             f"its parameters are the same) and pass mask=attnkit.sinks("
                             f"torch.zeros({module.num_heads})) at every call (& any other "
                             f"mask); the weights then lack torch's last (zero key) column")
        e = module.embed_dim
        weights = (module.in_proj_weight.split(e, dim=0)  # packed [3E, E]: rows q, k, v
                   if module.in_proj_weight is not None else
                   (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight))
        biases = [None] * 3 if module.in_proj_bias is None else module.in_proj_bias.split(e)
        sources = [*zip(weights, biases), (module.out_proj.weight, module.out_proj.bias)]
        ref = module.out_proj.weight
        copy = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                   bias=any(b is not None for _, b in sources), kdim=module.kdim,
                   vdim=module.vdim, backend=backend, batch_first=module.batch_first,
                   device=ref.device, dtype=ref.dtype)
        projections = (copy.q_proj, copy.k_proj, copy.v_proj, copy.out_proj)
        with torch.no_grad():
            for proj, (weight, bias) in zip(projections, sources):
                proj.weight.copy_(weight)
                proj.weight.requires_grad_(weight.requires_grad)
                if bias is None:
                    proj.bias = None
                else:
                    proj.bias.copy_(bias)
                    proj.bias.requires_grad_(bias.requires_grad)
        copy.train(module.training)
        return copy


# ---------------------------------------------------------------------------------------------
# Additive (Bahdanau) attention
# ---------------------------------------------------------------------------------------------
class AdditiveAttention(nn.Module):
    """Additive attention (Bahdanau et al., 2015): ``score(q, k) = vᵀ tanh(W_q q + W_k k + b)``.

    The weights are the softmax of the scores over the keys (masked keys excluded) and the
    output is their average of the values: ``out = weights @ values``.

    Parameters: ``query_proj`` (W_q, ``query_dim → hidden_dim``, no bias), ``key_proj``
    (W_k and b, ``key_dim → hidden_dim``) and ``score_proj`` (vᵀ, ``hidden_dim → 1``, no bias).

    Args:
        query_dim, key_dim: Dq and Dk, widths of queries and keys.
        hidden_dim: width of the tanh layer.
        value_dim: optional Dv; when given, ``values`` must have this width (checked).
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int,
                 value_dim: Optional[int] = None, *, device=None, dtype=None):
        super().__init__()
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim),
                            ("hidden_dim", hidden_dim)):
            _check_positive_int(name, value)
        if value_dim is not None:
            _check_positive_int("value_dim", value_dim)
        self.query_dim, self.key_dim, self.hidden_dim, self.value_dim = (
            query_dim, key_dim, hidden_dim, value_dim)
        factory = dict(device=device, dtype=dtype)
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False, **factory)
        self.key_proj = nn.Linear(key_dim, hidden_dim, bias=True, **factory)
        self.score_proj = nn.Linear(hidden_dim, 1, bias=False, **factory)

    def extra_repr(self) -> str:
        return (f"query_dim={self.query_dim}, key_dim={self.key_dim}, hidden_dim={self.hidden_dim}"
                f", value_dim={self.value_dim}")

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: MaskLike = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend from each query to the keys.

        Args:
            query: ``[B, Tq, Dq]`` (or unbatched ``[Tq, Dq]``).
            keys: ``[B, Tk, Dk]``; values: ``[B, Tk, Dv]`` (same rank as ``query``).
            mask: ``None``; a bool tensor broadcastable to ``[B, Tq, Tk]``, **True = may
              attend**; a float tensor added to the scores (−inf = masked); or an attnkit mask
              (``causal()``, ``padding(kv_lengths=...)``, ...), evaluated over
              ``MaskSpace(B, 1, Tq, Tk)``.

        Returns:
            ``(out [B, Tq, Dv], weights [B, Tq, Tk])``. A query whose keys are all masked
            gets weights 0 and output 0 (never NaN), with zero gradients.
        """
        unbatched = self._check_inputs(query, keys, values)
        if unbatched:
            query, keys, values = query[None], keys[None], values[None]
        batch, q_len, _ = query.shape
        kv_len = keys.shape[1]

        hidden = self.query_proj(query)[:, :, None, :] + self.key_proj(keys)[:, None, :, :]  # [B, Tq, Tk, Hd]
        scores = self.score_proj(torch.tanh(hidden)).squeeze(-1)  # [B, Tq, Tk]
        allowed, bias = self._dense_mask(mask, batch, q_len, kv_len, query.device)
        work = accum_dtype(scores.dtype)  # a bias is added there too, as attention() adds it
        scores = scores.to(work) if bias is None else scores.to(work) + bias.to(work)
        weights, _ = masked_softmax(scores, allowed)  # [B, Tq, Tk]
        weights = weights.to(values.dtype)
        if allowed is not None:  # values no query may weigh (padding) are never read: 0 · NaN
            seen = allowed[(None,) * (3 - allowed.dim())].any(-2)  # [B|1, Tk]
            values = zero_outside(values, seen[..., None])
        out = weights @ values  # [B, Tq, Dv]
        if unbatched:
            return out[0], weights[0]
        return out, weights

    if TYPE_CHECKING:  # calling the module runs forward (nn.Module's __call__ returns Any)
        __call__ = forward

    def _check_inputs(self, query, keys, values) -> bool:
        for name, t in (("query", query), ("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not (query.is_floating_point() and query.dtype == keys.dtype == values.dtype):
            raise TypeError(f"query, keys and values must share one floating-point dtype, got "
                            f"{query.dtype}, {keys.dtype}, {values.dtype}: cast with .to(query)")
        where = f"query {tuple(query.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}"
        if not query.dim() == keys.dim() == values.dim() or query.dim() not in (2, 3):
            raise ValueError(f"query, keys and values must all be [B, T, D] (or all unbatched "
                             f"[T, D]); got {where}")
        if query.shape[-1] != self.query_dim or keys.shape[-1] != self.key_dim:
            raise ValueError(f"query width must be query_dim={self.query_dim} and keys width "
                             f"key_dim={self.key_dim}; got {where}")
        if self.value_dim is not None and values.shape[-1] != self.value_dim:
            raise ValueError(f"values width must be value_dim={self.value_dim}; got {where}")
        if keys.shape[-2] != values.shape[-2]:
            raise ValueError(f"keys and values must have the same length Tk; got {where}")
        if query.dim() == 3 and not query.shape[0] == keys.shape[0] == values.shape[0]:
            raise ValueError(f"query, keys and values must share the batch size; got {where}")
        _check_dtypes(self, (("query", query), ("keys", keys)))
        return query.dim() == 2

    @staticmethod
    def _dense_mask(mask: MaskLike, batch: int, q_len: int, kv_len: int, device,
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``mask`` as (allowed bool, additive bias) tensors broadcastable to ``[B, Tq, Tk]``."""
        if mask is None:
            return None, None
        target = (batch, q_len, kv_len)
        if isinstance(mask, torch.Tensor):
            if mask.dtype != torch.bool and not mask.is_floating_point():
                raise TypeError(f"mask must be a bool tensor (True = may attend), a float bias or "
                                f"an attnkit mask, got {mask.dtype}")
            if mask.dim() > 3 or any(s not in (1, t) for s, t in zip(mask.shape[::-1], target[::-1])):
                raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the "
                                 f"scores [B, Tq, Tk] = {list(target)}")
            if mask.dtype == torch.bool:
                return mask.to(device), None
            values = mask.to(device)
            allowed = ~torch.isneginf(values)
            return allowed, values.masked_fill(~allowed, 0.0)
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a bool tensor (True = may attend), a float bias or an "
                            f"attnkit mask, got {type(mask).__name__}")
        if mask.modifies:
            raise TypeError(f"mask {mask!r} holds a score modifier (softcap, alibi, …): they "
                            f"change scaled dot-product scores, and additive attention has "
                            f"none; pass the masks alone")
        space = MaskSpace(batch=batch, heads=1, q_len=q_len, kv_len=kv_len, device=device)
        problems = mask.check(space)
        if problems:
            raise ValueError("mask does not fit [B, Tq, Tk] = " + str(list(target)) + ":\n  "
                             + "\n  ".join(problems))
        allowed = mask.to_dense(space)[:, 0]  # [Bm, Tq, Tk]
        bias = mask.dense_bias(space)
        return allowed, None if bias is None else bias[:, 0]


def _per_sequence_step(mask: MaskLike) -> bool:
    """Whether :meth:`PagedKVCache.attend` aligns ``mask`` to each sequence: none, a
    bottom-right band (causal, a window: the new queries are each sequence's last), softcap
    and sinks. ALiBi and relative biases read the gathered keys' positions there, like any
    other mask: those steps read the gathered keys, checked by :func:`_check_positions`."""
    if mask is None:
        return True
    rest, modifiers = split(as_mask(mask))
    if rest is not None and (rest.band() is None or rest.band().align != "bottom_right"):
        return False  # (a top-left band would start at each sequence's first key)
    return modifiers is None or not (modifiers.functions or modifiers.relative
                                     or modifiers.alibi)


def _bands(mask: Optional[Mask]) -> list[Mask]:
    """The bands (causal, windows) in ``mask``: the leaves of its ``&`` chain that are bands,
    and those inside its ``|`` and ``~`` parts."""
    found = []
    for leaf in [] if mask is None else mask.leaves():
        if leaf.band() is not None:
            found.append(leaf)
        elif isinstance(leaf, (masks._Or, masks._Not)):
            found.extend(band for part in leaf.parts for band in _bands(part))
    return found


def _check_positions(mask: Mask, cache: Union[KVCache, PagedKVCache],
                     lengths: Union[torch.Tensor, Sequence[int], None], width: int) -> None:
    """A ``ValueError`` where ``mask``'s positions would not be the sequences' own over
    ``cache`` (before this call's append of ``width`` positions, ``lengths`` real per
    sequence). Bands (causal, windows), relative biases and ALiBi with sinks read positions
    of the cache's buffer (or of the gathered keys), aligned to its end: right for every
    sequence only when all held as many keys before the append (and, paged, some sequence
    fills the chunk, whose end is then the gathered keys' end); and a top-left
    alignment counts the new queries from 0, wrong once the cache holds keys. ALiBi alone
    is off by a constant per row there, which softmax ignores (allowed); so are masks
    without positions (dense, bias, padding). Reads the cache's lengths on the host only
    when the mask holds something that reads positions."""
    rest, modifiers = split(mask)
    off = [] if modifiers is None else [*modifiers.relative,
                                        *(modifiers.alibi if modifiers.sinks else ())]
    parts = [*off, *_bands(rest)]  # what reads positions, each with its alignment
    if not parts:
        return
    paged = isinstance(cache, PagedKVCache)
    if paged:
        held = list(cache.lengths)
    else:
        held = [cache.length] if cache.lengths is None else cache.lengths.tolist()
    ends_early = (not paged and cache.lengths is not None and cache.length
                  and held[0] != cache.length)  # (with equal sequences: checked below)
    if not any(held):
        held = [0]  # an empty cache: positions are the call's own (its first append)
    what = repr(parts[0]) + (" with sinks" if off and off[0].kind == "alibi" else "")
    per_step = (" (a PagedKVCache step with a bottom-right band runs per sequence, but not "
                "with need_weights, key_valid, dropout or under attnkit.invariant())" if paged
                else "")
    if len(set(held)) > 1:
        raise ValueError(
            f"{what} over a cache whose sequences hold different numbers of keys: it reads "
            f"positions of the cache's buffer, not each sequence's own, so a shorter "
            f"sequence's rows would be wrong. Pass is_causal=True for causal attention (the "
            f"cache aligns it per sequence); keep sequences of different lengths in caches of "
            f"their own for windows and position biases, or pass their bias as a tensor "
            f"(attnkit.bias){per_step}")
    if ends_early and (held[0] or any(part.align != "top_left" for part in parts)):
        raise ValueError(
            f"{what} over a cache whose sequences hold {held[0]} keys in a buffer of "
            f"{cache.length} positions (a chunk appended with lengths below its width leaves "
            f"its padding at the buffer's end): it reads positions of the buffer, aligned to "
            f"its end, so every row would be off. Pass is_causal=True for causal attention "
            f"(the cache aligns it per sequence); for windows and position biases append "
            f"chunks without padding")
    top_left = [part for part in parts if part.align == "top_left"]
    # a paged cache gathers each sequence's keys up to the longest: a chunk no sequence fills
    # ends them before the chunk does, which moves a bottom-right alignment
    chunk = (None if not paged or lengths is None
             else lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths))
    if chunk is not None and max(chunk, default=width) != width and len(top_left) < len(parts):
        aligned = next(part for part in parts if part.align != "top_left")
        raise ValueError(
            f"{aligned!r} over a PagedKVCache chunk of {width} positions that no sequence fills "
            f"(lengths {chunk}): the gathered keys end before the chunk does, so a "
            f"bottom-right alignment would be off; pad the chunk to the longest sequence"
            f"{per_step}")
    if top_left and held[0]:
        raise ValueError(
            f"{top_left[0]!r} with a cache that holds {held[0]} keys: the new queries are the "
            f"last positions, but align='top_left' counts them from 0; pass "
            f"align='bottom_right' (or is_causal=True for causal attention)")
