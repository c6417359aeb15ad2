"""Differential fuzzing of score modifiers with per-sequence masks against an oracle written here.

Hypothesis draws a :class:`ModCase` (plain parameters, so a failing example prints as a
readable reproducer): one to three score modifiers joined by ``&`` with a mask, in a drawn
order — ``softcap(c)`` (caps from 1e-3 to 30, rarely near the ends of float32's normal range),
``alibi(slopes, align)`` (``[H]`` or ``[B, H]``, positive or mixed signs, fixed or learnable),
``relative_bias(table, buckets)`` (T5's default buckets, ``t5_buckets`` with other arguments
through ``functools.partial``, and custom bucket functions; fixed or learnable tables),
``sinks(logits)`` (fixed or learnable), ``score_function(fn)`` (functions of the score, the
batch, head and positions, reading a learnable tensor from their closure or listed with
``tensors=``; some return a result of shape ``[1, 1, tq, tk]`` or ``[1, 1, 1, tk]``) — and masks: none,
``causal``/``sliding_window`` in both alignments, ``padding`` with lengths and starts,
``causal``/``sliding_window`` with ``sequences=padding(...)``, ``documents`` (shared ids or
``q_ids``/``kv_ids``, per batch element or not) and ``documents(..., causal=...)``, and ``&``
of two of these. Shapes: rank 2..5, ``Tq``/``Tk`` from 0 (empty sequences) through ~70, a few
with more than 128 keys, GQA, ``Dk != Dv``; dtypes float64/float32/float16/bfloat16; scale
None or drawn; ``return_lse``/``return_weights``; gradients of q, k, v and of every learnable
modifier tensor.

Each case runs on ``reference``, ``tiled``, ``torch``, ``auto`` and, on a subset of small cases
where the triton interpreter is usable (``test_fuzz.triton_usable``; the tests set
``TRITON_INTERPRET=1`` as ``test_triton.py`` does), ``triton``. A "cannot run these inputs"
``ValueError`` is a refusal, counted; any other exception is a failure.

The oracle (:func:`oracle`) never calls attnkit's computation. In float64, per batch element
and query head, from the definition in ``attnkit.modifiers`` and ``docs/DESIGN.md``: ``s =
scale·q·kᵀ``, ``s = c·tanh(s/c)``, ``s += slope_h·(j − i − shift)`` (ALiBi; positions are
global, as the docs say: padding, starts and documents do not move them; ``shift = Tk − Tq``
for ``bottom_right``), ``s += table[h, bucket(j − i)]`` (buckets by ``test_modifiers.t5_bucket``,
written from the T5 paper, or the custom rule), ``s = fn(s, b, h, i, j)`` in ``&`` order, masked
keys excluded by ``torch.where``, then a softmax whose denominator holds ``exp(sink_h)``. A
row without an allowed key gives out 0 and weights 0, and lse −inf, or ``sink_h`` with sinks.
The masks' allowed matrices come from ``test_fuzz.materialise`` (plain masks) or are built
here from the documented rules (per-sequence bands, causal documents). Gradients are autograd's
through the float64 oracle.

Tolerances are ``test_fuzz.compare``'s: error ≤ 2 × the error of the same math in the input
dtype + a floor (``conftest.error_floor`` and the rounding of the scores in the accumulation
dtype, ``4·eps·max(|scale|·Σ|q||k| + |biases| + |s|)``); gradient floors from the backward's
form ``ds = p ∘ (dp − Δ)``, carried into each modifier tensor by its derivative (``|j − i|``
for slopes, 1 for table entries and sink logits).

``test_fuzz_modifiers`` is the bounded default (per dtype family); ``test_fuzz_modifiers_survey``
(``-m slow``, ``$ATTNKIT_FUZZ_EXAMPLES`` examples, 5000 by default) records every disagreement
and exception, shrinks each kind with :func:`minimise` and prints them grouped with per-backend
counts. ``run_case(ModCase(...))`` replays a printed case.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import MISSING, dataclass, fields, replace
from typing import NamedTuple, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import import_triton_interpreted

import_triton_interpreted()

import attnkit as ak  # noqa: E402

import test_fuzz  # noqa: E402
from test_fuzz import (FUZZ_SETTINGS, INF, Problem, Result, Stats, _wants,  # noqa: E402
                       call_attention, compare, run_survey, score_grad_size, triton_usable,
                       try_backend, written_to)
from test_modifiers import t5_bucket  # noqa: E402

BACKENDS = ("reference", "tiled", "torch", "auto")
PARAM_DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ---- the drawn case ------------------------------------------------------------------------------

@dataclass(frozen=True, repr=False)
class ModCase(test_fuzz.Case):
    """One example: :class:`test_fuzz.Case`'s shapes, dtype, scale and outputs (contiguous
    inputs, no poison), with ``mask`` and ``mods`` as below, and ``mask_at``: the position of
    the mask in the ``&`` chain of modifiers (0: first; past the end: last).

    ``mask``: None or ``("and", x, y)`` of leaves ``("causal", align)``,
    ``("window", left, right, align)``, ``("padding", q_lengths, kv_lengths, q_starts,
    kv_starts)`` and ``("documents", n_docs, sorted, per_batch, shared, seed)`` (test_fuzz's
    forms), ``("sequences", band, left, right, align, q_lengths, kv_lengths, q_starts,
    kv_starts)`` (``band``: ``"causal"`` or ``"window"``; ``causal``/``sliding_window`` with
    ``sequences=padding(...)``) and ``("causal_documents", n_docs, per_batch, shared, seed,
    align)`` (sorted ids, ``documents(q_ids, kv_ids or None, causal=align)``).

    ``mods``: in ``&`` order, ``("softcap", cap)``, ``("alibi", per_batch, align, magnitude,
    mixed_signs, learn, param_dtype, seed)``, ``("relative", buckets, num_buckets, bidirectional,
    max_distance, sigma, learn, param_dtype, seed)`` (``buckets``: ``"t5"`` (None),
    ``"t5_partial"``, ``"clamp"``, ``"modulo"``), ``("sinks", offset, learn, param_dtype, seed)``,
    ``("function", kind, learn, listed, param_dtype, seed)`` (see :func:`make_function`).
    ``param_dtype``: ``"float32"``, ``"float64"`` or ``"same"`` (the input dtype).
    ``grad``: which of q, k, v require grad; learnable modifier tensors require grad too, and
    a case with either takes gradients.
    """

    mods: tuple = ()
    mask_at: int = 0

    def __repr__(self):
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is not MISSING and value == f.default and f.name not in ("mask", "mods"):
                continue
            parts.append(f"{f.name}={value!r}")
        return f"ModCase({', '.join(parts)})"


# ---- masks: attnkit's objects and the oracle's allowed matrices -----------------------------------

def _sorted_documents(leaf: tuple) -> tuple:
    """A causal_documents leaf as test_fuzz's documents leaf with sorted ids."""
    _, n_docs, per_batch, shared, seed, _ = leaf
    return ("documents", n_docs, True, per_batch, shared, seed)


def _padding_of(spec: tuple):
    def listed(values):
        return None if values is None else list(values)
    return ak.padding(q_lengths=listed(spec[0]), kv_lengths=listed(spec[1]),
                      q_starts=listed(spec[2]), kv_starts=listed(spec[3]))


def mask_object(spec, case: ModCase):
    """The attnkit mask of ``spec`` (None for no mask)."""
    if spec is None:
        return None
    kind = spec[0]
    if kind == "and":
        return mask_object(spec[1], case) & mask_object(spec[2], case)
    if kind == "sequences":
        _, band, left, right, align = spec[:5]
        sequences = _padding_of(spec[5:])
        if band == "causal":
            return ak.causal(align, sequences=sequences)
        return ak.sliding_window(left, right, align, sequences=sequences)
    if kind == "causal_documents":
        q_ids, kv_ids = test_fuzz._document_ids(_sorted_documents(spec), case)
        return ak.documents(q_ids, kv_ids, causal=spec[-1])
    return test_fuzz.mask_argument(spec, case, {})


def _runs(spec: tuple, case: ModCase):
    """Real runs of a padding spec ``(q_lengths, kv_lengths, q_starts, kv_starts)`` →
    ``q_lo, q_hi, kv_lo, kv_hi`` (long ``[Bf]``), by the documented defaults: start 0, length
    to the end of the sequence."""
    def per_batch(values, default):
        if values is None:
            return torch.full((case.bf,), default, dtype=torch.long)
        t = torch.tensor(values, dtype=torch.long)
        return t.expand(case.bf) if t.numel() == 1 else t
    q_lo, kv_lo = per_batch(spec[2], 0), per_batch(spec[3], 0)
    q_hi = q_lo + (per_batch(spec[0], 0) if spec[0] is not None else case.tq - q_lo)
    kv_hi = kv_lo + (per_batch(spec[1], 0) if spec[1] is not None else case.tk - kv_lo)
    return q_lo, q_hi, kv_lo, kv_hi


def allowed_matrix(spec, case: ModCase) -> torch.Tensor:
    """The oracle's mask ``[Bf, Hq, Tq, Tk]`` bool, from the documented rules."""
    full = (case.bf, case.hq, case.tq, case.tk)
    if spec is None:
        return torch.ones(full, dtype=torch.bool)
    kind = spec[0]
    i = torch.arange(case.tq)[None, :, None]  # [1, Tq, 1]
    j = torch.arange(case.tk)[None, None, :]  # [1, 1, Tk]
    if kind == "and":
        return allowed_matrix(spec[1], case) & allowed_matrix(spec[2], case)
    if kind == "sequences":
        # a real query sees a real key when −left ≤ (j − i) − shift_b ≤ right, shift_b from the
        # runs' starts (top_left) or ends (bottom_right)
        _, band, left, right, align = spec[:5]
        q_lo, q_hi, kv_lo, kv_hi = (t[:, None, None] for t in _runs(spec[5:], case))
        shift = kv_lo - q_lo if align == "top_left" else kv_hi - q_hi
        rel = j - i - shift
        inside = (rel <= 0) if band == "causal" else (rel >= -left) & (rel <= right)
        real = (i >= q_lo) & (i < q_hi) & (j >= kv_lo) & (j < kv_hi)
        return (inside & real)[:, None].expand(full).clone()
    if kind == "causal_documents":
        q_ids, kv_ids = test_fuzz._document_ids(_sorted_documents(spec), case)
        kv_ids = q_ids if kv_ids is None else kv_ids
        q_ids = q_ids if q_ids.dim() == 2 else q_ids[None].expand(case.bf, case.tq)
        kv_ids = kv_ids if kv_ids.dim() == 2 else kv_ids[None].expand(case.bf, case.tk)
        allowed = torch.zeros(case.bf, case.tq, case.tk, dtype=torch.bool)
        for b in range(case.bf):  # by each document's segments, written out
            for doc in set(q_ids[b].tolist()) & set(kv_ids[b].tolist()):
                qs = (q_ids[b] == doc).nonzero().flatten()
                ks = (kv_ids[b] == doc).nonzero().flatten()
                for qi, q_pos in enumerate(qs.tolist()):
                    for ki, k_pos in enumerate(ks.tolist()):
                        if spec[-1] == "top_left":
                            allowed[b, q_pos, k_pos] = ki <= qi
                        else:
                            allowed[b, q_pos, k_pos] = ki - len(ks) <= qi - len(qs)
        return allowed[:, None].expand(full).clone()
    allowed, _ = test_fuzz.materialise(spec, case, {})
    return allowed


# ---- modifiers: attnkit's objects and the oracle's scores ----------------------------------------

def make_function(kind: str, w: Optional[torch.Tensor]):
    """A score function of ``kind`` reading ``w`` (its parameter, or None):

    - ``tanh``: ``4·tanh(s/4)``; ``where``: ``s + 1`` where ``(i − j) % 3 == 0``;
    - ``batch``: ``s + 0.25·b − 0.5·(h % 2)``;
    - ``distance``: ``s + 0.1·w[h]·(i − j)``, ``w [H]``; ``head``: ``s·w[h]``, ``w [H]``;
    - ``replace``: ``−0.1·|i − j|`` (ignores s: shape ``[1, 1, tq, tk]``);
    - ``key``: ``w[j]`` (ignores s: shape ``[1, 1, 1, tk]``), ``w [Tk]``.
    """
    if kind == "tanh":
        def tanh(s, b, h, q_idx, kv_idx):
            return 4.0 * torch.tanh(s / 4.0)
        return tanh
    if kind == "where":
        def every_third(s, b, h, q_idx, kv_idx):
            return torch.where((q_idx - kv_idx) % 3 == 0, s + 1.0, s)
        return every_third
    if kind == "batch":
        def by_batch(s, b, h, q_idx, kv_idx):
            return s + 0.25 * b.to(s.dtype) - 0.5 * (h % 2).to(s.dtype)
        return by_batch
    if kind == "distance":
        def distance(s, b, h, q_idx, kv_idx):
            return s + 0.1 * w[h].to(s.dtype) * (q_idx - kv_idx).to(s.dtype)
        return distance
    if kind == "head":
        def per_head(s, b, h, q_idx, kv_idx):
            return s * w[h].to(s.dtype)
        return per_head
    if kind == "replace":
        def by_position(s, b, h, q_idx, kv_idx):
            return -0.1 * (q_idx - kv_idx).abs().to(s.dtype)
        return by_position
    if kind == "key":
        def per_key(s, b, h, q_idx, kv_idx):
            return w[kv_idx].to(s.dtype)
        return per_key
    raise KeyError(kind)


FUNCTION_PARAMS = {"distance": "heads", "head": "heads", "key": "keys"}


def _bucket_rule(mod: tuple):
    """``(attnkit's buckets argument, the oracle's bucket of one relative position)``."""
    _, buckets, nb, bidirectional, max_distance = mod[:5]
    if buckets == "t5":
        return None, lambda r: t5_bucket(r, nb)
    if buckets == "t5_partial":
        return (functools.partial(ak.t5_buckets, num_buckets=nb, bidirectional=bidirectional,
                                  max_distance=max_distance),
                lambda r: t5_bucket(r, nb, bidirectional, max_distance))
    if buckets == "clamp":  # nb = 2m + 1 buckets for distances −m … m
        m = (nb - 1) // 2

        def clamped(relative):
            return relative.clamp(-m, m) + m
        return clamped, lambda r: min(max(r, -m), m) + m

    def modulo(relative):
        return relative.remainder(nb)
    return modulo, lambda r: r % nb


def _param_dtype(name: str, case: ModCase) -> torch.dtype:
    return case.torch_dtype if name == "same" else PARAM_DTYPES[name]


def modifier_params(case: ModCase) -> dict:
    """Each modifier's tensor (index in ``mods`` → tensor), learnable ones requiring grad."""
    params = {}
    for index, mod in enumerate(case.mods):
        kind = mod[0]
        if kind == "softcap":
            continue
        gen = torch.Generator().manual_seed(mod[-1])
        if kind == "alibi":
            _, per_batch, _, magnitude, mixed, learn, pdtype, _ = mod
            shape = (case.bf, case.hq) if per_batch else (case.hq,)
            values = magnitude * torch.rand(shape, generator=gen, dtype=torch.float64)
            if mixed:
                values = values * torch.randn(shape, generator=gen, dtype=torch.float64).sign()
        elif kind == "relative":
            nb, sigma, learn, pdtype = mod[2], mod[5], mod[6], mod[7]
            values = sigma * torch.randn(case.hq, nb, generator=gen, dtype=torch.float64)
        elif kind == "sinks":
            _, offset, learn, pdtype, _ = mod
            values = offset + torch.randn(case.hq, generator=gen, dtype=torch.float64)
        else:
            _, fkind, learn, _, pdtype, _ = mod
            what = FUNCTION_PARAMS.get(fkind)
            if what is None:
                continue
            size = case.hq if what == "heads" else case.tk
            values = 0.5 + torch.rand(size, generator=gen, dtype=torch.float64) if fkind == "head" \
                else torch.randn(size, generator=gen, dtype=torch.float64)
        params[index] = values.to(_param_dtype(pdtype, case)).requires_grad_(learn)
    return params


def modifier_objects(case: ModCase, params: dict) -> list:
    """The attnkit modifiers of ``case`` in ``&`` order."""
    out = []
    for index, mod in enumerate(case.mods):
        kind = mod[0]
        if kind == "softcap":
            out.append(ak.softcap(mod[1]))
        elif kind == "alibi":
            out.append(ak.alibi(params[index], align=mod[2]))
        elif kind == "relative":
            out.append(ak.relative_bias(params[index], buckets=_bucket_rule(mod)[0]))
        elif kind == "sinks":
            out.append(ak.sinks(params[index]))
        else:
            w = params.get(index)
            fn = make_function(mod[1], w)
            listed = mod[3] and w is not None
            out.append(ak.score_function(fn, tensors=[w] if listed else None))
    return out


def mask_argument(case: ModCase, params: dict):
    """The ``mask=`` argument: the mask spliced into the modifiers' ``&`` chain at ``mask_at``."""
    parts = modifier_objects(case, params)
    mask = mask_object(case.mask, case)
    if mask is not None:
        parts.insert(min(case.mask_at, len(parts)), mask)
    return functools.reduce(lambda a, b: a & b, parts) if parts else None


class OracleOut(NamedTuple):
    out: torch.Tensor  # [Bf, Hq, Tq, Dv]
    lse: torch.Tensor  # [Bf, Hq, Tq]
    weights: torch.Tensor  # [Bf, Hq, Tq, Tk]
    size: torch.Tensor  # [Bf, Hq, Tq, Tk]: |scale|·Σ|q||k| + |biases| + |s|, 0 where masked
    sink: Optional[torch.Tensor]  # [1, Hq, 1] or None
    distances: dict  # mod index -> |∂s/∂parameter| factor [Bf|1, Hq|1, Tq, Tk]


def oracle(case: ModCase, q, k, v, allowed, params: dict, scale: float, wrong: str = "",
           ) -> OracleOut:
    """Attention with the case's modifiers in q's dtype, from the definition.

    ``q [Bf, Hq, Tq, Dk]``, ``k [Bf, Hkv, Tk, Dk]``, ``v [Bf, Hkv, Tk, Dv]``, ``allowed
    [Bf, Hq, Tq, Tk]``, ``params``: the modifiers' tensors (index → tensor, any dtype: cast to
    q's here). ``wrong``: a deliberate misreading (:data:`MISREADINGS`), to show the
    comparison catches one."""
    dtype = q.dtype
    bf, hq, tq, tk = allowed.shape
    kq = k.repeat_interleave(case.group, dim=1)  # [Bf, Hq, Tk, Dk]
    vq = v.repeat_interleave(case.group, dim=1)  # [Bf, Hq, Tk, Dv]
    s = (q @ kq.transpose(-1, -2)) * scale  # [Bf, Hq, Tq, Tk]
    size = (q.detach().abs().double() @ kq.detach().abs().double().transpose(-1, -2)) * abs(scale)
    i = torch.arange(tq)[:, None]  # [Tq, 1] global query positions
    j = torch.arange(tk)[None, :]  # [1, Tk] global key positions
    b_idx = torch.arange(bf)[:, None, None, None]
    h_idx = torch.arange(hq)[None, :, None, None]
    mods = [(index, mod) for index, mod in enumerate(case.mods) if wrong != f"{mod[0]} left out"]
    factors = {}
    for index, mod in mods:  # softcap first, whatever its place in the chain
        if mod[0] == "softcap":
            s = mod[1] * torch.tanh(s / mod[1])
    for index, mod in mods:  # then the additive biases
        if mod[0] == "alibi":
            bottom_right = (mod[2] == "bottom_right") != (wrong == "alibi alignment swapped")
            shift = tk - tq if bottom_right else 0
            distance = (j - i - shift).to(dtype)  # [Tq, Tk]
            slopes = params[index].to(dtype).reshape(-1, hq)[:, :, None, None]  # [1|Bf, Hq, 1, 1]
            bias = slopes * distance
            factors[index] = distance.abs().double()[None, None]
        elif mod[0] == "relative":
            rule = _bucket_rule(mod)[1]
            ids = torch.tensor([[rule(jj - ii) for jj in range(tk)] for ii in range(tq)],
                               dtype=torch.long).reshape(tq, tk)
            bias = params[index].to(dtype)[:, ids][None]  # [1, Hq, Tq, Tk]
            factors[index] = torch.ones(1, 1, tq, tk, dtype=torch.float64)
        else:
            continue
        s = s + bias
        size = size + bias.detach().abs().double()
    for index, mod in mods:  # then the score functions, in & order
        if mod[0] == "function":
            w = params.get(index)
            fn = make_function(mod[1], None if w is None else w.to(dtype))
            s = fn(s, b_idx, h_idx, i[None, None], j[None, None]).to(dtype).expand(bf, hq, tq, tk)
            if mod[1] == "distance":
                factors[index] = 0.1 * (i - j).abs().double()[None, None]
            elif mod[1] == "head":
                factors[index] = s.detach().abs().double()
            elif mod[1] == "key":
                factors[index] = torch.ones(1, 1, tq, tk, dtype=torch.float64)
    size = torch.where(allowed, size + s.detach().abs().double(), 0.0)
    sink = None
    for index, mod in mods:
        if mod[0] == "sinks":
            sink = params[index].to(dtype)[None, :, None]  # [1, Hq, 1]
            factors[index] = torch.ones(1, 1, tq, max(tk, 1), dtype=torch.float64)
    zero = torch.zeros((), dtype=dtype)
    top = torch.where(allowed, s, -INF).amax(-1) if tk else torch.full((bf, hq, tq), -INF, dtype=dtype)
    if sink is not None:
        top = torch.maximum(top, sink)
    top = torch.where(torch.isinf(top), zero, top).detach()  # [Bf, Hq, Tq]
    e = torch.where(allowed, torch.exp(torch.where(allowed, s, zero) - top[..., None]), zero)
    total = e.sum(-1)
    if sink is not None:
        total = total + torch.exp(sink - top)
    nothing = total == 0  # no allowed key and no sink
    safe = torch.where(nothing, torch.ones((), dtype=dtype), total)
    p = e / safe[..., None]
    out = p @ vq
    lse = torch.where(nothing, torch.tensor(-INF, dtype=dtype), top + torch.log(safe))
    return OracleOut(out, lse, p, size, sink, factors)


# ---- building, running, comparing ----------------------------------------------------------------

class Built(NamedTuple):
    case: ModCase
    qkv: dict  # "q"/"k"/"v" -> tensor in the caller's layout (a leaf)
    params: dict  # mod index -> tensor (a leaf)
    allowed: torch.Tensor  # [Bf, Hq, Tq, Tk]
    grad_out: dict  # "out"/"lse"/"weights" -> upstream gradient in the caller's layout


def build(case: ModCase) -> Built:
    gen = torch.Generator().manual_seed(case.seed)
    dtype = case.torch_dtype
    qkv = {}
    for name in "qkv":
        values = torch.randn(case.shape(name), generator=gen, dtype=torch.float64).to(dtype)
        qkv[name] = values.requires_grad_(name in case.grad)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    grad_out = {"out": torch.randn(case.shape("out"), generator=gen, dtype=torch.float64).to(dtype),
                "lse": torch.randn(case.shape("lse"), generator=gen, dtype=torch.float64).to(lse_dtype),
                "weights": torch.randn(case.shape("weights"), generator=gen,
                                       dtype=torch.float64).to(dtype)}
    return Built(case, qkv, modifier_params(case), allowed_matrix(case.mask, case), grad_out)


def _takes_grad(built: Built) -> bool:
    return bool(built.case.grad) or any(p.requires_grad for p in built.params.values())


def _leaves(built: Built, qkv: dict, params: dict) -> list:
    """``(name, leaf)`` of what requires grad: ``dq``…, ``d<kind>@<mod index>``."""
    leaves = [(f"d{n}", qkv[n]) for n in "qkv" if qkv[n].requires_grad]
    leaves += [(f"d{built.case.mods[i][0]}@{i}", p) for i, p in sorted(params.items()) if p.requires_grad]
    return leaves


def _backward(built: Built, results: dict, leaves: list) -> dict:
    outs, grads_out = [], []
    for name, value in results.items():
        if value is None or value.numel() == 0 or not value.requires_grad:
            continue
        outs.append(value)
        grads_out.append(built.grad_out[name].to(value.dtype))
    if not outs or not leaves:
        return {name: None for name, _ in leaves}
    got = torch.autograd.grad(outs, [leaf for _, leaf in leaves], grads_out, allow_unused=True)
    return {name: g for (name, _), g in zip(leaves, got)}


class Outputs(NamedTuple):
    results: dict  # "out"/"lse"/"weights" in the caller's layout
    grads: dict  # leaf name -> gradient or None


def run_oracle(built: Built, dtype: torch.dtype, wrong: str = "") -> tuple[Outputs, OracleOut]:
    """The oracle on copies cast to ``dtype`` (float64: the truth; the input dtype: plain math)."""
    case = built.case
    qkv = {n: t.detach().to(dtype).requires_grad_(t.requires_grad) for n, t in built.qkv.items()}
    params = {i: p.detach().to(dtype).requires_grad_(p.requires_grad) for i, p in built.params.items()}
    with torch.enable_grad():
        q, k, v = (case.to4d(qkv[n], case.hq if n == "q" else case.hkv) for n in "qkv")
        scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.dk)
        full = oracle(case, q, k, v, built.allowed, params, scale, wrong)
        results = {"out": case.to_caller(full.out), "lse": case.to_caller(full.lse),
                   "weights": case.to_caller(full.weights)}
        results = {name: results[name] for name in _wants(case)}
        grads = _backward(built, results, _leaves(built, qkv, params)) if _takes_grad(built) else {}
    return Outputs(results, grads), full


def run_backend(built: Built, backend: str) -> Outputs:
    case = built.case
    mask = mask_argument(case, built.params)
    results = call_attention(case, built.qkv["q"], built.qkv["k"], built.qkv["v"], mask, backend,
                             _takes_grad(built))
    grads = _backward(built, results, _leaves(built, built.qkv, built.params)) if _takes_grad(built) else {}
    return Outputs(results, grads)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _top(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _floors(built: Built, full: OracleOut, acc: torch.dtype) -> tuple[dict, dict]:
    """``(output floors, gradient floors)`` from the rounding of the scores in the accumulation
    dtype (see test_fuzz's ``_grad_floors``: ``ds = p ∘ (dp − Δ)`` off by four ulps of
    ``p·(|dp| + |Δ| + |dlse| + |dw| + |Σ dw·p|)`` and the score's own rounding), carried into dq
    by |k|, dk by |q|, dv by |dout|, and into each modifier tensor by its derivative."""
    case = built.case
    score_size = _top(full.size)
    score_rel = 4 * _eps(acc) * score_size
    if full.sink is not None:
        score_rel += 4 * _eps(acc) * float(full.sink.detach().abs().max())
    v_top = float(built.qkv["v"].detach().double().abs().max()) if built.qkv["v"].numel() else 0.0
    out_top = float(full.out.detach().abs().max()) if full.out.numel() else 0.0
    floors = {"out": score_rel * (out_top + v_top), "lse": score_rel, "weights": score_rel}
    if not _takes_grad(built):
        return floors, {}
    ulps = 4 * _eps(acc) * (1.0 + score_size)
    with torch.no_grad():
        p = full.weights.detach().double()
        dout = case.to4d(built.grad_out["out"].double(), case.hq)
        q = case.to4d(built.qkv["q"].detach().double(), case.hq)
        kq = case.to4d(built.qkv["k"].detach().double(), case.hkv).repeat_interleave(case.group, 1)
        vq = case.to4d(built.qkv["v"].detach().double(), case.hkv).repeat_interleave(case.group, 1)
        out = full.out.detach().double()
        size = score_grad_size(case, built.grad_out, dout, vq, out, p)
        stored = _eps(case.torch_dtype) * (dout * out).square().sum(-1, keepdim=True).sqrt()
        term = torch.where(built.allowed, p * (ulps * size + stored), 0.0)  # [Bf, Hq, Tq, Tk]
        scale = abs(case.scale if case.scale is not None else 1.0 / math.sqrt(case.dk))
        dq = (term * scale) @ kq.abs()
        dk = ((term * scale).transpose(-1, -2) @ q.abs()).reshape(
            case.bf, case.hkv, case.group, case.tk, case.dk).sum(2)
        dv = ulps * (p.transpose(-1, -2) @ dout.abs()).reshape(
            case.bf, case.hkv, case.group, case.tk, case.dv).sum(2)
        grads = {"dq": _top(dq), "dk": _top(dk), "dv": _top(dv)}
        for index, factor in full.distances.items():
            mod = case.mods[index]
            if mod[0] == "sinks":
                # the sink's weight per row, p_sink = exp(sink − lse), rounded like a score's
                lse = full.lse.detach().double()
                p_sink = torch.exp(full.sink.detach().double() - lse)
                widest = size.amax(-1) if size.shape[-1] else torch.zeros(size.shape[:-1], dtype=size.dtype)
                rows = p_sink * ulps * widest
                grads[f"dsinks@{index}"] = float(rows.sum()) + _top(term.sum((0, 2, 3)))
            else:
                grads[f"d{mod[0]}@{index}"] = float((term * factor).sum())
    return floors, grads


def backends_for(case: ModCase) -> tuple:
    """All four, and triton (the interpreter: slow) on a subset of small cases when usable."""
    small = case.bf * case.hq * case.tq * case.tk <= 4096 and case.tk <= 80
    if small and case.seed % 4 == 0 and triton_usable():
        return BACKENDS + ("triton",)
    return BACKENDS


def _check_dtypes(backend: str, case: ModCase, results: dict) -> list:
    dtype = case.torch_dtype
    want = {"out": dtype, "lse": torch.float64 if dtype == torch.float64 else torch.float32,
            "weights": dtype}
    return [Problem(backend, name, "dtype", f"{value.dtype}, contract says {want[name]}")
            for name, value in results.items() if value is not None and value.dtype != want[name]]


def run_case(case: ModCase, backends: Optional[tuple] = None, wrong: str = "") -> Result:
    """Every backend of ``case`` against the oracle: the problems found, and call counts.
    ``wrong``: a misreading of the definition for the oracle (see :func:`oracle`)."""
    built = build(case)
    dtype = case.torch_dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    truth, full = run_oracle(built, torch.float64, wrong)
    plain_cache: dict = {}

    def yardstick(name):
        def attempts():
            for dt in ((dtype, torch.float32) if dtype != torch.float64 else (dtype,)):
                if dt not in plain_cache:
                    plain_cache[dt] = run_oracle(built, dt, wrong)[0]
                got = plain_cache[dt]
                value = got.grads.get(name) if name.startswith("d") else got.results.get(name)
                if value is not None:
                    yield value
        return attempts

    floors, grad_floors = _floors(built, full, acc)
    empty = case.to_caller(~built.allowed.any(-1))  # caller's [..., Tq]
    current = {**built.qkv, **{f"mod{i}": p for i, p in built.params.items()}}
    snapshot = {n: t.detach().clone() for n, t in current.items()}
    problems, calls, refusals = [], collections.Counter(), collections.Counter()
    for backend in backends or backends_for(case):
        calls[backend] += 1
        got = try_backend(backend, lambda: run_backend(built, backend), problems, refusals)
        if got is None:
            continue
        problems += written_to(backend, snapshot, current)
        problems += _check_dtypes(backend, case, got.results)
        for name in _wants(case):
            shape = case.shape(name)
            rows = empty if name == "lse" else empty[..., None].expand(shape)
            if name == "lse" and full.sink is not None:
                rows = None  # a row without keys has lse sink_h: compared as a value
            problems += compare(backend, name, got.results[name], truth.results[name],
                                yardstick(name), dtype, floors[name], empty_rows=rows)
        for name, want in truth.grads.items():
            base = name.split("@")[0]
            leaf = built.qkv[name[1]] if "@" not in name else built.params[int(name.split("@")[1])]
            if want is None:
                want = torch.zeros(leaf.shape, dtype=torch.float64)
            have = got.grads.get(name)
            if have is None:
                have = torch.zeros_like(want)
            coarser = max(dtype, leaf.dtype, key=_eps)
            problems += compare(backend, base, have, want, yardstick(name), coarser,
                                grad_floors.get(name, 0.0))
    return Result(problems, calls, refusals)


# ---- strategies -----------------------------------------------------------------------------------

T_EDGES = (0, 0, 1, 1, 2, 3, 7, 16, 17, 31, 33, 64, 65, 70)
COST_LIMIT = 600_000
"""Bound on Bf·Hq·Tq·Tk·(Dk + Dv), the size of the oracle's work."""

FAMILIES = {"core": ("float64", "float32"), "low": ("float16", "bfloat16"),
            "all": ("float64", "float64", "float32", "float32", "float16", "bfloat16")}


@st.composite
def padding_spec(draw, bf: int, tq: int, tk: int) -> tuple:
    """``(q_lengths, kv_lengths, q_starts, kv_starts)``: valid runs, one value or one per element."""
    which = draw(st.sampled_from(("q", "kv", "both", "both")))
    count = bf if bf > 1 and draw(st.booleans()) else 1
    ql = tuple(draw(st.integers(0, tq)) for _ in range(count)) if which != "kv" else None
    kl = tuple(draw(st.integers(0, tk)) for _ in range(count)) if which != "q" else None

    def starts(lengths, t):
        if not draw(st.booleans()):
            return None
        if lengths is None:  # starts alone: the run goes to the end of the sequence
            return tuple(draw(st.integers(0, t)) for _ in range(count))
        return tuple(draw(st.integers(0, t - n)) for n in lengths)
    return (ql, kl, starts(ql, tq), starts(kl, tk))


@st.composite
def mask_leaf(draw, dims: dict) -> tuple:
    bf, tq, tk = dims["bf"], dims["tq"], dims["tk"]
    kind = draw(st.sampled_from(("causal", "window", "padding", "sequences", "sequences",
                                 "documents", "causal_documents", "causal_documents")))
    align = st.sampled_from(("top_left", "bottom_right"))
    reach = st.integers(0, 5) | st.integers(0, 80)
    if kind == "causal":
        return ("causal", draw(align))
    if kind == "window":
        return ("window", draw(reach), draw(reach), draw(align))
    if kind == "padding":
        return ("padding", *draw(padding_spec(bf, tq, tk)))
    if kind == "sequences":
        band = draw(st.sampled_from(("causal", "window")))
        left, right = (None, 0) if band == "causal" else (draw(reach), draw(reach))
        return ("sequences", band, left, right, draw(align), *draw(padding_spec(bf, tq, tk)))
    shared = tq == tk and draw(st.booleans())
    n_docs, per_batch, seed = draw(st.integers(1, 4)), draw(st.booleans()), draw(st.integers(0, 2**20))
    if kind == "documents":
        return ("documents", n_docs, draw(st.booleans()), per_batch, shared, seed)
    return ("causal_documents", n_docs, per_batch, shared, seed, draw(align))


@st.composite
def mask_specs(draw, dims: dict):
    choice = draw(st.integers(0, 6))
    if choice == 0:
        return None
    if choice == 6:
        return ("and", draw(mask_leaf(dims)), draw(mask_leaf(dims)))
    return draw(mask_leaf(dims))


@st.composite
def modifier_spec(draw, kind: str, dims: dict) -> tuple:
    seed = draw(st.integers(0, 2**20))
    learn = draw(st.booleans())
    pdtype = draw(st.sampled_from(("float32", "float32", "float64", "same")))
    if kind == "softcap":
        if draw(st.integers(0, 40)) == 40:  # near the ends of float32's normal range
            return ("softcap", draw(st.sampled_from((2e-38, 1e-30, 1e30))))
        return ("softcap", draw(st.sampled_from((1e-3, 0.5, 2.0, 5.0, 30.0))))
    if kind == "alibi":
        return ("alibi", dims["bf"] > 1 and draw(st.booleans()),
                draw(st.sampled_from(("top_left", "bottom_right"))),
                draw(st.sampled_from((0.05, 0.5, 2.0))), draw(st.booleans()), learn, pdtype, seed)
    if kind == "relative":
        buckets = draw(st.sampled_from(("t5", "t5", "t5_partial", "clamp", "modulo")))
        bidirectional = draw(st.booleans())
        if buckets in ("t5", "t5_partial"):
            nb = draw(st.sampled_from((4, 8, 32)))
            if buckets == "t5_partial" and not bidirectional:
                nb = draw(st.sampled_from((2, 8, 32)))
            exact = (nb // 2 if bidirectional else nb) // 2
            max_distance = draw(st.sampled_from((exact + 1, 16, 128)))
            max_distance = max(max_distance, exact + 1)
        else:
            nb = draw(st.sampled_from((1, 3, 7, 11))) if buckets == "clamp" else draw(st.integers(1, 9))
            max_distance = 128
        return ("relative", buckets, nb, bidirectional, max_distance,
                draw(st.sampled_from((0.5, 3.0, 30.0))), learn, pdtype, seed)
    if kind == "sinks":
        return ("sinks", draw(st.sampled_from((0.0, -5.0, 5.0, 30.0))), learn, pdtype, seed)
    fkind = draw(st.sampled_from(("tanh", "where", "batch", "distance", "distance", "head",
                                  "replace", "key")))
    return ("function", fkind, learn, draw(st.booleans()), pdtype, seed)


@st.composite
def cases(draw, family: str = "all") -> ModCase:
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(FAMILIES[family]))
    rank = draw(st.sampled_from((2, 3, 4, 4, 4, 5)))
    if rank == 2:
        batch = ()
    elif rank in (3, 4):
        batch = (draw(st.integers(1, 3)),)
    else:
        batch = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    hkv = draw(st.integers(1, 3)) if rank >= 4 else 1
    group = draw(st.sampled_from((1, 1, 2, 4))) if rank >= 4 else 1
    lengths = st.sampled_from(T_EDGES) | st.integers(1, 70)
    if draw(st.integers(0, 11)) == 11:  # past the tiled backend's 128-key blocks
        tq, tk = draw(st.sampled_from((0, 1, 3) + (20, 150))), draw(st.integers(129, 260))
    else:
        tq, tk = draw(lengths), draw(lengths)
    dk = draw(st.integers(1, 20))
    dv = dk if draw(st.booleans()) else draw(st.integers(1, 20))
    while math.prod(batch) * hkv * group * tq * tk * (dk + dv) > COST_LIMIT:
        if max(dk, dv) > 6:
            dk, dv = min(dk, 6), min(dv, 6)
        elif group > 1:
            group = 1
        elif hkv > 1:
            hkv = 1
        elif any(b > 1 for b in batch):
            batch = tuple(1 for _ in batch)
        else:
            break
    dims = {"bf": math.prod(batch), "tq": tq, "tk": tk}
    mask = draw(mask_specs(dims))
    n_mods = draw(st.sampled_from((1, 1, 2, 2, 3)))
    kinds = draw(st.lists(st.sampled_from(("softcap", "alibi", "relative", "sinks", "function")),
                          min_size=n_mods, max_size=n_mods))
    seen, mods = set(), []
    for kind in kinds:  # one softcap and one sink at most (two are an error)
        if kind in ("softcap", "sinks") and kind in seen:
            continue
        seen.add(kind)
        mods.append(draw(modifier_spec(kind, dims)))
    scale = draw(st.sampled_from((None, None, 0.3, 1.0, 2.5, -0.7)))
    grad = ()
    if draw(st.booleans()):
        grad = tuple(n for n in "qkv" if draw(st.booleans())) or ("q", "k", "v")
    if not draw(st.booleans()):  # half the cases take no gradient at all
        grad = ()
        mods = [_fixed(m) for m in mods]
    return ModCase(seed=seed, rank=rank, batch=batch, hkv=hkv, group=group, tq=tq, tk=tk, dk=dk,
                   dv=dv, dtype=dtype, mask=mask, scale=scale,
                   return_lse=draw(st.booleans()),
                   return_weights=draw(st.sampled_from((False, False, True))), grad=grad,
                   mods=tuple(mods), mask_at=draw(st.integers(0, 3)))


def _fixed(mod: tuple) -> tuple:
    """``mod`` with its tensor not learnable."""
    at = {"alibi": 5, "relative": 6, "sinks": 2, "function": 2}.get(mod[0])
    return mod if at is None else mod[:at] + (False,) + mod[at + 1:]


# ---- bookkeeping, shrinking -----------------------------------------------------------------------

class ModStats(Stats):
    """:class:`test_fuzz.Stats` with per-backend counts of calls with a disagreement and calls
    that raised."""

    def __init__(self, name: str):
        super().__init__(name)
        self.disagreeing_calls = collections.Counter()
        self.exceptions = collections.Counter()

    def add(self, result: Result) -> None:
        super().add(result)
        raised = {p.backend for p in result.problems if p.quantity == "call"}
        self.exceptions.update(raised)
        self.disagreeing_calls.update({p.backend for p in result.problems if p.quantity != "call"})

    def summary(self) -> str:
        lines = [super().summary(), "  per backend: calls, refusals, calls with disagreements, "
                                    "calls with unexpected exceptions"]
        for backend in sorted(self.calls):
            lines.append(f"  {backend:9s} {self.calls[backend]:6d} {self.refusals[backend]:6d} "
                         f"{self.disagreeing_calls[backend]:6d} {self.exceptions[backend]:6d}")
        return "\n".join(lines)


def _simplifications(case: ModCase):
    for index in range(len(case.mods)):
        yield replace(case, mods=case.mods[:index] + case.mods[index + 1:])
    yield replace(case, mods=tuple(_fixed(m) for m in case.mods))
    yield replace(case, mask=None)
    if case.mask is not None and case.mask[0] == "and":
        yield replace(case, mask=case.mask[1])
        yield replace(case, mask=case.mask[2])
    yield replace(case, return_lse=False)
    yield replace(case, return_weights=False)
    yield replace(case, grad=())
    yield replace(case, scale=None)
    yield replace(case, mask_at=0)
    if case.dtype != "float64":
        yield replace(case, dtype="float64")
    if case.dtype in ("float16", "bfloat16"):
        yield replace(case, dtype="float32")
    if case.rank >= 4 and case.group > 1:
        yield replace(case, group=1)
    if case.rank >= 4 and case.hkv > 1:
        yield replace(case, hkv=1)
    if case.dv != case.dk:
        yield replace(case, dv=case.dk)
    for name in ("dk", "dv"):
        if getattr(case, name) > 2:
            yield replace(case, **{name: 2})
    resizable = not any(leaf[0] in ("padding", "sequences", "documents", "causal_documents")
                        for leaf in _mask_leaves(case.mask)) and not any(
        m[0] == "function" and m[1] == "key" for m in case.mods)
    if resizable:
        for name in ("tq", "tk"):
            value = getattr(case, name)
            for smaller in (0, 1, 2, 5, value // 2):
                if smaller < value:
                    yield replace(case, **{name: smaller})


def _mask_leaves(spec):
    if spec is None:
        return []
    if spec[0] == "and":
        return _mask_leaves(spec[1]) + _mask_leaves(spec[2])
    return [spec]


def minimise(case: ModCase, key: tuple, budget: int = 150) -> ModCase:
    """Greedily apply :func:`_simplifications` while the problem ``key`` persists."""
    tried, changed = 0, True
    while changed and tried < budget:
        changed = False
        for simpler in _simplifications(case):
            if simpler == case:
                continue
            tried += 1
            try:
                result = run_case(simpler, backends=(key[0],))
            except Exception:  # noqa: BLE001 — the harness cannot build this simplification
                continue
            if any(p.key == key for p in result.problems):
                case, changed = simpler, True
                break
            if tried >= budget:
                break
    return case


# ---- the tests ------------------------------------------------------------------------------------

@pytest.fixture
def interpreter(monkeypatch):
    """Opt in to the triton interpreter for CPU tensors in this test (as test_triton.py does)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


DEFAULT_EXAMPLES = {"core": 1200, "low": 700}


@pytest.mark.parametrize("family", sorted(DEFAULT_EXAMPLES))
def test_fuzz_modifiers(family, interpreter):
    """Bounded differential fuzz of modifiers × masks × backends against the oracle; a
    disagreement or exception fails with a shrunk reproducer."""
    stats = ModStats(f"modifiers-{family}")

    @settings(max_examples=DEFAULT_EXAMPLES[family], **FUZZ_SETTINGS)
    @given(case=cases(family))
    def fuzz(case):
        result = run_case(case)
        stats.add(result)
        if result.problems:
            first = result.problems[0]
            raise test_fuzz._failure(first)("\n".join(map(str, result.problems)) + f"\n{case!r}")

    try:
        fuzz()
    finally:
        stats.record()


@pytest.mark.slow
def test_fuzz_modifiers_survey(interpreter):
    """Many examples; every disagreement and exception is recorded, each kind minimised and
    printed with its count and a minimal case, and the per-backend counts, before failing."""
    run_survey(ModStats("modifiers-survey"), cases("all"), run_case, minimise,
               lambda case: (case.bf * case.hq * (case.tq + 1) * (case.tk + 1) * (case.dk + case.dv)
                             * (1 + len(case.mods))))


# ---- the fuzz can fail ----------------------------------------------------------------------------

FIXED = [
    ModCase(seed=1, rank=4, batch=(2,), hkv=2, group=2, tq=9, tk=13, dk=8, dv=8, dtype="float64",
            mask=("causal", "top_left"), return_lse=True, grad=("q", "k", "v"),
            mods=(("alibi", True, "bottom_right", 0.5, True, True, "float64", 3),
                  ("sinks", 0.0, True, "float64", 4))),
    ModCase(seed=2, rank=3, batch=(2,), hkv=1, group=1, tq=17, tk=11, dk=5, dv=3, dtype="float64",
            mask=("sequences", "causal", None, 0, "bottom_right", (9, 17), (11, 6), None, (0, 4)),
            return_lse=True, grad=("q",),
            mods=(("relative", "t5", 8, True, 128, 3.0, True, "float64", 5), ("softcap", 2.0))),
    ModCase(seed=3, rank=2, batch=(), hkv=1, group=1, tq=6, tk=11, dk=4, dv=4, dtype="float64",
            mask=("causal_documents", 3, False, False, 7, "top_left"), return_weights=True,
            mods=(("function", "distance", True, False, "float64", 6),)),
]


MISREADINGS = ("alibi alignment swapped", "softcap left out", "sinks left out",
               "function left out")


@pytest.mark.parametrize("misread", MISREADINGS)
def test_fuzz_modifiers_detects_a_wrong_oracle(misread):
    """The oracle agrees with the reference backend on the fixed cases; an oracle that misreads
    the definition (a modifier left out, ALiBi's alignment swapped) disagrees on one of them."""
    for case in FIXED:
        assert not run_case(case, backends=("reference",)).problems, case
    found = [run_case(case, backends=("reference",), wrong=misread).problems for case in FIXED]
    assert any(p.kind == "mismatch" and p.quantity == "out" for problems in found for p in problems), found
