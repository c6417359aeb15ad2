"""Hugging Face transformers backend: ``attn_implementation="attnkit"``.

::

    import attnkit.integrations.transformers as ak_hf
    ak_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

:func:`register` adds two functions to transformers under the name ``"attnkit"``:

- a *mask function* (``AttentionMaskInterface``), called once per forward pass and per layer
  type by transformers' mask creation (``create_causal_mask``, ``create_bidirectional_mask``,
  ``create_sliding_window_causal_mask``, ...). It turns what transformers describes (the
  2-D padding mask, the cache's query and key offsets, the mask pattern) into a structured
  attnkit mask, handed to every attention layer as a :class:`TransformersMask`. A name
  without a registered mask function gets no mask at all from transformers (padding would be
  lost), hence both registrations.
- an *attention function* (``AttentionInterface``), called by every attention layer with
  ``query [B, Hq, Tq, D]``, ``key``/``value [B, Hkv, Tk, D]`` (Hq a multiple of Hkv: GQA runs
  without repeating K/V), returning ``(out [B, Tq, Hq, Dv], weights [B, Hq, Tq, Tk] or None)``.

How transformers' patterns become attnkit masks (``q``/``kv``: absolute positions, i.e. the
call's index plus the cache's query/key offset):

=====================================  ===================================================
transformers                           attnkit
=====================================  ===================================================
causal (``kv ≤ q``)                    ``causal()``; with a cache ``causal("bottom_right")``
                                       or a window with ``right`` = the offset; nothing at
                                       all when every key is visible (decoding)
sliding window ``w`` (``q - w < kv``)  ``sliding_window(w - 1)``: ``w`` keys, the query's
                                       own included
bidirectional                          no mask
bidirectional window ``w``             ``sliding_window(w, w)``
chunked attention (chunk ``c``)        ``documents`` of the chunk numbers, ``& causal``
packed sequences (``position_ids``     ``documents(sequence ids) & causal()``; the
restarting, no padding mask)           attention function also keeps them apart when
                                       transformers' mask does not (with a cache), from
                                       ``cu_seq_lens_q/k`` or ``position_ids``
2-D ``attention_mask``                 ``padding(kv_mask=...)`` on the keys (one run of real
                                       tokens per row, left or right padding); other
                                       patterns ``dense`` of the key mask ``[B, 1, 1, Tk]``
=====================================  ===================================================

Padded *query* rows are left as transformers leaves them (they attend to the real keys their
mask allows), so every real token sees the keys it sees under ``eager``; a padded row that sees
no key (left padding under causal) gives 0, as under ``sdpa`` (``eager`` spreads uniform
weights over the masked keys there). Patterns are recognised by the names
of transformers' own mask functions (``masking_utils``) and the values they close over. One
this module does not recognise (a model's own ``or_mask_function``/``and_mask_function``,
block-wise overlays, a renamed function in another transformers release) becomes ``dense``
of the boolean mask transformers itself builds for ``"sdpa"``: exact, at ``O(B·Tq·Tk)``
memory (the ``attnkit`` logger says so at DEBUG level).

Logit softcapping (Gemma 2's ``attn_logit_softcapping``, the call's ``softcap=``) runs as
``attnkit.softcap``, learned attention sinks (gpt-oss's ``s_aux=``, ``sinks=``) as
``attnkit.sinks``. Features attnkit does not compute raise ``NotImplementedError`` naming them:
sparse-attention index selections. Dropout in training is attnkit's ``dropout_p``.

Sequence parallelism (:func:`sequence_parallel`): inside ``with sequence_parallel(sp):``
every attention call of the model runs ``ring_attention`` or ``ulysses_attention`` over
``sp.group``, each rank feeding its shard of the sequence::

    sp = SequenceParallel(kind="ring")                      # attnkit.distributed.parallel
    ids = sp.shard(input_ids, dim=1)                        # [B, T/P]
    positions = sp.shard(position_ids, dim=1)               # global positions, [B, T/P]
    targets = sp.shard(next_tokens, dim=1)                  # labels shifted on the WHOLE row
    with sequence_parallel(sp):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (loss / global_token_count).backward()                  # then all-reduce (sum) the grads

What each rank shards, cut by ``sp.shard`` (the same layout for all): ``input_ids``,
``position_ids`` (REQUIRED: the positions of the whole row, e.g. restarting at 0 for each
packed document; without them each rank would number its shard from 0) and the targets.
The targets are shifted on the whole row before sharding (``targets[t] = input_ids[t + 1]``,
``-100`` at the row's end and where a packed document ends), since the model's own
``labels=`` shifts within each shard; so the loss is computed from the logits: each rank's
summed token loss, divided by the global count of targets that are not ``-100``. Its
all-reduced sum is the single-process mean loss, and the parameter gradients summed over the
ranks (``dist.all_reduce``) are the single-process ones (DDP and FSDP average gradients
instead: multiply each rank's loss by P there).

The mask is that of the whole sequence: by default causal (for causal layers) and, for a
batch of one whose global ``position_ids`` do not run on by one, the packed documents they
delimit (the ranks exchange their ``position_ids`` once per forward pass), as transformers'
own mask delimits them in one process without a cache. Anything
else (padding, sliding windows, chunked attention) is given as ``mask=``, the attnkit mask
of the whole sequence; a 2-D ``attention_mask`` is refused under sequence parallelism.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.masks import UNBOUNDED, Mask, as_mask, keeping, readable, real_keys
from attnkit.threadlocal import setting

try:
    import transformers
    from transformers import masking_utils
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("attnkit.integrations.transformers needs Hugging Face transformers: "
                      "pip install 'attnkit[transformers]'") from error
try:  # where transformers records the outputs a forward pass was asked for
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:  # pragma: no cover - versions that pass output_attentions to every call
    _COLLECTOR = None

if TYPE_CHECKING:  # torch.distributed loads only when sequence parallelism is used
    from attnkit.distributed.parallel import SequenceParallel

__all__ = ["NAME", "register", "attention_forward", "mask_forward", "TransformersMask",
           "sequence_parallel"]

NAME = "attnkit"
"""The ``attn_implementation`` name :func:`register` adds."""

_log = logging.getLogger("attnkit")

_UNSUPPORTED = {
    "indices": "sparse attention over selected key indices",
    "block_indices": "sparse attention over selected key blocks",
}
"""Keyword arguments of transformers' attention calls that change the computation in ways
attnkit does not implement, with the feature each one names. Present and not ``None``, they
raise instead of being ignored."""


_PARALLEL = threading.local()
"""``_PARALLEL.active``: the ``(SequenceParallel, mask)`` of this thread's innermost
:func:`sequence_parallel` block (absent: none). Thread-local, as ``attnkit.invariant()`` is:
torch.compile traces its reads (it cannot trace a ``ContextVar``'s)."""


@contextlib.contextmanager
def sequence_parallel(parallel: "SequenceParallel",
                      mask: Union[Mask, torch.Tensor, None,
                                  dict[str, Union[Mask, torch.Tensor, None]]] = None,
                      ) -> Iterator["SequenceParallel"]:
    """Within the block, every ``attn_implementation="attnkit"`` attention call attends
    across the ranks of ``parallel`` (ring, Ulysses or hybrid, as ``parallel.kind`` says).

    Each rank calls the model on its shard of the sequence, cut by ``parallel.shard(x,
    dim=1)``: ``input_ids [B, T/P]`` with ``position_ids [B, T/P]`` (the shard of the whole
    row's positions; required), ``use_cache=False``, no ``attention_mask``. Each attention
    layer then receives ``query [B, Hq, T/P, D]``, ``key``/``value [B, Hkv, T/P, D]`` and
    returns this rank's rows ``[B, T/P, Hq, D]`` of attention over the whole sequence.

    ``mask``: the attnkit mask of the WHOLE sequence ``[B, H, T, T]`` (the same on every
    rank), used by every layer; or a dict from layer kind to such a mask (or ``None``), for
    models whose layers differ (``config.layer_types``: ``"full_attention"``,
    ``"sliding_attention"``, ...), which refuse a single mask. ``None``: causal for causal
    layers (none for the others), ``& documents`` of the packed sequences when a batch of one
    has global ``position_ids`` that do not run on by one; layers with a sliding window and
    2-D padding masks then raise ``ValueError`` (pass their mask here). The backward runs
    after the block as well; with gradient checkpointing (which reruns the forward) run it
    inside. Every rank must run the same forward and backward passes (the collectives pair
    up across ranks).
    """
    from attnkit.distributed.parallel import SequenceParallel

    if not isinstance(parallel, SequenceParallel):
        raise TypeError(f"sequence_parallel takes an attnkit.distributed.parallel."
                        f"SequenceParallel (e.g. SequenceParallel(kind='ring')), got "
                        f"{type(parallel).__name__}")
    given = mask.values() if isinstance(mask, dict) else (mask,)
    if not all(m is None or isinstance(m, (Mask, torch.Tensor)) for m in given) or (
            isinstance(mask, dict) and not all(isinstance(kind, str) for kind in mask)):
        raise TypeError(f"sequence_parallel(mask=...) takes an attnkit mask of the whole "
                        f"sequence (or a tensor attnkit.attention accepts), or a dict from "
                        f"layer kind (config.layer_types) to such masks, got {mask!r:.80}")
    with setting(_PARALLEL, "active", (parallel, mask)):
        yield parallel


def register() -> None:
    """Register ``"attnkit"`` with transformers: the attention function
    (``AttentionInterface``) and the mask function (``AttentionMaskInterface``). Then
    ``from_pretrained(..., attn_implementation="attnkit")``, ``from_config(...)`` and
    ``model.set_attn_implementation("attnkit")`` accept the name. Calling it again changes
    nothing."""
    transformers.AttentionInterface.register(NAME, attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, mask_forward)


class TransformersMask:
    """The mask every attention layer of one type receives for one forward pass: an attnkit
    mask (or ``None``: every key visible) for ``q_len`` queries against ``kv_len`` keys, batch
    ``batch``. ``structured`` is False when the pattern was not recognised and ``mask`` is
    ``ak.dense`` of transformers' own boolean mask ``[B, 1, q_len, kv_len]``.

    ``packed``: the mask already keeps packed sequences apart (transformers recognised them
    from ``position_ids``); ``padded``: transformers passed a 2-D padding mask. The attention
    function reads both to decide whether the packed-sequence boundaries it receives still
    need applying.

    ``shape`` (``(batch, 1, q_len, kv_len)``) and ``ndim`` (4) answer the questions
    transformers asks of a prepared 4-D mask, so a mask built ahead of the forward pass (as
    ``generate`` does for static caches) is passed through unchanged. A run of query rows,
    ``mask[:, :, rows, :]`` (a model that keeps only the last rows, as Gemma 4's shared-KV
    layers do), is the mask of those queries, made again by ``rows(start, count)``.

    :meth:`_for_keys` is the mask of the same queries against another key count, for a layer
    that holds every key of the sequence where transformers sized the mask from a layer that
    holds fewer (MiniMax's cache sizes it from its first layer, a linear-attention one),
    made again by ``keys(count)``."""

    ndim = 4

    def __init__(self, mask: Optional[Mask], batch: int, q_len: int, kv_len: int, *,
                 structured: bool = True, packed: bool = False, padded: bool = False,
                 rows: Optional[Callable[[int, int], "TransformersMask"]] = None,
                 keys: Optional[Callable[[int], Optional["TransformersMask"]]] = None):
        self.mask, self.batch, self.q_len, self.kv_len = mask, batch, q_len, kv_len
        self.structured, self.packed, self.padded = structured, packed, padded
        self._rows, self._keys = rows, keys
        self._plans: dict = {}
        self._resized: dict = {}

    def _for_keys(self, kv_len: int) -> Optional["TransformersMask"]:
        """The mask of the same ``q_len`` queries against ``kv_len`` keys that are the whole
        sequence so far (the queries its last ``q_len``), as a layer whose cache keeps every
        key attends; ``None`` where that is not known: only a mask given a 2-D padding mask
        of exactly ``kv_len`` tokens can say so (it numbers the sequence's tokens). Made once
        per key count and kept."""
        if kv_len == self.kv_len:
            return self
        if kv_len not in self._resized:
            self._resized[kv_len] = None if self._keys is None else self._keys(kv_len)
        return self._resized[kv_len]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: Optional[float]) -> torch.Tensor:
        """``attnkit.attention(query, key, value, self.mask, scale=scale)`` through a plan
        (:func:`attnkit.plan`) kept on this mask: the mask function makes one mask per forward
        pass, so the first layer of each signature plans the call (validation, the backend's
        choice, what is derived from the mask's values) and the others only run it. Without a
        mask (the call cache serves every step alike), under ``torch.autocast``, inside a
        compiled region or under a dispatch mode (:func:`~attnkit.masks.keeping`), the call
        itself."""
        if (self.mask is None or torch.compiler.is_compiling() or not keeping()
                or torch.is_autocast_enabled(query.device.type)):
            return ak.attention(query, key, value, self.mask, scale=scale)
        signature = (scale, ak.Plan.signature_of(query, key, value))
        plan = self._plans.get(signature)
        if plan is None or plan.stale():  # (a mask kept across passes, written in place)
            plan = self._plans[signature] = ak.plan(query, key, value, self.mask, scale=scale)
        return plan._run(query, key, value)  # the plan fits: it is kept by its signature

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, 1, q_len, kv_len)``: what transformers reads of a prepared 4-D mask."""
        return (self.batch, 1, self.q_len, self.kv_len)

    def __repr__(self) -> str:
        kind = "" if self.structured else ", dense fallback"
        return f"TransformersMask({self.mask!r}, {list(self.shape)}{kind})"

    def __getitem__(self, index) -> "TransformersMask":
        """``mask[:, :, rows]`` or ``mask[:, :, rows, :]`` for a slice ``rows`` of unit step:
        the mask of those queries; any other index is a tensor use (``TypeError``)."""
        index = index if isinstance(index, tuple) else (index,)
        whole = slice(None)
        if (len(index) in (3, 4) and index[:2] == (whole, whole) and index[3:] in ((), (whole,))
                and isinstance(index[2], slice) and index[2].step in (None, 1)):
            start, stop, _ = index[2].indices(self.q_len)
            count = max(stop - start, 0)
            if count == self.q_len:
                return self
            if self._rows is not None:
                return self._rows(start, count)
        raise TypeError(f"the attnkit mask takes only a run of query rows, mask[:, :, a:b], "
                        f"as an index (got {index!r}): {_TENSOR_USE}")

    # A model that uses the mask as a tensor instead of handing it to the attention function
    # (Falcon with alibi=True and BLOOM add their ALiBi bias to it) gets a message that says
    # so, not a missing attribute or operand of a private class.
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the attnkit mask has no attribute {name!r}: {_TENSOR_USE}")

    def _as_tensor(self, *_):
        raise TypeError(f"the attnkit mask is not a tensor: {_TENSOR_USE}")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _as_tensor
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __neg__ = _as_tensor


_TENSOR_USE = ("this model uses its attention mask as a tensor (as Falcon with alibi=True "
               "and BLOOM do, adding their ALiBi bias to it, and models that compute "
               "attention themselves, such as XGLM and MPNet) instead of passing it to "
               "transformers' attention function, so attnkit cannot run its attention; load "
               "it with attn_implementation='eager' (or 'sdpa' where the model supports it)")


# ---- the mask function -----------------------------------------------------------------------
def mask_forward(batch_size: int, q_length: int, kv_length: int,
                 q_offset: Union[int, torch.Tensor] = 0, kv_offset: Union[int, torch.Tensor] = 0,
                 mask_function: Optional[Callable] = None,
                 attention_mask: Optional[torch.Tensor] = None, use_vmap: bool = False,
                 device: Union[torch.device, str] = "cpu", **kwargs,
                 ) -> Optional[TransformersMask]:
    """transformers' mask-interface call → :class:`TransformersMask`.

    ``None`` where transformers allows it (``allow_is_bidirectional_skip``), the mask holds
    every key for every query and no 2-D mask is given, as its ``sdpa`` mask does: the
    attention function then gets ``None`` (or the model's own bias, which it adds to "no
    mask").

    Args (as transformers passes them): ``q_length``/``kv_length`` the query and key counts of
    the attention calls; ``q_offset``/``kv_offset`` the absolute position of the first query
    and key (the cache length, and for sliding-window caches the first key kept);
    ``mask_function(b, h, q, kv) -> bool`` the pattern on absolute positions;
    ``attention_mask`` the 2-D padding mask ``[B, ≥ kv_offset + kv_length]`` (True = real
    token; shorter masks count the missing keys as padding) or ``None``. Other keyword
    arguments (``local_size``, ``allow_is_causal_skip``, ``dtype``, ``config``, ...) are
    accepted and not needed.
    """
    if isinstance(attention_mask, TransformersMask):  # built ahead by generate(): already ours
        if attention_mask.shape != (batch_size, 1, q_length, kv_length):
            raise ValueError(f"a prepared attnkit mask of shape {attention_mask.shape} was passed "
                             f"for an attention of shape {(batch_size, 1, q_length, kv_length)}")
        return attention_mask
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        # a tensor made under inference mode has no version counter, so every layer's call
        # would key the mask's tensors by content (a host read each, a device sync on GPU);
        # the tensors made here, from the model's, are the mask's own and get one
        with torch.inference_mode(False):
            return mask_forward(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function, attention_mask, use_vmap, device, **kwargs)
    if mask_function is None:
        mask_function = masking_utils.causal_mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    padded = attention_mask is not None

    def rows(start: int, count: int) -> TransformersMask:  # the queries [start, start + count)
        return mask_forward(batch_size, count, kv_length, q_offset + start, kv_offset,
                            mask_function, attention_mask, use_vmap, device, **kwargs)

    def keys(count: int) -> Optional[TransformersMask]:  # the sequence's first `count` keys
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                and attention_mask.shape[-1] == count >= q_length):
            return None
        return mask_forward(batch_size, q_length, count, count - q_length, 0, mask_function,
                            attention_mask, use_vmap, device, **kwargs)

    try:
        mask, packed = _structured(q_length, kv_length, q_offset, kv_offset, mask_function,
                                   attention_mask)
        if mask is None and not padded and kwargs.get("allow_is_bidirectional_skip"):
            # as sdpa's: a model may add its own bias to "no mask" (BEiT); not with a 2-D mask
            # given, whose rows are then never read as packed (see _packed)
            return None
        return TransformersMask(mask, batch_size, q_length, kv_length, packed=packed,
                                padded=padded, rows=rows, keys=keys)
    except _NotStructured:
        if not torch.compiler.is_compiling():  # dynamo traces no logger call
            _log.debug("transformers mask %s (q_offset %d, kv_offset %d): no structured "
                       "translation, using transformers' dense mask",
                       getattr(mask_function, "__qualname__", mask_function), q_offset, kv_offset)
        allowed = masking_utils.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap,
            device=device)
        pattern = _read(mask_function)
        packed = pattern is not None and any(g[0] == "packed" for g in pattern.groups)
        mask = ak.dense(allowed)
        try:  # the padding too (already in the dense mask): where each row's keys begin, which
            real = _key_padding(attention_mask, kv_length, kv_offset)  # the invariance
        except _NotStructured:  # contract's key blocks start from (left padding)
            real = None
        return TransformersMask(mask if real is None else mask & real, batch_size, q_length,
                                kv_length, structured=False, packed=packed, padded=padded,
                                rows=rows, keys=keys)


class _NotStructured(Exception):
    """The pattern has no exact structured translation: build transformers' dense mask."""


@dataclass
class _Pattern:
    """A recognised pattern: keys with ``lo ≤ kv - q ≤ hi`` (absolute positions), within the
    same group for every entry of ``groups`` (``("packed", ids [B, T])`` or ``("chunk", size,
    left_padding [B])``). ``positions`` ``[B|1, T]``: the band was written on these position
    ids (packed sequences), not on indices."""

    lo: float = -math.inf
    hi: float = math.inf
    groups: tuple = ()
    positions: Optional[torch.Tensor] = None


def _free_variables(fn: Callable) -> dict:
    cells = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def _window(value) -> Optional[int]:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read(fn: Callable) -> Optional[_Pattern]:
    """The pattern of one of transformers' own mask functions (read from its name and the
    values it closes over), or ``None`` for anything else; inside a compiled region only the
    functions without a closure (causal, bidirectional) are read."""
    if getattr(fn, "__module__", None) != masking_utils.__name__:
        return None
    # (by identity: dynamo compares a function's traced __qualname__ unequal to its text)
    if fn is getattr(masking_utils, "causal_mask_function", None):
        return _Pattern(hi=0)
    if fn is getattr(masking_utils, "bidirectional_mask_function", None):
        return _Pattern()
    name = getattr(fn, "__qualname__", "")
    if torch.compiler.is_compiling():  # dynamo cannot read a closure's cells: the dense mask
        return None
    free = _free_variables(fn)
    if name == "sliding_window_overlay.<locals>.inner_mask":
        window = _window(free.get("sliding_window"))
        return None if window is None else _Pattern(lo=1 - window)
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        window = _window(free.get("sliding_window"))
        return None if window is None else _Pattern(lo=-window, hi=window)
    if name == "chunked_overlay.<locals>.inner_mask":
        size, left = _window(free.get("chunk_size")), free.get("left_padding")
        if size is None or size <= 0 or not isinstance(left, torch.Tensor) or left.dim() != 1:
            return None
        return _Pattern(groups=(("chunk", size, left),))
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        ids = free.get("packed_sequence_mask")
        ok = isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()
        return _Pattern(groups=(("packed", ids),)) if ok else None
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner, positions = _read(free.get("mask_function")), free.get("position_ids")
        if inner is None or inner.groups or inner.positions is not None:
            return None
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            return None
        return _Pattern(inner.lo, inner.hi, positions=positions)
    if name in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"):
        parts = [_read(f) for f in free.get("mask_functions", ())]
        if not parts or any(p is None for p in parts):
            return None
        if name.startswith("or_masks"):
            return parts[0] if len(parts) == 1 else None
        positions = [p.positions for p in parts if p.positions is not None]
        if any(p is not positions[0] for p in positions):
            return None
        return _Pattern(lo=max(p.lo for p in parts), hi=min(p.hi for p in parts),
                        groups=sum((p.groups for p in parts), ()),
                        positions=positions[0] if positions else None)
    return None


def _structured(q_len: int, kv_len: int, q_offset: int, kv_offset: int, mask_function: Callable,
                attention_mask: Optional[torch.Tensor]) -> tuple[Optional[Mask], bool]:
    """The exact attnkit mask for the call and whether it keeps packed sequences apart, or
    ``_NotStructured``."""
    pattern = _read(mask_function)
    if pattern is None:
        raise _NotStructured
    parts = [_band(pattern.lo, pattern.hi, q_offset - kv_offset, q_len, kv_len)]
    packed = [g for g in pattern.groups if g[0] == "packed"]
    if pattern.positions is not None and (
            not (torch.compiler.is_compiling() or readable(pattern.positions))  # fake, meta
            or not any(_consecutive(pattern.positions, ids) for _, ids in packed)):
        raise _NotStructured
    for group in pattern.groups:
        parts.append(_group(group, q_len, kv_len, q_offset, kv_offset))
    parts.append(_key_padding(attention_mask, kv_len, kv_offset))
    mask = None
    for part in parts:
        if part is not None:
            mask = part if mask is None else mask & part
    return mask, bool(packed)


def _band(lo: float, hi: float, shift: int, q_len: int, kv_len: int) -> Optional[Mask]:
    """Keys ``lo ≤ kv - q ≤ hi`` in absolute positions, i.e. ``lo + shift ≤ j - i ≤ hi +
    shift`` for query index ``i`` and key index ``j`` (``shift = q_offset - kv_offset``), as a
    causal or sliding-window mask; ``None`` when the band holds every key of every query;
    every key padding when it holds none (a window of 0 keys: Qwen2-MoE makes such a mask
    for the sliding layers it has none of)."""
    lo, hi = lo + shift, hi + shift
    if lo > hi:
        return ak.padding(kv_lengths=0)
    if lo <= -(q_len - 1) and hi >= kv_len - 1:
        return None
    fits = []  # (align, left, right) with j - i - diagonal within [-left, right]
    for align, diagonal in (("top_left", 0), ("bottom_right", kv_len - q_len)):
        left, right = diagonal - lo, hi - diagonal
        if left >= 0 and right >= 0:
            fits.append((align, left, right))
    if not fits:
        raise _NotStructured
    # top-left first (equal to bottom-right when Tq == Tk), but a diagonal of the band's own
    # (right == 0, e.g. causal after a cache) before a shifted one
    align, left, right = next((fit for fit in fits if fit[2] == 0), fits[0])
    if right == 0 and left == math.inf:
        return ak.causal(align)
    return ak.sliding_window(*(UNBOUNDED if b == math.inf else int(b) for b in (left, right)),
                             align=align)


def _consecutive(positions: torch.Tensor, ids: torch.Tensor) -> bool:
    """True when the packed sequence ids are runs of consecutive (non-negative) position ids,
    so a band on positions equals the band on indices within a sequence."""
    if positions.shape[-1] != ids.shape[-1] or positions.shape[0] not in (1, ids.shape[0]):
        return False
    positions = positions.to(ids.device).expand(ids.shape)
    same = ids[:, 1:] == ids[:, :-1]
    return (bool((ids[:, 1:] >= ids[:, :-1]).all()) and bool((positions >= 0).all())
            and torch.equal(same, positions[:, 1:] - positions[:, :-1] == 1))


def _group(group: tuple, q_len: int, kv_len: int, q_offset: int, kv_offset: int) -> Mask:
    """``documents`` for a packed-sequence or chunked-attention group."""
    if group[0] == "packed":
        ids = group[1]
        if q_offset or kv_offset or not q_len == kv_len == ids.shape[-1]:
            raise _NotStructured
        return ak.documents(ids)
    _, size, left = group
    q_pos = torch.arange(q_len, device=left.device) + q_offset
    kv_pos = torch.arange(kv_len, device=left.device) + kv_offset
    return ak.documents(torch.div(q_pos[None] - left[:, None], size, rounding_mode="floor"),
                        torch.div(kv_pos[None] - left[:, None], size, rounding_mode="floor"))


def _key_padding(attention_mask: Optional[torch.Tensor], kv_len: int,
                 kv_offset: int) -> Optional[Mask]:
    """The 2-D padding mask restricted to this call's keys ``[kv_offset, kv_offset + kv_len)``
    (positions past its end are padding): ``padding(kv_mask=...)`` when every row's real keys
    are one run, else ``dense [B, 1, 1, Tk]``; ``None`` when every key is real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise _NotStructured
    real = attention_mask.to(torch.bool)
    end = kv_offset + kv_len
    if real.shape[-1] < end:
        real = F.pad(real, (0, end - real.shape[-1]), value=False)
    mask = real_keys(real[:, kv_offset:end])
    return None if getattr(mask, "every_key_real", False) else mask  # read with its runs


# ---- the attention function ------------------------------------------------------------------
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor,
                      attention_mask: Union[TransformersMask, torch.Tensor, None],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs,
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' attention-interface call, run by :func:`attnkit.attention`.

    Shapes: ``query [B, Hq, Tq, D]``, ``key [B, Hkv, Tk, D]``, ``value [B, Hkv, Tk, Dv]``
    (Hq a multiple of Hkv). Returns ``out [B, Tq, Hq, Dv]`` (contiguous) and the attention
    weights ``[B, Hq, Tq, Tk]`` when the call asks ``output_attentions=True``, else ``None``
    (the weights before dropout; eager returns them after).

    ``attention_mask``: a :class:`TransformersMask` from :func:`mask_forward`; a 4-D tensor
    broadcastable to ``[B, Hq, Tq, Tk]`` (bool: True = may attend; float: added to the scores,
    as eager adds it); or ``None``, which means causal (top-left) when ``is_causal`` (or
    ``module.is_causal``) and ``Tq > 1``, as transformers' ``sdpa`` reads it. ``scaling``
    multiplies the scores (default ``1/sqrt(D)``); ``dropout`` is the dropout probability on
    the weights. ``position_bias [B|1, Hq|1, Tq, Tk]`` is added to the scaled scores. Packed
    sequences in one row (a batch of one, as ``DataCollatorWithFlattening`` makes) are kept
    apart, with or without a mask, as ``flash_attention_2`` keeps them: by
    ``cu_seq_lens_q``/``cu_seq_lens_k`` when given, else by ``position_ids`` that restart
    (without a padding mask; read once per forward pass). Inside :func:`sequence_parallel`
    the tensors are this rank's shards and the call runs across the ranks (see there).
    ``softcap`` (a float) caps the
    scaled scores (:func:`attnkit.softcap`); ``s_aux`` or ``sinks`` (``[Hq]``) are per-head
    sink logits (:func:`attnkit.sinks`).

    Raises ``NotImplementedError`` for sparse index selections (see :data:`_UNSUPPORTED`).
    """
    for name, feature in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation='attnkit' does not support {feature}: "
                f"{type(module).__name__} passed {name}=...; load this model with "
                f"attn_implementation='eager' instead")
    active = getattr(_PARALLEL, "active", None)
    if active is not None:
        return _parallel_forward(module, query, key, value, attention_mask, dropout, scaling,
                                 is_causal, *active, kwargs)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if isinstance(attention_mask, TransformersMask):
        # A hybrid model's cache may size its mask from a layer without keys (MiniMax's does):
        # a mask that holds every key of every query and pads nothing fits any key count, a
        # padded one is made again for this layer's keys (see TransformersMask._for_keys).
        free = attention_mask.mask is None and not attention_mask.padded
        resized = (attention_mask._for_keys(kv_len) if attention_mask.q_len == q_len and not free
                   else None)
        attention_mask = attention_mask if resized is None else resized
        if (attention_mask.q_len, attention_mask.kv_len) != (q_len, kv_len) and not (
                free and attention_mask.q_len == q_len):
            raise ValueError(
                f"{type(module).__name__} got an attnkit mask for {attention_mask.q_len} queries "
                f"× {attention_mask.kv_len} keys but attends {q_len} queries × {kv_len} keys "
                f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
        mask = attention_mask.mask
        if not attention_mask.packed:
            mask = _packed(kwargs, mask, query.shape[0], q_len, kv_len,
                           from_positions=not attention_mask.padded)
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = ak.causal() if causal and q_len > 1 else None
        mask = _packed(kwargs, mask, query.shape[0], q_len, kv_len, from_positions=True)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask = (ak.dense(attention_mask) if attention_mask.dtype == torch.bool
                else ak.bias(attention_mask))
        mask = _packed(kwargs, mask, query.shape[0], q_len, kv_len, from_positions=False)
    else:
        shape = getattr(attention_mask, "shape", None)
        raise TypeError(
            f"attn_implementation='attnkit' got an attention_mask of type "
            f"{type(attention_mask).__name__}{'' if shape is None else f' {tuple(shape)}'}: "
            f"expected the mask transformers builds with the attnkit mask function (call "
            f"attnkit.integrations.transformers.register() before loading the model), a 4-D "
            f"[B, H|1, Tq, Tk] tensor, or None")
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        mask = ak.bias(position_bias) if mask is None else ak.bias(position_bias) & mask
    modifiers = []
    if kwargs.get("softcap") is not None:
        modifiers.append(ak.softcap(float(kwargs["softcap"])))
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        modifiers.append(ak.sinks(sinks))
    for modifier in modifiers:
        mask = modifier if mask is None else mask & modifier
    weights_wanted = _weights_wanted(kwargs)
    if (isinstance(attention_mask, TransformersMask) and mask is attention_mask.mask
            and not dropout and not weights_wanted):  # the layers share the mask: one plan
        out = attention_mask.attend(query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    result = ak.attention(query, key, value, mask, scale=scaling, dropout_p=dropout,
                          return_weights=weights_wanted)
    out, weights = (result.out, result.weights) if weights_wanted else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _weights_wanted(kwargs: dict) -> bool:
    """Whether the forward pass asked for the attention weights: ``output_attentions`` in the
    call's keyword arguments, or, for models that take it out before their attention calls
    (GPT-2, OPT, Falcon, ...), the attentions transformers records from this pass's layers."""
    if kwargs.get("output_attentions"):
        return True
    if _COLLECTOR is None:
        return False
    if torch.compiler.is_compiling():  # dynamo cannot trace a ContextVar's read: the value
        # transformers keeps for a capture begun inside the compiled region, else none
        recorded = getattr(_COLLECTOR, "global_var", None) if getattr(
            _COLLECTOR, "compiling", False) else None
    else:
        recorded = _COLLECTOR.get()
    return isinstance(recorded, dict) and ("attentions" in recorded
                                           or "cross_attentions" in recorded)


def _packed(kwargs: dict, mask: Optional[Mask], batch: int, q_len: int, kv_len: int, *,
            from_positions: bool) -> Optional[Mask]:
    """``mask & documents(...)`` for packed sequences in one row: from the boundaries
    ``cu_seq_lens_q/k`` (``[n + 1]`` cumulative lengths) when given, else, with
    ``from_positions``, from ``position_ids [1, T]`` that restart (a sequence starts wherever
    they come back to their least value); ``mask`` itself when neither says the row is
    packed.
    The documents of one forward pass are made once and shared by its layers."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    positions = kwargs.get("position_ids") if from_positions else None
    if cu_q is None and cu_k is None:
        if (not isinstance(positions, torch.Tensor) or positions.dim() != 2 or batch != 1
                or positions.shape != (1, q_len) or q_len != kv_len or q_len < 2):
            return mask
        documents = _shared_documents((positions,),
                                      lambda: _documents_from_positions(positions))
    else:
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        if batch != 1 or q_len != kv_len or cu_q.dim() != 1 or cu_q.shape != cu_k.shape:
            raise NotImplementedError(
                f"attn_implementation='attnkit' takes cu_seq_lens_q/k only for packed "
                f"sequences without a cache: batch 1, equal query and key boundaries ending at "
                f"the sequence length (got batch {batch}, {q_len} queries, {kv_len} keys)")
        documents = _shared_documents((cu_q, cu_k),
                                      lambda: _documents_from_boundaries(cu_q, cu_k, q_len))
    if documents is None:
        return mask
    return documents if mask is None else mask & documents


_SHARED = threading.local()
"""Per thread (a forward pass runs its layers on one), the packed documents of its latest
forward pass, ``[sources, versions, documents]``: ``_SHARED.documents``, and
``_SHARED.parallel`` for the whole-sequence documents of a sequence-parallel pass."""


def _shared_documents(sources: tuple, make: Callable[[], Optional[Mask]],
                      kind: str = "documents") -> Optional[Mask]:
    """``make()``, shared by the layers of a forward pass (they receive the same ``sources``
    tensors): kept for the latest ``sources`` while they are unchanged, per thread and
    ``kind`` (:data:`_SHARED`). Inference tensors (no version counter) and compiled graphs
    are not kept: made in every layer."""
    if torch.compiler.is_compiling() or any(t.is_inference() for t in sources):
        return make()
    store = _SHARED.__dict__.setdefault(kind, [])
    versions = tuple(t._version for t in sources)
    if (store and len(store[0]) == len(sources)
            and all(a is b for a, b in zip(store[0], sources)) and store[1] == versions):
        return store[2]
    documents = make()
    store[:] = [sources, versions, documents]
    return documents


def _documents_from_positions(positions: torch.Tensor, restarts: bool = True,
                              ) -> Optional[Mask]:
    """``documents`` of ``position_ids [1, T]``; ``None`` (one host read) when they hold one
    sequence. ``restarts``: a new sequence wherever the positions come back to their least
    value (``flash_attention_2``'s rule: packed sequences all start at the same position, 0
    or a model's offset; a gap starts none), the rule where transformers built no packed
    mask (a forward pass with a cache); else wherever they do not run on by one
    (transformers' own ``find_packed_sequence_indices``, the rule of a pass without one)."""
    row = positions[0]
    starts = (row[1:] == row.min()) if restarts else (row[1:] - row[:-1] != 1)  # [T - 1]
    if not torch.compiler.is_compiling() and not bool(starts.any()):
        return None  # inside a compiled graph no value is read: one document, where unpacked
    ids = F.pad(starts.cumsum(0), (1, 0))  # [T]: the sequence of each position
    return ak.documents(ids[None])


def _documents_from_boundaries(cu_q: torch.Tensor, cu_k: torch.Tensor, length: int) -> Mask:
    """``documents`` of the boundaries ``cu_seq_lens [n + 1]`` (query and key alike, ending at
    ``length``); inside a compiled graph, checked when it runs (no value is read while
    tracing)."""
    if torch.compiler.is_compiling():
        torch._assert_async((cu_q == cu_k).all() & (cu_q[-1] == length),
                            "attn_implementation='attnkit' takes cu_seq_lens_q/k only for "
                            "packed sequences without a cache: equal query and key boundaries "
                            "ending at the sequence length")
    elif not torch.equal(cu_q, cu_k) or int(cu_q[-1]) != length:
        raise NotImplementedError(
            f"attn_implementation='attnkit' takes cu_seq_lens_q/k only for packed sequences "
            f"without a cache: equal query and key boundaries ending at the sequence length "
            f"(got cu_seq_lens_q {cu_q.tolist()}, cu_seq_lens_k {cu_k.tolist()}, {length} "
            f"positions)")
    ids = torch.searchsorted(cu_q[1:].to(torch.long),
                             torch.arange(length, device=cu_q.device), right=True)
    return ak.documents(ids[None])


# ---- sequence parallelism --------------------------------------------------------------------
_PARALLEL_UNSUPPORTED = {
    "position_bias": "a position bias [B, H, Tq, Tk] (it covers the shard only)",
    "cu_seq_lens_q": "cu_seq_lens_q/k (they describe the shard only; pass position_ids)",
    "cu_seq_lens_k": "cu_seq_lens_q/k (they describe the shard only; pass position_ids)",
}
"""Keyword arguments that describe the local shard as if it were the whole sequence, with
what each one is; :func:`sequence_parallel` refuses them."""


def _parallel_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, dropout: float,
                      scaling: Optional[float], is_causal: Optional[bool],
                      parallel: "SequenceParallel", mask: Union[Mask, torch.Tensor, None],
                      kwargs: dict) -> tuple[torch.Tensor, None]:
    """:func:`attention_forward` inside :func:`sequence_parallel`: ``query [B, Hq, T/P, D]``,
    ``key``/``value [B, Hkv, T/P, D]`` (this rank's shards) → ``(out [B, T/P, Hq, D], None)``,
    this rank's rows of attention over the whole sequence."""
    name = type(module).__name__
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if _weights_wanted(kwargs):
        raise ValueError(f"{name}: output_attentions=True under sequence_parallel: no rank "
                         f"holds whole rows of the weights; call without output_attentions")
    if q_len != kv_len:
        raise ValueError(f"{name} attends {q_len} queries to {kv_len} keys under "
                         f"sequence_parallel (query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}): each rank must attend its shard of one sequence "
                         f"to the same shard of keys; call the model with use_cache=False and "
                         f"no past_key_values")
    for keyword, what in _PARALLEL_UNSUPPORTED.items():
        if kwargs.get(keyword) is not None:
            raise ValueError(f"{name} passed {keyword}=... under sequence_parallel, which does "
                             f"not support {what}")
    mask = _layer_mask(module, mask, kwargs)
    if mask is None:
        mask = _parallel_mask(module, attention_mask, is_causal, parallel, query.shape[0],
                              q_len, kwargs)
    if kwargs.get("softcap") is not None:
        cap = ak.softcap(float(kwargs["softcap"]))
        mask = cap if mask is None else as_mask(mask) & cap
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        mask = ak.sinks(sinks) if mask is None else as_mask(mask) & ak.sinks(sinks)
    out = parallel.attend(query, key, value, mask, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def _layer_kinds(module: torch.nn.Module) -> Optional[list]:
    """The model's ``config.layer_types`` (the kind of each layer), or ``None``."""
    kinds = getattr(getattr(module, "config", None), "layer_types", None)
    return list(kinds) if isinstance(kinds, (list, tuple)) and kinds else None


def _mixed_kinds(module: torch.nn.Module) -> Optional[list]:
    """The model's layer kinds, sorted, where its layers are of more than one; else ``None``."""
    kinds = sorted(set(_layer_kinds(module) or ()))
    return kinds if len(kinds) > 1 else None


def _layer_mask(module: torch.nn.Module, given, kwargs: dict):
    """The mask :func:`sequence_parallel` gives this layer: the one mask, or the dict's entry
    for the layer's kind (``config.layer_types[layer_idx]``; else by whether it has a sliding
    window); a ``ValueError`` for one mask over layers of different kinds, which would be
    wrong for some of them."""
    name = type(module).__name__
    if isinstance(given, dict):
        kinds, index = _layer_kinds(module), getattr(module, "layer_idx", None)
        if kinds is not None and isinstance(index, int) and 0 <= index < len(kinds):
            kind = kinds[index]
        else:
            window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
            kind = "full_attention" if window is None else "sliding_attention"
        if kind not in given:
            raise ValueError(f"{name} is a {kind!r} layer but sequence_parallel(mask=...) "
                             f"names {sorted(given)}: add the whole sequence's mask for "
                             f"{kind!r} (None for the default)")
        return given[kind]
    mixed = _mixed_kinds(module)
    if given is not None and mixed is not None:
        example = ", ".join(f"{kind!r}: ..." for kind in mixed)
        raise ValueError(f"{name}: the model's layers are of kinds {mixed} "
                         f"(config.layer_types), and one mask for all of them would be wrong "
                         f"for some; pass sequence_parallel(sp, mask={{{example}}}), the whole "
                         f"sequence's mask of each kind")
    return given


def _parallel_mask(module: torch.nn.Module, attention_mask, is_causal: Optional[bool],
                   parallel: "SequenceParallel", batch: int, q_len: int,
                   kwargs: dict) -> Optional[Mask]:
    """The whole sequence's mask when :func:`sequence_parallel` was given none: ``causal()``
    for causal layers, ``& documents`` of packed sequences from the gathered ``position_ids``;
    a ``ValueError`` for what only an explicit mask can say."""
    name = type(module).__name__
    padded = (isinstance(attention_mask, TransformersMask) and attention_mask.padded) or (
        isinstance(attention_mask, torch.Tensor))
    if padded:
        raise ValueError(f"{name} got a padding attention_mask under sequence_parallel: it "
                         f"covers this rank's shard only; call the model without "
                         f"attention_mask and pass the whole sequence's padding as "
                         f"sequence_parallel(sp, mask=attnkit.padding(...) & attnkit.causal())")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None:
        mixed = _mixed_kinds(module)
        example = (f"{{'sliding_attention': attnkit.sliding_window({window!r} - 1), "
                   f"'full_attention': None}}" if mixed
                   else f"attnkit.sliding_window({window!r} - 1)")
        raise ValueError(f"{name} has a sliding window ({window!r}): under sequence_parallel "
                         f"pass the whole sequence's mask, e.g. sequence_parallel(sp, "
                         f"mask={example}) for a window of {window!r} keys"
                         + (f" in the sliding layers (the model's layers are of kinds {mixed})"
                            if mixed else ""))
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or (
            positions.shape[-1] != q_len or positions.shape[0] not in (1, batch)):
        shape = None if positions is None else tuple(getattr(positions, "shape", ()))
        raise ValueError(f"{name} needs position_ids [B, T/P] = [{batch}, {q_len}] under "
                         f"sequence_parallel (the shard of the whole row's positions, "
                         f"sp.shard(position_ids, dim=1)), got {shape}: call the model with "
                         f"position_ids=...")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = ak.causal() if causal else None
    if batch != 1 or positions.shape[0] != 1:
        return mask
    documents = _shared_documents(
        (positions,),  # (as transformers' own packed mask of a pass without a cache)
        lambda: _documents_from_positions(_gathered(positions, parallel), restarts=False),
        "parallel")
    if documents is None:
        return mask
    return documents if mask is None else mask & documents


def _gathered(positions: torch.Tensor, parallel: "SequenceParallel") -> torch.Tensor:
    """The whole row's ``position_ids [1, T]`` from every rank's shard ``[1, T/P]``
    (:meth:`SequenceParallel.gather`: all-gathers, put in order by its layout)."""
    return parallel.gather(positions, dim=-1)
