"""``backend="triton"``: the layered autograd around the kernels.

:func:`forward_step` ``(q, k, v, plan) -> (out, lse)`` and :func:`backward_step` ``(...) ->
(dq, dk, dv)`` allocate and launch (``launch.py``): the public step API, which the backend's
one ``torch.autograd.Function`` and ring attention's steps both call; ``TritonBackend``
states what it supports. Nothing imports triton until a kernel is launched (or until
``unavailable_reason`` is asked), so ``import attnkit`` stays fast.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional

import torch

from ...inputs import Inputs
from ...masks import check_unwritten, tensor_versions
from ...modifiers import relative_positions
from ..base import (Backend, BackendOutput, batched_gradient, bias_range_reasons,
                    check_backward_modifiers)
from . import launch


def forward_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: launch.Plan,
                 mods: launch.ScoreMods = launch.NO_MODS) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass of the kernels over ``plan`` (:func:`launch.make_plan`, or a ring
    step's plan over its rectangle of the mask): ``q [B, H, Tq, Dk]``, ``k [B, Hkv, Tk, Dk]``,
    ``v [B, Hkv, Tk, Dv]`` → ``out [B, H, Tq, Dv]`` (q's dtype) and ``lse [B, H, Tq]``
    (float32, natural log, −inf on fully masked rows), the scores modified by ``mods``."""
    batch, heads, q_len, _ = q.shape
    out = torch.empty(batch, heads, q_len, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    if k.shape[2] == 0:  # no keys at all: every row is fully masked
        return out.zero_(), lse.fill_(float("-inf"))
    launch.forward_call(q, k, v, out, lse, plan, mods).run(plan)
    return out, lse


def backward_step(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  plan: launch.Plan, mods: launch.ScoreMods = launch.NO_MODS,
                  dslope: Optional[torch.Tensor] = None, ddiag: Optional[torch.Tensor] = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq [B, H, Tq, Dk]``, ``dk [B, Hkv, Tk, Dk]``, ``dv [B, Hkv, Tk, Dv]``, recomputed
    from (q, k, v, out, lse). ``dlse [B, H, Tq]`` (or ``None``) is the gradient of the LSE: since
    ∂lse/∂s = p, it enters as ``Δ − dlse`` in ``ds = p ∘ (dp − Δ)``. The gradients of the
    modifiers' ALiBi slopes and relative-bias vector are added into ``dslope`` and ``ddiag``
    (float32 zeros shaped as ``mods.slopes`` and ``mods.diag``; ``None``: not wanted), the
    slopes' in a fixed order under the invariance contract (``plan.invariant``)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    batch, heads, q_len, _ = q.shape
    # [B, H, Tq] each, written for dK/dV by the dQ kernel (or the stats kernel): Δ (− dlse),
    # and the LSE in base 2 (+inf on fully masked rows)
    delta = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if launch.stores_ds(q, plan, mods):  # statistics, dK/dV storing dS, dQ = dS·K
        ds = launch.ds_buffer(q, plan)
        launch.stats_call(out, dout, lse, dlse, lse2, delta, plan).run(plan)
        launch.dkdv_call(q, k, v, dout, lse2, delta, dk, dv, plan, ds).run(plan)
        launch.dq_stored_call(q, k, v, ds, dq, plan).run(plan)
    else:
        slots = launch.slope_slots(q) if plan.invariant and dslope is not None else None
        launch.dq_call(q, k, v, dout, out, lse, dlse, lse2, delta, dq, plan, mods,
                       dslope if slots is None else slots, ddiag).run(plan)
        launch.dkdv_call(q, k, v, dout, lse2, delta, dk, dv, plan, mods=mods).run(plan)
        if slots is not None:
            launch.sum_slots(slots, dslope)
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the modifiers' ALiBi ``slopes [1|B, H]`` and relative-bias
    vector ``diag [H, Tq + Tk − 1]`` (the mask and its bias are constants); ``cap``, ``shift``:
    the rest of :class:`launch.ScoreMods`."""

    @staticmethod
    def forward(ctx, q, k, v, plan, cap=None, shift=0, slopes=None, diag=None, versions=()):
        # an unused lse gives dlse None, not a zero tensor to fill and subtract on every backward
        ctx.set_materialize_grads(False)
        mods = launch.ScoreMods(cap, slopes, shift, diag, q.shape[2] - 1)
        out, lse = forward_step(q, k, v, plan, mods)
        ctx.save_for_backward(q, k, v, out, lse, slopes, diag)
        ctx.plan, ctx.cap, ctx.shift = plan, cap, shift
        ctx.versions = versions  # the mask's tensors, which the backward reads again
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if batched_gradient(dout, dlse):
            raise RuntimeError("a batched backward (is_grads_batched=True, "
                               "jacobian(vectorize=True)) through the triton backend is not "
                               "supported: use backend='tiled' or 'reference', or "
                               "vectorize=False")
        q, k, v, out, lse, slopes, diag = ctx.saved_tensors
        check_unwritten(ctx.versions, "triton")
        if dout is None:  # only the lse was used
            dout = torch.zeros_like(out)
        want_slopes, want_diag = ctx.needs_input_grad[6:8]
        dslope, ddiag = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) if want else None
                         for t, want in ((slopes, want_slopes), (diag, want_diag)))
        mods = launch.ScoreMods(ctx.cap, slopes, ctx.shift, diag, q.shape[2] - 1)
        dq, dk, dv = backward_step(dout, dlse, q, k, v, out, lse, ctx.plan, mods, dslope, ddiag)
        return (dq, dk, dv, None, None, None, None if dslope is None else dslope.to(slopes.dtype),
                None if ddiag is None else ddiag.to(diag.dtype), None)


def score_mods(inputs: Inputs) -> dict:
    """The keyword arguments of :class:`_TritonAttention` for ``inputs.modifiers``: ``cap``,
    ALiBi's ``slopes [1|B, H]`` and ``shift``, and ``diag [H, Tq + Tk − 1]``, the relative
    biases looked up once per distance ``k − q`` (differentiable in their tables)."""
    modifiers = inputs.modifiers
    if modifiers is None or not modifiers.changes_scores:
        return {}
    heads = inputs.q.shape[1]
    found = dict(cap=None if modifiers.softcap is None else modifiers.softcap.cap)
    if modifiers.alibi:
        (alibi,) = modifiers.alibi
        found.update(slopes=alibi.slopes.reshape(-1, heads), shift=alibi.shift(inputs.space))
    if modifiers.relative:
        distance = relative_positions(inputs.space)[None]  # [1, Tq + Tk − 1]
        found["diag"] = sum(part.table[:, part.bucket_ids(distance - part.shift(inputs.space))[0]]
                            for part in modifiers.relative)
    return found


def torch_is_faster(inputs: Inputs) -> bool:
    """True when the torch backend can run ``inputs`` with its own fused kernel (no mask, or
    top-left causal), which measured faster than these kernels there (torch's default SDPA
    pick on an H200, docs/BENCHMARKS.md): ``auto`` leaves those inputs to it, but for a
    decoding step (:func:`launch.decode_form`), which the split-key kernel spreads over the
    whole GPU where SDPA's launches one program per (batch, head)."""
    from ..torch_sdpa import TorchBackend, is_plain_causal

    plain = inputs.mask is None or is_plain_causal(inputs.mask, inputs.scale)
    return (plain and not TorchBackend().not_supported_reasons(inputs)
            and launch.decode_form(inputs) is None)


INSTALLED = importlib.util.find_spec("triton") is not None
"""Whether triton is installed, found without importing it (importing triton takes 0.4–3 s:
that happens at the first launch). A constant, so a compiled graph reads it without tracing
a lookup."""


class TritonBackend(Backend):
    """``options``: how the kernels run (:class:`launch.TritonOptions`)."""

    NAME = "triton"
    INVARIANT_REFUSAL = None  # the contract's lists and fixed configs (launch.key_order_lists)
    DEVICES = ("cpu", "cuda")
    DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    SUPPORTS_DROPOUT = False
    SUPPORTS_WEIGHTS = False
    SUPPORTS_BIAS = True
    LSE_BACKWARD = True
    MAX_HEAD_DIM = 256
    SCORE_MODIFIERS = ("softcap", "alibi", "relative_bias")
    DESCRIPTION = ("fused Triton kernels (online softmax, block-sparse masks, GQA, LSE); "
                   "CPU tensors run through the Triton interpreter (TRITON_INTERPRET=1)")

    def __init__(self, options: launch.TritonOptions = launch.TritonOptions()):
        self.options = options

    def unavailable_reason(self) -> Optional[str]:
        if not INSTALLED:
            return "triton is not installed"
        if not torch.cuda.is_available() and launch.cpu_problem():
            return (f"no CUDA device: triton runs on CUDA GPUs, or {launch.cpu_problem()} "
                    f"(not supported by triton)")
        return None

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        if inputs.modifiers is not None and len(inputs.modifiers.alibi) > 1:
            reasons.append(f"{len(inputs.modifiers.alibi)} alibi modifiers (not supported by "
                           f"triton: its kernels add one; sum their slopes into one alibi)")
        reasons.extend(bias_range_reasons(inputs, torch.float32, "triton"))  # its scores' dtype
        if inputs.scale <= 0:
            reasons.append(f"scale={inputs.scale:g} <= 0 (not supported by triton: its kernels "
                           f"give NaN there)")
        if (inputs.invariant and inputs.modifiers is not None and torch.is_grad_enabled()
                and any(part.table.requires_grad for part in inputs.modifiers.relative)):
            reasons.append("invariant=True with a relative-bias table that requires grad (not "
                           "kept by triton: its gradient is summed by atomics, one per score, "
                           "in whatever order they land; use backend='tiled')")
        if inputs.q.device.type == "cpu" and self.unavailable_reason() is None:  # else said
            problem = launch.cpu_problem()
            if problem:
                reasons.append(f"tensors on CPU: triton runs on CUDA GPUs (move q, k, v to "
                               f"'cuda'), or {problem} (not supported by triton)")
        return reasons

    def auto_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.q.device.type != "cuda":
            return [f"device={inputs.q.device.type}: auto picks triton only for CUDA tensors (on CPU it "
                    f"runs through the slow Triton interpreter; ask for backend='triton')"]
        if torch_is_faster(inputs):
            return ["no mask or top-left causal: torch's own SDPA kernel (cuDNN on an H200) "
                    "measured faster than these kernels (docs/BENCHMARKS.md)"]
        return []

    def forward(self, inputs: Inputs) -> BackendOutput:
        form = launch.decode_form(inputs)
        if form is not None:  # a decoding step: the split-key kernel
            return BackendOutput(*launch.decode(inputs, *form, self.options), None)
        plan = launch.make_plan(inputs, self.options)
        mods = score_mods(inputs)
        versions = tensor_versions(inputs.mask) if inputs.need_grad else ()
        out, lse = _TritonAttention.apply(inputs.q, inputs.k, inputs.v, plan, mods.get("cap"),
                                          mods.get("shift", 0), mods.get("slopes"), mods.get("diag"),
                                          versions)
        return BackendOutput(out, lse, None)

    def backward(self, inputs, out, lse, dout, dlse, want_bias, want_params=()):
        check_backward_modifiers(inputs, self.NAME)
        params = inputs.modifiers.tensors if inputs.modifiers is not None else ()
        wanted = [*want_params, *[False] * (len(params) - len(want_params))]
        with torch.no_grad():
            found = score_mods(inputs)
        # the kernels' gradients of ALiBi's slopes and the relative vector, then the tensors'
        names = [name for name in ("slopes", "diag") if found.get(name) is not None] if any(wanted) else []
        grads = {name: torch.zeros(found[name].shape, dtype=torch.float32, device=inputs.q.device)
                 for name in names}
        mods = launch.ScoreMods(found.get("cap"), found.get("slopes"), found.get("shift", 0),
                                found.get("diag"), inputs.q.shape[2] - 1)
        dq, dk, dv = backward_step(dout, dlse, inputs.q, inputs.k, inputs.v, out, lse,
                               launch.make_plan(inputs, self.options), mods, grads.get("slopes"),
                               grads.get("diag"))
        dparams = [None] * len(params)
        if names:
            dparams = inputs.modifiers.pull_back(
                lambda m: [score_mods(dataclasses.replace(inputs, modifiers=m))[name] for name in names],
                [grads[name] for name in names], wanted)
        return dq, dk, dv, [None] * len(inputs.biases), dparams
