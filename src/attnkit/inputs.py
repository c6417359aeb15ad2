"""Validation and shape normalisation: every user error of ``attention()`` is raised here.

``validate`` checks the call once and returns an :class:`Inputs` whose tensors are
``[B, H, T, D]`` views of the caller's (no copies where the layout allows). Backends only ever
see :class:`Inputs`; ``restore`` puts results back into the caller's shape.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .masks import (DENSE_MAX_SCORES, Band, Mask, MaskSpace, _is_wrapped, as_mask,
                    derived_values, every_row_has_key, held_tensors, keeping, learnable,
                    mask_fields, mask_tensors, validation_key, wrapped_eagerly)
from .modifiers import Modifiers, split

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Inputs:
    """A validated call. ``q [B, Hq, Tq, Dk]``, ``k [B, Hkv, Tk, Dk]``, ``v [B, Hkv, Tk, Dv]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[Mask]
    scale: float
    dropout_p: float
    generator: Optional[torch.Generator]
    batch_shape: tuple  # the caller's leading dims (flattened into B)
    input_rank: int  # 2: [T, D]; 3: [B, T, D]; 4+: [..., H, T, D]
    need_weights: bool = False
    need_lse: bool = False
    need_grad: bool = field(default=False)
    bias_grad: bool = False
    """A bias of the mask requires grad (a learnable bias: it needs dBias)."""
    transformed: bool = False
    """The call runs under a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, …) or
    forward-mode AD: some of its tensors (q, k, v, or any the mask or its modifiers hold, such
    as vmapped lengths or ids) are functorch wrappers or dual tensors."""
    modifiers: Optional[Modifiers] = None
    """The score modifiers (softcap, alibi, …) taken out of the caller's mask, or ``None``;
    ``mask`` then holds only what says which keys count (see :mod:`attnkit.modifiers`)."""
    invariant: bool = False
    """The call runs under the invariance contract (:mod:`attnkit.invariance`): only backends
    that keep it accept it."""
    _allowed: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _has_key: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _space: Optional[MaskSpace] = field(default=None, repr=False, compare=False)
    derived: Optional[dict] = field(default=None, repr=False, compare=False)
    """What validation, the guard and the backend derived from the mask for this call's
    validation (computed once, whichever asks first), shared by every call that reuses it
    (:class:`CallCache`, :class:`attnkit.Plan`): its key holds the mask's tensors by identity
    and version, so what is kept here stays right. ``None`` on a hit of a mask keyed by shape
    (a new mask each call: :func:`derived` then computes)."""

    def allowed(self) -> torch.Tensor:
        """The mask evaluated over the whole call, bool ``[Bm, Hm, Tq, Tk]``, computed once per
        call (the torch backend's bias and :func:`attnkit.finite.guard` both read it). Only
        for calls whose mask is small enough to materialise."""
        if self._allowed is None:
            self._allowed = derived(self, "allowed", lambda: self.mask.to_dense(self.space))
        return self._allowed

    def has_key(self) -> Optional[torch.Tensor]:
        """Per query row, whether it has an allowed key: bool ``[Bm, Hm, Tq, 1]`` from
        :meth:`allowed`, computed once per call (the torch backend zeroes the rows without
        one, :func:`attnkit.finite.guard` their queries); ``None`` when every row is known to
        have one (:func:`~attnkit.masks.every_row_has_key`)."""
        if self._has_key is None:
            if every_row_has_key(self.mask, self.space):
                return None
            self._has_key = self.allowed().any(-1, keepdim=True)
        return self._has_key

    def replaced(self, **tensors: torch.Tensor) -> "Inputs":
        """A copy with ``q``, ``k`` or ``v`` replaced by tensors of the same shapes (what the
        call computed from its mask is kept); cheaper than ``dataclasses.replace``, which runs
        ``__init__`` again."""
        new = object.__new__(Inputs)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(tensors)
        return new

    @property
    def space(self) -> MaskSpace:
        """The call's extent, made once per call (q and k are never replaced in place; a plain
        attribute, not ``functools.cached_property``, whose lock torch.compile cannot trace)."""
        if self._space is None:
            b, h, tq, _ = self.q.shape
            self._space = MaskSpace(batch=b, heads=h, q_len=tq, kv_len=self.k.shape[2],
                                    device=self.q.device)
        return self._space

    @property
    def biases(self) -> list:
        """The mask's additive bias tensors (``[Bm, Hm, Tq|1, Tk|1]``), possibly requiring grad."""
        return [] if self.mask is None else self.mask.biases()

    @property
    def modifier_tensors(self) -> tuple:
        """The modifiers' tensors (slopes, tables, sink logits, what score functions read)."""
        return () if self.modifiers is None else self.modifiers.tensors

    @property
    def grad_tensors(self) -> tuple:
        """Every tensor a gradient can flow to: q, k, v, the mask's biases and the modifiers'
        tensors."""
        return (self.q, self.k, self.v, *self.biases, *self.modifier_tensors)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA); 1 for ordinary multi-head attention."""
        return self.q.shape[1] // self.k.shape[1]

    def describe(self) -> str:
        """One line per tensor, for error messages."""
        lines = [f"  {name}: shape {tuple(t.shape)}, {t.dtype}, {t.device}"
                 for name, t in (("q", self.q), ("k", self.k), ("v", self.v))]
        lines.append(f"  mask: {self.mask!r}, scale={self.scale:g}, dropout_p={self.dropout_p}")
        if self.modifiers is not None:
            lines.append(f"  modifiers: {self.modifiers!r}")
        return "\n".join(lines)


def derived(inputs: Inputs, key, compute: Callable[[], object]):
    """``compute()``, kept in :attr:`Inputs.derived` under ``key`` (computed once for every
    call that shares the validation), or computed where the call keeps nothing."""
    kept = inputs.derived
    if kept is None:
        return compute()
    if key not in kept:
        kept[key] = compute()
    return kept[key]


def _describe(**tensors) -> str:
    return ", ".join(f"{name} {tuple(t.shape)} {t.dtype} {t.device}" for name, t in tensors.items()
                     if isinstance(t, torch.Tensor))


def _refuse_sparse(name: str, t: torch.Tensor, fix: Optional[str] = None) -> None:
    """``TypeError`` for a tensor without strided memory (sparse COO, CSR, CSC, BSR, BSC;
    mkldnn): every backend reads its tensors through their strides. ``fix``: what to do
    (default: pass ``{name}.to_dense()``)."""
    if t.layout is not torch.strided:
        raise TypeError(f"{name} is a {t.layout} tensor of shape {tuple(t.shape)}: attention "
                        f"takes dense (strided) tensors; {fix or f'pass {name}.to_dense()'}")


def _refuse_sparse_mask(mask) -> None:
    """:func:`_refuse_sparse` for the ``mask`` argument: a tensor, or each tensor an attnkit
    mask holds (named by its mask and field, e.g. ``the documents mask's q_ids``)."""
    if isinstance(mask, torch.Tensor):
        _refuse_sparse("mask", mask)
    if not isinstance(mask, Mask) or all(t.layout is torch.strided
                                         for t in mask_tensors(mask) or ()):
        return
    for leaf in mask.leaves():
        for field, value in mask_fields(leaf).items():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    _refuse_sparse(f"the {type(leaf).__name__.lstrip('_').lower()} mask's "
                                  f"{field}", t, f"build the mask from {field}.to_dense()")
    _refuse_sparse("a tensor of the mask", next(t for t in mask_tensors(mask)
                                                 if t.layout is not torch.strided),
                  "build the mask from dense tensors (.to_dense())")


class LazyText:
    """A string computed on first formatting (error messages only)."""

    def __init__(self, make):
        self.make = make

    def __format__(self, spec):
        return format(self.make(), spec)

    def __str__(self):
        return self.make()


TORCH_KEYWORDS = {
    "attn_mask": "pass the tensor as `mask=attn_mask` (bool: True = may attend, as in torch; "
                 "float: added to the scores)",
    "is_causal": "use `mask=ak.causal()` for is_causal=True (top-left aligned, as in torch; "
                 "combine it with another mask by `&`)",
    "enable_gqa": "GQA is automatic (no enable_gqa): k and v with fewer heads than q each "
                  "serve a group of query heads",
}
"""torch SDPA's keyword arguments that attnkit spells differently, with the attnkit spelling."""

FLEX_KEYWORDS = {
    "block_mask": "pass its function as `mask=ak.from_function(block_mask.mask_mod)` (attnkit "
                  "finds the blocks to skip itself)",
    "score_mod": "pass `mask=ak.score_function(score_mod)`, joined to a mask by `&`",
}
"""FlexAttention's keyword arguments, with the attnkit spelling."""

FLASH_ATTN_KEYWORDS = {
    "softmax_scale": "pass it as `scale=`",
    "causal": "use `mask=ak.causal(\"bottom_right\")` for causal=True (flash-attn's alignment: "
              "each sequence's last query sees all its keys; combine masks by `&`)",
    "window_size": "use `mask=ak.sliding_window(left, right, \"bottom_right\")` for "
                   "window_size=(left, right); a side of -1 (unbounded) is "
                   "`ak.masks.UNBOUNDED` there (`ak.causal(\"bottom_right\")` for (-1, 0), no "
                   "mask for (-1, -1))",
    "softcap": "use `mask=ak.softcap(cap)`, joined to the other masks by `&` (it caps the "
               "scaled scores before ALiBi, as flash-attn)",
    "alibi_slopes": "with causal=True (or a window of right side 0) use `mask=ak.alibi(slopes, "
                    "\"bottom_right\")`: it adds slope·(j − i − (Tk − Tq)), flash-attn's "
                    "−slope·|i + Tk − Tq − j| on the keys such a mask keeps. Without, "
                    "flash-attn's bias is symmetric (keys after the query lose slope·distance; "
                    "ak.alibi adds it): use `ak.relative_bias(-slopes[:, None] * "
                    "torch.arange(n), lambda d: d.abs(), \"bottom_right\")` (slopes [H], "
                    "n ≥ the longest sequence). "
                    "varlen_attention takes slopes [H], not [batch_size, H]; paged_attention "
                    "takes ALiBi for one query per sequence, without return_lse",
    "return_attn_probs": "`return_lse=True` gives softmax_lse, as flash-attn lays it out "
                         "(varlen_attention [Hq, total_q], paged_attention [B, Hq, Tq]), −inf "
                         "for a row with no key (flash-attn writes +inf); no S_dmask: "
                         "`attnkit.attention(..., return_weights=True)` gives weights",
    "return_softmax_lse": "pass `return_lse=True`: the LSE [B, Hq, Tq], −inf for a row with no "
                          "key (flash-attn writes +inf)",
    "cache_seqlens": "pass the lengths as `seqlens` (after block_table), counting the new "
                     "tokens: paged_attention appends none, so write k and v into the pools "
                     "first, at positions cache_seqlens[b]… through block_table "
                     "(`attnkit.nn.PagedKVCache.from_tables(...).append(...)` appends into "
                     "blocks of its own choosing: read its block_table() after)",
}
"""flash-attn's keyword arguments (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``) that
:func:`attnkit.varlen_attention` and :func:`attnkit.paged_attention` spell differently, with
the attnkit spelling."""


def refuse_jit_trace(entry: str) -> None:
    """Raise inside ``torch.jit.trace``: a trace records the Python decisions attnkit makes
    from shapes and values (which tiles a mask keeps, which layout a check reads) as
    constants, so the traced graph would silently compute something else at other shapes."""
    if torch._C._get_tracing_state() is not None:
        raise RuntimeError(f"{entry} cannot be recorded by torch.jit.trace (which "
                           f"torch.onnx.export(dynamo=False) also runs): the trace would fix the "
                           f"mask's tiles and layouts to the traced shapes and be wrong at "
                           f"others. Capture it with torch.compile or torch.export.export "
                           f"(torch.onnx.export(dynamo=True) exports from it)")


def unexpected_keywords(function: Callable, keywords: dict) -> TypeError:
    """The error for keyword arguments that ``function`` does not take: torch SDPA's
    (:data:`TORCH_KEYWORDS`), FlexAttention's (:data:`FLEX_KEYWORDS`) and, for the packed and
    paged calls, flash-attn's (:data:`FLASH_ATTN_KEYWORDS`) with their attnkit spelling;
    others with the keywords it takes."""
    names = ", ".join(repr(name) for name in keywords)
    message = (f"{function.__name__}() got unexpected keyword argument"
               f"{'s' if len(keywords) > 1 else ''} {names}")
    tables = [("torch SDPA's", TORCH_KEYWORDS), ("FlexAttention's", FLEX_KEYWORDS)]
    if function.__name__ in ("varlen_attention", "paged_attention"):
        tables.append(("flash-attn's", FLASH_ATTN_KEYWORDS))
    hints = [f"{name} ({source}): {table[name]}" for name in keywords
             for source, table in tables if name in table]
    if hints:
        return TypeError(f"{message}; attnkit spells {'them' if len(hints) > 1 else 'it'}:\n  "
                         + "\n  ".join(hints))
    accepted = [p.name for p in inspect.signature(function).parameters.values()
                if p.kind is not p.VAR_KEYWORD]
    return TypeError(f"{message}; it takes {', '.join(accepted)}")


def validate(q, k, v, mask=None, *, scale=None, dropout_p=0.0, generator=None,
             need_weights=False, need_lse=False, invariant=False) -> Inputs:
    """Check an ``attention()`` call and normalise it to ``[B, H, T, D]``; raise on bad input.

    Accepted forms: ``[Tq, Dk]`` (one sequence), ``[B, Tq, Dk]`` (a batch, one head) and
    ``[..., Hq, Tq, Dk]`` (any leading batch dims). k/v have the same rank and leading dims.
    """
    tensors = dict(q=q, k=k, v=v)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            jagged = (" A jagged [B, H, j, D] as torch's scaled_dot_product_attention takes "
                      "runs packed as attnkit.varlen_attention(x.transpose(1, 2).values() "
                      "for x in q, k, v, then q.offsets(), k.offsets())."
                      if t.layout == torch.jagged else "")
            raise TypeError(f"{name} is a nested tensor (torch.nested, {t.layout}): attention "
                            f"takes dense tensors [..., H, T, D]; pack the sequences along T and pass "
                            f"`mask=ak.documents(ids)` (ids [T]: the sequence of each position), "
                            f"or pad them to one length and pass `mask=ak.padding(kv_lengths="
                            f"lengths)` (q_lengths= too for padded queries).{jagged}")
        if type(t).__name__ == "DTensor":  # torch.distributed.tensor, without importing it
            raise TypeError(f"{name} is a DTensor ({t.placements}): attention takes each "
                            f"rank's local tensors. For heads sharded over ranks, attend on "
                            f"q.to_local(), k.to_local(), v.to_local() and wrap the result with "
                            f"DTensor.from_local(out, q.device_mesh, q.placements); for a "
                            f"sharded sequence, see attnkit.distributed")
        _refuse_sparse(name, t)
    where = LazyText(lambda: _describe(**tensors))  # built only when a message needs it
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            fix = f"convert with {name}.{'dequantize' if t.is_quantized else 'float'}()"
            raise TypeError(f"{name} has dtype {t.dtype}; attention needs floating point "
                            f"(float64/float32/float16/bfloat16): {fix}. Got {where}")
        if t.dim() < 2:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; attention needs at least 2 dims "
                             f"[T, D] (use {name}[None] for a single vector). Got {where}")
    if not (q.dtype == k.dtype == v.dtype):
        autocast = (" (under torch.autocast float64 tensors keep their dtype and the others run "
                    "in the autocast dtype: pass all three in float64, or none)"
                    if torch.float64 in (q.dtype, k.dtype, v.dtype) else "")
        casts = ", ".join(f"{n}.to(q.dtype)" for n, t in (("k", k), ("v", v))
                          if t.dtype != q.dtype)
        raise TypeError(f"q, k and v must share one dtype: {where}. Cast them: "
                        f"{casts}{autocast}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device: {where}. Move them with .to(q.device)")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"q, k and v must have the same number of dims: {where}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the feature dim Dk (the last): q has {q.shape[-1]}, "
                         f"k has {k.shape[-1]}. Got {where}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length Tk (dim -2): k has {k.shape[-2]}, "
                         f"v has {v.shape[-2]}. Got {where}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must match in every dim but the last: {where}")
    for name, t in tensors.items():
        if t.shape[-1] == 0:
            raise ValueError(f"{name} has an empty feature dim: {where}")

    rank = q.dim()
    if rank == 2:
        batch_shape = ()
    elif rank == 3:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"3-D inputs are [B, T, D]: q and k must share the batch size B, "
                             f"got {where}. For heads use 4-D [B, H, T, D]")
        batch_shape = (q.shape[0],)
    else:
        batch_shape = tuple(q.shape[:-3])
        if tuple(k.shape[:-3]) != batch_shape:
            raise ValueError(f"q and k must share the leading batch dims {batch_shape}, got "
                             f"{tuple(k.shape[:-3])}: {where}. Broadcast them explicitly with .expand()")
        hq, hkv = q.shape[-3], k.shape[-3]
        if hq == 0 or hkv == 0:
            raise ValueError(f"q has {hq} heads and k has {hkv} (dim -3): attention needs at least "
                             f"one head on each side. Got {where}. For inputs without heads use "
                             f"[B, T, D] or [T, D]")
        if hq % hkv:
            # dims -3 that do not divide while dims -2 do: torch's [B, T, H, D] layout
            slip = (f". attnkit expects `[B, H, T, D]`: if these are [B, T, H, D] (dim -2 holds "
                    f"{q.shape[-2]} and {k.shape[-2]}), use `x.transpose(1, 2)` on q, k and v"
                    if k.shape[-2] and q.shape[-2] % k.shape[-2] == 0 else "")
            raise ValueError(f"k has {hkv} heads but q has {hq}: the number of query heads must be "
                             f"a multiple of key/value heads (GQA). Got {where}{slip}")
    # Any other layout (transposes, stride-0 expands, slices) is read through its strides by every
    # backend; only a feature dim that is not contiguous (an unbind/chunk view of a fused QKV
    # projection, a strided slice) is copied, since the fused CPU kernels read rows as vectors.
    q4, k4, v4 = (_bhtd(t, rank, batch_shape) for t in (q, k, v))

    scale = checked_scale(scale, q.shape[-1])
    if q.dtype != torch.float64 and abs(scale) > torch.finfo(torch.float32).max:
        raise ValueError(f"scale={scale!r} is beyond float32's range, in which {q.dtype} "
                         f"scores are computed (they would be inf, the softmax NaN): scale the "
                         f"inputs instead, or use float64")
    if (isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real)
            or not 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p={dropout_p!r}: must be a float in [0, 1)")
    for name, flag in (("return_weights", need_weights), ("return_lse", need_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r}: pass True or False")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if (generator is not None and dropout_p
            and generator.device.type not in ("cpu", "meta", q.device.type)
            and q.device.type != "meta"):
        # (where dropout draws: the CPU's is accepted for any q, the tiled engine draws its
        # seed on the generator's device; a generator of another device cannot draw on q's;
        # shapes alone draw nothing)
        raise ValueError(f"generator is on {generator.device} but q {tuple(q.shape)} is on "
                         f"{q.device}: make it with torch.Generator(device=q.device), or "
                         f"torch.Generator() (the CPU's)")

    _refuse_sparse_mask(mask)
    mask, modifiers = split(as_mask(mask))
    if modifiers is not None:
        modifiers = _resolved_neg(modifiers)
    # sinks join the finished result through its LSE (modifiers.Sinks.join): the call needs one
    need_lse = need_lse or (modifiers is not None and modifiers.sinks is not None)
    inputs = Inputs(q=q4, k=k4, v=v4, mask=mask, scale=float(scale), dropout_p=float(dropout_p),
                    generator=generator, batch_shape=batch_shape, input_rank=rank,
                    need_weights=need_weights, need_lse=need_lse, modifiers=modifiers,
                    invariant=invariant, derived={})
    if modifiers is not None:
        problems = modifiers.check(inputs.space)
        if problems:
            raise ValueError("score modifiers do not fit the inputs:\n  " + "\n  ".join(problems)
                             + f"\nInputs (normalised to [B, H, T, D]):\n{inputs.describe()}")
    if mask is not None:
        mask = _fit_mask(mask, inputs)
        inputs.mask = mask
    grad_mode = torch.is_grad_enabled()
    inputs.need_grad = grad_mode and any(t.requires_grad for t in inputs.grad_tensors)
    inputs.bias_grad = grad_mode and any(t.requires_grad for t in inputs.biases)
    inputs.transformed = _transformed(inputs)
    if mask is not None:
        if q.device.type != "meta":  # a mask built under `with torch.device("meta")`
            for t in mask_tensors(mask) or ():
                if t.device.type == "meta":
                    raise ValueError(f"the mask holds a meta tensor {tuple(t.shape)} (no data) "
                                     f"but q is on {q.device}: build the mask from tensors "
                                     f"with values (outside `with torch.device('meta')`), "
                                     f"or on q's device")
        problems = mask.check(inputs.space)
        if problems:
            raise ValueError("mask does not fit the inputs:\n  " + "\n  ".join(problems)
                             + f"\nInputs (normalised to [B, H, T, D]):\n{inputs.describe()}")
        inputs.mask = mask.simplified(inputs.space)
    return inputs


def _transformed(inputs: Inputs) -> bool:
    """:attr:`Inputs.transformed` for a validated call: a tensor it takes is a ``torch.func``
    wrapper or a dual tensor (q, k, v, and every tensor the mask and its modifiers hold: ``vmap``
    over per-example lengths, ids or bool masks wraps them alone), or a transform is active
    and the call runs the caller's code (``from_function``, a score or bucket function), which
    may read a wrapped tensor the mask does not hold. Never inside a compiled graph, which
    holds no wrappers (and dynamo cannot trace the functorch query)."""
    if torch.compiler.is_compiling():
        return False
    mask, modifiers = inputs.mask, inputs.modifiers
    held = () if mask is None else held_tensors(mask)
    if any(_is_wrapped(t) for t in (*inputs.grad_tensors, *held)):
        return True
    runs_code = (mask is not None and mask_tensors(mask) is None) or (
        modifiers is not None and (bool(modifiers.functions) or any(
            part.buckets is not None for part in modifiers.relative)))
    return runs_code and torch._C._functorch.peek_interpreter_stack() is not None


LAST_QUERY_CAUSAL = Band(None, 0, "bottom_right")
"""``causal("bottom_right")``: with one query it allows every key."""


def checked_scale(scale, head_dim: int) -> float:
    """``scale`` as a call uses it: ``1/sqrt(head_dim)`` for ``None``; ``TypeError`` for a
    non-number, ``ValueError`` for NaN or ±inf."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float (or None for 1/sqrt(Dk)), got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale!r}: use a finite number (a temperature τ is "
                         f"scale=1/(τ·sqrt(Dk)))")
    return scale


class CallCache:
    """Validated calls by signature, so a model's many identical small calls validate (and pick
    a backend) once: the tensors' shapes, whether their rows have unit stride (nothing else
    of a layout changes validation or the choice: a growing cache's views, whose strides
    change with its length, hit), dtypes, devices and ``requires_grad``, grad mode, the
    mask's :func:`~attnkit.masks.validation_key` (tensors by identity and version counter,
    so a mask whose lengths or ids were written to in place through torch is validated
    again, and keying reads no value; score modifiers in it too, their tensors with
    ``requires_grad``; a decoding step's vouched padding, and a padding read from ``[B, T]``
    masks, by its shapes), and every other
    argument. A hit rebuilds the :class:`Inputs` from the current tensors with the remembered
    layout, mask (the call's own, for a mask keyed by shape), modifiers and choice, and skips
    the checks that gave the same answer before. Calls that cannot be keyed are never cached:
    masks without a cache key (``dense``, ``bias``, ``from_function``, ``score_function``,
    ``relative_bias`` with a bucket function, tensors), masks or modifiers holding a tensor
    computed with autograd history (a new one each step: an entry would keep its graph),
    dropout, ``torch.func`` wrappers, compiled graphs.

    Bounded twice: at most ``entries`` calls, and the tensors their masks derived (dense
    biases of ``Tq·Tk`` per sequence, kept for hits on the same mask) and the memory of the
    tensors they hold (the whole storage a view of a larger tensor keeps alive) at most
    about ``derived_bytes``: a server seeing a new mask each call keeps only its latest few.
    The least recently used entries go first.

    Shared by the threads of a process (a server's thread pool calling one model): a lock
    guards the entries and their accounting; validation, and the calls themselves, run
    outside it."""

    def __init__(self, entries: int = 256, derived_bytes: int = 64 << 20):
        self.entries, self.derived_bytes = entries, derived_bytes
        self._calls: OrderedDict = OrderedDict()
        self._sizes: dict = {}  # key -> bytes derived (measured at the next insertion)
        self._bytes = 0
        self._newest = None  # the key inserted last, its size not measured yet
        self._lock = threading.Lock()  # guards the four above

    def _insert(self, key, entry: tuple) -> None:
        """Remember ``entry`` under ``key``, the oldest entries evicted past either bound
        (holding :attr:`_lock`). A key another thread inserted meanwhile keeps its entry."""
        if key in self._calls:
            self._calls.move_to_end(key)
            return
        newest = self._newest
        if newest is not None and newest in self._calls:  # its call has derived by now
            kept, _, held = self._calls[newest]
            size = _nbytes((kept.derived, derived_values(kept.mask), held))
            self._sizes[newest] = size
            self._bytes += size
        while self._calls and (len(self._calls) >= self.entries
                               or self._bytes > self.derived_bytes):
            old, _ = self._calls.popitem(last=False)
            self._bytes -= self._sizes.pop(old, 0)
        self._calls[key] = entry
        self._newest = key

    def get(self, q, k, v, mask, options: tuple, validate_and_choose: Callable[[], tuple]):
        """``(inputs, choice)`` for this call: from the cache, or ``validate_and_choose()``
        (which returns them) remembered under the call's signature. ``options``: the call's
        other arguments, hashable. Called outside compiled regions only (the caller
        validates a traced call itself)."""
        key, keep, by_shape = (self._signature(q, k, v, mask, options) if keeping()
                               else (None, [], False))
        hit = None
        try:
            if key is not None:
                with self._lock:
                    hit = self._calls.get(key)
                    if hit is not None:
                        self._calls.move_to_end(key)  # least recently used first out
        except TypeError:  # an unhashable argument: validation will say what is wrong with it
            key = None
        if hit is None:
            inputs, choice = validate_and_choose()
            # a mask keyed by shape runs as given on a hit: only where validation kept it
            if key is not None and (not by_shape or inputs.mask is mask):
                # what the call derived from its mask, for every hit: not for a mask keyed by
                # shape, a new mask at every hit, nor from what an optimizer may step
                # (masks.learnable: a fused one writes without moving the version counter)
                fresh = by_shape or any(map(learnable, keep))
                # (a mask keyed by shape is not kept: a hit runs on its own mask, and an
                # entry would keep the caller's first mask and its tensors alive for nothing)
                kept = dataclasses.replace(inputs, q=None, k=None, v=None, _allowed=None,
                                           _has_key=None, mask=None if by_shape else inputs.mask,
                                           derived=None if fresh else inputs.derived)
                with self._lock:
                    self._insert(key, (kept, choice, keep))
            return inputs, choice
        t, choice, _ = hit
        rank, batch = t.input_rank, t.batch_shape
        return Inputs(_bhtd(q, rank, batch), _bhtd(k, rank, batch), _bhtd(v, rank, batch),
                      mask if by_shape else t.mask, t.scale, t.dropout_p, t.generator, batch,
                      rank, t.need_weights, t.need_lse, t.need_grad, t.bias_grad, t.transformed,
                      t.modifiers, t.invariant, derived=t.derived), choice

    @staticmethod
    def _signature(q, k, v, mask, options: tuple) -> tuple[Optional[tuple], list, bool]:
        """``(key, keep, by_shape)``: the call's key (``None``: not cached), the tensors an
        entry must hold, and whether the mask is keyed by shape (:func:`validation_key`)."""
        keep: list = []
        tensor, strided = torch.Tensor, torch.strided
        if (type(q) is not tensor or type(k) is not tensor or type(v) is not tensor
                or q.is_nested or k.is_nested or v.is_nested
                or q.layout is not strided or k.layout is not strided or v.layout is not strided
                or wrapped_eagerly(q) or wrapped_eagerly(k) or wrapped_eagerly(v)
                or min(q.dim(), k.dim(), v.dim()) < 2):  # validation says what is wrong
            return None, keep, False
        by_shape = False
        if mask is None:
            mask_key = None
        elif isinstance(mask, Mask):
            mask_key, by_shape = validation_key(mask, keep, q.shape[-2], k.shape[-2])
            if mask_key is None or any(getattr(t, "grad_fn", None) is not None for t in keep):
                return None, keep, False  # (a tensor with history: a new one every step)
        else:
            return None, keep, False
        k_shape, v_shape = k.shape, v.shape
        if by_shape or mask is None or (mask.band() == LAST_QUERY_CAUSAL and q.shape[-2] == 1):
            # no mask left over any keys, or one validated from its shapes: validation and the
            # backend do not depend on Tk ≥ 1 (a decode loop's growing cache hits)
            if k_shape[-2] == 0 or k_shape[-2:-1] != v_shape[-2:-1]:
                return None, keep, False
            # what the choice may still depend on: a cache at least 4x the queries (decoding),
            # a mask small enough to materialise (the torch backend's dense bias)
            q_len, kv_len = q.shape[-2], k_shape[-2]
            k_shape = (k_shape[:-2] + k_shape[-1:], kv_len >= 4 * q_len,
                       q_len * kv_len <= DENSE_MAX_SCORES)
            v_shape = v_shape[:-2] + v_shape[-1:]
        # the interpreter matters only to the triton backend, named (auto never takes it on CPU)
        interpreted = os.environ.get("TRITON_INTERPRET") if "triton" in options else None
        return (q.shape, q.stride(-1) == 1, q.dtype, q.device, q.requires_grad,
                k_shape, k.stride(-1) == 1, k.dtype, k.device, k.requires_grad,
                v_shape, v.stride(-1) == 1, v.dtype, v.device, v.requires_grad,
                mask_key, torch.is_grad_enabled(), interpreted, options), keep, by_shape


def _nbytes(value) -> int:
    """The bytes of the distinct storages behind the tensors in ``value`` (a tensor, or
    tuples, lists and dicts of them): a tensor shared by several of them (a mask's dense form
    that a call's derived values hold too) counts once, an expanded view by the memory it
    reads, a view of a larger tensor by the whole storage it keeps alive. Reads a copy of
    each list and dict: other threads add to a call's derived values and a mask's memos
    while they are measured."""
    tensors, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(tuple(item))
        elif isinstance(item, dict):
            stack.extend(tuple(item.values()))
    return _storage_bytes(tensors)


def _storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors`` (a view keeps its base's whole
    storage alive); 0 for tensors without memory of their own (meta). A tensor whose storage
    cannot be read (a ``torch.func`` wrapper, a sparse or nested tensor, a subclass) counts
    its elements once."""
    storages = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            storages[id(t)] = t.numel() * t.element_size()
        else:
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _bhtd(t: torch.Tensor, rank: int, batch_shape: tuple) -> torch.Tensor:
    """A caller's tensor as ``[B, H, T, D]``, as :func:`validate` lays it out. A negative
    view (``torch._neg_view``: memory holding ``-t``) is materialised, since kernels that
    read memory through a pointer (triton) or reinterpret its bits would miss the sign."""
    t = t.resolve_neg()  # itself unless a negative view (and dynamo traces it, not is_neg)
    if rank == 2:
        t = t[None, None]
    elif rank == 3:
        t = t[:, None]
    elif rank > 4:
        t = t.reshape(math.prod(batch_shape), *t.shape[-3:])
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _resolved_neg(modifiers: Modifiers) -> Modifiers:
    """``modifiers`` with the ALiBi slopes, relative-bias tables and sink logits that are
    negative views materialised, as :func:`_bhtd` does for q, k and v (the tensors score
    functions read stay as given: their function reads them through torch)."""
    parts = (*modifiers.alibi, *modifiers.relative,
             *(() if modifiers.sinks is None else (modifiers.sinks,)))
    if torch.compiler.is_compiling():  # (dynamo does not trace is_neg)
        return modifiers
    swap = {id(t): t.resolve_neg() for part in parts for t in part.tensors() if t.is_neg()}
    return modifiers._swapped(swap) if swap else modifiers


def _fit_mask(mask: Mask, inputs: Inputs) -> Mask:
    """Tensor masks follow the caller's layout; map them to [B, H, Tq, Tk] once, here."""

    def fit(t: torch.Tensor, is_bias: bool) -> torch.Tensor:
        what = f"{'bias' if is_bias else 'mask'} of shape {tuple(t.shape)}"
        if t.device != inputs.q.device:
            raise ValueError(f"{what} is on {t.device} but q {tuple(inputs.q.shape)} is on "
                             f"{inputs.q.device}: move it with .to(q.device)")
        if is_bias and t.dtype != inputs.q.dtype and t.dtype not in (torch.float32, torch.float64):
            # (under torch.autocast q is in the autocast dtype here, the bias as given, and
            # autocast is off: a fix named by q's dtype could name one the caller's q does not
            # have, except for float64, which autocast never casts)
            autocast = (" (under torch.autocast, the autocast dtype; a bias keeps its own)"
                        if inputs.q.dtype != torch.float64 else "")
            raise TypeError(f"{what} has dtype {t.dtype} but q has {inputs.q.dtype}{autocast}: "
                            f"a bias is float32, float64 or q's dtype. Cast it with .float()"
                            + (", or .to(q.dtype) outside torch.autocast" if autocast
                               else " or .to(q.dtype)"))
        t4 = _to_4d(t.resolve_neg(), inputs)  # as _bhtd does
        if is_bias and inputs.q.dtype == torch.float64:
            t4 = t4.to(torch.float64)  # biases of float64 inputs add (and sum) in float64
        return t4

    return mask.map_score_tensors(fit)


def _to_4d(t: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """A tensor broadcastable to the caller's [..., H, Tq, Tk] → [Bm, Hm, Tq, Tk]."""
    rank, batch_shape = inputs.input_rank, inputs.batch_shape
    caller = (*batch_shape, inputs.q.shape[1], inputs.q.shape[2], inputs.k.shape[2])
    if rank == 3:  # caller's form is [B, Tq, Tk] with no head dim
        caller = (*batch_shape, inputs.q.shape[2], inputs.k.shape[2])
    elif rank == 2:
        caller = caller[-2:]
    if t.dim() > len(caller) or any(s not in (1, c) for s, c in zip(t.shape[::-1], caller[::-1])):
        raise ValueError(f"mask of shape {tuple(t.shape)} is not broadcastable to the scores "
                         f"{list(caller)} (q {tuple(inputs.q.shape)} normalised): each dim must "
                         f"match or be 1; masks are never silently broadcast otherwise")
    t = t.reshape((1,) * (len(caller) - t.dim()) + tuple(t.shape))
    if rank == 3:
        t = t.unsqueeze(1)
    elif rank == 2:
        t = t[None, None]
    lead = t.shape[:-3]
    if all(s == 1 for s in lead):
        return t.reshape(1, *t.shape[-3:])
    return t.expand(*batch_shape, *t.shape[-3:]).reshape(math.prod(batch_shape), *t.shape[-3:])


def restore(x: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """``[B, H, Tq, ...]`` → the caller's layout (``[Tq, ...]``, ``[B, Tq, ...]`` or ``[..., H, Tq, ...]``)."""
    if inputs.input_rank == 2:
        return x[0, 0]
    if inputs.input_rank == 3:
        return x[:, 0]
    if inputs.input_rank == 4:
        return x
    return x.reshape(*inputs.batch_shape, *x.shape[1:])
