"""One eager attention call, the steps below :func:`attnkit.attention`::

    validated   inputs checked and a backend chosen, once per call signature (CALLS)
    run         dispatch.run: garbage guarded, the backend, non-finite rows poisoned
    sinks       joined through the LSE, one place for every backend
    refusal     a double backward through a backend without one raises clearly
    restored    back to the caller's layout

The compiled operator (:mod:`attnkit.compiled`) runs this on real tensors: nothing here
imports the public entry point.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Union

import torch

from . import dispatch
from .backends.base import Backend, BackendOutput
from .inputs import CallCache, Inputs, restore, validate


class AttentionResult(NamedTuple):
    """What ``attention(..., return_lse=True / return_weights=True)`` returns.

    ``out [..., Hq, Tq, Dv]`` in the input dtype; ``lse [..., Hq, Tq]`` natural-log
    log-sum-exp of the masked scaled scores, after any score modifiers and with sinks in the
    sum (float32, float64 for float64 input; −inf on a fully masked row without a sink) or
    ``None``; ``weights [..., Hq, Tq, Tk]`` (before dropout; with sinks a row sums to less
    than 1) or ``None``.
    """

    out: torch.Tensor
    lse: Optional[torch.Tensor]
    weights: Optional[torch.Tensor]


CALLS = CallCache()
"""Validated calls and their backends by signature (:class:`~attnkit.inputs.CallCache`)."""


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *, scale: Optional[float],
        dropout_p: float, generator: Optional[torch.Generator], backend: str, return_lse: bool,
        return_weights: bool, invariant: bool = False) -> Union[torch.Tensor, AttentionResult]:
    """The eager call of :func:`attnkit.attention` (same arguments and results; autocast is
    off here: the caller applied it to q, k and v)."""
    compiling = torch.compiler.is_compiling()
    inputs, chosen = validated(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                               generator=generator, backend=backend, return_lse=return_lse,
                               return_weights=return_weights, compiling=compiling,
                               invariant=invariant)
    result = with_sinks(inputs, dispatch.run(chosen, inputs))
    if inputs.need_grad and not chosen.DOUBLE_BACKWARD and not compiling:
        dispatch.refuse_double_backward(result, chosen.NAME)
    return restored(result, inputs, return_lse, return_weights)


def validated(q, k, v, mask, *, scale, dropout_p, generator, backend, return_lse,
              return_weights, compiling: bool, invariant: bool = False,
              ) -> tuple[Inputs, Backend]:
    """``(inputs, backend)`` for the call: from :data:`CALLS` when its signature was seen
    (never with dropout, which draws from a generator, nor inside a compiled graph:
    ``compiling``)."""
    def validate_and_choose():
        inputs = validate(q, k, v, mask, scale=scale, dropout_p=dropout_p, generator=generator,
                          need_weights=return_weights, need_lse=return_lse,
                          invariant=invariant)
        return inputs, dispatch.select(inputs, backend)
    if dropout_p or compiling:
        inputs, chosen = validate_and_choose()
    else:
        inputs, chosen = CALLS.get(q, k, v, mask, (scale, backend, dispatch.forced(backend),
                                                   return_lse, return_weights, invariant),
                                   validate_and_choose)
    if not compiling and dispatch.log.isEnabledFor(logging.DEBUG):
        dispatch.log.debug("attention: backend %s (asked %r) for q %s, k %s, %s, mask %r",
                           chosen.NAME, backend, tuple(inputs.q.shape), tuple(inputs.k.shape),
                           inputs.q.dtype, inputs.mask)
    return inputs, chosen


def with_sinks(inputs: Inputs, result: BackendOutput) -> BackendOutput:
    """``result`` with the call's sinks joined (merged with an empty result of LSE sink_h:
    :meth:`~attnkit.modifiers.Sinks.join`), the same for every backend; itself without."""
    if inputs.modifiers is None or inputs.modifiers.sinks is None:
        return result
    return BackendOutput(*inputs.modifiers.sinks.join(result.out, result.lse, result.weights,
                                                       alike=inputs.invariant))


def restored(result: BackendOutput, inputs: Inputs, return_lse: bool,
             return_weights: bool) -> Union[torch.Tensor, AttentionResult]:
    """The result in the caller's layout: ``out``, or an :class:`AttentionResult`."""
    out = restore(result.out, inputs)
    if not (return_lse or return_weights):
        return out
    lse = restore(result.lse, inputs) if return_lse else None
    weights = restore(result.weights, inputs) if return_weights else None
    return AttentionResult(out, lse, weights)
