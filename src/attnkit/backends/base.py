"""The backend protocol: what a backend supports, stated as data, and why it refuses an input."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..inputs import Inputs
from ..masks import readable


class BackendOutput(NamedTuple):
    """``out [B, Hq, Tq, Dv]`` (input dtype), ``lse [B, Hq, Tq]`` (fp32; fp64 for fp64 input;
    may be ``None`` when not requested), ``weights [B, Hq, Tq, Tk]`` or ``None`` when not requested.
    The reference with sinks returns all three in float64, which the sinks' join rounds once."""

    out: torch.Tensor
    lse: Optional[torch.Tensor]
    weights: Optional[torch.Tensor]


def beyond_range(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the bias ``values`` hold finite numbers beyond ``dtype``'s range, which adding
    them in ``dtype`` would turn into ±inf (and the softmax into NaN, or a row wrongly masked):
    one read of the values, only for a bias in a wider dtype than ``dtype``."""
    limit = torch.finfo(dtype).max
    return torch.finfo(values.dtype).max > limit and bool(
        (values.detach().abs() > limit).logical_and_(~torch.isinf(values)).any())


def bias_range_reasons(inputs: Inputs, dtype: torch.dtype, name: str) -> list[str]:
    """The refusal of a backend that adds the mask's biases in ``dtype``, for each bias with
    finite values beyond its range (:func:`beyond_range`), ALiBi's largest (its slopes times
    ``Tq + Tk``) and relative-bias tables included. Under a ``torch.func`` transform
    (``inputs.transformed``) biases are not read: ``vmap`` cannot read batched values on the
    host, and such a call runs on ``reference``, which adds them in float64."""
    reasons = [f"a bias beyond {dtype}'s range (|bias| > {torch.finfo(dtype).max:g}) (not "
               f"supported by {name}: it adds the bias in {dtype}, where it would overflow; "
               f"reference adds it in float64)"
               for values in inputs.biases
               if not inputs.transformed and beyond_range(values, dtype)]
    modifiers = inputs.modifiers
    if modifiers is not None and (modifiers.alibi or modifiers.relative):
        span = inputs.q.shape[2] + inputs.k.shape[2]
        extremes = [*((part.slopes, span) for part in modifiers.alibi),
                    *((part.table, 1) for part in modifiers.relative)]
        # (only a wider dtype than `dtype` can hold them: no product for the others)
        if any(torch.finfo(values.dtype).max > torch.finfo(dtype).max and readable(values)
               and beyond_range(values * factor, dtype) for values, factor in extremes):
            reasons.append(f"alibi or relative_bias values beyond {dtype}'s range (not "
                           f"supported by {name}: it adds them in {dtype}, where they would "
                           f"overflow; reference adds them in float64)")
    return reasons


class Backend:
    """A way to compute attention. Subclasses set the capability fields and ``forward``.

    ``forward`` must be differentiable in q, k, v (plain autograd or a ``torch.autograd.Function``).
    """

    NAME: str = "?"
    DEVICES: tuple[str, ...] = ("cpu", "cuda")
    DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    SUPPORTS_DROPOUT: bool = True
    SUPPORTS_WEIGHTS: bool = True
    SUPPORTS_BIAS: bool = True
    SUPPORTS_BIAS_GRAD: bool = False
    """A bias that requires grad gets ``dBias`` (reduced over its broadcast dims)."""
    SUPPORTS_FUNC: bool = False
    """Runs under ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``: wrapped tensors,
    nested differentiation)."""
    DOUBLE_BACKWARD: bool = False
    """Its backward is differentiable (``create_graph=True``, gradient penalties); backends
    without it raise a clear error when a double backward reaches them."""
    LSE_BACKWARD: bool = False
    """Has :meth:`backward`: gradients from the saved output and LSE, called outside autograd
    (a compiled graph's opaque backward)."""
    EXACT_NONFINITE: bool = False
    """Makes NaN exactly the rows that hold or may attend a non-finite value, by itself;
    others get :func:`attnkit.finite.poison` after the call on CPU."""
    INVARIANT_REFUSAL: Optional[str] = "it does not keep the invariance contract"
    """Why it refuses a call under the invariance contract (:mod:`attnkit.invariance`);
    ``None``: it keeps it."""
    MAX_HEAD_DIM: Optional[int] = None
    SCORE_MODIFIERS: tuple[str, ...] = ()
    """The score modifiers it applies (``"softcap"``, ``"alibi"``, ``"relative_bias"``,
    ``"score_function"``; see :mod:`attnkit.modifiers`). Sinks are not listed: every backend
    that returns an LSE runs them (they join its result after the call)."""
    DESCRIPTION: str = ""

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run on this machine at all (``None`` when it can)."""
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """Every reason this backend cannot run ``inputs``, one line each; empty means it can."""
        name = self.NAME
        reasons = []
        why_not = self.unavailable_reason()
        if why_not:
            reasons.append(why_not)
        if inputs.q.device.type not in self.DEVICES:
            reasons.append(f"device={inputs.q.device.type} (not supported by {name})")
        if inputs.q.dtype not in self.DTYPES:
            reasons.append(f"dtype={inputs.q.dtype} (not supported by {name})")
        if inputs.dropout_p > 0 and not self.SUPPORTS_DROPOUT:
            reasons.append(f"dropout_p={inputs.dropout_p} (not supported by {name})")
        if inputs.need_weights and not self.SUPPORTS_WEIGHTS:
            reasons.append(f"return_weights=True (not supported by {name})")
        if inputs.mask is not None and inputs.mask.has_bias and not self.SUPPORTS_BIAS:
            reasons.append(f"additive bias mask (not supported by {name})")
        if inputs.bias_grad and not self.SUPPORTS_BIAS_GRAD:
            reasons.append(f"a bias that requires grad (not supported by {name}: it takes the "
                           f"bias as a constant; tiled and reference give its gradient)")
        if inputs.transformed and not self.SUPPORTS_FUNC:
            reasons.append(f"a torch.func transform (vmap/grad/jacrev) or forward-mode AD "
                           f"(not supported by {name}: its kernels take no functorch or dual "
                           f"tensors; reference supports them)")
        head_dim = max(inputs.q.shape[-1], inputs.v.shape[-1])
        if self.MAX_HEAD_DIM is not None and head_dim > self.MAX_HEAD_DIM:
            reasons.append(f"head dim {head_dim} > {self.MAX_HEAD_DIM} (not supported by {name})")
        if inputs.modifiers is not None:
            reasons.extend(f"{kind} (not supported by {name})" for kind in inputs.modifiers.kinds()
                           if kind not in self.SCORE_MODIFIERS)
        if inputs.invariant and self.INVARIANT_REFUSAL:
            reasons.append(f"invariant=True (not kept by {name}: {self.INVARIANT_REFUSAL})")
        reasons.extend(self.extra_reasons(inputs))
        return reasons

    def reads_padding(self, inputs: Inputs) -> bool:
        """Whether the call reads K/V outside each sequence's real keys (then
        :func:`attnkit.finite.guard` zeroes them there first)."""
        return True

    def evaluates_mask(self, inputs: Inputs) -> bool:
        """Whether the call evaluates its mask over the whole ``[Bm, Hm, Tq, Tk]``
        (:meth:`~attnkit.inputs.Inputs.allowed`), which :func:`attnkit.finite.guard` may
        then share whatever the batch."""
        return False

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        """Backend-specific refusals beyond the capability fields."""
        return []

    def auto_reasons(self, inputs: Inputs) -> list[str]:
        """Why ``backend="auto"`` should pass over this backend although it *can* run ``inputs``
        (it is measured slower there, e.g. a dense-materialised mask, or an interpreter on CPU).
        An explicit ``backend=NAME`` ignores these."""
        return []

    def forward(self, inputs: Inputs) -> BackendOutput:
        raise NotImplementedError

    def backward(self, inputs: Inputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 dlse: Optional[torch.Tensor], want_bias: Sequence[bool],
                 want_params: Sequence[bool] = ()) -> tuple:
        """Gradients of a :meth:`forward` from its ``out [B, Hq, Tq, Dv]`` and ``lse [B, Hq, Tq]``
        and their upstream gradients (``dlse`` may be ``None``) → ``(dq, dk, dv, dbiases,
        dparams)``; ``want_bias`` and ``dbiases`` have one entry per ``inputs.biases``,
        ``want_params`` and ``dparams`` one per tensor of the score modifiers
        (``inputs.modifiers.tensors``; ``None`` where no gradient is wanted). Score modifiers
        but sinks and score functions (:func:`check_backward_modifiers`). Backends with
        ``LSE_BACKWARD``; it works below autograd too (inside a custom operator)."""
        raise NotImplementedError(f"backend {self.NAME!r} has no separate backward")


def empty_output(inputs: Inputs) -> BackendOutput:
    """The result of a call with nothing to compute (B, Tq or Tk of 0), whatever its mask and
    score modifiers: ``out [B, Hq, Tq, Dv]`` zeros (with Tk = 0 every row is fully masked),
    ``lse [B, Hq, Tq]`` −inf (float32; float64 for float64 input), ``weights [B, Hq, Tq, Tk]``
    zeros when asked for. Every float tensor a gradient can reach (q, k, v, the mask's
    biases, the modifiers' tensors) joins the result through an empty slice of itself, which
    adds exactly 0 whatever its values, so each gets a zero gradient of its own shape. Sinks
    join afterwards, as for any backend."""
    q = inputs.q
    batch, heads, q_len, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, heads, q_len, inputs.v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, q_len), float("-inf"), dtype=lse_dtype, device=q.device)
    weights = (torch.zeros(batch, heads, q_len, inputs.k.shape[2], dtype=q.dtype, device=q.device)
               if inputs.need_weights else None)
    if inputs.need_grad or inputs.transformed:
        anchor = torch.stack([t.reshape(-1)[:0].sum(dtype=lse_dtype) for t in inputs.grad_tensors
                              if t.is_floating_point()]).sum()  # [], exactly 0
        out, lse = out + anchor.to(out.dtype), lse + anchor
        weights = None if weights is None else weights + anchor.to(weights.dtype)
    return BackendOutput(out, lse, weights)


def batched_gradient(*grads: Optional[torch.Tensor]) -> bool:
    """Whether a gradient reaching a backward is batched by a vmap (``is_grads_batched=True``
    and ``jacobian(vectorize=True)`` use torch's legacy one) or wrapped by another
    ``torch.func`` transform: a backward that writes in place or launches kernels cannot
    take it."""
    functorch = torch._C._functorch
    return any(g is not None and (functorch.is_legacy_batchedtensor(g)
                                  or functorch.is_functorch_wrapped_tensor(g)) for g in grads)


def check_backward_modifiers(inputs: Inputs, backend: str) -> None:
    """Raise ``ValueError`` for score modifiers that :meth:`Backend.backward` cannot take:
    sinks (they change the saved out/lse: join them after, :meth:`~attnkit.modifiers.Sinks.
    join`, and differentiate that) and score functions (their gradient needs autograd)."""
    modifiers = inputs.modifiers
    if modifiers is None:
        return
    if modifiers.sinks is not None or modifiers.functions:
        raise ValueError(f"{backend} backward outside autograd takes no sinks and no "
                         f"score_function (got {', '.join(m.kind for m in modifiers.parts())}): "
                         f"join sinks to the result after the call (Sinks.join), or "
                         f"differentiate attention() with autograd")
