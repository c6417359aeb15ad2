"""Shared helpers for the core tests.

Everything here is written from scratch and never calls attnkit's own computation, so the
tests compare attnkit against an *independent* definition:

- :func:`naive_attention`: float64 attention as the math reads (matmul, scale, bias, −inf
  where masked, softmax, fully masked rows set to 0, LSE by ``logsumexp``); GQA by
  ``repeat_interleave`` of K/V over the query heads.
- :func:`plain_attention`: the same computation done in a low-precision dtype, the yardstick of
  the "≤ 2× plain PyTorch math error" rule (flash-attn's test rule).
- hand-written dense constructions of every structured mask, with Python loops, so a
  vectorised bug in ``attnkit.masks`` cannot hide in an identical vectorised expectation.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Optional

import pytest
import torch
from hypothesis import settings

import attnkit as ak
from attnkit import dispatch

# Hypothesis draws the same examples in every run ("ci", derived from each test), so a CI run
# on a fresh machine tests what the last local run tested; ATTNKIT_HYPOTHESIS=explore draws new
# ones each run, to look for failures (pin one that turns up with @example).
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("ATTNKIT_HYPOTHESIS", "ci"))

# Test tensors are tiny: intra-op threads only add synchronisation cost, which is large on the
# shared 2-core machines we test on (3x slower per test measured). Results do not depend on it.
torch.set_num_threads(1)

LOW_PRECISION = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def import_triton_interpreted() -> None:
    """Import triton in interpreter mode (``TRITON_INTERPRET=1`` while ``triton.language`` is
    first imported decorates its library so kernels run on CPU tensors), unless triton is
    missing, already imported, or a CUDA device runs it compiled; its ``tl.dot`` then computes
    each row alike wherever it sits (:func:`rowwise_interpreter_dots`). Test modules that
    launch kernels call this before importing attnkit's triton backend."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return
    if "triton" in sys.modules:
        rowwise_interpreter_dots()
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401  (decorates triton's library in interpreter mode)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    rowwise_interpreter_dots()


def _blas_rows_alike() -> bool:
    """Whether numpy's matmul computes a row of a product alike wherever the row sits in its
    operand and however many rows it has (OpenBLAS's Haswell/Zen float32 kernel does not: a
    row's last bits follow its position)."""
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 64), dtype=np.float32)
    b = rng.standard_normal((64, 32), dtype=np.float32)
    whole = a @ b
    return np.array_equal(a[:16] @ b, whole[:16]) and all(
        np.array_equal(np.roll(a, shift, 0) @ b, np.roll(whole, shift, 0)) for shift in (1, 3))


def rowwise_interpreter_dots() -> None:
    """Make the Triton interpreter's ``tl.dot`` compute each output element from its own row
    and column alone, where numpy's BLAS does not on this CPU (:func:`_blas_rows_alike`).

    The interpreter runs ``tl.dot`` as ``numpy.matmul``; the invariance tests check that a
    sequence's rows get the same bits wherever its padding or chunking puts them in a query
    block, as the GPU's matrix units give them. A BLAS whose rows round by position would fail
    them on CPU for a reason no GPU has, so there the products run through ``numpy.einsum``
    (numpy's own loops, one fixed order per element) on contiguous operands."""
    if importlib.util.find_spec("triton") is None:
        return
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_rowwise_dots", False) or _blas_rows_alike():
        return
    import numpy as np
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...ij,...jk->...ik", np.ascontiguousarray(a.data),
                            np.ascontiguousarray(b.data), dtype=d.data.dtype, optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    builder._rowwise_dots = True


def interpreted_triton_launch():
    """attnkit's triton ``launch`` module when this process runs kernels through the
    interpreter (a version that can run them); skips the test otherwise."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from attnkit.backends.triton import launch
    if not launch.interpreting():
        pytest.skip("triton runs compiled in this process: these are interpreter tests on CPU")
    rowwise_interpreter_dots()
    import triton
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"the Triton interpreter before 3.9 cannot run these kernels ({triton.__version__})")
    return launch


# ---- the independent attention ---------------------------------------------------------------

def _attention_math(q, k, v, allowed, bias, scale, dtype):
    """softmax(q kᵀ·scale + bias, masked) v computed entirely in ``dtype``.

    q ``[..., Hq, Tq, Dk]`` (or ``[Tq, Dk]`` / ``[B, Tq, Dk]``), k ``[..., Hkv, Tk, Dk]``,
    v ``[..., Hkv, Tk, Dv]``; ``allowed`` bool and ``bias`` float broadcastable to the scores
    ``[..., Hq, Tq, Tk]``. Returns ``(out [..., Hq, Tq, Dv], lse [..., Hq, Tq], weights
    [..., Hq, Tq, Tk])`` in ``dtype``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dim() >= 4 and q.shape[-3] != k.shape[-3]:  # GQA / MQA: copy each K/V head per group
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)  # [..., Hq, Tk, Dk]
        v = v.repeat_interleave(group, dim=-3)  # [..., Hq, Tk, Dv]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., Hq, Tq, Tk]
    if bias is not None:
        scores = scores + bias.to(dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [..., Hq, Tq, 1]
    weights = torch.softmax(scores, dim=-1)  # NaN on fully masked rows …
    weights = weights.masked_fill(row_empty, 0.0)  # … which are defined as 0
    lse = torch.logsumexp(scores, dim=-1)  # −inf on fully masked rows
    out = torch.matmul(weights, v)  # [..., Hq, Tq, Dv]
    return out, lse, weights


def naive_attention(q, k, v, allowed=None, bias=None, scale=None):
    """The float64 truth: ``(out, lse, weights)`` in float64 (see :func:`_attention_math`)."""
    return _attention_math(q, k, v, allowed, bias, scale, torch.float64)


def plain_attention(q, k, v, allowed=None, bias=None, scale=None, dtype=None):
    """Plain PyTorch math in ``dtype`` (default: q's dtype), the yardstick of the 2× rule."""
    return _attention_math(q, k, v, allowed, bias, scale, dtype or q.dtype)


def max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest absolute difference, treating equal infinities as exact and any mismatch of
    infinities or NaN as an infinite error."""
    actual, truth = actual.detach().to(torch.float64), truth.detach().to(torch.float64)
    same_inf = torch.isinf(actual) & torch.isinf(truth) & (torch.sign(actual) == torch.sign(truth))
    diff = (actual - truth).abs()
    diff = torch.where(same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    return float(diff.max()) if diff.numel() else 0.0


def error_floor(dtype: torch.dtype, truth: torch.Tensor) -> float:
    """Absolute slack added to the 2× rule, for when plain math is exact by luck.

    Plain math may hit the float64 truth almost exactly on tiny inputs (its error is then ~0
    and "2× of 0" would demand bit-exactness). The unavoidable error of *any* implementation is
    rounding the exact result to the output dtype: ½ ulp of the largest entry. We allow one ulp
    (``eps · max|truth|``) for fp16/bf16 — for fp16 that is ≈ 1e-3·max — and 8 ulps for fp32
    (≈ 1e-6 for outputs of size ~1), because fp32 kernels sum in a different order than the
    plain matmul (blocked flash accumulation), which costs a few ulps, not more.
    """
    if dtype == torch.float64:
        return 1e-12 * max(1.0, _finite_max(truth))
    ulps = 8 if dtype == torch.float32 else 1
    return ulps * torch.finfo(dtype).eps * max(1.0, _finite_max(truth))


def _finite_max(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.detach().abs().max()) if finite.numel() else 0.0


def assert_within_2x(name: str, actual: torch.Tensor, truth: torch.Tensor, plain: torch.Tensor,
                     dtype: torch.dtype, floor: float = 0.0) -> None:
    """The golden rule: error(actual) ≤ 2·error(plain math in ``dtype``) + floor (float64 truth).
    ``floor``: a larger floor where the caller knows the computation's own rounding scale."""
    assert actual.shape == truth.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    err, plain_err = max_error(actual, truth), max_error(plain, truth)
    floor = max(floor, error_floor(dtype, truth))
    bound = 2 * plain_err + floor
    assert err <= bound, (f"{name} ({dtype}): error {err:.3g} > 2 × plain-math error "
                          f"{plain_err:.3g} + floor {floor:.3g}")


def delta_form_floors(q, k, v, dout, allowed, bias, scale,
                      eps: float = torch.finfo(torch.float32).eps) -> dict:
    """Error floors for dq and dk from the backward's own form, ``ds = p ∘ (dp − Δ)`` with
    ``Δ = rowsum(dO ∘ O)`` and ``p`` recomputed from the LSE, evaluated in the backward's
    accumulation dtype (machine epsilon ``eps``; float32 for the kernels, whatever the input
    dtype): each score's ``dp − Δ`` carries rounding of the size of ``|dp| + |Δ|``,
    which autograd's softmax backward may cancel exactly (a row that sees a single key has
    ``p = 1`` and no gradient through the scores; plain math then gets exactly 0, and the 2x rule
    would demand bit-exact zeros). Four ulps of that per score, carried by ``|k|`` into
    dq and ``|q|`` into dk (over a GQA group too) and added in quadrature (independent
    roundings: a typical scale, not a worst case). In float64."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    out, _, weights = naive_attention(q, k, v, allowed, bias, scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    dp = dout @ v.transpose(-1, -2)  # [B, H, Tq, Tk]
    delta = (dout * out).sum(-1, keepdim=True)  # [B, H, Tq, 1]
    term = (weights * (dp.abs() + delta.abs()) * scale) ** 2
    dq = (term @ k ** 2).sqrt()  # [B, H, Tq, Dk]
    dk = (term.transpose(-1, -2) @ q ** 2).unflatten(1, (-1, group)).sum(2).sqrt()  # [B, Hkv, Tk, Dk]
    ulps = 4 * eps
    return {"dq": ulps * float(dq.max()) if dq.numel() else 0.0,
            "dk": ulps * float(dk.max()) if dk.numel() else 0.0}


# ---- hand-written dense masks (loops, on purpose) ----------------------------------------------

def dense_band(tq: int, tk: int, left: Optional[int], right: Optional[int],
               align: str = "top_left") -> torch.Tensor:
    """``[tq, tk]``: key j allowed for query i when ``i+s-left ≤ j ≤ i+s+right``,
    ``s = tk - tq`` for bottom_right alignment, 0 for top_left; ``None`` = unbounded."""
    shift = tk - tq if align == "bottom_right" else 0
    out = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        for j in range(tk):
            ok = True
            if right is not None and j > i + shift + right:
                ok = False
            if left is not None and j < i + shift - left:
                ok = False
            out[i, j] = ok
    return out


def dense_causal(tq: int, tk: int, align: str = "top_left") -> torch.Tensor:
    return dense_band(tq, tk, None, 0, align)


def dense_padding(tq: int, tk: int, q_lengths=None, kv_lengths=None, batch: int = 1) -> torch.Tensor:
    """``[B, 1, tq, tk]``: query i / key j of batch b real when ``i < q_lengths[b]`` / ``j < kv_lengths[b]``."""
    out = torch.zeros(batch, 1, tq, tk, dtype=torch.bool)
    for b in range(batch):
        q_len = tq if q_lengths is None else int(q_lengths[b if len(q_lengths) > 1 else 0])
        kv_len = tk if kv_lengths is None else int(kv_lengths[b if len(kv_lengths) > 1 else 0])
        for i in range(tq):
            for j in range(tk):
                out[b, 0, i, j] = i < q_len and j < kv_len
    return out


def dense_documents(q_ids, kv_ids=None) -> torch.Tensor:
    """``[B, 1, tq, tk]`` (B = 1 for 1-D ids): same document id."""
    q_ids = torch.as_tensor(q_ids)
    kv_ids = q_ids if kv_ids is None else torch.as_tensor(kv_ids)
    q2 = q_ids if q_ids.dim() == 2 else q_ids[None]
    k2 = kv_ids if kv_ids.dim() == 2 else kv_ids[None]
    batch = max(q2.shape[0], k2.shape[0])
    out = torch.zeros(batch, 1, q2.shape[1], k2.shape[1], dtype=torch.bool)
    for b in range(batch):
        qb, kb = q2[min(b, q2.shape[0] - 1)], k2[min(b, k2.shape[0] - 1)]
        for i in range(q2.shape[1]):
            for j in range(k2.shape[1]):
                out[b, 0, i, j] = bool(qb[i] == kb[j])
    return out


def sorted_ids(length: int, n_docs: int, gen: torch.Generator, batch: Optional[int] = None):
    """Sorted document ids (packed sequences): ``[length]`` or ``[batch, length]`` int64."""
    rows = []
    for _ in range(batch or 1):
        ids = torch.randint(0, n_docs, (length,), generator=gen).sort().values
        rows.append(ids)
    return torch.stack(rows) if batch else rows[0]


# ---- mask cases for attention tests ------------------------------------------------------------

def mask_case(kind: str, batch_shape: tuple, rank: int, tq: int, tk: int, gen: torch.Generator):
    """A mask argument for ``attention`` and its expected dense form in the caller's layout.

    Returns ``(mask, allowed, bias)``: ``mask`` is what to pass as ``mask=`` (a Mask object or a
    raw tensor); ``allowed`` (bool or None) and ``bias`` (float or None) broadcast to the scores
    in the caller's layout (``[Tq, Tk]`` for 2-D inputs, ``[B, Tq, Tk]`` for 3-D, and
    ``[..., H, Tq, Tk]`` for 4-D and up).
    """
    batch = math.prod(batch_shape) if batch_shape else 1

    def caller(per_batch: torch.Tensor) -> torch.Tensor:
        """``[B_flat, 1, tq, tk]`` (or ``[1, 1, …]``) → the caller's broadcastable layout."""
        if per_batch.shape[0] == 1:
            return per_batch[0, 0]  # [tq, tk] broadcasts everywhere
        if rank == 3:
            return per_batch[:, 0]  # [B, tq, tk]
        return per_batch.reshape(*batch_shape, 1, tq, tk)

    if kind == "none":
        return None, None, None
    if kind == "causal":
        return ak.causal(), dense_causal(tq, tk), None
    if kind == "causal_bottom_right":
        return ak.causal("bottom_right"), dense_causal(tq, tk, "bottom_right"), None
    if kind == "window":
        return ak.sliding_window(2, 1), dense_band(tq, tk, 2, 1), None
    if kind == "padding":
        # Lengths include 0 (a fully masked batch element) when there is more than one element.
        q_lengths = [int(x) for x in torch.randint(1, tq + 1, (batch,), generator=gen)]
        kv_lengths = [int(x) for x in torch.randint(0, tk + 1, (batch,), generator=gen)]
        if batch > 1:
            kv_lengths[0] = 0
            q_lengths[-1] = tq
            kv_lengths[-1] = tk
        else:
            kv_lengths = [max(1, kv_lengths[0])]
        mask = ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths)
        return mask, caller(dense_padding(tq, tk, q_lengths, kv_lengths, batch)), None
    if kind == "documents":
        if tq != tk:  # cross attention: separate id sequences for queries and keys
            q_ids, kv_ids = sorted_ids(tq, 3, gen), sorted_ids(tk, 3, gen)
            return ak.documents(q_ids, kv_ids), dense_documents(q_ids, kv_ids)[0, 0], None
        ids = sorted_ids(tq, 3, gen)
        return ak.documents(ids), dense_documents(ids)[0, 0], None
    if kind == "causal&padding":
        kv_lengths = [int(x) for x in torch.randint(1, tk + 1, (batch,), generator=gen)]
        mask = ak.causal() & ak.padding(kv_lengths=kv_lengths)
        allowed = dense_causal(tq, tk) & dense_padding(tq, tk, None, kv_lengths, batch)
        return mask, caller(allowed), None
    if kind == "documents|window":
        ids = sorted_ids(tq, 2, gen)
        kv_ids = ids if tq == tk else sorted_ids(tk, 2, gen)
        mask = ak.documents(ids, kv_ids) | ak.sliding_window(1)
        return mask, dense_documents(ids, kv_ids)[0, 0] | dense_band(tq, tk, 1, 0), None
    if kind == "~causal":
        return ~ak.causal(), ~dense_causal(tq, tk), None
    if kind == "from_function":
        def even_distance(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx) % 2 == 0
        allowed = torch.tensor([[(i - j) % 2 == 0 for j in range(tk)] for i in range(tq)])
        return ak.from_function(even_distance), allowed, None
    if kind == "bool_tensor":  # a raw [Tq, Tk] bool tensor as mask=
        allowed = torch.rand(tq, tk, generator=gen) < 0.7
        return allowed, allowed, None
    if kind == "dense":
        allowed = torch.rand(tq, tk, generator=gen) < 0.7
        return ak.dense(allowed), allowed, None
    if kind == "float_tensor":  # a raw float tensor as mask= is a bias; −inf entries are masked
        values = torch.randn(tq, tk, generator=gen, dtype=torch.float64)
        values[torch.rand(tq, tk, generator=gen) < 0.2] = float("-inf")
        return values.float(), ~torch.isneginf(values), torch.nan_to_num(values.float().double(), neginf=0.0)
    if kind == "bias&causal":
        values = torch.randn(tq, tk, generator=gen)
        return ak.bias(values) & ak.causal(), dense_causal(tq, tk), values.double()
    if kind == "broadcast_bool":  # a per-batch [B, 1, Tq, Tk] bool tensor (4-D inputs and up)
        per_batch = torch.rand(batch, 1, tq, tk, generator=gen) < 0.6
        shaped = per_batch.reshape(*batch_shape, 1, tq, tk) if rank >= 4 else (
            per_batch[:, 0] if rank == 3 else per_batch[0, 0])
        return shaped, shaped, None
    raise KeyError(kind)


MASK_KINDS = ("none", "causal", "causal_bottom_right", "window", "padding", "documents",
              "causal&padding", "documents|window", "~causal", "from_function", "bool_tensor",
              "dense", "float_tensor", "bias&causal", "broadcast_bool")


# ---- backends ---------------------------------------------------------------------------------

def usable_backends() -> list[str]:
    """Every registered backend that can run on this machine (later backends join automatically)."""
    return [name for name, b in dispatch.BACKENDS.items() if b.is_available()]


def reasons_for(backend: str, q, k, v, mask=None, **kwargs) -> list[str]:
    """``not_supported_reasons`` of ``backend`` for one call (empty when it can run it)."""
    from attnkit.inputs import validate
    inputs = validate(q, k, v, mask, **kwargs)
    return dispatch.BACKENDS[backend].not_supported_reasons(inputs)


@pytest.fixture(autouse=True)
def _global_rng_per_test():
    """Every test starts from the same global RNG state and leaves the state it found: module
    initialisation (``nn.Linear``, transformers' ``from_config``) and dropout draw from it, so
    without this a test's weights would depend on which tests its worker ran before it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator, so every test draws the same numbers on every run."""
    return torch.Generator().manual_seed(1234)


# ---- the triton backend through the interpreter (test_triton*.py, test_gpu_bench.py) ----------------

def skip_module_unless_interpreted(launch, test_file: str) -> None:
    """Skips the calling test module (at its import, after :func:`import_triton_interpreted` and
    the import of attnkit's triton ``launch``) where triton runs compiled in this process or its
    interpreter cannot run the kernels."""
    name = os.path.join("tests", os.path.basename(test_file))
    if not launch.interpreting():
        pytest.skip(f"triton runs compiled in this process (a CUDA machine, or imported before this "
                    f"module without TRITON_INTERPRET=1): run TRITON_INTERPRET=1 pytest "
                    f"{name} for these CPU tests", allow_module_level=True)
    import triton
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"the Triton interpreter before 3.9 cannot run these kernels (3.6 seen failing: a "
                    f"scalar tl.load returns a 1-element array there); triton {triton.__version__} "
                    f"is installed", allow_module_level=True)


def attention_math(q, k, v, allowed, bias, scale, dtype):
    """softmax(q kᵀ·scale + bias, masked) v in ``dtype``, differentiable everywhere.

    q ``[B, Hq, Tq, Dk]``, k ``[B, Hkv, Tk, Dk]``, v ``[B, Hkv, Tk, Dv]``; ``allowed``/``bias``
    broadcastable to ``[B, Hq, Tq, Tk]``. Fully masked rows: output 0, LSE −inf, and (since their
    scores are replaced by 0 before the softmax, then their weights by 0) zero gradients.
    Returns ``out [B, Hq, Tq, Dv]`` and ``lse [B, Hq, Tq]``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, Hq, Tk, D]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    if bias is not None:
        scores = scores + bias.to(dtype)
    if allowed is None:
        allowed = torch.ones(scores.shape, dtype=torch.bool)
    allowed = allowed.expand(scores.shape)
    row_empty = ~allowed.any(-1, keepdim=True)  # [B, Hq, Tq, 1]
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(row_empty, 0.0)
    weights = torch.softmax(scores, -1).masked_fill(row_empty, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(row_empty[..., 0], float("-inf"))
    return weights @ v, lse


def make_qkv(batch, heads, heads_kv, q_len, kv_len, dk, dv, dtype, gen):
    shapes = ((batch, heads, q_len, dk), (batch, heads_kv, kv_len, dk), (batch, heads_kv, kv_len, dv))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def check(q, k, v, mask, allowed=None, bias=None, *, gen, dout=None, grads=True, lse_grad=False,
          kernel_qkv=None, options=None):
    """Forward (out, LSE) and backward (dq, dk, dv) of the triton backend against float64.

    ``allowed``/``bias``: the mask written out independently, broadcastable to the scores.
    ``dout``: the output gradient (random when ``None``); ``lse_grad`` adds a loss term on the
    LSE so its gradient flows too; ``kernel_qkv``: what the kernel gets instead of (q, k, v)
    (same values where it matters, poison where it must not look); ``options``: the backend's
    ``TritonOptions`` (default: ``attention(backend="triton")``'s). Returns the triton result
    and gradients.
    """
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    leaves = [t.detach().requires_grad_() for t in (kernel_qkv or (q, k, v))]  # views stay views
    if options is None:
        result = ak.attention(*leaves, mask=mask, backend="triton", return_lse=True)
    else:
        from attnkit.backends.triton import TritonBackend
        from attnkit.inputs import validate
        result = TritonBackend(options).forward(validate(*leaves, mask))
    truth_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_true, lse_true = attention_math(*truth_leaves, allowed, bias, scale, torch.float64)
    out_plain, lse_plain = attention_math(*plain_leaves, allowed, bias, scale, dtype)

    assert result.out.dtype == dtype and result.lse.dtype == torch.float32
    assert torch.isfinite(result.out).all(), "NaN/inf in the output"
    assert_within_2x("out", result.out, out_true, out_plain, dtype)
    empty_rows = torch.isneginf(lse_true)  # [B, Hq, Tq]
    assert torch.equal(torch.isneginf(result.lse), empty_rows), "LSE −inf exactly on fully masked rows"
    assert (result.out[empty_rows] == 0).all(), "fully masked rows must be exactly 0"
    assert_within_2x("lse", result.lse, lse_true, lse_plain, dtype)
    if not grads:
        return result, None

    if dout is None:
        dout = torch.randn(result.out.shape, generator=gen, dtype=torch.float64).to(dtype)
    dlse = torch.randn(result.lse.shape, generator=gen, dtype=torch.float64) if lse_grad else None

    def loss(out, lse):
        total = (out.double() * dout.double()).sum()
        if dlse is not None:
            total = total + (torch.where(torch.isinf(lse), 0.0, lse.double()) * dlse).sum()
        return total

    if lse_grad:
        got = torch.autograd.grad(loss(result.out, result.lse), leaves)
    else:  # dout goes in as given (it may be a strided view: the kernels read it by strides)
        got = torch.autograd.grad(result.out, leaves, dout)
    true = torch.autograd.grad(loss(out_true, lse_true), truth_leaves)
    plain = torch.autograd.grad(loss(out_plain, lse_plain), plain_leaves)
    floors = delta_form_floors(q, k, v, dout, allowed, bias, scale)
    for name, g, t, p in zip(("dq", "dk", "dv"), got, true, plain):
        assert g.dtype == dtype and g.shape == t.shape
        assert torch.isfinite(g).all(), f"NaN/inf in {name}"
        assert_within_2x(name, g, t, p, dtype, floors.get(name, 0.0))
    assert (got[0][empty_rows] == 0).all(), "fully masked rows must get exactly zero dq"
    return result, got


def walk_options(walk: str, sparse: int, block: int, **more):
    """``TritonOptions`` whose interpreted launches walk with ``walk``, square kernel blocks
    ``block`` in square sparse blocks ``sparse`` (``more``: other options)."""
    from attnkit.backends.triton import launch  # here: after import_triton_interpreted()
    return launch.TritonOptions(walk=walk, tiles=launch.Tiles(
        sparse_q=sparse, sparse_k=sparse, fwd=(block, block), dkdv=(block, block),
        dq=(block, block)), **more)


@pytest.fixture
def validations(monkeypatch):
    """Counts the calls that validate (the others were answered by ``attnkit.call.CALLS``)."""
    from attnkit import call
    monkeypatch.setattr(call, "CALLS", type(call.CALLS)())
    count, real = [], call.validate

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(call, "validate", counted)
    return count


# ---- multi-process tests: one set of ranks per module, errors recorded per case ---------------

_SPAWNED: dict = {}


def spawned_once(worker, world: int, **kwargs) -> list:
    """Every rank's return value of ``worker(rank, world)`` on ``world`` local gloo ranks
    (``attnkit.distributed.spawn``, one thread each, ``kwargs`` passed on), spawned once per
    test process for each worker and world size: one set of processes runs every case of a
    module, and each case's test reads its part of the results."""
    key = (worker.__module__, worker.__qualname__, world)
    if key not in _SPAWNED:
        from attnkit.distributed import spawn
        _SPAWNED[key] = spawn(worker, world, threads=1, **kwargs)
    return _SPAWNED[key]


def expect_error(call, error_type, words) -> None:
    """``call()`` must raise ``error_type`` whose message holds every one of ``words``, else
    an ``AssertionError`` saying what happened."""
    try:
        call()
    except error_type as error:
        message = str(error)
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        return
    raise AssertionError(f"no {error_type.__name__} raised")


def error_failures(cases: dict) -> dict:
    """``{name: (call, error_type, words)}`` → ``{name: None, or why the call did not raise as
    expected}`` (:func:`expect_error` on each; a rank's cases run alike on every rank)."""
    failures = {}
    for name, (call, error_type, words) in cases.items():
        try:
            expect_error(call, error_type, words)
            failures[name] = None
        except AssertionError as error:
            failures[name] = str(error)
    return failures


def backward_unless_rank_1(out: torch.Tensor, rank: int, log_dir: str) -> None:
    """A worker whose rank 1 never calls backward: rank 1 waits (spawn stops it once another
    rank has raised); every other rank runs ``out.sum().backward()`` and, when that raises,
    writes the error to ``log_dir/rank{rank}.txt`` (whole, by a rename) and raises it."""
    import time
    from pathlib import Path

    if rank == 1:
        time.sleep(60)
        return
    try:
        out.sum().backward()
    except RuntimeError as error:
        record = Path(log_dir, f"rank{rank}.txt")
        record.with_suffix(".tmp").write_text(str(error))
        record.with_suffix(".tmp").rename(record)
        raise
