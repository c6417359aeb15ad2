"""PyTorch's own fused kernel (``F.scaled_dot_product_attention``), where it meets the contract.

On CPU with Dk == Dv it calls the fused flash kernel directly, which also returns the LSE.
Masks: none and top-left causal go in as ``is_causal``; any other boolean/bias mask is
materialised once as an additive bias (O(Tq·Tk) memory). Rows with no allowed key are
zeroed and given LSE −inf afterwards, so the contract holds whatever the kernel does there.
ALiBi and relative biases with constant slopes and tables join that bias, read from one
vector per head by relative position (:meth:`~attnkit.modifiers.Modifiers.position_bias`):
``auto`` takes them here only without a mask and for few queries (a decoding step), where the
bias is small. Empty calls (B, Tq or Tk of 0) never reach the kernel: ``attention()`` gives
their result itself (:func:`attnkit.dispatch.run`).

On CPU a decoding step with GQA runs each K/V head's query heads as the rows of one call, and
a call of few queries over a padding of the keys alone and a large cache runs per sequence
over its real keys (no copy of K/V: :meth:`TorchBackend.reads_padding`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..finite import checks_keys
from ..inputs import Inputs, derived
from ..masks import CAUSAL, DENSE_MAX_SCORES, Padding
from ..numerics import accum_dtype, additive_mask, grouped, query_rows, ungrouped, unit_rows
from .base import Backend, BackendOutput, bias_range_reasons


KERNELS = ("flash", "mem_efficient", "cudnn", "math")
"""torch's SDPA kernels by the names of their switches (``torch._C._get_<name>_sdp_enabled``)."""

_SWITCHES = tuple(getattr(torch._C, f"_get_{name}_sdp_enabled", lambda: True) for name in KERNELS)
"""Each kernel's switch, read per call (a torch without one: always allowed)."""

_ALL_ALLOWED = (True,) * len(KERNELS)

DEVICE_KERNELS = {"cpu": ("flash", "math"), "cuda": KERNELS}
"""The kernels torch has for each device."""


def allowed_kernels() -> tuple[bool, ...]:
    """Which of :data:`KERNELS` the caller allows now (``torch.nn.attention.sdpa_kernel``,
    ``torch.backends.cuda.enable_*_sdp``; process-wide), one flag each. Inside a compiled
    region they are read as the graph is traced, as the graph's own call of torch's kernel
    reads them; dynamo keeps no guard on them, so a graph traced outside a context keeps
    the backend chosen there."""
    flash, mem_efficient, cudnn, math_ = _SWITCHES  # (unpacked: called on every call)
    return flash(), mem_efficient(), cudnn(), math_()


def _allowed_here(device: torch.device) -> list[str]:
    """The kernels of :data:`DEVICE_KERNELS` for ``device`` that the caller allows now."""
    allowed = dict(zip(KERNELS, allowed_kernels()))
    return [name for name in DEVICE_KERNELS.get(device.type, KERNELS) if allowed[name]]


def context_refusal(device: torch.device) -> Optional[str]:
    """Why ``auto`` passes this backend over on ``device`` under the caller's ``sdpa_kernel``
    context, or ``None``: it allows none of the device's kernels, or on CUDA not the math
    kernel (each fused one refuses some calls, known only by calling it). An explicit
    ``backend="torch"`` still calls the kernel, which honours the context."""
    if allowed_kernels() == _ALL_ALLOWED:  # (the common case, read per decoding step)
        return None
    allowed = _allowed_here(device)
    if allowed and (device.type != "cuda" or "math" in allowed):
        return None
    why = ("none of them runs there" if not allowed
           else "its fused kernels refuse some calls, known only by calling them")
    return (f"torch.nn.attention.sdpa_kernel allows {', '.join(allowed) or 'none'} of "
            f"torch's kernels on {device.type}: {why} (auto passes torch over; "
            f"backend='torch' honours the context)")


def _fused_cpu(inputs: Inputs) -> bool:
    """The CPU flash kernel that also returns the LSE (taken when the LSE is asked for; else
    the public entry point, with less per-call cost) needs Dk == Dv."""
    return inputs.q.device.type == "cpu" and inputs.q.shape[-1] == inputs.v.shape[-1]


def is_plain_causal(mask, scale: float = 1.0) -> bool:
    """Top-left causal, run as the kernel's ``is_causal`` (which gives NaN for a scale ≤ 0)."""
    return mask is not None and mask.band() == CAUSAL and scale > 0


POSITION_BIAS_QUERIES = 4
"""``auto`` runs ALiBi and relative biases here only without a mask and for at most this many
queries (decoding steps), where the same fused kernel call costs less here than through the
tiled engine; from about 16 queries on the two are level, and with many queries the tiled
engine, which reads the bias by position, is faster (docs/BENCHMARKS.md)."""


def dense_bias(inputs: Inputs) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The mask (and the position biases, see :func:`position_bias`) as an additive bias in
    q's dtype ``[Bm, Hm, Tq, Tk]`` (−inf where forbidden), and the rows without an allowed
    key, bool ``[Bm, Hm, Tq, 1]`` (``None`` when every row has one: :meth:`Inputs.has_key`).
    Additive even for a mask without bias values: torch's entry point would convert a bool
    mask on every call, the bias is made once per validation (bit for bit the same scores)."""
    space = inputs.space
    positions = position_bias(inputs)
    if inputs.mask is None:
        return positions.to(inputs.q.dtype), None
    allowed = inputs.allowed()
    values = inputs.mask.dense_bias(space)
    if positions is not None:
        values = positions if values is None else values + positions
    has_key = inputs.has_key()
    return additive_mask(allowed, values, inputs.q.dtype), None if has_key is None else ~has_key


def position_bias(inputs: Inputs) -> Optional[torch.Tensor]:
    """The ALiBi and relative biases of the call, built: ``[1|B, H, Tq, Tk]`` in the
    accumulation dtype (entry ``(i, j)`` read from the vector by relative position at ``j − i
    + Tq − 1``), or ``None`` without them."""
    if inputs.modifiers is None:
        return None
    space = inputs.space
    with torch.no_grad():
        vector = inputs.modifiers.position_bias(space, accum_dtype(inputs.q.dtype))
    if vector is None:
        return None
    device = vector.device
    index = (torch.arange(space.kv_len, device=device)[None, :]
             - torch.arange(space.q_len, device=device)[:, None] + (space.q_len - 1))
    return vector[..., index]  # [1|B, H, Tq, Tk]


def _position_biased(inputs: Inputs) -> bool:
    """Whether the call's scores change by ALiBi and relative biases alone (which this backend
    builds into its bias)."""
    return inputs.modifiers is not None and inputs.modifiers.by_position


def _lse_use(inputs: Inputs) -> str:
    """What asks for the LSE, in reasons: the caller, or sinks (which join through it)."""
    sinks = inputs.modifiers is not None and inputs.modifiers.sinks is not None
    return "return_lse=True or sinks (they join through the LSE)" if sinks else "return_lse=True"


def _stacks_heads(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> bool:
    """Whether a call runs the ``Hq / Hkv`` query heads of each K/V head as the rows of one
    call (:func:`~attnkit.numerics.grouped`): a CPU decoding step (one query) with GQA/MQA,
    without the kernel's own causal mask (which reads the row index). The kernel then reads
    each K/V head once for all of its query heads, where ``enable_gqa`` runs every query head
    on its own: measured never slower and up to several times faster (docs/BENCHMARKS.md)."""
    return (q.device.type == "cpu" and q.shape[2] == 1 and q.shape[1] != k.shape[1]
            and not is_causal)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              additive: Optional[torch.Tensor], is_causal: bool, scale: float, fused: bool,
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq] or None)`` of one call of torch's kernel:
    ``fused``, the CPU flash kernel that also returns the LSE, else the public entry point; a
    decoding step with GQA as one call per K/V head over its query heads
    (:func:`_stacks_heads`; :meth:`attnkit.nn.KVCache.decode` makes its call here too)."""
    q, heads_q = query_rows(q), q.shape[1]  # the kernels' output is made like q
    stacked = _stacks_heads(q, k, is_causal)
    if stacked:  # the query heads of a K/V head as the rows of one call
        q = grouped(q, k.shape[1])
        if additive is not None and additive.shape[1] != 1:  # [Bm, Hq, 1, Tk]
            additive = grouped(additive, k.shape[1])
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, unit_rows(k), unit_rows(v), 0.0, is_causal, attn_mask=additive, scale=scale)
        lse = lse.to(accum_dtype(q.dtype))
    else:
        # (a branch, not the comparison itself: under dynamic shapes that is a SymBool, which
        # the kernel's argument parser refuses)
        gqa = True if q.shape[1] != k.shape[1] else False
        try:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive,
                                                 is_causal=is_causal, scale=scale,
                                                 enable_gqa=gqa)
        except RuntimeError as error:
            _name_the_kernel_context(error, q)
            raise
        lse = None
    if stacked:  # (a copy where the kernel lays its output out as [B, Tq, H, D])
        out = ungrouped(out, heads_q)
        lse = None if lse is None else ungrouped(lse, heads_q)
    return out, lse


def _name_the_kernel_context(error: RuntimeError, q: torch.Tensor) -> None:
    """Raise ``error`` again naming attnkit's route when it came from a
    ``torch.nn.attention.sdpa_kernel`` context that allows none of torch's kernels for the
    call (code written for one device, run on another): the context binds the torch backend
    (and ``auto``'s choice of it), not the others."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends
    allowed = _cur_sdpa_kernel_backends()
    if SDPBackend.MATH in allowed or not str(error).startswith(("No viable backend",
                                                                  "No available kernel")):
        return
    names = ", ".join(sorted(b.name for b in allowed)) or "none"
    raise RuntimeError(
        f"torch's scaled_dot_product_attention has no kernel for this call on "
        f"{q.device.type} under torch.nn.attention.sdpa_kernel allowing {names}, which "
        f"attnkit's torch backend honours: run attnkit with backend='tiled' (or "
        f"attnkit.use_backend('tiled')), or leave the sdpa_kernel context") from error


SEQUENCE_MAX_QUERIES = 16
"""A key padding call runs per sequence (:func:`_sequence_spans`) with at most this many
queries (decoding steps, short chunks), where copying K/V costs as much as the attention."""

SEQUENCE_MIN_ELEMENTS = 1 << 16
"""... and with at least this many K elements per sequence, where the copies cost more than a
kernel call per sequence (docs/BENCHMARKS.md)."""


def _sequence_spans(inputs: Inputs) -> Optional[tuple]:
    """Each sequence's real keys ``(start, stop)`` where the call runs per sequence over
    them alone (:func:`_per_sequence`: no K/V copy, nothing outside them read): a CPU call
    whose mask is a padding of the keys alone (:meth:`~attnkit.masks.Padding.key_spans`),
    without modifiers, of at most :data:`SEQUENCE_MAX_QUERIES` queries and at least
    :data:`SEQUENCE_MIN_ELEMENTS` K elements per sequence, whose keys
    :func:`~attnkit.finite.poison` does not look at; else ``None``. Found once per
    validation (the guard asks, then the forward)."""
    mask, q, k = inputs.mask, inputs.q, inputs.k
    if (not isinstance(mask, Padding) or inputs.modifiers is not None or q.device.type != "cpu"
            or q.shape[2] > SEQUENCE_MAX_QUERIES or math.prod(k.shape[1:]) < SEQUENCE_MIN_ELEMENTS
            or checks_keys(inputs)):
        return None

    def spans():
        found = mask.key_spans(inputs.space)
        if found is None or len(found) != q.shape[0] or all(b <= a for a, b in found):
            return None  # (no key anywhere: the whole call's zeros come from the kernel's graph)
        return found
    return derived(inputs, "sequence spans", spans)


def _per_sequence(inputs: Inputs, spans: tuple) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out, lse)`` of a key padding call as one kernel call per sequence over its real
    keys (views; a sequence without one gets out 0 and LSE −inf)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    fused = inputs.need_lse and _fused_cpu(inputs)
    outs, lses = [], []
    for b, (start, stop) in enumerate(spans):
        if stop > start:
            out, lse = sdpa_call(q[b:b + 1], k[b:b + 1, :, start:stop],
                                 v[b:b + 1, :, start:stop], None, False, inputs.scale, fused)
        else:
            out = q.new_zeros(1, q.shape[1], q.shape[2], v.shape[-1])
            lse = q.new_full((1, q.shape[1], q.shape[2]), float("-inf"),
                             dtype=accum_dtype(q.dtype)) if fused else None
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses) if fused else None


class TorchBackend(Backend):
    NAME = "torch"
    SUPPORTS_DROPOUT = False  # torch's dropout cannot follow attnkit's generator contract
    SUPPORTS_WEIGHTS = False
    SCORE_MODIFIERS = ("alibi", "relative_bias")
    INVARIANT_REFUSAL = ("torch's kernels split queries and keys by the call's shapes: a "
                         "sequence alone and in a padded batch differ in the last bits")
    DESCRIPTION = ("torch's fused SDPA kernel; masks other than causal, ALiBi and relative "
                   "biases are materialised as a bias")

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        lse_use = _lse_use(inputs)
        if inputs.need_lse and not _fused_cpu(inputs):
            reasons.append(f"{lse_use} needs the CPU fused kernel with Dk == Dv "
                           "(not supported by torch)")
        elif inputs.need_lse and "flash" not in _allowed_here(inputs.q.device):
            # (the fused kernel is called past the entry point, which reads the context)
            reasons.append(f"{lse_use} needs torch's CPU flash kernel, which "
                           f"torch.nn.attention.sdpa_kernel does not allow here (not "
                           f"supported by torch)")
        dtype = inputs.q.dtype
        low = accum_dtype(dtype) != dtype  # fp16/bf16: the others add biases in float32
        if low:
            reasons.extend(f"a {values.dtype} bias with {dtype} inputs (not supported by "
                           f"torch: its kernel would round the bias to {dtype}; tiled and "
                           f"reference add it in float32; pass it in {dtype} to run on torch)"
                           for values in inputs.biases if values.dtype != dtype)
        else:  # the kernel takes the bias in q's dtype
            reasons.extend(bias_range_reasons(inputs, dtype, "torch"))
        if low and _position_biased(inputs):
            reasons.append(f"alibi or relative_bias with {dtype} inputs (not supported by torch: "
                           f"its kernel would round their bias to {dtype}; tiled and reference "
                           f"add it in float32)")
        if (inputs.modifiers is not None and torch.is_grad_enabled()
                and any(t.requires_grad for t in inputs.modifiers.position_tensors)):
            reasons.append("alibi or relative_bias tensors that require grad (not supported by "
                           "torch: it takes their bias as a constant; tiled and reference give "
                           "their gradients)")
        if inputs.need_lse and inputs.need_grad:
            # torch's kernel marks its LSE output non-differentiable: returning it would
            # silently drop the LSE's part of the gradient.
            reasons.append(f"{lse_use} with inputs that require grad: torch's kernel gives "
                           "no gradient for the LSE (not supported by torch)")
        return reasons

    def auto_reasons(self, inputs: Inputs) -> list[str]:
        refusal = context_refusal(inputs.q.device)
        if refusal is not None:
            return [refusal]
        mask = inputs.mask
        positions = _position_biased(inputs)
        q_len, kv_len = inputs.q.shape[2], inputs.k.shape[2]
        if (mask is not None and (positions or not is_plain_causal(mask, inputs.scale))
                and q_len * kv_len > DENSE_MAX_SCORES):
            return [f"mask would be materialised as a dense Tq×Tk bias, Tq·Tk = {q_len * kv_len} "
                    f"> {DENSE_MAX_SCORES} (auto prefers tiled, which skips empty tiles: "
                    f"measured faster, see docs/BENCHMARKS.md)"]
        if positions and inputs.q.shape[2] > POSITION_BIAS_QUERIES:
            return [f"alibi or relative_bias over Tq={inputs.q.shape[2]} > "
                    f"{POSITION_BIAS_QUERIES} queries would be materialised as a Tq×Tk bias "
                    f"(auto prefers tiled, which reads it by position: measured faster, see "
                    f"docs/BENCHMARKS.md)"]
        return []

    def reads_padding(self, inputs: Inputs) -> bool:
        return _sequence_spans(inputs) is None

    def evaluates_mask(self, inputs: Inputs) -> bool:  # its dense bias (see forward)
        return (inputs.mask is not None and not is_plain_causal(inputs.mask, inputs.scale)
                and _sequence_spans(inputs) is None)

    def forward(self, inputs: Inputs) -> BackendOutput:
        spans = _sequence_spans(inputs)
        if spans is not None:  # each sequence over its own keys
            return BackendOutput(*_per_sequence(inputs, spans), None)
        q, k, v, mask = inputs.q, inputs.k, inputs.v, inputs.mask
        positions = inputs.modifiers is not None and _position_biased(inputs)
        is_causal = mask is not None and is_plain_causal(mask, inputs.scale) and not positions
        additive = no_key = None
        if (mask is not None and not is_causal) or positions:
            additive, no_key = derived(inputs, "dense_bias", lambda: dense_bias(inputs))
        out, lse = sdpa_call(q, k, v, additive, is_causal, inputs.scale,
                             inputs.need_lse and _fused_cpu(inputs))
        if no_key is not None:  # in place where autograd does not keep the kernel's output
            out = (out.masked_fill(no_key, 0.0) if out.requires_grad
                   else out.masked_fill_(no_key, 0.0))
            if lse is not None:
                lse = lse.masked_fill(no_key[..., 0], float("-inf"))
        return BackendOutput(out, lse, None)
