"""Backend registry and selection: ``backend="auto"`` takes the first backend, in priority
order, whose ``not_supported_reasons`` is empty; an explicit backend that cannot run the
input raises with its reasons. The order is data (``PRIORITY``), never mutated at run time."""

from __future__ import annotations

import torch

from .backends.base import Backend
from .backends.reference import ReferenceBackend
from .backends.tiled import TiledBackend
from .backends.torch_sdpa import TorchBackend
from .backends.triton import TritonBackend
from .inputs import Inputs

BACKENDS: dict[str, Backend] = {b.NAME: b for b in (ReferenceBackend(), TorchBackend(), TiledBackend(),
                                                  TritonBackend())}
"""Every backend by name; a new backend is added here and placed in ``PRIORITY``."""

PRIORITY: tuple[str, ...] = ("triton", "torch", "tiled", "reference")
"""Order tried by ``backend="auto"``: fastest first, the exact reference last (it runs anything)."""

AUTO_RULES = (
    "triton: CUDA, a mask torch's fused kernel can't take (or an LSE), fp16/bf16/fp32, "
    "head dim <= 256, no dropout/weights; never on CPU",
    "torch: no mask or top-left causal (its fused kernel: cuDNN/flash on CUDA, measured faster "
    "than triton there; auto costs only dispatch overhead), no dropout, no weights, no "
    "differentiated LSE",
    "tiled: every other mask (skipping empty tiles beats torch with a dense mask, measured in "
    "docs/BENCHMARKS.md), dropout, weights without autograd; O(T) memory",
    "reference: whatever is left (returned weights with autograd); float64, O(Tq*Tk) memory",
)
"""Human-readable dispatch rules, shown by ``attnkit info``."""


def refuse_double_backward(result, name: str) -> None:
    """Make a double backward (``create_graph=True``) through ``result``'s out/LSE raise a clear
    error naming backend ``name``, instead of torch's message about a private kernel or a
    silently constant second derivative. The hook runs in the backward pass, where grad mode
    is on exactly when the backward itself is being recorded."""
    def hook(grad):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"double backward (create_graph=True) through attention is not supported by "
                f"backend {name!r}: pass backend='tiled' (O(T) memory) or backend='reference' to "
                f"attention() for gradients of gradients")
        return grad

    for t in (result.out, result.lse):
        if t is not None and t.requires_grad:
            t.register_hook(hook)


def names() -> list[str]:
    return ["auto", *BACKENDS]


def select(inputs: Inputs, backend: str) -> Backend:
    """The backend to run ``inputs`` with, or a ValueError listing every reason."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"unknown backend {backend!r}: choose one of {names()}")
    if backend != "auto":
        chosen = BACKENDS[backend]
        reasons = chosen.not_supported_reasons(inputs)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run these inputs:\n  - "
                             + "\n  - ".join(reasons) + f"\nInputs:\n{inputs.describe()}\n"
                             f"Use backend='auto' to pick one that can.")
        return chosen
    all_reasons = {}
    for name in PRIORITY:
        candidate = BACKENDS[name]
        reasons = candidate.not_supported_reasons(inputs) or candidate.auto_reasons(inputs)
        if not reasons:
            return BACKENDS[name]
        all_reasons[name] = reasons
    detail = "\n".join(f"  {name}: " + "; ".join(r) for name, r in all_reasons.items())
    raise ValueError(f"no backend can run these inputs:\n{detail}\nInputs:\n{inputs.describe()}")
