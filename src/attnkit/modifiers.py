"""Score modifiers: how much a key counts, beside masks, which say whether it counts.

A modifier is written with the masks and combined with them by ``&``::

    ak.attention(q, k, v, ak.causal() & ak.softcap(30.0))
    ak.attention(q, k, v, ak.documents(ids) & ak.alibi(slopes) & ak.sinks(logits))

Each query row's scores go through, in this order (:meth:`Modifiers.apply` is the one
definition, used by every backend that runs modifiers)::

    s = q·kᵀ · scale                                  scale
    s = c · tanh(s / c)                               softcap(c)
    s = s + bias + alibi + relative                   additive biases (ak.bias, alibi, relative_bias)
    s = fn(s, b, h, q_idx, kv_idx)                    score_function(fn), in & order
    s = −inf where the mask forbids                   the mask
    softmax over the row, with exp(sink_h) added to its denominator (sinks)

As masks, modifiers allow every key: their block maps are FULL everywhere, so only the masks
decide which tiles are skipped. ``|`` and ``~`` with a modifier raise ``TypeError``.
Validation (:func:`attnkit.inputs.validate`) takes the modifiers out of the mask
(:func:`split`) into a :class:`Modifiers`; backends read ``Inputs.modifiers`` and say in
``not_supported_reasons`` which they cannot run. Sinks need nothing of a backend but its LSE:
:meth:`Sinks.join` merges the finished result with an empty partial result ``(out 0, lse =
sink)`` by :func:`attnkit.numerics.merge`, once, for every backend, and autograd gives the
gradients of out, LSE and the sink logits.

Positions are global (as for masks): a tile of queries ``q_idx`` against keys ``kv_idx`` is
evaluated from its indices, never from a ``Tq × Tk`` tensor. ALiBi and relative biases depend
on ``j − i`` alone: :meth:`Modifiers.position_bias` gives them once per relative position
(``Tq + Tk − 1`` values per head), from which a backend reads any tile's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .masks import (FULL, Mask, MaskSpace, aligned_shift, band_per_sequence, check_arity,
                    tensor_key, tensor_summary)

__all__ = ["Modifier", "Modifiers", "softcap", "alibi", "relative_bias", "sinks",
           "score_function", "t5_buckets", "split"]


def _tensor_state(t: torch.Tensor, keep: list) -> Optional[tuple]:
    """A tensor for a cache key: its identity and version counter
    (:func:`attnkit.masks.tensor_key`, so an in-place write through torch misses), with its
    ``requires_grad`` (which decides what a call computes); ``None`` when it cannot be keyed
    (a ``torch.func`` wrapper: no storage, and a new one per call). The tensor is appended to
    ``keep``."""
    key = tensor_key(t, keep)
    return None if key is None else (*key, t.requires_grad)


def relative_positions(space: MaskSpace) -> torch.Tensor:
    """Every relative position ``j − i`` (key minus query) of ``space`` in order, ``[L]``
    long with ``L = Tq + Tk − 1`` (``−(Tq − 1) … Tk − 1``), empty when ``Tq = Tk = 0``."""
    first = 1 - space.q_len
    return torch.arange(first, max(space.kv_len, first), device=space.device)




class Modifier(Mask):
    """Base class of score modifiers. As a mask it allows every key (``tile`` all True, block
    map FULL, tile structure ``"full"``); what it does to the scores is read by
    :class:`Modifiers`."""

    modifies = True
    kind: str = "?"
    """The modifier's name in reasons and messages: ``softcap (not supported by torch)``."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a gradient can flow to (slopes, a table, sink logits, …)."""
        return []

    def tile(self, q_idx, kv_idx, space):
        return torch.ones(1, 1, q_idx.shape[0], kv_idx.shape[0], dtype=torch.bool, device=space.device)

    def block_map(self, block_q, block_k, space, *, q_offset=0, q_count=None, kv_offset=0,
                  kv_count=None):
        q_count = space.q_len - q_offset if q_count is None else q_count
        kv_count = space.kv_len - kv_offset if kv_count is None else kv_count
        return torch.full((1, 1, math.ceil(q_count / block_q), math.ceil(kv_count / block_k)),
                          FULL, dtype=torch.int8, device=space.device)


class _Positioned(Modifier):
    """A modifier that reads positions (ALiBi, relative biases), aligned ``top_left`` or
    ``bottom_right`` (``align``)."""

    @staticmethod
    def _checked_align(kind: str, align: str) -> str:
        if align not in ("top_left", "bottom_right"):
            raise ValueError(f"{kind}(align={align!r}): use 'top_left' (distance j − i) or "
                             f"'bottom_right' (distance j − i − (Tk − Tq): the last query "
                             f"sits on the last key)")
        return align

    def shift(self, space: MaskSpace) -> int:
        """What the alignment subtracts from ``j − i``: :func:`~attnkit.masks.aligned_shift`."""
        return aligned_shift(self.align, space)


def _per_head_problem(what: str, t: torch.Tensor, space: MaskSpace, batched: bool) -> list[str]:
    """Problems of a per-head tensor ``[H]`` (or ``[B, H]`` when ``batched``) against ``space``
    (H: query heads, B: the batch size, the product of q's leading dims)."""
    heads, batch = space.heads, space.batch
    problems = []
    if t.device != space.device:
        problems.append(f"{what} is on {t.device} but q is on {space.device}: move it with "
                        f".to(q.device)")
    shapes = [(heads,)] + ([(batch, heads)] if batched else [])
    # (size by size, not tuple in list: a traced size is symbolic, compared as a guard)
    if not any(t.dim() == len(s) and all(a == b for a, b in zip(t.shape, s)) for s in shapes):
        named = batched and batch != 1  # (a batch of one: [H] says it all)
        forms = " or ".join(f"[{', '.join(map(str, s))}]" for s in shapes[:2 if named else 1])
        names = "[H]" + (" or [B, H]" if named else "")
        problems.append(f"{what} has shape {tuple(t.shape)}; it needs one value per query head: "
                        f"{names} = {forms} (q has H={heads} query heads"
                        + (f", batch size B={batch}, q's leading dims together" if named
                           else "") + "; with GQA, H counts "
                        f"query heads, not key/value heads)")
    return problems


def _float_tensor(what: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{what} must be a float tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    return t


# ---- softcap ----------------------------------------------------------------------------------

class Softcap(Modifier):
    """``s → cap · tanh(s / cap)`` on the scaled scores (see :func:`softcap`)."""

    kind = "softcap"

    def __init__(self, cap: float):
        if torch.compiler.is_compiling() and not isinstance(cap, (torch.Tensor, bool)):
            self.cap = cap  # a graph input (a symbolic float): checked in the operator
            return
        if isinstance(cap, torch.Tensor):
            raise TypeError(
                f"softcap(cap): cap must be a float, got a tensor {tensor_summary(cap)}: the cap is a "
                f"constant of the call, not learnable. Pass float(cap); for a learnable cap, "
                f"ak.score_function(lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap)) "
                f"gives cap its gradient (it applies after the additive biases, softcap before)")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"softcap(cap): cap must be a float > 0 (scores become "
                            f"cap·tanh(s/cap)), got {cap!r}")
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap(cap={cap!r}): cap must be a finite float > 0 (scores "
                             f"become cap·tanh(s/cap), within (-cap, cap)); for no cap, leave "
                             f"softcap out")
        low, high = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
        if not low <= cap <= high:
            raise ValueError(
                f"softcap(cap={cap!r}): cap must lie in float32's normal range [{low:.7g}, "
                f"{high:.7g}]: kernels compute cap·tanh(s/cap) in float32, where a larger cap "
                f"overflows to inf (and inf·0 is NaN) and a smaller one is subnormal, its "
                f"reciprocal near float32's overflow (the scores become NaN); for no cap, "
                f"leave softcap out")
        self.cap = float(cap)

    def cache_key(self, keep):
        return ("softcap", self.cap)

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.tanh(scores / self.cap) * self.cap

    def __repr__(self):
        return f"softcap({self.cap!r})"


def softcap(cap: float) -> Mask:
    """Soft-cap the scaled scores: ``s → cap · tanh(s / cap)`` (Gemma 2, Grok), before any
    additive bias and before masking. ``cap``: a float in float32's normal range, ``1.18e-38
    ≤ cap ≤ 3.4e38`` (kernels divide by it in float32), checked when built; inside a compiled
    graph, where cap may be a graph input, when attnkit's operator runs. Combine with masks
    by ``&``: ``ak.causal() & ak.softcap(50.0)``."""
    return Softcap(cap)


# ---- ALiBi ------------------------------------------------------------------------------------

class Alibi(_Positioned):
    """``slope_h · (j − i − shift)`` added to the scores (see :func:`alibi`)."""

    kind = "alibi"

    def __init__(self, slopes: torch.Tensor, align: str):
        self.slopes = _float_tensor("alibi(slopes)", slopes)
        self.align = self._checked_align("alibi", align)

    def tensors(self):
        return [self.slopes]

    def cache_key(self, keep):
        state = _tensor_state(self.slopes, keep)
        return None if state is None else ("alibi", state, self.align)

    def check(self, space):
        return _per_head_problem("alibi slopes", self.slopes, space, batched=True)

    def values(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, space: MaskSpace,
               dtype: torch.dtype) -> torch.Tensor:
        """The bias of one tile at global positions → ``[1|B, H, tq, tk]`` in ``dtype``."""
        distance = (kv_idx[None, :] - q_idx[:, None] - self.shift(space)).to(dtype)  # [tq, tk]
        slopes = self.slopes.to(dtype).reshape(-1, space.heads)[:, :, None, None]  # [1|B, H, 1, 1]
        return slopes * distance

    def by_distance(self, relative: torch.Tensor, space: MaskSpace, dtype: torch.dtype,
                    ) -> torch.Tensor:
        """The bias of each relative position ``j − i`` in ``relative [L]`` (long) →
        ``[1|B, H, L]`` in ``dtype``: the values :meth:`values` gives at those distances."""
        distance = (relative - self.shift(space)).to(dtype)  # [L]
        return self.slopes.to(dtype).reshape(-1, space.heads)[:, :, None] * distance

    def __repr__(self):
        align = "" if self.align == "top_left" else f", align={self.align!r}"
        return f"alibi({tensor_summary(self.slopes)}{align})"


def alibi(slopes: torch.Tensor, align: str = "top_left") -> Mask:
    """ALiBi (Press et al.): add ``slope_h · (j − i − shift)`` to the scores of query i and key
    j (global positions) in head h; ``shift`` is 0 for ``align="top_left"`` and ``Tk − Tq`` for
    ``"bottom_right"`` (a decoding step: the last query sits on the last key). With causal
    masking and positive slopes, keys further back get lower scores.

    ``slopes``: float ``[H]`` (one per query head) or ``[B, H]``; they get a gradient when
    they require grad. The bias is computed per tile from positions, never as a ``Tq × Tk``
    tensor. ``ak.causal() & ak.alibi(slopes)``."""
    return Alibi(slopes, align)


# ---- relative position buckets (T5) -----------------------------------------------------------

def t5_buckets(relative_position: torch.Tensor, num_buckets: int, bidirectional: bool = True,
               max_distance: int = 128) -> torch.Tensor:
    """T5's bucketing of relative positions ``j − i`` (key minus query), as in the T5 paper
    (Raffel et al., section 2.1) and Hugging Face's ``_relative_position_bucket``.

    ``relative_position``: integer tensor of any shape → bucket ids (long, same shape) in
    ``[0, num_buckets)``. ``bidirectional``: half of the buckets for keys before the query
    (and the query itself), half for keys after it; otherwise every key after the query shares
    bucket 0. Within a direction's ``n`` buckets, distances ``0 … n/2 − 1`` get a bucket each,
    and larger ones share ``n/2`` logarithmically spaced buckets up to ``max_distance``, beyond
    which all fall into the last. E.g. ``num_buckets=32``: ``0 → 0``, ``−3 → 3``, ``+3 → 19``,
    ``−20 → 10``, ``−1000 → 15``, ``+1000 → 31``. With ``bidirectional`` each direction gets
    ``num_buckets // 2``, as in Hugging Face's: an odd count's last bucket is never used.
    """
    if not isinstance(relative_position, torch.Tensor) or relative_position.is_floating_point() \
            or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(f"t5_buckets(relative_position): needs an integer tensor of key − query "
                        f"positions, got {getattr(relative_position, 'dtype', type(relative_position).__name__)}")
    for name, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"t5_buckets({name}={value!r}): must be an int")
    per_side = num_buckets // 2 if bidirectional else num_buckets
    exact = per_side // 2
    if exact < 1:
        raise ValueError(f"t5_buckets(num_buckets={num_buckets}, bidirectional={bidirectional}): "
                         f"needs at least {4 if bidirectional else 2} buckets (half of each "
                         f"direction's buckets count exact distances, at least one)")
    if max_distance <= exact:
        raise ValueError(f"t5_buckets(max_distance={max_distance}): must exceed the {exact} "
                         f"exact distances of num_buckets={num_buckets}")
    relative_position = relative_position.long()
    if bidirectional:
        offset = (relative_position > 0).long() * per_side  # keys after the query: upper half
        distance = relative_position.abs()
    else:
        offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)  # keys after the query: distance 0
    # log-spaced from `exact` (bucket `exact`) to `max_distance` (bucket per_side), in float32
    # as the reference implementation computes it; distances < exact never use this branch
    ratio = distance.clamp(min=1).float() / exact
    far = exact + (torch.log(ratio) / math.log(max_distance / exact) * (per_side - exact)).long()
    far = far.clamp(max=per_side - 1)
    return offset + torch.where(distance < exact, distance, far)


class RelativeBias(_Positioned):
    """``table[h, bucket(j − i)]`` added to the scores (see :func:`relative_bias`)."""

    kind = "relative_bias"

    def __init__(self, table: torch.Tensor, buckets: Optional[Callable], align: str = "top_left"):
        self.table = _float_tensor("relative_bias(table)", table)
        self.align = self._checked_align("relative_bias", align)
        if table.dim() != 2:
            raise ValueError(f"relative_bias(table) has shape {tuple(table.shape)}; it must be "
                             f"[H, num_buckets]")
        if table.shape[-1] == 0:
            raise ValueError(f"relative_bias(table) has 0 buckets (shape {tuple(table.shape)}); "
                             f"it must be [H, num_buckets], one column per bucket id, "
                             f"num_buckets ≥ 1")
        if buckets is None and table.shape[-1] < 4:
            raise ValueError(f"relative_bias(table) has {table.shape[-1]} buckets; T5's "
                             f"bidirectional bucketing (buckets=None) needs at least 4")
        if buckets is not None and not callable(buckets):
            raise TypeError(f"relative_bias(buckets=...) takes a callable relative_position "
                            f"[tq, tk] long -> bucket ids long, or None for T5's; got "
                            f"{type(buckets).__name__}")
        self.buckets = buckets

    def tensors(self):
        return [self.table]

    def cache_key(self, keep):
        if self.buckets is not None:  # a callable may read anything (as from_function)
            return None
        state = _tensor_state(self.table, keep)
        return None if state is None else ("relative_bias", state, self.align)

    def check(self, space):
        problems = [] if self.table.device == space.device else [
            f"relative_bias table is on {self.table.device} but q is on {space.device}: move "
            f"it with .to(q.device)"]
        if self.table.shape[0] != space.heads:
            problems.append(f"relative_bias table has shape {tuple(self.table.shape)}; it must "
                            f"be [H, num_buckets] with H={space.heads} query heads (with GQA, "
                            f"H counts query heads)")
        if self.buckets is not None and not problems:
            problems.extend(self._bucket_problems(space))
        return problems

    def _bucket_problems(self, space: MaskSpace) -> list[str]:
        """The bucket function's ids over every relative position of ``space`` (once per call,
        ``Tq + Tk − 1`` of them; T5's are in range by construction), outside ``[0,
        num_buckets)``: a negative id would index the table from its end, a large one fail."""
        shift = self.shift(space)
        relative = relative_positions(space) - shift  # [L]
        if relative.numel() == 0:
            return []
        ids = self.bucket_ids(relative[None, :])[0]  # [L]
        low, high = (int(x) for x in torch.stack([ids.min(), ids.max()]).tolist())
        buckets = self.table.shape[-1]
        if 0 <= low and high < buckets:
            return []
        name = getattr(self.buckets, "__name__", "fn")
        return [f"relative_bias(buckets={name}) gave bucket ids in [{low}, {high}] for the "
                f"relative positions {'j − i' if not shift else f'j − i − {shift} (bottom-right)'}"
                f" in [{-(space.q_len - 1) - shift}, {space.kv_len - 1 - shift}]; they "
                f"must lie in [0, num_buckets) = [0, {buckets}) (the table has shape "
                f"{tuple(self.table.shape)}): clamp them, or widen the table"]

    def bucket_ids(self, relative: torch.Tensor) -> torch.Tensor:
        """Bucket ids ``[tq, tk]`` (long) of relative positions ``j − i`` ``[tq, tk]``."""
        if self.buckets is None:
            return t5_buckets(relative, self.table.shape[-1])
        ids = self.buckets(relative)
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.shape != relative.shape:
            raise TypeError(f"relative_bias(buckets={getattr(self.buckets, '__name__', 'fn')}) "
                            f"must return a long tensor of the relative positions' shape "
                            f"{tuple(relative.shape)}, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)} "
                            f"{tuple(getattr(ids, 'shape', ()))}")
        return ids

    def values(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, space: MaskSpace,
               dtype: torch.dtype) -> torch.Tensor:
        """The bias of one tile at global positions → ``[1, H, tq, tk]`` in ``dtype``."""
        ids = self.bucket_ids(kv_idx[None, :] - q_idx[:, None] - self.shift(space))  # [tq, tk]
        return self.table.to(dtype)[:, ids][None]  # [1, H, tq, tk]

    def by_distance(self, relative: torch.Tensor, space: MaskSpace, dtype: torch.dtype,
                    ) -> torch.Tensor:
        """The bias of each relative position ``j − i`` in ``relative [L]`` (long) → ``[1, H,
        L]`` in ``dtype`` (the bucket function sees them as one row, ``[1, L]``)."""
        ids = self.bucket_ids((relative - self.shift(space))[None, :])[0]  # [L]
        return self.table.to(dtype)[:, ids][None]  # [1, H, L]

    def __repr__(self):
        buckets = ("" if self.buckets is None
                   else f", buckets={getattr(self.buckets, '__name__', 'fn')}")
        align = "" if self.align == "top_left" else f", align={self.align!r}"
        return f"relative_bias({tensor_summary(self.table)}{buckets}{align})"


def relative_bias(table: torch.Tensor, buckets: Optional[Callable] = None,
                  align: str = "top_left") -> Mask:
    """A learned relative-position bias (T5): add ``table[h, bucket(j − i − shift)]`` to the
    scores of query i and key j (global positions) in head h; ``shift`` is 0 for
    ``align="top_left"`` and ``Tk − Tq`` for ``"bottom_right"`` (a decoding step or a chunk
    of a chunked prefill over a cache: the last query sits on the last key, as T5's decoder
    counts a step's query at the cache's length).

    ``table``: float ``[H, num_buckets]`` (one row per query head), learnable: it gets its
    gradient (summed per bucket) when it requires grad. ``buckets``: a callable
    ``relative_position [tq, tk] long -> bucket ids [tq, tk] long`` in ``[0, num_buckets)``
    (checked once per call, over every relative position: ``ValueError`` outside it), or
    ``None`` for T5's bidirectional bucketing with ``max_distance=128`` (:func:`t5_buckets`).
    Evaluated per tile, never as a ``Tq × Tk`` tensor."""
    return RelativeBias(table, buckets, align)


# ---- sinks ------------------------------------------------------------------------------------

class Sinks(Modifier):
    """A per-head logit in every row's softmax denominator (see :func:`sinks`)."""

    kind = "sinks"

    def __init__(self, logits: torch.Tensor):
        self.logits = _float_tensor("sinks(logits)", logits)

    def tensors(self):
        return [self.logits]

    def cache_key(self, keep):
        state = _tensor_state(self.logits, keep)
        return None if state is None else ("sinks", state)

    def check(self, space):
        return _per_head_problem("sinks logits", self.logits, space, batched=False)

    def join(self, out: torch.Tensor, lse: torch.Tensor, weights: Optional[torch.Tensor] = None,
             alike: bool = False, dtype: Optional[torch.dtype] = None,
             ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """A finished result with the sinks in its denominators: ``out [B, H, Tq, Dv]``,
        ``lse [B, H, Tq]``, ``weights [B, H, Tq, Tk]`` or ``None`` → the same, out and weights
        in ``dtype`` (default: their own) and lse in its accumulation dtype. The result is
        merged with an empty partial result ``(0, sink_h)`` (:func:`attnkit.numerics.merge`,
        in out's accumulation dtype): ``lse' = logaddexp(lse, sink_h)``, ``out' = out ·
        exp(lse − lse')``, weights scaled alike (a row's weights then sum to less than 1). A
        fully masked row gets out 0 and ``lse' = sink_h``. A float64 result (the reference's)
        joins in float64 and rounds once, to ``dtype``. ``alike``:
        :func:`~attnkit.numerics.merge`'s form for the invariance contract."""
        from .numerics import accum_dtype, merge

        sink = self.logits.to(lse.dtype)[None, :, None].expand_as(lse)  # [B, H, Tq]
        merged, merged_lse = merge(out, lse, torch.zeros_like(out), sink, alike)
        if weights is not None:  # (a −inf sink on a row with no key: both −inf, weights 0)
            finite = merged_lse.where(~torch.isneginf(merged_lse), 0.0)
            weights = weights * torch.exp(lse - finite).to(weights.dtype)[..., None]
            weights = weights if dtype is None else weights.to(dtype)
        dtype = out.dtype if dtype is None else dtype
        return merged.to(dtype), merged_lse.to(accum_dtype(dtype)), weights

    def __repr__(self):
        return f"sinks({tensor_summary(self.logits)})"


def sinks(logits: torch.Tensor) -> Mask:
    """Attention sinks (gpt-oss, StreamingLLM's learnable form): a learnable logit per head
    that joins every row's softmax denominator without a value::

        out_i = Σ_j exp(s_ij − lse'_i) · v_j,   lse'_i = log(exp(sink_h) + Σ_j exp(s_ij))

    so a row may put weight on "nothing". ``logits``: float ``[H]`` (query heads), learnable.
    A fully masked row gets output 0 and LSE ``sink_h``. Runs on every backend that returns
    an LSE (see :meth:`Sinks.join`)."""
    return Sinks(logits)


# ---- score functions --------------------------------------------------------------------------

def _captured(fn) -> list[torch.Tensor]:
    """The tensors ``fn`` reads without being given them: in its closure, its defaults, the
    globals its code names, a bound method's object, a ``functools.partial``'s arguments, an
    ``nn.Module``'s parameters and buffers (a level deep inside lists, tuples and dicts)."""
    found: dict[int, torch.Tensor] = {}

    def visit(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, torch.nn.Module):
            for t in (*value.parameters(), *value.buffers()):
                found.setdefault(id(t), t)
        elif depth > 2:
            return
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)
        elif isinstance(value, functools.partial):
            visit(value.func, depth + 1)
            visit(value.args, depth + 1)
            visit(value.keywords, depth + 1)
        elif inspect.ismethod(value):
            visit(value.__self__, depth + 1)
            visit(value.__func__, depth + 1)
        elif inspect.isfunction(value):
            try:
                closure = inspect.getclosurevars(value)
            except ValueError:  # an empty cell (a name not bound yet): nothing to read there
                return
            visit(list(closure.nonlocals.values()), depth + 1)
            visit([g for g in closure.globals.values() if not inspect.ismodule(g)], depth + 1)
            visit(value.__defaults__ or (), depth + 1)
            visit(value.__kwdefaults__ or {}, depth + 1)
        elif callable(value) and not isinstance(value, type):  # an object with __call__
            visit(vars(value) if hasattr(value, "__dict__") else {}, depth + 1)
            visit(getattr(type(value), "__call__", None), depth + 1)

    visit(fn, 0)
    return list(found.values())


class ScoreFunction(Modifier):
    """``fn(score, b, h, q_idx, kv_idx) -> score`` (see :func:`score_function`)."""

    kind = "score_function"

    def __init__(self, fn: Callable, tensors: Optional[Sequence[torch.Tensor]], name: Optional[str]):
        if not callable(fn):
            raise TypeError(f"score_function() takes a callable fn(score, b, h, q_idx, kv_idx) "
                            f"-> score, got {type(fn).__name__}")
        check_arity(fn, "score_function", "score, b, h, q_idx, kv_idx",
                    "a mask function fn(b, h, q_idx, kv_idx) -> bool (FlexAttention's mask_mod) "
                    "goes to ak.from_function")
        if isinstance(tensors, torch.Tensor):  # (iterating it would list its rows, not it)
            raise TypeError(f"score_function(tensors=...) takes a sequence of tensors, got one "
                            f"tensor of shape {tuple(tensors.shape)}: pass tensors=[t]")
        if tensors is not None and not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("score_function(tensors=...) takes a sequence of tensors: the ones "
                            "fn reads that should get gradients")
        self.fn = fn
        self.listed = None if tensors is None else tuple(tensors)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def tensors(self):
        return list(self.listed) if self.listed is not None else _captured(self.fn)

    def evaluate(self, scores: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                 ) -> torch.Tensor:
        """``fn`` on ``scores [B, H, tq, tk]`` at global positions → the new scores, same shape."""
        batch, heads = scores.shape[:2]
        device = scores.device
        b = torch.arange(batch, device=device)[:, None, None, None]
        h = torch.arange(heads, device=device)[None, :, None, None]
        out = self.fn(scores, b, h, q_idx[None, None, :, None], kv_idx[None, None, None, :])
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise TypeError(f"score_function({self.name}) must return a float tensor of scores, "
                            f"got {getattr(out, 'dtype', type(out).__name__)}")
        # four dims that each match the scores' or are 1, or a constant: a result with fewer
        # dims (q_idx.flatten(), [tq]) would broadcast against the wrong dims of the scores
        constant = out.dim() <= 4 and all(size == 1 for size in out.shape)
        if not constant and (out.dim() != 4 or any(size not in (1, want) for size, want
                                                   in zip(out.shape, scores.shape))):
            raise ValueError(
                f"score_function({self.name}) returned shape {tuple(out.shape)}; it must "
                f"broadcast to the scores by their four dims, each of its size or 1: [B|1, H|1, "
                f"tq|1, tk|1] = {list(scores.shape)} (or be a constant), as combining the "
                f"arguments gives (score [B,H,tq,tk], b [B,1,1,1], h [1,H,1,1], q_idx "
                f"[1,1,tq,1], kv_idx [1,1,1,tk]): index and flatten none of them")
        return out.to(scores.dtype).expand(scores.shape)

    def __repr__(self):
        return f"score_function({self.name})"


def score_function(fn: Callable, *, tensors: Optional[Sequence[torch.Tensor]] = None,
                   name: Optional[str] = None) -> Mask:
    """A general score modifier ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's
    ``score_mod``), applied after softcap and the additive biases, before masking.

    ``fn`` gets broadcastable tensors: ``score [B, H, tq, tk]`` (one tile, scaled and biased),
    ``b [B,1,1,1]``, ``h [1,H,1,1]`` (query heads), ``q_idx [1,1,tq,1]``, ``kv_idx [1,1,1,tk]``
    (global positions), and returns new scores with four dims, each ``score``'s size or 1
    (``[B|1, H|1, tq|1, tk|1]``, or a constant of size 1; a lower-rank result such as ``[tq]``
    is refused, since broadcasting would line it up with the keys), e.g.
    ``lambda s, b, h, q, kv: s + w[h] * (q - kv)``. Gradients reach q/k/v and the tensors fn
    reads: on the tiled engine those found in its closure, defaults, named globals, a bound
    method's object or a module's parameters, or the ones listed in ``tensors`` (a call whose
    fn reads another tensor that requires grad runs on the reference backend)."""
    return ScoreFunction(fn, tensors, name)


def calls_python(mask: Optional[Mask]) -> list[Mask]:
    """The score modifiers of ``mask`` that run the caller's Python code per tile: score
    functions, and relative biases with a bucket function of their own."""
    return [leaf for leaf in ([] if mask is None else mask.leaves()) if leaf.modifies
            and (leaf.kind == "score_function" or getattr(leaf, "buckets", None) is not None)]


# ---- the modifiers of one call ----------------------------------------------------------------

@dataclass(frozen=True)
class Modifiers:
    """The score modifiers of one validated call (``Inputs.modifiers``), taken out of its mask:
    ``softcap`` (or ``None``), ``alibi`` and ``relative`` (tuples, all added), ``sinks`` (or
    ``None``) and ``functions`` (applied in ``&`` order). ``tensors``: every tensor a gradient
    can reach through them, each once."""

    softcap: Optional[Softcap] = None
    alibi: tuple[Alibi, ...] = ()
    relative: tuple[RelativeBias, ...] = ()
    sinks: Optional[Sinks] = None
    functions: tuple[ScoreFunction, ...] = ()
    tensors: tuple[torch.Tensor, ...] = ()

    @property
    def changes_scores(self) -> bool:
        """Whether anything but sinks is present: the scores themselves change."""
        return bool(self.softcap or self.alibi or self.relative or self.functions)

    @property
    def by_position(self) -> bool:
        """Whether the scores change by ALiBi and relative biases alone: an additive bias that
        depends on ``j − i`` only (see :meth:`position_bias`), nothing else."""
        return bool(self.alibi or self.relative) and self.softcap is None and not self.functions

    @property
    def position_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors of the ALiBi and relative biases (slopes, tables), each once."""
        found: dict[int, torch.Tensor] = {}
        for part in (*self.alibi, *self.relative):
            for t in part.tensors():
                found.setdefault(id(t), t)
        return tuple(found.values())

    def position_bias(self, space: MaskSpace, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The ALiBi and relative biases together, once per relative position: ``[1|B, H,
        Tq + Tk − 1]`` in ``dtype`` (contiguous), entry ``e`` the bias of key j for query i
        where ``j − i = e − (Tq − 1)`` (``Tq``, ``Tk``: ``space``'s global lengths), so a
        tile's bias is read from it without a ``Tq × Tk`` tensor. ``None`` without ALiBi or
        relative biases. Differentiable in the slopes and tables."""
        parts = (*self.alibi, *self.relative)
        if not parts:
            return None
        relative = relative_positions(space)  # [L]
        total = None
        for part in parts:
            values = part.by_distance(relative, space, dtype)  # [1|B, H, L]
            total = values if total is None else total + values
        return total.contiguous()

    def kinds(self) -> list[str]:
        """The kinds present that change scores (``["softcap", "alibi"]``), for reasons."""
        present = [self.softcap, *self.alibi[:1], *self.relative[:1], *self.functions[:1]]
        return [m.kind for m in present if m is not None]

    def parts(self) -> list[Modifier]:
        return [m for m in (self.softcap, *self.alibi, *self.relative, self.sinks, *self.functions)
                if m is not None]

    def check(self, space: MaskSpace) -> list[str]:
        """Problems fitting the modifiers to ``space`` (shapes against H and B, devices)."""
        return [problem for m in self.parts() for problem in m.check(space)]

    def pull_back(self, build: Callable[["Modifiers"], Sequence[torch.Tensor]],
                  grads: Sequence[Optional[torch.Tensor]], wanted: Sequence[bool],
                  ) -> list[Optional[torch.Tensor]]:
        """The gradients of :attr:`tensors` through ``build`` (modifiers → tensors, e.g. the
        position vector), given ``grads``, those of its outputs (``None``: zero); ``None``
        where not ``wanted``. By ``torch.func.vjp``, which differentiates below autograd too
        (inside a custom operator); the cost is ``build``'s own, O((Tq + Tk)·H) for position
        biases. Tensors that score functions read are not rebuilt: they get zeros."""
        chosen = [i for i, want in enumerate(wanted) if want]
        if not chosen:
            return [None] * len(self.tensors)

        def rebuilt(*new):
            return tuple(build(self._swapped({id(self.tensors[i]): t for i, t in zip(chosen, new)})))

        outputs, vjp = torch.func.vjp(rebuilt, *(self.tensors[i] for i in chosen))
        found = dict(zip(chosen, vjp(tuple(torch.zeros_like(o) if g is None else g.to(o.dtype)
                                           for o, g in zip(outputs, grads)))))
        return [found.get(i) for i in range(len(self.tensors))]

    def _swapped(self, swap: dict) -> "Modifiers":
        """These modifiers with the tensors in ``swap`` (``id(old) → new``) replaced in the
        ALiBi, relative-bias and sink parts."""
        def part(p):
            names = [name for name, value in vars(p).copy().items()  # (another thread may memo)
                     if isinstance(value, torch.Tensor) and id(value) in swap]
            if not names:
                return p
            p = copy.copy(p)
            p.__dict__.pop("_memo", None)  # values derived from the tensors being swapped
            for name in names:
                setattr(p, name, swap[id(getattr(p, name))])
            return p

        return dataclasses.replace(
            self, alibi=tuple(map(part, self.alibi)), relative=tuple(map(part, self.relative)),
            sinks=None if self.sinks is None else part(self.sinks),
            tensors=tuple(swap.get(id(t), t) for t in self.tensors))

    # ---- the definition: scale → softcap → additive biases → score functions --------------
    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Softcap (or nothing) on scaled scores."""
        return scores if self.softcap is None else self.softcap.apply(scores)

    def add_biases(self, scores: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                   space: MaskSpace, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scores [B, H, tq, tk]`` plus ``bias`` (the mask's, ``[Bm, Hm, tq, tk]``, or
        ``None``), ALiBi and relative biases of the tile at global positions."""
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        for part in (*self.alibi, *self.relative):
            scores = scores + part.values(q_idx, kv_idx, space, scores.dtype)
        return scores

    def call_functions(self, scores: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                       ) -> torch.Tensor:
        for part in self.functions:
            scores = part.evaluate(scores, q_idx, kv_idx)
        return scores

    def apply(self, scores: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
              space: MaskSpace, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scaled scores of one tile ``[B, H, tq, tk]`` (queries ``q_idx``, keys ``kv_idx``,
        global) → the modified scores, before masking: softcap, + ``bias`` (the mask's) and
        the ALiBi and relative biases, then the score functions. Differentiable."""
        scores = self.add_biases(self.cap(scores), q_idx, kv_idx, space, bias)
        return self.call_functions(scores, q_idx, kv_idx)

    def hidden_tensors(self, space: MaskSpace, dtype: torch.dtype) -> int:
        """How many tensors that require grad the score functions reach besides
        :attr:`tensors` (evaluated on one position per batch element and head, none of an
        empty side; 0 without functions): a backend that hands gradients to :attr:`tensors`
        itself cannot give those theirs."""
        if not self.functions or not torch.is_grad_enabled():
            return 0
        # position 0 of each side, or none of an empty side (indexing a [Tk] tensor at 0
        # fails where Tk = 0; an empty index still reaches the tensor in the graph)
        q_idx = torch.zeros(min(space.q_len, 1), dtype=torch.long, device=space.device)
        kv_idx = torch.zeros(min(space.kv_len, 1), dtype=torch.long, device=space.device)
        # (scores without grad: a product of them with an inference tensor saves nothing,
        # and the graph reaches only the tensors that require grad)
        scores = torch.zeros(space.batch, space.heads, q_idx.shape[0], kv_idx.shape[0], dtype=dtype,
                             device=space.device)
        try:
            out = self.apply(scores, q_idx, kv_idx, space)
        except RuntimeError as error:
            # a tensor that requires grad times an inference tensor, which autograd cannot
            # save: a call with gradients cannot run the function at all, and one without
            # needs no tensor's
            if "Inference tensors" not in str(error):
                raise
            return 0
        if out.grad_fn is None:
            return 0
        known = {id(t) for t in (scores, *self.tensors)}
        known_nodes = {t.grad_fn for t in self.tensors if t.grad_fn is not None}
        hidden, seen, todo = set(), set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in known_nodes:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None and id(variable) not in known:
                hidden.add(id(variable))
            todo.extend(next_node for next_node, _ in node.next_functions)
        return len(hidden)

    def __repr__(self):
        return " & ".join(map(repr, self.parts()))


def split(mask: Optional[Mask]) -> tuple[Optional[Mask], Optional[Modifiers]]:
    """``mask`` (an ``&`` chain of masks and modifiers) → ``(the masks alone, Modifiers)``:
    ``(mask, None)`` unchanged when it holds no modifier; ``None`` for a side that is empty.
    Raises ``ValueError`` for two softcaps or two sinks (their combination is not defined)."""
    if mask is None or not mask.modifies:
        return mask, None
    leaves = mask.leaves()
    rest = [leaf for leaf in leaves if not leaf.modifies]
    found = [leaf for leaf in leaves if leaf.modifies]
    for kind in ("softcap", "sinks"):
        twice = [m for m in found if m.kind == kind]
        if len(twice) > 1:
            raise ValueError(f"mask holds {len(twice)} {kind} modifiers ({', '.join(map(repr, twice))}): "
                             f"use one")
    tensors: dict[int, torch.Tensor] = {}
    for part in found:
        for t in part.tensors():
            tensors.setdefault(id(t), t)
    first = {kind: next((m for m in found if m.kind == kind), None) for kind in ("softcap", "sinks")}
    modifiers = Modifiers(
        softcap=first["softcap"], sinks=first["sinks"],
        alibi=tuple(m for m in found if m.kind == "alibi"),
        relative=tuple(m for m in found if m.kind == "relative_bias"),
        functions=tuple(m for m in found if m.kind == "score_function"),
        tensors=tuple(tensors.values()))
    return (functools.reduce(lambda a, b: a & b, rest) if rest else None), modifiers


def per_sequence(mask: Optional[Mask], sequences: Mask, *, call: str,
                 positions: Optional[str] = None) -> Mask:
    """``mask`` applied inside each sequence of ``sequences`` (a :func:`~attnkit.masks.padding`
    of each batch element's tokens, or :func:`~attnkit.masks.documents` of packed sequences),
    as one mask: its band aligned to each sequence's own queries and keys
    (:func:`~attnkit.masks.band_per_sequence`), its score modifiers joined; ``sequences``
    itself when ``mask`` is ``None``. ``call`` names the caller in errors; ``positions``,
    when given, says why ALiBi and relative biases cannot apply per sequence there (they
    read positions, which are the whole row's). Masks that are not bands, and
    ``score_function``, are refused with a ValueError."""
    rest, modifiers = split(mask)
    band = None if rest is None else rest.band()
    if rest is not None and band is None:
        raise ValueError(f"{call} applies its mask inside each sequence and takes causal(...), "
                         f"sliding_window(...) and score modifiers; got {rest!r}. The sequences "
                         f"are kept apart already; for another mask, pad the batch and call "
                         f"attnkit.attention")
    base = sequences if band is None else band_per_sequence(band, sequences)
    if modifiers is None:
        return base
    if modifiers.functions:
        raise ValueError(f"{call} does not take score_function: it would see the whole row's "
                         f"positions, not each sequence's; pad the batch and call "
                         f"attnkit.attention")
    if (modifiers.alibi or modifiers.relative) and positions is not None:
        raise ValueError(f"{call} applies alibi or relative_bias per sequence only {positions}")
    return functools.reduce(lambda a, b: a & b, modifiers.parts(), base)
