"""``attention`` under ``torch.compile``: a structured mask runs as one opaque operator.

Masks are Python objects whose block maps, lengths and ranges are read from tensor values
(``int(t.max())``, block lists built on the host): what a backend does is data-dependent, so
tracing into it breaks the graph. Inside a compiled region :func:`attention` therefore lowers
the mask to a *spec* (a string naming its classes, fields and constant parameters such as
alignments) plus its tensors and its numbers (window sizes, caps: a float64 tensor, so a
function compiled once takes masks with other numbers as data; dynamo itself recompiles for
a changed Python number: once for an int, which it then makes symbolic, and for every new
float, which it specialises), and calls the custom operator ``attnkit::attention``, which
rebuilds the mask and runs the eager :func:`attnkit.attention` on real tensors; ``attnkit::attention_backward`` gives the
gradients from the saved output and LSE through a backend's own backward (``tiled`` or
``triton``: no recomputed forward, O(T) memory), score modifiers (softcap, ALiBi, T5 relative
biases) included, with the gradients of their slopes and tables. Sinks stay outside the
operator: it returns the result without them, and :meth:`~attnkit.modifiers.Sinks.join`
runs in the graph, so autograd differentiates it.
Fake-tensor implementations give the output shapes, so the graph around the call compiles in
one piece, forward and backward.

No mask and top-left causal are traced directly when they run on a backend made of torch
operations alone (torch's fused kernel, the reference's math: :func:`traced`); on tiled or
triton, which plan on the host, they run as the operator too.
"""

from __future__ import annotations

import ast
import functools
import math
import importlib.util
import operator
import sys
from typing import Optional, Sequence

import torch

from .masks import CAUSAL, MASK_TYPES, Mask, MaskSpace, dense, mask_fields, unkeyed
from .modifiers import Sinks, Softcap, calls_python

TRACED_BACKENDS = ("torch", "reference")
"""Backends whose forward is torch operations alone, which a compiled graph traces as they run
eagerly; the others (tiled, triton) plan on the host from the mask's values and caches."""

_NUMBERS = (int, float, torch.SymInt, torch.SymFloat)


def _encode(value, tensors: list, numbers: list, space: MaskSpace, lead: tuple):
    """One mask attribute as a literal: tensors become their index in ``tensors``, numbers
    (ints and floats, symbolic ones included) their index in ``numbers`` with their type; a
    ``from_function`` mask (a Python callable, which a string cannot name) becomes the dense
    mask it evaluates to over ``space``, computed in the graph (shaped for a q with leading
    dims ``lead``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("T", len(tensors) - 1)
    if isinstance(value, _NUMBERS) and not isinstance(value, bool):
        numbers.append(value)
        return ("N", len(numbers) - 1, isinstance(value, (int, torch.SymInt)))
    if isinstance(value, Mask) and value.runs_code:
        allowed = value.tile(torch.arange(space.q_len, device=space.device),
                             torch.arange(space.kv_len, device=space.device), space)
        value = dense(_in_rank(allowed, lead))
    if isinstance(value, Mask):
        fields = mask_fields(value)
        return ("M", type(value).__name__, tuple(
            (name, _encode(fields[name], tensors, numbers, space, lead))
            for name in sorted(fields)))
    if isinstance(value, tuple):
        return ("S", tuple(_encode(item, tensors, numbers, space, lead) for item in value))
    return ("C", value)


def _in_rank(allowed: torch.Tensor, lead: tuple) -> torch.Tensor:
    """A mask function's ``[B|1, H|1, Tq, Tk]`` values (the batch dims flattened) shaped for
    the caller's q with leading dims ``lead`` (``q.shape[:-2]``), as a ``dense`` mask of that
    call takes them: ``[Tq, Tk]``, ``[B|1, Tq, Tk]``, or the batch dims unflattened."""
    if len(lead) == 2:
        return allowed
    if len(lead) < 2:  # one head: its dim goes, and the batch's with a 2-D q
        allowed = allowed[:, 0]
        return allowed[0] if not lead else allowed
    batch = lead[:-1] if allowed.shape[0] != 1 else (1,) * (len(lead) - 1)
    return allowed.reshape(*batch, *allowed.shape[1:])


def flatten(mask: Optional[Mask], space: MaskSpace,
            lead: tuple = ()) -> tuple[str, list[torch.Tensor], list]:
    """``mask`` as ``(spec, tensors, numbers)``: the spec names every class, field and constant
    parameter (a string, constant for a compiled graph), the tensors are its lengths, ids,
    biases..., the numbers its window sizes, caps... (Python or symbolic ints and floats);
    :func:`unflatten` rebuilds an equal mask from them. ``space``: the call's extent, and
    ``lead``: the leading dims of its q (``q.shape[:-2]``), for ``from_function`` masks,
    evaluated into a dense mask of that call."""
    tensors: list[torch.Tensor] = []
    numbers: list = []
    return repr(_encode(mask, tensors, numbers, space, lead)), tensors, numbers


@functools.lru_cache(maxsize=256)
def _parse(spec: str):
    return ast.literal_eval(spec)


def unflatten(spec: str, tensors: Sequence[torch.Tensor], numbers: Sequence[float] = ()
              ) -> Optional[Mask]:
    """The mask :func:`flatten` described, holding ``tensors`` and ``numbers`` (ints where the
    mask had ints)."""

    def build(node):
        kind = node[0]
        if kind == "T":
            return tensors[node[1]]
        if kind == "N":
            value = numbers[node[1]]
            return int(value) if node[2] else float(value)
        if kind == "M":
            mask = object.__new__(MASK_TYPES[node[1]])
            mask.__dict__.update((name, build(value)) for name, value in node[2])
            return mask
        if kind == "S":
            return tuple(build(item) for item in node[1])
        return node[1]

    return build(_parse(spec))


def _checked(mask: Optional[Mask]) -> Optional[Mask]:
    """``mask`` (rebuilt by :func:`unflatten`) after the checks its numbers skip while traced:
    a softcap's cap, symbolic or taken as given there (:class:`~attnkit.modifiers.Softcap`),
    is concrete inside the operator and raises what it raises eagerly."""
    for leaf in () if mask is None else mask.leaves():
        if isinstance(leaf, Softcap):
            Softcap(leaf.cap)
    return mask


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _engine(q, k, v, mask: Mask, scale: Optional[float], backend: str, need_weights: bool,
            invariant: bool, tensors: Sequence[torch.Tensor], wanted: Sequence[bool]):
    """``(inputs, backend)`` for a call whose gradients come from ``Backend.backward``; the
    forward and the backward operator make the same choice from the same arguments.
    ``wanted``: whether each of ``tensors`` (the mask's, as :func:`flatten` gave them) gets a
    gradient. Inside the operator no tensor requires grad, so validation cannot see a bias that
    trains: ``wanted`` marks it, and the backend must give its gradient, as eagerly (``auto``
    passes over one that does not; an explicit one raises)."""
    from .dispatch import select_with_backward
    from .inputs import validate

    inputs = validate(q, k, v, mask, scale=scale, need_lse=True, need_weights=need_weights,
                      invariant=invariant)
    trained = {id(t) for t, want in zip(tensors, wanted) if want}
    inputs.bias_grad = mask is not None and any(id(t) in trained for t in mask.biases())
    chosen = select_with_backward(inputs, backend)
    if chosen is None:
        raise ValueError(f"attnkit under torch.compile: backend={backend!r} has no separate "
                         f"backward for these inputs (q {tuple(q.shape)}, mask {mask!r}); the "
                         f"gradients of a compiled call come from tiled or triton: use "
                         f"backend='auto' or backend='tiled'")
    return inputs, chosen


@torch.library.custom_op("attnkit::attention", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                numbers: torch.Tensor, spec: str, scale: Optional[float], backend: str,
                need_weights: bool, need_lse: bool, grads: list[bool], invariant: bool,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grads``: whether each of q, k, v and ``tensors`` gets a gradient (never empty: a list
    of bools is one leaf for the autograd registration, as a number is)."""
    from .call import run as eager

    register_flop_formulas()  # an exported program run in a new process
    mask = _checked(unflatten(spec, tensors, numbers.tolist()))
    with unkeyed():  # (inductor may hand over a reused buffer with new values)
        if any(grads):
            backend = _engine(q, k, v, mask, scale, backend, need_weights, invariant, tensors,
                              grads[3:])[1].NAME
        result = eager(q, k, v, mask, scale=scale, dropout_p=0.0, generator=None,
                       backend=backend, return_lse=True, return_weights=need_weights,
                       invariant=invariant)
    weights = result.weights if need_weights else q.new_empty(0)
    return result.out.contiguous(), result.lse.contiguous(), weights.contiguous()


@_forward_op.register_fake
def _(q, k, v, tensors, numbers, spec, scale, backend, need_weights, need_lse, grads,
      invariant):
    register_flop_formulas()  # traced (compile, export)
    rows = q.shape[:-1]
    weights = q.new_empty((*rows, k.shape[-2])) if need_weights else q.new_empty(0)
    return (q.new_empty((*rows, v.shape[-1])), q.new_empty(rows, dtype=_lse_dtype(q)), weights)


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, dlse: Optional[torch.Tensor],
                 dweights: Optional[torch.Tensor], q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 tensors: list[torch.Tensor], wanted: list[bool], numbers: torch.Tensor,
                 spec: str, scale: Optional[float], backend: str, need_weights: bool,
                 invariant: bool) -> list[torch.Tensor]:
    if dweights is not None and bool(dweights.any()):
        raise RuntimeError("attnkit under torch.compile: the attention weights returned by "
                           "return_weights=True are not differentiable there; differentiate "
                           "out/lse, or run eagerly")
    from .dispatch import is_empty
    from .finite import applies, guard

    with unkeyed():  # (inductor may hand over a reused buffer with new values)
        mask = unflatten(spec, tensors, numbers.tolist())
        inputs, chosen = _engine(q, k, v, mask, scale, backend, need_weights, invariant,
                                 tensors, wanted)
        if is_empty(inputs):  # nothing was computed (dispatch.run): every gradient is 0
            return [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                    *(torch.zeros_like(t) if want else t.new_empty(0)
                      for t, want in zip(tensors, wanted))]
        # the q, K and V the forward ran on (dispatch.run)
        zeroing = functools.partial(guard, poisons=applies(inputs, chosen),
                                    zero_kv=chosen.reads_padding(inputs),
                                    whole_mask=chosen.evaluates_mask(inputs))
        caller, inputs = inputs, zeroing(inputs).inputs
        rows = inputs.q.shape[:3]
        wanted_by_id = {id(t): want for t, want in zip(tensors, wanted)}
        biases = [] if mask is None else mask.biases()  # the caller's tensors, in the order of
        # inputs.biases (fitted copies); the modifiers' are the caller's own
        params = inputs.modifiers.tensors if inputs.modifiers is not None else ()
        dq, dk, dv, dbias, dparams = chosen.backward(
            inputs, out.reshape(*rows, -1), lse.reshape(rows), dout.reshape(*rows, -1),
            None if dlse is None else dlse.reshape(rows), [wanted_by_id[id(t)] for t in biases],
            [wanted_by_id.get(id(t), False) for t in params])
        dq, dk, dv = _through_zeroing(zeroing, caller, inputs, (dq, dk, dv))
        by_id = {id(t): d for t, d in zip([*biases, *params], [*dbias, *dparams])}
        extra, given = [], set()
        for t, want in zip(tensors, wanted):
            if want and id(t) in by_id and by_id[id(t)] is None:
                # validated inside the operator, the tensor did not require grad there
                raise RuntimeError(
                    f"attnkit under torch.compile: backend {chosen.NAME!r} gives no gradient "
                    f"for the mask's tensor of shape {tuple(t.shape)}, which requires grad; "
                    f"use backend='tiled' for a compiled call that trains a bias")
            if want and by_id.get(id(t)) is not None:
                grad = _like(by_id[id(t)], t)
                # a tensor the mask holds twice (its gradient sums both uses): one output per
                # occurrence, never aliased (a custom operator's outputs may not alias)
                extra.append(grad.clone() if id(t) in given else grad)
                given.add(id(t))
            else:
                extra.append(torch.zeros_like(t) if want else t.new_empty(0))
        return [_like(dq, q), _like(dk, k), _like(dv, v), *extra]


def _through_zeroing(zeroing, caller, ran, grads: Sequence[torch.Tensor]) -> list:
    """``grads``, the gradients of the q, K, V ``[B, H, T, D]`` a backend ran on (``ran``:
    what ``zeroing``, :func:`~attnkit.finite.guard`, made of ``caller``'s), as gradients of
    ``caller``'s: 0 where the guard zeroed (K/V outside the real keys, queries with no allowed
    key), whatever the backend computed there (NaN from a non-finite value it read), as
    autograd gives through the zeroing eagerly. Where the guard zeroes depends on the mask
    and the shapes alone, so the guard run over the gradients (in the inputs' dtypes) zeroes
    them there."""
    names = ("q", "k", "v")
    if all(getattr(ran, name) is getattr(caller, name) for name in names):
        return list(grads)
    fitted = {name: grad.to(getattr(caller, name).dtype) for name, grad in zip(names, grads)}
    zeroed = zeroing(caller.replaced(**fitted)).inputs
    return [getattr(zeroed, name) for name in names]


def _like(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``x``'s shape, dtype and strides (``torch.empty_like``), as the fake states;
    copied only when its layout differs."""
    grad = grad.reshape(x.shape)
    if grad.dtype == x.dtype and grad.stride() == torch.empty_like(x, device="meta").stride():
        return grad
    return torch.empty_like(x).copy_(grad)


@_backward_op.register_fake
def _(dout, dlse, dweights, q, k, v, out, lse, tensors, wanted, numbers, spec, scale, backend,
      need_weights, invariant):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            *(torch.empty_like(t) if want else t.new_empty(0) for t, want in zip(tensors, wanted))]


def _setup_context(ctx, inputs, output):
    (q, k, v, tensors, numbers, spec, scale, backend, need_weights, need_lse, grads,
     invariant) = inputs
    out, lse, weights = output
    # An LSE or weights the caller did not ask for get no gradient (None, not zeros: the tiled
    # backward then takes the fused kernel).
    ctx.set_materialize_grads(False)
    if not need_lse:
        ctx.mark_non_differentiable(lse)
    if not need_weights:
        ctx.mark_non_differentiable(weights)
    ctx.save_for_backward(q, k, v, out, lse, numbers, *tensors)
    # traced flags, or what trains when the graph runs (a program exported without gradients)
    ctx.wanted = [want or (t.requires_grad and t.is_floating_point())
                  for want, t in zip(grads[3:], tensors)]
    ctx.options = (spec, scale, backend, need_weights, invariant)


def _backward(ctx, dout, dlse, dweights):
    q, k, v, out, lse, numbers, *tensors = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, *extra = _backward_op(dout, dlse, dweights, q, k, v, out, lse, tensors,
                                      ctx.wanted, numbers, *ctx.options)
    dtensors = [d if want else None for d, want in zip(extra, ctx.wanted)]
    return dq, dk, dv, dtensors, None, None, None, None, None, None, None, None


torch.library.register_autograd("attnkit::attention", _backward, setup_context=_setup_context)


def _bhtd_shape(shape) -> tuple:
    """An input's shape as ``(B, H, T, D)``: leading dims merged into B, ``[B, T, D]`` one
    head, ``[T, D]`` one sequence."""
    if len(shape) >= 4:
        return (math.prod(shape[:-3]), *shape[-3:])
    return (shape[0], 1, *shape[1:]) if len(shape) == 3 else (1, 1, *shape)


def _forward_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """What ``FlopCounterMode`` counts for the operator: torch's SDPA formula (every score
    of the dense ``Tq × Tk``, as it counts a causal call; the tiles a mask skips are not
    subtracted)."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(*map(_bhtd_shape, (q_shape, k_shape, v_shape)))


def _backward_flops(dout_shape, dlse_shape, dweights_shape, q_shape, k_shape, v_shape, *args,
                    out_shape=None, **kwargs) -> int:
    """The backward operator's count, torch's SDPA backward formula (see :func:`_forward_flops`)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(*map(_bhtd_shape, (dout_shape, q_shape, k_shape, v_shape)))


_FLOPS_REGISTERED = False


def register_flop_formulas() -> None:
    """Give ``FlopCounterMode`` the operators' counts (:func:`_forward_flops`), once.
    ``torch.utils.flop_counter`` imports triton, which must not be imported with attnkit (its
    interpreter is chosen by ``TRITON_INTERPRET`` at triton's first import): this runs at
    import where that module or triton is loaded already or triton is not installed, else
    where the operator is first traced or run (a counter made before then, around the first
    run of an exported program loaded in a new process, counts it 0)."""
    global _FLOPS_REGISTERED
    if _FLOPS_REGISTERED:
        return
    from torch.utils.flop_counter import register_flop_formula
    register_flop_formula(torch.ops.attnkit.attention)(_forward_flops)
    register_flop_formula(torch.ops.attnkit.attention_backward)(_backward_flops)
    _FLOPS_REGISTERED = True


if "torch.utils.flop_counter" in sys.modules or "triton" in sys.modules or (
        importlib.util.find_spec("triton") is None):
    register_flop_formulas()  # nothing to keep unimported


def traced(q, k, v, mask: Optional[Mask], *, scale, dropout_p, backend, return_lse,
           return_weights, invariant: bool = False) -> bool:
    """Whether :func:`attnkit.attention` inside a compiled region traces its eager code (shapes
    as for it): no mask or top-left causal masking, on a backend in :data:`TRACED_BACKENDS`
    (``auto`` picks torch's fused kernel there). Every other call runs as the
    ``attnkit::attention`` operator (:func:`attention`)."""
    from .dispatch import select
    from .inputs import validate

    if invariant or (mask is not None and mask.band() != CAUSAL):
        return False
    inputs = validate(q, k, v, mask, scale=scale, dropout_p=dropout_p, need_weights=return_weights,
                      need_lse=return_lse)
    return select(inputs, backend).NAME in TRACED_BACKENDS


def attention(q, k, v, mask: Optional[Mask], *, scale, dropout_p, backend, return_lse,
              return_weights, invariant: bool = False):
    """:func:`attnkit.attention` inside a compiled region, for a call that does not trace
    (:func:`traced`): the same results, through the ``attnkit::attention`` operator (see the
    module docstring)."""
    if dropout_p > 0:
        raise ValueError(f"attnkit under torch.compile: dropout_p={dropout_p} with mask {mask!r} "
                         f"on backend {backend!r} is not supported inside a compiled region; "
                         f"apply dropout to the output instead, or call attention outside "
                         f"torch.compile")
    code = calls_python(mask)
    if code:
        instead = (" or use T5's bucketing (buckets=None)" if any(leaf.kind != "score_function"
                                                                  for leaf in code)
                   else " or express the function by softcap, alibi, relative_bias or a bias "
                        "tensor")
        raise ValueError(f"attnkit under torch.compile: {', '.join(map(repr, code))} in mask "
                         f"{mask!r} calls Python code, which a compiled region cannot hand to "
                         f"attnkit's operator; call attention outside torch.compile (e.g. in a "
                         f"function decorated with @torch.compiler.disable),{instead}")
    rows = q.shape[:-2]
    batch = 1 if q.dim() == 2 else rows[0] if q.dim() == 3 else math.prod(rows[:-1])
    heads = 1 if q.dim() < 4 else rows[-1]
    space = MaskSpace(batch, heads, q.shape[-2], k.shape[-2], q.device)
    mask, sinks = (None, None) if mask is None else _without_sinks(mask, space)
    spec, tensors, numbers = flatten(mask, space, tuple(rows))
    grad_mode = torch.is_grad_enabled()
    grads = [grad_mode and t.requires_grad and t.is_floating_point() for t in (q, k, v, *tensors)]
    # on the host as data: a changed window or cap is a new value, not a new spec
    numbers = torch.tensor(numbers, dtype=torch.float64, device="cpu")
    out, lse, weights = _forward_op(q, k, v, tensors, numbers, spec, scale, backend,
                                    bool(return_weights), bool(return_lse or sinks is not None),
                                    grads, invariant)
    if sinks is not None:  # in the graph: autograd differentiates it, logits included
        joined = sinks.join(out.reshape(batch, heads, *out.shape[-2:]),
                            lse.reshape(batch, heads, -1),
                            weights.reshape(batch, heads, *weights.shape[-2:])
                            if return_weights else None, alike=invariant)
        out, lse = joined[0].reshape(out.shape), joined[1].reshape(lse.shape)
        weights = joined[2].reshape(weights.shape) if return_weights else weights
    return out, (lse if return_lse else None), (weights if return_weights else None)


def _without_sinks(mask: Mask, space: MaskSpace) -> tuple[Optional[Mask], Optional[Sinks]]:
    """``mask`` without its sinks (``None`` when nothing else is left), and the sinks (or
    ``None``), checked against ``space``."""
    leaves = mask.leaves()
    found = [leaf for leaf in leaves if isinstance(leaf, Sinks)]
    if not found:
        return mask, None
    if len(found) > 1:
        raise ValueError(f"mask holds {len(found)} sinks modifiers ({', '.join(map(repr, found))}): "
                         f"use one")
    problems = found[0].check(space)
    if problems:
        raise ValueError(f"attnkit under torch.compile: {'; '.join(problems)}")
    rest = [leaf for leaf in leaves if leaf is not found[0]]
    return (functools.reduce(operator.and_, rest) if rest else None), found[0]
