"""The invariance contract: ``with attnkit.invariant():`` (or ``attention(...,
invariant=True)``) makes a query row's result a function of that row's own inputs alone.

Under it, for every backend that accepts it (``tiled`` and ``triton``; the others refuse with
their reason and ``auto`` passes them over), bit for bit (docs/NUMERICS.md, "Invariance"):

1. run to run: the same inputs give the same outputs, LSE and gradients;
2. batch invariance: a sequence's output rows and LSE do not depend on the other sequences
   of the batch, the batch size, the sequence's place in it, or the padding around it
   (right or left; a packed ``varlen_attention`` batch runs each sequence as its own call);
3. chunking invariance: a query row computed in a full prefill, in any chunk of a chunked
   prefill, or as a decoding step over a cache gives the same bits.

4. ring attention is deterministic run to run (not promised equal to one device's result).

How: the tiled engine's fixed schedule (``TiledOptions.fixed_blocks``): on torch's fused
kernel each sequence's keys go through the kernel in whole splits of 512 from its own first
key (a left-padded sequence's from its first real key), which the kernel merges in key order;
on the matmul path they are reduced in blocks of ``FIXED_BLOCK_K`` merged in key order; every
kernel call has a multiple of ``row_quantum`` query rows, never a path chosen from the call's
shapes. Keys a row may not attend change nothing, so the rows around it and the keys it cannot
see leave its bits alone. The triton kernels keep it the same way
(``launch.key_order_lists``): one online softmax over key blocks in key order from each
sequence's first key, the mask program in every tile, fixed kernel configs, and no split-key
decoding (a step runs the forward kernel, as a prefill's row does). Below: the checks of
``attnkit check --invariance`` and :func:`rowwise_linears`, for a model's own layers.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator, NamedTuple, Optional, Sequence

import torch

from .threadlocal import setting

_MODE = threading.local()
"""``_MODE.on``: whether :func:`invariant` is active on this thread (absent: no)."""


@contextlib.contextmanager
def invariant(enabled: bool = True) -> Iterator[None]:
    """Run every ``attention()`` call in the ``with`` block under the invariance contract
    (see this module): ``backend="auto"`` picks a backend that keeps it, an explicit backend
    that cannot raises with its reason. Thread-local, like :func:`attnkit.use_backend`; an
    explicit ``attention(..., invariant=False)`` still wins. For a model's forward or a
    ``generate`` loop::

        with attnkit.invariant():
            model.generate(**batch)

    With ``torch.utils.checkpoint``, run the backward inside the block too: its recompute
    calls ``attention()`` again, which outside the block runs without the contract
    (``CheckpointError``).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"invariant(enabled={enabled!r}): pass True or False")
    with setting(_MODE, "on", enabled, False):
        yield


@contextlib.contextmanager
def rowwise_linears(model: "torch.nn.Module"):
    """Inside the ``with`` block, every ``torch.nn.Linear`` of ``model`` (and every
    transformers ``Conv1D``, GPT-2's projections: a linear layer with its weight transposed)
    computes its rows in products of a fixed number of rows (:func:`attnkit.nn._rowwise`),
    so that each row's result does not depend on how many rows the call has. The contract
    covers attention; a model's own linear layers are torch's, whose CPU BLAS computes one or
    two rows on another path, and wide layers blocked or threaded by the row count, so its
    logits alone and in a batch differ in their last bits unless they are row-wise too
    (slower: many small products). ``MultiHeadAttention`` does this for its own projections
    under the contract.
    For a model whose attention runs on attnkit::

        with attnkit.invariant(), attnkit.invariance.rowwise_linears(model):
            model.generate(**batch)     # the same tokens and logits alone and in any batch

    Per thread, as :func:`invariant` is: a model shared by several threads computes row-wise
    only in the threads inside a block (blocks may nest and overlap across threads).
    """
    from torch import nn

    layers = [m for m in model.modules() if isinstance(m, nn.Linear) or _conv1d(m)]
    with _held_rowwise(layers):
        yield model


@contextlib.contextmanager
def _held_rowwise(layers: Sequence["torch.nn.Module"]):
    """Inside the ``with`` block, on this thread, each module of ``layers`` computes its rows
    in products of a fixed number of rows (:func:`attnkit.nn._rowwise`): the forward of
    :func:`rowwise_linears`, for any module taking one tensor ``[..., in]``. The module is
    called as usual, so its forward hooks and pre-hooks see the whole input; its product
    runs per chunk of rows: from the weight for a plain ``nn.Linear`` or ``Conv1D``, else
    a forward set on the instance (a hook's, such as accelerate's) or the class's own
    forward (a subclass's, a wrapper's) on each chunk."""
    here = _ROWWISE_HERE.__dict__.setdefault("layers", {})  # this thread's blocks per layer
    with _ROWWISE_LOCK:
        for layer in layers:
            users = _ROWWISE_USERS.get(id(layer), 0)
            if not users:  # a forward set on the instance (a hook's) runs per chunk, and stays
                _ROWWISE_SAVED[id(layer)] = _instance_forward(layer)
                layer.forward = functools.partial(_linear_forward, layer)
            _ROWWISE_USERS[id(layer)] = users + 1
    for layer in layers:
        here[id(layer)] = here.get(id(layer), 0) + 1
    try:
        yield
    finally:
        for layer in layers:
            here[id(layer)] -= 1
            if not here[id(layer)]:
                del here[id(layer)]
        with _ROWWISE_LOCK:
            for layer in layers:
                users = _ROWWISE_USERS.pop(id(layer)) - 1
                if users:
                    _ROWWISE_USERS[id(layer)] = users
                else:
                    saved = _ROWWISE_SAVED.pop(id(layer), None)
                    if _ours(layer.__dict__.get("forward")):  # (not one set inside the block)
                        if saved is None:
                            del layer.forward
                        else:
                            layer.forward = saved


_ROWWISE_LOCK = threading.Lock()
_ROWWISE_USERS: dict = {}
"""``id(layer)`` → the :func:`_held_rowwise` blocks, on any thread, that hold the layer (its
patched ``forward`` goes when the last one ends)."""
_ROWWISE_SAVED: dict = {}
"""``id(layer)`` → the forward set on the layer instance before the first block (``None``)."""
_ROWWISE_HERE = threading.local()
"""``_ROWWISE_HERE.layers``: ``id(layer)`` → this thread's blocks that hold the layer."""


def _ours(forward) -> bool:
    """Whether ``forward`` is the one :func:`_held_rowwise` sets."""
    return isinstance(forward, functools.partial) and forward.func is _linear_forward


def _instance_forward(layer: "torch.nn.Module"):
    """The forward set on ``layer`` itself, or ``None``: also where it is one
    :func:`_held_rowwise` set (a copy made inside a block carries it)."""
    forward = layer.__dict__.get("forward")
    if _ours(forward):
        del layer.forward
        return None
    return forward


def _linear_forward(layer: "torch.nn.Module", input: torch.Tensor) -> torch.Tensor:
    """A layer's forward while a :func:`_held_rowwise` block holds it: row-wise on a thread
    inside such a block, the layer's own forward on any other (a forward set on the
    instance, such as a hook's, first)."""
    from .nn import _rowwise

    saved = _ROWWISE_SAVED.get(id(layer))
    if getattr(_ROWWISE_HERE, "layers", {}).get(id(layer)):
        own = type(layer).forward  # a subclass's own forward (an adapter) runs per chunk
        plain = saved is None and (own is torch.nn.Linear.forward or _conv1d(layer))
        return _rowwise(layer, input, None if plain
                        else saved if saved is not None else functools.partial(own, layer))
    return saved(input) if saved is not None else type(layer).forward(layer, input)


def _conv1d(module: "torch.nn.Module") -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``x @ weight + bias``, weight ``[in,
    out]``), recognised without importing transformers."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def active(explicit: Optional[bool] = None) -> bool:
    """Whether a call runs under the contract: ``explicit`` when given (``attention(...,
    invariant=...)``), else the :func:`invariant` mode of this thread."""
    if explicit is None:
        return bool(getattr(_MODE, "on", False))
    if not isinstance(explicit, bool):
        raise TypeError(f"invariant={explicit!r}: pass True, False or None (None follows "
                        f"attnkit.invariant())")
    return explicit


# ---- the checks behind ``attnkit check --invariance`` and tests/test_invariance.py ---------

CHECKS = ("run to run", "batch", "chunking", "ring")
"""The contract's points, in the order ``attnkit check --invariance`` reports them (ring: run
to run over two gloo ranks)."""


class Finding(NamedTuple):
    """One check on one backend: ``status`` is ``"holds"``, ``"refused"`` (``detail``: the
    backend's reason) or ``"BROKEN"`` (``detail``: the first differing element)."""

    check: str
    backend: str
    status: str
    detail: str = ""


def first_difference(name: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """``None`` when ``got`` and ``want`` hold the same bits (NaN where the other has NaN),
    else where they first differ: ``"out[0, 1, 7, 3]: 0.1234567 vs 0.1234566"``."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in (~same).nonzero()[0])
    return f"{name}{list(index)}: {got[index].item()!r} vs {want[index].item()!r}"


def _differences(pairs) -> Optional[str]:
    for name, got, want in pairs:
        found = first_difference(name, got, want)
        if found is not None:
            return found
    return None


LENGTH = 600
"""The checks' sequence length: several of tiled's 256-key blocks."""


def _case(seed: int, device, dtype, heads_q: int = 4, heads_kv: int = 2, length: int = LENGTH,
          dim: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, length, dim, generator=gen).to(device, dtype)
               for h in (heads_q, heads_kv, heads_kv))
    return q, k, v


def _masks(heads: int, device) -> list:
    """The masks every check runs: causal (torch's fused kernel per tile) and causal with a
    softcap and ALiBi (the matmul path), both aligned bottom-right so that a chunk of queries
    keeps its positions."""
    from .masks import causal
    from .modifiers import alibi, softcap
    slopes = torch.linspace(0.05, 0.5, heads, device=device)
    return [causal("bottom_right"),
            causal("bottom_right") & softcap(20.0) & alibi(slopes, align="bottom_right")]


def _call(q, k, v, mask, backend: str):
    from .api import attention
    return attention(q, k, v, mask, backend=backend, return_lse=True, invariant=True)


def check_run_to_run(backend: str, device="cpu", dtype=torch.float32, seed: int = 0,
                     length: int = LENGTH) -> Optional[str]:
    """The same call twice, forward and (float32/float64) backward, on a sequence of
    ``length``: ``None`` when every output, LSE and gradient holds the same bits, else the
    first difference."""
    grads = dtype in (torch.float32, torch.float64)
    q, k, v = _case(seed, device, dtype, length=length)
    for mask in _masks(q.shape[1], device):
        runs = []
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
            result = _call(*leaves, mask, backend)
            tensors = [result.out.detach(), result.lse.detach()]
            if grads:
                (result.out.square().sum() + result.lse.sum()).backward()
                tensors += [t.grad for t in leaves]
            runs.append(tensors)
        found = _differences(zip(("out", "lse", "dq", "dk", "dv"), *runs))
        if found is not None:
            return f"{mask!r}: {found}"
    return None


def check_batch(backend: str, device="cpu", dtype=torch.float32, seed: int = 0,
                length: int = LENGTH) -> Optional[str]:
    """A sequence of ``length`` alone, then second of three in a right-padded and in a
    left-padded batch (other sequences of other lengths, NaN in its padding): ``None`` when
    its rows hold the same bits each time."""
    from .masks import padding
    q, k, v = _case(seed, device, dtype, length=length)
    length, width = q.shape[2], q.shape[2] + 77
    gen = torch.Generator().manual_seed(seed + 1)
    for mask in _masks(q.shape[1], device):
        alone = _call(q, k, v, mask, backend)
        for side in ("right", "left"):
            pad = 0 if side == "right" else width - length
            batch = [torch.randn(3, t.shape[1], width, t.shape[3], generator=gen).to(device, dtype)
                     for t in (q, k, v)]
            for big, small in zip(batch, (q, k, v)):
                big[1, :, :] = float("nan")
                big[1, :, pad:pad + length] = small[0]
            lengths = torch.tensor([width, length, width - 40], device=device)
            starts = torch.tensor([0, pad, 40 if side == "left" else 0], device=device)
            runs = padding(lengths, lengths, starts, starts)
            within = _call(*batch, mask & runs, backend)
            found = _differences([
                ("out", within.out[1:2, :, pad:pad + length], alone.out),
                ("lse", within.lse[1:2, :, pad:pad + length], alone.lse)])
            if found is not None:
                return f"{side}-padded, {mask!r}: {found}"
    return None


def check_chunking(backend: str, device="cpu", dtype=torch.float32, seed: int = 0,
                   length: int = LENGTH) -> Optional[str]:
    """One prefill of a sequence of ``length``, then the same queries in chunks over the keys
    up to each chunk's end (the last rows one by one: decoding steps): ``None`` when every row
    holds the same bits."""
    q, k, v = _case(seed, device, dtype, length=length)
    cuts = sorted({0, 1, length // 6, length // 2, 7 * length // 8,
                   *range(max(0, length - 3), length + 1)})
    for mask in _masks(q.shape[1], device):
        whole = _call(q, k, v, mask, backend)
        for start, stop in zip(cuts, cuts[1:]):
            part = _call(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], mask, backend)
            found = _differences([("out", part.out, whole.out[:, :, start:stop]),
                                  ("lse", part.lse, whole.lse[:, :, start:stop])])
            if found is not None:
                return f"rows {start}:{stop}, {mask!r}: {found}"
    return None


def _ring_twice(rank: int, world_size: int, backend: str, dtype_name: str, seed: int,
                length: int):
    from .distributed import ring_attention, shard
    dtype = getattr(torch, dtype_name)
    q, k, v = _case(seed, "cpu", dtype, length=length)
    results = []
    for _ in range(2):
        leaves = [shard(t, rank, world_size).detach().clone().requires_grad_() for t in (q, k, v)]
        result = ring_attention(*leaves, _masks(q.shape[1], "cpu")[1], backend=backend,
                                return_lse=True)
        (result.out.square().sum() + result.lse.sum()).backward()
        results.append([result.out.detach(), result.lse.detach(), *(t.grad for t in leaves)])
    return _differences(zip(("out", "lse", "dq", "dk", "dv"), *results))


def check_ring(backend: str, device="cpu", dtype=torch.float32, seed: int = 0,
               length: int = 256) -> Optional[str]:
    """Ring attention over two local gloo ranks, forward and backward, twice, on a sequence
    of ``length``: ``None`` when every rank's out, LSE and gradients hold the same bits both
    times. CPU float32/float64 only (``ValueError`` otherwise)."""
    from .distributed import spawn
    if backend != "tiled":
        raise ValueError(f"the ring check runs its steps on tiled over gloo (its triton steps "
                         f"need CUDA and NCCL), not on {backend}")
    if str(device) != "cpu" or dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the ring check runs on CPU in float32/float64 (gloo), not {device} "
                         f"{dtype}")
    found = spawn(_ring_twice, 2, backend, str(dtype).removeprefix("torch."), seed, length)
    broken = [f"rank {rank}: {what}" for rank, what in enumerate(found) if what is not None]
    return "; ".join(broken) or None


_CHECKS = {"run to run": check_run_to_run, "batch": check_batch, "chunking": check_chunking,
           "ring": check_ring}


def check(backends: Sequence[str], device="cpu", dtype=torch.float32, seed: int = 0,
          checks: Sequence[str] = CHECKS, length: Optional[int] = None) -> list[Finding]:
    """Every check of ``checks`` on every backend of ``backends`` (names from
    ``attnkit.available_backends()``), on sequences of ``length`` (``None``: each check's
    own): a :class:`Finding` each. A backend that refuses the
    contract (a ``ValueError`` naming ``invariant``), or a ring over a backend it does not
    run on, is ``"refused"`` with its reason."""
    findings = []
    for name in checks:
        for backend in backends:
            try:
                sized = {} if length is None else {"length": length}
                broken = _CHECKS[name](backend, device, dtype, seed, **sized)
            except ValueError as error:
                reason = _refusal(str(error))
                if reason is None:
                    raise
                findings.append(Finding(name, backend, "refused", reason))
                continue
            findings.append(Finding(name, backend, "BROKEN" if broken else "holds",
                                    broken or ""))
    return findings


def _refusal(message: str) -> Optional[str]:
    """The refusal reason in a backend's ValueError (the line naming ``invariant`` or the
    ring's backends), or ``None`` for any other error."""
    for line in message.splitlines():
        line = line.strip(" -")
        if line.startswith("invariant=True (not kept by "):
            return line.split(": ", 1)[1].removesuffix(")")
        if "ring" in line or "gloo" in line:
            return line
    return None
