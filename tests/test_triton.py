"""``backend="triton"`` through the Triton interpreter, on CPU tensors: the kernels' numerics.

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
``TRITON_INTERPRET=1 pytest tests/test_triton.py`` there; ``tests/test_gpu.py`` checks the GPU).
``tests/test_triton_launch.py`` and ``tests/test_gpu_bench.py`` start the same way.

What is tested here: forward, LSE and both backwards (recomputing, and storing dS) for every
mask kind, GQA, dtypes, head dims and walks of the block lists; memory safety (inputs inside
NaN-poisoned buffers, blocks that must never be read) and determinism; the backend's refusals
and dispatch. The launch machinery (plans, layouts and their caches, block lists, autotuning,
direct launches) is tested in ``tests/test_triton_launch.py``; ``benchmarks/gpu.py`` in
``tests/test_gpu_bench.py``.

Every check compares against float64 math (``conftest.attention_math``, NaN-safe so its
gradients exist on fully masked rows; ``conftest.check`` runs the comparison) with hand-built
dense masks from ``conftest``, by the rule error ≤ 2 × (error of the same math in the input
dtype) + ``conftest.error_floor``. Sizes are small (T ≤ 80): the interpreter costs tens of ms
per block operation.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


from conftest import import_triton_interpreted, skip_module_unless_interpreted  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.backends.triton import backend as triton_backend  # noqa: E402
from attnkit.backends.triton import TritonBackend, launch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402

from conftest import (assert_within_2x, attention_math, check, dense_band, dense_causal,  # noqa: E402
                      dense_documents, dense_padding, make_qkv, sorted_ids, walk_options)

skip_module_unless_interpreted(launch, __file__)

NAN = float("nan")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Opt in to the interpreter for this test only (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_only_finite_fills_average_as_other_backends(dtype, gen):
    """A bias row of only ``finfo.min`` (transformers' padding under causal) is added as any
    bias: the uniform average, as the reference gives, not a row with no key (the fill scaled
    to base 2 would overflow to −inf)."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, 16, dtype, gen)
    fill = torch.finfo(dtype).min
    bias = torch.zeros(1, 1, 20, 20, dtype=dtype).masked_fill(~dense_causal(20, 20), fill)
    bias[..., :3, :] = fill  # three rows of only fills
    got = ak.attention(q, k, v, ak.bias(bias), backend="triton", return_lse=True)
    want = ak.attention(q, k, v, ak.bias(bias), backend="reference", return_lse=True)
    uniform = v.float().mean(-2, keepdim=True).expand(1, 2, 3, 16)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(want.out[:, :, :3].float(), uniform, atol=atol)
    assert torch.allclose(got.out.float(), want.out.float(), atol=atol)
    assert torch.isfinite(got.lse).all() and (got.lse[:, :, :3] < -1e38).all()


def test_a_bias_written_between_forward_and_backward_is_refused(gen):
    """The kernels read the caller's bias again in the backward: a write after the forward
    raises rather than giving the gradients of another bias."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 20, 20, 16, 16, torch.float32, gen))
    values = torch.randn(1, 1, 20, 20, generator=gen)
    out = ak.attention(q, k, v, ak.bias(values), backend="triton")
    values.fill_(0)
    with pytest.raises(RuntimeError, match="written in place between the forward and the backward"):
        out.sum().backward()


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


def test_a_batched_backward_is_refused_by_name(gen):
    """A backward with batched gradients (``is_grads_batched=True``, what
    ``jacobian(vectorize=True)`` runs) cannot launch the kernels: refused with the remedy."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 1, 4, 4, 16, 16, torch.float32, gen))
    out = ak.attention(q, k, v, ak.causal(), backend="triton")
    eye = torch.eye(out.numel()).view(-1, *out.shape)
    with pytest.raises(RuntimeError, match="batched backward.*triton.*backend='tiled'"):
        torch.autograd.grad(out, q, eye, is_grads_batched=True)


@pytest.mark.parametrize("tiles", [
    launch.Tiles(sparse_q=32, sparse_k=32, fwd=(16, 16), dkdv=(16, 16), dq=(16, 16)),
    launch.Tiles(sparse_q=32, sparse_k=32, fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)),
], ids=["square_subtiles", "rectangular_subtiles"])
def test_kernel_blocks_inside_sparse_blocks(tiles, gen):
    """On a GPU, autotuned kernel blocks walk sub-tiles of the 128×128 sparse blocks; the same
    loops run here with 16-wide kernel blocks inside 32-wide sparse blocks."""
    mask, allowed = _docs(gen, 53, 3, causal=True)
    q, k, v = make_qkv(1, 2, 1, 53, 53, 32, 16, torch.float32, gen)
    check(q, k, v, mask, allowed, gen=gen, options=launch.TritonOptions(tiles=tiles))


@pytest.mark.parametrize("walk", sorted(launch.WALKS))
@pytest.mark.parametrize("case", ["docs&causal", "window&padding", "bias", "causal"])
def test_every_walk_of_the_block_lists(walk, case, gen):
    """Each walk the autotuner may pick (a PARTIAL loop then a FULL one, or one loop; loads by
    pointers or TMA) gives the same attention, on rows mixing PARTIAL and FULL blocks, with two
    kernel blocks per sparse block. At 76 positions every tensor, the LSE too (76 a multiple of
    4), is TMA-eligible for the ``+tma`` walks. GQA 2/1, so the dK/dV programs walk two heads'
    lists."""
    options = walk_options(walk, sparse=32, block=16)
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
    check(q, k, v, mask, allowed, bias, gen=gen, options=options)


LOOPS = ["flat", "one_loop"]  # the walks' distinct loops


@pytest.mark.parametrize("walk", LOOPS)
@pytest.mark.parametrize("case", ["docs&causal", "window"])
def test_evenly_spaced_blocks(walk, case, gen):
    """Rows whose FULL blocks are consecutive, several per row, and whose PARTIAL blocks are
    evenly spaced (documents under causal: a document's first block and the diagonal; a
    window: its far edge and the diagonal, FULL blocks between), on lengths that are whole
    sparse blocks: every walk computes the positions (``PARTIAL_STRIDED``,
    ``FULL_STRIDED``; the one-loop walk switches between the two progressions). Kernel
    blocks inside sparse ones walk them in the other walk tests (causal rows)."""
    options = walk_options(walk, sparse=32, block=32)
    if case == "window":
        mask, allowed = ak.sliding_window(100), dense_band(128, 128, 100, 0)
    else:
        ids = torch.tensor([0] * 20 + [1] * 108)
        mask, allowed = ak.documents(ids) & ak.causal(), dense_documents(ids) & dense_causal(128, 128)
    q, k, v = make_qkv(1, 1, 1, 128, 128, 16, 16, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, mask), options)
    for lists in (plan.rows, plan.cols):
        assert lists.full_strided and lists.partial_strided
    assert int(plan.rows.num_full.max()) >= 2 and int(plan.rows.num_partial.max()) == 2
    check(q, k, v, mask, allowed, gen=gen, options=options)


@pytest.mark.parametrize("walk", LOOPS)
def test_unevenly_spaced_blocks(walk, gen):
    """FULL and PARTIAL blocks not evenly spaced (FULL: blocks 0, 1 and 3 of most rows and
    columns; PARTIAL: 2, 4, 5 and the ragged tail): the kernels load each position
    (``PARTIAL_STRIDED``, ``FULL_STRIDED`` off) in every walk."""
    options = walk_options(walk, sparse=16, block=16)
    allowed = torch.rand(108, 108, generator=gen) < 0.5
    for blocks in (slice(0, 32), slice(48, 64)):
        allowed[:, blocks] = True
        allowed[blocks, :] = True
    q, k, v = make_qkv(1, 2, 1, 108, 108, 16, 16, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.dense(allowed)), options)
    assert not (plan.rows.full_strided or plan.cols.full_strided or plan.rows.partial_strided
                or plan.cols.partial_strided)
    check(q, k, v, ak.dense(allowed), allowed, gen=gen, options=options)


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
    (``TritonOptions.backward``): forward and backward within the 2x rule of the float64 truth.
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
    options = launch.TritonOptions(walk=walk, backward=backward, tiles=launch.Tiles(
        tiles[0], tiles[0], (tiles[1], tiles[1]), (tiles[1], tiles[1]), (tiles[1], tiles[1])))
    q, k, v = make_qkv(batch, heads[0], heads[1], tq, tk, *dims, dtype, gen)
    check(q, k, v, mask, allowed, gen=gen, options=options)


# ---- the stored-dS backward (TritonOptions.backward) ---------------------------------------------

STORED = launch.TritonOptions(backward="stored_ds")


@pytest.fixture
def stored_ds(monkeypatch):
    """The stored-dS buffer starts NaN-filled, so a slot dQ reads that dK/dV never wrote shows
    up as NaN in dq; records the plans that allocated one."""
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
    check(q, k, v, mask, allowed, bias[0] if bias else None, gen=gen, options=STORED)
    assert stored_ds, "the stored-dS path did not run"


@pytest.mark.parametrize("walk", sorted(launch.WALKS))
def test_stored_ds_every_walk(walk, gen, monkeypatch, stored_ds):
    """dK/dV finds each tile's slot in every walk (two loops or one; TMA loads too), dS by TMA
    stores, with two kernel blocks per sparse block and a ragged tail whose last sub-block no
    dK/dV program writes (76 positions: every tensor TMA-eligible; no GQA, which turns the TMA
    loads off in dK/dV)."""
    options = walk_options(walk, sparse=32, block=16, backward="stored_ds")
    mask, allowed = _docs(gen, 76, 2, causal=True)
    q, k, v = make_qkv(1, 2, 2, 76, 76, 16, 16, torch.float32, gen)
    tma = []
    build = launch.dkdv_call

    def dkdv_call(*args, **kwargs):
        call = build(*args, **kwargs)
        tma.append((call.args["TMA_OK"], bool(call.args["stored"].BY_TMA)))
        return call
    monkeypatch.setattr(launch, "dkdv_call", dkdv_call)
    check(q, k, v, mask, allowed, gen=gen, options=options)
    assert tma == [(True, True)]  # TMA allowed for the walk's loads (used by +tma), dS by TMA


@pytest.mark.parametrize("walk", LOOPS)
def test_stored_ds_by_pointer_stores(walk, gen, stored_ds):
    """Without TMA (``tma=False``, as on a GPU before sm90) dS goes by pointer stores."""
    options = walk_options(walk, sparse=32, block=16, backward="stored_ds", tma=False)
    mask, allowed = _docs(gen, 70, 2, causal=True)
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16, 16, torch.float32, gen)
    check(q, k, v, mask, allowed, gen=gen, options=options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stored_ds_rectangular_subtiles_low_precision(dtype, gen, stored_ds):
    """dK/dV and dQ with different kernel blocks inside the sparse ones (each reads the slots
    in its own sub-tiles), dS stored in the input dtype, the LSE's gradient through the
    statistics kernel."""
    options = launch.TritonOptions(backward="stored_ds", tiles=launch.Tiles(
        sparse_q=32, sparse_k=32, fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)))
    mask = ak.sliding_window(20) & ak.padding(kv_lengths=[61])
    allowed = dense_band(76, 76, 20, 0) & dense_padding(76, 76, None, [61])
    q, k, v = make_qkv(1, 4, 2, 76, 76, 32, 32, dtype, gen)
    check(q, k, v, mask, allowed, gen=gen, lse_grad=True, options=options)


def test_stored_ds_matches_recompute(gen, monkeypatch):
    """Both backwards give the same gradients: dk and dv bit for bit (the same dK/dV kernel,
    storing or not), dq to float32 rounding (a sum of the same products in another order)."""
    mask = ak.documents(sorted_ids(64, 3, gen)) & ak.causal()
    q, k, v = make_qkv(2, 2, 2, 64, 64, 32, 32, torch.float32, gen)
    dout = torch.randn(2, 2, 64, 32, generator=gen)
    grads = {}
    for mode in ("recompute", "stored_ds"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = TritonBackend(launch.TritonOptions(backward=mode)).forward(validate(*leaves, mask)).out
        grads[mode] = torch.autograd.grad(out, leaves, dout)
    (dq, dk, dv), (dq_s, dk_s, dv_s) = grads["recompute"], grads["stored_ds"]
    assert torch.equal(dk, dk_s) and torch.equal(dv, dv_s)
    torch.testing.assert_close(dq_s, dq, rtol=1e-5, atol=1e-6)


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
@pytest.mark.parametrize("walk", ["flat+tma", "one_loop+tma"])
def test_tma_reads_nothing_past_the_ends(walk, heads_kv, gen):
    """``+tma`` walks describe K/V (forward, dQ) and Q/dO (dK/dV) per (batch, head) as
    ``[T, D]``: the copies must zero-fill rows past a ragged end (72 positions in 32-row blocks)
    and columns past a padded head dim (24 → 32), here NaN in memory, while the strides still
    let TMA describe the views. (With GQA, dK/dV loads by pointers: see ``launch.dkdv_call``.)"""
    options = walk_options(walk, sparse=32, block=32)
    q, k, v = (poisoned(t, extra=(0, 0, 24, 8)) for t in make_qkv(1, 2, heads_kv, 72, 72, 24, 24,
                                                                   torch.float32, gen))
    lse = torch.empty(1, 2, 72)  # as the forward makes it; 72 rows keep each head 16-byte aligned
    mask, allowed = _docs(gen, 72, 3, causal=True)
    plan = launch.make_plan(validate(q, k, v, mask), options)
    assert (launch._tma_ok(plan, k, v) and launch._tma_ok(plan, q, q, lse)
            and not launch._tma_ok(plan, poisoned(k)))
    check(q, k, v, mask, allowed, gen=gen, options=options)


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
    assert any("triton runs on CUDA GPUs" in r and "or set TRITON_INTERPRET=1 to run its kernels "
               "on the CPU interpreter for testing (not supported by triton)" in r
               for r in _reasons(q, k, v))

    monkeypatch.setattr(triton_backend, "INSTALLED", False)
    assert triton_backend.TritonBackend().unavailable_reason() == "triton is not installed"


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


# ---- decoding: the split-key kernel ------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 4, 2, 1, 70, 16), (1, 8, 2, 3, 100, 32), (2, 2, 2, 4, 33, 24),
                                   (1, 16, 1, 4, 90, 16)], ids=str)
@pytest.mark.parametrize("case", ["none", "causal", "lengths", "causal&lengths"])
@pytest.mark.parametrize("splits", [1, 3, None], ids=["one_chunk", "three_chunks", "auto"])
def test_decoding_steps(shape, case, splits, gen, monkeypatch):
    """Few queries against many keys (GQA up to 16:1, so up to 64 query rows a kv head) run the
    split-key kernel, one key chunk or several merged, with bottom-right causal and per-batch
    key lengths (one of them 0: output 0, LSE −inf): equal to float64 math."""
    batch, heads, heads_kv, q_len, kv_len, dim = shape
    q, k, v = make_qkv(batch, heads, heads_kv, q_len, kv_len, dim, dim, torch.float32, gen)
    lengths = [kv_len - 5, 0][:batch] if batch == 2 else [kv_len - 11]
    mask = {"none": None, "causal": ak.causal("bottom_right"), "lengths": ak.padding(kv_lengths=lengths),
            "causal&lengths": ak.causal("bottom_right") & ak.padding(kv_lengths=lengths)}[case]
    ran = []
    real = launch.decode
    monkeypatch.setattr(launch, "decode", lambda *a: ran.append(a) or real(*a))
    got = TritonBackend(launch.TritonOptions(decode_splits=splits)).forward(validate(q, k, v, mask))
    assert ran, "the split-key kernel did not run"
    truth = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference", return_lse=True)
    torch.testing.assert_close(got.out.double(), truth.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), truth.lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decoding_low_precision(dtype, gen):
    """bf16/fp16 steps in three chunks: within twice the error of plain math in the dtype."""
    q, k, v = make_qkv(2, 8, 2, 2, 130, 32, 32, dtype, gen)
    mask = ak.causal("bottom_right") & ak.padding(kv_lengths=[130, 77])
    allowed = dense_causal(2, 130, "bottom_right") & dense_padding(2, 130, None, [130, 77], batch=2)
    got = TritonBackend(launch.TritonOptions(decode_splits=3)).forward(validate(q, k, v, mask))
    scale = 1 / math.sqrt(32)
    truth = attention_math(q.double(), k.double(), v.double(), allowed, None, scale, torch.float64)
    plain = attention_math(q, k, v, allowed, None, scale, dtype)
    assert got.out.dtype == dtype
    assert_within_2x("out", got.out, truth[0], plain[0], dtype)
    assert_within_2x("lse", got.lse, truth[1], plain[1], dtype)


def test_decoding_only_without_gradients_and_for_few_rows(gen):
    """With gradients, other masks or more query rows, the block-sparse kernels run; on CUDA
    ``auto`` takes the split-key kernel for a decoding step (torch keeps the others)."""
    q, k, v = make_qkv(1, 4, 1, 2, 64, 16, 16, torch.float32, gen)
    assert launch.decode_form(validate(q, k, v)) == (None, False, None)
    assert launch.decode_form(validate(q.requires_grad_(), k, v)) is None
    assert launch.decode_form(validate(q.detach(), k, v, ak.sliding_window(8, align="bottom_right"))) is None
    many = make_qkv(1, 4, 1, 20, 64, 16, 16, torch.float32, gen)[0]  # 80 rows a kv head
    assert launch.decode_form(validate(many, k, v)) is None
    assert not triton_backend.torch_is_faster(validate(q.detach(), k, v))
    assert triton_backend.torch_is_faster(validate(many, k, v))


@pytest.mark.parametrize("case", ["ragged_cache", "left_padding", "causal_documents"])
def test_decoding_steps_with_per_query_key_runs(case, gen):
    """Masks whose every query sees one run of keys (a ragged cache's per-sequence causal mask,
    left padding, causal documents) reach the split-key kernel as ranges."""
    from attnkit.nn import KVCache

    q, k, v = make_qkv(3, 4, 2, 3, 90, 16, 16, torch.float32, gen)
    if case == "ragged_cache":  # three sequences of 40, 87 and 10 tokens, then 3, 2 and 0 new
        cache = KVCache.empty().append(k[:, :, :87], v[:, :, :87], lengths=torch.tensor([40, 87, 10]))
        cache = cache.append(k[:, :, 87:], v[:, :, 87:], lengths=torch.tensor([3, 2, 0]))
        k, v, mask = cache.keys, cache.values, cache.mask()
    elif case == "left_padding":
        mask = ak.causal("bottom_right") & ak.padding(kv_starts=[0, 30, 89], kv_lengths=[90, 60, 1])
    else:
        ids = torch.arange(90) // 25
        mask = ak.documents(ids[-3:], ids, causal="bottom_right")
    inputs = validate(q, k, v, mask)
    assert launch.decode_form(inputs)[2] is not None
    got = TritonBackend(launch.TritonOptions(decode_splits=2)).forward(inputs)
    truth = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference", return_lse=True)
    torch.testing.assert_close(got.out.double(), truth.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), truth.lse, rtol=1e-5, atol=1e-5)


# ---- score modifiers --------------------------------------------------------------------------------

def _modified_math(q, k, v, mask, dtype):
    """out, lse of attention under ``mask`` (masks and score modifiers) in ``dtype``, the
    modifiers applied by their one definition (``Modifiers.apply``) on the whole score matrix,
    sinks joined; differentiable. A fully masked row has out 0 and LSE −inf (before sinks)."""
    inputs = validate(q, k, v, mask)
    space = inputs.space
    q, k, v = (t.to(dtype) for t in (inputs.q, inputs.k, inputs.v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * inputs.scale
    q_idx, kv_idx = torch.arange(space.q_len), torch.arange(space.kv_len)
    scores = inputs.modifiers.apply(scores, q_idx, kv_idx, space)
    if inputs.mask is not None:
        scores = scores.masked_fill(~inputs.mask.to_dense(space), float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    out, lse = weights @ v, torch.logsumexp(scores, -1)
    if inputs.modifiers.sinks is not None:
        out, lse, _ = inputs.modifiers.sinks.join(out, lse)
    return out, lse


MODIFIER_CASES = {
    # name: (dtype, build(slopes [H], table [H, 32], Tq, Tk) -> mask)
    "softcap&causal": (torch.float32, lambda s, t, tq, tk: ak.causal() & ak.softcap(3.0)),
    "alibi&causal_bottom_right": (torch.float32, lambda s, t, tq, tk: (
        ak.causal("bottom_right") & ak.alibi(s, align="bottom_right"))),
    "relative&documents": (torch.float32, lambda s, t, tq, tk: (
        ak.documents(torch.arange(tq) // 9, torch.arange(tk) // 16) & ak.relative_bias(t))),
    "alibi_per_batch&padding": (torch.float32, lambda s, t, tq, tk: (
        ak.padding(kv_lengths=[0, tk - 7]) & ak.alibi(torch.stack([s, s.flip(0)])))),
    "all&sinks&window": (torch.float32, lambda s, t, tq, tk: (
        ak.sliding_window(20, 3) & ak.softcap(3.0) & ak.alibi(s) & ak.relative_bias(t)
        & ak.sinks(torch.linspace(-1, 1, 4)))),
    "softcap&alibi_bf16": (torch.bfloat16, lambda s, t, tq, tk: ak.causal() & ak.softcap(3.0) & ak.alibi(s)),
}


@pytest.mark.parametrize("name", MODIFIER_CASES)
def test_score_modifiers(name, gen):
    """Softcap, ALiBi (both alignments, per head or per batch and head) and relative biases in
    the kernels, with masks, GQA, Tq ≠ Tk, an empty batch element and sinks: out, LSE, dq, dk,
    dv and the slopes' and table's gradients against float64 by the 2× rule."""
    dtype, build = MODIFIER_CASES[name]
    q, k, v = make_qkv(2, 4, 2, 40, 72, 16, 16, dtype, gen)
    q = q * 3  # scores large enough for the soft cap to bend them
    slopes = torch.rand(4, generator=gen, dtype=torch.float64) * 0.3
    table = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 4, 40, 16, generator=gen, dtype=torch.float64)
    dlse = torch.randn(2, 4, 40, generator=gen, dtype=torch.float64)

    def run(how, param_dtype):
        leaves = [t.detach().to(param_dtype if how != "triton" else dtype).requires_grad_()
                  for t in (q, k, v)]
        params = [t.to(param_dtype).requires_grad_() for t in (slopes, table)]
        mask = build(*params, 40, 72)
        if how == "triton":
            result = ak.attention(*leaves, mask, backend="triton", return_lse=True)
            out, lse = result.out, result.lse
        else:
            out, lse = _modified_math(*leaves, mask, param_dtype)
        finite = torch.isfinite(lse)
        loss = (out.double() * dout).sum() + torch.where(finite, lse.double(), 0.0).mul(dlse).sum()
        used = [t for t in (*leaves, *params)]
        grads = torch.autograd.grad(loss, used, allow_unused=True)
        return [out, lse, *(torch.zeros_like(t) if g is None else g for t, g in zip(used, grads))]

    got, truth, plain = run("triton", torch.float32), run("truth", torch.float64), run("plain", dtype)
    for label, x, t, p in zip(("out", "lse", "dq", "dk", "dv", "dslopes", "dtable"), got, truth, plain):
        assert not torch.isnan(x).any(), f"{label} has NaN"
        assert_within_2x(label, x.to(t.dtype) if label in ("dslopes", "dtable") else x, t, p.to(t.dtype)
                         if label in ("dslopes", "dtable") else p, dtype)


def test_modifiers_the_kernels_do_not_run_are_refused(gen):
    """Score functions and two ALiBi parts are stated as reasons (auto then runs tiled); the
    decoding kernel takes no modifier."""
    q, k, v = make_qkv(1, 2, 1, 2, 64, 16, 16, torch.float32, gen)
    function = ak.score_function(lambda s, b, h, i, j: s * 0.5)
    reasons = TritonBackend().not_supported_reasons(validate(q, k, v, ak.causal() & function))
    assert any("score_function (not supported by triton)" in r for r in reasons)
    twice = ak.alibi(torch.ones(2)) & ak.alibi(torch.ones(2))
    assert any("2 alibi modifiers" in r for r in TritonBackend().not_supported_reasons(validate(q, k, v, twice)))
    assert launch.decode_form(validate(q, k, v, ak.softcap(5.0))) is None
    assert launch.decode_form(validate(q, k, v, ak.sinks(torch.zeros(2)))) is not None


# ---- paged keys read through the block table ------------------------------------------------
@pytest.mark.parametrize("q_len", [1, 3, 40])
@pytest.mark.parametrize("case", ["none", "causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_decode_reads_blocks_by_table(q_len, case, dtype, gen, monkeypatch):
    """The split-key kernel over shuffled blocks of a NaN-filled pool (garbage past every
    sequence's blocks in the table, a sequence of no keys, GQA 4:1) equals float64 math on
    each sequence's own keys, within twice the error of plain math in the dtype; 40 queries
    (160 rows a kv head) run as a prefill, in blocks of rows."""
    from test_paged import _pools

    from attnkit import paged

    lengths = [37, 0, 130, 5]
    key_pool, value_pool, table, keys, values = _pools(lengths, 16, heads_kv=2, dk=32, dv=16)
    key_pool, value_pool = key_pool.to(dtype), value_pool.to(dtype)
    q = torch.randn(4, 8, q_len, 32, generator=gen).to(dtype)
    mask = {"none": None, "causal": ak.causal("bottom_right"),
            "window": ak.sliding_window(9, align="bottom_right")}[case]
    ran = []
    real = launch.paged_decode
    monkeypatch.setattr(launch, "paged_decode", lambda *a: ran.append(a) or real(*a))
    got = paged.paged_attention(q, key_pool, value_pool, table, lengths, mask=mask,
                                backend="triton", return_lse=True)
    assert ran, "the paged kernel did not run"
    runs = {}
    for how, dt in (("truth", torch.float64), ("plain", dtype)):
        outs, lses = [], []
        for b, n in enumerate(lengths):
            per = None if mask is None else (
                ak.causal("bottom_right") if case == "causal"
                else ak.sliding_window(9, align="bottom_right"))
            k, v = keys[b][None].to(dtype).to(dt), values[b][None].to(dtype).to(dt)  # as pooled
            if n == 0:
                outs.append(torch.zeros(1, 8, q_len, 16, dtype=dt))
                lses.append(torch.full((1, 8, q_len), float("-inf"), dtype=torch.float64))
                continue
            r = ak.attention(q[b:b + 1].to(dt), k, v, per, backend="reference", return_lse=True)
            outs.append(r.out)
            lses.append(r.lse.double())
        runs[how] = (torch.cat(outs), torch.cat(lses))
    assert_within_2x("out", got.out, runs["truth"][0], runs["plain"][0], dtype)
    seen = torch.isfinite(runs["truth"][1])
    torch.testing.assert_close(got.lse.double()[seen], runs["truth"][1][seen], rtol=1e-5,
                               atol=1e-5)
    assert (got.lse[~seen] == float("-inf")).all()


def test_paged_decode_of_an_empty_batch_is_empty(gen):
    from attnkit.paged import paged_attention
    pool = torch.randn(4, 4, 1, 16, generator=gen)
    q = torch.randn(0, 2, 1, 16)
    with torch.no_grad():
        r = paged_attention(q, pool, pool, torch.zeros(0, 2, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long), backend="triton", return_lse=True)
    assert r.out.shape == (0, 2, 1, 16) and r.lse.shape == (0, 2, 1)


def test_paged_decode_reads_a_forked_prompt_once(gen, monkeypatch):
    """Forks of two prompts: one extra launch per shared prompt whose queries are all of its
    forks', merged with each fork's own keys; equal to float64 math on the gathered keys,
    one token per step, then chunks of three and thirty."""
    from attnkit.nn import PagedKVCache

    cache = PagedKVCache(300, 16)
    prompt = torch.randn(2, 2, 300, 32, generator=gen)
    cache.append(prompt, prompt.flip(-1), lengths=[300, 100])
    cache.fork(0), cache.fork(0), cache.fork(1)
    launches = []
    real = launch.paged_decode
    monkeypatch.setattr(launch, "paged_decode", lambda *a: launches.append(a[0].shape) or real(*a))
    for width in (1, 1, 3, 30):
        new = torch.randn(cache.batch, 2, width, 32, generator=gen)
        cache.append(new, new * 2)
        q = torch.randn(cache.batch, 8, width, 32, generator=gen)
        launches.clear()
        got = cache.attend(q, backend="triton", return_lse=True)
        want = ak.attention(q.double(), cache.keys.double(), cache.values.double(),
                            cache.mask(), backend="reference", return_lse=True)
        torch.testing.assert_close(got.out.double(), want.out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.lse.double(), want.lse, rtol=1e-5, atol=1e-5)
        shared = sorted(shape[2] for shape in launches[1:])  # the prompts' launches: forks as queries
        assert shared == ([2, 3] if width == 1 else [])
