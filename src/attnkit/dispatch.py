"""Backend registry and selection: ``backend="auto"`` takes the first backend, in priority
order, whose ``not_supported_reasons`` is empty; an explicit backend that cannot run the
input raises with its reasons. The order is data (``PRIORITY``), never mutated at run time."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, NamedTuple, Optional

import torch

from . import finite
from .backends.base import Backend, BackendOutput, empty_output
from .backends.reference import ReferenceBackend
from .backends.tiled import TiledBackend
from .backends.torch_sdpa import TorchBackend
from .backends.triton import TritonBackend
from .inputs import Inputs
from .masks import shapes_only
from .threadlocal import setting

BACKENDS: dict[str, Backend] = {b.NAME: b for b in (ReferenceBackend(), TorchBackend(), TiledBackend(),
                                                  TritonBackend())}
"""Every backend by name; a new backend is added here and placed in ``PRIORITY``."""

PRIORITY: tuple[str, ...] = ("triton", "torch", "tiled", "reference")
"""Order tried by ``backend="auto"``: fastest first, the exact reference last (it runs anything)."""

AUTO_RULES = (
    "triton: CUDA, a mask torch's fused kernel can't take (or an LSE), fp16/bf16/fp32, "
    "head dim <= 256, no dropout/weights; never on CPU",
    "torch: no mask or top-left causal (its fused kernel: cuDNN/flash on CUDA, measured faster "
    "than triton there; auto costs only dispatch overhead), or any other mask with Tq*Tk <= "
    "DENSE_MAX_SCORES (made once into a dense bias), no dropout, no weights, no "
    "differentiated LSE",
    "tiled: every larger mask (skipping empty tiles beats torch with a dense mask, measured in "
    "docs/BENCHMARKS.md), dropout, weights without autograd, score modifiers (softcap, alibi, "
    "relative_bias, score_function; sinks run on any backend that returns an LSE); O(T) memory",
    "reference: whatever is left (returned weights with autograd); float64, O(Tq*Tk) memory",
)
"""Human-readable dispatch rules, shown by ``attnkit info``."""


def refuse_double_backward(result, name: str) -> None:
    """Make a double backward (``create_graph=True``) through ``result``'s out/LSE raise a clear
    error naming backend ``name``, instead of torch's message about a private kernel or a
    silently constant second derivative. The hook runs before the node that made each of
    them, in the backward pass, where grad mode is on exactly when the backward itself is
    being recorded."""
    def hook(grad_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"double backward (create_graph=True) through attention is not supported by "
                f"backend {name!r}: pass backend='tiled' (O(T) memory) or backend='reference' "
                f"(to attention(), to MultiHeadAttention(...), or around the call with "
                f"attnkit.use_backend(...)) for gradients of gradients")

    nodes = {t.grad_fn for t in (result.out, result.lse) if t is not None and t.requires_grad}
    for node in nodes:
        if node is not None:
            node.register_prehook(hook)


log = logging.getLogger("attnkit")
"""One debug line per dispatch: ``logging.getLogger("attnkit").setLevel(logging.DEBUG)``."""

_FORCED = threading.local()
"""``_FORCED.name``: the backend :func:`use_backend` set on this thread (absent: none)."""


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every ``attention(..., backend="auto")`` call inside the ``with`` block on backend
    ``name``, as if it had been passed explicitly (an input it cannot run raises with its
    reasons). For a region of someone else's code, e.g. a model's forward::

        with attnkit.use_backend("reference"):
            model(x)

    Thread-local; an explicit ``backend=`` still wins. With ``torch.utils.checkpoint``, run
    the backward inside the block too: its recompute calls ``attention()`` again, and outside
    the block that call would pick another backend (``CheckpointError``)."""
    check_name(name)
    with setting(_FORCED, "name", None if name == "auto" else name):
        yield


class Dispatch(NamedTuple):
    """What ``backend="auto"`` does with an input: ``backend``, the name it picks (``None``
    when none can run it), and ``reasons``: for every backend passed over, why (its
    capabilities, or why auto prefers another), in priority order."""

    backend: Optional[str]
    reasons: dict[str, list[str]]
    forced: bool = False
    """Inside :func:`use_backend`: ``backend`` is the one it names (``None`` with its reasons
    when that one cannot run the input), not auto's pick."""

    def __str__(self) -> str:
        if self.forced:
            name = self.backend or next(iter(self.reasons))
            lines = [f"use_backend({name!r}) runs: "
                     f"{self.backend or 'nothing (it cannot run these inputs)'}"]
        else:
            lines = [f"auto picks: {self.backend or 'nothing (no backend can run these inputs)'}"]
        lines += [f"  {name}: " + "; ".join(why) for name, why in self.reasons.items()]
        return "\n".join(lines)


def explain(inputs: Inputs) -> Dispatch:
    """:class:`Dispatch` for ``inputs``: the backend auto picks and why each one before it
    was passed over (backends after the pick are not asked); inside :func:`use_backend`, the
    backend it names, or why that one cannot run the input. A call that only propagates
    shapes runs on ``reference``, as :func:`select` runs it."""
    if shape_only(inputs):
        return Dispatch("reference", {})
    name = forced("auto")
    if name != "auto":
        why = BACKENDS[name].not_supported_reasons(inputs)
        return Dispatch(None, {name: why}, forced=True) if why else Dispatch(name, {}, True)
    return _pick(inputs)


def _pick(inputs: Inputs) -> Dispatch:
    """:func:`explain` outside :func:`use_backend`: auto's pick."""
    reasons = {}
    for name in PRIORITY:
        candidate = BACKENDS[name]
        why = candidate.not_supported_reasons(inputs) or candidate.auto_reasons(inputs)
        if not why:
            return Dispatch(name, reasons)
        reasons[name] = why
    return Dispatch(None, reasons)


def names() -> list[str]:
    return ["auto", *BACKENDS]


def check_name(name) -> None:
    """Raise ``ValueError`` unless ``name`` is ``"auto"`` or a backend's name."""
    if name not in names():
        raise ValueError(f"unknown backend {name!r}: choose one of {names()}")


def forced(backend: str) -> str:
    """``backend`` with ``"auto"`` replaced by the name :func:`use_backend` set on this thread."""
    return (getattr(_FORCED, "name", None) or "auto") if backend == "auto" else backend


def shape_only(inputs: Inputs) -> bool:
    """Whether the call only propagates shapes: its tensors are on ``meta`` or fake
    (``FakeTensorMode``: meta-device initialisation, dry runs, memory estimators), outside a
    compiled region (which has its own operator, :mod:`attnkit.compiled`)."""
    return not torch.compiler.is_compiling() and any(
        shapes_only(t) for t in (inputs.q, inputs.k, inputs.v))


def select(inputs: Inputs, backend: str) -> Backend:
    """The backend to run ``inputs`` with, or a ValueError listing every reason. Inside
    :func:`use_backend`, ``"auto"`` means the backend it names. A call that only propagates
    shapes (:func:`shape_only`) runs on ``reference``, whose operations all have meta and fake
    implementations; every backend gives the same shapes and dtypes."""
    check_name(backend)
    if shape_only(inputs):
        return BACKENDS["reference"]
    backend = forced(backend)
    if backend != "auto":
        chosen = BACKENDS[backend]
        reasons = chosen.not_supported_reasons(inputs)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run these inputs:\n  - "
                             + "\n  - ".join(reasons) + f"\nInputs:\n{inputs.describe()}\n"
                             f"Use backend='auto' to pick one that can.")
        return chosen
    picked = _pick(inputs)
    if picked.backend is not None:
        return BACKENDS[picked.backend]
    detail = "\n".join(f"  {name}: " + "; ".join(r) for name, r in picked.reasons.items())
    raise ValueError(f"no backend can run these inputs:\n{detail}\nInputs:\n{inputs.describe()}")


def is_empty(inputs: Inputs) -> bool:
    """Whether the call has nothing to compute: B, Tq or Tk is 0 (validation keeps H and the
    head dims at least 1)."""
    return inputs.q.shape[0] == 0 or inputs.q.shape[2] == 0 or inputs.k.shape[2] == 0


def run(chosen: Backend, inputs: Inputs) -> BackendOutput:
    """``chosen.forward(inputs)`` on K/V without garbage outside the real keys
    (:func:`~attnkit.finite.guard`), with the rows that hold or see a non-finite value made
    NaN on CPU (:func:`~attnkit.finite.poison`); for an empty call (:func:`is_empty`) its known
    result instead (:func:`~attnkit.backends.base.empty_output`: zeros, LSE −inf, zero
    gradients), the same on every backend, since kernels, plans and masks have nothing to tile
    there. ``chosen`` has accepted the call (:func:`select`): its refusals hold for empty calls
    as for any other."""
    if is_empty(inputs):
        return empty_output(inputs)
    guarded = finite.guard(inputs, finite.applies(inputs, chosen), chosen.reads_padding(inputs),
                           chosen.evaluates_mask(inputs))
    result = chosen.forward(guarded.inputs)
    if guarded.poisons:
        result = BackendOutput(*finite.poison(guarded, *result))
    return result


def select_with_backward(inputs: Inputs, backend: str) -> Optional[Backend]:
    """The backend to run ``inputs`` with when its gradients will come from
    :meth:`Backend.backward` (a compiled graph's opaque backward): :func:`select`'s pick when it
    has one (``LSE_BACKWARD``); for ``"auto"`` otherwise ``tiled`` when it can run them;
    ``None`` when neither."""
    chosen = select(inputs, backend)
    if chosen.LSE_BACKWARD:
        return chosen
    if forced(backend) == "auto":
        tiled = BACKENDS["tiled"]
        if not tiled.not_supported_reasons(inputs):
            return tiled
    return None
