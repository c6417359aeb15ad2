"""``padding()`` with starts: left-padded and mixed left/right batches, and runs read from a 2-D
"real token" mask, on every backend against float64 attention over a hand-built allowed matrix.

The triton cases run through the Triton interpreter on CPU tensors, switched on the way
``test_triton.py`` does it (triton imported with ``TRITON_INTERPRET=1`` at collection on
machines without CUDA); they skip when triton is missing or runs compiled in this process.
"""

from __future__ import annotations

import pytest
import torch

from conftest import import_triton_interpreted, interpreted_triton_launch  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.backends import tiled  # noqa: E402
from attnkit.inputs import validate  # noqa: E402
from attnkit.masks import MaskSpace  # noqa: E402

from conftest import dense_band, dense_causal, naive_attention, usable_backends  # noqa: E402
from test_tiled import _assert_like_truth, _run  # noqa: E402

B, TQ, TK = 3, 13, 17


def runs_dense(tq, tk, q_runs, kv_runs):
    """``[B, 1, tq, tk]`` by loops: query i / key j of row b real when it lies in that row's
    ``(start, stop)`` run (``None``: every position real)."""
    batch = len(q_runs or kv_runs)
    out = torch.zeros(batch, 1, tq, tk, dtype=torch.bool)
    for b in range(batch):
        q0, q1 = (0, tq) if q_runs is None else q_runs[b]
        k0, k1 = (0, tk) if kv_runs is None else kv_runs[b]
        for i in range(tq):
            for j in range(tk):
                out[b, 0, i, j] = q0 <= i < q1 and k0 <= j < k1
    return out


def _row(start, stop, width):
    return [1 if start <= t < stop else 0 for t in range(width)]


def cases():
    """name → (mask, hand-built allowed ``[B, 1, TQ, TK]``)."""
    left_kv = [(5, TK), (0, TK), (TK - 4, TK)]
    left_q = [(3, TQ), (0, TQ), (TQ, TQ)]  # row 2: no real query at all
    mixed_q = [(2, 7), (0, TQ), (4, 4)]
    mixed_kv = [(1, 11), (6, TK), (0, TK)]
    kv_rows = [(4, TK), (0, 9), (0, 0)]  # left, right, no real key
    q_rows = [(2, TQ), (0, TQ), (0, 5)]
    generation = [(TK - 1 - 6, TK - 1), (0, TK - 1), (TK - 9, TK - 1)]
    return {
        "left_kv": (ak.padding(kv_starts=[s for s, _ in left_kv]), runs_dense(TQ, TK, None, left_kv)),
        "left_q_kv": (ak.padding(q_starts=[s for s, _ in left_q], kv_starts=[s for s, _ in left_kv]),
                      runs_dense(TQ, TK, left_q, left_kv)),
        "mixed": (ak.padding(q_lengths=[e - s for s, e in mixed_q], kv_lengths=[e - s for s, e in mixed_kv],
                             q_starts=[s for s, _ in mixed_q], kv_starts=[s for s, _ in mixed_kv]),
                  runs_dense(TQ, TK, mixed_q, mixed_kv)),
        "from_mask": (ak.padding(q_mask=torch.tensor([_row(s, e, TQ) for s, e in q_rows], dtype=torch.bool),
                                 kv_mask=torch.tensor([_row(s, e, TK) for s, e in kv_rows]),
                                 allow_empty_rows=True),
                      runs_dense(TQ, TK, q_rows, kv_rows)),
        "causal&left": (ak.causal() & ak.padding(q_starts=[s for s, _ in left_q],
                                                 kv_starts=[s for s, _ in left_kv]),
                        dense_causal(TQ, TK) & runs_dense(TQ, TK, left_q, left_kv)),
        "causal_br&generation": (ak.causal("bottom_right") & ak.padding(
            kv_starts=[s for s, _ in generation], kv_lengths=[e - s for s, e in generation]),
            dense_causal(TQ, TK, "bottom_right") & runs_dense(TQ, TK, None, generation)),
        "window&mixed": (ak.sliding_window(4, 2) & ak.padding(
            q_lengths=[e - s for s, e in mixed_q], q_starts=[s for s, _ in mixed_q],
            kv_starts=[s for s, _ in mixed_kv], kv_lengths=[e - s for s, e in mixed_kv]),
            dense_band(TQ, TK, 4, 2) & runs_dense(TQ, TK, mixed_q, mixed_kv)),
        "documents&left": (ak.documents([0] * 6 + [1] * 7, [0] * 8 + [1] * 9)
                           & ak.padding(kv_starts=[s for s, _ in left_kv]),
                           _docs(TQ, TK) & runs_dense(TQ, TK, None, left_kv)),
    }


def _docs(tq, tk):
    q_ids, kv_ids = [0] * 6 + [1] * 7, [0] * 8 + [1] * 9
    return torch.tensor([[q_ids[i] == kv_ids[j] for j in range(tk)] for i in range(tq)])[None, None]


CASE_NAMES = list(cases())


def _qkv(dtype=torch.float64, heads=4, heads_kv=2, d=8):
    g = torch.Generator().manual_seed(5)
    shapes = ((B, heads, TQ, d), (B, heads_kv, TK, d), (B, heads_kv, TK, d))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _assert_exact_empty_rows(out, lse, allowed):
    empty = ~allowed.expand(B, out.shape[1], TQ, TK).any(-1)  # [B, H, Tq]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()


def test_cases_have_fully_masked_rows():
    """Every case but left_kv (no query padding) has left-padded or empty query rows."""
    assert all((~allowed.any(-1)).any() for name, (_, allowed) in cases().items() if name != "left_kv")


def test_mask_dense_equals_hand_built():
    space = MaskSpace(batch=B, heads=2, q_len=TQ, kv_len=TK)
    for name, (mask, allowed) in cases().items():
        got = mask.to_dense(space).expand(B, 2, TQ, TK)
        assert torch.equal(got, allowed.expand(B, 2, TQ, TK)), name


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "auto"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_backends_against_float64(backend, name):
    if backend not in usable_backends() and backend != "auto":
        pytest.skip(f"{backend} is not usable here")
    mask, allowed = cases()[name]
    q, k, v = _qkv()
    result = ak.attention(q, k, v, mask, backend=backend, return_lse=True)
    out, lse, _ = naive_attention(q, k, v, allowed, None, None)
    assert torch.allclose(result.out, out, atol=1e-10, rtol=0), name
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(result.lse), finite), name
    assert torch.allclose(result.lse[finite], lse[finite], atol=1e-10, rtol=0), name
    _assert_exact_empty_rows(result.out, result.lse, allowed)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_tiled_small_blocks_forward_backward(fused, name):
    """Many 8×4 tiles (EMPTY, FULL and PARTIAL ones), both tile primitives, with gradients."""
    mask, allowed = cases()[name]
    q, k, v = _qkv(torch.float32)
    result = _run(q, k, v, mask, 0.4, block_q=8, block_k=4,
                  options=tiled.TiledOptions(fused_tiles=fused))
    _assert_like_truth(result, q, k, v, allowed, None, 0.4, torch.float32)
    _assert_exact_empty_rows(result[0], result[1], allowed)


# ---- triton (interpreter) ------------------------------------------------------------------------



@pytest.mark.parametrize("name", ["left_q_kv", "mixed", "from_mask", "causal_br&generation",
                                  "window&mixed", "documents&left"])
def test_triton_left_padding(name, monkeypatch):
    launch = interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mask, allowed = cases()[name]
    q, k, v = _qkv(torch.float32)
    assert not dispatch.BACKENDS["triton"].not_supported_reasons(validate(q, k, v, mask))
    result = _run_triton(q, k, v, mask)
    _assert_like_truth(result, q, k, v, allowed, None, 0.4, torch.float32)
    _assert_exact_empty_rows(result[0], result[1], allowed)
    program = launch.compile_mask(mask, MaskSpace(B, 4, TQ, TK))
    assert program.allowed is None or name == "documents&left"  # no dense [B, H, Tq, Tk] view


def _run_triton(q, k, v, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    result = ak.attention(q, k, v, mask, scale=0.4, backend="triton", return_lse=True)
    out, lse = result.out, result.lse
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out * cot.to(out.dtype)).sum().backward()
    return out, lse, [t.grad for t in (q, k, v)]


def test_triton_program_for_starts():
    """Starts go into the kernels' range form exactly; zero starts keep the lengths form."""
    launch = interpreted_triton_launch()
    space = MaskSpace(2, 1, 5, 6)
    program = launch.compile_mask(ak.padding(q_lengths=[3, 5], kv_starts=[2, 0], kv_lengths=[4, 1]), space)
    assert program.doc_ranges and program.q_lengths is None and program.kv_lengths is None
    assert program.q_docs[0].tolist() == [[2, 6]] * 3 + [[0, 0]] * 2
    assert program.q_docs[1].tolist() == [[0, 1]] * 5
    assert program.kv_docs[0].tolist() == [[0, 0]] * 2 + [[0, 3]] * 4
    assert program.kv_docs[1].tolist() == [[0, 5]] + [[0, 0]] * 5
    plain = launch.compile_mask(ak.padding(q_lengths=[3, 5], kv_starts=[0, 0], kv_lengths=[4, 1]), space)
    assert plain.q_docs is None and plain.q_lengths.tolist() == [3, 5] and plain.kv_lengths.tolist() == [4, 1]


def test_real_keys_is_padding_for_one_run_per_row_else_dense():
    runs = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    holes = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    space = ak.masks.MaskSpace(2, 1, 3, 5)
    for real, kind in ((runs, type(ak.padding(kv_mask=runs))), (holes, type(ak.dense(holes)))):
        mask = ak.masks.real_keys(real)
        assert type(mask) is kind
        assert torch.equal(mask.to_dense(space), real[:, None, None, :].expand(2, 1, 3, 5))


def test_a_key_mask_read_into_padding_is_its_own_copy():
    """``padding(kv_mask=...)`` keeps the mask it read (its dense form and the guard use it):
    its dense form equals the element-wise evaluation, and writing the caller's tensor later
    changes neither."""
    real = torch.arange(10) >= torch.tensor([3, 0, 7])[:, None]  # left padding, [B, Tk]
    mask = ak.padding(kv_mask=real)
    space = MaskSpace(3, 2, 4, 10)
    dense = mask.to_dense(space).clone()
    evaluated = mask.tile(torch.arange(4), torch.arange(10), space)
    assert torch.equal(dense, evaluated.expand_as(dense))
    q = torch.randn(3, 2, 4, 8)
    before = ak.attention(q, q.repeat(1, 1, 3, 1)[:, :, :10], q.repeat(1, 1, 3, 1)[:, :, :10], mask)
    real.fill_(True)
    assert torch.equal(mask.to_dense(space), dense)
    after = ak.attention(q, q.repeat(1, 1, 3, 1)[:, :, :10], q.repeat(1, 1, 3, 1)[:, :, :10], mask)
    assert torch.equal(before, after)
