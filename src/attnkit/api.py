"""``attention()``: the public entry point. Its steps: torch SDPA's keywords refused with the
attnkit spelling, autocast, the compiled-graph operator (:mod:`attnkit.compiled`), then the
eager call (:func:`attnkit.call.run`: validate → dispatch → run → sinks → restore)."""

from __future__ import annotations

from typing import Literal, Optional, Union, overload

import torch

from . import call, compiled, dispatch, invariance
from .call import AttentionResult
from .inputs import unexpected_keywords, validate
from .masks import Mask, as_mask

MaskLike = Union[Mask, torch.Tensor, None]


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0,
              generator: Optional[torch.Generator] = None, backend: str = "auto",
              return_lse: Literal[False] = False, return_weights: Literal[False] = False,
              invariant: Optional[bool] = None) -> torch.Tensor: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0,
              generator: Optional[torch.Generator] = None, backend: str = "auto",
              return_lse: Literal[True], return_weights: bool = False,
              invariant: Optional[bool] = None) -> AttentionResult: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0,
              generator: Optional[torch.Generator] = None, backend: str = "auto",
              return_lse: bool = False, return_weights: Literal[True],
              invariant: Optional[bool] = None) -> AttentionResult: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0,
              generator: Optional[torch.Generator] = None, backend: str = "auto",
              return_lse: bool = False, return_weights: bool = False,
              invariant: Optional[bool] = None) -> Union[torch.Tensor, AttentionResult]: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: MaskLike = None, *, scale: Optional[float] = None,
              dropout_p: float = 0.0, generator: Optional[torch.Generator] = None,
              backend: str = "auto", return_lse: bool = False, return_weights: bool = False,
              invariant: Optional[bool] = None, **unexpected,
              ) -> Union[torch.Tensor, AttentionResult]:
    """Scaled dot-product attention ``softmax(q kᵀ · scale + mask) v``.

    Shapes: ``q [..., Hq, Tq, Dk]``, ``k [..., Hkv, Tk, Dk]``, ``v [..., Hkv, Tk, Dv]`` with Hq a
    multiple of Hkv (GQA/MQA, K/V never copied per query head); also ``[T, D]`` and
    ``[B, T, D]`` (one head). Returns ``out [..., Hq, Tq, Dv]`` in the input dtype, or an
    :class:`AttentionResult` when ``return_lse`` or ``return_weights`` is set.

    Args:
        mask: an attnkit mask (``causal()``, ``padding(...)``, combined with ``& | ~``), a bool
            tensor (True = may attend) or a float tensor added to the scores, broadcastable
            to ``[..., Hq, Tq, Tk]``. Score modifiers join it by ``&`` (``softcap``, ``alibi``,
            ``relative_bias``, ``sinks``, ``score_function``; see :mod:`attnkit.modifiers`
            for the order in which they apply).
        scale: multiplies the scores; default ``1/sqrt(Dk)``. A temperature τ is
            ``scale=1/(τ·sqrt(Dk))``.
        dropout_p: dropout on the attention weights (rescaled by ``1/(1-p)``); reproducible
            with ``generator`` or the global seed. Under ``torch.utils.checkpoint`` leave
            ``generator`` out: the recompute restores the global RNG only, and a generator's
            next draw would drop other weights than the forward did.
        backend: ``"auto"`` or a name from ``attnkit.available_backends()``; an explicit backend that
            cannot run the input raises ``ValueError`` with its reasons. Inside
            ``attnkit.use_backend(name)``, ``"auto"`` means ``name``;
            :func:`explain_dispatch` tells what ``"auto"`` picks and why.
        invariant: run under the invariance contract (:mod:`attnkit.invariance`): each query
            row's bits depend on its own inputs alone, not on the batch, its padding or how
            the queries were chunked; ``None`` follows ``attnkit.invariant()``.

    Under ``torch.autocast`` q, k and v (all but float64 ones) run in the autocast dtype, as
    torch's SDPA does; the backends themselves then run with autocast off (they choose their
    own accumulation dtypes).

    A query row whose keys are all masked gets output 0 and LSE −inf (never NaN), and zero
    gradients (with ``sinks``: output 0, LSE sink_h). K/V outside each sequence's real keys
    (padding, unwritten cache slots) are never read; NaN/inf in q or in keys a row may attend
    make that row NaN, never a wrong finite number (see :mod:`attnkit.finite`).

    Keyword arguments of torch's SDPA that attnkit spells differently (``attn_mask``,
    ``is_causal``, ``enable_gqa``) raise ``TypeError`` with the attnkit spelling.
    """
    if unexpected:
        raise unexpected_keywords(attention, unexpected)
    invariant = invariance.active(invariant)
    device = autocast_device(q)
    autocast = device is not None
    if autocast:  # 1. autocast: the inputs in its dtype, as torch's SDPA takes them
        q, k, v = _autocast(device, q, k, v)
    compiling = torch.compiler.is_compiling()
    if compiling:  # 2. inside a compiled graph: attnkit's operator
        detour = _compiled(q, k, v, as_mask(mask), scale=scale, dropout_p=dropout_p,
                           backend=backend, return_lse=return_lse, return_weights=return_weights,
                           invariant=invariant)
        if detour is not None:
            return detour
    # 3. the eager call (validated once per signature, run, sinks joined, restored); the
    # backends choose their own accumulation dtypes
    if not autocast:
        return call.run(q, k, v, mask, scale=scale, dropout_p=dropout_p, generator=generator,
                        backend=backend, return_lse=return_lse, return_weights=return_weights,
                        invariant=invariant, compiling=compiling)
    with torch.autocast(device, enabled=False):
        return call.run(q, k, v, mask, scale=scale, dropout_p=dropout_p, generator=generator,
                        backend=backend, return_lse=return_lse, return_weights=return_weights,
                        invariant=invariant, compiling=compiling)


def _compiled(q, k, v, mask, *, scale, dropout_p, backend, return_lse, return_weights,
              invariant):
    """A call inside a compiled graph as attnkit's operator (:mod:`attnkit.compiled`), or
    ``None`` when the graph traces its backend directly (torch operations alone)."""
    backend = dispatch.forced(backend)
    if compiled.traced(q, k, v, mask, scale=scale, dropout_p=dropout_p, backend=backend,
                       return_lse=return_lse, return_weights=return_weights,
                       invariant=invariant):
        return None
    out, lse, weights = compiled.attention(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                                           backend=backend, return_lse=return_lse,
                                           return_weights=return_weights, invariant=invariant)
    return AttentionResult(out, lse, weights) if return_lse or return_weights else out


def autocast_device(q) -> Optional[str]:
    """``"cpu"``/``"cuda"`` when ``q``'s device runs under ``torch.autocast`` now, else
    ``None``."""
    device = q.device.type if isinstance(q, torch.Tensor) else "cpu"
    return device if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) else None


def autocast_call(fn, q, *tensors, **kwargs):
    """``fn(q, *tensors, **kwargs)`` as :func:`attention` runs under ``torch.autocast``:
    the floating tensors (but float64) in the autocast dtype, then autocast off (for the
    entry points beside :func:`attention`: varlen, paged)."""
    device = autocast_device(q)
    q, *tensors = _autocast(device, q, *tensors)
    with torch.autocast(device, enabled=False):
        return fn(q, *tensors, **kwargs)


def _autocast(device: str, *tensors):
    """The tensors in the autocast dtype, as autocast casts SDPA's inputs (float64 and
    non-tensors are left alone: validation reports them)."""
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
         scale: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
         return_weights: bool = False, invariant: Optional[bool] = None,
         **unexpected) -> call.Plan:
    """``attention(q, k, v, mask, ...)`` validated and planned once, to run on new tensors of
    the same signature: ``plan = attnkit.plan(q, k, v, mask)``, then ``plan(q, k, v)`` in
    every layer of a step that passes ``mask`` (or every step of a loop whose shapes repeat).

    Shapes and arguments as for :func:`attention` (no dropout). Making the plan validates the
    call, chooses the backend (or finds both in the call cache, as :func:`attention` does)
    and may read the mask's values on the host (its range checks);
    running it makes no such decision again: it checks the tensors' shapes, strides, dtypes,
    devices and gradient flags against the plan's and the mask's tensors against in-place
    writes (``ValueError`` on either; a mask's tensors made under ``torch.inference_mode``
    have no version counter: on the CPU their values are compared, on a GPU they are not
    watched, so make a new plan after writing one), then runs the planned call, which returns what
    :func:`attention` returns, bit for bit. A plan holds what it derived from the mask's
    values (runs of real keys, the dense key mask of torch's kernel) for its lifetime: make a
    new one for a new mask, as each step of a decoding loop does. A plan over a parameter
    (a learnable bias, ALiBi slopes or relative-bias table; or a leaf that requires grad),
    which ``torch.optim``'s fused optimizers write without moving its version counter,
    keeps nothing: each run is the call :func:`attention` makes; so does a plan over a mask
    that runs the caller's code (``from_function``, ``score_function``, a ``relative_bias``
    bucket function), which may read tensors the mask does not hold, and one over a CPU
    inference tensor larger than 4 MiB (too large to compare by value). Make and run plans
    outside ``torch.autocast``; inside a compiled region a plan runs as :func:`attention`.
    torch SDPA's keywords raise ``TypeError`` with the attnkit spelling, as there."""
    if unexpected:
        raise unexpected_keywords(plan, unexpected)
    return call.Plan(q, k, v, mask, scale=scale, backend=backend, return_lse=return_lse,
                     return_weights=return_weights, invariant=invariance.active(invariant))


def explain_dispatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None,
                     *, scale: Optional[float] = None, dropout_p: float = 0.0,
                     return_lse: bool = False, return_weights: bool = False,
                     invariant: Optional[bool] = None, **unexpected) -> dispatch.Dispatch:
    """What ``attention(q, k, v, mask, ...)`` with ``backend="auto"`` would run, without running
    it: the backend's name and, for every backend tried before it, why not (shapes as for
    :func:`attention`); inside ``attnkit.use_backend(name)``, that backend (``forced``), or
    why it cannot run the input. ``print()`` it for a readable summary. Gradients count as
    ``attention`` would see them (q/k/v/bias ``requires_grad`` under grad mode); so does the
    invariance contract (``invariant``, or ``attnkit.invariant()``). torch SDPA's keywords
    raise ``TypeError`` with the attnkit spelling, as in :func:`attention`."""
    if unexpected:
        raise unexpected_keywords(explain_dispatch, unexpected)
    device = autocast_device(q)
    if device is not None:  # as attention() runs it
        q, k, v = _autocast(device, q, k, v)
    inputs = validate(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                      need_weights=return_weights, need_lse=return_lse,
                      invariant=invariance.active(invariant))
    return dispatch.explain(inputs)


def available_backends() -> dict[str, str]:
    """Every backend by name, with ``""`` when usable here or the reason it is not. (Not named
    ``backends``: that is the subpackage ``attnkit.backends``, which ``import
    attnkit.backends.triton`` must reach.)"""
    return {name: (b.unavailable_reason() or "") for name, b in dispatch.BACKENDS.items()}
