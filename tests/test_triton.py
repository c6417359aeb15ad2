"""``backend="triton"`` through the Triton interpreter, on CPU tensors.

The interpreter runs the very ``@triton.jit`` kernels a GPU compiles, one program at a time in
numpy. How it is switched on here: Triton reads ``TRITON_INTERPRET`` when ``@triton.jit``
*decorates* a function, and its own library (``tl.zeros``, ``tl.max`` …) is decorated when
triton is first imported, so the mode is fixed per process at that import. This module (at
collection, before any test runs) therefore imports triton with ``TRITON_INTERPRET=1`` set just
for that import, on machines without CUDA where the interpreter is the only way to run Triton
anyway; the backend's own kernels follow the library's mode whatever the environment says
later (``launch.kernels``). ``TRITON_INTERPRET=1`` is also the user's opt-in that the backend
checks per call, so the autouse fixture sets it with ``monkeypatch`` for each test here and
nothing leaks into other test files. On a CUDA machine, or when something imported triton
compiled before this module, the tests skip with the reason (run
``TRITON_INTERPRET=1 pytest tests/test_triton.py`` there; ``benchmarks/gpu.py`` checks the GPU).

Every check compares against float64 math written here (``attention_math``, NaN-safe so its
gradients exist on fully masked rows) with hand-built dense masks from ``conftest``, by the
rule error ≤ 2 × (error of the same math in the input dtype) + ``conftest.error_floor``.
Sizes are small (T ≤ 80): the interpreter costs tens of ms per block operation.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


from conftest import import_triton_interpreted  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.backends.triton import backend as triton_backend  # noqa: E402
from attnkit.backends.triton import launch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402
from attnkit.masks import EMPTY, FULL, PARTIAL, MaskSpace  # noqa: E402

from conftest import (assert_within_2x, delta_form_floors, dense_band, dense_causal,  # noqa: E402
                      dense_documents, dense_padding, sorted_ids)

if not launch.interpreting():
    pytest.skip("triton runs compiled in this process (a CUDA machine, or imported before this "
                "module without TRITON_INTERPRET=1): run TRITON_INTERPRET=1 pytest "
                "tests/test_triton.py for these CPU tests", allow_module_level=True)

import triton  # noqa: E402

if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"the Triton interpreter before 3.9 cannot run these kernels (3.6 seen failing: a "
                f"scalar tl.load returns a 1-element array there); triton {triton.__version__} "
                f"is installed", allow_module_level=True)

NAN = float("nan")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Opt in to the interpreter for this test only (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- the independent math -------------------------------------------------------------------------

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
          kernel_qkv=None):
    """Forward (out, LSE) and backward (dq, dk, dv) of the triton backend against float64.

    ``allowed``/``bias``: the mask written out independently, broadcastable to the scores.
    ``dout``: the output gradient (random when ``None``); ``lse_grad`` adds a loss term on the
    LSE so its gradient flows too; ``kernel_qkv``: what the kernel gets instead of (q, k, v)
    (same values where it matters, poison where it must not look). Returns the triton result
    and gradients.
    """
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    leaves = [t.detach().requires_grad_() for t in (kernel_qkv or (q, k, v))]  # views stay views
    result = ak.attention(*leaves, mask=mask, backend="triton", return_lse=True)
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


# ---- every mask kind, forward and backward ----------------------------------------------------------

def _padding_case(gen):
    """Batch 0 has no keys at all (every row fully masked); batch 1 pads queries and keys."""
    q_lengths, kv_lengths = [20, 41], [0, 33]
    return ak.padding(q_lengths, kv_lengths), dense_padding(48, 40, q_lengths, kv_lengths, batch=2)


def _bias_case(gen):
    values = torch.randn(1, 2, 45, 45, generator=gen)  # per head
    values[torch.rand(values.shape, generator=gen) < 0.2] = float("-inf")
    values[0, 1, 7] = float("-inf")  # one fully masked row
    return ak.bias(values), ~torch.isneginf(values), torch.nan_to_num(values, neginf=0.0)


def _dense_case(gen):
    allowed = torch.rand(45, 45, generator=gen) < 0.6
    allowed[3] = False
    return ak.dense(allowed), allowed


def _function_case(gen):
    def every_third(b, h, q_idx, kv_idx):  # depends on the head: loaded per head
        return (q_idx - kv_idx + h) % 3 == 0
    allowed = torch.tensor([[[(i - j + h) % 3 == 0 for j in range(45)] for i in range(45)]
                            for h in range(2)])
    return ak.from_function(every_third), allowed


MASK_CASES = {
    # name: (batch, q_len, kv_len, build(gen) -> (mask, allowed[, bias]))
    "none_ragged": (1, 37, 53, lambda gen: (None, None)),
    "causal": (1, 64, 64, lambda gen: (ak.causal(), dense_causal(64, 64))),
    "causal_bottom_right": (1, 37, 53, lambda gen: (ak.causal("bottom_right"),
                                                    dense_causal(37, 53, "bottom_right"))),
    "causal_top_left_tq_gt_tk": (1, 53, 37, lambda gen: (ak.causal(), dense_causal(53, 37))),
    "window": (1, 70, 70, lambda gen: (ak.sliding_window(9, 4), dense_band(70, 70, 9, 4))),
    "padding": (2, 48, 40, _padding_case),
    "documents": (1, 64, 64, lambda gen: _docs(gen, 64, 4)),
    "documents&causal": (1, 64, 64, lambda gen: _docs(gen, 64, 4, causal=True)),
    "documents_per_batch&causal": (2, 50, 50, lambda gen: _docs(gen, 50, 3, causal=True, batch=2)),
    "documents_interleaved&causal": (1, 48, 48, lambda gen: _interleaved_docs()),
    "documents_cross": (2, 40, 56, lambda gen: _cross_docs(gen)),
    "window&causal&padding": (2, 45, 45, lambda gen: (
        ak.sliding_window(12, 5) & ak.causal() & ak.padding(kv_lengths=[30, 45]),
        dense_band(45, 45, 12, 0) & dense_padding(45, 45, None, [30, 45], batch=2))),
    "dense": (1, 45, 45, _dense_case),
    "bias": (1, 45, 45, _bias_case),
    "bias&causal": (1, 45, 45, lambda gen: _bias_causal(gen)),
    "from_function": (1, 45, 45, _function_case),
    "documents|window": (1, 45, 45, lambda gen: _docs_or_window(gen)),
    "~causal": (1, 40, 40, lambda gen: (~ak.causal(), ~dense_causal(40, 40))),
}


def _docs(gen, length, n_docs, causal=False, batch=None):
    ids = sorted_ids(length, n_docs, gen, batch)
    mask, allowed = ak.documents(ids), dense_documents(ids)
    if causal:
        mask, allowed = mask & ak.causal(), allowed & dense_causal(length, length)
    return mask, allowed


def _interleaved_docs():
    """Every id in several runs: the kernels compare ids (no ranges)."""
    ids = (torch.arange(48) // 4) % 3
    return ak.documents(ids) & ak.causal(), dense_documents(ids) & dense_causal(48, 48)


def _cross_docs(gen):
    """Queries and keys of other lengths, per batch row, and ids only one side has."""
    q_ids, kv_ids = sorted_ids(40, 3, gen, batch=2), sorted_ids(56, 4, gen, batch=2)
    return ak.documents(q_ids, kv_ids), dense_documents(q_ids, kv_ids)


def _bias_causal(gen):
    values = torch.randn(45, 45, generator=gen)
    return ak.bias(values) & ak.causal(), dense_causal(45, 45), values


def _docs_or_window(gen):
    ids = sorted_ids(45, 3, gen)
    return ak.documents(ids) | ak.sliding_window(2), dense_documents(ids) | dense_band(45, 45, 2, 0)


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_masks_forward_backward(name, gen):
    batch, q_len, kv_len, build = MASK_CASES[name]
    mask, allowed, *bias = build(gen)
    q, k, v = make_qkv(batch, 2, 1, q_len, kv_len, 32, 32, torch.float32, gen)  # GQA 2/1
    check(q, k, v, mask, allowed, bias[0] if bias else None, gen=gen)


# ---- dtypes, head dims, GQA, lengths ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_low_precision(dtype, kind, gen):
    """fp16/bf16 in, fp32 accumulation: within 2× of plain math in the same dtype."""
    if kind == "causal":
        q, k, v = make_qkv(1, 4, 2, 53, 53, 64, 64, dtype, gen)  # GQA 4/2, D 64
        check(q, k, v, ak.causal(), dense_causal(53, 53), gen=gen)
    else:
        mask, allowed = _padding_case(gen)
        q, k, v = make_qkv(2, 2, 2, 48, 40, 32, 32, dtype, gen)
        check(q, k, v, mask, allowed, gen=gen)


@pytest.mark.parametrize("dk,dv", [(16, 16), (64, 64), (48, 24), (32, 80)])
def test_head_dims(dk, dv, gen):
    """Powers of two and padded ones (48 → 64, 24 → 32, 80 → 128), Dk ≠ Dv."""
    q, k, v = make_qkv(1, 2, 2, 37, 45, dk, dv, torch.float32, gen)
    check(q, k, v, ak.causal("bottom_right"), dense_causal(37, 45, "bottom_right"), gen=gen)


def test_gqa_with_per_head_mask(gen):
    """4 query heads over 2 K/V heads with a different mask per query head: the dK/dV program
    of one K/V head walks each of its query heads' own (transposed) block lists."""
    allowed = torch.rand(1, 4, 50, 50, generator=gen) < 0.5
    allowed[:, 1] = dense_causal(50, 50)  # head 1 skips blocks, the others do not
    allowed[:, 2, :, 20:] = False  # head 2: whole key blocks EMPTY
    q, k, v = make_qkv(1, 4, 2, 50, 50, 32, 32, torch.float32, gen)
    check(q, k, v, ak.dense(allowed), allowed, gen=gen)


def test_lse_gradient(gen):
    """A loss on the LSE reaches q and k (∂lse/∂s = p enters as Δ − dlse)."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 32, 32, torch.float32, gen)
    mask, allowed = ak.causal() & ak.padding(q_lengths=[30]), dense_causal(40, 40) & dense_padding(40, 40, [30])
    check(q, k, v, mask, allowed, gen=gen, lse_grad=True)


def test_gradient_of_lse_alone(gen):
    """A loss on the LSE only (the output unused: its gradient arrives as None, not zeros)
    gives the float64 math's gradients; v gets exactly zero."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 32, 32, torch.float32, gen)
    mask, allowed = ak.causal() & ak.padding(q_lengths=[30]), dense_causal(40, 40) & dense_padding(40, 40, [30])
    weight = torch.randn(1, 2, 40, generator=gen, dtype=torch.float64)

    def loss(lse):
        return (torch.where(torch.isinf(lse), 0.0, lse.double()) * weight).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(loss(ak.attention(*leaves, mask=mask, backend="triton", return_lse=True).lse),
                              leaves)
    truth_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    plain_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    truth = torch.autograd.grad(loss(attention_math(*truth_leaves, allowed, None, 1 / math.sqrt(32),
                                                    torch.float64)[1]), truth_leaves, allow_unused=True)
    plain = torch.autograd.grad(loss(attention_math(*plain_leaves, allowed, None, 1 / math.sqrt(32),
                                                    torch.float32)[1]), plain_leaves, allow_unused=True)
    for name, mine, true, ref in zip(("dq", "dk"), got, truth, plain):
        assert_within_2x(name, mine, true, ref, torch.float32)
    assert (got[2] == 0).all()


def use_walk(monkeypatch, walk: str, sparse: int, block: int) -> None:
    """The interpreter's launches walk with ``walk``, square kernel blocks in square sparse ones."""
    monkeypatch.setattr(launch, "INTERPRETER_TILES", launch.Tiles(
        sparse_q=sparse, sparse_k=sparse, fwd=(block, block), dkdv=(block, block),
        dq=(block, block), walk=walk))


@pytest.mark.parametrize("tiles", [
    launch.Tiles(sparse_q=32, sparse_k=32, fwd=(16, 16), dkdv=(16, 16), dq=(16, 16)),
    launch.Tiles(sparse_q=32, sparse_k=32, fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)),
], ids=["square_subtiles", "rectangular_subtiles"])
def test_kernel_blocks_inside_sparse_blocks(tiles, gen, monkeypatch):
    """On a GPU, autotuned kernel blocks walk sub-tiles of the 128×128 sparse blocks; the same
    loops run here with 16-wide kernel blocks inside 32-wide sparse blocks."""
    monkeypatch.setattr(launch, "INTERPRETER_TILES", tiles)
    mask, allowed = _docs(gen, 53, 3, causal=True)
    q, k, v = make_qkv(1, 2, 1, 53, 53, 32, 16, torch.float32, gen)
    check(q, k, v, mask, allowed, gen=gen)


@pytest.mark.parametrize("walk", sorted(launch.WALKS))
@pytest.mark.parametrize("case", ["docs&causal", "window&padding", "bias", "causal"])
def test_every_walk_of_the_block_lists(walk, case, gen, monkeypatch):
    """Each walk the autotuner may pick (PARTIAL or FULL loop first; sub-tiles unrolled or one
    per iteration; rows in order or heaviest first) gives the same attention, on rows mixing
    PARTIAL and FULL blocks, with two kernel blocks per sparse block. At 76 positions an
    ordered launch has one program past the end (3 sparse rows × 2), which must write nothing,
    and every tensor, the LSE too (76 a multiple of 4), is TMA-eligible for the ``+tma`` walks.
    GQA 2/1, so the dK/dV programs walk two heads' lists. The cases' orders cover the three
    kinds (loaded, reversed for causal rows, the rows' own for causal columns and the bias)."""
    use_walk(monkeypatch, walk, sparse=32, block=16)
    if case == "docs&causal":
        mask, allowed = _docs(gen, 76, 2, causal=True)
        bias = None
    elif case == "window&padding":
        mask = ak.sliding_window(20) & ak.padding(kv_lengths=[61])
        allowed, bias = dense_band(76, 76, 20, 0) & dense_padding(76, 76, None, [61]), None
    elif case == "causal":
        mask, allowed, bias = ak.causal(), dense_causal(76, 76), None
    else:
        bias = torch.randn(76, 76, generator=gen)
        mask, allowed = ak.bias(bias), None
    q, k, v = make_qkv(1, 2, 1, 76, 76, 16, 16, torch.float32, gen)  # GQA 2/1
    check(q, k, v, mask, allowed, bias, gen=gen)


LOOPS = sorted(w for w in launch.WALKS if "lpt" not in w)  # the walks' distinct loops


@pytest.mark.parametrize("walk", LOOPS)
@pytest.mark.parametrize("case", ["docs&causal", "window"])
def test_evenly_spaced_blocks(walk, case, gen, monkeypatch):
    """Rows whose FULL blocks are consecutive, several per row, and whose PARTIAL blocks are
    evenly spaced (documents under causal: a document's first block and the diagonal; a
    window: its far edge and the diagonal, FULL blocks between), on lengths that are whole
    sparse blocks: every walk computes the positions (``PARTIAL_STRIDED``,
    ``FULL_STRIDED``; the one-loop walk switches between the two progressions). Kernel
    blocks inside sparse ones walk them in the other walk tests (causal rows)."""
    use_walk(monkeypatch, walk, sparse=32, block=32)
    if case == "window":
        mask, allowed = ak.sliding_window(100), dense_band(128, 128, 100, 0)
    else:
        ids = torch.tensor([0] * 20 + [1] * 108)
        mask, allowed = ak.documents(ids) & ak.causal(), dense_documents(ids) & dense_causal(128, 128)
    q, k, v = make_qkv(1, 1, 1, 128, 128, 16, 16, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, mask))
    for lists in (plan.rows, plan.cols):
        assert lists.full_strided and lists.partial_strided
    assert int(plan.rows.num_full.max()) >= 2 and int(plan.rows.num_partial.max()) == 2
    check(q, k, v, mask, allowed, gen=gen)


@pytest.mark.parametrize("walk", LOOPS)
def test_unevenly_spaced_blocks(walk, gen, monkeypatch):
    """FULL and PARTIAL blocks not evenly spaced (FULL: blocks 0, 1 and 3 of most rows and
    columns; PARTIAL: 2, 4, 5 and the ragged tail): the kernels load each position
    (``PARTIAL_STRIDED``, ``FULL_STRIDED`` off) in every walk."""
    use_walk(monkeypatch, walk, sparse=16, block=16)
    allowed = torch.rand(108, 108, generator=gen) < 0.5
    for blocks in (slice(0, 32), slice(48, 64)):
        allowed[:, blocks] = True
        allowed[blocks, :] = True
    q, k, v = make_qkv(1, 2, 1, 108, 108, 16, 16, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.dense(allowed)))
    assert not (plan.rows.full_strided or plan.cols.full_strided or plan.rows.partial_strided
                or plan.cols.partial_strided)
    check(q, k, v, ak.dense(allowed), allowed, gen=gen)


def test_spacing_of_the_block_lists():
    """``BlockLists.partial_strided``/``full_strided``: the PARTIAL (FULL) entries of every
    row are evenly spaced blocks (any one or two are)."""
    P, F, E = PARTIAL, FULL, EMPTY

    def strided(*rows):
        lists = launch.block_lists(torch.tensor([[rows]], dtype=torch.int8), 1, 1)
        return lists.partial_strided, lists.full_strided
    assert strided([F, F, P, E], [P, F, F, E]) == (True, True)
    assert strided([F, F, P, E], [F, P, F, E]) == (True, True)  # FULL 0, 2: step 2
    assert strided([F, F, P, F]) == (True, False)  # FULL 0, 1, 3
    assert strided([P, P, E, E], [E, E, E, E]) == (True, True)  # no FULL block at all
    assert strided([P, F, F, P, F, P]) == (False, False)  # PARTIAL 0, 3, 5; FULL 1, 2, 4
    assert strided([P, F, P, F, P, E]) == (True, True)  # PARTIAL 0, 2, 4; FULL 1, 3
    assert strided([P, P, F, P], [P, E, E, E]) == (False, True)
    # lengths a multiple of the sparse blocks (a ragged tail block is PARTIAL in every row)
    space = MaskSpace(batch=1, heads=1, q_len=384, kv_len=384, device=torch.device("cpu"))
    for mask in (ak.causal(), ak.sliding_window(200), ak.padding(kv_lengths=[200]),
                 ak.documents(torch.arange(384) // 70) & ak.causal(), None):
        plan = launch.layout(mask, space, launch.GPU_TILES)
        assert plan.rows.full_strided and plan.cols.full_strided, mask
        assert plan.rows.partial_strided and plan.cols.partial_strided, mask


RANDOM_KINDS = ["window", "band", "causal", "bottom_right", "documents", "documents&causal",
                "equal_documents&causal", "causal&padding", "window&padding"]


@settings(max_examples=20,  # the same 20 in every run unless ATTNKIT_HYPOTHESIS=explore
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # its env var: the same
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(RANDOM_KINDS), seq=st.integers(20, 100),
       param=st.one_of(st.sampled_from([16, 32, 48]), st.integers(2, 60)),
       walk=st.sampled_from(sorted(launch.WALKS)), tiles=st.sampled_from([(16, 16), (32, 16), (32, 32)]),
       heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]), batch=st.integers(1, 2),
       dims=st.sampled_from([(16, 16), (32, 16), (24, 32)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       backward=st.sampled_from(launch.BACKWARDS))
def test_random_structures(seed, kind, seq, param, walk, tiles, heads, batch, dims, dtype,
                           backward):
    """Random windows, bands, causal masks (both alignments, other key lengths), documents of
    equal and unequal lengths with and without causal, and padding, at any length (ragged
    tails), under every walk, with kernel blocks equal to or half the sparse blocks, GQA,
    batches, head dims that need padding, each input dtype and each backward path
    (``launch.BACKWARD``): forward and backward within the 2x rule of the float64 truth.
    Their rows' blocks are evenly spaced or not, as they fall. (More examples, new in each run: raise ``max_examples`` and set
    ``ATTNKIT_HYPOTHESIS=explore`` locally.)"""
    gen = torch.Generator().manual_seed(seed)
    tq = tk = seq
    if kind == "window":
        mask, allowed = ak.sliding_window(param), dense_band(tq, tk, param, 0)
    elif kind == "band":
        mask, allowed = ak.sliding_window(param, param // 3), dense_band(tq, tk, param, param // 3)
    elif kind in ("causal", "bottom_right"):
        tk = seq + (param % 23 if kind == "bottom_right" else 0)
        align = "top_left" if kind == "causal" else "bottom_right"
        mask, allowed = ak.causal(align), dense_causal(tq, tk, align)
    elif kind.endswith("documents") or kind.endswith("documents&causal"):
        ids = (torch.arange(seq) // param if kind.startswith("equal")
               else torch.randint(0, max(2, seq // param), (seq,), generator=gen).sort().values)
        mask, allowed = ak.documents(ids), dense_documents(ids)
        if kind.endswith("causal"):
            mask, allowed = mask & ak.causal(), allowed & dense_causal(tq, tk)
    else:  # padding under causal or a window: a different length per batch row
        lengths = torch.randint(1, seq + 1, (batch,), generator=gen).tolist()
        band = ak.causal() if kind.startswith("causal") else ak.sliding_window(param)
        mask = band & ak.padding(kv_lengths=lengths)
        allowed = (dense_band(tq, tk, None if kind.startswith("causal") else param, 0)
                   & dense_padding(tq, tk, None, lengths, batch=batch))
    with pytest.MonkeyPatch.context() as patch:
        use_walk(patch, walk, sparse=tiles[0], block=tiles[1])
        patch.setattr(launch, "BACKWARD", backward)
        q, k, v = make_qkv(batch, heads[0], heads[1], tq, tk, *dims, dtype, gen)
        check(q, k, v, mask, allowed, gen=gen)


# ---- the stored-dS backward (launch.BACKWARD) ------------------------------------------------------

@pytest.fixture
def stored_ds(monkeypatch):
    """Calls plan the stored-dS backward; its buffer starts NaN-filled, so a slot dQ reads that
    dK/dV never wrote shows up as NaN in dq."""
    monkeypatch.setattr(launch, "BACKWARD", "stored_ds")
    calls, allocate = [], launch.ds_buffer

    def poisoned_buffer(q, plan):
        calls.append(plan)
        return allocate(q, plan).fill_(NAN)
    monkeypatch.setattr(launch, "ds_buffer", poisoned_buffer)
    return calls


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_stored_ds_every_mask(name, gen, stored_ds):
    """Every mask kind through the stored-dS backward (statistics; dK/dV storing dS; dQ = dS·K),
    GQA 2/1 as in :func:`test_masks_forward_backward`."""
    batch, q_len, kv_len, build = MASK_CASES[name]
    mask, allowed, *bias = build(gen)
    q, k, v = make_qkv(batch, 2, 1, q_len, kv_len, 32, 32, torch.float32, gen)
    check(q, k, v, mask, allowed, bias[0] if bias else None, gen=gen)
    assert stored_ds, "the stored-dS path did not run"


@pytest.mark.parametrize("walk", sorted(launch.WALKS))
def test_stored_ds_every_walk(walk, gen, monkeypatch, stored_ds):
    """dK/dV finds each tile's slot in every walk (unrolled sub-tiles, one per iteration, one
    loop; rows heaviest first; TMA loads too), dS by TMA stores, with two kernel blocks per
    sparse block and a ragged tail whose last sub-block no dK/dV program writes (76
    positions: every tensor TMA-eligible; no GQA, which turns the TMA loads off in dK/dV)."""
    use_walk(monkeypatch, walk, sparse=32, block=16)
    mask, allowed = _docs(gen, 76, 2, causal=True)
    q, k, v = make_qkv(1, 2, 2, 76, 76, 16, 16, torch.float32, gen)
    tma = []
    build = launch.dkdv_call

    def dkdv_call(*args, **kwargs):
        call = build(*args, **kwargs)
        tma.append((call.args["TMA_OK"], call.args["DS_TMA"]))
        return call
    monkeypatch.setattr(launch, "dkdv_call", dkdv_call)
    check(q, k, v, mask, allowed, gen=gen)
    assert tma == [(True, True)]  # TMA allowed for the walk's loads (used by +tma), dS by TMA


@pytest.mark.parametrize("walk", [launch.P, launch.F_FLAT, launch.M])
def test_stored_ds_by_pointer_stores(walk, gen, monkeypatch, stored_ds):
    """Without TMA (``DS_BY_TMA`` off, as on a GPU before sm90) dS goes by pointer stores."""
    monkeypatch.setattr(launch, "DS_BY_TMA", False)
    use_walk(monkeypatch, walk, sparse=32, block=16)
    mask, allowed = _docs(gen, 70, 2, causal=True)
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16, 16, torch.float32, gen)
    check(q, k, v, mask, allowed, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stored_ds_rectangular_subtiles_low_precision(dtype, gen, monkeypatch, stored_ds):
    """dK/dV and dQ with different kernel blocks inside the sparse ones (each reads the slots
    in its own sub-tiles), dS stored in the input dtype, the LSE's gradient through the
    statistics kernel."""
    monkeypatch.setattr(launch, "INTERPRETER_TILES", launch.Tiles(
        sparse_q=32, sparse_k=32, fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)))
    mask = ak.sliding_window(20) & ak.padding(kv_lengths=[61])
    allowed = dense_band(76, 76, 20, 0) & dense_padding(76, 76, None, [61])
    q, k, v = make_qkv(1, 4, 2, 76, 76, 32, 32, dtype, gen)
    check(q, k, v, mask, allowed, gen=gen, lse_grad=True)


def test_stored_ds_matches_recompute(gen, monkeypatch):
    """Both backwards give the same gradients: dk and dv bit for bit (the same dK/dV kernel,
    storing or not), dq to float32 rounding (a sum of the same products in another order)."""
    mask = ak.documents(sorted_ids(64, 3, gen)) & ak.causal()
    q, k, v = make_qkv(2, 2, 2, 64, 64, 32, 32, torch.float32, gen)
    dout = torch.randn(2, 2, 64, 32, generator=gen)
    grads = {}
    for mode in ("recompute", "stored_ds"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with launch.backward_path(mode):
            out = ak.attention(*leaves, mask=mask, backend="triton")
        grads[mode] = torch.autograd.grad(out, leaves, dout)
    (dq, dk, dv), (dq_s, dk_s, dv_s) = grads["recompute"], grads["stored_ds"]
    assert torch.equal(dk, dk_s) and torch.equal(dv, dv_s)
    torch.testing.assert_close(dq_s, dq, rtol=1e-5, atol=1e-6)


def test_slots_index_the_forward_lists():
    """``Layout.slots``: entry j of key column c (query row r) names the place of c in row r's
    forward list, for masks that differ per batch and head."""
    allowed = torch.rand(2, 3, 90, 90, generator=torch.Generator().manual_seed(1)) < 0.02
    allowed[0, 1] = dense_causal(90, 90)
    space = MaskSpace(batch=2, heads=3, q_len=90, kv_len=90, device=torch.device("cpu"))
    lay = launch.layout(ak.dense(allowed), space, launch.Tiles(sparse_q=16, sparse_k=16))
    slots, entries = lay.slots
    rows, cols = lay.rows, lay.cols
    assert entries == int((rows.num_partial + rows.num_full).max())
    checked = 0
    for b in range(2):
        for h in range(3):
            for c in range(cols.index.shape[2]):
                for j in range(int(cols.num_partial[b, h, c] + cols.num_full[b, h, c])):
                    r = int(cols.index[b, h, c, j])
                    e = int(slots[b, h, c, j])
                    assert int(rows.index[b, h, r, e]) == c and e < entries
                    checked += 1
    assert checked == rows.visited()


def test_auto_stores_ds_for_sparse_masks_within_the_budget(monkeypatch):
    """``"auto"`` stores dS where no row lists more than half the key blocks and the buffer fits
    ``STORED_DS_MAX_BYTES``; a plan keeps the choice it was made with."""
    q = torch.zeros(1, 2, 256, 16)

    def planned(mask, mode):
        with launch.backward_path(mode):
            return launch.make_plan(validate(q, q, q, mask))
    window, causal = planned(ak.sliding_window(40), "auto"), planned(ak.causal(), "auto")
    assert launch.stores_ds(q, window) and not launch.stores_ds(q, causal)
    assert launch.ds_bytes(q, window) == 2 * (256 // 32) * 3 * 32 * 32 * 4  # 3 blocks a row
    monkeypatch.setattr(launch, "STORED_DS_MAX_BYTES", launch.ds_bytes(q, window) - 1)
    assert not launch.stores_ds(q, window)
    assert launch.stores_ds(q, planned(ak.causal(), "stored_ds"))
    assert not launch.stores_ds(q, planned(ak.sliding_window(40), "recompute"))
    with pytest.raises(ValueError, match="launch.BACKWARD"):
        planned(None, "atomic")
    assert launch.BACKWARD == "auto"  # the default: plans made outside backward_path
    assert launch.make_plan(validate(q, q, q, ak.sliding_window(40))).backward == "auto"


# ---- memory safety and determinism ----------------------------------------------------------------

def poisoned(t: torch.Tensor, extra=(1, 1, 7, 5)) -> torch.Tensor:
    """``t`` copied into a larger NaN-filled buffer: a strided view whose neighbours (next head,
    rows past the end, features past the last) are NaN, so any out-of-bounds read shows."""
    buffer = torch.full([s + e for s, e in zip(t.shape, extra)], NAN, dtype=t.dtype)
    view = buffer[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def test_nan_poisoned_memory(gen):
    """q, k, v, dout, the bias and the dense mask all live inside NaN-filled buffers."""
    q, k, v = (poisoned(t) for t in make_qkv(1, 2, 1, 37, 45, 24, 40, torch.float32, gen))
    values = torch.randn(2, 37, 45, generator=gen)
    flags = torch.rand(37, 45, generator=gen) < 0.7
    bias_view = poisoned(values, extra=(1, 3, 9))
    flag_buffer = torch.zeros(40, 50, dtype=torch.bool)  # bool cannot hold NaN: False around it
    flag_view = flag_buffer[:37, :45]
    flag_view.copy_(flags)
    mask = ak.bias(bias_view) & ak.dense(flag_view) & ak.causal("bottom_right")
    allowed = flags & dense_causal(37, 45, "bottom_right")
    dout = poisoned(torch.randn(1, 2, 37, 40, generator=gen))
    for view in (q, k, v, dout, bias_view):
        after_first_row = view.as_strided((1,), (1,), view.storage_offset() + view.shape[-1])
        assert not view.is_contiguous() and torch.isnan(after_first_row).all()
    check(q, k, v, mask, allowed, values, gen=gen, dout=dout)


@pytest.mark.parametrize("kind", ["causal_br", "window", "docs_ranges", "docs_ids", "padding",
                                  "dense_bias"])
def test_lengths_on_block_edges_skip_bounds_checks(kind, gen):
    """Lengths that are multiples of the sparse blocks (64 queries, 96 keys over 32×32 blocks)
    compile PARTIAL tiles without sequence-end checks (``BOUNDS`` off). Every input lives in a
    NaN-filled buffer, so a read past an end would show."""
    q_len, kv_len = 64, 96
    bias = None
    if kind == "causal_br":
        mask, allowed = ak.causal("bottom_right"), dense_causal(q_len, kv_len, "bottom_right")
    elif kind == "window":
        mask, allowed = ak.sliding_window(20, 5), dense_band(q_len, kv_len, 20, 5)
    elif kind.startswith("docs"):
        q_ids = sorted_ids(q_len, 3, gen, batch=2)
        kv_ids = sorted_ids(kv_len, 4, gen, batch=2)
        if kind == "docs_ids":  # ids in two runs each: compared per tile
            q_ids, kv_ids = q_ids % 2, kv_ids % 2
        mask, allowed = ak.documents(q_ids, kv_ids), dense_documents(q_ids, kv_ids)
    elif kind == "padding":
        mask = ak.padding([50, 0], [96, 17])
        allowed = dense_padding(q_len, kv_len, [50, 0], [96, 17], batch=2)
    else:
        bias = torch.randn(2, 1, q_len, kv_len, generator=gen)
        flags = torch.rand(q_len, kv_len, generator=gen) < 0.6
        mask, allowed = ak.bias(poisoned(bias)) & ak.dense(flags), flags
    q, k, v = (poisoned(t) for t in make_qkv(2, 2, 1, q_len, kv_len, 32, 16, torch.float32, gen))
    assert launch._common(q, k, v, launch.make_plan(validate(q, k, v, mask)))["BOUNDS"] is False
    dout = poisoned(torch.randn(2, 2, q_len, 16, generator=gen))
    check(q, k, v, mask, allowed, bias, gen=gen, dout=dout)


@pytest.mark.parametrize("heads_kv", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("walk", [launch.P_TMA, launch.P_FLAT_TMA, launch.F_FLAT_TMA, launch.M_TMA])
def test_tma_reads_nothing_past_the_ends(walk, heads_kv, gen, monkeypatch):
    """``+tma`` walks describe K/V (forward, dQ) and Q/dO (dK/dV) per (batch, head) as
    ``[T, D]``: the copies must zero-fill rows past a ragged end (72 positions in 32-row blocks)
    and columns past a padded head dim (24 → 32), here NaN in memory, while the strides still
    let TMA describe the views. (With GQA, dK/dV loads by pointers: see ``launch.dkdv_call``.)"""
    use_walk(monkeypatch, walk, sparse=32, block=32)
    q, k, v = (poisoned(t, extra=(0, 0, 24, 8)) for t in make_qkv(1, 2, heads_kv, 72, 72, 24, 24,
                                                                   torch.float32, gen))
    lse = torch.empty(1, 2, 72)  # as the forward makes it; 72 rows keep each head 16-byte aligned
    assert launch._tma_ok(k, v) and launch._tma_ok(q, q, lse) and not launch._tma_ok(poisoned(k))
    mask, allowed = _docs(gen, 72, 3, causal=True)
    check(q, k, v, mask, allowed, gen=gen)


def test_skipped_blocks_are_never_read(gen):
    """Keys 32+ of a 30-key padding mask lie in EMPTY blocks: NaN there must not reach anything
    (a visited block would compute 0 · NaN = NaN in p @ v)."""
    q, k, v = make_qkv(1, 2, 2, 40, 80, 32, 32, torch.float32, gen)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, 32:], v_nan[:, :, 32:] = NAN, NAN
    mask = ak.padding(kv_lengths=[30])
    _, grads = check(q, k, v, mask, dense_padding(40, 80, None, [30]), gen=gen,
                     kernel_qkv=(q, k_nan, v_nan))
    assert (grads[1][:, :, 30:] == 0).all() and (grads[2][:, :, 30:] == 0).all()


def test_rerun_is_bit_identical(gen):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 45, 45, 32, 32, torch.bfloat16, gen))
    mask = ak.documents(sorted_ids(45, 3, gen)) & ak.causal()
    dout = torch.randn(1, 2, 45, 32, generator=gen).to(torch.bfloat16)

    def run():
        r = ak.attention(q, k, v, mask, backend="triton", return_lse=True)
        return (r.out, r.lse, *torch.autograd.grad(r.out, (q, k, v), dout))

    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


# ---- the layout cache (block lists reused between calls) -------------------------------------------

def test_layout_is_reused_for_the_same_mask_and_shapes():
    ids = torch.arange(96) // 32
    mask = ak.documents(ids) & ak.causal()
    first = _plan(mask, 96, 96, launch.INTERPRETER_TILES).layout
    assert _plan(mask, 96, 96, launch.INTERPRETER_TILES).layout is first
    assert _plan(mask, 96, 96, launch.INTERPRETER_TILES, heads=2).layout is not first  # other shapes
    equal = ak.documents(ids.clone()) & ak.causal()  # another tensor: planned again
    assert _plan(equal, 96, 96, launch.INTERPRETER_TILES).layout is not first
    assert ak.masks.cache_key(ak.from_function(lambda b, h, q, kv: q >= kv), []) is None
    big = torch.ones(96, 96, dtype=torch.bool)  # Tq×Tk tensors are never held by a cache
    assert ak.masks.cache_key(ak.dense(big), []) is None
    assert ak.masks.cache_key(ak.bias(big.float()) & ak.causal(), []) is None


def test_layout_cache_sees_in_place_changes(gen):
    """Document ids written in place after a call must give a new layout and right results."""
    ids = torch.arange(64) // 32  # 2 documents
    mask = ak.documents(ids)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32, gen)
    check(q, k, v, mask, dense_documents(ids), gen=gen, grads=False)
    before = _plan(mask, 64, 64, launch.INTERPRETER_TILES).layout
    ids[:] = torch.arange(64) // 16  # now 4 documents: blocks that were FULL are EMPTY
    assert _plan(mask, 64, 64, launch.INTERPRETER_TILES).layout is not before
    check(q, k, v, mask, dense_documents(ids), gen=gen)


def test_reused_launches_take_the_new_tensors(gen):
    """Launch arguments are built once per layout and shapes; a second call with other tensors
    of the same shapes (and a strided view) must compute with those tensors."""
    mask = ak.sliding_window(9)
    allowed = dense_band(48, 48, 9, 0)
    first = make_qkv(1, 2, 1, 48, 48, 16, 16, torch.float32, gen)
    check(*first, mask, allowed, gen=gen)
    second = make_qkv(1, 2, 1, 48, 48, 16, 16, torch.float32, gen)
    r2, _ = check(*second, mask, allowed, gen=gen)
    wide = torch.randn(1, 2, 48, 32, generator=gen)[..., :16]  # same shape, other strides
    r3, _ = check(wide, *second[1:], mask, allowed, gen=gen)
    assert not torch.equal(r2.out, r3.out)
    layout = _plan(mask, 48, 48, launch.INTERPRETER_TILES, heads=2).layout
    assert layout.calls and not any(isinstance(value, torch.Tensor) and value.shape[-1] == 16
                                    for call in layout.calls.values() for value in call.args.values())



@pytest.mark.parametrize("walk", [launch.P, launch.F_LPT])
def test_compiled_launches_skip_the_autotuner_once_it_has_chosen(walk, monkeypatch):
    """On a GPU the first launch of a template goes through ``triton.autotune``; later launches
    from the same template call the kernel directly with the config it chose (same grid, same
    arguments, the config's kwargs). Checked with stand-ins for the tuner and the kernel (the
    real path runs in ``benchmarks/gpu.py``, which checks every result on the GPU)."""
    launches = []

    class Config:
        kwargs = {"BLOCK_M": 64, "BLOCK_N": 32, **launch.WALKS[walk]}

        def all_kwargs(self):
            return {**self.kwargs, "num_warps": 4, "num_stages": 2}

    class Kernel:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append(("direct", grid, kwargs))

    class Tuner:
        fn, best_config = Kernel(), Config()

        def __getitem__(self, grid):
            return lambda **kwargs: launches.append(("tuner", grid(Config.kwargs), kwargs))

    monkeypatch.setattr(launch, "_tuned", lambda name: Tuner())
    monkeypatch.setattr(launch, "_LAYOUTS", launch.MaskCache(32))  # no template of another test
    mask = ak.sliding_window(9)
    q = torch.zeros(1, 2, 130, 16)
    plan = launch.make_plan(validate(q, q, q, mask), launch.GPU_TILES)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 130)
    for _ in range(3):
        launch.forward_call(q, q, q, out, lse, plan).run(interpret=False)
    assert [how for how, _, _ in launches] == ["tuner", "direct", "direct"]
    # cdiv(130, 64) blocks, or ordered: whole 128-row sparse blocks, 2 programs each; × batch·heads
    blocks = 4 if launch.WALKS[walk]["ORDERED"] else 3
    assert launches[0][1] == launches[1][1] == (blocks, 2)
    assert launches[1][2] == {**launches[0][2], **Config().all_kwargs()}
    assert all(value is not q for call in plan.layout.calls.values() for value in call.args.values())



@pytest.mark.parametrize("keep", [True, False])
def test_autotune_timings_kept_on_disk(keep, monkeypatch):
    """The tuners are made with ``cache_results=AUTOTUNE_CACHE`` (a new process with the same
    shapes and mask kinds reads the timings back instead of timing every candidate again;
    ``benchmarks/gpu.py`` turns it off), over every candidate of the kernel."""
    import triton

    made = {}
    real = triton.autotune

    def autotune(**kwargs):
        made.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(triton, "autotune", autotune)
    monkeypatch.setattr(launch, "_TUNED", {})
    monkeypatch.setattr(launch, "AUTOTUNE_CACHE", keep)
    tuner = launch._tuned("attn_bwd_dq")
    assert made["cache_results"] is keep and tuner is launch._tuned("attn_bwd_dq")
    every = {c for bucket in launch.CONFIGS["attn_bwd_dq"].values() for c in bucket}
    assert {launch._config_key(c) for c in made["configs"]} == every


def test_direct_launch_after_the_first_compiled_launches(monkeypatch):
    """Compiled launches of one template: the autotuner first, then ``JITFunction`` with the
    chosen config (whose compiled kernel is kept), then that kernel directly with every
    parameter in the kernel's order: the same values ``JITFunction`` bound by name, plus the
    config's blocks and walk flags. A tensor's 16-byte alignment or the TMA switch changing,
    or ``DIRECT_LAUNCH`` off, sends the launch back through ``JITFunction``."""
    launches = []
    config = SimpleNamespace(kwargs=dict(BLOCK_M=64, BLOCK_N=128, **launch.WALKS["partial_first+tma"]),
                             all_kwargs=lambda: dict(config.kwargs, num_warps=8, num_stages=2))

    class Compiled:  # as triton's CompiledKernel: its launcher reads all three grid axes
        def __getitem__(self, grid):
            return lambda *args: launches.append(("direct", (grid[0], grid[1], grid[2]), args))

    class Jit:
        fn = staticmethod(launch.kernels().attn_fwd.fn)  # the kernel's Python function

        def __getitem__(self, grid):
            def run(**kwargs):
                launches.append(("jit", grid, kwargs))
                return Compiled()
            return run

    class Tuner:
        fn, best_config = Jit(), config

        def __getitem__(self, grid):
            return lambda **kwargs: launches.append(("autotune", grid(config.kwargs), kwargs))

    monkeypatch.setattr(launch, "_tuned", lambda name: Tuner())
    monkeypatch.setattr(launch, "_scratch_allocator", lambda: None)
    monkeypatch.setattr(launch, "_LAYOUTS", launch.MaskCache(32))
    q = torch.zeros(1, 2, 300, 128)
    plan = launch.make_plan(validate(q, q, q, ak.causal()), launch.GPU_TILES)
    plan.interpret = False

    def launch_once(q, out=None):
        out = torch.empty_like(q) if out is None else out
        launch.forward_call(q, q, q, out, torch.empty(1, 2, 300), plan).run(False)
        return launches[-1]

    assert launch_once(q)[0] == "autotune"
    kind, grid, bound = launch_once(q)
    assert kind == "jit" and grid == (5, 2) and bound["num_warps"] == 8  # 300 rows / 64
    out = torch.empty_like(q)
    kind, grid, positional = launch_once(q, out)
    assert kind == "direct" and grid == (5, 2, 1)
    names = list(inspect.signature(Jit.fn).parameters)
    assert len(positional) == len(names)
    by_name = dict(zip(names, positional))
    for name, value in bound.items():
        if name not in ("num_warps", "num_stages", "Out", "Lse"):  # options; fresh outputs
            assert by_name[name] is value or by_name[name] == value, name
    assert by_name["Q"] is q and by_name["Out"] is out  # this call's tensors, swapped in
    kept = [entry for entry in plan.layout.calls.values() if entry.tuned.get("direct")]
    _, values, _ = next(iter(kept[0].tuned["direct"].values()))
    assert not any(isinstance(x, torch.Tensor) and x.shape == q.shape for x in values), \
        "the cache keeps no call's tensors alive"
    assert by_name["BLOCK_M"] == 64 and by_name["TMA"] is True
    misaligned = torch.zeros(1 * 2 * 300 * 128 + 1)[1:].view(1, 2, 300, 128)  # 4 bytes off
    assert launch_once(misaligned)[0] == "jit"
    assert launch_once(q)[0] == "direct"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    assert launch_once(q)[0] == "jit"


@pytest.mark.parametrize("with_dlse", [False, True])
def test_dq_writes_the_row_statistics_for_dkdv(with_dlse, gen):
    """The dQ kernel, which runs first in the backward, writes each of its rows' Δ =
    rowsum(dO ∘ O) − dLSE and base-2 LSE (``+inf`` on fully masked rows) for dK/dV; a call
    with the LSE's gradient and one without are different launch templates."""
    q, k, v = make_qkv(1, 2, 2, 70, 50, 32, 32, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.padding(q_lengths=[70], kv_lengths=[50])
                                     & ak.causal("bottom_right")))
    out, dout = torch.randn(1, 2, 70, 32, generator=gen), torch.randn(1, 2, 70, 32, generator=gen)
    lse = torch.randn(1, 2, 70, generator=gen)
    lse[:, :, :5] = float("-inf")  # fully masked rows
    dlse = torch.randn(1, 2, 70, generator=gen) if with_dlse else None
    delta, lse2 = torch.full_like(lse, float("nan")), torch.full_like(lse, float("nan"))
    call = launch.dq_call(q, k, v, dout, out, lse, dlse, lse2, delta, torch.empty_like(q), plan)
    assert call.args["HAS_DLSE"] is with_dlse
    call.run(interpret=True)
    expected = (dout * out).sum(-1) - (dlse if with_dlse else 0)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
    assert torch.isposinf(lse2[:, :, :5]).all()
    torch.testing.assert_close(lse2[:, :, 5:], lse[:, :, 5:] * math.log2(math.e), rtol=1e-6, atol=0)
    other = launch.dq_call(q, k, v, dout, out, lse, None if with_dlse else lse, lse2, delta,
                           torch.empty_like(q), plan)
    assert other.args["HAS_DLSE"] is not with_dlse


def test_direct_launch_arguments_run_the_kernel(gen):
    """The direct launch's positional arguments (``launch._slots``), given to the interpreted
    forward kernel, compute what the keyword launch computes, bit for bit."""
    q, k, v = make_qkv(1, 4, 2, 70, 50, 32, 32, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.documents(torch.arange(70) // 30, torch.arange(50) // 20)
                                     & ak.causal("bottom_right")))
    outs = [(torch.empty(1, 4, 70, 32), torch.empty(1, 4, 70)) for _ in range(2)]
    call = launch.forward_call(q, k, v, *outs[0], plan)
    call.run(interpret=True)
    call = launch.forward_call(q, k, v, *outs[1], plan)
    block_m, block_n = call.fixed
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, **launch.WALKS[call.walk])
    kernel = launch.kernels().attn_fwd
    slots = launch._slots(kernel.fn, call.args, meta)
    kernel[call.grid(block_m, block_n, meta["ORDERED"])](*[call.args.get(n, x) for n, x in slots])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert launch._slots(kernel.fn, {}, meta) is None  # a parameter without value or default


@pytest.mark.parametrize("index", [0, 3, 99])
def test_pinned_launches_skip_the_autotuner(index, monkeypatch):
    """``launch.pinned(i)`` (gpu.py's checks of mask kinds and of every candidate): compiled
    launches run candidate i of the head-dim bucket (the last when there are fewer) directly,
    never the autotuner, and record no choice."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append((grid, kwargs))

    class Kernels:
        attn_fwd = Kernel()

    def no_tuner(name):
        raise AssertionError("the autotuner must not run")

    monkeypatch.setattr(launch, "_tuned", no_tuner)
    monkeypatch.setattr(launch, "kernels", lambda: Kernels())
    monkeypatch.setattr(launch, "_LAYOUTS", launch.MaskCache(32))
    q = torch.zeros(1, 2, 300, 128)
    plan = launch.make_plan(validate(q, q, q, ak.causal()), launch.GPU_TILES)
    call = launch.forward_call(q, q, q, torch.empty_like(q), torch.empty(1, 2, 300), plan)
    with launch.pinned(index):
        call.run(interpret=False)
    candidates = launch.CONFIGS["attn_fwd"][128]
    block_m, block_n, warps, stages, walk = candidates[min(index, len(candidates) - 1)]
    grid, kwargs = launches[0]
    rows = launch.cdiv(300, 128) * (128 // block_m) if launch.WALKS[walk]["ORDERED"] else launch.cdiv(300, block_m)
    assert grid == (rows, 2)
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (
        block_m, block_n, warps, stages)
    assert all(kwargs[flag] == value for flag, value in launch.WALKS[walk].items())
    assert call.tuned == {} and not launch._PINNED


def test_documents_as_ranges_when_contiguous():
    """Documents that are contiguous runs reach the kernels as ranges (each query's key range,
    each key's query range), others as int32 ids; ids beyond int32 keep their equalities."""
    space = MaskSpace(2, 1, 6, 5)
    q_ids, kv_ids = torch.tensor([7, 7, 2, 2, 2, 9]), torch.tensor([[2, 7, 7, 7, 5], [9, 9, 2, 2, 2]])
    program = launch.compile_mask(ak.documents(q_ids, kv_ids), space)
    assert program.doc_ranges and program.q_docs.dtype == torch.int32
    assert program.q_docs.tolist() == [[[1, 4], [1, 4], [0, 1], [0, 1], [0, 1], [0, 0]],
                                       [[0, 0], [0, 0], [2, 5], [2, 5], [2, 5], [0, 2]]]
    assert program.kv_docs.tolist() == [[[2, 5], [0, 2], [0, 2], [0, 2], [0, 0]],
                                        [[5, 6], [5, 6], [2, 5], [2, 5], [2, 5]]]
    split = launch.compile_mask(ak.documents(torch.tensor([1, 2, 1, 3, 3, 3])), MaskSpace(1, 1, 6, 6))
    assert not split.doc_ranges and split.q_docs.dtype == torch.int32
    huge = torch.tensor([2**40, 2**40, 5, 2**40]).repeat_interleave(2)  # 2**40 in two runs
    wide = launch.compile_mask(ak.documents(huge), MaskSpace(1, 1, 8, 8))
    same = wide.q_docs[0][:, None] == wide.kv_docs[0][None, :]
    assert not wide.doc_ranges and torch.equal(same, huge[:, None] == huge[None, :])

# ---- block skipping (host block lists) -----------------------------------------------------------

@pytest.mark.parametrize("length", [96, 90])
def test_parts_that_forbid_nothing_in_partial_tiles_are_left_out(length, gen, monkeypatch):
    """``launch.needed_leaves``: documents aligned to the sparse blocks under causal leave the
    PARTIAL tiles (the diagonal ones, and a ragged tail) to causal alone, with the same
    results; misaligned documents, a bias and a dense part stay in the program; padding that
    covers everything goes."""
    use_walk(monkeypatch, launch.P, sparse=32, block=16)
    ids = torch.arange(length) // 32
    aligned = ak.documents(ids) & ak.causal()
    assert _plan(aligned, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi"]
    q, k, v = make_qkv(1, 2, 1, length, length, 16, 16, torch.float32, gen)
    check(q, k, v, aligned, dense_documents(ids) & dense_causal(length, length), gen=gen)
    misaligned = ak.documents(torch.arange(length) // 40) & ak.causal()
    assert "documents" in _plan(misaligned, length, length, launch.INTERPRETER_TILES).program.features()
    biased = ak.causal() & ak.bias(torch.zeros(length, length)) & ak.padding(kv_lengths=[length])
    assert _plan(biased, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi", "bias"]
    # only structured parts are weighed (a dense one's block map would evaluate every element)
    dense = ak.causal() & ak.dense(torch.ones(length, length, dtype=torch.bool))
    assert _plan(dense, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi", "dense"]


def _plan(mask, q_len, kv_len, tiles, heads=1, batch=1):
    q = torch.zeros(batch, heads, q_len, 16)
    k = torch.zeros(batch, heads, kv_len, 16)
    return launch.make_plan(validate(q, k, k, mask), tiles)


def test_causal_visits_about_half_the_tiles():
    tiles = launch.Tiles(sparse_q=16, sparse_k=16)
    n = 1024 // 16
    plan = _plan(ak.causal(), 1024, 1024, tiles)
    assert plan.rows.visited() == n * (n + 1) // 2  # the lower triangle and the diagonal
    assert plan.cols.visited() == n * (n + 1) // 2
    assert int((plan.rows.num_partial).sum()) == n  # only diagonal tiles need the mask
    assert _plan(None, 1024, 1024, tiles).rows.visited() == n * n


def test_window_and_documents_visit_only_their_band():
    tiles = launch.Tiles(sparse_q=16, sparse_k=16)
    n = 1024 // 16
    window = _plan(ak.sliding_window(32), 1024, 1024, tiles).rows.visited()
    assert window <= 4 * n  # 32 keys back span at most 3 blocks plus the diagonal one
    ids = torch.arange(1024) // 128  # 8 documents of 128: 8×8 blocks each on the diagonal
    docs = _plan(ak.documents(ids), 1024, 1024, tiles)
    assert docs.rows.visited() == 8 * 8 * 8 and int(docs.rows.num_partial.sum()) == 0


def test_block_lists_order_and_tails():
    """PARTIAL blocks are listed first, then FULL; blocks past a ragged end are never FULL."""
    codes = torch.tensor([[[[FULL, EMPTY, PARTIAL, FULL], [EMPTY, EMPTY, EMPTY, EMPTY]]]], dtype=torch.int8)
    lists = launch.block_lists(codes, batch=2, heads=3)
    assert lists.num_partial[1, 2].tolist() == [1, 0] and lists.num_full[0, 0].tolist() == [2, 0]
    assert lists.index[1, 1, 0, :3].tolist() == [2, 0, 3]
    assert lists.order.tolist() == [0, 1] and lists.order_kind == 0  # the rows' own order
    # heaviest rows first (a PARTIAL block weighs 5/4 of a FULL one), ties in row order
    codes = torch.tensor([[[[FULL, EMPTY], [FULL, FULL], [PARTIAL, EMPTY], [EMPTY, EMPTY], [FULL, EMPTY]]]],
                         dtype=torch.int8)
    lists = launch.block_lists(codes, batch=1, heads=1)
    assert lists.order.tolist() == [1, 2, 0, 4, 3] and lists.order_kind == 2  # loaded
    causal = launch.block_codes(ak.causal(), MaskSpace(1, 1, 96, 96), launch.Tiles(32, 32))
    rows, cols = launch.block_lists(causal, 1, 1), launch.block_lists(causal.transpose(-1, -2), 1, 1)
    assert (rows.order.tolist(), rows.order_kind) == ([2, 1, 0], 1)  # reversed: computed
    assert (cols.order.tolist(), cols.order_kind) == ([0, 1, 2], 0)
    space = validate(torch.zeros(1, 1, 40, 16), torch.zeros(1, 1, 50, 16), torch.zeros(1, 1, 50, 16)).space
    tail = launch.block_codes(None, space, launch.Tiles(sparse_q=32, sparse_k=32))
    assert tail[0, 0].tolist() == [[FULL, PARTIAL], [PARTIAL, PARTIAL]]


def test_mask_program_features():
    """Structured parts of an & chain become index arithmetic; the rest is loaded."""
    space = validate(torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16)).space
    program = launch.compile_mask(ak.causal() & ak.sliding_window(8, 3), space)
    assert program.features() == ["band_lo", "band_hi"] and (program.band_lo, program.band_hi) == (-8, 0)
    program = launch.compile_mask(ak.padding(kv_lengths=[3, 9]) & ak.padding(kv_lengths=[5, 4]), space)
    assert program.kv_lengths.tolist() == [3, 4]
    program = launch.compile_mask(ak.documents(torch.arange(40) // 10) | ak.causal(), space)
    assert program.features() == ["dense"] and program.allowed.stride()[:2] == (0, 0)
    program = launch.compile_mask(ak.bias(torch.zeros(40, 40)) & ak.causal("bottom_right"), space)
    assert program.features() == ["band_hi", "bias"]


# ---- refusals and dispatch ------------------------------------------------------------------------

def _reasons(q, k, v, mask=None, **kwargs):
    return dispatch.BACKENDS["triton"].not_supported_reasons(validate(q, k, v, mask, **kwargs))


def test_refusals(gen, monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, gen)
    assert _reasons(q, k, v) == []
    assert "dropout_p=0.1 (not supported by triton)" in _reasons(q, k, v, dropout_p=0.1)
    assert "return_weights=True (not supported by triton)" in _reasons(q, k, v, need_weights=True)
    assert "dtype=torch.float64 (not supported by triton)" in _reasons(q.double(), k.double(), v.double())
    wide = torch.zeros(1, 1, 4, 320)
    assert "head dim 320 > 256 (not supported by triton)" in _reasons(wide, wide, wide)
    trainable = torch.zeros(8, 8, requires_grad=True)
    assert any("bias that requires grad" in r for r in _reasons(q, k, v, ak.bias(trainable)))
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        ak.attention(q, k, v, dropout_p=0.1, backend="triton")

    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in triton_backend.TritonBackend().unavailable_reason()
    assert any("CPU tensors need TRITON_INTERPRET=1 (not supported by triton)" in r
               for r in _reasons(q, k, v))

    monkeypatch.setattr(triton_backend.importlib.util, "find_spec", lambda name: None)
    triton_backend._installed.cache_clear()
    try:
        assert triton_backend.TritonBackend().unavailable_reason() == "triton is not installed"
    finally:
        monkeypatch.undo()
        triton_backend._installed.cache_clear()


def test_auto_never_picks_the_interpreter(gen):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, gen)
    inputs = validate(q, k, v, ak.causal())
    assert dispatch.select(inputs, "auto").NAME != "triton"
    assert dispatch.select(inputs, "triton").NAME == "triton"
    assert dispatch.PRIORITY.index("triton") < dispatch.PRIORITY.index("torch")


def test_auto_leaves_plain_and_causal_to_torch(gen):
    """On CUDA, auto hands no-mask and top-left-causal inputs to torch's fused SDPA (measured
    faster) unless torch cannot run them; structured masks stay with triton."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, gen)
    assert triton_backend.torch_is_faster(validate(q, k, v, None))
    assert triton_backend.torch_is_faster(validate(q, k, v, ak.causal()))
    assert not triton_backend.torch_is_faster(validate(q, k, v, ak.causal("bottom_right") & ak.sliding_window(3)))
    assert not triton_backend.torch_is_faster(validate(q, k, v, ak.documents(torch.arange(8) // 4)))
    assert not triton_backend.torch_is_faster(validate(q, k, v, ak.causal(), dropout_p=0.5))


def test_no_keys_at_all(gen):
    """Tk = 0: every row is fully masked (3-D inputs: 4-D ones with Tk = 0 trip a reshape in
    ``inputs.validate``, reported separately)."""
    q = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    k = torch.zeros(2, 0, 16, requires_grad=True)
    r = ak.attention(q, k, k, backend="triton", return_lse=True)
    assert r.out.shape == (2, 5, 16) and (r.out == 0).all() and torch.isneginf(r.lse).all()
    r.out.sum().backward()
    assert (q.grad == 0).all()


# ---- the GPU benchmark's pipeline, end to end at toy sizes ---------------------------------------------

@pytest.fixture
def bench(monkeypatch):
    """``benchmarks/gpu.py`` as a module, with ``launch.CONFIGS`` restored afterwards."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends src/ to it
    spec.loader.exec_module(module)
    monkeypatch.setattr(launch, "CONFIGS", {name: {bucket: list(candidates) for bucket, candidates
                                                   in buckets.items()}
                                            for name, buckets in launch.CONFIGS.items()})
    return module


def test_benchmark_masks_pick_the_workloads(bench):
    """``--masks`` keeps the workloads of the masks named, in the script's order; an unknown
    name stops the run before anything is timed."""
    args = bench.parse_args(["--masks", "dense,window", "--dims", "64,128", "--lengths", "1024,4096"])
    assert [(w.mask, w.d, w.n) for w in bench.workloads(args)] == [
        ("window", 64, 8192), ("dense", 64, 1024), ("dense", 64, 4096),
        ("window", 128, 8192), ("dense", 128, 1024), ("dense", 128, 4096)]
    with pytest.raises(SystemExit, match="unknown"):
        bench.workloads(bench.parse_args(["--masks", "docs"]))


def test_benchmark_warm_parts(bench, monkeypatch):
    """``--warm-parts n``: n workers per (mask, head dim), each told its part; a candidate
    failing in one part drops it and reruns every part of that job (the drop shifts the
    candidates' indices between parts); a part failing for good keeps its whole job out."""
    bad = ["attn_fwd", 128, list(launch.CONFIGS["attn_fwd"][128][4])]
    crashed = f"{bench.TRACE}{json.dumps(bad)}\nCUDA error: illegal address"
    calls = []

    def run(jobs):
        calls.append(jobs)
        out = {}
        for label, argv in jobs.items():
            dropped = json.loads(argv[argv.index("--drop-configs") + 1])
            if label == "causal D128 part 2/3":
                out[label] = (0, "") if dropped == [bad] else (1, crashed)
            elif label == "window D128 part 3/3":
                out[label] = (1, "ImportError: boom")
            else:
                out[label] = (0, "")
        return out

    todo = [bench.Workload("causal", 1024, 128, 2, 16, 1024), bench.Workload("window", 8192, 128, 2, 16, 1024)]
    warmed = bench.warm(todo, bench.parse_args(["--warm-parts", "3"]), run=run)
    assert sorted(calls[0]) == sorted(f"{mask} D128 part {p}/3" for mask in ("causal", "window") for p in (1, 2, 3))
    assert [argv[argv.index("--warm-part") + 1] for argv in calls[0].values()] == ["0/3", "1/3", "2/3"] * 2
    assert warmed.dropped == [bad] and sorted(calls[1]) == [f"causal D128 part {p}/3" for p in (1, 2, 3)]
    assert list(warmed.broken) == ["window D128"] and warmed.skips("window D128")
    assert not warmed.skips("causal D128")
    # by default as many parts as the CPUs allow, at least 1, at most WARM_MAX_PARTS
    for cpus, parts in ((16, 4), (6, 3), (1, 1), (None, 1)):
        monkeypatch.setattr(bench.os, "cpu_count", lambda: cpus)
        calls.clear()
        bench.warm(todo, bench.parse_args([]), run=lambda jobs: calls.append(jobs) or
                   {label: (0, "") for label in jobs})
        assert len(calls[0]) == 2 * parts, cpus


def test_benchmark_budget_times_the_first_workload(tmp_path, capsys, bench):
    """``--budget`` counts from the start, warm step and checks included; a budget spent
    before any timing still times the first workload, and only that one."""
    assert bench.main(["--dry-run", "--budget", "0", "--masks", "causal,dense", "--competitors",
                       "attnkit-triton", "--profile", "none", "--out", str(tmp_path)]) == 0
    assert "over the --budget, not timed: dense" in capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    assert {(r["workload"], r["mode"]) for r in saved["results"]} == {("causal", "fwd"), ("causal", "fwd+bwd")}


def test_benchmark_dry_run(tmp_path, capsys, bench):
    """``benchmarks/gpu.py --dry-run``: the whole pipeline (checks, every competitor that runs on
    CPU, table, JSON) at toy sizes through the interpreter, in this process (its triton is
    already in interpreter mode, and the imports are paid)."""
    start = time.perf_counter()
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_bench_dry_run.json").read_text())
    # each mask once through each backward
    assert all(check["ok"] for check in saved["checks"]) and len(saved["checks"]) == 8
    assert sum("(stored dS)" in check["workload"] for check in saved["checks"]) == 4
    for backend in ("attnkit-triton", "attnkit-kernels"):  # the kernels alone: both modes too
        ours = [r for r in saved["results"] if r["backend"] == backend]
        assert len(ours) == 8 and all(r["tflops"] and r["tflops"] > 0 for r in ours)
    stored = [r for r in saved["results"] if r["backend"] == "attnkit-stored" and r["tflops"]]
    assert {(r["workload"], r["mode"]) for r in stored} == {
        (w, m) for w in ("window16", "docs16&causal", "causal", "dense") for m in ("fwd", "fwd+bwd")}
    assert "stored vs best" in printed
    assert "TFLOP/s" in printed and "docs16&causal" in printed
    assert time.perf_counter() - start < 180  # 25-40 s here: catches a run that compiles or
    # times far more than toy sizes, not a slow machine
    # one forward+backward under torch.profiler per workload (host operators on CPU)
    assert set(saved["info"]["kernel_profile"]) == {"window16 D32 N64", "docs16&causal D32 N64",
                                                    "causal D32 N64", "dense D32 N64"}
    ours = saved["info"]["kernel_profile"]["causal D32 N64"]["attnkit-triton"]
    assert ours and all(row["us"] > 0 and row["calls"] >= 1 for row in ours.values())
    assert saved["info"]["kernel_profile"]["window16 D32 N64"]["attnkit-stored"]
    assert "torch.profiler" in printed
    facts = {"grid": [8, 32, 1], "block": [256, 1, 1], "registers per thread": 255,
             "shared memory": 98304, "blocks per SM": 1, "est. achieved occupancy %": 12}
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 800.0, "args": facts},
        {"cat": "kernel", "name": "attn_bwd_dkdv", "dur": 10.0, "args": {}},
        {"cat": "kernel", "name": "attn_fwd", "dur": 400.0, "args": {}},
        {"cat": "gpu_memset", "name": "Memset (Device)", "dur": 2.0},
        {"cat": "cpu_op", "name": "aten::empty", "dur": 12.0}, {"name": "no category"}]}
    assert bench.kernel_times(trace, on_device=True) == {
        "attn_bwd_dkdv": {"us": 810.0, "calls": 2, "grid": [8, 32, 1], "block": [256, 1, 1],
                          "regs": 255, "smem": 98304, "blocks_per_sm": 1, "occupancy_pct": 12},
        "attn_fwd": {"us": 400.0, "calls": 1}, "Memset (Device)": {"us": 2.0, "calls": 1}}
    assert bench.kernel_times(trace, on_device=False) == {"aten::empty": {"us": 12.0, "calls": 1}}
    # each walk family's best autotuning time (the GPU run's answer to which walks pay)
    ms = {"128x128 w8 s2 partial_first": 0.30, "128x128 w8 s2 full_first": 0.29,
          "128x64 w8 s3 partial_first+flat": 0.31, "128x128 w8 s2 one_loop": 0.27,
          "128x128 w8 s2 partial_first+lpt": 0.28, "32x128 w8 s2 full_first+flat+lpt": 0.26,
          "128x128 w8 s2 one_loop+tma": 0.25}
    assert bench.walk_families(ms) == {"split": 0.29, "flat": 0.31, "one_loop": 0.27, "lpt": 0.26,
                                       "tma": 0.25}
    assert all(any(member(walk) for member in bench.WALK_FAMILIES.values()) for walk in launch.WALKS)
    # candidates never within 5 % of a tuning's fastest, per kernel and head dim
    tuned = {"window D128 N8192": {"attn_fwd": {"ms": {"a": 1.0, "b": 1.04, "c": 1.2, "d": None}},
                                   "attn_bwd_dq": {"ms": {"a": 2.0, "b": 2.0}}},
             "causal D128 N1024": {"attn_fwd": {"ms": {"a": 0.5, "c": 0.6, "e": 0.49}}},
             "causal D64 N1024": {"attn_fwd": {"ms": {"a": 0.3, "c": 0.3}}}}
    assert bench.losing_candidates(tuned) == {"attn_fwd D128": ["c"]}
    assert bench.losing_candidates(tuned, slack=1.01) == {"attn_fwd D128": ["b", "c"]}
    # --compile-only's loop sizes: instructions from a label to the branch back to it
    sass = "\n".join(["        /*0000*/   MOV R1, c[0x0][0x28] ;", ".L_x_1:",
                      *[f"        /*{16 * i:04x}*/   FFMA R2, R3, R4, R2 ;" for i in range(24)],
                      "        /*0190*/   @P0 BRA `(.L_x_1) ;", ".L_x_2:",
                      "        /*01a0*/   NOP ;", "        /*01b0*/   @!P1 BRA `(.L_x_2) ;",
                      "        /*01c0*/   BRA `(.L_x_3) ;", ".L_x_3:", "        /*01d0*/   EXIT ;"])
    assert bench.loop_sizes(sass) == [25] and bench.loop_sizes(sass, smallest=1) == [25, 2]
    # rows where the GPU waited on the Python: the whole call over 1.05x its kernels alone
    def row(backend, ms):
        return bench.Result("causal", 128, 1024, 16, 16, "fwd+bwd", backend, ms=ms)
    keyed = {("causal", 128, 1024, "fwd+bwd"): {"attnkit-triton": row("attnkit-triton", 1.34),
                                                "attnkit-kernels": row("attnkit-kernels", 1.06)},
             ("causal", 128, 4096, "fwd+bwd"): {"attnkit-triton": row("attnkit-triton", 3.07),
                                                "attnkit-kernels": row("attnkit-kernels", 3.01)},
             ("dense", 128, 1024, "fwd"): {"attnkit-triton": row("attnkit-triton", 0.4)}}
    assert bench.host_bound(keyed) == ["causal D128 N1024 fwd+bwd +0.280 ms"]
    # --exclude-walks: a walk that fails on some machine can be left out of a run
    assert bench.exclude_walks("tma, one_loop")
    walks = {c[4] for buckets in launch.CONFIGS.values() for cs in buckets.values() for c in cs}
    assert walks and not any("tma" in w or w.startswith("one_loop") for w in walks)


def test_benchmark_config_timings_tell_the_dkdv_variants_apart(bench, monkeypatch):
    """The plain and the dS-storing dK/dV share one autotuner; a tuning whose key has the
    stored-dS bit (30 of ``TUNE_KEY``) is reported as ``attn_bwd_dkdv+ds``."""
    import triton

    config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, **launch.WALKS[launch.F_FLAT]},
                           num_warps=8, num_stages=2)
    for stored, label in ((False, "attn_bwd_dkdv"), (True, "attn_bwd_dkdv+ds")):
        tuner = SimpleNamespace(cache={(128, 128, 5 | stored << 30, "bf16"): config},
                                configs_timings={config: [0.5, 0.4, 0.6]})
        monkeypatch.setattr(launch, "_TUNED", {"attn_bwd_dkdv": tuner})
        assert bench.config_timings() == {label: {"key": str((128, 128, 5 | stored << 30)),
                                                  "ms": {"32x128 w8 s2 full_first+flat": 0.5}}}


def test_benchmark_warm_isolates_failures(bench, capsys, monkeypatch):
    """The warm step finds a candidate that fails in a worker from the worker's launch trace,
    drops it (here and in the rerun's workers) and reruns the job; a job failing outside a
    launch, or a mask kind's, is kept out of the timed process (one crash there would end its
    CUDA context) and reported as a failed check instead."""
    # the trace: the launch running when the worker died is the last one without an "ok"
    real_launch = launch.Call._launch

    def sabotaged(self, *args, **options):
        if self.name == "attn_bwd_dq":
            raise RuntimeError("illegal memory access (sabotaged)")
        real_launch(self, *args, **options)

    monkeypatch.setattr(launch.Call, "_launch", sabotaged)
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    with bench.traced_launches(), pytest.raises(RuntimeError, match="sabotaged"):
        ak.attention(q, q, q, mask=ak.causal(), backend="triton").sum().backward()
    assert launch.Call._launch is sabotaged  # the tracer is undone
    trace = capsys.readouterr().out
    assert trace.count(bench.TRACE + "ok") == 1  # the forward ran; dQ runs before dK/dV
    assert bench.culprit(trace) == ["attn_bwd_dq", 64, [32, 32, None, None, "partial_first"]]
    assert bench.culprit(trace + bench.TRACE + "ok\nTraceback ...") is None
    assert bench.culprit(trace + bench.TRACE + "ok\n" + bench.TRACE + "direct\nCUDA error") is None
    assert bench.culprit("ImportError: no triton") is None

    # the warm loop, with fake workers
    bad = list(launch.CONFIGS["attn_fwd"][128][4])
    assert bad[4] == "partial_first+tma"
    calls = []

    def run(jobs):
        calls.append(jobs)
        crashed = f"{bench.TRACE}{json.dumps(['attn_fwd', 128, bad])}\nCUDA error: illegal address"
        out = {}
        for label, argv in jobs.items():
            dropped = json.loads(argv[argv.index("--drop-configs") + 1])
            if label == "causal D128":
                out[label] = (0, "") if [["attn_fwd", 128, bad]] == dropped else (1, crashed)
            elif label in ("window D128", "kind causal bf16"):
                out[label] = (1, crashed if label.startswith("kind") else "ImportError: boom")
            elif label == "kind window37 bf16":  # slow compiles, killed: neither dropped nor failed
                out[label] = (bench.TIMED_OUT, crashed)
            elif label == "documents&causal D128":  # every candidate passed, then direct launches failed
                out[label] = (1, f"{bench.TRACE}ok\n{bench.TRACE}direct\nCUDA error")
            else:
                out[label] = (0, "")
        return out

    todo = [bench.Workload("causal", 1024, 128, 2, 16, 1024), bench.Workload("window", 8192, 128, 2, 16, 1024),
            bench.Workload("documents&causal", 8192, 128, 2, 16, 1024)]
    warmed = bench.warm(todo, bench.parse_args(["--check-kinds", "--warm-parts", "1"]), run=run)
    assert warmed.dropped == [["attn_fwd", 128, bad]] and tuple(bad) not in launch.CONFIGS["attn_fwd"][128]
    assert sorted(warmed.broken) == ["kind causal bf16", "window D128"]
    assert len(calls) == 2 and list(calls[1]) == ["causal D128"]
    # 3 workload jobs; 11 kinds in bf16, 3 in fp16, 11 in bf16 through the stored-dS backward
    assert "kind documents bf16 stored_ds" in calls[0] and len(calls[0]) == 3 + 11 + 3 + 11
    assert warmed.direct_failed and "documents&causal D128" not in warmed.broken
    printed = capsys.readouterr().out
    assert "candidate dropped, job rerun" in printed and "left out of this run" in printed
    assert "kind window37 bf16: still running" in printed

    # what failed in a worker is a failed check in the timed process, not run there
    rows = bench.check_kinds(torch.bfloat16, torch.device("cpu"), ("causal",), warmed)
    assert rows == [{"case": "causal", "ok": False, "exception": rows[0]["exception"]}]
    assert "warm worker failed" in rows[0]["exception"]
    every = bench.Warmed(broken={bench.warm_label(mask, d): "" for mask, d in bench.config_checks(todo)})
    rows = bench.check_configs(todo, torch.bfloat16, torch.device("cpu"), every)
    assert len(rows) == len(bench.config_checks(todo)) and not any(row["ok"] for row in rows)
