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
from .backends.torch_sdpa import allowed_kernels
from .inputs import CallCache, Inputs, _bhtd, refuse_jit_trace, restore, validate
from .masks import (KEY_BYTES, as_mask, content_key, held_tensors, learnable, mask_tensors,
                    readable, wrapped_eagerly)
from .modifiers import calls_python


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
        return_weights: bool, invariant: bool = False, compiling: Optional[bool] = None,
        ) -> Union[torch.Tensor, AttentionResult]:
    """The eager call of :func:`attnkit.attention` (same arguments and results; autocast is
    off here: the caller applied it to q, k and v). ``compiling``:
    ``torch.compiler.is_compiling()`` where the caller has read it, else ``None``."""
    refuse_jit_trace("attnkit.attention")
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    inputs, chosen = validated(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                               generator=generator, backend=backend, return_lse=return_lse,
                               return_weights=return_weights, compiling=compiling,
                               invariant=invariant)
    return executed(inputs, chosen, return_lse, return_weights, compiling)


def executed(inputs: Inputs, chosen: Backend, return_lse: bool, return_weights: bool,
             compiling: bool = False) -> Union[torch.Tensor, AttentionResult]:
    """A validated call run on ``chosen``: dispatch.run, sinks joined, a double backward
    refused where the backend has none, the result in the caller's layout."""
    result = with_sinks(inputs, dispatch.run(chosen, inputs))
    if inputs.need_grad and not chosen.DOUBLE_BACKWARD and not compiling:
        dispatch.refuse_double_backward(result, chosen.NAME)
    return restored(result, inputs, return_lse, return_weights)


class Plan:
    """One attention call validated and planned once, run on new tensors of the same
    signature (:func:`attnkit.plan`): the layers of a step that pass one mask, a decoding
    loop's repeated shapes. Running a plan validates nothing, chooses nothing and derives
    nothing from the mask again (each layer pays only the kernel and the per-call operations
    on its own q, k, v); it checks that the tensors have the planned shapes, strides, dtypes,
    devices and gradient flags, and that the mask's tensors were not written in place since
    (their version counters; CPU inference tensors, which have none, by their values; an
    inference tensor on a GPU is not watched: make a new plan after writing it), raising
    ``ValueError`` otherwise. Made and run outside
    ``torch.autocast``; made or run inside a compiled region, it runs as
    :func:`attnkit.attention`."""

    def __init__(self, q, k, v, mask, *, scale, backend, return_lse, return_weights,
                 invariant):
        if _autocast_on():
            raise ValueError("attnkit.plan under torch.autocast: make and run plans in the "
                             "dtype the call runs in (autocast casts per call: use attention())")
        self.mask, self.scale, self.backend_name = mask, scale, backend
        self.return_lse, self.return_weights, self.invariant = return_lse, return_weights, invariant
        if torch.compiler.is_compiling():  # made in a compiled region, it runs as attention()
            return
        inputs, self.backend = validated(q, k, v, mask, scale=scale, dropout_p=0.0,
                                         generator=None, backend=backend, return_lse=return_lse,
                                         return_weights=return_weights, compiling=False,
                                         invariant=invariant)
        # the caller's tensors, found once (validation may fit a bias into a copy)
        self._watched = _watched(as_mask(mask))
        # read afresh by every run, through attention(): a parameter, which a fused optimizer
        # writes without a trace (:func:`~attnkit.masks.learnable`), a CPU inference tensor
        # too large to compare by value, and a mask that runs user code, whose reads no
        # version counter shows
        self._rederives = (any(learnable(t) or _too_large(t) for t in self._watched)
                           or _runs_code(as_mask(mask)))
        # what runs derive from the mask, kept for the plan's lifetime (a call cache hit of a
        # mask keyed by shape shares nothing)
        self._inputs = inputs.replaced(q=None, k=None, v=None,
                                       derived={} if inputs.derived is None else inputs.derived)
        self._signature = _plan_signature(q, k, v)
        self._tensors = _versions(self._watched)

    @staticmethod
    def signature_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """What a plan is made for: the shapes, strides, dtypes, devices and gradient flags of
        ``q, k, v`` and the grad mode (hashable)."""
        return _plan_signature(q, k, v)

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``q, k, v`` have the planned signature (:meth:`signature_of`)."""
        return _plan_signature(q, k, v) == self._signature

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_stale"] = "_watched" in state and self.stale()
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy``, ``deepcopy``, pickle) watches its own tensors, whose version
        counters start anew: stale where the original was when copied, else from now on."""
        stale = state.pop("_stale", False)
        self.__dict__.update(state)
        if "_watched" in state:
            self._tensors = ("stale",) if stale else _versions(self._watched)

    def stale(self) -> bool:
        """Whether a tensor of the mask (or of its score modifiers) was written in place since
        the plan was made (its version counter moved), or its ``requires_grad`` changed (the
        plan chose its backend and gradients for the old flag): running it would then raise."""
        return _versions(self._watched) != self._tensors

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ) -> Union[torch.Tensor, AttentionResult]:
        """The planned call on ``q, k, v``: what ``attention(q, k, v, mask, ...)`` with the
        plan's arguments returns."""
        refuse_jit_trace("an attnkit plan")
        if torch.compiler.is_compiling() or any(map(wrapped_eagerly, (q, k, v))):
            # traced, or torch.func / forward-mode AD tensors: attention() chooses for them
            from .api import attention
            return attention(q, k, v, self.mask, scale=self.scale, backend=self.backend_name,
                             return_lse=self.return_lse, return_weights=self.return_weights,
                             invariant=self.invariant)
        if not self.fits(q, k, v):
            got = _plan_signature(q, k, v)
            hint = ("; the grad mode differs: a plan runs in the mode it was made in (a "
                    "reentrant torch.utils.checkpoint runs its forward with grad mode off and "
                    "its recompute with it on: use use_reentrant=False)"
                    if got[1] != self._signature[1] else "")
            raise ValueError(f"this plan was made for {_describe(self._signature)}; got "
                             f"{_describe(got)}: make a plan for these tensors "
                             f"(attnkit.plan), or call attnkit.attention{hint}")
        if _autocast_on():
            raise ValueError("a plan runs outside torch.autocast (autocast casts per call: use "
                             "attention())")
        if self.stale():
            raise ValueError("the mask's tensors were written in place, or their requires_grad "
                             "changed, after the plan was made: what the plan derived from "
                             "them is stale; make a new plan")
        return self._run(q, k, v)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             ) -> Union[torch.Tensor, AttentionResult]:
        """:meth:`__call__` once its checks have passed (a caller that keys its plans by
        :meth:`signature_of` and checks :meth:`stale` itself)."""
        if self._rederives:
            from .api import attention
            return attention(q, k, v, self.mask, scale=self.scale, backend=self.backend.NAME,
                             return_lse=self.return_lse, return_weights=self.return_weights,
                             invariant=self.invariant)
        template = self._inputs
        rank, batch = template.input_rank, template.batch_shape
        inputs = template.replaced(q=_bhtd(q, rank, batch), k=_bhtd(k, rank, batch),
                                   v=_bhtd(v, rank, batch))
        return executed(inputs, self.backend, self.return_lse, self.return_weights)

    def __repr__(self) -> str:
        return (f"Plan({_describe(self._signature)}, mask {self._inputs.mask!r}, backend "
                f"{self.backend.NAME})")


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def _plan_signature(q, k, v) -> tuple:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a plan runs on torch.Tensors q, k, v; got {type(t).__name__} "
                            f"for {name}")
    layouts = [(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in (q, k, v)]
    return tuple(layouts), torch.is_grad_enabled()


def _describe(signature: tuple) -> str:
    tensors, grad_mode = signature
    parts = [f"{name} {tuple(shape)} stride {stride} {dtype} {device}"
             + (" requires_grad" if grad else "")
             for name, (shape, stride, dtype, device, grad) in zip("qkv", tensors)]
    return ", ".join(parts) + f" (grad mode {'on' if grad_mode else 'off'})"


def _watched(mask) -> tuple:
    """Every tensor the caller's mask holds, its score modifiers' included, whose in-place
    writes make a plan stale (:func:`~attnkit.masks.held_tensors`: those of parts that run
    user code too, where they hold them; what their code reads is not known)."""
    return () if mask is None else held_tensors(mask)


def _versions(tensors: tuple) -> tuple:
    """The version counter of each tensor, then each one's ``requires_grad`` (the plan holds
    the tensors, so their identities stay theirs). Inference tensors have no counter: their
    values on the CPU (:func:`_inference_values`), else ``None`` (not watched)."""
    return (tuple([_inference_values(t) if t.is_inference() else t._version for t in tensors]),
            tuple([t.requires_grad for t in tensors]))


def _inference_values(t: torch.Tensor) -> Optional[bytes]:
    """An inference tensor's values as a key when reading them costs no device sync (a plain
    CPU tensor, at most :data:`~attnkit.masks.KEY_BYTES`); else ``None``: a GPU tensor (a read
    would sync every run), meta or fake tensors (no values), larger ones."""
    if not _values_on_cpu(t) or t.numel() * t.element_size() > KEY_BYTES:
        return None
    return content_key(t)


def _values_on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain CPU tensor with values to read (not meta, fake or traced)."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and readable(t)


def _runs_code(mask) -> bool:
    """Whether ``mask`` runs the caller's Python code: a ``from_function`` part, or a score
    modifier that does (:func:`~attnkit.modifiers.calls_python`)."""
    return mask is not None and (mask_tensors(mask) is None or bool(calls_python(mask)))


def _too_large(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CPU inference tensor with values (no version counter) too large for
    :func:`_inference_values` to compare."""
    return (t.is_inference() and _values_on_cpu(t)
            and t.numel() * t.element_size() > KEY_BYTES)


def validated(q, k, v, mask, *, scale, dropout_p, generator, backend, return_lse,
              return_weights, compiling: bool, invariant: bool = False,
              ) -> tuple[Inputs, Backend]:
    """``(inputs, backend)`` for the call: from :data:`CALLS` when its signature was seen
    (never with dropout, which draws from a generator, nor inside a compiled graph:
    ``compiling``)."""
    def validate_and_choose():
        return _validated_now(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                              generator=generator, backend=backend, return_lse=return_lse,
                              return_weights=return_weights, invariant=invariant)
    if compiling or generator is not None or type(dropout_p) not in (float, int) or dropout_p:
        inputs, chosen = validate_and_choose()  # (validation checks dropout_p and generator)
    else:
        # (the arguments' types too: True == 1 and np.float32(0.5) == 0.5, which validation
        # tells apart; and the torch kernels the caller's sdpa_kernel context allows, which
        # the torch backend's refusals read)
        options = (scale, backend, dispatch.forced(backend), return_lse, return_weights,
                   invariant, type(scale), type(return_lse), type(return_weights),
                   allowed_kernels())
        inputs, chosen = CALLS.get(q, k, v, mask, options, validate_and_choose)
    if not compiling and dispatch.log.isEnabledFor(logging.DEBUG):
        dispatch.log.debug("attention: backend %s (asked %r) for q %s, k %s, %s, mask %r",
                           chosen.NAME, backend, tuple(inputs.q.shape), tuple(inputs.k.shape),
                           inputs.q.dtype, inputs.mask)
    return inputs, chosen


def _validated_now(q, k, v, mask, *, scale, dropout_p, generator, backend, return_lse,
                   return_weights, invariant) -> tuple[Inputs, Backend]:
    """``(inputs, backend)``: the call validated and its backend chosen, here."""
    inputs = validate(q, k, v, mask, scale=scale, dropout_p=dropout_p, generator=generator,
                      need_weights=return_weights, need_lse=return_lse, invariant=invariant)
    return inputs, dispatch.select(inputs, backend)


def with_sinks(inputs: Inputs, result: BackendOutput) -> BackendOutput:
    """``result`` with the call's sinks joined (merged with an empty result of LSE sink_h:
    :meth:`~attnkit.modifiers.Sinks.join`), the same for every backend; itself without."""
    if inputs.modifiers is None or inputs.modifiers.sinks is None:
        return result
    return BackendOutput(*inputs.modifiers.sinks.join(result.out, result.lse, result.weights,
                                                       alike=inputs.invariant,
                                                       dtype=inputs.q.dtype))


def restored(result: BackendOutput, inputs: Inputs, return_lse: bool,
             return_weights: bool) -> Union[torch.Tensor, AttentionResult]:
    """The result in the caller's layout: ``out``, or an :class:`AttentionResult`."""
    out = restore(result.out, inputs)
    if not (return_lse or return_weights):
        return out
    lse = restore(result.lse, inputs) if return_lse else None
    weights = restore(result.weights, inputs) if return_weights else None
    return AttentionResult(out, lse, weights)
