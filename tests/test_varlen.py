"""``ak.varlen_attention``: packed sequences ``[total, H, D]`` with ``cu_seqlens``, each sequence
against its own float64 truth (computed alone, on its own positions), forward, LSE and
gradients, by the 2× rule."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (assert_within_2x, dense_band, import_triton_interpreted,
                      interpreted_triton_launch, naive_attention, plain_attention)

import_triton_interpreted()  # before attnkit: the triton cases run interpreted on CPU

import attnkit as ak  # noqa: E402

F32, F64 = torch.float32, torch.float64


def _packed(lengths_q, lengths_k, heads=4, heads_kv=2, dk=8, dv=6, dtype=F32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, heads, dk, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(total_k, heads_kv, dk, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(total_k, heads_kv, dv, generator=gen, dtype=F64).to(dtype)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],  # noqa: E731
                                      dtype=torch.int32)
    return q, k, v, cu(lengths_q), cu(lengths_k)


def _band(kind: str, tq: int, tk: int) -> torch.Tensor:
    """The mask of one sequence alone, written out independently ``[tq, tk]``."""
    if kind == "none":
        return torch.ones(tq, tk, dtype=torch.bool)
    if kind == "causal":
        return dense_band(tq, tk, None, 0)
    if kind == "causal_br":
        return dense_band(tq, tk, None, 0, "bottom_right")
    if kind == "window":
        return dense_band(tq, tk, 3, 0)
    if kind == "window_both":
        return dense_band(tq, tk, 2, 1)
    if kind == "window_br":
        return dense_band(tq, tk, 3, 0, "bottom_right")
    raise ValueError(kind)


MASKS = {"none": None, "causal": ak.causal(), "causal_br": ak.causal("bottom_right"),
         "window": ak.sliding_window(3), "window_both": ak.sliding_window(2, 1),
         "window_br": ak.sliding_window(3, align="bottom_right")}


def _per_sequence(q, k, v, cu_q, cu_k, kind, dtype):
    """(out [total_q, Hq, Dv], lse [Hq, total_q]) of each sequence alone, concatenated:
    float64 truth, or plain math in ``dtype``."""
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        qs = q[a:b].transpose(0, 1)[None]  # [1, Hq, t, D]
        ks, vs = (x[c:d].transpose(0, 1)[None].repeat_interleave(group, 1) for x in (k, v))
        allowed = _band(kind, b - a, d - c)
        math_fn = naive_attention if dtype == F64 else plain_attention
        if d == c:  # no key: output 0, LSE −inf
            out = torch.zeros(1, q.shape[1], b - a, v.shape[-1], dtype=F64 if dtype == F64
                              else q.dtype)
            lse = torch.full((1, q.shape[1], b - a), -math.inf, dtype=out.dtype)
        else:
            out, lse, _ = math_fn(qs, ks, vs, allowed)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


CASES = {  # (query lengths, key lengths): equal segments, and queries shorter than keys
    "self": ([5, 1, 0, 9, 17], [5, 1, 0, 9, 17]),
    "decode": ([1, 3, 2, 1], [7, 0, 9, 33]),
}


@pytest.mark.parametrize("backend, dtype", [
    (backend, dtype) for backend in ("auto", "tiled", "reference", "triton")
    for dtype in (F32, F64) if backend != "triton" or dtype == F32], ids=str)
@pytest.mark.parametrize("case, kind", [(case, kind) for case in CASES for kind in MASKS])
def test_each_sequence_gets_what_it_gets_alone(case, kind, backend, dtype, monkeypatch):
    if backend == "triton":
        interpreted_triton_launch()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    lengths_q, lengths_k = CASES[case]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = ak.varlen_attention(*leaves, cu_q, cu_k, mask=MASKS[kind], backend=backend,
                                 return_lse=True)
    assert result.out.shape == (q.shape[0], q.shape[1], v.shape[-1])
    assert result.out.is_contiguous() and result.lse.shape == (q.shape[1], q.shape[0])
    truth_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_true, lse_true = _per_sequence(*truth_leaves, cu_q, cu_k, kind, F64)
    out_plain, lse_plain = _per_sequence(*plain_leaves, cu_q, cu_k, kind, dtype)
    assert_within_2x("out", result.out, out_true, out_plain, dtype)
    assert torch.equal(torch.isneginf(result.lse), torch.isneginf(lse_true))
    assert_within_2x("lse", result.lse, lse_true, lse_plain, dtype)

    dout = torch.randn(result.out.shape, generator=torch.Generator().manual_seed(5),
                       dtype=F64).to(dtype)
    got = torch.autograd.grad(result.out, leaves, dout)
    true = torch.autograd.grad((out_true * dout.double()).sum(), truth_leaves)
    plain = torch.autograd.grad((out_plain * dout).sum(), plain_leaves)
    for name, g, t, p in zip(("dq", "dk", "dv"), got, true, plain):
        assert_within_2x(name, g, t, p, dtype, floor=1e-5 if dtype == F32 else 0.0)


@pytest.mark.parametrize("modifier", ["softcap", "sinks", "alibi"])
def test_score_modifiers_apply_per_sequence(modifier):
    """Modifiers join the per-sequence mask; with equal segments ALiBi's relative positions
    inside a sequence are the packed row's."""
    lengths = [4, 7, 1, 6]
    q, k, v, cu, _ = _packed(lengths, lengths, dtype=F64)
    heads = q.shape[1]
    made = {"softcap": ak.softcap(2.0),
            "sinks": ak.sinks(torch.linspace(-1.0, 1.0, heads, dtype=F64)),
            "alibi": ak.alibi(torch.linspace(0.1, 0.8, heads, dtype=F64))}[modifier]
    mask = ak.causal() & made
    got = ak.varlen_attention(q, k, v, cu, mask=mask)
    want = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
        want.append(ak.attention(*alone, mask, backend="reference")[0].transpose(0, 1))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("modifier", ["alibi", "relative"])
@pytest.mark.parametrize("segments", ["decode", "seqused"])
def test_position_modifiers_on_differing_segments(modifier, segments):
    """ALiBi and relative biases where queries and keys differ per sequence (a chunk of new
    queries over each sequence's keys; a cache's filled part) read each sequence's own
    positions, bottom-right aligned: out, LSE and gradients equal each sequence alone."""
    lengths_q, lengths_k = [2, 1, 3, 0], [6, 1, 9, 4]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, dtype=F64)
    used = [5, 1, 9, 2] if segments == "seqused" else lengths_k
    heads = q.shape[1]
    bias = {"alibi": ak.alibi(torch.linspace(0.1, 0.8, heads, dtype=F64), align="bottom_right"),
            "relative": ak.relative_bias(torch.randn(heads, 19, dtype=F64),
                                         lambda rel: rel.clamp(-9, 9) + 9)}[modifier]
    mask = ak.causal("bottom_right") & bias
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = ak.varlen_attention(*leaves, cu_q, cu_k, mask=mask, return_lse=True,
                              seqused_k=used if segments == "seqused" else None)
    outs, lses = [], []
    for b, (qa, qb, ka, n) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                             cu_k[:-1].tolist(), used)):
        alone = [leaves[0][qa:qb], leaves[1][ka:ka + n], leaves[2][ka:ka + n]]
        r = ak.attention(*(x.transpose(0, 1)[None] for x in alone), mask, backend="reference",
                         return_lse=True)
        outs.append(r.out[0].transpose(0, 1))
        lses.append(r.lse[0])
    want_out, want_lse = torch.cat(outs), torch.cat(lses, 1)
    torch.testing.assert_close(got.out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-12, atol=1e-12)
    dout = torch.randn(got.out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    for g, w in zip(torch.autograd.grad(got.out, leaves, dout),
                    torch.autograd.grad(want_out, leaves, dout)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_seqused_k_counts_only_the_filled_keys():
    lengths_q, lengths_k, used = [1, 2, 1], [6, 5, 8], [3, 5, 0]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, dtype=F64)
    k_garbage = k.clone()
    for (c, d), n in zip(zip(cu_k[:-1].tolist(), cu_k[1:].tolist()), used):
        k_garbage[c + n:d] = float("nan")  # never read
    got = ak.varlen_attention(q, k_garbage, v, cu_q, cu_k, seqused_k=torch.tensor(used),
                              mask=ak.causal("bottom_right"), return_lse=True)
    trimmed_k = torch.cat([k[c:c + n] for c, n in zip(cu_k[:-1].tolist(), used)])
    trimmed_v = torch.cat([v[c:c + n] for c, n in zip(cu_k[:-1].tolist(), used)])
    cu_used = torch.tensor([0, *torch.tensor(used).cumsum(0).tolist()])
    want_out, want_lse = _per_sequence(q, trimmed_k, trimmed_v, cu_q, cu_used, "causal_br", F64)
    torch.testing.assert_close(got.out, want_out.to(got.out.dtype))
    torch.testing.assert_close(got.lse, want_lse.to(got.lse.dtype))
    assert (got.out[cu_q[2]:] == 0).all() and torch.isneginf(got.lse[:, cu_q[2]:]).all()


def test_views_of_a_fused_projection_run_as_they_are():
    """q, k, v as views of one [total, 3, H, D] projection (strided): the same result as
    contiguous copies, and gradients reach the fused tensor."""
    lengths = [3, 8, 5]
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, 8, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 3, 11, 16])
    out = ak.varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, mask=ak.causal())
    want = ak.varlen_attention(*(qkv[:, i].detach().contiguous() for i in range(3)), cu,
                               mask=ak.causal())
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def test_cu_seqlens_as_lists_and_defaults():
    q, k, v, cu, _ = _packed([2, 3], [2, 3])
    torch.testing.assert_close(ak.varlen_attention(q, k, v, [0, 2, 5]),
                               ak.varlen_attention(q, k, v, cu, cu, max_seqlen_q=3,
                                                   max_seqlen_k=3))


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v: ak.varlen_attention(q[None], k, v, [0, 2, 5]), ValueError, "3-D"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [1, 2, 5]), ValueError, "start at 0"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 4, 2, 5]), ValueError, "sequence 1"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 4]), ValueError, "end at"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, torch.tensor([0.0, 2, 5])), TypeError,
     "integers"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0.0, 2.5, 5.0]), TypeError, "integers"),
    (lambda q, k, v: ak.varlen_attention(q, k[:, :0], v[:, :0], [0, 2, 5]), ValueError,
     "Hkv ≥ 1"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], [0, 5]), ValueError,
     "same sequences"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], max_seqlen_q=2), ValueError,
     "sequence 1 holds 3"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], [0, 2, 5], seqused_k=[1, 4]),
     ValueError, "seqused_k[1] = 4"),
    (lambda q, k, v: ak.varlen_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(
        -1, 3, -1), [0, 2, 5]), ValueError, "multiple of Hkv"),
    (lambda q, k, v: ak.varlen_attention(q, k.double(), v.double(), [0, 2, 5]), TypeError,
     "one dtype and device"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], mask=ak.padding(kv_lengths=[2])),
     ValueError, "inside each sequence"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], [0, 2, 5], seqused_k=[2, 2],
                                         mask=ak.alibi(torch.ones(4)) & ak.score_function(
                                             lambda s, b, h, i, j: s)), ValueError,
     "score_function"),
    (lambda q, k, v: ak.varlen_attention(q, k, v, [0, 2, 5], mask=ak.causal() & ak.score_function(
        lambda s, b, h, i, j: s)), ValueError, "score_function"),
])
def test_bad_input_is_refused_by_name(call, error, words):
    q, k, v, _, _ = _packed([2, 3], [2, 3])
    with pytest.raises(error) as raised:
        call(q, k, v)
    assert words in str(raised.value)


@pytest.mark.parametrize("modifier, words", [
    (lambda: ak.alibi(torch.ones(2, 4)), "alibi slopes has shape (2, 4)"),
    (lambda: ak.sinks(torch.ones(3)), "sinks logits has shape (3,)"),
    (lambda: ak.relative_bias(torch.zeros(3, 9)), "relative_bias table has shape (3, 9)"),
])
def test_a_modifier_that_does_not_fit_names_the_packed_shapes(modifier, words):
    """The problem is told against the caller's packed q, k and v, not the [1, H, total, D]
    row they run as."""
    q, k, v, _, _ = _packed([2, 3], [2, 3])
    with pytest.raises(ValueError) as raised:
        ak.varlen_attention(q, k, v, [0, 2, 5], mask=modifier())
    message = str(raised.value)
    assert words in message and f"q {tuple(q.shape)}" in message
    assert "(1, 4" not in message and "[B, H]" not in message


@pytest.mark.parametrize("segments", ["invariant", "keys differ", "one packing"])
def test_a_bucket_function_is_checked_per_sequence(segments):
    """A relative-bias bucket function that covers each sequence's own offsets, not the
    packed row's, runs: each sequence is then a call of its own (as it is under the
    invariance contract or with other key segments)."""
    q, k, v, cu_q, cu_k = _packed([5, 8], [6, 8] if segments == "keys differ" else [5, 8],
                                  heads=2, heads_kv=2, dv=8)
    table = torch.randn(2, 15, generator=torch.Generator().manual_seed(1))
    align = "bottom_right" if segments == "keys differ" else "top_left"
    mask = ak.causal(align) & ak.relative_bias(table, buckets=lambda r: r + 7, align=align)
    got = ak.varlen_attention(q, k, v, cu_q, cu_k, mask=mask,
                              invariant=segments == "invariant")
    outs = []
    for (qa, qb), (ka, kb) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                  zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        q4, k4, v4 = (t[a:b].transpose(0, 1)[None].double()
                      for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        outs.append(ak.attention(q4, k4, v4, mask, backend="reference")[0].transpose(0, 1))
    torch.testing.assert_close(got.double(), torch.cat(outs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_refusal_below_says_how_the_packed_call_runs(invariant):
    q, k, v, _, _ = _packed([2, 3], [2, 3])
    with pytest.raises(ValueError) as raised:
        ak.varlen_attention(q, k, v, [0, 2, 5], dropout_p=0.5, backend="torch",
                            invariant=invariant)
    assert "dropout_p=0.5" in str(raised.value)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert f"packed q {tuple(q.shape)}" in notes and "[1, H, " in notes


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_sequence_gives_an_empty_lse_in_the_accumulation_dtype(invariant, dtype):
    q, k = torch.zeros(0, 4, 8, dtype=dtype), torch.zeros(0, 2, 8, dtype=dtype)
    result = ak.varlen_attention(q, k, k, [0], return_lse=True, invariant=invariant)
    assert result.out.shape == (0, 4, 8) and result.lse.shape == (4, 0)
    assert result.lse.dtype == dtype  # float32 and float64 accumulate in themselves


@pytest.mark.parametrize("seqused", [[3, 4], torch.tensor([3, 4])], ids=["list", "tensor"])
def test_a_shape_only_call_takes_real_seqused_k(seqused):
    """Meta q, k and v (a shape-only call) with ``seqused_k`` as a list or a CPU tensor: its
    values are read where they are, as the boundaries' are; on meta it is refused by name."""
    packed = torch.empty(16, 2, 8, device="meta")
    out = ak.varlen_attention(packed, packed, packed, [0, 5, 16], seqused_k=seqused)
    assert out.shape == (16, 2, 8) and out.device.type == "meta"
    with pytest.raises(ValueError, match="seqused_k must hold values"):
        ak.varlen_attention(packed, packed, packed, [0, 5, 16],
                            seqused_k=torch.tensor([3, 4], device="meta"))
